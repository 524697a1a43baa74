"""The gradient pipeline: from (parameter names, gradients) to a payload and back.

For a set of gradients ``G_p`` (one bucket, or one FSDP group):

* route: ``T_p`` is the layer's geometry map (:mod:`geofp8.geometry.sources`) when the
  selection (:mod:`geofp8.selection`) has chosen it, else the identity;
* error feedback (:mod:`geofp8.feedback`): ``Ũ_p = G_p T_p + R_p``;
* encode (:mod:`geofp8.comm.stages`) with the layout of the collective; the new residual
  ``R_p ← Ũ_p − deq(Q(Ũ_p))`` is written over the last one (zero if the step is skipped);
* after the collective's FP32 sum ``Σ``: ``Ĝ_p = (Σ / N) T_p⁻¹``.

The pipeline issues no collective itself: the adapters (:mod:`geofp8.ddp`, FSDP) launch the
payload, and the factor sources and selections use the :class:`~geofp8.comm.group.DeviceGroup`
they are given. :meth:`GradientPipeline.start_step` and :meth:`~GradientPipeline.settle`
bracket a step; per tensor, :meth:`~GradientPipeline.prepare_into` and
:meth:`~GradientPipeline.map_back` are the two halves of the route.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn

from .bucket_path import BucketPath, Encoded
from .bucket_record import RecordedDecisions
from .candidates import find_candidates
from .codecs import make_codec
from .comm.group import DeviceGroup
from .comm.layout import ShardLayout
from .feedback import ErrorFeedback
from .geometry.sources import LocalFactors, SharedInputs, make_source
from .geometry.transforms import IDENTITY, Transform
from .handover import hand_over
from .ledger import StepLedger
from .selection import make_selection
from .sender_factors import factor_bytes, sender_factors, unmap_per_sender

__all__ = ["Encoded", "GradientPipeline"]


class GradientPipeline(BucketPath, RecordedDecisions):
    """Routing, factors, selection, error feedback and encoding of one model's gradients
    (the bucket's encode and decode: :class:`~geofp8.bucket_path.BucketPath`).

    Args:
        model: the module whose parameters are communicated.
        config: a :class:`~geofp8.config.GeoFP8Config`.
        group: the data-parallel :class:`DeviceGroup` (factor and selection traffic).
        ledger: the :class:`StepLedger` that receives timings.
        candidates: which Linear layers may take geometry (see :func:`find_candidates`).
        residual_storage: ``"fp32"``, ``"bf16"``, ``"fp8"`` or ``"nvfp4"`` error-feedback
            residuals (see :mod:`geofp8.feedback`).
    """

    def __init__(self, model: nn.Module, config, group: DeviceGroup, ledger: StepLedger,
                 candidates="blocks", residual_storage: str = "fp32") -> None:
        self.config, self.group, self.ledger = config, group, ledger
        self.world_size, self.rank = group.size, group.rank
        self.codec = make_codec(config.format, config.scaling, config.block_size,
                                config.rounding)
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.layers = find_candidates(model, self.names, candidates, config.min_dim)
        if not self.layers and config.transform != "euclidean" and config.layers != "none":
            warnings.warn(f"GeoFP8: the model has no candidate layer (candidates="
                          f"{config.candidates!r}, min_dim={config.min_dim}): every gradient "
                          f"is communicated in plain {config.format} (Euclidean)", stacklevel=3)
        devices = {n: p.device for n, p in model.named_parameters()}
        self.source = make_source(config, self.layers, ledger, group, devices,
                                  self.codec.block_size)
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}
        self.selection = make_selection(config, self.codec, list(self.layers),
                                        config.factor_source, shapes, self.world_size)
        self.feedback = ErrorFeedback(storage=residual_storage)
        self.shared = self.source.shared if self.source is not None else SharedInputs()
        modules = dict(model.named_modules())
        self.hooks = self.source.attach(modules) if self.source is not None else []
        self._layouts: dict[tuple, ShardLayout] = {}
        self._observing = False
        self.next_start: float = 0  # the first step whose start may decide anything
        # the residuals of the exact collective's second rounding (owner_feedback), set by
        # the DDP adapter: see owner_keys and prepare_into
        self.owner: ErrorFeedback | None = None
        self.geometry_since: int | None = None  # the first settled step with a layer on a map
        self._geometry_steps: list[tuple[int, torch.Tensor]] = []  # (step, finite) to resolve

    # -- step boundaries ---------------------------------------------------------------------

    def forward_done(self) -> None:
        """The model's training forward returned: the ranks agree on the shared inputs (the
        first time) and the factor source launches its reductions (collective)."""
        if self.source is None:
            return
        self._agree()
        self.source.forward_done()

    def _agree(self) -> None:
        if not self.shared.agreed:
            self.shared.agree(list(self.layers), self.group)

    def start_step(self, step: int) -> None:
        """Decisions and refreshes due at the start of ``step`` (collective), if any may be:
        none before :attr:`next_start`, the first step at which the selection or the source
        may act (their ``next_start``), nor what they change (the observing, the decisions);
        any step after a rolled-back one or a loaded state (:meth:`forget_records`). (An
        engine does not call it before then.)"""
        if step >= self.next_start:
            self._start(step)

    def _start(self, step: int) -> None:
        self.selection.start_step(step, self.group)
        if self.source is not None:
            self._agree()  # already done at the forward's end, unless the model's own
            self.source.start_step(step)  # forward was never called (its parts were)
        self._observing = self.source is not None and self.selection.wants(step)
        self.note_decisions()
        self.next_start = min(self.selection.next_start(step),
                              math.inf if self.source is None else self.source.next_start(step))

    def report(self) -> None:
        """Give the warnings that wait on device flags (a host read; see
        :meth:`FactorSource.report`)."""
        if self.source is not None:
            self.source.report()
        self._resolve_geometry_since()

    def _resolve_geometry_since(self) -> None:
        """The first of the steps that sent a layer through a map whose verdict was finite
        (their device flags read here, with the stats, not in the step)."""
        for step, finite in self._geometry_steps:
            if bool(finite):
                self.geometry_since = step
                break
        self._geometry_steps = []

    def settle(self, finite: torch.Tensor) -> None:
        """Hand the step's 0-dim verdict (on the device) to what it produced: kept where
        true, chosen away (residuals: reset to zero) where false."""
        self.feedback.commit(finite)
        if self.source is not None:  # (no map without one; the steps sent through one:)
            self.source.settle(finite)
            if self.geometry_since is None and (self._mapped or self.source.per_step
                                                and bool(self.geometry_layers())):
                self._geometry_steps.append((self.ledger.step, finite))
                if len(self._geometry_steps) >= 64:  # bounded: a host read per 64 such steps
                    self._resolve_geometry_since()
        if self._observing:  # (a selection that observed nothing has nothing to settle)
            self.selection.settle(finite)

    # -- per tensor --------------------------------------------------------------------------

    def route(self, name: str) -> Transform:
        """``T`` of ``name`` this step: its geometry map if selected and built, else identity."""
        if name not in self.selection.selected or self.source is None:
            return IDENTITY
        transform = self.source.transform(name)
        return IDENTITY if transform is None else transform

    def prepare_into(self, name: str, G: torch.Tensor, out: torch.Tensor,
                     in_place: bool = False) -> Transform:
        """Write ``Ũ = G T + R`` (FP32, ``G``'s shape) into ``out``; returns ``T``.
        ``in_place``: ``out`` is ``G``'s own memory (read before it is written). With
        ``owner_feedback``, a tensor that takes a map again gets its owner's residual ``O``
        handed over: ``Ũ = G T + R + O T`` (:mod:`geofp8.handover`)."""
        candidate = name in self.layers and self.source is not None
        if candidate:
            self.source.prepare(name)
        route = self.route(name)
        G = G.detach().float()
        if self._observing and self.selection.observes(name):
            self.selection.observe(name, G, self.source.transform(name) if candidate else None,
                                   lambda r: self._residual(name, r))
        x = G if route is IDENTITY else route.forward(G)
        residual = self._residual(name, route)
        handed = self._hand_over(name, route, G.shape)
        if handed is not None:
            residual = handed if residual is None else residual + handed
        if residual is None:
            if not (in_place and route is IDENTITY):  # else Ũ = G is in place already
                out.copy_(x)
        else:
            torch.add(x, residual, out=out)
        return route

    def plain(self, name: str) -> bool:
        """Whether ``Ũ = G + R`` of ``name`` needs nothing of its whole gradient this step
        (no map of this step to prepare, not observed, routed through identity, no owner's
        residual to hand over): an adapter may then add the residual piece by piece
        instead of calling :meth:`prepare_into`, or over the whole bucket at once. A
        candidate the selection has not chosen is plain unless its source builds maps
        every step (fresh, local: :attr:`FactorSource.per_step`)."""
        candidate = name in self.layers and self.source is not None
        return (not (candidate and (self.source.per_step or name in self.selection.selected))
                and not (self._observing and self.selection.observes(name))
                and self.route(name) is IDENTITY
                and (self.owner is None or name not in self.owner.residuals))

    def _per_sender(self, name: str) -> bool:
        """Whether ``name`` is decoded with each sender's own map (local factors)."""
        return (isinstance(self.source, LocalFactors) and name in self.selection.selected
                and name in self.layers)

    def _owner_keeps(self, name: str, route: Transform) -> bool:
        """Whether the owner's residual of ``name`` is applied this step (no map)."""
        return route is IDENTITY and not self._per_sender(name)

    def _hand_over(self, name: str, route: Transform, shape) -> torch.Tensor | None:
        """``O T``: this rank's owner residual of ``name`` in ``route``'s coordinates, removed
        (:mod:`geofp8.handover`); ``None`` when it has none or keeps it."""
        owner = self.owner
        if owner is None or name not in owner.residuals or self._owner_keeps(name, route):
            return None
        whole = hand_over(owner, name, shape, self.codec, self.world_size, self.rank)
        return whole if route is IDENTITY else route.forward(whole)

    def owner_keys(self, encoded: Encoded) -> list[str | None]:
        """Per tensor of ``encoded``: its name if the owner of its reduced piece keeps a
        residual of the second rounding this step, else ``None`` (a tensor sent through a
        map: its reduced piece is in that map's coordinates, which a refresh moves and the
        owner cannot re-base; see :meth:`prepare_into` for what becomes of its residual)."""
        return [n if self._owner_keeps(n, route) else None
                for n, route in zip(encoded.names, encoded.routes)]

    def _residual(self, name: str, route: Transform) -> torch.Tensor | None:
        if not self.config.error_feedback:
            return None
        return self.feedback.residual_in(name, route)

    def map_back(self, route: Transform, Y: torch.Tensor) -> torch.Tensor:
        """``Y T⁻¹`` (identity routes pass ``Y`` through)."""
        return Y if route is IDENTITY else route.inverse(Y)

    # -- per-sender (local) factors: geofp8.sender_factors -----------------------------------

    def _factor_bytes(self, d_in: int) -> int:
        return factor_bytes(self.source, d_in)

    def _sender_factors(self, shapes, per_sender, routes, layout: ShardLayout
                        ) -> list[torch.Tensor]:
        return sender_factors(self.source, shapes, per_sender, routes, layout,
                              self.group.device)

    def unmap(self, encoded: Encoded):
        """``V T_r⁻¹`` per sender for this receiver's shard (:func:`unmap_per_sender`)."""
        return unmap_per_sender(self.source, encoded, self.rank)

    # -- reporting and checkpoints -----------------------------------------------------------

    def fingerprint(self) -> dict:
        """What every rank must agree on (JSON-serialisable)."""
        return {"candidates": sorted(self.layers)}

    def transforms(self) -> dict[str, Transform]:
        """This step's geometry map of every candidate that has one, by weight name."""
        if self.source is None:
            return {}
        return {n: t for n in self.layers if (t := self.source.transform(n)) is not None}

    def geometry_layers(self) -> list[str]:
        return sorted(n for n in self.selection.selected
                      if self.source is not None and self.source.transform(n) is not None)

    def budget_stats(self) -> dict:
        """Under a budget: every tensor's path (``formats``), the bytes per element per
        round trip planned at the last decision, and the last measured relative errors."""
        return self.selection.figures()

    @property
    def nonfinite_factors(self) -> int:
        """Statistics, sketches or maps found non-finite and reset so far (this rank)."""
        return self.source.rejected if self.source is not None else 0

    @property
    def factor_nbytes(self) -> int:
        return self.source.nbytes if self.source is not None else 0

    def state_dict(self) -> dict:
        """Selection and factors (the residuals are the engine's to save)."""
        self._resolve_geometry_since()
        return {"selection": self.selection.state_dict(),
                "source": self.source.state_dict() if self.source is not None else None,
                "geometry_since": self.geometry_since}

    def load_state_dict(self, state: dict) -> None:
        self.forget_records()
        self.geometry_since = state.get("geometry_since")  # absent in older checkpoints
        self._geometry_steps = []
        self.selection.load_state_dict(state["selection"])
        if self.source is not None:
            self.source.load_state_dict(state["source"])
