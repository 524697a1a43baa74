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
* :class:`FreshFactors` — this step's low-rank factor: each layer's forward sketches
  ``Σ x xᵀ Ω`` (``d_in × (k+p)`` floats) locally; when the model's forward returns, every
  rank reduces all layers' sketches in one launch (in FP32, or through the exact collective
  in ``sketch_format``; zeros for a layer it did not run), overlapping the backward; every
  rank runs the same deterministic Nyström step, on the device.
* :class:`LocalFactors` — each rank's own factor of this step, never reduced: shipped with
  the sender's payload and applied by the receiver to that sender's rows (per-sender
  decoding, see :class:`geofp8.pipeline.GradientPipeline`).

Layers that read the *same input tensor* (q/k/v projections; gate/up) share one statistic
and one map (:class:`SharedInputs`, agreed across ranks): the statistic is recorded, reduced
and factored once. No statistics collective depends on which layers a rank ran.
"""

from __future__ import annotations

import math
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
from ..comm.streams import used_here
from .factory import make_transform, needs
from .statistics import JoinedMoments, SecondMoment, nystrom_factor, sketch_matrix
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

    Each rank decides at a layer's first training forward (by the identity of its input);
    at the end of the first training forward (:meth:`agree`) the ranks merge what they saw,
    and the map is fixed from then on, complete: a layer shares its owner's statistic only
    if every rank that ran it decided alike and the owner owns its own; every other
    candidate (conflicting, or run on no rank yet) owns its own. So the map is identical on
    every rank whichever layers each rank happened to run."""

    def __init__(self) -> None:
        self.owner: dict[str, str] = {}
        self.agreed = False
        self._seen: dict[int, tuple[torch.Tensor, str]] = {}

    def new_forward(self) -> None:
        self._seen.clear()

    def records(self, name: str, x: torch.Tensor) -> bool:
        """Whether ``name`` owns the statistic of input ``x`` (its first sight decides,
        until the ranks agree; afterwards a plain lookup, which ``torch.compile`` traces
        without guarding on the input's identity)."""
        if self.agreed:
            return self.owner.get(name, name) == name
        return self._first_sight(name, x)

    # by input identity: not for a graph (the first forward only); torch.compiler.disable,
    # importing dynamo at the first call, not with geofp8 (0.7 s of the CLI's start)
    @torch._disable_dynamo
    def _first_sight(self, name: str, x: torch.Tensor) -> bool:
        if name not in self.owner:
            seen = self._seen.get(id(x))
            self.owner[name] = seen[1] if seen is not None and seen[0] is x else name
        self._seen.setdefault(id(x), (x, self.owner[name]))
        return self.owner[name] == name

    def of(self, name: str) -> str:
        return self.owner.get(name, name)

    def agree(self, names: list[str], group: DeviceGroup) -> None:
        """Merge every rank's decisions over the candidates ``names`` and fix the map
        (collective on ``group``; see the class notes)."""
        everyone = group.all_gather_json(self.owner, "consistency")
        merged = {}
        for name in names:
            seen = {decided[name] for decided in everyone if name in decided}
            merged[name] = seen.pop() if len(seen) == 1 else name
        self.owner = {n: o if merged.get(o) == o else n for n, o in merged.items()}
        self.agreed = True

    def state_dict(self) -> dict:
        return {"owner": dict(self.owner), "agreed": self.agreed}

    def load_state_dict(self, state: dict) -> None:
        self.owner, self.agreed = dict(state["owner"]), bool(state["agreed"])


def _training(module: nn.Module) -> bool:
    return module.training and torch.is_grad_enabled()


