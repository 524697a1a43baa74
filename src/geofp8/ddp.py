"""GeoFP8 DDP communication hook: FP8 all-reduce in geometry-aware coordinates.

For a bucket holding gradients ``G_p`` of parameters ``p`` on rank ``r``:

* route: ``G̃_p = G_p T_p`` for the selected 2-D Linear weights (``T_p ≈ A_p^{-1/2}``,
  identical on every rank), ``G̃_p = G_p`` for everything else;
* error feedback: ``Ũ_p = G̃_p + R_p``; one flat FP8 payload per bucket;
* :class:`geofp8.comm.Communicator`: exact all-reduce, per-rank scales honoured,
  the sum done in FP32;
* map back: ``Ĝ_p = (Σ_r Ũ_{p,r} quantized) / N · T_p⁻¹``, and ``R_p ← Ũ_p − deq(Q(Ũ_p))``.

Example::

    >>> from geofp8 import GeoFP8Config, GeoFP8State, geofp8_hook
    >>> state = GeoFP8State(model, GeoFP8Config(format="e4m3"))
    >>> ddp_model = DistributedDataParallel(model)
    >>> ddp_model.register_comm_hook(state, geofp8_hook)

Step bookkeeping: a step ends when DDP hands over its last bucket; its statistics,
residuals and counters are committed at the next forward of the model only if every
bucket came back finite. A step whose gradient was non-finite on any rank returns NaN
for its buckets on every rank (so ``GradScaler`` or the caller skips it) and leaves no
trace in the state: the next finite step sees exactly the state it would have seen.
"""

# No `from __future__ import annotations`: DDP inspects the hooks' annotations at runtime.
import io
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .codecs import make_codec
from .comm import (
    Communicator,
    ShardLayout,
    decode,
    encode,
    fp32_allreduce_wire_bytes,
    wire_bytes,
)
from .comm.group import DeviceGroup
from .config import FP8Config, GeoFP8Config
from .geometry.statistics import SecondMoment, nystrom_factor, sketch_matrix
from .geometry.transforms import (
    BlockInput,
    DiagonalInput,
    Hadamard,
    Identity,
    LowRankInput,
    OutputSide,
    Transform,
    TwoSided,
    full_input,
    rebase,
)

__all__ = [
    "FP8State",
    "GeoFP8State",
    "HadamardFP8State",
    "fp8_hook",
    "geofp8_hook",
    "hadamard_fp8_hook",
]

IDENTITY = Identity()
SUPPORTED_BACKENDS = ("gloo", "nccl")


@dataclass
class _Layer:
    """A candidate Linear layer: its weight's name and the statistics of its input/output."""

    module_name: str
    param_name: str
    d_in: int
    d_out: int
    pending_A: SecondMoment | None = None  # this step (all micro-batches)
    window_A: SecondMoment | None = None  # committed since the last refresh
    pending_S: SecondMoment | None = None
    window_S: SecondMoment | None = None
    fresh_works: list = field(default_factory=list)  # (work, buffer) of this step's sketches


def _serialize(obj) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _deserialize(data: torch.Tensor):
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=False)


