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

import warnings
from dataclasses import dataclass

import torch
from torch import nn

from .candidates import find_candidates
from .codecs import make_codec
from .comm.group import DeviceGroup
from .comm.layout import ShardLayout
from .comm.stages import encode, encode_with_error
from .feedback import ErrorFeedback
from .geometry.sources import LocalFactors, SharedInputs, make_source
from .geometry.transforms import IDENTITY, LowRankInput, Transform
from .ledger import StepLedger
from .selection import BudgetSelection, make_selection

__all__ = ["Encoded", "GradientPipeline"]



@dataclass
class Encoded:
    """One encoded set of gradients and what is needed to map the sum back."""

    sent: torch.Tensor  # uint8: every shard's payload (and side bytes)
    layout: ShardLayout
    names: list[str]
    shapes: list[tuple[int, ...]]
    routes: list[Transform]
    per_sender: tuple[bool, ...]  # mapped back by the receiver with each sender's own map
    side_bytes: int  # bytes of sender factors in what this rank sends to the others


class GradientPipeline:
    """Routing, factors, selection, error feedback and encoding of one model's gradients.

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
        # the residuals of the exact collective's second rounding (owner_feedback), set by
        # the DDP adapter: see owner_keys and prepare_into
        self.owner: ErrorFeedback | None = None
        self.step = 0
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
        """Decisions and refreshes due at the start of ``step`` (collective)."""
        self.selection.start_step(step, self.group)
        if self.source is not None:
            self._agree()  # already done at the forward's end, unless the model's own
            self.source.start_step(step)  # forward was never called (its parts were)
        self._observing = self.source is not None and self.selection.wants(step)
        self.step = step

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
        if self.source is not None:
            self.source.settle(finite)
        self.selection.settle(finite)
        if self.geometry_since is None and self.geometry_layers():
            self._geometry_steps.append((self.step, finite))
            if len(self._geometry_steps) >= 64:  # bounded: one host read per 64 such steps
                self._resolve_geometry_since()
        self.feedback.commit(finite)

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
        ``in_place``: ``out`` is ``G``'s own memory (read before it is written).

        **Owner hand-over** (``owner_feedback``): the second rounding's residual ``O`` of a
        tensor lives in Euclidean coordinates, on the rank that owns its piece of the reduced
        shard, and is kept only while the tensor is sent without a map
        (:meth:`owner_keys`). In the first step in which the tensor takes a map again (a
        budget's or an ``auto`` selection's change of route), its owner's residual cannot
        be re-based on the owner's piece (``T`` mixes whole rows): it is *handed over* to
        this rank's send instead, ``Ũ = G T + R + O T`` (``O`` zero outside the piece), and
        so reaches the sum whole, its rounding error going on in the sender's residual
        ``R`` (with ``error_feedback``), which is re-based with the route. Every rank does
        so with the piece it owns. The owner's residual is dropped at once; a non-finite
        step resets the sender's residual it wrote to zero, so the handed-over error is
        then lost, as every residual of a skipped step is. A change of format alone (``nvfp4`` ↔
        ``e4m3``) keeps the owner's residual as it is, as the sender's."""
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
        (not a geometry candidate, not observed, routed through identity, no owner's
        residual to hand over): an adapter may then add the residual piece by piece
        instead of calling :meth:`prepare_into`."""
        return (not (name in self.layers and self.source is not None)
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
        """``O T``: this rank's owner residual of ``name`` as a whole tensor in ``route``'s
        coordinates, removing it (:meth:`prepare_into`); ``None`` when it has none or
        keeps it."""
        owner = self.owner
        if owner is None or name not in owner.residuals or self._owner_keeps(name, route):
            return None
        piece = owner.residual_in(name, IDENTITY).reshape(-1)
        # this rank's piece of the tensor as the exact collective cuts it (by itself)
        alone = ShardLayout.build([tuple(shape)], self.codec, self.world_size)
        [(lo, hi)] = alone.segments[self.rank] or [(0, 0)]
        if piece.numel() != hi - lo:
            raise RuntimeError(f"GeoFP8: the owner residual of {name} has {piece.numel()} "
                               f"elements, not its piece's {hi - lo}")
        whole = torch.zeros(alone.numel, dtype=torch.float32, device=piece.device)
        whole[lo:hi] = piece
        owner.drop(name)
        whole = whole.view(shape)
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

    # -- a set of gradients in one flat payload (a DDP bucket) --------------------------------

    def encode(self, names: list[str], grads: list[torch.Tensor],
               seed: int | None = None, flat: torch.Tensor | None = None) -> Encoded:
        """Route, add residuals, encode (``seed``: stochastic rounding's, the same on every
        rank for this step and bucket); write the new residuals. ``flat``: where ``Ũ`` is
        written, FP32, one tensor after the other (the buffer that ``grads`` tile in order,
        as a DDP bucket's do: each is read before its place is written); else a new one."""
        shapes = [tuple(g.shape) for g in grads]
        in_place = flat is not None
        if flat is None:
            flat = torch.empty(sum(g.numel() for g in grads), dtype=torch.float32,
                               device=grads[0].device if grads else self.group.device)
        bucket = self._bucket_residual(names, shapes) if in_place else None
        if bucket is not None:  # Ũ = G + R over the bucket at once, in the encode: G is flat
            routes = [IDENTITY] * len(names)
        else:
            routes, pos = [], 0
            for name, g in zip(names, grads):
                slot = flat[pos : pos + g.numel()].view(g.shape)
                routes.append(self.prepare_into(name, g, slot, in_place))
                pos += g.numel()
        per_sender = tuple(self._per_sender(n) for n in names)
        layout = self._layout(shapes, per_sender, tuple(self.codec_of(n) for n in names))
        side = self._sender_factors(shapes, per_sender, routes, layout) if any(per_sender) \
            else None
        if self.config.error_feedback:  # R ← Ũ − deq(Q(Ũ)): into a bucket's R, or over Ũ
            sent, residual = encode_with_error(flat, layout, side, seed, self.group.rank,
                                               error_out=flat, feedback=bucket)
            whole = bucket is not None or (in_place and all(self.plain(n) for n in names)
                                           and self.feedback.first_bucket(names))
            if whole:
                self.feedback.stage_bucket(names, residual, shapes)
            pos = 0
            for name, shape, route in zip(names, shapes, routes) if not whole else ():
                n = torch.Size(shape).numel()
                self.feedback.stage(name, residual[pos : pos + n].view(shape), route)
                pos += n
        else:
            sent = encode(flat, layout, side, seed, sender=self.group.rank)
        side_bytes = sum(layout.side[j] for j in range(self.world_size) if j != self.rank)
        return Encoded(sent, layout, list(names), shapes, routes, per_sender, side_bytes)

    def _bucket_residual(self, names: list[str], shapes: list[tuple[int, ...]]
                         ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """``(R, flag)`` of a bucket whose every tensor is :meth:`plain` and has a residual
        (:meth:`ErrorFeedback.bucket_in`: one flat vector): the encode then adds it and
        writes the new residual into it (:func:`~geofp8.comm.stages.encode_with_error`'s
        ``feedback``); else ``None`` (tensor by tensor)."""
        if not self.config.error_feedback or not all(self.plain(n) for n in names):
            return None
        return self.feedback.bucket_in(names, shapes)

    def decode(self, encoded: Encoded, total: torch.Tensor, divided: bool = False
               ) -> torch.Tensor:
        """The mean ``(Σ / N) T⁻¹`` of every tensor, written over the collective's FP32 sum
        ``total`` (one tensor after the other, as :meth:`encode` laid them; ``divided``:
        ``Σ / N`` already, the collective's ``divide``); returns it."""
        if not divided:
            total.div_(total.new_full((), self.world_size))  # exact on CUDA (codecs.exact_div)
        pos = 0
        for shape, route, mapped in zip(encoded.shapes, encoded.routes, encoded.per_sender):
            n = torch.Size(shape).numel()
            if not mapped and route is not IDENTITY:
                y = total[pos : pos + n].view(shape)
                y.copy_(route.inverse(y))
            pos += n
        return total

    def codec_of(self, name: str):
        """The wire codec of ``name`` this step (the selection's under a budget)."""
        return self.selection.codec_of(name) or self.codec

    def _layout(self, shapes: list[tuple[int, ...]], per_sender: tuple[bool, ...],
                codecs: tuple) -> ShardLayout:
        key = (tuple(shapes), per_sender, codecs)
        if key not in self._layouts:
            side = [self._factor_bytes(shape[1]) if mapped else 0
                    for shape, mapped in zip(shapes, per_sender)]
            self._layouts[key] = ShardLayout.build(shapes, self.codec, self.world_size,
                                                   list(per_sender), side, list(codecs),
                                                   kernels=self.config.kernels)
        return self._layouts[key]

    # -- per-sender (local) factors ----------------------------------------------------------

    def _factor_bytes(self, d_in: int) -> int:
        """``U`` (``d_in × k``), ``d_inv`` (``k``) and ``c_inv`` as float32."""
        k = self.source.rank_of(d_in)
        return 4 * (d_in * k + k + 1)

    def _sender_factors(self, shapes, per_sender, routes, layout: ShardLayout
                        ) -> list[torch.Tensor]:
        """Per shard: this sender's inverse map of every per-sender-decoded tensor in it."""
        blobs, device = {}, self.group.device
        for i, (shape, mapped, t) in enumerate(zip(shapes, per_sender, routes)):
            if not mapped:
                continue
            d, k = shape[1], self.source.rank_of(shape[1])
            if isinstance(t, LowRankInput):
                parts = [t.U.reshape(-1), t.d_inv, t.U.new_full((1,), t.c_inv)]
            else:  # no factor on this rank this step: the identity map
                parts = [torch.zeros(d * k + k, device=device), torch.ones(1, device=device)]
            blobs[i] = torch.cat([p.to(device, torch.float32) for p in parts]).view(torch.uint8)
        return [torch.cat([blobs[i] for i in layout.owners[j] if i in blobs] or
                          [torch.zeros(0, dtype=torch.uint8, device=device)])
                for j in range(layout.world_size)]

    def unmap(self, encoded: Encoded):
        """``unmap(rows, sides)`` for this receiver's shard (``[N, shard]`` decoded copies and
        ``[N, side bytes]``): ``V T_r⁻¹`` per sender ``r`` (``None`` when nothing in
        ``encoded`` is decoded per sender)."""
        if not any(encoded.per_sender):
            return None
        j, layout, shapes = self.rank, encoded.layout, encoded.shapes

        def unmap(rows: torch.Tensor, sides: torch.Tensor) -> torch.Tensor:
            for values, side in zip(rows, sides):  # one sender's factors each
                pos = spos = 0
                for (lo, hi), i in zip(layout.segments[j], layout.owners[j]):
                    if encoded.per_sender[i]:
                        d, k = shapes[i][1], self.source.rank_of(shapes[i][1])
                        nb = self._factor_bytes(d)
                        f = side[spos : spos + nb].clone().view(torch.float32)
                        U, d_inv, c_inv = f[: d * k].view(d, k), f[d * k : d * k + k], f[-1]
                        V = values[pos : pos + hi - lo].view(-1, d)
                        values[pos : pos + hi - lo] = (V * c_inv
                                                       + ((V @ U) * d_inv) @ U.T).view(-1)
                        spos += nb
                    pos += hi - lo
            return rows
        return unmap

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
        selection = self.selection
        if not isinstance(selection, BudgetSelection):
            return {}
        return {"formats": selection.assignment(), "budget": selection.budget,
                "budget_planned": selection.planned,
                "budget_errors": {n: dict(e) for n, e in selection.last_measurement.items()}}

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
        self.geometry_since = state.get("geometry_since")  # absent in older checkpoints
        self._geometry_steps = []
        self.selection.load_state_dict(state["selection"])
        if self.source is not None:
            self.source.load_state_dict(state["source"])