class FactorSource:
    """Base: committed maps by layer name; no statistics."""

    per_step = False  # whether prepare() builds a map every step (else it does nothing)

    def __init__(self, layers: dict[str, Layer], ledger) -> None:
        self.layers, self.ledger = layers, ledger
        self.shared = SharedInputs()
        self.transforms: dict[str, Transform] = {}
        self._step: dict[str, Transform] = {}  # this step's maps (fresh / local)
        self.rejected = 0  # statistics or maps found non-finite and reset (stats())
        self.warned: set[str] = set()

    def attach(self, modules: dict[str, nn.Module]) -> list:
        return []

    def start_step(self, step: int) -> None:
        """Collectives due at the start of ``step`` (e.g. a refresh)."""

    def next_start(self, step: int) -> float:
        """The first step after ``step`` whose :meth:`start_step` may act (default: the
        next one)."""
        return step + 1

    def forward_done(self) -> None:
        """The wrapped model's training forward returned (every rank, the same point)."""

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
        """Count and give the warnings that wait on device flags (a host read, made when the
        stats are read; default: none)."""

    def settle(self, finite: torch.Tensor) -> None:
        """Keep this step's maps where the 0-dim ``finite`` holds, else the last ones (on the
        device)."""
        for key, made in self._step.items():
            self.transforms[key] = LowRankInput.chosen(finite, made, self.transforms.get(key))
        self._step = {}

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in {id(t): t for t in self.transforms.values()}.values())

    def _rejected(self, names: list[str], what: str) -> None:
        """Count non-finite statistics or maps of ``names`` that were reset; warn once per
        layer."""
        self.rejected += len(names)
        for name in names:
            if name not in self.warned:
                self.warned.add(name)
                warnings.warn(f"GeoFP8: {what} of {name!r} is not finite (its activations "
                              "overflow x xᵀ in FP32); it was reset: the layer keeps its last "
                              "map, the identity before its first (warned once per layer; "
                              "stats()['nonfinite_factors'] counts them)", RuntimeWarning,
                              stacklevel=3)

    def _timed(self, key: str, t0: float) -> None:
        self.ledger.add(key, time.perf_counter() - t0)

    def _measured(self, key: str, work, *args) -> None:
        """``work(*args)``, its host time added to ``key``; untimed under ``torch.compile``
        (the hooks it runs in are traced: no clock read in a graph)."""
        if torch.compiler.is_compiling():
            work(*args)
            return
        t0 = time.perf_counter()
        work(*args)
        self._timed(key, t0)

    def state_dict(self) -> dict:
        return {"shared": self.shared.state_dict(),
                "transforms": {n: {"kind": t.name, "state": t.state()}
                               for n, t in self.transforms.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.shared.load_state_dict(state["shared"])
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

    def next_start(self, step: int) -> float:
        return math.inf  # (fixed maps: no start acts)


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
        self._joined = self._join()
        # per device, its moments' commit bound once: commit(finite) (JoinedMoments.bound_commit)
        self._commits = [(dropped.device, pending.bound_commit(window, dropped))
                         for _, pending, window, dropped in self._joined]

    def _join(self) -> list[tuple[list[str], JoinedMoments, JoinedMoments, torch.Tensor]]:
        """Per device: ``(layers, pending, window, dropped)``, every moment's pending and
        window sums in one buffer each and, per moment, the count of finite steps whose
        statistic was not finite (dropped; read at the refresh)."""
        groups: dict[tuple, list] = {}
        for name, sides in self.pending.items():
            for side, p in sides.items():
                groups.setdefault((p.total.device, p.dtype), []).append(
                    (name, p, self.window[name][side]))
        return [([n for n, _, _ in g], JoinedMoments([p for _, p, _ in g]),
                 JoinedMoments([w for _, _, w in g]),
                 torch.zeros(len(g), dtype=torch.int64, device=device))
                for (device, _), g in groups.items()]

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
                self._measured("statistics_s", self.pending[name]["A"].update, args[0])
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
        """A finite step's statistics join the window, each moment only if all of it is
        finite (decided on the device, every moment at once: a non-finite moment of a
        finite step is dropped, counted at the refresh; a skipped step's are dropped
        uncounted)."""
        for device, commit in self._commits:  # (no map of its own per step)
            commit(finite.to(device))

    def start_step(self, step: int) -> None:
        if step > 0 and step % self.config.refresh_every == 0:
            self.refresh()

    def next_start(self, step: int) -> float:
        """The next refresh."""
        return (step // self.config.refresh_every + 1) * self.config.refresh_every

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
        usable = self._usable(units)  # the same reduced window everywhere: the same verdict
        mine = {}
        for i, name in enumerate(units):
            A = self.window[self.shared.of(name)]["A"]
            if not usable[name] or float(A.weight) <= 0:
                continue
            if A.mode == "sketch":  # every rank factors the same reduced sketch alike
                if _finite(built := self._build(name), name, self):
                    self._assign(name, built)
            elif i % world == rank and _finite(built := self._build(name), name, self):
                mine.update({f"{name}|{k}": v for k, v in built.state().items()})
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

    def _usable(self, units: list[str]) -> dict[str, bool]:
        """Whether each unit's reduced window is finite (the same window everywhere: the same
        verdict); the others keep their last map. Counted and warned, with the statistics
        dropped at settling."""
        windows = [[self.window[self.shared.of(n)]["A"], *([self.window[n]["S"]]
                    if "S" in self.window[n] else [])] for n in units]
        flags = [torch.stack([torch.isfinite(t).all() for m in ms for t in m.tensors()]).all()
                 for ms in windows]
        usable = dict(zip(units, torch.stack(flags).tolist() if flags else []))
        dropped = []
        for names, _, _, counts in self._joined:
            dropped += [n for n, count in zip(names, counts.tolist()) for _ in range(count)]
            counts.zero_()
        self._rejected(dropped, "a step's input statistic")
        self._rejected([n for n, ok in usable.items() if not ok], "the refresh's statistic")
        return usable

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

    per_step = True
    unusable = "this step's input sketch"  # what the warning of a non-finite one names

    def __init__(self, layers, ledger, config) -> None:
        super().__init__(layers, ledger)
        self.config = config
        self._omegas: dict[int, torch.Tensor] = {}
        self._flags: list[tuple[str, torch.Tensor]] = []  # (layer, sketch not finite)
        self._unsaid: dict[str, torch.Tensor] = {}  # layer: steps whose sketch was not finite

    def _build_step(self, key: str, sketch: torch.Tensor, moments: torch.Tensor,
                    omega: torch.Tensor) -> None:
        """This step's map of ``key`` from its summed ``sketch`` ``Σ x xᵀ Ω`` and ``moments``
        ``[Σ‖x‖², tokens]``, on the device: nothing is read back to the host (a non-finite
        sketch, or one with no tokens this step, keeps the last map — the identity before
        the first — chosen by ``torch.where``; counted and warned at :meth:`report`)."""
        d, cfg = self.layers[key].d_in, self.config
        tokens = moments[1]
        ok = torch.isfinite(sketch).all() & torch.isfinite(moments).all() & (tokens > 0)
        count = tokens.clamp_min(1)  # the tokens (1 when none: never used then)
        # where the sketch is unusable, a stand-in (A = I) that factors safely, never used
        Y = torch.where(ok, sketch.view(d, omega.shape[1]) / count, omega)
        trace = torch.where(ok, moments[0] / count, float(d)).double()
        fresh = LowRankInput(nystrom_factor(Y, omega, min(cfg.k, d), trace), cfg.damping)
        ok = ok & torch.isfinite(fresh.packed).all()  # the state's one buffer: one pass
        self._step[key] = LowRankInput.chosen(ok, fresh, self.transforms.get(key))
        self._flags.append((key, ~ok & (tokens > 0)))

    def report(self) -> None:
        """Count the steps whose sketch or map of a layer was not finite since the last
        report; warn once per layer."""
        unsaid, self._unsaid = self._unsaid, {}
        for key, count in unsaid.items():
            self._rejected([key] * int(count), self.unusable)

    def settle(self, finite: torch.Tensor) -> None:
        for key, bad in self._flags:  # folded on the device, read by report()
            self._unsaid[key] = self._unsaid.get(key, 0) + bad.to(torch.int64)
        self._flags = []
        super().settle(finite)

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
                self._measured("statistics_s", self.record, name, args[0].detach())
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
        self._local: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # this forward's sums
        self._launched: list[_Reduced] = []  # this step's reductions, one per forward
        self._reduced: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
        self._codec = None if config.sketch_format is None else make_codec(config.sketch_format)
        self._sketches = Communicator("exact", group, kind="factor")
        self._layouts: dict[int, ShardLayout] = {}

    def _layout(self, numel: int) -> ShardLayout:
        if numel not in self._layouts:
            self._layouts[numel] = ShardLayout.build([(numel,)], self._codec, self.group.size,
                                                     kernels=self.config.kernels)
        return self._layouts[numel]

    def units(self) -> list[str]:
        """The layers that own a statistic (:class:`SharedInputs`), in candidate order."""
        return [n for n in self.layers if self.shared.of(n) == n]

    def _width(self, name: str) -> int:
        d = self.layers[name].d_in
        return d * min(self.config.k + self.config.oversample, d)

    def record(self, name: str, x: torch.Tensor) -> None:
        """Add this micro-batch's ``Σ x xᵀ Ω`` and ``[Σ‖x‖², tokens]`` to the forward's local
        sums (no collective: :meth:`forward_done` reduces every layer's at once)."""
        x = x.reshape(-1, self.layers[name].d_in).float()
        omega = self.omega(x.shape[1], x.device)
        sketch = (x.T @ (x @ omega)).reshape(-1)
        moments = torch.cat([x.pow(2).sum().reshape(1), x.new_full((1,), float(x.shape[0]))])
        if name in self._local:  # the layer ran twice in this forward
            sketch, moments = sketch + self._local[name][0], moments + self._local[name][1]
        self._local[name] = (sketch, moments)

    def forward_done(self) -> None:
        """Launch one SUM reduction of every unit's sketch and moments, in candidate order,
        zeros for the units this rank did not run (one FP32 all-reduce, or the sketches
        through the exact collective and the moments in FP32). Every rank launches it at the
        same point, so which layers a rank ran never decides who joins a collective; it
        overlaps the loss and the backward up to the first map's :meth:`prepare`."""
        device, sketches, moments = self.group.device, [], []
        for name in self.units():
            sketch, moment = self._local.get(name) or (
                torch.zeros(self._width(name), device=device), torch.zeros(2, device=device))
            sketches.append(sketch.to(device))
            moments.append(moment.to(device))
        self._local = {}
        if not sketches:
            return
        sketch, moment = torch.cat(sketches), torch.cat(moments)
        if self._codec is None:
            buf, work = self.group.all_reduce(torch.cat([sketch, moment]), "factor",
                                              async_op=True)
            self._launched.append(_Reduced(work, buf, sketch.numel()))
            return
        layout = self._layout(sketch.numel())
        reduced = self._sketches.launch(encode(sketch, layout, sender=self.group.rank),
                                        layout, last=False)  # its all-gather: next launch
        moment, work = self.group.all_reduce(moment, "factor", async_op=True)
        self._launched.append(_Reduced(work, moment, sketch.numel(), reduced))

    def start_step(self, step: int) -> None:
        """A model whose own forward was not called (its submodules were): reduce now."""
        if not self._launched:
            self.forward_done()

    def _await(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Every unit's reduced ``(sketch, [Σ‖x‖², tokens])``, summed over the step's
        forwards."""
        sketch, moments = self._launched[0].wait()
        for reduced in self._launched[1:]:
            more_sketch, more_moments = reduced.wait()
            sketch, moments = sketch + more_sketch, moments + more_moments
        units = self.units()
        sketches = sketch.split([self._width(n) for n in units])
        return {n: (s, m) for n, s, m in zip(units, sketches, moments.view(-1, 2))}

    def prepare(self, name: str) -> None:
        """Wait for the reduced sketches (normally long done) and build the map of ``name``'s
        unit, on the device: nothing is read back to the host (a non-finite sketch, or one
        that no rank recorded this step, keeps the last map — the identity before the first
        — chosen by ``torch.where``; the count and warning wait for the stats to be read,
        :meth:`report`)."""
        self._drain()  # the last sketch's all-gather: issued here, the same point on every rank
        key = self.shared.of(name)
        if key in self._step or not self._launched:
            return
        t0 = time.perf_counter()
        if self._reduced is None:
            self._reduced = self._await()
        sketch, moments = self._reduced[key]
        used_here(sketch, moments)  # reduced on backward's stream, read here on the side one
        self._build_step(key, sketch, moments, self.omega(self.layers[key].d_in,
                                                          sketch.device))
        self._timed("transform_s", t0)

    def _drain(self) -> None:
        """Issue the pending sketch all-gather and complete every reduced sketch."""
        self._sketches.flush()
        self._sketches.complete(block=True)

    def settle(self, finite: torch.Tensor) -> None:
        self._drain()  # every rank at the same point, whether or not a layer read its sketch
        for reduced in self._launched:  # a step no map read (FP32 warm-up): done all the same
            reduced.work.wait()
        self._launched, self._reduced, self._local = [], None, {}
        super().settle(finite)


def _finite(built: Transform, name: str, source: FactorSource) -> bool:
    """Whether the map ``built`` of ``name`` is finite (else counted and warned by
    ``source``; the layer keeps its last map)."""
    if all(bool(torch.isfinite(t).all()) for t in built.state().values()):
        return True
    source._rejected([name], "the refreshed map")
    return False


@dataclass
class _Reduced:
    """One forward's reduced ``(Σ_r Y_r, [Σ‖x‖², tokens] per unit)``, once :meth:`wait`
    returns: both parts of ``values`` (the first ``split`` elements the sketches) after the
    FP32 all-reduce ``work``, or the ``sketch`` the exact collective reduced and ``values``
    the moments alone."""

    work: object
    values: torch.Tensor
    split: int
    sketch: torch.futures.Future | None = None

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.work.wait()
        if self.sketch is None:
            return self.values[: self.split], self.values[self.split :]
        return self.sketch.wait(), self.values


class LocalFactors(_SketchedFactors):
    """Each rank's own factor of this step (module notes); never reduced. A rank that did
    not run a layer this step, or whose statistic is not finite, keeps its last map (the
    identity before the first), as a skipped sketch of :class:`FreshFactors` does."""

    unusable = "this rank's input statistic"

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
        """This rank's map of ``name``'s unit from its own statistic, on the device (see
        :meth:`_build_step`: nothing read back to the host)."""
        key = self.shared.of(name)
        if key in self._step:
            return
        t0 = time.perf_counter()
        stats = self.pending[key]
        self._build_step(key, stats.total.reshape(-1),
                         torch.stack([stats.trace_total, stats.weight]), stats.omega)
        self._timed("transform_s", t0)

    def settle(self, finite: torch.Tensor) -> None:
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
