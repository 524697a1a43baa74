"""A bucket's gradients in one flat payload, and the collective's sum back (DDP's path).

:class:`BucketPath` is the part of :class:`~geofp8.pipeline.GradientPipeline` that works on a
whole set of gradients at once (one DDP bucket): ``Ũ`` of every tensor laid one after the
other (per tensor through :meth:`~geofp8.pipeline.GradientPipeline.prepare_into`, or, when
every tensor is :meth:`~BucketPath.steady`, each ``G T`` written in its slot and
``Ũ = G T + R`` over the bucket at once), the layout of the exact collective, the encode
with the new residuals, and the decode ``(Σ / N) T⁻¹`` of the sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .bucket_record import BucketRecord
from .codecs import triton_fp8, triton_map
from .codecs.base import device_scalar
from .codecs.triton_fp8 import feedback_fits
from .codecs.triton_map import BoundMaps
from .comm.bound import BoundStages
from .comm.layout import ShardLayout
from .comm.stages import encode, encode_with_error
from .feedback import NO_RESIDUALS
from .geometry.transforms import IDENTITY, LowRankInput, Transform

__all__ = ["BucketPath", "Encoded", "MapSlots", "TorchMaps"]


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
    slots: tuple = ()  # MapSlots: each tensor the receiver maps back by T⁻¹
    record: BucketRecord | None = None  # the bucket's decisions, kept for its next call
    bound: BoundStages | None = None  # its record's stages, for the collective's later ones
    maps: object | None = None  # its slots' maps bound to the bucket in place (MapSlots.bind)


class BucketPath:
    """Encode and decode of one flat payload (mixed into
    :class:`~geofp8.pipeline.GradientPipeline`, whose routes, feedback and selection it
    uses)."""

    def encode(self, names: list[str], grads: list[torch.Tensor],
               seed: int | None = None, flat: torch.Tensor | None = None,
               record: BucketRecord | None = None) -> Encoded:
        """Route, add residuals, encode (``seed``: stochastic rounding's, the same on every
        rank for this step and bucket); write the new residuals. ``flat``: where ``Ũ`` is
        written, FP32, one tensor after the other (the buffer that ``grads`` tile in order,
        as a DDP bucket's do: each is read before its place is written); else a new one.
        ``record``: the :attr:`Encoded.record` of this bucket's last call (with the same
        ``flat``: a record is made on the flat path only), followed while its generation is
        the current one and its residuals live (:mod:`geofp8.bucket_record`)."""
        if record is not None and record.generation == self.generation() and record.residuals.live:
            return self._encode_recorded(record, flat, seed)
        shapes = [tuple(g.shape) for g in grads]
        in_place = flat is not None
        if flat is None:
            flat = torch.empty(sum(g.numel() for g in grads), dtype=torch.float32,
                               device=grads[0].device if grads else self.group.device)
        per_sender = tuple(self._per_sender(n) for n in names)
        layout = self._layout(shapes, per_sender, tuple(self.codec_of(n) for n in names))
        routes, bucket = self._bucket_residual(names, shapes) if in_place else (None, None)
        if bucket is not None:  # Ũ = G T + R over the bucket at once, in the encode
            slots = self._map_slots(names, shapes, routes, per_sender, flat, layout)
            _map_over(slots, flat, inverse=False)  # G T over G, in its slot of the bucket
        else:
            routes, pos = [], 0
            for name, g in zip(names, grads):
                slot = flat[pos : pos + g.numel()].view(g.shape)
                routes.append(self.prepare_into(name, g, slot, in_place))
                pos += g.numel()
            slots = self._map_slots(names, shapes, routes, per_sender, flat, layout)
        side = self._sender_factors(shapes, per_sender, routes, layout) if any(per_sender) \
            else None
        if self.config.error_feedback:  # R ← Ũ − deq(Q(Ũ)): into a bucket's R, or over Ũ
            sent, residual = encode_with_error(flat, layout, side, seed, self.group.rank,
                                               error_out=flat, feedback=bucket)
            whole = bucket is not None or (in_place and all(self.plain(n) for n in names)
                                           and self.feedback.first_bucket(names))
            if whole:
                self.feedback.stage_bucket(names, residual, shapes, routes)
            pos = 0
            for name, shape, route in zip(names, shapes, routes) if not whole else ():
                n = torch.Size(shape).numel()
                self.feedback.stage(name, residual[pos : pos + n].view(shape), route)
                pos += n
        else:
            sent = encode(flat, layout, side, seed, sender=self.group.rank)
        side_bytes = sum(layout.side[j] for j in range(self.world_size) if j != self.rank)
        # the flat path: with error feedback the bucket's residual; without, every tensor
        # plain (Ũ = G, in place already)
        flat_path = bucket is not None or (in_place and not self.config.error_feedback
                                           and all(self.plain(n) for n in names))
        maps = slots.bind(flat) if in_place else None  # (kept by a record)
        record = self._record(names, shapes, routes, per_sender, slots, layout, side_bytes,
                              flat, bucket, maps) \
            if flat_path and self.recordable() and not any(per_sender) else None
        return Encoded(sent, layout, list(names), shapes, routes, per_sender, side_bytes,
                       slots, record, maps=maps)

    def _record(self, names: list[str], shapes: list[tuple[int, ...]],
                routes: list[Transform], per_sender: tuple[bool, ...], slots: MapSlots,
                layout: ShardLayout, side_bytes: int, flat: torch.Tensor,
                bucket: triton_fp8.Feedback | None, maps) -> BucketRecord:
        """The :class:`BucketRecord` of a bucket just encoded on the flat path: its stages
        bound for its vector and residual, and their send bound for both
        (:meth:`~geofp8.comm.bound.BoundStages.sender`), where the fused kernels take them."""
        bound = layout.plan.bound(flat, flat) if feedback_fits(flat, bucket) else None
        return BucketRecord(self.generation(),
                            NO_RESIDUALS if bucket is None else self.feedback.held(names),
                            tuple(names), tuple(shapes), tuple(routes), per_sender, slots,
                            layout, side_bytes, bound,
                            bound and bound.sender(flat, None if bucket is None else bucket[0]),
                            maps)

    def _encode_recorded(self, record: BucketRecord, flat: torch.Tensor,
                         seed: int | None) -> Encoded:
        """:meth:`encode` of a bucket as ``record`` resolved it, on the flat path: ``G T``
        over each mapped tensor's slot, then the encode, with error feedback the bucket's
        residual added and the new one written back into it (no Python per tensor but a
        map's): the record's bound send (its tensors checked when it was made), the stages'
        entry where it has none or a kernel failed."""
        # its check but the kernels' availability (a kernel may fail since)
        bound = record.bound if record.bound and record.bound.kernels.available(flat) else None
        if record.maps is not None:  # (no call for a bucket without a map)
            record.maps.forward()
        # with error feedback the bucket's residual R (its recorded vector) added and the new
        # one written in place, into R; without, no error is kept
        feedback = self.feedback.recorded(record.residuals) if self.config.error_feedback else None
        sent = bound and record.send(feedback, seed, self.group.rank)
        if sent is None:  # the torch path
            if feedback is None:
                sent = encode(flat, record.layout, None, seed, self.group.rank)
            else:  # (the error of Ũ written into R; error_out: the bucket, not read again)
                sent = encode_with_error(flat, record.layout, None, seed, self.group.rank, flat,
                                         feedback)[0]
        if feedback is not None:
            self.feedback.restage(record.names)
        return Encoded(sent, record.layout, record.names, record.shapes, record.routes,
                       record.per_sender, record.side_bytes, record.slots, record, bound,
                       record.maps)

    def _bucket_residual(self, names: list[str], shapes: list[tuple[int, ...]]):
        """``(routes, (R, flag))`` of a bucket whose every tensor is :meth:`steady` and has
        a residual in its route's coordinates (:meth:`ErrorFeedback.bucket_in`: one flat
        vector): the encode then adds it and writes the new residual into it
        (:func:`~geofp8.comm.stages.encode_with_error`'s ``feedback``); else
        ``(None, None)`` (tensor by tensor)."""
        if not self.config.error_feedback:
            return None, None
        routes = [self.steady(n) for n in names]
        if any(route is None for route in routes):
            return None, None
        bucket = self.feedback.bucket_in(names, shapes, routes)
        return (routes, bucket) if bucket is not None else (None, None)

    def steady(self, name: str) -> Transform | None:
        """``T`` of ``name`` when ``Ũ = G T + R`` needs nothing but ``G T`` this step:
        ``plain`` (identity), or on a map of a source that builds none per step, not
        observed, no owner's residual to hand over; else ``None``. A bucket of such tensors
        maps each ``G`` in place and adds ``R`` over the bucket at once, when every ``R``
        was written in its ``T``'s coordinates (:meth:`ErrorFeedback.bucket_in`; a changed
        route is re-based tensor by tensor, in ``prepare_into``)."""
        if self.plain(name):
            return IDENTITY
        route = self.route(name)
        handed_over = self.owner is not None and name in self.owner.residuals
        observed = self._observing and self.selection.observes(name)
        if route is IDENTITY or self.source.per_step or handed_over or observed:
            return None
        return route

    def decode(self, encoded: Encoded, total: torch.Tensor, divided: bool = False,
               finite: torch.Tensor | None = None) -> bool:
        """The mean ``(Σ / N) T⁻¹`` of every tensor, written over the collective's FP32 sum
        ``total`` (one tensor after the other, as :meth:`encode` laid them; ``divided``:
        ``Σ / N`` already, the collective's ``divide``). ``finite``: the sum's 0-dim flag
        "every element finite" (uint8), which the grouped maps AND with the finiteness of
        what they write; returns whether it now stands for the mean (``False``: the maps
        ran on the torch path, which checks nothing)."""
        if not divided:
            total.div_(device_scalar(self.world_size, total.dtype, total.device))  # exact on CUDA
        return _map_over(encoded.slots, total, True, finite) if encoded.slots else True

    _last_slots: dict | None = None  # a bucket's names → its last MapSlots

    def _map_slots(self, names: list[str], shapes: list[tuple[int, ...]],
                   routes: list[Transform], per_sender: tuple[bool, ...], flat: torch.Tensor,
                   layout: ShardLayout) -> MapSlots:
        """:meth:`MapSlots.of` this bucket, its last one while its maps are the same ones
        (packed once per set of maps, not per call of a bucket resolved again; new maps in
        the same slots keep the last packing's program table)."""
        slots = MapSlots.of(shapes, routes, per_sender)
        if self._last_slots is None:
            self._last_slots = {}
        last = self._last_slots.get(tuple(names))
        if last is not None and last == slots:
            return last
        self._last_slots[tuple(names)] = slots.group(flat, layout, last)
        return slots

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


class MapSlots(tuple):
    """:attr:`Encoded.slots`: ``(offset, numel, shape, T)`` of each tensor laid one after the
    other that the receiver maps back by ``T⁻¹`` (on a map, not per sender), and
    :attr:`grouped`, the same maps packed for one Triton launch each way
    (:class:`~geofp8.codecs.triton_map.GroupedMaps`), or ``None`` (the torch path, map by
    map)."""

    grouped: triton_map.GroupedMaps | None = None

    @classmethod
    def of(cls, shapes: list[tuple[int, ...]], routes: list[Transform],
           per_sender: tuple[bool, ...]) -> MapSlots:
        """A bucket's slots, not grouped."""
        slots, pos = [], 0
        for shape, route, mapped in zip(shapes, routes, per_sender):
            n = torch.Size(shape).numel()
            if not mapped and route is not IDENTITY:
                slots.append((pos, n, shape, route))
            pos += n
        return cls(slots)

    def group(self, flat: torch.Tensor, layout: ShardLayout, last: MapSlots | None
              ) -> MapSlots:
        """These slots grouped over ``flat`` where the stages take the batched kernels on
        its device and every map is an FP32 low-rank one the Triton kernel places
        (:func:`~geofp8.codecs.triton_map.places`), ``last`` (the bucket's previous slots)
        lending its program table; returns them."""
        if self and layout.batched(flat.device) and all(
                isinstance(t, LowRankInput) and len(shape) == 2 for _, _, shape, t in self) \
                and triton_map.places(flat, [t.U for *_, t in self]):
            self.grouped = triton_map.GroupedMaps(
                [(pos, shape[0], shape[1], t.U, t.V_fwd, t.V_inv) for pos, _, shape, t in self],
                flat.device, getattr(last, "grouped", None))
        return self

    def bind(self, flat: torch.Tensor) -> BoundMaps | TorchMaps | None:
        """These slots' maps over ``flat`` for a bucket's record: the grouped ones bound
        (:meth:`~geofp8.codecs.triton_map.GroupedMaps.bind`), else the torch path's
        (:class:`TorchMaps`); ``None`` where nothing is mapped."""
        if self.grouped is not None:
            return self.grouped.bind(flat)
        return TorchMaps(self, flat) if self else None


class TorchMaps:
    """:class:`MapSlots` over one vector on the torch path, map by map, with the calls of a
    bound grouped one (:class:`~geofp8.codecs.triton_map.BoundMaps`)."""

    __slots__ = ("flat", "slots")

    def __init__(self, slots: MapSlots, flat: torch.Tensor) -> None:
        self.slots, self.flat = slots, flat

    def forward(self) -> None:
        _map_over(self.slots, self.flat, inverse=False)

    def back(self, flag: torch.Tensor, launch_into) -> bool:
        """``T⁻¹`` over each slot; ``False``: nothing checked (``flag`` left as it is)."""
        return _map_over(self.slots, self.flat, inverse=True)


def _map_over(slots: MapSlots, flat: torch.Tensor, inverse: bool,
              finite: torch.Tensor | None = None) -> bool:
    """``G T`` (``inverse``: ``G T⁻¹``) over each mapped slot of ``flat``: one launch when
    grouped, which clears the 0-dim uint8 ``finite`` (if given) where a value it writes is
    not (returns ``True``), else map by map (returns ``False``: nothing checked)."""
    grouped = getattr(slots, "grouped", None)  # an Encoded made without maps: ()
    if grouped is not None:
        return grouped(flat, inverse, finite)
    for pos, n, shape, route in slots:
        view = flat[pos : pos + n].view(shape)
        if inverse:
            route.inverse_over(view)
        else:
            route.forward_over(view)
    return False
