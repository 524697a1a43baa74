"""GeoFP8 as a DDP communication hook: a state object and a pure hook function.

For a bucket holding gradients ``G_p`` on rank ``r``, :func:`geofp8_hook` runs the
:class:`~geofp8.pipeline.GradientPipeline` (route ``G̃_p = G_p T_p`` on selected Linear
weights, ``Ũ_p = G̃_p + R_p``, encode) and the exact collective
(:class:`~geofp8.comm.collective.Communicator`: per-rank scales honoured, the sum in FP32),
then maps back ``Ĝ_p = (Σ_r Ũ_{p,r} decoded) / N · T_p⁻¹`` into the bucket.

Example::

    >>> from geofp8 import GeoFP8Config, GeoFP8State, geofp8_hook
    >>> state = GeoFP8State(model, GeoFP8Config(format="e4m3"))
    >>> ddp_model = DistributedDataParallel(model)
    >>> ddp_model.register_comm_hook(state, geofp8_hook)

Step bookkeeping (:class:`~geofp8.ledger.StepLedger`): a step begins with its first bucket
and settles when the last bucket's result is ready — before ``backward()`` returns. It is
committed (statistics, residuals, selections, counters) only if every bucket came back
finite; a step whose gradient was non-finite on any rank returns NaN for its buckets on
every rank (so ``GradScaler`` or the caller skips it) and leaves no trace in the state.
"""

# No `from __future__ import annotations`: DDP inspects the hooks' annotations at runtime.
import threading
import time

import torch
import torch.distributed as dist
from torch import nn

from .comm.collective import Communicator
from .comm.group import DeviceGroup
from .config import FP8Config, GeoFP8Config
from .ledger import StepLedger
from .pipeline import GradientPipeline

__all__ = [
    "FP8State",
    "GeoFP8State",
    "HadamardFP8State",
    "fp8_hook",
    "geofp8_hook",
    "hadamard_fp8_hook",
]

SUPPORTED_BACKENDS = ("gloo", "nccl")
STATE_VERSION = 2


