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

Selections observe gradients while buckets are encoded; what they observe in a step counts
only if the step is settled as finite. Decisions need a collective and are taken at the
start of the next step (:meth:`Selection.start_step`), identically on every rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .codecs import Codec
from .comm.group import DeviceGroup
from .geometry.transforms import IDENTITY, Transform

__all__ = ["AutoSelection", "FixedSelection", "ProfileSelection", "Selection",
           "make_selection"]

ResidualIn = Callable[[Transform], "torch.Tensor | None"]


class Selection:
    """Base: a fixed set of selected names; nothing observed, nothing decided."""

    def __init__(self, candidates: list[str], selected: set[str] | None = None) -> None:
        self.candidates = list(candidates)
        self.index = {n: i for i, n in enumerate(self.candidates)}
        self.selected: set[str] = set(selected or ())

    def wants(self, step: int) -> bool:
        """Whether :meth:`observe` should be called for the candidates of this step."""
        return False

    def observe(self, name: str, G: torch.Tensor, geo: Transform | None,
                residual_in: ResidualIn) -> None:
        """See one candidate's FP32 gradient ``G`` (2-D) and its geometry map, if any."""

    def start_step(self, step: int, group: DeviceGroup) -> None:
        """Decide, from what earlier settled steps observed (collective on ``group``)."""

    def settle(self, finite: bool) -> None:
        """Keep (finite step) or drop what this step observed."""

    def state_dict(self) -> dict:
        return {"selected": sorted(self.selected)}

    def load_state_dict(self, state: dict) -> None:
        self.selected = set(state["selected"])


class FixedSelection(Selection):
    """``all``, ``none`` or explicit names (they never change)."""


class ProfileSelection(Selection):
    """The paper's vulnerability profile (see the module notes)."""

    def __init__(self, candidates: list[str], codec: Codec, start: int, steps: int,
                 top: int | None) -> None:
        super().__init__(candidates)
        self.codec, self.start, self.steps = codec, start, steps
        self.top = top or max(1, len(candidates) // 4)
        self.totals = torch.zeros(len(candidates), dtype=torch.float64)
        self._pending = torch.zeros_like(self.totals)
        self.scores: dict[str, float] = {}

    def wants(self, step: int) -> bool:
        return self.start <= step < self.start + self.steps

    def observe(self, name, G, geo, residual_in) -> None:
        self._pending[self.index[name]] += self.codec.clipped_fraction(G)

    def start_step(self, step: int, group: DeviceGroup) -> None:
        if step != self.start + self.steps or not self.candidates:
            return
        scores, _ = group.all_reduce(self.totals.clone(), "factor")
        scores = scores.cpu()
        order = torch.argsort(scores, descending=True, stable=True)[: self.top]
        self.selected.update(self.candidates[i] for i in order.tolist())
        self.scores = {n: float(scores[i]) / self.steps for i, n in enumerate(self.candidates)}

    def settle(self, finite: bool) -> None:
        if finite:
            self.totals += self._pending
        self._pending.zero_()

    def state_dict(self) -> dict:
        return {**super().state_dict(), "totals": self.totals.clone()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.totals.copy_(state["totals"])
        self._pending.zero_()


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

    def observe(self, name, G, geo, residual_in) -> None:
        if geo is None:
            return
        if self._pending is None:
            self._pending = torch.zeros(len(self.candidates), 3, dtype=torch.float64)
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

    def settle(self, finite: bool) -> None:
        if finite and self._pending is not None:
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


def make_selection(config, codec: Codec, candidates: list[str],
                   factor_source: str) -> Selection:
    """The selection policy of ``config.layers`` over ``candidates`` (parameter names).
    Module names in ``config.layers`` that are not candidates raise."""
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
