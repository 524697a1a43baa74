"""Which candidate Linear weights take the geometry branch.

* :class:`FixedSelection` — ``"all"``, ``"none"`` or a list of module names.
* :class:`ProfileSelection` — the paper: over ``profile_steps`` steps after the warm-up,
  score every candidate by the share of its codes saturated or flushed to zero
  (:meth:`Codec.clipped_fraction`), reduce the scores across ranks, and fix the top
  ``profile_top`` (default a quarter of the candidates) for the rest of training.
* :class:`AutoSelection` — ours: at each measurement step every rank computes, per layer,
  the error each path would send *with error feedback as it is*,
  ``e_p = ‖T_p⁻¹ deq(Q(G T_p + R_p)) − G‖²`` (``R_p`` the residual in path ``p``'s
  coordinates), and ``‖G‖²``; the sums are reduced across ranks at the next step, and a
  layer switches on when ``rel_geo < (1 − margin) · rel_euclid`` and off when
  ``rel_geo > rel_euclid`` (hysteresis).
* :class:`BudgetSelection` — ``GeoFP8Config(budget=B)``: a *path* (format and route) per
  communicated tensor, the assignment of least total error whose bytes fit ``B`` bytes per element
  per round trip (see the class).

Selections observe gradients while buckets are encoded; what they observe in a step counts
only if the step is settled as finite. Decisions need a collective and are taken at the
start of the next step (:meth:`Selection.start_step`), identically on every rank.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch

from .codecs import Codec, make_codec
from .comm.group import DeviceGroup
from .comm.layout import tensor_wire_bytes
from .geometry.transforms import IDENTITY, Transform

__all__ = ["PATHS", "AutoSelection", "BudgetSelection", "FixedSelection", "ProfileSelection",
           "Selection", "make_selection"]

ResidualIn = Callable[[Transform], "torch.Tensor | None"]


class Selection:
    """Base: a fixed set of selected names; nothing observed, nothing decided.

    ``static``: it never observes nor decides (the selected names change only when a
    state is loaded), so :meth:`start_step` and :meth:`settle` need not be called (a
    subclass is not, unless it says so). ``charges``: :meth:`charged` is wanted after every
    settled step."""

    static, charges = False, False

    def __init__(self, candidates: list[str], selected: set[str] | None = None) -> None:
        self.candidates = list(candidates)
        self.index = {n: i for i, n in enumerate(self.candidates)}
        self.selected: set[str] = set(selected or ())

    def wants(self, step: int) -> bool:
        """Whether :meth:`observe` should be called for the tensors of this step."""
        return False

    def observes(self, name: str) -> bool:
        """Whether ``name``'s gradient is observed (the candidates; a budget: every tensor)."""
        return name in self.index

    def observe(self, name: str, G: torch.Tensor, geo: Transform | None,
                residual_in: ResidualIn) -> None:
        """See one tensor's FP32 gradient ``G`` and its geometry map, if any."""

    def start_step(self, step: int, group: DeviceGroup) -> None:
        """Decide, from what earlier settled steps observed (collective on ``group``)."""

    def next_start(self, step: int) -> float:
        """The first step after ``step`` whose :meth:`start_step` or :meth:`wants` may act
        (the ones before it neither decide nor observe; default: the next one, never for a
        static selection)."""
        return math.inf if self.static else step + 1

    def settle(self, finite: torch.Tensor) -> None:
        """Keep what this step observed if the 0-dim ``finite`` (on the device) holds, else
        drop it."""

    def charged(self, factor_bytes: float) -> None:
        """The factor and selection bytes this rank sent in a step just settled."""

    def codec_of(self, name: str) -> Codec | None:
        """The wire codec of ``name`` (``None``: the pipeline's one codec)."""
        return None

    def figures(self) -> dict:
        """The selection's own figures in the adapters' ``stats()`` (default: none)."""
        return {}

    def state_dict(self) -> dict:
        return {"selected": sorted(self.selected)}

    def load_state_dict(self, state: dict) -> None:
        self.selected = set(state["selected"])


class FixedSelection(Selection):
    """``all``, ``none`` or explicit names (they never change)."""

    static = True


