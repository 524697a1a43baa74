"""GeoFP8 for sharded training (FSDP2 ``fully_shard``): an exact FP8 reduce-scatter, and the
cross-replica all-reduce of HSDP in exact FP8.

Reduce-scatter (one per ``fully_shard`` unit and backward). FSDP hands a flat buffer
``[N, M]`` whose row ``r`` is every parameter's dim-0 chunk ``r`` (see
:meth:`ShardLayout.for_rows`). Rank ``s`` holds its whole unsharded gradient ``G_{p,s}``:

* route and error feedback per parameter, ``Ũ_{p,s} = G_{p,s} T_p + R_{p,s}`` (the same code
  path as DDP, :class:`geofp8.pipeline.GradientPipeline`; ``T_p`` acts on columns, so it
  commutes with the row chunks);
* every row chunk quantized with this sender's own scales, plus one flag byte ("my input
  was finite"); all-to-all; receiver ``r`` decodes the ``N`` copies of row ``r`` and sums in
  FP32, then maps its rows back by ``T_p⁻¹`` and applies FSDP's ``op`` (``AVG``: ``/N``;
  ``PREMUL_SUM`` after ``set_gradient_divide_factor(f)``: ``/f``). One rounding, no
  all-gather: ``(N−1)/N`` encoded bytes per element and rank, against ``4(N−1)/N`` in FP32.
* non-finite: a sender whose input is not finite says so in its flag; every receiver then
  sets the whole unit's output to NaN, so every rank sees it and the step is settled as
  skipped (nothing committed, as in DDP).

HSDP (``enable(..., mesh=2-D mesh with dims ("replicate", "shard"))``, the model sharded on
``mesh["shard"]``): FSDP's all-reduce hook receives this rank's reduced shard and
all-reduces it over the replicate group with the DDP collective (exact FP8, error feedback
per shard), dividing by the replica count; with or without the FP8 reduce-scatter.

Step boundaries: a step's first reduction starts it; it is settled at the next forward of
the model (or at :meth:`GeoFP8FSDP.stats` / :meth:`GeoFP8FSDP.state_dict`).
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from .codecs import make_codec
from .comm import Communicator, ShardLayout, decode, encode, fp32_allreduce_wire_bytes
from .comm.group import DeviceGroup
from .config import FP8Config, GeoFP8Config
from .feedback import IDENTITY as _IDENTITY
from .feedback import ErrorFeedback
from .ledger import StepLedger
from .pipeline import IDENTITY as ROUTE_IDENTITY
from .pipeline import GradientPipeline

__all__ = ["GeoFP8FSDP", "GeoFP8ReduceScatter", "enable"]

RESIDUALS = ("fp32", "bf16", "fp8")


@dataclass
class _Unit:
    """One ``fully_shard`` unit: its parameter group and its parameters in FSDP's order."""

    name: str
    param_group: object  # torch's FSDPParamGroup
    names: list[str]
    shapes: list[tuple[int, ...]]
    layouts: dict = field(default_factory=dict)  # (kind, world size) -> ShardLayout

    def rows(self, world: int) -> list[tuple[int, int, int]]:
        """Per parameter ``(offset in a row, chunk rows, elements per dim-0 row)``."""
        out, pos = [], 0
        for shape in self.shapes:
            rows, width = -(-shape[0] // world), torch.Size(shape[1:]).numel()
            out.append((pos, rows, width))
            pos += rows * width
        return out


class GeoFP8ReduceScatter(ReduceScatter):
    """FSDP's custom reduce-scatter for one unit (see the module notes); installed by
    :func:`enable`. It runs to completion inside ``__call__`` (returns no work)."""

    def __init__(self, state: GeoFP8FSDP, unit: _Unit) -> None:
        self.state, self.unit = state, unit

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op, async_op: bool = False) -> None:
        self.state._reduce_scatter(self.unit, output_tensor, input_tensor, group, op)


