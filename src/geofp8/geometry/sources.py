"""Where each candidate layer's geometry map comes from.

Every source keeps its maps identical on every rank (DESIGN rule 1) and offers the same
small protocol: :meth:`FactorSource.attach` (forward hooks on the model),
:meth:`~FactorSource.start_step` (collectives at a step boundary), ``prepare(name)`` (just
before a layer's gradient is encoded), :meth:`~FactorSource.transform`,
:meth:`~FactorSource.settle` and a tensor-only ``state_dict``.

* :class:`FixedFactors` — data-independent maps (the Hadamard and random-Hadamard controls).
* :class:`RefreshFactors` — the paper: ``A = E[x xᵀ]`` (and ``S`` for output-side / K-FAC)
  accumulated over ``refresh_every`` settled steps and SUM-reduced; an exact statistic's map
  is computed on one owner rank and broadcast as tensors, a sketched one's by every rank
  from the same reduced sketch with the same deterministic Nyström step (as fresh factors).
* :class:`FreshFactors` — this step's low-rank factor: each forward sketches
  ``Σ x xᵀ Ω`` (``d_in × (k+p)`` floats) and all-reduces it at once (in FP32, or through the
  exact collective in ``sketch_format``), overlapping the rest of the forward and the
  backward; every rank runs the same deterministic Nyström step, on the device.
* :class:`LocalFactors` — each rank's own factor of this step, never reduced: shipped with
  the sender's payload and applied by the receiver to that sender's rows (per-sender
  decoding, see :class:`geofp8.pipeline.GradientPipeline`).

Layers that read the *same input tensor* (q/k/v projections; gate/up) share one statistic
and one map (:class:`SharedInputs`): the statistic is recorded, reduced and factored once.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from ..codecs import make_codec
from ..comm.collective import Communicator
from ..comm.group import DeviceGroup
from ..comm.layout import ShardLayout
from ..comm.stages import encode
from .factory import make_transform, needs
from .statistics import SecondMoment, nystrom_factor, sketch_matrix
from .transforms import LowRankInput, Transform, transform_from_state

__all__ = ["FactorSource", "FixedFactors", "FreshFactors", "Layer", "LocalFactors",
           "RefreshFactors", "SharedInputs", "make_source"]


@dataclass(frozen=True)
class Layer:
    """A candidate Linear layer: its module, its weight's name and its widths."""

    module_name: str
    param_name: str
    d_in: int
    d_out: int


class SharedInputs:
    """Links layers that read the very same input tensor to the first of them (the owner).

    Decided at a layer's first training forward and fixed afterwards (the model's code
    decides it, so every rank decides alike; the ranks' fingerprints include it)."""

    def __init__(self) -> None:
        self.owner: dict[str, str] = {}
        self._seen: dict[int, tuple[torch.Tensor, str]] = {}

    def new_forward(self) -> None:
        self._seen.clear()

    def records(self, name: str, x: torch.Tensor) -> bool:
        """Whether ``name`` owns the statistic of input ``x`` (its first sight decides)."""
        if name not in self.owner:
            seen = self._seen.get(id(x))
            self.owner[name] = seen[1] if seen is not None and seen[0] is x else name
        self._seen.setdefault(id(x), (x, self.owner[name]))
        return self.owner[name] == name

    def of(self, name: str) -> str:
        return self.owner.get(name, name)


def _training(module: nn.Module) -> bool:
    return module.training and torch.is_grad_enabled()


