"""GeoFP8 for sharded training (FSDP2 ``fully_shard``): an exact low-precision reduce-scatter,
and the cross-replica all-reduce of HSDP in exact low precision.

Adapters of the :class:`~geofp8.engine.SyncEngine` (which owns the step: consistency check,
warm-up, routing, error feedback, finite agreement, settling, state), in the manner of
FSDP2's comm protocols (``allocate`` and ``__call__``):

:class:`GeoFP8ReduceScatter` (one per ``fully_shard`` unit and backward). FSDP hands a flat
buffer ``[N, M]`` whose row ``r`` is every parameter's dim-0 chunk ``r`` (see
:meth:`ShardLayout.for_rows`). Rank ``s`` holds its whole unsharded gradient ``G_{p,s}``:

* route and error feedback per parameter, ``Ũ_{p,s} = G_{p,s} T_p + R_{p,s}`` (the engine's
  pipeline, as DDP; ``T_p`` acts on columns, so it commutes with the row chunks), written
  over the parameter's row chunks in place. The sender's residual ``R_{p,s}`` covers the
  whole unsharded gradient, so it is kept only with ``sender_feedback=True``; by default
  ``R = 0`` (no error feedback on this rounding: measured without loss, see
  :class:`GeoFP8FSDP`);
* every row chunk quantized with this sender's own scales; all-to-all; receiver ``r``
  decodes the ``N`` copies of row ``r`` and sums in FP32 (the fused kernels where they
  run: two launches to encode, one to decode and sum), then maps its rows back by
  ``T_p⁻¹`` and applies FSDP's ``op`` (``AVG``: ``/N``; ``PREMUL_SUM`` after
  ``set_gradient_divide_factor(f)``: ``/f``). One rounding, no all-gather: ``(N−1)/N``
  encoded bytes per element and rank, against ``4(N−1)/N`` in FP32.
* non-finite: a sender's non-finite element makes its scale group's scale non-finite, so
  the group decodes to NaN in its owner's sum (every codec, either path), whose output is
  then not finite: the unit's verdict on that rank. The verdicts, a sum that overflows on
  one receiver only, or a NaN that FSDP's own reduce-scatter left in one shard (HSDP hook
  only), are agreed on when the step settles (the engine all-reduces the units' finite
  flags, on the device), so a reduce-scatter that leaves a NaN on one rank makes the unit
  non-finite on every rank: every rank counts the step as skipped, resets the residuals it
  wrote to zero, keeps no statistic, and sets the local gradient shards of the units that
  were not finite on some rank to NaN on every rank, so an optimizer or ``GradScaler`` sees
  the same verdict everywhere (one multiply per unit and step, the verdict staying on the
  device).

:class:`ReplicaAllReduce` (HSDP: ``enable(..., mesh=2-D mesh with dims ("replicate",
"shard"))``, the model sharded on ``mesh["shard"]``): FSDP's all-reduce hook receives this
rank's reduced shard and all-reduces it over the replicate group with the DDP collective
(exact, error feedback per shard), dividing by the replica count; with or without the
low-precision reduce-scatter. It honours ``set_requires_all_reduce(False)`` (gradient
accumulation): the shard is kept and added to the next one that is all-reduced.

A step begins with its first reduction and settles at the end of its backward (a callback
queued on the autograd engine; at the next forward of the model if the reductions ran
outside a backward).
"""

from __future__ import annotations

import operator
import time
import zlib
from dataclasses import dataclass, field, replace
from functools import cached_property

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from .codecs.base import device_scalar
from .comm import Communicator, ShardLayout, encode, encode_with_error, fp32_allreduce_wire_bytes
from .comm.bound import BoundStages
from .comm.group import DeviceGroup, collective
from .comm.streams import StreamsUsed
from .config import FP8Config, GeoFP8Config
from .engine import SyncEngine
from .feedback import STORAGES, FlatResiduals
from .fsdp_maps import UnitMaps, UnitRecord, resolve
from .geometry.transforms import IDENTITY

__all__ = ["GeoFP8FSDP", "GeoFP8ReduceScatter", "ReplicaAllReduce", "enable"]

_LOCAL_GRAD = operator.attrgetter("sharded_param.grad._local_tensor")  # an FSDPParam's

RESIDUALS = STORAGES
REPLICA = "#replica"
# No sender residual for the reduce-scatter by default (GeoFP8FSDP's sender_feedback): it
# would cover the whole unsharded gradient on every rank, and dropping it measured no loss
# (llama-tiny, 2 ranks, 100 steps, fp8 and nvfp4: docs/failure-behaviour.md).
SENDER_FEEDBACK = False


