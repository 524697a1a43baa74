"""GeoFP8 as a DDP communication hook: a state object and a pure hook function.

A thin adapter: the step (consistency check, warm-up, routing, error feedback, finite
agreement, settling, state) is the :class:`~geofp8.engine.SyncEngine`'s. For a bucket
holding gradients ``G_p`` on rank ``r``, :func:`geofp8_hook` has the engine's pipeline
route ``G̃_p = G_p T_p`` on selected Linear weights, add ``R_p`` and encode, launches the
exact collective (:class:`~geofp8.comm.collective.Communicator`: per-rank scales honoured,
the sum in FP32), then maps back ``Ĝ_p = (Σ_r Ũ_{p,r} decoded) / N · T_p⁻¹`` into the
bucket. An FP32 bucket is the hook's working memory: ``Ũ`` is written over the gradients
and the mean decoded into it (a hook that needs the local gradients must copy them first).

Example::

    >>> from geofp8 import GeoFP8Config, GeoFP8State, geofp8_hook
    >>> state = GeoFP8State(model, GeoFP8Config(format="e4m3"))
    >>> ddp_model = DistributedDataParallel(model)
    >>> ddp_model.register_comm_hook(state, geofp8_hook)

A step begins with its first bucket and settles when the last bucket's result is ready —
before ``backward()`` returns, with no read back from the device. On CUDA each bucket's work
runs on a side stream (:mod:`geofp8.comm.streams`): ordered after its gradients, waiting
for its collectives there, and completing its future there (mapping back, the finite flag,
and at the last bucket the step's settling included), so backward's stream never waits for
the network and DDP's read of the bucket is ordered after it. A step whose gradient
was non-finite on any rank returns NaN for its buckets on every rank (the exact collective
poisons the whole bucket everywhere, so ``GradScaler`` or the caller skips it); its
statistics and selections are not kept and the residuals it wrote are reset to zero (on the
device: :mod:`geofp8.feedback`); it is counted in ``stats()["skipped_steps"]``. An exception
inside the hook, or in a bucket's collective after it (the communicator's ``on_failure``,
before the bucket's future fails), rolls the step back (its residuals reset likewise).
"""

# No `from __future__ import annotations`: DDP inspects the hooks' annotations at runtime.
import functools
import time

import torch
import torch.distributed as dist
from torch import nn

from .comm.collective import Communicator
from .comm.group import DeviceGroup
from .comm.layout import fp32_allreduce_wire_bytes
from .comm.stages import all_finite
from .comm.streams import SideStream
from .config import FP8Config, GeoFP8Config
from .engine import SyncEngine
from .geometry.transforms import IDENTITY
from .hierarchy import HierarchicalAllReduce, node_size
from .verdict import map_into

__all__ = [
    "FP8State",
    "GeoFP8State",
    "HadamardFP8State",
    "fp8_hook",
    "geofp8_hook",
    "hadamard_fp8_hook",
]

SUPPORTED_BACKENDS = ("gloo", "nccl")
_SIZE = ("elements", "bytes_fp32_equivalent")  # a bucket's figures per step (_Bucket.size)
_ENCODED = (*_SIZE, "codec_s")  # with its encode's host seconds (its map back's: transform_s)