class GeoFP8State:
    """State of :func:`geofp8_hook`: the pipeline, the collective and the step ledger.

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

    def __init__(self, model: nn.Module, config: GeoFP8Config | None = None,
                 process_group: dist.ProcessGroup | None = None,
                 grad_scaler: torch.amp.GradScaler | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("GeoFP8State needs torch.distributed to be initialised first")
        self.config = config if config is not None else GeoFP8Config()
        backend = dist.get_backend(process_group)
        if backend not in SUPPORTED_BACKENDS:
            raise ValueError(f"GeoFP8 supports the {SUPPORTED_BACKENDS} backends, got {backend!r}")
        unsupported = [f"{n} ({p.dtype})" for n, p in model.named_parameters()
                       if p.requires_grad and not p.is_floating_point()]
        if unsupported:  # complex: DDP's bucket has 2n reals, the hook saw n
            raise TypeError("GeoFP8 communicates real floating-point gradients; "
                            f"unsupported parameters: {unsupported[:3]}")
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.group = DeviceGroup(process_group, device)
        self.world_size, self.rank = self.group.size, self.group.rank
        self.ledger = StepLedger()
        self.pipeline = GradientPipeline(model, self.config, self.group, self.ledger,
                                         self.config.candidates)
        self.communicator = Communicator(self.config.collective, self.group)
        self.grad_scaler = grad_scaler
        self.grad_scale = 1.0
        self._param_shapes = [[n, list(p.shape), str(p.dtype), p.requires_grad]
                              for n, p in model.named_parameters()]
        self._checked = False
        self._outstanding = 0
        self._lock = threading.Lock()
        self._hooks = [model.register_forward_pre_hook(self._on_model_forward),
                       *self.pipeline.hooks]

    def remove_hooks(self) -> None:
        """Detach the statistics hooks from the model."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _on_model_forward(self, module, args) -> None:
        self.pipeline.shared.new_forward()

    # -- the hook ----------------------------------------------------------------------------

    def communicate(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """Launch this bucket's all-reduce; the future's value is the averaged gradient."""
        if not self._checked:
            self._check_consistency()
        last = bucket.is_last()
        with self._lock:  # counted in before the step can be marked launched
            self._outstanding += 1
        if self.ledger.begin_bucket(last):
            self._begin_step()
        buffer = bucket.buffer()
        self.group.charge("fp32_equivalent",
                          2 * (self.world_size - 1) * buffer.numel() * 4 // self.world_size)
        self.ledger.add("elements", buffer.numel())
        if self.ledger.step < self.config.warmup_steps:
            future = self._fp32_allreduce(buffer)
        else:
            future = self._fp8_allreduce(bucket, buffer, last)
        return future.then(self._bucket_done)

    def _begin_step(self) -> None:
        if self.grad_scaler is not None and self.grad_scaler.is_enabled():
            self.set_grad_scale(float(self.grad_scaler.get_scale()))
        self.pipeline.start_step(self.ledger.step)

    def _bucket_done(self, fut: torch.futures.Future) -> torch.Tensor:
        """Count the bucket in; the last one of a launched step settles it."""
        value = fut.value()
        with self._lock:
            self._outstanding -= 1
            if self._outstanding == 0 and self.ledger.unsettled:
                self._settle()
        return value

    def _settle(self) -> None:
        finite = self.ledger.finite
        self.pipeline.settle(finite)
        sent = self.group.take_bytes()
        for key, kind in (("bytes_sent", "payload"), ("factor_bytes_sent", "factor"),
                          ("bytes_fp32_equivalent", "fp32_equivalent")):
            self.ledger.add(key, sent.get(kind, 0.0))
        self.ledger.settle()

    def set_grad_scale(self, scale: float) -> None:
        """The loss scale of the coming backward: rescale the residuals if it changed."""
        if scale != self.grad_scale:
            self.pipeline.feedback.rescale(scale / self.grad_scale)
            self.grad_scale = float(scale)

    def _fp32_allreduce(self, buffer: torch.Tensor) -> torch.futures.Future:
        """Full precision, exactly as DDP's default: divide by N, then SUM all-reduce."""
        self.communicator.flush()
        _, work = self.group.all_reduce(buffer.div_(self.world_size), "payload", async_op=True)

        def average(fut):
            out = fut.value()[0]
            if not bool(torch.isfinite(out).all()):
                self.ledger.finite = False
            return out
        return work.get_future().then(average)

    def _fp8_allreduce(self, bucket: dist.GradBucket, buffer: torch.Tensor, last: bool):
        names, grads = [], []
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            if id(p) not in self.pipeline.names:
                raise RuntimeError("a bucket holds a parameter that is not in the model given to "
                                   "GeoFP8State: pass the module that DDP wraps")
            names.append(self.pipeline.names[id(p)])
            grads.append(g)
        t0 = time.perf_counter()
        seed = self.config.rounding_seed(self.ledger.step, bucket.index())
        encoded = self.pipeline.encode(names, grads, seed)
        self.ledger.add("codec_s", time.perf_counter() - t0)
        offsets = [(g.data_ptr() - buffer.data_ptr()) // g.element_size() for g in grads]

        def map_back(fut: torch.futures.Future) -> torch.Tensor:
            total = fut.value()
            if total.numel() and torch.isnan(total[0]):  # poisoned: all-or-nothing
                self.ledger.finite = False
                return buffer.fill_(float("nan"))
            t1 = time.perf_counter()
            for off, y in zip(offsets, self.pipeline.decode(encoded, total)):
                buffer[off : off + y.numel()].copy_(y.reshape(-1))
            self.ledger.add("transform_s", time.perf_counter() - t1)
            return buffer

        future = self.communicator.launch(encoded.sent, encoded.layout, last,
                                          self.pipeline.unmap(encoded), seed=seed)
        self.group.charge("payload", -encoded.side_bytes)  # sender factors are factor bytes
        self.group.charge("factor", encoded.side_bytes)
        return future.then(map_back)

    # -- consistency -------------------------------------------------------------------------

    def _fingerprint(self) -> dict:
        return {"config": self.config.to_dict(), "world_size": self.world_size,
                "parameters": self._param_shapes, **self.pipeline.fingerprint()}

    def _check_consistency(self) -> None:
        """Fail fast, on every rank, when ranks disagree on config or model structure
        (fingerprints travel as JSON text in uint8 tensors)."""
        self._checked = True
        # charged to its own kind, outside the per-step figures: it runs once
        everyone = self.group.all_gather_json(self._fingerprint(), "consistency")
        problems = []
        first = everyone[0]
        for r, other in enumerate(everyone):
            if other == first:
                continue
            for key in ("config", "world_size", "candidates", "shared_inputs"):
                if other[key] != first[key]:
                    detail = other[key]
                    if key == "config":
                        detail = {k: (first[key][k], v) for k, v in other[key].items()
                                  if first[key].get(k) != v}
                    problems.append(f"rank {r} vs rank 0: {key} differs: {detail}")
            if other["parameters"] != first["parameters"]:
                diff = [(a, b) for a, b in zip(first["parameters"], other["parameters"])
                        if a != b][:3]
                n0, n1 = len(first["parameters"]), len(other["parameters"])
                problems.append(f"rank {r} vs rank 0: model structure differs "
                                f"({n0} vs {n1} parameters; first differences {diff})")
        if problems:
            raise RuntimeError("GeoFP8: ranks disagree:\n  " + "\n  ".join(problems))

    # -- reporting and checkpoints -----------------------------------------------------------

    @property
    def step(self) -> int:
        return self.ledger.step

    @property
    def layers(self):
        """The candidate Linear layers, by weight name."""
        return self.pipeline.layers

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
        last = self.ledger.last
        sent = last["bytes_sent"] + last["factor_bytes_sent"]
        return {
            "step": self.ledger.step,
            "skipped_steps": self.ledger.skipped_steps,
            "bytes_sent": int(sent),
            "payload_bytes_sent": int(last["bytes_sent"]),
            "factor_bytes_sent": int(last["factor_bytes_sent"]),
            "bytes_fp32_equivalent": int(last["bytes_fp32_equivalent"]),
            "bytes_per_element": sent / last["elements"] if last["elements"] else 0.0,
            "geometry_layers": self.pipeline.geometry_layers(),
            "codec_s": last["codec_s"],
            "transform_s": last["transform_s"],
            "statistics_s": last["statistics_s"],
            "ef_bytes": self.pipeline.feedback.nbytes,
            "factor_bytes": self.pipeline.factor_nbytes,
        }

    def state_dict(self) -> dict:
        """Everything needed to continue bit-identically: tensors and plain containers only
        (it loads with ``weights_only=True``)."""
        return {"version": STATE_VERSION, "config": self.config.to_dict(),
                "step": self.ledger.step, "skipped_steps": self.ledger.skipped_steps,
                "grad_scale": self.grad_scale, **self.pipeline.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"GeoFP8 checkpoint version {state.get('version')!r} is not "
                             f"supported (this version reads {STATE_VERSION})")
        if state.get("config") != self.config.to_dict():
            mine, theirs = self.config.to_dict(), state.get("config", {})
            diff = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v}
            raise ValueError(f"GeoFP8 checkpoint was written with another config: "
                             f"(checkpoint, current) = {diff}")
        self.ledger.step = int(state["step"])
        self.ledger.skipped_steps = int(state["skipped_steps"])
        self.ledger.reset_phase()
        self.grad_scale = float(state.get("grad_scale", 1.0))
        self.pipeline.load_state_dict(state)


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