@dataclass
class _Unit:
    """One ``fully_shard`` unit: its parameter group and its parameters in FSDP's order."""

    name: str
    param_group: object  # torch's FSDPParamGroup
    names: list[str]
    shapes: list[tuple[int, ...]]
    trained: list  # the FSDPParams of those parameters (torch's), in the same order
    layouts: dict = field(default_factory=dict)  # (kind, world size) -> ShardLayout
    # with no residual to add (GeoFP8ReduceScatter._prepare): the generation of the
    # pipeline's decisions in which every route is the identity, else None; its routes
    # resolved (fsdp_maps.resolve), kept while they hold
    plain: tuple | None = None
    record: UnitRecord | None = None
    _rows: dict = field(default_factory=dict)  # world size -> rows(world)

    def rows(self, world: int) -> list[tuple[int, int, int]]:
        """Per parameter ``(offset in a row, chunk rows, elements per dim-0 row)``."""
        if world not in self._rows:
            out = self._rows[world] = []
            pos = 0
            for shape in self.shapes:
                rows, width = -(-shape[0] // world), torch.Size(shape[1:]).numel()
                out.append((pos, rows, width))
                pos += rows * width
        return self._rows[world]

    @property
    def shard_size(self) -> int:
        return self.param_group.mesh_info.shard_mesh_size

    @cached_property
    def chunk_shapes(self) -> list[tuple[int, ...]]:
        """This rank's dim-0 chunk of every parameter (the HSDP replica hop's tensors)."""
        return [(-(-s[0] // self.shard_size), *s[1:]) for s in self.shapes]

    @cached_property
    def replica_keys(self) -> list[str]:
        """The replica hop's residuals' names, one a parameter."""
        return [name + REPLICA for name in self.names]

    @cached_property
    def crc(self) -> int:
        return zlib.crc32(self.name.encode())


class GeoFP8ReduceScatter(ReduceScatter):
    """FSDP's custom reduce-scatter for one unit (module notes); it runs to completion
    inside ``__call__`` (returns no work)."""

    def __init__(self, state: GeoFP8FSDP, unit: _Unit) -> None:
        self.state, self.unit = state, unit

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op, async_op: bool = False) -> None:
        self.state.run_unit(self.unit, self._reduce, output_tensor, input_tensor, group, op)

    def _reduce(self, out: torch.Tensor, inp: torch.Tensor, group, op) -> None:
        engine, unit = self.state.engine, self.unit
        dg = engine.device_group(group, inp.device)
        n = dg.size
        layout = self.state.layout(unit, "rows", n)
        if inp.numel() != layout.numel or out.numel() != layout.numel // n:
            raise RuntimeError(
                f"GeoFP8: the reduce-scatter input of {unit.name or '<root>'!r} has "
                f"{inp.numel()} elements, its parameters make {layout.numel}: a parameter "
                "received no gradient this step (set reduce_scatter_unused_params) or FSDP's "
                "layout changed")
        divisor = _divisor(unit, op, n)
        engine.ledger.add("elements", inp.numel())
        dg.charge("fp32_equivalent", (n - 1) * out.numel() * 4)
        if not engine.fp8:  # FP32, as FSDP's default (PREMUL_SUM, which gloo lacks: ·1/f, SUM)
            if op != dist.ReduceOp.AVG and op != dist.ReduceOp.SUM:
                inp.mul_(1.0 / divisor)
                op = dist.ReduceOp.SUM
            dg.reduce_scatter(out, inp, op, "payload")
            engine.observe(out)
            return
        t0 = time.perf_counter()
        flat = inp.float() if inp.dtype != torch.float32 else inp
        self.state.probe.reference(unit, flat, dg, divisor)
        routes = self._prepare(flat.view(n, -1), n)
        seed = engine.seed(unit.crc, 0)
        if engine.config.error_feedback:
            sent, residual = encode_with_error(flat, layout, seed=seed, sender=dg.rank)
            self._stage_residuals(residual.view(n, -1), n, routes)
        else:
            sent = encode(flat, layout, seed=seed, sender=dg.rank)
        engine.ledger.add("codec_s", time.perf_counter() - t0)
        # a sender's non-finite input: NaN in its owner's sum (notes), its flag down
        comm = self.state.communicator(dg, None if divisor == 1 else divisor)
        if out.dtype == torch.float32 and not isinstance(routes, list):  # the sum / divisor
            # straight in out, its grouped maps' back there (UnitMaps.then)
            engine.observe(out, finite=comm.launch(sent, layout, gather=False, out=flat, into=out,
                                                   then=routes.then if routes else _flag).wait())
        else:  # mapped back per parameter first, or copied into FSDP's dtype
            total = comm.launch(sent, layout, gather=False, out=flat).wait()
            self._map_back(total, n, routes)
            if comm.divide is None:
                out.copy_(total)
            else:  # the division (IEEE, as the kernel's) is the copy into FSDP's output
                torch.div(total, device_scalar(comm.divide, torch.float32, total.device), out=out)
            engine.observe(out)
        if self.state.mesh is None and self.state.probe.enabled:
            self.state.probe.compare(unit, out.float(), n)

    def _prepare(self, rows2d: torch.Tensor, n: int) -> list | UnitMaps | None:
        """``Ũ = G T + R`` in place. With no residual to add, the unit's routes resolved
        once per generation of the pipeline's decisions (:mod:`.fsdp_maps`), then taken
        with no Python per parameter: ``None`` when every route is the identity (``Ũ = G``
        as it is), or its grouped maps (``G T`` in one launch; returned for
        :meth:`_map_back`). Else parameter by parameter: a plain parameter (identity route,
        nothing observed: :meth:`GradientPipeline.plain`) adds its residual straight into
        its row chunks; the others go through the pipeline on one temporary of the
        parameter's padded size (``G`` gathered into it, ``Ũ`` written over it and back);
        returns the routes."""
        routes, pipeline, unit = [], self.state.engine.pipeline, self.unit
        feedback = pipeline.feedback if pipeline.config.error_feedback else None
        if feedback is None and unit.plain == pipeline.generation():
            return None
        if feedback is None:
            record = unit.record
            if record is None or record.key != (pipeline.generation(), n):
                batched = self.state.layout(unit, "rows", n).batched(rows2d.device)
                record = unit.record = resolve(pipeline, unit.names, unit.shapes, unit.rows(n),
                                               rows2d.view(-1), n, batched, record)
            if record.maps is not None:
                record.maps.forward(rows2d.view(-1))
                return record.maps
            if record.plain:
                unit.plain = pipeline.generation()
                return None
        for name, shape, (pos, rows, width) in zip(unit.names, unit.shapes, unit.rows(n)):
            if pipeline.plain(name):
                residual = feedback.residual_in(name, IDENTITY) if feedback else None
                if residual is not None:
                    rows_of = residual.reshape(shape[0], width)
                    for piece, lo, hi in _row_pieces(rows2d, pos, rows, width, shape[0]):
                        piece.add_(rows_of[lo:hi].view(piece.shape))
                routes.append(IDENTITY)
                continue
            view = rows2d[:, pos : pos + rows * width]
            padded = rows2d.new_empty(n * rows, width)  # the parameter's rows, then padding
            padded.view(n, rows * width).copy_(view)
            G = padded[: shape[0]].view(shape)
            routes.append(pipeline.prepare_into(name, G, G, in_place=True))
            padded[shape[0] :].zero_()
            view.copy_(padded.view(n, rows * width))
        return routes

    def _stage_residuals(self, rows2d: torch.Tensor, n: int, routes) -> None:
        """Each parameter's rounding error, from its row chunks of ``rows2d``."""
        feedback = self.state.engine.pipeline.feedback
        for name, shape, (pos, rows, width), route in zip(self.unit.names, self.unit.shapes,
                                                           self.unit.rows(n), routes):
            feedback.stage_rows(name, shape, _row_pieces(rows2d, pos, rows, width, shape[0]),
                                route)

    def _map_back(self, total: torch.Tensor, n: int, routes) -> None:
        """This rank's summed rows of each routed weight, ``Y T⁻¹`` (``T`` acts on columns;
        ``routes``: :meth:`_prepare`'s, ``None``: none routed; the unit's grouped maps: one
        launch)."""
        if not isinstance(routes, list):
            if routes is not None:
                routes.back(total)
            return
        for (pos, rows, width), route in zip(self.unit.rows(n), routes or ()):
            if route is not IDENTITY:
                Y = total[pos : pos + rows * width].view(rows, width)
                route.inverse_over(Y)


class ReplicaAllReduce:
    """HSDP's all-reduce hook for one unit (module notes). ``after_ours``: the unit's
    reduce-scatter is GeoFP8's (else FSDP's own FP32 one ran before, counted here)."""

    def __init__(self, state: GeoFP8FSDP, unit: _Unit, group: DeviceGroup,
                 after_ours: bool) -> None:
        self.state, self.unit, self.group, self.after_ours = state, unit, group, after_ours
        self._partial: torch.Tensor | None = None  # shards kept under no all-reduce
        # the replica residuals' flat vector as the last step left it, and the feedback's
        # version then (_encode_with_residual)
        self._held: FlatResiduals | None = None
        self._version = 0

    def __call__(self, reduce_output: torch.Tensor) -> None:
        if not self.unit.param_group.all_reduce_grads:  # accumulate: all-reduce later
            self._partial = reduce_output.clone() if self._partial is None else \
                self._partial.add_(reduce_output)
            reduce_output.zero_()  # FSDP adds it to the gradient: the sum comes later
            return
        if self._partial is not None:
            reduce_output.add_(self._partial)
            self._partial = None
        self.state.run_unit(self.unit, self._all_reduce, reduce_output)

    def _all_reduce(self, shard: torch.Tensor) -> None:
        engine, unit, rep, shards = self.state.engine, self.unit, self.group, self.unit.shard_size
        n = rep.size
        fp32_bytes = fp32_allreduce_wire_bytes(shard.numel(), n)
        if not self.after_ours or shards == 1:  # FSDP's FP32 reduce-scatter ran before
            # (none on a shard group of one rank): count it and the elements here
            shard_bytes = (shards - 1) * shard.numel() * 4
            engine.ledger.add("elements", shards * shard.numel())
            rep.charge("payload", shard_bytes)  # issued by FSDP, not through our door
            fp32_bytes += shard_bytes
        rep.charge("fp32_equivalent", fp32_bytes)
        # FSDP divided by the shard group only; divide by the replicas unless the user set
        # their own divide factor (then it is the whole division)
        divisor = n if unit.param_group.gradient_divide_factor is None else 1
        # an FP32 shard is the hop's working memory: Ũ is written over it, the sum decoded into it
        x = shard.float() if shard.dtype != torch.float32 else shard
        if not self.after_ours:  # FSDP's FP32 reduce-scatter: this shard is exact
            self.state.probe.keep(unit, x)
        finite = None  # the gathered decode's flag of x, where it has one
        if not engine.fp8:
            x, _ = rep.all_reduce(x, "payload")
            if divisor != 1:
                x.div_(device_scalar(divisor, torch.float32, x.device))
        else:
            t0 = time.perf_counter()
            layout = self._layout
            seed = engine.seed(unit.crc, 1)
            bound = layout.plan.bound(x, x)  # the fused stages on x, for every stage
            sent = self._encode_with_residual(x, layout, seed, bound) \
                if self.state.replica_feedback else encode(x, layout, seed=seed, sender=rep.rank)
            engine.ledger.add("codec_s", time.perf_counter() - t0)
            # divided by the decode (IEEE), its flag that of x
            x, finite = self.state.communicator(rep, None if divisor == 1 else divisor).launch(
                sent, layout, gather=True, seed=seed, owner_keys=unit.names, out=x, then=_pair,
                bound=bound).wait()
        if x is not shard:
            shard.copy_(x)
            finite = None  # (the copy may round to infinity)
        engine.observe(shard, finite=finite)
        if self.state.probe.enabled:
            self.state.probe.replica(unit, shard.float(), rep, divisor)

    @cached_property
    def _layout(self) -> ShardLayout:
        return self.state.layout(self.unit, "replica", self.group.size)

    def _encode_with_residual(self, x: torch.Tensor, layout: ShardLayout, seed,
                              bound: BoundStages | None) -> torch.Tensor:
        """The shard ``x`` encoded with its replica residuals added, the new ones staged.
        Stored plain (FP32 or BF16) and written by one step, they are one flat vector
        (:meth:`ErrorFeedback.bucket_in`, as a DDP bucket's) that the encode reads and
        writes in place (the fused kernels: ``x`` not written); else parameter by
        parameter (the first step makes that vector, :meth:`ErrorFeedback.first_bucket`).
        That vector, once made, is read again as it was left (:meth:`ErrorFeedback.recorded`,
        as a DDP bucket's record does) while it is live and the feedback's version has not
        moved: no Python per parameter, the encode ``bound``'s send (the layout's fused stages
        on ``x``; the vector fits them: made so) where it runs."""
        feedback = self.state.engine.feedbacks["replica"]
        if self._held is not None and self._held.live and self._version == feedback.version:
            bucket = feedback.recorded(self._held)
            sent = bound and bound.send(x, None, bucket, seed, self.group.rank)
            if sent is None:  # the torch path (or a kernel failed)
                sent = encode_with_error(x, layout, seed=seed, sender=self.group.rank,
                                         feedback=bucket)[0]
            feedback.restage(self._held.names)
            return sent
        keys, chunks = self.unit.replica_keys, self.unit.chunk_shapes
        bucket = feedback.bucket_in(keys, chunks)
        for key, (lo, hi) in zip(keys, _spans(chunks)) if bucket is None else ():
            residual = feedback.residual_in(key, IDENTITY)
            if residual is not None:
                x[lo:hi] += residual.reshape(-1)
        sent, residual = encode_with_error(x, layout, seed=seed, sender=self.group.rank,
                                           feedback=bucket)
        if bucket is not None or feedback.first_bucket(keys):
            feedback.stage_bucket(keys, residual, chunks)
            self._held, self._version = feedback.held(keys), feedback.version
            return sent
        for key, (lo, hi), chunk in zip(keys, _spans(chunks), chunks):
            feedback.stage(key, residual[lo:hi].view(chunk), IDENTITY)
        return sent


class Fidelity:
    """The ``shadow`` measurement: the communicated gradient against FSDP's FP32 reduction
    of the same gradients, per parameter of this rank's shard (uncounted FP32 collectives)."""

    def __init__(self) -> None:
        self.enabled = False
        self._refs: dict[str, torch.Tensor] = {}
        self._sums: dict[str, torch.Tensor] = {}

    def reference(self, unit: _Unit, flat: torch.Tensor, dg: DeviceGroup, divisor: float):
        """FSDP's FP32 reduce-scatter of the exact input (before it is routed in place)."""
        if self.enabled:
            ref = torch.empty(flat.numel() // dg.size, dtype=torch.float32, device=flat.device)
            collective("reduce_scatter_single")(ref, flat.clone(), op=dist.ReduceOp.SUM,
                                                group=dg.group)
            self._refs[unit.name] = ref.div_(divisor)

    def keep(self, unit: _Unit, exact_shard: torch.Tensor) -> None:
        if self.enabled:
            self._refs[unit.name] = exact_shard.clone()

    def replica(self, unit: _Unit, got: torch.Tensor, rep: DeviceGroup, divisor: float):
        """HSDP: the reference's own FP32 replica all-reduce, then the comparison."""
        if self.enabled and unit.name in self._refs:
            ref = self._refs[unit.name]
            dist.all_reduce(ref, group=rep.group)
            ref.div_(divisor)
            self.compare(unit, got, unit.shard_size)

    def compare(self, unit: _Unit, got: torch.Tensor, world: int) -> None:
        """Accumulate ``‖Ĝ−Ḡ‖², ‖Ḡ‖², Ĝ·Ḡ, ‖Ĝ‖²`` per parameter of this rank's shard."""
        if not self.enabled:
            return
        ref = self._refs.pop(unit.name)
        for name, (pos, rows, width) in zip(unit.names, unit.rows(world)):
            g, r = got[pos : pos + rows * width], ref[pos : pos + rows * width]
            self._sums[name] = torch.stack([(g - r).pow(2).sum(), r.pow(2).sum(),
                                            g @ r, g.pow(2).sum()]).double()

    def result(self, names: list[str]) -> tuple[dict[str, dict[str, float]], float, float]:
        """Collective over the world (HSDP replicas count twice in every term: ratios hold)."""
        sums = torch.stack([self._sums.get(n, torch.zeros(4, dtype=torch.float64))
                            for n in names])
        self._sums = {}
        dist.all_reduce(sums)
        out = {name: dict(zip(("rel_l2", "cos"), _ratios(*row)))
               for name, row in zip(names, sums.tolist())}
        return (out, *_ratios(*sums.sum(0).tolist()))


class GeoFP8FSDP:
    """GeoFP8 on a ``fully_shard``-ed model: the engine, the units and their adapters.

    Args:
        model: the root module, ``fully_shard`` applied (to it and any submodules).
        config: :class:`GeoFP8Config` or :class:`FP8Config` (identical on every rank:
            checked at the first step, every rank fails with the differing fields named).
        mesh: ``None`` (FSDP: the low-precision reduce-scatter) or a 2-D ``DeviceMesh``
            with dims ``("replicate", "shard")`` for HSDP; the model must be sharded on
            ``mesh["shard"]``.
        reduce_scatter: install the low-precision reduce-scatter (default); ``False`` with a
            mesh: only the replica all-reduce is (the reduce-scatter stays FSDP's FP32 one).
        residual: storage of the error-feedback residuals: ``"fp32"`` (4 bytes per
            parameter and rank), ``"bf16"`` (2), ``"fp8"`` (1, plus 4 per row) or
            ``"nvfp4"`` (0.5625); ``None``: ``config.residual``.
        sender_feedback: keep each sender's residual of the reduce-scatter's rounding
            (with ``config.error_feedback``). It covers the whole unsharded gradient, so
            its bytes per rank do not fall with the number of ranks; ``None``:
            :data:`SENDER_FEEDBACK`. Without it the reduce-scatter rounds once, with no
            error feedback (``config.error_feedback`` is then set to ``False`` in
            :attr:`config`); HSDP's replica hop keeps its own, shard-sized residuals.
    """

    def __init__(self, model: nn.Module, config: GeoFP8Config | FP8Config | None = None,
                 mesh=None, reduce_scatter: bool = True, residual: str | None = None,
                 sender_feedback: bool | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("GeoFP8FSDP needs torch.distributed to be initialised first")
        if isinstance(config, FP8Config):
            config = config.to_geofp8()
        cfg = config if config is not None else GeoFP8Config()
        residual = str(cfg.residual) if residual is None else residual
        if cfg.transform in ("output", "kfac"):
            raise ValueError("GeoFP8 on FSDP: output-side transforms act on rows, which FSDP "
                             "shards; use an input-side transform (lowrank, full, diag, ...)")
        if cfg.factor_source == "local":
            raise ValueError("GeoFP8 on FSDP: factor_source='local' is DDP-only; use "
                             "'refresh' or 'fresh'")
        if cfg.budget is not None:
            raise ValueError("GeoFP8 on FSDP: a byte budget (formats chosen per layer) is "
                             "DDP-only for now; use one format (e.g. format='nvfp4')")
        if residual not in RESIDUALS:
            raise ValueError(f"residual must be one of {RESIDUALS}, got {residual!r}")
        if mesh is None and not reduce_scatter:
            raise ValueError("reduce_scatter=False needs an HSDP mesh (nothing would be FP8)")
        if mesh is not None and (mesh.ndim != 2 or
                                 tuple(mesh.mesh_dim_names or ()) != ("replicate", "shard")):
            raise ValueError("the HSDP mesh must be 2-D with dims ('replicate', 'shard'), "
                             f"got dims {mesh.mesh_dim_names}")
        device = next(model.parameters()).device
        self.mesh, self.residual = mesh, residual
        self.replica_feedback = cfg.error_feedback
        self.sender_feedback = cfg.error_feedback and (
            SENDER_FEEDBACK if sender_feedback is None else bool(sender_feedback))
        if not self.sender_feedback:
            cfg = replace(cfg, error_feedback=False)
        # factors and selections on the whole world: identical on every rank, replicas too
        self.engine = SyncEngine(model, cfg, DeviceGroup(None, device), "fsdp",
                                 residual_storage=residual, agree=True)
        self.engine.fingerprint_extra = {"hsdp": mesh is not None,
                                         "reduce_scatter": reduce_scatter, "residual": residual,
                                         "replica_feedback": self.replica_feedback}
        self.probe = Fidelity()
        self._communicators: dict[tuple, Communicator] = {}
        self._armed = False
        self._reduced: list[_Unit] = []  # units reduced in the step in flight
        self._streams = StreamsUsed(device)  # FSDP's streams the units ran on, this step
        self.engine.on_skip.append(self._poison_reduced)
        units = _units(model, mesh)
        self.units = [u for u, _ in units]
        if mesh is not None:
            self.engine.add_feedback("replica", residual)
            if cfg.owner_feedback:  # the replica hop's second rounding
                self.engine.add_feedback("owner", residual)
            replicate = self.engine.device_group(mesh["replicate"].get_group(), device)
        for unit, module in units:
            if reduce_scatter:
                module.set_custom_reduce_scatter(GeoFP8ReduceScatter(self, unit))
            if mesh is not None:
                module.set_all_reduce_hook(ReplicaAllReduce(self, unit, replicate,
                                                            reduce_scatter))
        self._hook = model.register_forward_pre_hook(lambda *_: self._end_step())

    # -- what the adapters share -------------------------------------------------------------

    config = property(lambda self: self.engine.config)
    pipeline = property(lambda self: self.engine.pipeline)
    ledger = property(lambda self: self.engine.ledger)
    step = property(lambda self: self.engine.step)

    def run_unit(self, unit: _Unit, work, *args) -> None:
        """Run one unit of the step through the engine: begin the step if it is the first,
        settle at the end of backward, roll back on an exception."""
        engine = self.engine
        try:
            engine.start_unit()
            if not self._armed:
                self._armed = _queue_end_of_backward(self._end_of_backward)
            self._reduced.append(unit)
            self._streams.note()  # FSDP's reduce-scatter (or all-reduce) stream, on CUDA
            work(*args)
            engine.finish_unit()
        except BaseException:
            self._reduced = []
            engine.rollback()
            raise

    def _end_of_backward(self) -> None:
        self._armed = False
        self._end_step()

    def _end_step(self) -> None:
        """Settle the step, on the current stream, after the units' work on FSDP's streams
        (their finite flags are read there)."""
        self._streams.join()
        self.engine.end_step()
        self._reduced = []

    def _poison_reduced(self, factors: torch.Tensor) -> None:
        """NaN in the local gradient shards of the units not finite on some rank (module
        notes; ``factors``: per :meth:`run_unit`, in order, 1 or NaN on the device,
        :meth:`~geofp8.verdict.StepVerdict.settle`'s): each unit's shards multiplied by its
        factor in one foreach op (as :func:`~geofp8.comm.stages.poison_unless` does one
        tensor)."""
        for unit, factor in zip(self._reduced, factors.unbind()):
            try:  # (no Python per parameter)
                shards = list(map(_LOCAL_GRAD, unit.trained))
            except AttributeError:  # a gradient missing, or not a DTensor's
                shards = [getattr(g, "_local_tensor", g) for fp in unit.trained
                          if (g := fp.sharded_param.grad) is not None]
            if shards:
                torch._foreach_mul_(shards, factor)

    def communicator(self, group: DeviceGroup, divide: float | None = None) -> Communicator:
        """The exact collective over ``group`` whose fused decode divides by ``divide``
        (IEEE; ``None``: no division), made at its first use."""
        key = (id(group), divide)
        if key not in self._communicators:
            self._communicators[key] = Communicator("exact", group)
            self._communicators[key].divide = divide
            self._communicators[key].owner = self.engine.feedbacks.get("owner")
            self._communicators[key].owner_route = IDENTITY
            self._communicators[key].flag_slot = self.engine.verdict.slot
        return self._communicators[key]

    def layout(self, unit: _Unit, kind: str, world: int) -> ShardLayout:
        """The unit's row layout (``"rows"``) or its replica hop's (``"replica"``)."""
        key = (kind, world)
        if key not in unit.layouts:
            codec, kernels = self.engine.pipeline.codec, self.engine.config.kernels
            unit.layouts[key] = ShardLayout.for_rows(unit.shapes, codec, world, kernels=kernels) \
                if kind == "rows" else ShardLayout.build(unit.chunk_shapes, codec, world,
                                                         kernels=kernels)
        return unit.layouts[key]

    # -- reporting and checkpoints -----------------------------------------------------------

    @property
    def shadow(self) -> bool:
        """Set before a backward to measure it against FP32 (see :meth:`fidelity`)."""
        return self.probe.enabled

    @shadow.setter
    def shadow(self, value: bool) -> None:
        self.probe.enabled = bool(value)

    def fidelity(self) -> tuple[dict[str, dict[str, float]], float, float]:
        """``({parameter: {"rel_l2", "cos"}}, rel_l2, cos)`` of the last backward run with
        :attr:`shadow` set: the communicated gradient against FSDP's FP32 reduction of the
        same gradients (reduce-scatter, and the replica all-reduce under HSDP). Collective
        over the world; call it on every rank after the backward."""
        return self.probe.result([n for u in self.units for n in u.names])

    def stats(self) -> dict:
        """Figures of the last settled step (as :meth:`geofp8.GeoFP8State.stats`; reading
        changes nothing).

        ``bytes_sent``: what this rank put on the wire: the all-to-all shards for others
        (reduce-scatter), the exact all-reduce (replicas), the step's finite agreement (one
        float), and, when FSDP's own reduce-scatter runs under the HSDP hook, that FP32
        reduce-scatter. ``bytes_fp32_equivalent``: FSDP's FP32 reduce-scatter,
        ``(N−1)/N·4`` bytes per element, plus for HSDP a ring all-reduce of the shard.
        ``bytes_per_element``: per element of the (padded) unsharded gradient."""
        return {**self.engine.stats(), "residual": self.residual,
                "sender_feedback": self.sender_feedback}

    def state_dict(self) -> dict:
        """This rank's state (residuals differ per rank): tensors and plain containers."""
        return self.engine.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.engine.load_state_dict(state)

    def remove_hooks(self) -> None:
        self._hook.remove()
        self.engine.remove_hooks()


def _units(model: nn.Module, mesh) -> list[tuple[_Unit, FSDPModule]]:
    """A unit per FSDP parameter group: a module that owns none (a root whose children hold
    every parameter) has nothing to reduce, and ``fully_shard([a, b])`` makes a and b share
    one group, installed once."""
    names = {id(p): n for n, p in model.named_parameters()}
    modules = [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError("no fully_shard-ed module found: apply fully_shard first")
    units, seen = [], set()
    for name, module in modules:
        unit = _unit(name, module, names, mesh)
        if unit is not None and id(unit.param_group) not in seen:
            seen.add(id(unit.param_group))
            units.append((unit, module))
    return units


def _unit(name: str, module: FSDPModule, names: dict[int, str], mesh) -> _Unit | None:
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None and hasattr(state, "_fsdp_param_group"):  # torch < 2.12: one or None
        groups = [g for g in (state._fsdp_param_group,) if g is not None]
    if groups is None or not isinstance(groups, list):
        raise RuntimeError(f"GeoFP8: FSDP internals changed: module {name!r} has no "
                           "_fsdp_param_groups list (built for torch 2.13)")
    if not groups:
        return None
    if len(groups) != 1:
        raise ValueError(f"GeoFP8: module {name or '<root>'!r} has {len(groups)} FSDP "
                         "parameter groups (per-parameter meshes via shard_placement_fn?); "
                         "GeoFP8 needs exactly one parameter group per fully_shard unit")
    group = groups[0]
    if mesh is not None:
        own = group.mesh_info.mesh
        if own.ndim != 1 or own != mesh["shard"]:
            raise ValueError("GeoFP8 HSDP: shard the model on mesh['shard'] (a 1-D mesh); "
                             "the replica all-reduce is GeoFP8's own (via the all-reduce "
                             "hook), not FSDP's native HSDP one")
    unames, shapes, trained = [], [], []
    for fp in group.fsdp_params:
        if fp.fsdp_placement.dim != 0:
            raise ValueError(f"GeoFP8: parameter of {name!r} is sharded on dim "
                             f"{fp.fsdp_placement.dim}; only dim-0 sharding is supported")
        pid = id(fp.sharded_param)
        if pid not in names:
            raise RuntimeError(f"GeoFP8: an FSDP parameter of {name!r} is not a parameter "
                               "of the model given to enable()")
        if not fp.sharded_param.requires_grad:
            continue
        unames.append(names[pid])
        shapes.append(tuple(fp._orig_size))
        trained.append(fp)
    return _Unit(name, group, unames, shapes, trained)


def _queue_end_of_backward(callback) -> bool:
    """Run ``callback`` when the current backward ends (after FSDP's own final callback,
    queued earlier); ``False`` outside a backward."""
    try:
        torch.autograd.Variable._execution_engine.queue_callback(callback)
    except RuntimeError:
        return False
    return True


def _divisor(unit: _Unit, op, world: int) -> float:
    """FSDP's reduction: ``AVG`` → ``N``; ``SUM`` → 1; ``PREMUL_SUM`` → the unit's gradient
    divide factor."""
    if op == dist.ReduceOp.AVG:
        return float(world)
    if op == dist.ReduceOp.SUM:
        return 1.0
    factor = unit.param_group.gradient_divide_factor
    if factor is None:
        raise RuntimeError(f"GeoFP8: unexpected reduce-scatter op {op!r} without a "
                           "gradient divide factor")
    return float(factor)


def _flag(values: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """A reduce-scatter's ``then``: its finite flag (its values are written where asked)."""
    return finite


def _pair(values: torch.Tensor, finite: torch.Tensor | None) -> tuple:
    """A launch's ``then``: its value and its finite flag (``None``: not known)."""
    return values, finite


def _spans(shapes: list[tuple[int, ...]]) -> list[tuple[int, int]]:
    out, pos = [], 0
    for shape in shapes:
        n = torch.Size(shape).numel()
        out.append((pos, pos + n))
        pos += n
    return out


def _ratios(e2: float, r2: float, dot: float, g2: float) -> tuple[float, float]:
    """``(‖Ĝ−Ḡ‖/‖Ḡ‖, cos(Ĝ, Ḡ))`` from the four sums (0 and 1 for a zero reference)."""
    return ((e2 / r2) ** 0.5 if r2 > 0 else 0.0,
            dot / (g2 * r2) ** 0.5 if g2 * r2 > 0 else 1.0)


def _row_pieces(rows2d: torch.Tensor, pos: int, rows: int, width: int,
                length: int) -> list[tuple[torch.Tensor, int, int]]:
    """Rows ``0:length`` of a parameter (``width`` elements each) in FSDP's layout
    ``rows2d`` (row ``r``: every parameter's dim-0 chunk ``r`` of ``rows`` rows, the
    parameter's at ``pos``), as views ``(view, lo, hi)``: the whole chunks ``[k, rows,
    width]`` and the last partial one ``[rem, width]`` (FSDP pads the rest with zeros)."""
    chunks = rows2d[:, pos : pos + rows * width].view(len(rows2d), rows, width)
    full, rem = divmod(length, rows) if rows else (0, 0)
    out = [(chunks[:full], 0, full * rows)]
    if rem:
        out.append((chunks[full, :rem], full * rows, length))
    return out


def enable(model: nn.Module, config: GeoFP8Config | FP8Config | None = None, mesh=None,
           reduce_scatter: bool = True, residual: str | None = None,
           sender_feedback: bool | None = None) -> GeoFP8FSDP:
    """Install GeoFP8 on every ``fully_shard`` unit of ``model`` (see :class:`GeoFP8FSDP`).

    FSDP2::

        for block in model.layers: fully_shard(block)
        fully_shard(model)
        state = geofp8.fsdp.enable(model, GeoFP8Config())

    HSDP (2 nodes × 4 GPUs)::

        mesh = init_device_mesh("cuda", (2, 4), mesh_dim_names=("replicate", "shard"))
        ... fully_shard(..., mesh=mesh["shard"]) ...
        state = geofp8.fsdp.enable(model, GeoFP8Config(), mesh=mesh)
    """
    return GeoFP8FSDP(model, config, mesh=mesh, reduce_scatter=reduce_scatter,
                      residual=residual, sender_feedback=sender_feedback)