class GeoFP8State:
    """State of :func:`geofp8_hook`: routing, factors, error-feedback residuals, counters.

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
        self.group = process_group
        backend = dist.get_backend(process_group)
        if backend not in SUPPORTED_BACKENDS:
            raise ValueError(f"GeoFP8 supports the {SUPPORTED_BACKENDS} backends, got {backend!r}")
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.codec = make_codec(self.config.format, self.config.scaling, self.config.block_size)
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.communicator = Communicator(self.config.collective,
                                         DeviceGroup(process_group, device))
        self._names = {id(p): n for n, p in model.named_parameters()}
        unsupported = [f"{n} ({p.dtype})" for n, p in model.named_parameters()
                       if p.requires_grad and not p.is_floating_point()]
        if unsupported:  # complex: DDP's bucket has 2n reals, the hook saw n
            raise TypeError("GeoFP8 communicates real floating-point gradients; "
                            f"unsupported parameters: {unsupported[:3]}")
        self._param_shapes = [(n, tuple(p.shape), str(p.dtype), p.requires_grad)
                              for n, p in model.named_parameters()]
        self.layers = self._find_layers(model)
        self._layer_index = {name: i for i, name in enumerate(self.layers)}
        self.selected: set[str] = self._initial_selection()
        self.transforms: dict[str, Transform] = {}
        self.residuals: dict[str, torch.Tensor] = {}
        self.residual_basis: dict[str, Transform] = {}  # coordinates each residual is in
        self._step_transforms: dict[str, Transform] = {}  # fresh factors of this step
        self._omegas: dict[int, torch.Tensor] = {}
        self.step = 0
        self.skipped_steps = 0
        self.grad_scaler = grad_scaler
        self.grad_scale = 1.0
        self._layouts: dict[tuple, ShardLayout] = {}
        self._checked = False
        self._in_step = False
        self._launched = False
        self._step_finite = True
        self._measure_now = False
        self._measurements: torch.Tensor | None = None
        self._staged_residuals: dict[str, torch.Tensor] = {}
        self.last_measurement: dict[str, dict[str, float]] = {}
        self.profile_scores: dict[str, float] = {}
        self._profile_scores = torch.zeros(len(self.layers), dtype=torch.float64)
        self._pending_profile = torch.zeros_like(self._profile_scores)  # this step's
        self._counters = self._zero_counters()
        self._last = self._zero_counters()
        self._hooks = [model.register_forward_pre_hook(self._on_model_forward)]
        if self.config.transform == "hadamard":
            self.transforms = {n: Hadamard(l.d_in, seed=self.config.seed)
                               for n, l in self.layers.items()}
        elif self._needs_statistics:
            self._attach_statistics(model)

    # -- set-up ------------------------------------------------------------------------------

    @property
    def _needs_statistics(self) -> bool:
        cfg = self.config
        return cfg.transform not in ("hadamard", "euclidean") and cfg.layers != "none"

    def _find_layers(self, model: nn.Module) -> dict[str, _Layer]:
        cfg = self.config
        modules = dict(model.named_modules())
        if isinstance(cfg.layers, (list, tuple)):
            unknown = [n for n in cfg.layers if not isinstance(modules.get(n), nn.Linear)]
            if unknown:
                raise ValueError(f"GeoFP8Config.layers names no nn.Linear module: {unknown}")
        layers = {}
        for name, mod in modules.items():
            if not isinstance(mod, nn.Linear) or not mod.weight.requires_grad:
                continue
            if min(mod.in_features, mod.out_features) < cfg.min_dim:
                continue
            pname = f"{name}.weight" if name else "weight"
            if self._names.get(id(mod.weight)) != pname:  # tied to another parameter
                continue
            layers[pname] = _Layer(name, pname, mod.in_features, mod.out_features)
        return layers

    def _initial_selection(self) -> set[str]:
        layers = self.config.layers
        if layers == "all":
            return set(self.layers)
        if isinstance(layers, (list, tuple)):
            return {f"{n}.weight" for n in layers} & set(self.layers)
        return set()  # none / auto / profile start Euclidean

    def _attach_statistics(self, model: nn.Module) -> None:
        cfg = self.config
        modules = dict(model.named_modules())
        for layer in self.layers.values():
            module = modules[layer.module_name]
            if cfg.factor_source == "fresh":
                self._hooks.append(module.register_forward_pre_hook(self._fresh_sketcher(layer)))
                continue
            if cfg.factor_source == "local":  # this rank's own sketch of this step, never reduced
                layer.pending_A = SecondMoment(layer.d_in, "sketch", seed=cfg.seed,
                                               sketch_size=cfg.rank + cfg.oversample)
                self._hooks.append(module.register_forward_pre_hook(self._input_recorder(layer)))
                continue
            mode = cfg.statistics
            if mode == "auto":
                mode = "sketch" if cfg.transform == "lowrank" and layer.d_in > cfg.sketch_above \
                    else "exact"
            device = modules[layer.module_name].weight.device

            def moment(dim, mode=mode, device=device):
                return SecondMoment(dim, mode, sketch_size=cfg.rank + cfg.oversample,
                                    seed=cfg.seed, device=device)

            layer.pending_A, layer.window_A = moment(layer.d_in), moment(layer.d_in)
            self._hooks.append(module.register_forward_pre_hook(self._input_recorder(layer)))
            if cfg.transform in ("output", "kfac"):
                layer.pending_S = moment(layer.d_out, "exact")
                layer.window_S = moment(layer.d_out, "exact")
                self._hooks.append(module.register_forward_hook(self._output_recorder(layer)))

    def _input_recorder(self, layer: _Layer):
        def record(module, args):
            if module.training and torch.is_grad_enabled():
                t0 = time.perf_counter()
                layer.pending_A.update(args[0])
                self._counters["statistics_s"] += time.perf_counter() - t0
        return record

    def _fresh_sketcher(self, layer: _Layer):
        """Forward pre-hook of ``factor_source="fresh"``: sketch this micro-batch's
        ``Σ x xᵀ Ω`` (``d_in × (k+p)``), its trace and token count, and launch their SUM
        all-reduce at once, so it overlaps the rest of the forward and the backward."""
        def sketch(module, args):
            if not (module.training and torch.is_grad_enabled()):
                return
            t0 = time.perf_counter()
            x = args[0].detach().reshape(-1, layer.d_in).float()
            omega = self._omega(layer.d_in, x.device)
            buf = torch.cat([(x.T @ (x @ omega)).reshape(-1), x.pow(2).sum().reshape(1),
                             torch.tensor([float(x.shape[0])], device=x.device)])
            work = dist.all_reduce(buf, group=self.group, async_op=True)
            layer.fresh_works.append((work, buf))
            self._counters["factor_bytes_sent"] += fp32_allreduce_wire_bytes(
                buf.numel(), self.world_size)
            self._counters["statistics_s"] += time.perf_counter() - t0
        return sketch

    def _omega(self, dim: int, device) -> torch.Tensor:
        """The Gaussian test matrix for width ``dim``, from the shared seed (same on all ranks)."""
        if dim not in self._omegas:
            self._omegas[dim] = sketch_matrix(dim, self.config.rank + self.config.oversample,
                                            self.config.seed, torch.float32, device)
        return self._omegas[dim]

    def _build_fresh(self, layer: _Layer) -> None:
        """Wait for this step's reduced sketches of ``layer`` (normally long done) and build
        its low-rank transform by Nyström. Every rank holds the same reduced sketch and runs
        the same deterministic factorisation, so the transforms are bit-identical."""
        t0 = time.perf_counter()
        total = None
        for work, buf in layer.fresh_works:
            work.wait()
            total = buf if total is None else total + buf
        layer.fresh_works.clear()
        tokens = float(total[-1])
        if tokens > 0 and bool(torch.isfinite(total).all()):
            d, omega = layer.d_in, self._omega(layer.d_in, total.device)
            Y = total[: d * omega.shape[1]].view(d, omega.shape[1]) / tokens
            factor = nystrom_factor(Y, omega, min(self.config.rank, d), float(total[-2]) / tokens)
            self._step_transforms[layer.param_name] = LowRankInput(factor, self.config.damping)
        self._counters["transform_s"] += time.perf_counter() - t0

    def _output_recorder(self, layer: _Layer):
        def record(module, args, output):
            if module.training and torch.is_grad_enabled() and output.requires_grad:
                output.register_hook(lambda grad: layer.pending_S.update(grad))
        return record

    def remove_hooks(self) -> None:
        """Detach the statistics hooks from the model."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # -- step bookkeeping --------------------------------------------------------------------

    @staticmethod
    def _zero_counters() -> dict[str, float]:
        keys = ("bytes_sent", "bytes_fp32_equivalent", "factor_bytes_sent", "elements",
                "codec_s", "transform_s", "statistics_s")
        return dict.fromkeys(keys, 0.0)

    def _on_model_forward(self, module, args) -> None:
        self._finish_step()

    def _finish_step(self) -> None:
        """Commit (finite step) or discard (non-finite step) what the last step produced."""
        if not self._launched:
            return
        self._launched = False
        for layer in self.layers.values():
            for pending, window in ((layer.pending_A, layer.window_A),
                                    (layer.pending_S, layer.window_S)):
                if pending is None:
                    continue
                if self._step_finite and window is not None:
                    for w, p in zip(window.tensors(), pending.tensors()):
                        w.add_(p)
                pending.reset()
        if self._step_finite:
            self.step += 1
            self._commit_residuals()
            self._profile_scores += self._pending_profile
            self.transforms.update(self._step_transforms)
        else:
            self.skipped_steps += 1
            self._measurements = None
        for layer in self.layers.values():
            layer.fresh_works.clear()
        self._staged_residuals, self._step_transforms = {}, {}
        self._pending_profile.zero_()
        self._step_finite = True
        self._last = self._counters
        self._counters = self._zero_counters()

    def _begin_step(self) -> None:
        cfg = self.config
        self._finish_step()  # in case no forward of the model came between two backwards
        self._in_step = True
        if self.grad_scaler is not None and self.grad_scaler.is_enabled():
            self.set_grad_scale(float(self.grad_scaler.get_scale()))
        if self._measurements is not None:
            self._apply_auto_selection()
        if cfg.layers == "profile" and self.step == cfg.warmup_steps + cfg.profile_steps:
            self._finish_profile()
        self._measure_now = False
        if self._needs_statistics and self.step % cfg.refresh_every == 0:
            if cfg.factor_source == "refresh" and self.step > 0:
                self._refresh()
            self._measure_now = cfg.layers == "auto" and (self.step > 0 or
                                                          cfg.factor_source != "refresh")

    def set_grad_scale(self, scale: float) -> None:
        """The loss scale of the coming backward: rescale the residuals if it changed."""
        if scale != self.grad_scale:
            for residual in self.residuals.values():
                residual.mul_(scale / self.grad_scale)
            self.grad_scale = float(scale)

    # -- the hook ----------------------------------------------------------------------------

    def communicate(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """Launch this bucket's all-reduce; the future's value is the averaged gradient."""
        if not self._checked:
            self._check_consistency()
        if not self._in_step:
            self._begin_step()
        last = bucket.is_last()
        if last:
            self._in_step, self._launched = False, True
        buffer = bucket.buffer()
        self._counters["bytes_fp32_equivalent"] += fp32_allreduce_wire_bytes(
            buffer.numel(), self.world_size)
        self._counters["elements"] += buffer.numel()
        if self.step < self.config.warmup_steps:
            return self._fp32_allreduce(buffer)
        return self._fp8_allreduce(bucket, buffer, last)

    def _fp32_allreduce(self, buffer: torch.Tensor) -> torch.futures.Future:
        """Full precision, exactly as DDP's default: divide by N, then SUM all-reduce."""
        self._counters["bytes_sent"] += fp32_allreduce_wire_bytes(
            buffer.numel(), self.world_size, buffer.element_size())
        self.communicator.flush()
        work = dist.all_reduce(buffer.div_(self.world_size), group=self.group, async_op=True)

        def average(fut):
            out = fut.value()[0]
            if not bool(torch.isfinite(out).all()):
                self._step_finite = False
            return out
        return work.get_future().then(average)

    def _fp8_allreduce(self, bucket: dist.GradBucket, buffer: torch.Tensor, last: bool):
        cfg = self.config
        names, grads = [], []
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            if id(p) not in self._names:
                raise RuntimeError("a bucket holds a parameter that is not in the model given to "
                                   "GeoFP8State: pass the module that DDP wraps")
            names.append(self._names[id(p)])
            grads.append(g)
        t0 = time.perf_counter()
        local_source = cfg.factor_source == "local"
        for name in names:
            if name in self.layers and self.layers[name].fresh_works:
                self._build_fresh(self.layers[name])
            if local_source and name in self.layers:
                self._build_local(self.layers[name])
        routes = [self._route(n) for n in names]
        # per-sender decoding: the receiver maps these back with each sender's own factor
        local = tuple(local_source and n in self.selected and n in self.layers for n in names)
        shapes = [tuple(g.shape) for g in grads]
        flat = torch.empty(buffer.numel(), dtype=torch.float32, device=buffer.device)
        pos = 0
        for name, g, t in zip(names, grads, routes):  # Ũ = G T + R, written into its slot
            G = g.detach().float()
            if name in self.layers and self._measure_now:
                self._measure(name, G)
            if name in self.layers and self._profiling:
                self._profile(name, G)
            x = G if t is IDENTITY else t.forward(G)
            slot = flat[pos : pos + G.numel()].view(G.shape)
            residual = self._residual_in(name, t) if cfg.error_feedback else None
            if residual is None:
                slot.copy_(x)
            else:
                torch.add(x, residual, out=slot)
            pos += G.numel()
        flat = flat[:pos]
        t1 = time.perf_counter()
        layout = self._layout(shapes, local)
        side = self._local_side(shapes, local, routes, layout) if any(local) else None
        sent = encode(flat, layout, side)
        if cfg.error_feedback:  # R ← Ũ − deq(Q(Ũ)), in place of the decoded copy
            residual = decode(sent, layout)
            torch.sub(flat, residual, out=residual)
            self._stage_residuals(names, shapes, routes, residual)
        t2 = time.perf_counter()
        self._counters["transform_s"] += t1 - t0
        self._counters["codec_s"] += t2 - t1
        side_sent = sum(layout.side[j] for j in range(self.world_size) if j != self.rank)
        self._counters["bytes_sent"] += wire_bytes(layout, self.rank, cfg.collective) - side_sent
        self._counters["factor_bytes_sent"] += side_sent
        offsets = [(g.data_ptr() - buffer.data_ptr()) // g.element_size() for g in grads]
        unmap = self._local_unmap(shapes, local, layout) if any(local) else None

        def map_back(fut: torch.futures.Future) -> torch.Tensor:
            total = fut.value()
            if total.numel() and torch.isnan(total[0]):  # poisoned: all-or-nothing
                self._step_finite = False
                return buffer.fill_(float("nan"))
            t3 = time.perf_counter()
            total.div_(self.world_size)
            pos = 0
            for shape, t, off, mapped in zip(shapes, routes, offsets, local):
                n = torch.Size(shape).numel()
                y = total[pos : pos + n].view(shape)
                y = y if t is IDENTITY or mapped else t.inverse(y)
                buffer[off : off + n].copy_(y.reshape(-1))
                pos += n
            self._counters["transform_s"] += time.perf_counter() - t3
            return buffer

        return self.communicator.launch(sent, layout, last, unmap).then(map_back)

    def _transform(self, name: str) -> Transform | None:
        """This step's geometry transform of ``name`` (fresh if built this step), if any."""
        return self._step_transforms.get(name, self.transforms.get(name))

    def _route(self, name: str) -> Transform:
        transform = self._transform(name) if name in self.selected else None
        return IDENTITY if transform is None else transform

    def _layout(self, shapes: list[tuple[int, ...]], local: tuple[bool, ...]) -> ShardLayout:
        key = (tuple(shapes), local)
        if key not in self._layouts:
            side = [self._local_factor_bytes(shape[1]) if mapped else 0
                    for shape, mapped in zip(shapes, local)]
            self._layouts[key] = ShardLayout.build(shapes, self.codec, self.world_size,
                                                   list(local), side)
        return self._layouts[key]

    # -- per-sender (local) factors ----------------------------------------------------------

    def _local_rank(self, d_in: int) -> int:
        return min(self.config.rank, d_in)

    def _local_factor_bytes(self, d_in: int) -> int:
        """``U`` (``d_in × k``), ``d_inv`` (``k``) and ``c_inv`` as float32."""
        k = self._local_rank(d_in)
        return 4 * (d_in * k + k + 1)

    def _build_local(self, layer: _Layer) -> None:
        """This rank's own low-rank factor of this step (Nyström of its local sketch)."""
        stats = layer.pending_A
        if layer.param_name in self._step_transforms or float(stats.weight) <= 0:
            return
        factor = stats.factor(self._local_rank(layer.d_in))
        if factor.rank == self._local_rank(layer.d_in) and bool(torch.isfinite(factor.U).all()):
            self._step_transforms[layer.param_name] = LowRankInput(factor, self.config.damping)

    def _local_side(self, shapes, local, routes, layout: ShardLayout) -> list[torch.Tensor]:
        """Per shard: this sender's inverse map of every per-sender-decoded tensor in it."""
        blobs = {}
        for i, (shape, mapped, t) in enumerate(zip(shapes, local, routes)):
            if not mapped:
                continue
            d, k = shape[1], self._local_rank(shape[1])
            if isinstance(t, LowRankInput):
                parts = [t.U.reshape(-1), t.d_inv, torch.tensor([t.c_inv])]
            else:  # no factor on this rank this step: the identity map
                parts = [torch.zeros(d * k + k), torch.ones(1)]
            blobs[i] = torch.cat([p.float().cpu() for p in parts]).view(torch.uint8)
        return [torch.cat([blobs[i] for i in layout.owners[j] if i in blobs] or
                          [torch.zeros(0, dtype=torch.uint8)])
                for j in range(layout.world_size)]

    def _local_unmap(self, shapes, local, layout: ShardLayout):
        """``unmap(values, side)`` for this receiver's shard: ``V T_r⁻¹`` per sender ``r``."""
        j = self.rank

        def unmap(values: torch.Tensor, side: torch.Tensor) -> torch.Tensor:
            pos = spos = 0
            for (lo, hi), i in zip(layout.segments[j], layout.owners[j]):
                if local[i]:
                    d, k = shapes[i][1], self._local_rank(shapes[i][1])
                    nb = self._local_factor_bytes(d)
                    f = side[spos : spos + nb].clone().view(torch.float32)
                    U, d_inv, c_inv = f[: d * k].view(d, k), f[d * k : d * k + k], f[-1]
                    V = values[pos : pos + hi - lo].view(-1, d)
                    values[pos : pos + hi - lo] = (V * c_inv + ((V @ U) * d_inv) @ U.T).view(-1)
                    spos += nb
                pos += hi - lo
            return values
        return unmap

    # -- error feedback ----------------------------------------------------------------------

    def _stage_residuals(self, names, shapes, routes, residual: torch.Tensor) -> None:
        pos = 0
        for name, shape, route in zip(names, shapes, routes):
            n = torch.Size(shape).numel()
            self._staged_residuals[name] = (residual[pos : pos + n].view(shape), route)
            pos += n

    def _commit_residuals(self) -> None:
        for name, (residual, basis) in self._staged_residuals.items():
            self.residuals[name], self.residual_basis[name] = residual, basis

    def _residual_in(self, name: str, route: Transform) -> torch.Tensor | None:
        """The committed residual in ``route``'s coordinates, ``R T_basis⁻¹ T_route``: its
        Euclidean meaning is kept whenever a refresh or a selection changes the route."""
        residual = self.residuals.get(name)
        if residual is None:
            return None
        basis = self.residual_basis.get(name, IDENTITY)
        return residual if basis is route else rebase(residual, basis, route)

    # -- factors -----------------------------------------------------------------------------

    def _refresh(self) -> None:
        """Reduce the window's statistics, build each layer's transform on one owner rank and
        broadcast it (residuals follow lazily, see :meth:`_residual_in`)."""
        t0 = time.perf_counter()
        layers = list(self.layers.values())
        tensors = [t for l in layers for m in (l.window_A, l.window_S) if m is not None
                   for t in m.tensors()]
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat, group=self.group)
        self._counters["factor_bytes_sent"] += fp32_allreduce_wire_bytes(
            flat.numel(), self.world_size, flat.element_size())
        pos = 0
        for t in tensors:
            t.copy_(flat[pos : pos + t.numel()].view_as(t))
            pos += t.numel()
        mine = {l.param_name: self._build_transform(l) for i, l in enumerate(layers)
                if i % self.world_size == self.rank and float(l.window_A.weight) > 0}
        new: dict[str, Transform] = {}
        for src in range(self.world_size):
            new.update(self._broadcast_object(mine if src == self.rank else None, src))
        self.transforms.update(new)
        for l in layers:
            for m in (l.window_A, l.window_S):
                if m is not None:
                    m.reset()
        self._counters["transform_s"] += time.perf_counter() - t0

    def _build_transform(self, layer: _Layer) -> Transform:
        cfg, A = self.config, layer.window_A
        if cfg.transform == "lowrank":
            return LowRankInput(A.factor(min(cfg.rank, layer.d_in)), cfg.damping)
        if cfg.transform == "full":
            return full_input(A.mean(), cfg.damping)
        if cfg.transform == "diag":
            return DiagonalInput(A.mean(), cfg.damping)
        if cfg.transform == "block":
            return BlockInput(A.mean(), cfg.transform_block, cfg.damping)
        if cfg.transform == "output":
            return OutputSide(layer.window_S.mean(), cfg.damping)
        return TwoSided(A.mean(), layer.window_S.mean(), cfg.damping)

    def _broadcast_object(self, obj, src: int):
        """Bit-exact broadcast of a picklable object (length first, then the bytes)."""
        data = _serialize(obj) if src == self.rank else None
        length = torch.tensor([data.numel() if data is not None else 0], dtype=torch.int64)
        dist.broadcast(length, src=self._global(src), group=self.group)
        if data is None:
            data = torch.empty(int(length), dtype=torch.uint8)
        dist.broadcast(data, src=self._global(src), group=self.group)
        if src == self.rank:
            self._counters["factor_bytes_sent"] += (self.world_size - 1) * (data.numel() + 8)
        return _deserialize(data)

    def _global(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    # -- selection ---------------------------------------------------------------------------

    @property
    def _profiling(self) -> bool:
        cfg = self.config
        return cfg.layers == "profile" and \
            cfg.warmup_steps <= self.step < cfg.warmup_steps + cfg.profile_steps

    def _measure(self, name: str, G: torch.Tensor) -> None:
        """Local round-trip squared errors of both paths, for the ``auto`` selection."""
        transform = self._transform(name)
        if transform is None or G.dim() != 2:
            return
        if self._measurements is None:
            self._measurements = torch.zeros(len(self.layers), 3, dtype=torch.float64)
        euclid = self.codec.round_trip(G)
        geo = transform.inverse(self.codec.round_trip(transform.forward(G)))
        i = self._layer_index[name]
        self._measurements[i, 0] += float((euclid - G).pow(2).sum())
        self._measurements[i, 1] += float((geo - G).pow(2).sum())
        self._measurements[i, 2] += float(G.pow(2).sum())

    def _apply_auto_selection(self) -> None:
        """Reduce the measured errors; switch on where geometry wins by the margin, off where
        it loses (hysteresis)."""
        m = self._measurements
        self._measurements = None
        dist.all_reduce(m, group=self.group)
        self._counters["factor_bytes_sent"] += fp32_allreduce_wire_bytes(
            m.numel(), self.world_size, m.element_size())
        self.last_measurement = {}
        for i, name in enumerate(self.layers):
            err_e, err_g, norm = (float(v) for v in m[i])
            if norm <= 0 or self._transform(name) is None:
                continue
            rel_e, rel_g = (err_e / norm) ** 0.5, (err_g / norm) ** 0.5
            self.last_measurement[name] = {"euclidean": rel_e, "geometry": rel_g}
            on = name in self.selected
            if not on and rel_g < (1 - self.config.auto_margin) * rel_e:
                self.selected.add(name)
            elif on and not rel_g <= rel_e:
                self.selected.discard(name)

    def _profile(self, name: str, G: torch.Tensor) -> None:
        """The paper's vulnerability score: share of codes saturated at ±max or flushed to 0."""
        self._pending_profile[self._layer_index[name]] += self.codec.clipped_fraction(G)

    def _finish_profile(self) -> None:
        scores = self._profile_scores.clone()
        dist.all_reduce(scores, group=self.group)
        top = self.config.profile_top or max(1, len(self.layers) // 4)
        order = torch.argsort(scores, descending=True, stable=True)[:top]
        names = list(self.layers)
        self.selected.update(names[i] for i in order.tolist())
        self.profile_scores = {names[i]: float(scores[i]) / self.config.profile_steps
                               for i in range(len(names))}

    # -- consistency -------------------------------------------------------------------------

    def _fingerprint(self) -> dict:
        return {"config": self.config.to_dict(), "world_size": self.world_size,
                "parameters": self._param_shapes, "candidates": sorted(self.layers)}

    def _check_consistency(self) -> None:
        """Fail fast, on every rank, when ranks disagree on config or model structure."""
        mine = self._fingerprint()
        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.group)
        self._checked = True
        problems = []
        for r, other in enumerate(everyone):
            if other == everyone[0]:
                continue
            for key in ("config", "world_size", "candidates"):
                if other[key] != everyone[0][key]:
                    detail = other[key]
                    if key == "config":
                        detail = {k: (everyone[0][key][k], v) for k, v in other[key].items()
                                  if everyone[0][key].get(k) != v}
                    problems.append(f"rank {r} vs rank 0: {key} differs: {detail}")
            if other["parameters"] != everyone[0]["parameters"]:
                diff = [(a, b) for a, b in zip(everyone[0]["parameters"], other["parameters"])
                        if a != b][:3]
                n0, n1 = len(everyone[0]["parameters"]), len(other["parameters"])
                problems.append(f"rank {r} vs rank 0: model structure differs "
                                f"({n0} vs {n1} parameters; first differences {diff})")
        if problems:
            raise RuntimeError("GeoFP8: ranks disagree:\n  " + "\n  ".join(problems))

    # -- reporting and checkpoints -----------------------------------------------------------

    def stats(self) -> dict:
        """Figures of the last completed step.

        ``bytes_sent``: bytes this rank put on the wire (payloads, scales, factor and
        selection traffic), counting what each collective's standard algorithm sends:
        ring all-reduce ``2(N−1)/N·size``, all-to-all the ``N−1`` shards for others,
        all-gather/broadcast ``N−1`` copies. ``bytes_fp32_equivalent``: the ring all-reduce
        of the same buckets in FP32. Times are host wall-clock seconds (on a GPU they
        measure launch, not kernel, time).
        """
        self._finish_step()
        last = self._last
        sent = last["bytes_sent"] + last["factor_bytes_sent"]
        return {
            "step": self.step,
            "skipped_steps": self.skipped_steps,
            "bytes_sent": int(sent),
            "payload_bytes_sent": int(last["bytes_sent"]),
            "factor_bytes_sent": int(last["factor_bytes_sent"]),
            "bytes_fp32_equivalent": int(last["bytes_fp32_equivalent"]),
            "bytes_per_element": sent / last["elements"] if last["elements"] else 0.0,
            "geometry_layers": sorted(n for n in self.selected if n in self.transforms),
            "codec_s": last["codec_s"],
            "transform_s": last["transform_s"],
            "statistics_s": last["statistics_s"],
            "ef_bytes": sum(r.numel() * r.element_size() for r in self.residuals.values()),
            "factor_bytes": sum(t.nbytes for t in self.transforms.values()) + sum(
                m.nbytes for l in self.layers.values() for m in
                (l.pending_A, l.window_A, l.pending_S, l.window_S) if m is not None),
        }

    def state_dict(self) -> dict:
        """Everything needed to continue bit-identically (tensors only)."""
        self._finish_step()
        windows = {n: [t.clone() for m in (l.window_A, l.window_S) if m is not None
                       for t in m.tensors()] for n, l in self.layers.items()}
        return {
            "version": 1,
            "config": self.config.to_dict(),
            "step": self.step,
            "skipped_steps": self.skipped_steps,
            "grad_scale": self.grad_scale,
            "selected": sorted(self.selected),
            "residuals": {n: r.clone() for n, r in self.residuals.items()},
            "transforms": _serialize({"transforms": self.transforms,
                                      "basis": self.residual_basis}),
            "windows": windows,
            "profile_scores": self._profile_scores.clone(),
            # auto selection: errors measured at a refresh step, reduced at the next step
            "measurements": None if self._measurements is None else self._measurements.clone(),
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("config") != self.config.to_dict():
            mine, theirs = self.config.to_dict(), state.get("config", {})
            diff = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v}
            raise ValueError(f"GeoFP8 checkpoint was written with another config: "
                             f"(checkpoint, current) = {diff}")
        self.step = int(state["step"])
        self.skipped_steps = int(state["skipped_steps"])
        self.grad_scale = float(state.get("grad_scale", 1.0))
        self.selected = set(state["selected"])
        self.residuals = {n: r.clone() for n, r in state["residuals"].items()}
        maps = _deserialize(state["transforms"])
        self.transforms, self.residual_basis = maps["transforms"], maps["basis"]
        for name, saved in state["windows"].items():
            layer = self.layers[name]
            live = [t for m in (layer.window_A, layer.window_S) if m is not None
                    for t in m.tensors()]
            for t, s in zip(live, saved):
                t.copy_(s)
        self._profile_scores.copy_(state["profile_scores"])
        measured = state.get("measurements")
        self._measurements = None if measured is None else measured.clone()
        self._pending_profile.zero_()
        self._launched, self._in_step = False, False


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
