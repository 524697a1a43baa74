"""Where a segmentwise codec's payload parts go: flat order and shard order, in bytes.

A segmentwise codec (:meth:`~geofp8.codecs.base.Codec.segmentwise`) encodes the flat vector
in one call over its segments in flat order; its parts are then put in shard order as bytes,
not FP32 values. :class:`SegmentParts` is the part of :class:`~geofp8.comm.layout.ShardLayout`
that knows that arrangement, made once per layout: every segment as a one-segment shard in
flat order, the one-gather reorder of the parts (:class:`~geofp8.codecs.groups.PartsOrder`)
where its indices are small enough, and the cuts of the records a stage receives into every
segment's parts.
"""

from __future__ import annotations

from functools import cached_property

import torch

from ..codecs.base import GroupMap
from ..codecs.groups import PartsOrder, RaggedGather, RunGather

__all__ = ["SegmentParts"]

MAX_INDEX_SHARE = 2  # a reorder's indices may take up to 1/2 of the payload's bytes ...
MIN_INDEX_BYTES = 1 << 16  # ... or this much
WINDOW_COPIES = 16  # copies from which a gather per kind beats the split into 4 views
# a copy and the cat of their parts (on meta, 3 kinds: 141 against 196 µs for 8 copies, 725
# against 194 for 64), though it takes a launch more per kind than the one cat