class GeoFP8FSDP:
    """State of GeoFP8 on a ``fully_shard``-ed model: layouts, residuals, counters.

    Args:
        model: the root module, ``fully_shard`` applied (to it and any submodules).
        config: :class:`GeoFP8Config` or :class:`FP8Config` (identical on every rank).
        mesh: ``None`` (FSDP: the FP8 reduce-scatter) or a 2-D ``DeviceMesh`` with dims
            ``("replicate", "shard")`` for HSDP; the model must be sharded on
            ``mesh["shard"]``.
        reduce_scatter: install the FP8 reduce-scatter (default); ``False`` with a mesh: only
            the replica all-reduce is FP8 (the reduce-scatter stays FSDP's FP32 one).
        residual: storage of the error-feedback residuals: ``"fp32"`` (4 bytes per
            parameter and rank), ``"bf16"`` (2) or ``"fp8"`` (1, plus 4 per row).
    """

    def __init__(self, model: nn.Module, config: GeoFP8Config | FP8Config | None = None,
                 mesh=None, reduce_scatter: bool = True, residual: str = "fp32") -> None:
        if not dist.is_initialized():
            raise RuntimeError("GeoFP8FSDP needs torch.distributed to be initialised first")
        if isinstance(config, FP8Config):
            config = config.to_geofp8()
        self.config = config if config is not None else GeoFP8Config()
        cfg = self.config
        if str(getattr(cfg.transform, "value", cfg.transform)) in ("output", "kfac"):
            raise ValueError("GeoFP8 on FSDP: output-side transforms act on rows, which FSDP "
                             "shards; use an input-side transform (lowrank, full, diag, ...)")
        if str(getattr(cfg.factor_source, "value", cfg.factor_source)) == "local":
            raise ValueError("GeoFP8 on FSDP: factor_source='local' is DDP-only; use "
                             "'refresh' or 'fresh'")
        if residual not in RESIDUALS:
            raise ValueError(f"residual must be one of {RESIDUALS}, got {residual!r}")
        if mesh is None and not reduce_scatter:
            raise ValueError("reduce_scatter=False needs an HSDP mesh (nothing would be FP8)")
        self.codec = make_codec(self.config.format, self.config.scaling, self.config.block_size,
                                self.config.rounding)
        self.feedback = ErrorFeedback(storage=residual)  # the HSDP replica stage
        self.ledger = StepLedger()
        self.residual = residual
        self._groups: dict[int, DeviceGroup] = {}
        self._replicate = None
        if mesh is not None:
            if mesh.ndim != 2 or tuple(mesh.mesh_dim_names or ()) != ("replicate", "shard"):
                raise ValueError("the HSDP mesh must be 2-D with dims ('replicate', 'shard'), "
                                 f"got dims {mesh.mesh_dim_names}")
            device = next(model.parameters()).device
            self._replicate = DeviceGroup(mesh["replicate"].get_group(), device)
            self._shard_mesh = mesh["shard"]
        names = {id(p): n for n, p in model.named_parameters()}
        modules = [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]
        if not modules:
            raise ValueError("no fully_shard-ed module found: apply fully_shard first")
        # a unit per FSDP parameter group: a module that owns none (a root whose children
        # hold every parameter) has nothing to reduce, and fully_shard([a, b]) makes a and b
        # share one group, installed once
        units, seen = [], set()
        for name, m in modules:
            unit = self._unit(name, m, names)
            if unit is not None and id(unit.param_group) not in seen:
                seen.add(id(unit.param_group))
                units.append((unit, m))
        self.units = [u for u, _ in units]
        for unit, module in units:
            if reduce_scatter:
                module.set_custom_reduce_scatter(GeoFP8ReduceScatter(self, unit))
            if self._replicate is not None:
                module.set_all_reduce_hook(self._all_reduce_hook(unit, reduce_scatter))
        self._reduce_scatter_installed = reduce_scatter
        self.shadow = False  # set before a backward: measure it against FP32 (see fidelity)
        self._shadow_refs: dict[str, torch.Tensor] = {}
        self._shadow_sums: dict[str, torch.Tensor] = {}
        # routes, factors, selection and the reduce-scatter's residuals: the DDP code path,
        # on the whole world (factors identical on every rank, HSDP replicas included)
        self.world = DeviceGroup(None, next(model.parameters()).device)
        self.pipeline = GradientPipeline(model, cfg, self.world, self.ledger, cfg.candidates,
                                         residual_storage=residual)
        self._hooks = [model.register_forward_pre_hook(self._on_forward), *self.pipeline.hooks]

    def _on_forward(self, *_) -> None:
        self._settle()
        self.pipeline.shared.new_forward()

    # -- set-up ------------------------------------------------------------------------------

    def _unit(self, name: str, module: FSDPModule, names: dict[int, str]) -> _Unit | None:
        state = module._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
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
        if self._replicate is not None:
            mesh = group.mesh_info.mesh
            if mesh.ndim != 1 or mesh != self._shard_mesh:
                raise ValueError("GeoFP8 HSDP: shard the model on mesh['shard'] (a 1-D mesh); "
                                 "the replica all-reduce is GeoFP8's own (via the all-reduce "
                                 "hook), not FSDP's native HSDP one")
        unames, shapes = [], []
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
        return _Unit(name, group, unames, shapes)

    def _device_group(self, group: dist.ProcessGroup, device: torch.device) -> DeviceGroup:
        key = id(group)
        if key not in self._groups:
            self._groups[key] = DeviceGroup(group, device)
        return self._groups[key]

    def _layout(self, unit: _Unit, kind: str, world: int) -> ShardLayout:
        key = (kind, world)
        if key not in unit.layouts:
            if kind == "rows":
                unit.layouts[key] = ShardLayout.for_rows(unit.shapes, self.codec, world, 1)
            else:  # the replica all-reduce of this rank's chunks
                chunks = [(-(-s[0] // self._shard_size(unit)), *s[1:]) for s in unit.shapes]
                unit.layouts[key] = ShardLayout.build(chunks, self.codec, world)
        return unit.layouts[key]

    @staticmethod
    def _shard_size(unit: _Unit) -> int:
        return unit.param_group.mesh_info.shard_mesh_size

    # -- step bookkeeping --------------------------------------------------------------------

    def _begin(self) -> None:
        if self.ledger.phase.value == "idle":
            self.pipeline.start_step(self.ledger.step)
        self.ledger.begin_bucket(last=False)

    def _settle(self) -> None:
        """Commit (finite step) or discard (non-finite) what the last backward produced."""
        if self.ledger.phase.value == "idle":
            return
        finite = self.ledger.finite
        self.pipeline.settle(finite)
        if finite:
            self.feedback.commit()
        else:
            self.feedback.discard()
        self.ledger.add("factor_bytes_sent", self.world.take_bytes().get("factor", 0.0))
        self.ledger.settle()

    @property
    def _fp8(self) -> bool:
        return self.ledger.step >= self.config.warmup_steps

    def _seed(self, unit: _Unit, hop: int) -> int | None:
        """Stochastic rounding's seed for this step, unit and hop (0: the reduce-scatter,
        1: the replica all-reduce)."""
        return self.config.rounding_seed(self.ledger.step, zlib.crc32(unit.name.encode()), hop)

    # -- the reduce-scatter ------------------------------------------------------------------

    def _divisor(self, unit: _Unit, op, world: int) -> float:
        """FSDP's reduction: ``AVG`` → ``N``; ``SUM`` → 1; ``PREMUL_SUM`` → the unit's
        gradient divide factor."""
        if op == dist.ReduceOp.AVG:
            return float(world)
        if op == dist.ReduceOp.SUM:
            return 1.0
        factor = unit.param_group.gradient_divide_factor
        if factor is None:
            raise RuntimeError(f"GeoFP8: unexpected reduce-scatter op {op!r} without a "
                               "gradient divide factor")
        return float(factor)

    def _reduce_scatter(self, unit: _Unit, out: torch.Tensor, inp: torch.Tensor,
                        group: dist.ProcessGroup, op) -> None:
        self._begin()
        dg = self._device_group(group, inp.device)
        n = dg.size
        layout = self._layout(unit, "rows", n)
        if inp.numel() != layout.numel or out.numel() != layout.numel // n:
            raise RuntimeError(
                f"GeoFP8: the reduce-scatter input of {unit.name or '<root>'!r} has "
                f"{inp.numel()} elements, its parameters make {layout.numel}: a parameter "
                "received no gradient this step (set reduce_scatter_unused_params) or FSDP's "
                "layout changed")
        divisor = self._divisor(unit, op, n)
        led = self.ledger
        led.add("elements", inp.numel())
        led.add("bytes_fp32_equivalent", (n - 1) * out.numel() * 4)
        if not self._fp8:
            self._passthrough(out, inp, dg, op, divisor)
            return
        t0 = time.perf_counter()
        flat = inp.float() if inp.dtype != torch.float32 else inp
        exact = flat.clone() if self.shadow else None
        routes = self._prepare(unit, flat.view(n, -1), n)
        finite = torch.ones(1, dtype=torch.uint8, device=flat.device)
        if not bool(torch.isfinite(flat).all()):
            finite.zero_()
        sent = encode(flat, layout, side=[finite] * n, seed=self._seed(unit, 0), sender=dg.rank)
        if self.config.error_feedback:
            self._stage_residuals(unit, (flat - decode(sent, layout)).view(n, -1), n, routes)
        led.add("codec_s", time.perf_counter() - t0)
        led.add("bytes_sent", layout.scatter_bytes(dg.rank))
        total = Communicator("exact", dg).launch(sent, layout, unmap=_poison_unless_flag,
                                                 gather=False).wait()
        if not bool(torch.isfinite(total).all()):
            total.fill_(float("nan"))
            led.finite = False
        else:
            self._map_back(unit, total, n, routes)
        out.copy_(total.div_(divisor) if divisor != 1 else total)
        if exact is not None:  # the FP32 reference, not counted in the bytes
            ref = torch.empty(layout.numel // n, dtype=torch.float32, device=out.device)
            dist.reduce_scatter_single(ref, exact, op=dist.ReduceOp.SUM, group=dg.group)
            self._shadow_refs[unit.name] = ref.div_(divisor)
            if self._replicate is None:
                self._compare(unit, out.float(), n)

    def _compare(self, unit: _Unit, got: torch.Tensor, world: int) -> None:
        """Accumulate ``‖Ĝ−Ḡ‖², ‖Ḡ‖², Ĝ·Ḡ, ‖Ĝ‖²`` per parameter of this rank's shard."""
        ref = self._shadow_refs.pop(unit.name)
        for name, (pos, rows, width) in zip(unit.names, unit.rows(world)):
            g, r = got[pos : pos + rows * width], ref[pos : pos + rows * width]
            self._shadow_sums[name] = torch.stack([(g - r).pow(2).sum(), r.pow(2).sum(),
                                                   g @ r, g.pow(2).sum()]).double()

    def fidelity(self) -> tuple[dict[str, dict[str, float]], float, float]:
        """``({parameter: {"rel_l2", "cos"}}, rel_l2, cos)`` of the last backward run with
        :attr:`shadow` set: the communicated gradient against FSDP's FP32 reduction of
        the same gradients (reduce-scatter, and the replica all-reduce under HSDP).
        Collective over the world; call it on every rank after the backward."""
        names = [n for u in self.units for n in u.names]
        sums = torch.stack([self._shadow_sums.get(n, torch.zeros(4, dtype=torch.float64))
                            for n in names])
        self._shadow_sums = {}
        dist.all_reduce(sums)  # HSDP replicas count twice in every term: ratios unchanged
        out = {}
        for name, (e2, r2, dot, g2) in zip(names, sums.tolist()):
            out[name] = {"rel_l2": (e2 / r2) ** 0.5 if r2 > 0 else 0.0,
                         "cos": dot / (g2 * r2) ** 0.5 if g2 * r2 > 0 else 1.0}
        e2, r2, dot, g2 = sums.sum(0).tolist()
        return out, (e2 / r2) ** 0.5 if r2 > 0 else 0.0, \
            dot / (g2 * r2) ** 0.5 if g2 * r2 > 0 else 1.0

    def _passthrough(self, out, inp, dg: DeviceGroup, op, divisor: float) -> None:
        """FP32, as FSDP's default does (``PREMUL_SUM``, which gloo lacks: ``·(1/f)`` then
        ``SUM``)."""
        self.ledger.add("bytes_sent", (dg.size - 1) * out.numel() * out.element_size())
        if op != dist.ReduceOp.AVG and op != dist.ReduceOp.SUM:
            inp.mul_(1.0 / divisor)
            op = dist.ReduceOp.SUM
        dist.reduce_scatter_single(out, inp, group=dg.group, op=op)

    # -- error feedback over FSDP's row layout ----------------------------------------------

    def _prepare(self, unit: _Unit, rows2d: torch.Tensor, n: int) -> list:
        """``Ũ = G T + R`` in place, parameter by parameter, through the pipeline (the rows
        of a parameter are the same dim-0 chunks in every row of ``rows2d``)."""
        routes = []
        for name, shape, (pos, rows, width) in zip(unit.names, unit.shapes, unit.rows(n)):
            view = rows2d[:, pos : pos + rows * width]
            G = view.reshape(n * rows, width)[: shape[0]].reshape(shape)
            U = torch.empty(shape, dtype=torch.float32, device=rows2d.device)
            routes.append(self.pipeline.prepare_into(name, G, U))
            padded = rows2d.new_zeros(n * rows, width)
            padded[: shape[0]] = U.reshape(shape[0], width)
            view.copy_(padded.view(n, rows * width))
        return routes

    def _stage_residuals(self, unit: _Unit, rows2d: torch.Tensor, n: int, routes) -> None:
        for name, shape, (pos, rows, width), route in zip(unit.names, unit.shapes,
                                                           unit.rows(n), routes):
            full = rows2d[:, pos : pos + rows * width].reshape(n * rows, width)
            self.pipeline.feedback.stage(name, full[: shape[0]].reshape(shape).clone(), route)

    def _map_back(self, unit: _Unit, total: torch.Tensor, n: int, routes) -> None:
        """This rank's summed rows of each routed weight, ``Y T⁻¹`` (``T`` acts on columns)."""
        for (pos, rows, width), route in zip(unit.rows(n), routes):
            if route is not ROUTE_IDENTITY:
                Y = total[pos : pos + rows * width].view(rows, width)
                Y.copy_(self.pipeline.map_back(route, Y))

    # -- HSDP: the replica all-reduce --------------------------------------------------------

    def _all_reduce_hook(self, unit: _Unit, ours: bool):
        def hook(reduce_output: torch.Tensor) -> None:
            self._replica_all_reduce(unit, reduce_output, ours)
        return hook

    def _replica_all_reduce(self, unit: _Unit, shard: torch.Tensor, ours: bool) -> None:
        """Exact FP8 all-reduce of this rank's reduced shard over the replicate group."""
        if not ours:
            self._begin()
        rep = self._replicate
        n = rep.size
        layout = self._layout(unit, "replica", n)
        led = self.ledger
        led.add("bytes_fp32_equivalent", fp32_allreduce_wire_bytes(shard.numel(), n))
        if not ours:  # FSDP's own FP32 reduce-scatter ran before: count it too
            size = self._shard_size(unit)
            led.add("elements", size * shard.numel())
            for key in ("bytes_sent", "bytes_fp32_equivalent"):
                led.add(key, (size - 1) * shard.numel() * 4)
        # FSDP divided by the shard group only; divide by the replicas unless the user set
        # their own divide factor (then it is the whole division)
        divisor = n if unit.param_group.gradient_divide_factor is None else 1
        x = shard.float() if shard.dtype != torch.float32 else shard.clone()
        if self.shadow and not ours:  # FSDP's FP32 reduce-scatter: this shard is exact
            self._shadow_refs[unit.name] = x.clone()
        if not ours:  # FSDP's FP32 reduce-scatter poisons only some shards: agree first
            shard_group = self._device_group(unit.param_group.mesh_info.shard_process_group,
                                             shard.device)
            bad = torch.tensor([0.0 if bool(torch.isfinite(x).all()) else 1.0])
            bad, _ = shard_group.all_reduce(bad, "flag")
            led.add("bytes_sent", 2 * (shard_group.size - 1) * 4 // shard_group.size)
            if float(bad) > 0:
                x.fill_(float("nan"))
        if not self._fp8:
            led.add("bytes_sent", fp32_allreduce_wire_bytes(x.numel(), n))
            x, _ = rep.all_reduce(x, "payload")
        else:
            t0 = time.perf_counter()
            chunks = self._chunk_shapes(unit)
            if self.config.error_feedback:
                self._add_chunk_residuals(unit, chunks, x)
            seed = self._seed(unit, 1)
            sent = encode(x, layout, seed=seed, sender=rep.rank)
            if self.config.error_feedback:
                self._stage_chunk_residuals(unit, chunks, x - decode(sent, layout))
            led.add("codec_s", time.perf_counter() - t0)
            led.add("bytes_sent", layout.wire_bytes(rep.rank))
            x = Communicator("exact", rep).launch(sent, layout, gather=True, seed=seed).wait()
        if not bool(torch.isfinite(x).all()):
            led.finite = False
        shard.copy_(x.div_(divisor) if divisor != 1 else x)
        if self.shadow and unit.name in self._shadow_refs:
            ref = self._shadow_refs[unit.name]
            dist.all_reduce(ref, group=rep.group)
            ref.div_(divisor)
            self._compare(unit, shard.float(), self._shard_size(unit))

    def _chunk_shapes(self, unit: _Unit) -> list[tuple[int, ...]]:
        size = self._shard_size(unit)
        return [(-(-s[0] // size), *s[1:]) for s in unit.shapes]

    def _add_chunk_residuals(self, unit, chunks, x: torch.Tensor) -> None:
        pos = 0
        for name, chunk in zip(unit.names, chunks):
            k = torch.Size(chunk).numel()
            residual = self.feedback.residual_in(name + REPLICA, _IDENTITY)
            if residual is not None:
                x[pos : pos + k] += residual.reshape(-1)
            pos += k

    def _stage_chunk_residuals(self, unit, chunks, residual: torch.Tensor) -> None:
        pos = 0
        for name, chunk in zip(unit.names, chunks):
            k = torch.Size(chunk).numel()
            self.feedback.stage(name + REPLICA, residual[pos : pos + k].view(chunk).clone(),
                                _IDENTITY)
            pos += k

    # -- reporting and checkpoints -----------------------------------------------------------

    def stats(self) -> dict:
        """Figures of the last settled step (as :meth:`geofp8.GeoFP8State.stats`).

        ``bytes_sent``: what this rank put on the wire: the all-to-all shards for others
        (reduce-scatter), the exact all-reduce (replicas), the flag all-reduce when FSDP's
        own reduce-scatter runs under the HSDP hook (and that FP32 reduce-scatter itself).
        ``bytes_fp32_equivalent``: FSDP's FP32 reduce-scatter, ``(N−1)/N·4`` bytes per
        element, plus for HSDP a ring all-reduce of the shard. ``bytes_per_element``: per
        element of the (padded) unsharded gradient."""
        self._settle()
        last = self.ledger.last
        return {
            "step": self.ledger.step,
            "skipped_steps": self.ledger.skipped_steps,
            "bytes_sent": int(last["bytes_sent"] + last["factor_bytes_sent"]),
            "payload_bytes_sent": int(last["bytes_sent"]),
            "factor_bytes_sent": int(last["factor_bytes_sent"]),
            "factor_bytes": self.pipeline.factor_nbytes,
            "bytes_fp32_equivalent": int(last["bytes_fp32_equivalent"]),
            "bytes_per_element": (last["bytes_sent"] + last["factor_bytes_sent"]) /
            last["elements"]
            if last["elements"] else 0.0,
            "geometry_layers": self.pipeline.geometry_layers(),
            "codec_s": last["codec_s"],
            "transform_s": last["transform_s"],
            "statistics_s": last["statistics_s"],
            "ef_bytes": self.pipeline.feedback.nbytes + self.feedback.nbytes,
            "residual": self.residual,
        }

    def state_dict(self) -> dict:
        """This rank's state (residuals differ per rank): tensors and plain containers."""
        self._settle()
        return {"version": 1, "config": self.config.to_dict(), "residual": self.residual,
                "step": self.ledger.step, "skipped_steps": self.ledger.skipped_steps,
                "pipeline": self.pipeline.state_dict(), "replica": self.feedback.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("config") != self.config.to_dict() or state.get("residual") != \
                self.residual:
            raise ValueError("GeoFP8FSDP checkpoint was written with another config or "
                             "residual storage")
        self.ledger.step = int(state["step"])
        self.ledger.skipped_steps = int(state["skipped_steps"])
        self.ledger.reset_phase()
        self.pipeline.load_state_dict(state["pipeline"])
        self.feedback.load_state_dict(state["replica"], {})

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


REPLICA = "#replica"


def _poison_unless_flag(values: torch.Tensor, side: torch.Tensor) -> torch.Tensor:
    """Per-sender decoding: a sender whose flag byte says "not finite" poisons the shard."""
    return values if int(side[0]) == 1 else values.fill_(float("nan"))


def enable(model: nn.Module, config: GeoFP8Config | FP8Config | None = None, mesh=None,
           reduce_scatter: bool = True, residual: str = "fp32") -> GeoFP8FSDP:
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
                      residual=residual)