class ProfileSelection(Selection):
    """The paper's vulnerability profile (see the module notes)."""

    def __init__(self, candidates: list[str], codec: Codec, start: int, steps: int,
                 top: int | None) -> None:
        super().__init__(candidates)
        self.codec, self.start, self.steps = codec, start, steps
        self.top = top or max(1, len(candidates) // 4)
        self.totals = torch.zeros(len(candidates), dtype=torch.float64)
        self._pending = torch.zeros_like(self.totals)
        self._seen = False  # scores pending this step
        self.scores: dict[str, float] = {}

    def wants(self, step: int) -> bool:
        return self.start <= step < self.start + self.steps

    def next_start(self, step: int) -> float:
        """Each step up to the one after the profile (it decides); none later."""
        return step + 1 if step < self.start + self.steps else math.inf

    def observe(self, name, G, geo, residual_in) -> None:
        score = self.codec.clipped_fraction(G)  # on G's device: no host read per layer
        if self.totals.device != score.device:  # the first score: the sums follow it there
            self.totals, self._pending = self.totals.to(score.device), self._pending.to(
                score.device)
        self._pending[self.index[name]] += score
        self._seen = True

    def start_step(self, step: int, group: DeviceGroup) -> None:
        if step != self.start + self.steps or not self.candidates:
            return
        scores, _ = group.all_reduce(self.totals.clone(), "factor")
        scores = scores.cpu()
        order = torch.argsort(scores, descending=True, stable=True)[: self.top]
        self.selected.update(self.candidates[i] for i in order.tolist())
        self.scores = {n: float(scores[i]) / self.steps for i, n in enumerate(self.candidates)}

    def settle(self, finite: torch.Tensor) -> None:
        if self._seen:  # the scores are on the gradients' device, as the verdict is
            self.totals += torch.where(finite, self._pending, 0.0)
            self._pending.zero_()
            self._seen = False

    def state_dict(self) -> dict:
        return {**super().state_dict(), "totals": self.totals.clone()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.totals.copy_(state["totals"])
        self._pending.zero_()
        self._seen = False


class AutoSelection(Selection):
    """Switch by the measured error each path sends with error feedback (module notes)."""

    def __init__(self, candidates: list[str], codec: Codec, every: int, margin: float,
                 first_step: int) -> None:
        super().__init__(candidates)
        self.codec, self.every, self.margin, self.first_step = codec, every, margin, first_step
        self._pending: torch.Tensor | None = None  # this step's sums
        self.measured: torch.Tensor | None = None  # a settled step's sums, not yet reduced
        self.last_measurement: dict[str, dict[str, float]] = {}

    def wants(self, step: int) -> bool:
        return step % self.every == 0 and step >= self.first_step

    def next_start(self, step: int) -> float:
        """The step after a measuring one (it decides), else the next measuring step."""
        if self.wants(step):
            return step + 1
        first = max(self.first_step, step + 1)
        return first + -first % self.every

    def observe(self, name, G, geo, residual_in) -> None:
        if self._pending is None:  # on every rank that observes, with a map or not (local
            # factors: a rank that did not run a layer has none), so all join the reduction
            self._pending = torch.zeros(len(self.candidates), 3, dtype=torch.float64)
        if geo is None:
            return
        row = self._pending[self.index[name]]
        for col, route in ((0, IDENTITY), (1, geo)):
            residual = residual_in(route)
            U = route.forward(G) if residual is None else route.forward(G) + residual
            sent = route.inverse(self.codec.round_trip(U))
            row[col] += float((sent - G).pow(2).sum())
        row[2] += float(G.pow(2).sum())

    def start_step(self, step: int, group: DeviceGroup) -> None:
        if self.measured is None:
            return
        m, _ = group.all_reduce(self.measured, "factor")
        self.measured = None
        self.last_measurement = {}
        for i, name in enumerate(self.candidates):
            err_e, err_g, norm = (float(v) for v in m[i])
            if norm <= 0:  # not measured (no factor yet) or a zero gradient
                continue
            rel_e, rel_g = (err_e / norm) ** 0.5, (err_g / norm) ** 0.5
            self.last_measurement[name] = {"euclidean": rel_e, "geometry": rel_g}
            on = name in self.selected
            if not on and rel_g < (1 - self.margin) * rel_e:
                self.selected.add(name)
            elif on and not rel_g <= rel_e:
                self.selected.discard(name)

    def settle(self, finite: torch.Tensor) -> None:
        # a measuring step reads its errors back already: its verdict is read with them
        if self._pending is not None and bool(finite):
            self.measured = self._pending
        self._pending = None

    def state_dict(self) -> dict:
        return {**super().state_dict(),
                "measured": None if self.measured is None else self.measured.clone()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        measured = state.get("measured")
        self.measured = None if measured is None else measured.clone()
        self._pending = None


# A budget's paths: (format, route through the refreshed low-rank factor). The first is the
# floor: every tensor takes it until the first decision. Tensors that are not candidates
# have no factor: the geometry path is never admissible for them.
PATHS: tuple[tuple[str, bool], ...] = (("nvfp4", False), ("nvfp4", True), ("e4m3", False))


def path_name(path: tuple[str, bool]) -> str:
    return f"{path[0]}-geo" if path[1] else path[0]


class BudgetSelection(Selection):
    """A path of :data:`PATHS` per communicated tensor, chosen within a byte budget.

    **Tensors.** Every tensor DDP communicates takes part (``shapes``, in the model's order,
    identical on every rank): candidate Linear weights choose among all paths, the others
    (embeddings, the output head, norms, biases) among ``nvfp4`` and ``e4m3``.

    **Error.** At a measurement step every rank computes, per tensor and admissible path
    ``p = (format, T)``, the rounding error of the path's round trip of ``G T + R_p`` (the
    gradient with the residual of error feedback, in ``T``'s coordinates) mapped back to
    parameter coordinates, ``e_p = ‖(deq(Q(G T + R_p)) − (G T + R_p)) T⁻¹‖²``: the error
    the step leaves behind, which is what error feedback carries on. It is reduced across
    ranks (one all-reduce of ``len(PATHS) + 1`` float64 per tensor, with ``‖G‖²``) at the
    next step; a tensor's cost of path ``p`` is ``numel · e_p / ‖G‖²``, its mean squared
    *relative* error per element summed over the elements, the error an element-wise
    normalising optimizer (Adam) sees. Measuring costs, once per measurement step, one
    codec round trip per admissible path of every tensor (about three encodes of the whole
    gradient, each geometry path adding its map and inverse), nothing on other steps.

    **When.** Measurements are taken at the first low-precision step (``first_step``, the
    end of the FP32 warm-up) and at every refresh (``step % every == 0``) after it; each is
    decided at the start of the next step, so the budget holds from the second low-precision
    step on. The geometry path is admissible once a factor exists (after the first refresh).

    **Bytes.** A tensor's cost of a path is the bytes one rank sends for it in the exact
    collective, averaged over the ranks (:func:`~geofp8.comm.layout.tensor_wire_bytes`:
    codes, scales, the all-gather's copies). The budget is ``B · (Σ elements) · 2(N−1)/N``
    bytes per step and rank; from it goes a *reserve* for the factor and selection traffic:
    its mean per step over the period since the last decision (averaged over the ranks;
    statistics are reduced for every candidate whichever path it takes, so it does not
    depend on the choice), plus what that period spent beyond the reserve it was planned
    with, spread over the next ``every`` steps (the first period, planned before any
    refresh, reserves nothing), so that the mean over the run keeps to the budget.

    **Choice** (a multiple-choice knapsack, solved greedily): every tensor starts at the
    least-error path among the cheapest ones; then upgrades ``(tensor, p)`` are taken in
    decreasing order of error saved per extra byte while they fit. With two byte levels (4 and
    8 bits) the greedy is optimal up to the one upgrade that does not fit. The inputs are
    all-reduced and the order is total (ties by tensor order), so every rank chooses alike.
    A budget below the floor raises at construction; when the reserve pushes the floor over
    the budget, every tensor stays at the floor (a warning).

    **Changes** happen only at the step after a measurement. A layer whose route changes has
    its residual re-based ``R T_old⁻¹ T_new`` when it is next read
    (:meth:`~geofp8.feedback.ErrorFeedback.residual_in`); a residual is FP32 in its
    coordinates, not in a format, so a format change carries it on as it is (it is the part
    of the gradient not yet delivered). With ``owner_feedback`` the owner of each reduced
    piece keeps a residual of the second rounding, in Euclidean coordinates, for tensors sent
    without a map: a format change carries it on as it is too; a change to the geometry path
    hands it over to that rank's send at the first finite step on the new route (added to
    ``Ũ`` in the new coordinates, its error going on in the sender's residual), so that
    nothing undelivered is lost (:meth:`~geofp8.pipeline.GradientPipeline.prepare_into`);
    a change back starts a new owner's residual.
    """

    charges = True

    def __init__(self, candidates: list[str], floor: Codec, shapes: dict[str, tuple],
                 world_size: int, budget: float, every: int, first_step: int) -> None:
        super().__init__(candidates)
        self.budget, self.every, self.first_step = budget, every, first_step
        self.world_size = world_size
        self.tensors = list(shapes)  # every communicated tensor: the rows of a measurement
        self.index = {n: i for i, n in enumerate(self.tensors)}
        self.codecs = {"nvfp4": floor, "e4m3": make_codec("e4m3", "tensor")}
        self.numel = [torch.Size(shapes[n]).numel() for n in self.tensors]
        candidate = set(candidates)
        self.costs = [[tensor_wire_bytes(shapes[n], self.codecs[fmt], world_size)
                       if n in candidate or not geometry else float("inf")
                       for fmt, geometry in PATHS] for n in self.tensors]
        ring = 2 * (world_size - 1) / world_size
        self.elements_ring = sum(self.numel) * ring
        self.limit = budget * self.elements_ring  # bytes per step and rank
        floor_bytes = sum(c[0] for c in self.costs)
        if floor_bytes > self.limit:
            raise ValueError(
                f"GeoFP8Config(budget={budget}): the cheapest assignment (every tensor in "
                f"nvfp4) needs {floor_bytes / self.elements_ring:.4f} bytes per element per "
                "round trip; raise the budget")
        self.path = [0] * len(self.tensors)
        self.planned = floor_bytes / self.elements_ring if ring else 0.0
        self.reserve = 0.0  # factor bytes per step and rank planned at the last decision
        self._pending: torch.Tensor | None = None
        self.measured: torch.Tensor | None = None
        self.factor_window = [0.0, 0]  # factor bytes sent and steps since the last decision
        self.last_measurement: dict[str, dict[str, float]] = {}

    def wants(self, step: int) -> bool:
        return step == self.first_step or (step > self.first_step and step % self.every == 0)

    def next_start(self, step: int) -> float:
        """The step after a measuring one (it decides), else the next measuring step."""
        if self.wants(step):
            return step + 1
        if step < self.first_step:
            return self.first_step
        return (step // self.every + 1) * self.every

    def observe(self, name, G, geo, residual_in) -> None:
        if self._pending is None:
            self._pending = torch.zeros(len(self.tensors), len(PATHS) + 1,
                                        dtype=torch.float64)
        row = self._pending[self.index[name]]
        for col, (fmt, geometry) in enumerate(PATHS):
            route = geo if geometry else IDENTITY
            if route is None:  # no factor (yet, or ever): the path cannot be taken
                row[col] = float("nan")
                continue
            residual = residual_in(route)
            U = route.forward(G) if residual is None else route.forward(G) + residual
            error = self.codecs[fmt].round_trip(U) - U
            row[col] += float(route.inverse(error).pow(2).sum())
        row[-1] += float(G.pow(2).sum())

    def settle(self, finite: torch.Tensor) -> None:
        # a measuring step reads its errors back already: its verdict is read with them
        if self._pending is not None and bool(finite):
            self.measured = self._pending
        self._pending = None

    def charged(self, factor_bytes: float) -> None:
        self.factor_window[0] += factor_bytes
        self.factor_window[1] += 1

    def codec_of(self, name: str) -> Codec | None:
        i = self.index.get(name)
        return None if i is None else self.codecs[PATHS[self.path[i]][0]]

    def figures(self) -> dict:
        """Every tensor's path (``formats``), the bytes per element per round trip planned at
        the last decision, and the last measured relative errors."""
        return {"formats": self.assignment(), "budget": self.budget,
                "budget_planned": self.planned,
                "budget_errors": {n: dict(e) for n, e in self.last_measurement.items()}}

    def assignment(self) -> dict[str, str]:
        """Every tensor's path, by parameter name (``nvfp4``, ``nvfp4-geo``, ``e4m3``)."""
        return {n: path_name(PATHS[p]) for n, p in zip(self.tensors, self.path)}

    def start_step(self, step: int, group: DeviceGroup) -> None:
        if self.measured is None:
            return
        total, steps = self.factor_window
        flat = torch.cat([self.measured.reshape(-1),
                          torch.tensor([total / max(1, steps)], dtype=torch.float64)])
        m, _ = group.all_reduce(flat, "factor")
        m = m.cpu()
        self.measured, self.factor_window = None, [0.0, 0]
        factor = float(m[-1]) / group.size  # per step and rank, averaged over the ranks
        overspent = max(0.0, factor - self.reserve) * steps  # the last period's, in bytes
        self._decide(m[:-1].view(len(self.tensors), len(PATHS) + 1),
                     factor + overspent / self.every)

    def _decide(self, errors: torch.Tensor, reserve: float) -> None:
        """The assignment of least error within the budget less ``reserve`` bytes per step
        (class notes) from the reduced ``errors`` (per tensor: ``e_p`` per path, then
        ``‖G‖²``)."""
        self.last_measurement = {}
        cost: list[list[float]] = []  # per tensor and path: weighted error (inf: none)
        for i, name in enumerate(self.tensors):
            norm = float(errors[i, -1])
            row = [float(e) * self.numel[i] / norm
                   if norm > 0 and torch.isfinite(e) and self.costs[i][p] < float("inf")
                   else float("inf") for p, e in enumerate(errors[i, :-1])]
            if norm > 0:
                self.last_measurement[name] = {
                    path_name(p): (e / self.numel[i]) ** 0.5
                    for p, e in zip(PATHS, row) if e < float("inf")}
            cost.append(row)
        path = []
        for i, row in enumerate(cost):
            cheapest = min(self.costs[i])
            floors = [p for p, c in enumerate(self.costs[i]) if c == cheapest]
            path.append(min(floors, key=lambda p: (row[p], p)))
        spent = reserve + sum(c[p] for c, p in zip(self.costs, path))
        if spent > self.limit:
            warnings.warn(f"GeoFP8 budget {self.budget}: the factor traffic puts the floor at "
                          f"{spent / self.elements_ring:.4f} bytes per element; every "
                          "tensor stays at the floor", stacklevel=2)
        else:
            upgrades = sorted(
                ((cost[i][path[i]] - cost[i][p]) / (self.costs[i][p] - self.costs[i][path[i]]),
                 i, p)
                for i in range(len(self.tensors)) for p in range(len(PATHS))
                if self.costs[i][p] > self.costs[i][path[i]] and cost[i][p] < cost[i][path[i]])
            base = list(path)
            for _, i, p in sorted(upgrades, key=lambda u: (-u[0], u[1], u[2])):
                extra = self.costs[i][p] - self.costs[i][path[i]]
                if path[i] == base[i] and spent + extra <= self.limit:
                    path[i], spent = p, spent + extra
        self.path, self.reserve = path, reserve
        self.planned = spent / self.elements_ring if self.elements_ring else 0.0
        self.selected = {n for n, p in zip(self.tensors, path) if PATHS[p][1]}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "path": list(self.path), "planned": self.planned,
                "reserve": self.reserve, "factor_window": list(self.factor_window),
                "measured": None if self.measured is None else self.measured.clone()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.path, self.planned = list(state["path"]), float(state["planned"])
        self.reserve = float(state["reserve"])
        self.factor_window = [float(state["factor_window"][0]),
                              int(state["factor_window"][1])]
        measured = state.get("measured")
        self.measured = None if measured is None else measured.clone()
        self._pending = None


def make_selection(config, codec: Codec, candidates: list[str], factor_source: str,
                   shapes: dict[str, tuple] | None = None, world_size: int = 1) -> Selection:
    """The selection policy of ``config.layers`` over ``candidates`` (parameter names), or
    of ``config.budget`` (``shapes``: every communicated parameter's, by name, over
    ``world_size`` ranks). Module names in ``config.layers`` that are not candidates raise."""
    if config.budget is not None:
        return BudgetSelection(candidates, codec, shapes or {}, world_size, config.budget,
                               config.refresh_every, config.warmup_steps)
    layers = config.layers
    if isinstance(layers, (list, tuple)):
        refused = [n for n in layers if f"{n}.weight" not in candidates]
        if refused:
            raise ValueError(
                f"GeoFP8Config(layers=...) names {refused}, which are not candidates under "
                f"candidates={config.candidates!r} (candidates: "
                f"{[c.removesuffix('.weight') for c in candidates]}); name them in "
                "candidates too, or use candidates='linear'")
    if not candidates:
        return FixedSelection(candidates)
    if layers == "profile":
        return ProfileSelection(candidates, codec, config.warmup_steps, config.profile_steps,
                                config.profile_top)
    if layers == "auto":
        # a refreshed factor exists only after the first refresh; fresh/local from step 0
        first = config.refresh_every if factor_source == "refresh" else 0
        return AutoSelection(candidates, codec, config.refresh_every, config.auto_margin,
                             first)
    if layers == "all":
        return FixedSelection(candidates, set(candidates))
    if layers == "none":
        return FixedSelection(candidates)
    return FixedSelection(candidates, {f"{n}.weight" for n in layers} & set(candidates))