class FactorSource:
    """Base: committed maps by layer name; no statistics."""

    def __init__(self, layers: dict[str, Layer], ledger) -> None:
        self.layers, self.ledger = layers, ledger
        self.shared = SharedInputs()
        self.transforms: dict[str, Transform] = {}
        self._step: dict[str, Transform] = {}  # this step's maps (fresh / local)

    def attach(self, modules: dict[str, nn.Module]) -> list:
        return []

    def start_step(self, step: int) -> None:
        """Collectives due at the start of ``step`` (e.g. a refresh)."""

    def prepare(self, name: str) -> None:
        """Called before ``name``'s gradient is encoded (this step's maps are built here)."""

    def transform(self, name: str) -> Transform | None:
        """This step's map of ``name``: its own (output-side maps are per layer), else the
        map of the statistic it shares."""
        for key in (name, self.shared.of(name)):
            found = self._step.get(key, self.transforms.get(key))
            if found is not None:
                return found
        return None

    def report(self) -> None:
        """Give the warnings that wait on device flags (a host read, made when the stats are
        read; default: none)."""

    def settle(self, finite: torch.Tensor) -> None:
        """Keep this step's maps where the 0-dim ``finite`` holds, else the last ones (on the
        device)."""
        for key, made in self._step.items():
            self.transforms[key] = _chosen(finite, made, self.transforms.get(key))
        self._step = {}

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in {id(t): t for t in self.transforms.values()}.values())

    def _timed(self, key: str, t0: float) -> None:
        self.ledger.add(key, time.perf_counter() - t0)

    def state_dict(self) -> dict:
        return {"owner": dict(self.shared.owner),
                "transforms": {n: {"kind": t.name, "state": t.state()}
                               for n, t in self.transforms.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.shared.owner = dict(state["owner"])
        self.transforms = {n: transform_from_state(s["kind"], s["state"])
                           for n, s in state["transforms"].items()}
        self._step = {}


class FixedFactors(FactorSource):
    """A fixed rotation of every candidate's columns: random signs (seed) and a block
    Hadamard (``hadamard``), or one at the codec's scale block ``block`` (``rht``)."""

    def __init__(self, layers, ledger, kind: str, seed: int, block: int, devices) -> None:
        super().__init__(layers, ledger)
        self.transforms = {n: make_transform(kind, 0.0, dim=l.d_in, block=block, seed=seed,
                                             device=devices[n])
                           for n, l in layers.items()}


class RefreshFactors(FactorSource):
    """The paper's refreshed factors (module notes)."""

    def __init__(self, layers, ledger, config, group: DeviceGroup, devices) -> None:
        super().__init__(layers, ledger)
        self.config, self.group, self.kind = config, group, str(config.transform)
        self.pending: dict[str, dict[str, SecondMoment]] = {}
        self.window: dict[str, dict[str, SecondMoment]] = {}
        for name, layer in layers.items():
            mode = config.statistics
            if mode == "auto":
                mode = "sketch" if self.kind == "lowrank" and layer.d_in > config.sketch_above \
                    else "exact"
            sides = {"A": (layer.d_in, mode)}
            if "S" in needs(self.kind):
                sides["S"] = (layer.d_out, "exact")
            for store in (self.pending, self.window):
                store[name] = {s: SecondMoment(d, m, sketch_size=config.k + config.oversample,
                                               seed=config.seed, device=devices[name])
                               for s, (d, m) in sides.items()}

    def attach(self, modules):
        hooks = []
        for name, layer in self.layers.items():
            module = modules[layer.module_name]
            hooks.append(module.register_forward_pre_hook(self._input_recorder(name)))
            if "S" in self.pending[name]:
                hooks.append(module.register_forward_hook(self._output_recorder(name)))
        return hooks

    def _input_recorder(self, name: str):
        def record(module, args):
            if _training(module) and self.shared.records(name, args[0]):
                t0 = time.perf_counter()
                self.pending[name]["A"].update(args[0])
                self._timed("statistics_s", t0)
        return record

    def _output_recorder(self, name: str):
        def record(module, args, output):
            if _training(module) and output.requires_grad:
                output.register_hook(lambda grad: self.pending[name]["S"].update(grad))
        return record

    def _moments(self, store) -> list[tuple[str, str, SecondMoment]]:
        """``(layer, side, moment)`` that carry data: a shared input counts once."""
        return [(n, s, m) for n, sides in store.items() for s, m in sides.items()
                if s == "S" or self.shared.of(n) == n]

    def settle(self, finite: torch.Tensor) -> None:
        for (_, _, p), (_, _, w) in zip(self._moments(self.pending), self._moments(self.window)):
            for a, b in zip(w.tensors(), p.tensors()):
                a.add_(torch.where(finite.to(b.device), b, torch.zeros_like(b)))
            p.reset()
        super().settle(finite)

    def start_step(self, step: int) -> None:
        if step > 0 and step % self.config.refresh_every == 0:
            self.refresh()

    def refresh(self) -> None:
        """Reduce the window, build each map on its owner rank, broadcast it as tensors."""
        t0 = time.perf_counter()
        moments = [m for _, _, m in self._moments(self.window)]
        tensors = [t for m in moments for t in m.tensors()]
        flat, _ = self.group.all_reduce(torch.cat([t.reshape(-1) for t in tensors]), "factor")
        pos = 0
        for t in tensors:
            t.copy_(flat[pos : pos + t.numel()].view_as(t))
            pos += t.numel()
        # one map per owner of a statistic (per layer when the output side is needed too)
        units = [n for n in self.layers if "S" in needs(self.kind) or self.shared.of(n) == n]
        world, rank = self.group.size, self.group.rank
        mine = {}
        for i, name in enumerate(units):
            A = self.window[self.shared.of(name)]["A"]
            if float(A.weight) <= 0:
                continue
            if A.mode == "sketch":  # every rank factors the same reduced sketch alike
                self._assign(name, self._build(name))
            elif i % world == rank:
                mine.update({f"{name}|{k}": v for k, v in self._build(name).state().items()})
        for src in range(world):
            named = self.group.broadcast_tensors(mine if src == rank else None, src, "factor")
            by_layer: dict[str, dict[str, torch.Tensor]] = {}
            for key, value in named.items():
                layer, _, field = key.partition("|")
                by_layer.setdefault(layer, {})[field] = value
            for layer, state in by_layer.items():
                self._assign(layer, transform_from_state(self.kind, state))
        for m in moments:
            m.reset()
        self._timed("transform_s", t0)

    def _assign(self, unit: str, built: Transform) -> None:
        """``built`` is the map of ``unit`` and of every layer sharing its statistic."""
        self.transforms.update({n: built for n in self.layers if n == unit or (
            "S" not in needs(self.kind) and self.shared.of(n) == unit)})

    def _build(self, name: str) -> Transform:
        cfg, layer = self.config, self.layers[name]
        A = self.window[self.shared.of(name)]["A"]
        S = self.window[name].get("S")
        return make_transform(
            self.kind, cfg.damping, block=cfg.transform_block,
            factor=A.factor(min(cfg.k, layer.d_in)) if self.kind == "lowrank" else None,
            A=A.mean() if "A" in needs(self.kind) else None,
            S=S.mean() if S is not None else None)

    @property
    def nbytes(self) -> int:
        return super().nbytes + sum(m.nbytes for store in (self.pending, self.window)
                                    for _, _, m in self._moments(store))

    def state_dict(self) -> dict:
        return {**super().state_dict(),
                "windows": {f"{n}|{s}": [t.clone() for t in m.tensors()]
                            for n, s, m in self._moments(self.window)}}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        for n, s, m in self._moments(self.window):
            for live, saved in zip(m.tensors(), state["windows"][f"{n}|{s}"]):
                live.copy_(saved)
        for _, _, m in self._moments(self.pending):
            m.reset()


class _SketchedFactors(FactorSource):
    """Shared parts of the per-step sources: Ω per width and the low-rank map of a sketch."""

    def __init__(self, layers, ledger, config) -> None:
        super().__init__(layers, ledger)
        self.config = config
        self._omegas: dict[int, torch.Tensor] = {}

    def omega(self, dim: int, device) -> torch.Tensor:
        """The Gaussian test matrix for width ``dim`` from the shared seed (same everywhere)."""
        if dim not in self._omegas:
            self._omegas[dim] = sketch_matrix(dim, self.config.k + self.config.oversample,
                                              self.config.seed, torch.float32, device)
        return self._omegas[dim]

    def attach(self, modules):
        return [modules[layer.module_name].register_forward_pre_hook(self._recorder(name))
                for name, layer in self.layers.items()]

    def _recorder(self, name: str):
        def record(module, args):
            if _training(module) and self.shared.records(name, args[0]):
                t0 = time.perf_counter()
                self.record(name, args[0].detach())
                self._timed("statistics_s", t0)
        return record


class FreshFactors(_SketchedFactors):
    """This step's factor from an all-reduced sketch (module notes).

    ``config.sketch_format``: ``None`` all-reduces ``Y = Σ x xᵀ Ω`` in FP32
    (``4·d_in·(k+p)`` bytes, ``2(N−1)/N`` of them per rank). A format (``e4m3``, ``nvfp4``,
    ...) sends ``Y`` through the exact collective instead (each sender's rounding, an FP32
    sum, the owner's re-rounding: the same reduced sketch on every rank), at that format's
    bytes per element; ``Σ‖x‖²`` and the token count still travel in FP32. The map is then
    the Nyström factor of a rounded sketch: identical everywhere, decoded exactly by its
    inverse, only a less exact whitening.
    """

    def __init__(self, layers, ledger, config, group: DeviceGroup) -> None:
        super().__init__(layers, ledger, config)
        self.group = group
        self._works: dict[str, list] = {}
        self._flags: list[tuple[str, torch.Tensor]] = []  # (layer, sketch not finite)
        self._unsaid: dict[str, torch.Tensor] = {}  # layer: a sketch not finite, since read
        self.warned: set[str] = set()
        self._codec = None if config.sketch_format is None else make_codec(config.sketch_format)
        self._sketches = Communicator("exact", group, kind="factor")
        self._layouts: dict[int, ShardLayout] = {}

    def _layout(self, numel: int) -> ShardLayout:
        if numel not in self._layouts:
            self._layouts[numel] = ShardLayout.build([(numel,)], self._codec, self.group.size,
                                                     kernels=self.config.kernels)
        return self._layouts[numel]

    def record(self, name: str, x: torch.Tensor) -> None:
        """Launch the SUM all-reduces of ``Σ x xᵀ Ω`` and ``[Σ‖x‖², tokens]`` of this
        micro-batch (one FP32 buffer, or the sketch through the exact collective)."""
        x = x.reshape(-1, self.layers[name].d_in).float()
        omega = self.omega(x.shape[1], x.device)
        sketch = (x.T @ (x @ omega)).reshape(-1)
        moments = torch.cat([x.pow(2).sum().reshape(1), x.new_full((1,), float(x.shape[0]))])
        if self._codec is None:
            buf, work = self.group.all_reduce(torch.cat([sketch, moments]), "factor",
                                              async_op=True)
            self._works.setdefault(name, []).append(_Reduced(work, buf))
            return
        layout = self._layout(sketch.numel())
        reduced = self._sketches.launch(encode(sketch, layout, sender=self.group.rank),
                                        layout, last=False)  # its all-gather: next launch
        moments, work = self.group.all_reduce(moments, "factor", async_op=True)
        self._works.setdefault(name, []).append(_Reduced(work, moments, reduced))

    def prepare(self, name: str) -> None:
        """Wait for the owner's reduced sketches (normally long done) and build its map, on
        the device: nothing is read back to the host (a non-finite or empty sketch keeps the
        last map — the identity before the first — chosen by ``torch.where``; the warning
        waits for the stats to be read, :meth:`report`)."""
        self._drain()  # the last sketch's all-gather: issued here, the same point on every rank
        key = self.shared.of(name)
        works = self._works.pop(key, None)
        if not works:
            return
        t0 = time.perf_counter()
        sketch, moments = works[0].wait()
        for reduced in works[1:]:
            more_sketch, more_moments = reduced.wait()
            sketch, moments = sketch + more_sketch, moments + more_moments
        d, cfg = self.layers[key].d_in, self.config
        omega = self.omega(d, sketch.device)
        tokens = moments[1]
        ok = torch.isfinite(sketch).all() & torch.isfinite(moments).all() & (tokens > 0)
        count = tokens.clamp_min(1)  # the tokens (1 when none: never used then)
        # where the sketch is unusable, a stand-in (A = I) that factors safely, never used
        Y = torch.where(ok, sketch.view(d, omega.shape[1]) / count, omega)
        trace = torch.where(ok, moments[0] / count, float(d)).double()
        fresh = LowRankInput(nystrom_factor(Y, omega, min(cfg.k, d), trace), cfg.damping)
        self._step[key] = _chosen(ok, fresh, self.transforms.get(key))
        self._flags.append((key, ~ok & (tokens > 0)))
        self._timed("transform_s", t0)

    def report(self) -> None:
        """Warn once per layer whose sketch was not finite in a step since the last report."""
        unsaid, self._unsaid = self._unsaid, {}
        for key, bad in unsaid.items():
            if bool(bad) and key not in self.warned:  # the same reduced sketch on every rank
                self.warned.add(key)
                warnings.warn(f"GeoFP8: this step's input sketch of {key!r} is not finite "
                              "(its activations overflow x xᵀ Ω in FP32); the layer keeps its "
                              "last map for this step, the identity before its first (warned "
                              "once per layer)", RuntimeWarning, stacklevel=2)

    def _drain(self) -> None:
        """Issue the pending sketch all-gather and complete every reduced sketch."""
        self._sketches.flush()
        self._sketches.complete(block=True)

    def settle(self, finite: bool) -> None:
        self._drain()  # every rank at the same point, whether or not a layer read its sketch
        for key, bad in self._flags:  # folded on the device, read by report()
            self._unsaid[key] = bad | self._unsaid[key] if key in self._unsaid else bad
        self._works, self._flags = {}, []
        super().settle(finite)


def _chosen(ok: torch.Tensor, fresh: LowRankInput, last: Transform | None) -> LowRankInput:
    """``fresh`` where the 0-dim ``ok`` holds, else ``last`` (the identity when ``None``),
    field by field on the device."""
    chosen = LowRankInput.__new__(LowRankInput)
    for field in LowRankInput.fields:
        new = getattr(fresh, field)
        old = getattr(last, field) if last is not None else (
            1.0 if field in LowRankInput.scalar_fields else torch.zeros_like(new))
        setattr(chosen, field, torch.where(ok, new, old))
    return chosen


@dataclass
class _Reduced:
    """One micro-batch's reduced ``(Σ_r Y_r, [Σ‖x‖², tokens])``, once :meth:`wait` returns:
    both views of ``values`` after the FP32 all-reduce ``work``, or the ``sketch`` the exact
    collective reduced and ``values`` the two moments alone."""

    work: object
    values: torch.Tensor
    sketch: torch.futures.Future | None = None

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.work.wait()
        if self.sketch is None:
            return self.values[:-2], self.values[-2:]
        return self.sketch.wait(), self.values


class LocalFactors(_SketchedFactors):
    """Each rank's own factor of this step (module notes); never reduced."""

    def __init__(self, layers, ledger, config, devices) -> None:
        super().__init__(layers, ledger, config)
        self.pending = {n: SecondMoment(l.d_in, "sketch", seed=config.seed,
                                        sketch_size=config.k + config.oversample,
                                        device=devices[n])
                        for n, l in layers.items()}

    def rank_of(self, d_in: int) -> int:
        return min(self.config.k, d_in)

    def record(self, name: str, x: torch.Tensor) -> None:
        self.pending[name].update(x)

    def prepare(self, name: str) -> None:
        key = self.shared.of(name)
        stats = self.pending[key]
        if key in self._step or float(stats.weight) <= 0:
            return
        k = self.rank_of(self.layers[key].d_in)
        factor = stats.factor(k)
        if factor.rank == k and bool(torch.isfinite(factor.U).all()):
            self._step[key] = LowRankInput(factor, self.config.damping)

    def settle(self, finite: bool) -> None:
        for stats in self.pending.values():
            stats.reset()
        super().settle(finite)

    @property
    def nbytes(self) -> int:
        return super().nbytes + sum(m.nbytes for m in self.pending.values())


def make_source(config, layers: dict[str, Layer], ledger, group: DeviceGroup,
                devices: dict[str, torch.device], codec_block: int = 128) -> FactorSource | None:
    """The factor source of ``config`` (``None``: no candidate ever takes geometry, or there
    is no candidate); ``codec_block``: the codec's scale block (the block of ``rht``)."""
    if not layers:
        return None
    if config.transform in ("hadamard", "rht"):
        return FixedFactors(layers, ledger, config.transform, config.seed, codec_block,
                            devices)
    if config.transform == "euclidean" or config.layers == "none":
        return None
    if config.factor_source == "fresh":
        return FreshFactors(layers, ledger, config, group)
    if config.factor_source == "local":
        return LocalFactors(layers, ledger, config, devices)
    return RefreshFactors(layers, ledger, config, group, devices)