class GeoFP8State:
    """State of :func:`geofp8_hook`: the :class:`~geofp8.engine.SyncEngine` and the
    collective that carries DDP's buckets.

    Args:
        model: the module that DDP wraps (its parameter objects are the buckets' ones).
        config: a :class:`GeoFP8Config`; identical on every rank (checked at the first step).
        process_group: the data-parallel group (default: the world).
        grad_scaler: the ``torch.amp.GradScaler`` of a loss-scaled run, if any. Gradients
            arrive multiplied by its scale, and so do the error-feedback residuals; when the
            scale changes, the residuals are rescaled by ``new / old`` so they keep their
            meaning (without EF the codec is invariant to the scale anyway). Without a
            scaler object, call :meth:`set_grad_scale` before each backward instead.
    """

    lag = 2  # hooks between a bucket's all-to-all and its all-gather (Communicator's notes)

    def __init__(self, model: nn.Module, config: GeoFP8Config | None = None,
                 process_group: dist.ProcessGroup | None = None,
                 grad_scaler: torch.amp.GradScaler | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("GeoFP8State needs torch.distributed to be initialised first")
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        backend = backend_of(process_group, device)
        if backend not in SUPPORTED_BACKENDS:
            raise ValueError(f"GeoFP8 supports the {SUPPORTED_BACKENDS} backends, got {backend!r}")
        unsupported = [f"{n} ({p.dtype})" for n, p in model.named_parameters()
                       if p.requires_grad and not p.is_floating_point()]
        if unsupported:  # complex: DDP's bucket has 2n reals, the hook saw n
            raise TypeError("GeoFP8 communicates real floating-point gradients; "
                            f"unsupported parameters: {unsupported[:3]}")
        config = config if config is not None else GeoFP8Config()
        self.engine = SyncEngine(model, config, DeviceGroup(process_group, device), "ddp",
                                 residual_storage=config.residual, grad_scaler=grad_scaler,
                                 serial=True)
        self.stream = SideStream(device)
        # every call of it runs inside the hook's side-stream context (communicate)
        self.communicator = Communicator(config.collective, self.engine.group, lag=self.lag,
                                         mean=True)
        # the step settles in one kernel (StepVerdict.slot: one list.pop, no lock needed)
        self.communicator.flag_slot = self.engine.verdict.slot
        self.communicator.on_failure = self._rollback  # a failed bucket rolls the step back
        if config.owner_feedback:
            self.communicator.owner = self.engine.add_feedback("owner", "fp32")
            self.communicator.owner_route = IDENTITY
            self.engine.pipeline.owner = self.communicator.owner
        size = node_size(config, self.engine.group.size)
        if process_group is not None and config.hierarchy == "auto":
            size = None  # a group of the caller's: its node layout is not ours to guess
        if size and config.budget is not None:
            self.engine.remove_hooks()
            raise ValueError(f"GeoFP8: a byte budget needs the flat collective, but "
                             f"hierarchy={config.hierarchy!r} resolves to nodes of {size} "
                             "ranks here; set hierarchy='flat'")
        self.hierarchy = (HierarchicalAllReduce(self.engine, size, device, self.stream)
                          if size else None)
        if self.hierarchy is not None:
            self.hierarchy.runs.on_failure = self._rollback
        # a bucket's low-precision all-reduce, chosen once
        self._fp8_allreduce = self._flat if self.hierarchy is None else self._hierarchical
        self.engine.fingerprint_extra = {"node_size": size}
        self._buckets: dict[int, _Bucket] = {}  # by the address of DDP's bucket buffer

    # -- what the engine holds, by its usual names ------------------------------------------

    config = property(lambda self: self.engine.config)
    group = property(lambda self: self.engine.group)
    pipeline = property(lambda self: self.engine.pipeline)
    ledger = property(lambda self: self.engine.ledger)
    step = property(lambda self: self.engine.step,
                    doc="Steps settled so far, skipped ones included (the schedule's clock).")
    layers = property(lambda self: self.engine.pipeline.layers,
                      doc="The candidate Linear layers, by weight name.")
    world_size = property(lambda self: self.engine.group.size)
    rank = property(lambda self: self.engine.group.rank)

    def remove_hooks(self) -> None:
        """Detach the statistics hooks from the model."""
        self.engine.remove_hooks()

    def set_grad_scale(self, scale: float) -> None:
        """The loss scale of the coming backward: rescale the residuals if it changed."""
        self.engine.set_grad_scale(scale)

    # -- the hook ----------------------------------------------------------------------------

    def communicate(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """Launch this bucket's all-reduce; the future's value is the averaged gradient (a
        failure in its collective rolls the step back: the communicator's ``on_failure``).
        The engine's parts are named as the engine's here, not by the properties (the
        hook's Python per bucket)."""
        buffer, last = bucket.buffer(), bucket.is_last()
        try:  # the gradients are written: read them on the side stream, which the buffer is
            # handed over to
            with self.stream.after_current(buffer):
                kept = self._buckets.get(buffer.data_ptr()) or self._bucket_of(bucket, buffer)
                self.engine.start_unit(last)
                if self.engine.fp8:
                    return self._fp8_allreduce(kept, last)
                return self._fp32_allreduce(kept, last)
        except BaseException:
            self._rollback()
            raise

    def _bucket_done(self, value: torch.Tensor, finite: torch.Tensor | None = None
                     ) -> torch.Tensor:
        """Fold the bucket into the step's finite flag (on the side stream, where the flags
        are stacked too; ``finite``: the value's own, when the collective has it); the last
        one settles the step."""
        self.engine.finish_unit(value, finite)
        return value

    def _rollback(self) -> None:
        self.communicator.reset()
        if self.hierarchy is not None:
            self.hierarchy.reset()
        self.engine.rollback()

    def _fp32_allreduce(self, kept: "_Bucket", last: bool) -> torch.futures.Future:
        """Full precision, exactly as DDP's default: divide by N, then SUM all-reduce
        (completed on this thread, as the low-precision launches are)."""
        communicator, buffer = self.communicator, kept.buffer
        self.engine.ledger.add_each(_SIZE, kept.size)
        communicator.flush()
        _, work = self.group.all_reduce(buffer.div_(self.world_size), "payload", async_op=True)
        future = communicator.track(work, lambda: self._bucket_done(buffer), buffer.device)
        communicator.complete(block=last)
        return future

    def _bucket_of(self, bucket: dist.GradBucket, buffer: torch.Tensor) -> "_Bucket":
        """What DDP's bucket needs that does not change while it holds the same parameters
        in the same buffer (DDP builds its buckets once, again after the first step): made
        at its first call, then found by the buffer's address alone (:meth:`communicate`).
        The record holds that buffer, so no other bucket's can be allocated at the same
        address while it is kept: a rebuilt bucket is a new buffer, a new record, and the
        records it replaces are let go here (its index's, and at the last bucket those past
        its index: DDP may have rebuilt fewer buckets)."""
        names, index = self.pipeline.names, bucket.index()
        params, grads = bucket.parameters(), bucket.gradients()
        if any(id(p) not in names for p in params):
            raise RuntimeError("a bucket holds a parameter that is not in the model given to "
                               "GeoFP8State: pass the module that DDP wraps")
        offsets = [(g.data_ptr() - buffer.data_ptr()) // g.element_size() for g in grads]
        # An FP32 bucket that its gradients tile in order (DDP's) is the hook's own working
        # memory: Ũ is written over the gradients and the sum decoded into it, so the hook
        # allocates no bucket-sized FP32 vector of its own.
        ends = [off + g.numel() for off, g in zip(offsets, grads)]
        in_place = bool(buffer.dtype == torch.float32 and ends and ends[-1] == buffer.numel()
                        and offsets == [0, *ends[:-1]])
        kept = _Bucket(index, buffer, [names[id(p)] for p in params], grads, offsets, in_place,
                       fp32_allreduce_wire_bytes(buffer.numel(), self.engine.group.size))
        self._buckets = {address: b for address, b in self._buckets.items()
                         if b.index < index or (b.index > index and not bucket.is_last())}
        self._buckets[buffer.data_ptr()] = kept
        return kept

    def _hierarchical(self, kept: "_Bucket", last: bool) -> torch.futures.Future:
        """The bucket's all-reduce over nodes, several buckets in flight (see
        :mod:`geofp8.hierarchy`)."""
        self.engine.ledger.add_each(_SIZE, kept.size)
        return self.hierarchy.launch(kept.names, kept.grads, kept.buffer, kept.offsets,
                                     self.engine.seed(kept.index), last, then=self._bucket_done)

    def _flat(self, kept: "_Bucket", last: bool) -> torch.futures.Future:
        """The bucket's exact all-reduce over the group (:class:`Communicator`), its map back
        (:meth:`_map_back`) once the sum is there."""
        # (no seed to mix when rounding to nearest: Config.rounding_seed's None)
        seed = self.engine.seed(kept.index) if self.engine.config.rounding == "stochastic" else None
        t0 = time.perf_counter()
        encoded = self.engine.pipeline.encode(kept.names, kept.grads, seed, kept.flat, kept.record)
        kept.record = encoded.record  # the bucket's decisions for its next call
        self.engine.ledger.add_each(_ENCODED, (*kept.size, time.perf_counter() - t0))
        # (a record has none of these: BucketRecord)
        unmap, owner_keys = (None, None) if encoded.record else _resolved(self.engine, encoded)
        if last and (encoded.slots or unmap is not None):  # its map back rewrites its flag:
            self.engine.verdict.to_map()  # that decides the step, not its decode (_map_back)
        then = functools.partial(self._map_back, kept, encoded, unmap is not None)
        return self.communicator.launch(encoded.sent, encoded.layout, last, unmap, seed=seed,
                                        owner_keys=owner_keys, out=kept.flat, then=then,
                                        bound=encoded.bound)

    def _map_back(self, kept: "_Bucket", encoded, check: bool, total: torch.Tensor,
                  finite: torch.Tensor | None) -> torch.Tensor:
        """The mean of ``kept``'s launch written into its buffer, from the collective's
        ``total`` (divided by N in its fused decode; all NaN on every rank if any rank sent
        a non-finite value): its finite flag stands for the bucket's where nothing is
        mapped back. A map may overflow: the grouped maps of ``T⁻¹`` AND the flag with
        "every value written finite" (the elements they leave are the sum's, which it
        covers already; a bucket's record's bound maps, the step's armed last slot deciding
        the step: :func:`geofp8.verdict.map_into`); else (the torch path, or ``check``:
        mapped back per sender in the collective) the mean's own check is written over it
        (a poisoned sum maps back to NaN), in its step's slot; its host seconds are added to
        the step's ``transform_s``."""
        if not (encoded.slots or check) and kept.flat is not None:  # nothing to map back
            self.engine.finish_unit(kept.buffer, finite)
            return kept.buffer
        t1 = time.perf_counter()  # T⁻¹ over each mapped tensor of the sum, in place:
        if encoded.maps is not None and finite is not None and not check:  # bound maps
            check = not encoded.maps.back(finite.view(torch.uint8), map_into)  # (in the bucket)
        else:
            if encoded.slots:
                check |= not self.engine.pipeline.decode(
                    encoded, total, divided=True,
                    finite=None if finite is None else finite.view(torch.uint8))
            if kept.flat is None:  # the sum was not decoded into the buffer itself
                for off, y in zip(kept.offsets, total.split([g.numel() for g in kept.grads])):
                    kept.buffer[off : off + y.numel()].copy_(y)
        self.engine.ledger.add("transform_s", time.perf_counter() - t1)
        if check and finite is not None:
            all_finite(kept.buffer, out=finite)
        self.engine.finish_unit(kept.buffer, finite)
        return kept.buffer

    # -- reporting and checkpoints -----------------------------------------------------------

    def stats(self) -> dict:
        """Figures of the last settled step (reading changes nothing).

        ``bytes_sent``: bytes this rank handed to the process group (payloads, scales,
        factor and selection traffic; not the one-time consistency check of the first step),
        counting what each collective's standard algorithm sends: ring all-reduce
        ``2(N−1)/N·size``, all-to-all the ``N−1`` shards for others,
        all-gather/broadcast ``N−1`` copies. ``bytes_fp32_equivalent``: the ring all-reduce
        of the same buckets in FP32. Times are host wall-clock seconds (on a GPU they
        measure launch, not kernel, time).
        """
        return self.engine.stats()

    def state_dict(self) -> dict:
        """Everything needed to continue bit-identically (see
        :meth:`geofp8.engine.SyncEngine.state_dict`)."""
        return self.engine.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.communicator.reset()
        if self.hierarchy is not None:
            self.hierarchy.reset()
        self.engine.load_state_dict(state)


class FP8State(GeoFP8State):
    """Plain Euclidean FP8 (optionally with error feedback) on the same machinery."""

    def __init__(self, model: nn.Module, config: FP8Config | None = None,
                 process_group: dist.ProcessGroup | None = None) -> None:
        super().__init__(model, (config or FP8Config()).to_geofp8(), process_group)


class HadamardFP8State(GeoFP8State):
    """Data-independent control: every 2-D Linear weight rotated by a fixed block Hadamard."""

    def __init__(self, model: nn.Module, config: FP8Config | None = None,
                 process_group: dist.ProcessGroup | None = None) -> None:
        geo = (config or FP8Config()).to_geofp8(transform="hadamard", layers="all")
        super().__init__(model, geo, process_group)


def _resolved(engine: SyncEngine, encoded) -> tuple:
    """``(unmap, owner keys)`` of a launch whose bucket was resolved this call, its sender
    factors' bytes charged as factor bytes (before the launch: the last one settles the
    step, bytes charged included)."""
    pipeline = engine.pipeline
    if encoded.side_bytes:
        engine.group.charge("payload", -encoded.side_bytes)
        engine.group.charge("factor", encoded.side_bytes)
    # the owners' residuals are in communication coordinates, which stay put only for
    # tensors sent without a map (refreshes change maps): see GradientPipeline.owner_keys
    owner_keys = pipeline.owner_keys(encoded) if pipeline.owner is not None else None
    return pipeline.unmap(encoded) if any(encoded.per_sender) else None, owner_keys


def geofp8_hook(state: GeoFP8State,
                bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: FP8 all-reduce, geometry-aware on the selected layers."""
    return state.communicate(bucket)


def fp8_hook(state: FP8State, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: plain FP8 all-reduce (per-rank scales, FP32 sum)."""
    return state.communicate(bucket)


def hadamard_fp8_hook(state: HadamardFP8State,
                      bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: FP8 all-reduce after a fixed Hadamard rotation of each weight."""
    return state.communicate(bucket)


class _Bucket:
    """A DDP bucket's index, parameters' names, gradients (views of ``buffer``) and their
    offsets in it (elements); ``flat``: the buffer where the gradients tile it in order
    (FP32: the hook's working memory), else ``None``; ``size``: its figures per step
    (elements, the FP32 ring all-reduce's bytes) and the pipeline's record of its decisions
    (:mod:`geofp8.bucket_record`) once made."""

    __slots__ = ("buffer", "flat", "grads", "index", "names", "offsets", "record", "size")

    def __init__(self, index: int, buffer: torch.Tensor, names: list[str],
                 grads: list[torch.Tensor], offsets: list[int], in_place: bool,
                 fp32_bytes: int) -> None:
        self.index, self.buffer, self.names, self.grads = index, buffer, names, grads
        self.offsets, self.flat, self.record = offsets, buffer if in_place else None, None
        self.size = (buffer.numel(), fp32_bytes)  # its figures _SIZE


def backend_of(process_group: dist.ProcessGroup | None, device: torch.device) -> str:
    """The backend that carries ``device``'s tensors in ``process_group``: a group made
    without naming one (``init_process_group()``) reports ``"undefined"`` and keeps one
    backend per device type (``"cpu:gloo,cuda:nccl"``)."""
    backend = dist.get_backend(process_group)
    if backend in SUPPORTED_BACKENDS:
        return backend
    per_device = dict(item.split(":", 1) for item in
                      dist.get_backend_config(process_group).split(",") if ":" in item)
    return per_device.get(device.type, backend)