class SegmentParts:
    """The segmentwise codec's parts in flat and shard order (a mixin of
    :class:`~geofp8.comm.layout.ShardLayout`, whose metadata it reads)."""

    @cached_property
    def _by_segment(self) -> tuple | None:
        """For a segmentwise codec (:meth:`Codec.segmentwise`) when shard-major order is not
        flat order: ``(every segment as a one-segment shard of its groups, in flat order;
        per shard, the flat position of each of its segments; per flat segment, its parts'
        bytes)``. ``None`` otherwise."""
        lengths = [hi - lo for spans in self.segments for lo, hi in spans]
        if self.codecs or self._order is None or not self.codec.segmentwise(lengths):
            return None
        by_pos = self._order[3]
        groups = [g for shard in self.groups for g in shard]  # shard-major order
        flat_shards = GroupMap((groups[i],) for i in by_pos)
        return (flat_shards, self._segment_split[1],
                [self.codec.part_bytes(s) for s in flat_shards])

    @cached_property
    def _parts_order(self) -> PartsOrder | None:
        """For the batched kernels of a segmentwise codec: every kind of part moved between
        flat and shard order by one gather (:class:`PartsOrder`); ``None`` where its indices
        would take more than ``1/MAX_INDEX_SHARE`` of the payload's bytes (runs whose
        lengths share no large factor: the split-and-cat path then)."""
        _, positions, seg_bytes = self._by_segment
        return _within_share(PartsOrder(seg_bytes, positions))

    @cached_property
    def _reorder(self) -> PartsOrder | None:
        """The batched kernels' reorder of the parts between flat and shard order:
        :attr:`_parts_order` where it is taken, else, for ragged runs, one whose kinds may
        each gather rows from any byte and fix the rows that straddle runs
        (:class:`~geofp8.codecs.groups.RaggedGather`: three kernels a kind, not ``T·N``
        views), within the same share of the payload's bytes; ``None`` beyond it (the
        split-and-cat path then)."""
        if self._parts_order is not None:
            return self._parts_order
        _, positions, seg_bytes = self._by_segment
        return _within_share(PartsOrder(seg_bytes, positions, ragged=True))

    @cached_property
    def _sends(self) -> PartsOrder | None:
        """:attr:`_reorder` when its one reorder of the joined kinds to the send buffer
        (:meth:`PartsOrder.send_buffer`: a ``cat`` of the kinds and the reorder's kernels)
        takes no more launches than a gather per kind and a ``cat`` of the ``kinds·N``
        parts, and keeps its indices within the same share of the payload's bytes; else
        ``None`` (that gather and ``cat``, whose host work grows with ``N``)."""
        order = self._reorder
        if order is None:
            return None
        sends = order.sends
        fewer = 1 + sends.launches <= 1 + sum(g.launches for g in order.gathers)
        return order if fewer and _within_share(sends) is not None else None

    def _receives(self, records: tuple[int, ...]) -> RunGather | RaggedGather | None:
        """For records of these sizes and :attr:`_reorder`: its one reorder of the records
        to the kinds whole in flat order (:meth:`PartsOrder.receives`) when it takes no
        more launches than its gather per kind straight from the records
        (:meth:`PartsOrder.from_records`, three kernels a ragged kind) and its indices are
        within the share of :func:`_within_share`; else ``None``. Made once per sizes."""
        key = ("receives", records)
        if key not in self._maps:
            order = self._reorder
            gather = _within_share(order.receives(records))
            fewer = gather is not None and gather.launches <= sum(
                g.launches for g in order.gathers)
            self._maps[key] = gather if fewer else None
        return self._maps[key]

    @cached_property
    def _flat_run(self) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
        """When :attr:`segmentwise`: every segment's groups in flat order, as the segments of
        one shard, and that shard's parts' bytes (part ``p`` of every segment back to back)."""
        segments = tuple(shard[0] for shard in self._by_segment[0])
        return segments, tuple(self.codec.part_bytes(segments))

    @property
    def segmentwise(self) -> bool:
        """Whether the stages run the codec over the segments in flat order and reorder bytes
        (:meth:`encode_pieces`, :meth:`decode_flat`) rather than FP32 values."""
        return self._by_segment is not None

    @property
    def encodes_error(self) -> bool:
        """Whether :meth:`encode_pieces` leaves the rounding error: a segmentwise codec, whose
        one call over the flat vector leaves its rounding error in flat order (chunked: from
        the encoding pass where :meth:`Codec.fuses_error`; batched: decoded from the payload
        parts before they are put in shard order, no copy of them)."""
        return self.segmentwise

    def _record_cuts(self, records: tuple[int, ...]) -> tuple[list[int], list[int]]:
        """``(the byte sizes that cut records of these sizes into every segment's parts and
        each record's rest, the index in them of every segment's part p at f·k + p)``, made
        once per records' sizes (a stage passes the same ones every step)."""
        found = self._maps.get(("records", records))
        if found is not None:
            return found
        _, positions, seg_bytes = self._by_segment
        k = len(seg_bytes[0]) if seg_bytes else 0
        sizes, where = [], [0] * (len(seg_bytes) * k)
        for j, record in enumerate(records):
            for p in range(k):
                for f in positions[j]:
                    where[f * k + p] = len(sizes)
                    sizes.append(seg_bytes[f][p])
            sizes.append(record - sum(self.parts[j]))  # the record's rest (side bytes, padding)
        self._maps[("records", records)] = sizes, where
        return sizes, where

    def _cuts(self, shards: list[int], records: int | list[int]
              ) -> tuple[int, list[int], list[int], list[int], int]:
        """``(the records' bytes, the sizes that cut them into every record's parts and
        rest, the index in them of each part (a one-codec layout's kind after kind), each
        kind's bytes in all, the shards' elements)``."""
        if isinstance(records, int):
            records = [records] * len(shards)
        sizes, where = [], []
        for j, nbytes in zip(shards, records):
            parts = self.parts[j]
            where.append(range(len(sizes), len(sizes) + len(parts)))
            sizes += [*parts, nbytes - sum(parts)]
        numel = sum(self.shard_numel(j) for j in shards)
        if self.codecs:
            return sum(records), sizes, [i for w in where for i in w], [], numel
        k = len(self.codec.part_bytes(()))  # every shard's kinds: kind p of each in turn
        return (sum(records), sizes, [w[p] for p in range(k) for w in where],
                [sum(self.parts[j][p] for j in shards) for p in range(k)], numel)

    def _copies_gather(self, key: tuple) -> RunGather | None:
        """For the records of :meth:`decode_records`' ``key``, when they are copies of one
        shard in equal records (an owner's ``N`` senders) of a one-codec layout: their
        parts kind after kind, copy after copy (their rests, side bytes or padding, after
        them), as one gather of rows (:class:`RunGather`,
        one kernel whatever the copies, its index within the share of
        :func:`_within_share`); ``None`` otherwise (:meth:`_windows` or the ``split`` and
        ``cat``). Made once per key."""
        gkey = ("copies", *key[1:])
        if gkey not in self._maps:
            shards, records, gather = key[1], key[2], None
            if not self.codecs and isinstance(records, int) and len(set(shards)) == 1:
                parts, copies = self.parts[shards[0]], len(shards)
                k = len(parts)
                gather = _within_share(RunGather(  # the records' rests last
                    [*parts, records - sum(parts)] * copies,
                    [c * (k + 1) + p for p in range(k + 1) for c in range(copies)]))
            self._maps[gkey] = gather
        return self._maps[gkey]

    def _windows(self, key: tuple, device: torch.device
                 ) -> list[tuple[int, torch.Tensor]] | None:
        """For the records of :meth:`decode_records`' ``key``, when they are at least
        :data:`WINDOW_COPIES` copies of one shard in equal records (an owner's ``N``
        senders) of a one-codec layout: per kind, its bytes in a record and where it starts
        in each (int32 on ``device``), for one gather of the copies' windows per kind;
        ``None`` otherwise (the ``split`` and ``cat``). Made once per key and device."""
        wkey = ("windows", *key[1:], torch.device(device))
        if wkey not in self._maps:
            shards, records = key[1], key[2]
            copies, windows = len(shards), None
            if (not self.codecs and copies >= WINDOW_COPIES and isinstance(records, int)
                    and len(set(shards)) == 1):
                parts = self.parts[shards[0]]
                windows = [(length, (torch.arange(copies, dtype=torch.int32) * records
                                     + sum(parts[:p])).to(device))
                           for p, length in enumerate(parts)]
            self._maps[wkey] = windows
        return self._maps[wkey]


def _within_share(order):
    """``order`` (a reorder: its ``index_bytes`` and ``numel``) if its indices take at most
    ``1/MAX_INDEX_SHARE`` of the payload's bytes (or
    :data:`MIN_INDEX_BYTES`), else ``None``."""
    return order if order.index_bytes <= max(order.numel // MAX_INDEX_SHARE,
                                             MIN_INDEX_BYTES) else None
