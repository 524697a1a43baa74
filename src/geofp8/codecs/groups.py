"""The scale groups of some shards, with what the batched kernels need about them, made once.

A :class:`GroupMap` is the shards themselves (a tuple: per shard, per segment, the lengths
of its scale groups) plus everything derived from them that a codec's batched kernels
(:meth:`~.base.Codec.encode_shards`, :meth:`~.base.Codec.decode_shards`) read: the group
lengths laid end to end, whether they are all equal, each shard's element count, each
segment's group count, and those lengths as small int64 tensors on a device. Each is
computed on first use and kept by the map, so a layout that hands the same map to every
step (:meth:`geofp8.comm.ShardLayout.group_map`) pays the ``O(groups)`` walk once, not on
every call, and nothing is hashed or looked up by value: a model with any number of
buckets keeps one map per bucket stage, as long as the bucket lives.

A plain nested tuple or list of shards works wherever a map does (:func:`group_map` wraps
it), at the price of that walk on each call.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from functools import cached_property
from typing import Any

import torch

__all__ = ["GroupMap", "PartsOrder", "RaggedGather", "RunGather", "group_map", "segment_index"]


class GroupMap(tuple):
    """Shards as a tuple (per shard, per segment, a tuple of group lengths) and their derived
    metadata (module notes). Immutable; derived values are built on first use."""

    def __new__(cls, shards) -> GroupMap:
        return super().__new__(cls, (tuple(tuple(seg) for seg in segments)
                                     for segments in shards))

    @cached_property
    def lengths(self) -> tuple[int, ...]:
        """Every group's length, shard after shard, segment after segment."""
        return tuple(n for segments in self for seg in segments for n in seg)

    @cached_property
    def common(self) -> int | None:
        """The common length when every group has it (``None`` if they differ or for none)."""
        lengths = self.lengths
        return lengths[0] if lengths and lengths.count(lengths[0]) == len(lengths) else None

    @cached_property
    def numels(self) -> tuple[int, ...]:
        """Elements of each shard."""
        return tuple(sum(map(sum, segments)) for segments in self)

    @cached_property
    def counts(self) -> tuple[int, ...]:
        """Groups of each segment, shard after shard."""
        return tuple(len(seg) for segments in self for seg in segments)

    @cached_property
    def segments(self) -> tuple[tuple[int, ...], ...]:
        """Every segment's groups, shard after shard (the shards' segments as one list)."""
        return tuple(seg for segments in self for seg in segments)

    @cached_property
    def _memo(self) -> dict:
        return {}

    def memo(self, key: Any, make: Callable[[], Any]) -> Any:
        """``make()``, made once per ``key`` for this map (a codec's own derived values, e.g.
        its parts' bytes per shard)."""
        memo = self._memo
        if key not in memo:
            memo[key] = make()
        return memo[key]

    def on(self, name: str, device: torch.device) -> torch.Tensor:
        """``lengths`` or ``counts`` as an int64 tensor on ``device`` (what ``segment_reduce``
        and ``repeat_interleave`` take), copied there once: a host-to-device copy of
        pageable memory waits for the device, so never per call."""
        return self.memo((name, torch.device(device)),
                         lambda: torch.tensor(getattr(self, name), dtype=torch.long).to(device))


def segment_index(groups: GroupMap, device: torch.device) -> torch.Tensor:
    """The segment of every group of ``groups`` (int32, on ``device``, made once): what a
    per-segment value indexes to be per group, one gather (``repeat_interleave`` by the
    counts takes two kernels)."""
    return groups.memo(("segment index", torch.device(device)), lambda: torch.repeat_interleave(
        torch.arange(len(groups.counts), dtype=torch.int32),
        torch.tensor(groups.counts, dtype=torch.long), output_size=len(groups.lengths)
    ).to(device))


def group_map(shards) -> GroupMap:
    """``shards`` as a :class:`GroupMap` (itself when it is one)."""
    return shards if isinstance(shards, GroupMap) else GroupMap(shards)


class RunGather:
    """A reorder of the contiguous runs of a 1-D tensor, as one ``index_select`` of rows.

    The source holds runs of ``lengths[r]`` elements one after the other; the destination
    holds the same runs in the order ``order`` (source run indices). Every run starts and
    ends at a multiple of ``row``, the gcd of the lengths, so both tensors viewed as
    ``[numel/row, row]`` map row to row: :meth:`forward` and :meth:`backward` are one
    gather each with an index made once on the host and copied once per device, whatever
    the number of runs (no view per run, no ``cat`` of them). The index costs
    :attr:`index_bytes` on each device, more than the data when the runs' lengths share no
    large factor: the caller decides.
    """

    def __init__(self, lengths: Sequence[int], order: Sequence[int]) -> None:
        self.row = self.fine = math.gcd(*lengths) or 1
        self.numel = sum(lengths)
        self.index_bytes = 8 * (self.numel // self.row)  # two int32 indices
        self.launches = 1  # kernels each way
        self._lengths, self._order = tuple(lengths), tuple(order)
        self._memo: dict = {}

    def _rows(self, backward: bool) -> torch.Tensor:
        """Each destination row's source row (host int64): the forward map, or its inverse."""
        fwd = _source_of(self._lengths, self._order, self.row)
        if not backward:
            return fwd
        bwd = torch.empty_like(fwd)
        bwd[fwd] = torch.arange(fwd.numel())
        return bwd

    def _index(self, device: torch.device, backward: bool) -> torch.Tensor:
        """:meth:`_rows` on ``device`` (int32), made once per device and direction."""
        key = (torch.device(device), backward)
        if key not in self._memo:
            self._memo[key] = self._rows(backward).to(torch.int32).to(key[0])
        return self._memo[key]

    def plan(self, backward: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The reorder as :func:`gather_rows` takes it, rows of :attr:`row` (host int64):
        every destination row whole from its source start, no element to fix."""
        none = torch.empty(0, dtype=torch.long)
        return self._rows(backward) * self.row, none, none

    def forward(self, src: torch.Tensor) -> torch.Tensor:
        """The runs of the contiguous ``src`` in destination order (a new tensor)."""
        return src.view(-1, self.row).index_select(0, self._index(src.device, False)).view(-1)

    def backward(self, dst: torch.Tensor) -> torch.Tensor:
        """The inverse: the runs of the contiguous ``dst`` back in source order."""
        return dst.view(-1, self.row).index_select(0, self._index(dst.device, True)).view(-1)


def _source_of(lengths: Sequence[int], order: Sequence[int], unit: int) -> torch.Tensor:
    """For every ``unit`` (a row of that many elements, all runs' lengths its multiples) of
    the runs of ``lengths`` put in the order ``order``, its source unit (int64, host)."""
    n = torch.tensor(lengths, dtype=torch.long) // unit  # units per run
    first = torch.cumsum(n, 0) - n  # each run's first source unit
    order = torch.tensor(order, dtype=torch.long)
    taken = n[order]
    shift = first[order] - (torch.cumsum(taken, 0) - taken)  # source - destination
    total = sum(lengths) // unit  # (output_size: no read of a tensor's value)
    return torch.arange(total) + torch.repeat_interleave(shift, taken, output_size=total)


class RaggedGather:
    """:class:`RunGather` for runs whose lengths share no large factor (a 768-vector cut in
    64 chunks of 12): the destination in rows of ``row`` elements, each gathered from
    wherever it starts in the source (the source seen as its overlapping windows of that
    length, ``unfold``: any start, no alignment), then the elements of the rows that
    straddle two runs, and of the last partial row, written by a second gather in rows of
    :attr:`fine` elements, the gcd of the runs' lengths (every run starts at a multiple of
    it on both sides: no such row straddles two runs). Three kernels each way whatever the
    number of runs. The indices, made once on the host and copied once per device, take
    :attr:`index_bytes` on each device: per direction, an int32 per row and an int32 +
    int64 per fine row to fix."""

    def __init__(self, lengths: Sequence[int], order: Sequence[int], row: int) -> None:
        self.numel = sum(lengths)
        self.row = min(row, self.numel) or 1
        self.fine = _fine(lengths, self.row)
        inverse = [0] * len(order)
        for i, r in enumerate(order):
            inverse[r] = i
        self._plans = (self._plan(lengths, order),
                       self._plan([lengths[i] for i in order], inverse))
        self.index_bytes = sum(4 * rows.numel() + 12 * dst.numel()
                               for rows, dst, _ in self._plans)
        self.launches = max(bool(rows.numel()) + 2 * bool(dst.numel())
                            for rows, dst, _ in self._plans)  # kernels each way, at most
        self._memo: dict = {}

    def _plan(self, lengths: Sequence[int], order: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """``(each destination row's source start, the destination's rows of
        :attr:`fine` elements not all in a row within one run, their source starts)``
        (host int64) of the runs of ``lengths`` put in ``order`` (a fine row that a whole
        row covers in part is written twice, with the same bytes)."""
        f = self.fine
        src = _source_of(lengths, order, f)  # every fine row's source fine row
        per, rows = self.row // f, self.numel // self.row
        starts = src[: rows * per].view(rows, per)
        whole = (starts - starts[:, :1] == torch.arange(per)).all(1)  # within one run
        fix = torch.cat([(~whole).repeat_interleave(per),
                         torch.ones(self.numel // f - rows * per, dtype=torch.bool)])
        dst = fix.nonzero().view(-1)
        return starts[:, 0].masked_fill(~whole, 0) * f, dst, src[dst] * f

    def plan(self, backward: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The reorder as :func:`gather_rows` takes it, rows of :attr:`row` (host int64)."""
        return self._plans[backward]

    def _move(self, src: torch.Tensor, backward: bool) -> torch.Tensor:
        device = torch.device(src.device)
        if (device, backward) not in self._memo:
            self._memo[device, backward] = on_device(self.plan(backward), device)
        return gather_rows(src, self.row, *self._memo[device, backward], self.numel,
                           self.fine)

    def forward(self, src: torch.Tensor) -> torch.Tensor:
        """The runs of the contiguous ``src`` in destination order (a new tensor)."""
        return self._move(src, backward=False)

    def backward(self, dst: torch.Tensor) -> torch.Tensor:
        """The inverse: the runs of the contiguous ``dst`` back in source order."""
        return self._move(dst, backward=True)


def on_device(plan: Sequence[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, ...]:
    """A :func:`gather_rows` plan's ``(starts, dst, elements)`` (host int64) on ``device``:
    int32 where an ``index_select`` reads them, int64 for ``index_copy_``'s."""
    starts, dst, elements = plan
    return starts.to(torch.int32).to(device), dst.to(device), elements.to(torch.int32).to(device)


def gather_rows(src: torch.Tensor, row: int, starts: torch.Tensor, dst: torch.Tensor,
                elements: torch.Tensor, numel: int, fine: int = 1) -> torch.Tensor:
    """A new 1-D tensor of ``numel`` elements: its ``i``-th row of ``row`` elements is
    ``src[starts[i] : starts[i] + row]`` (any start: ``src`` seen as its overlapping
    windows, ``unfold``, one gather), then its rows of ``fine`` elements ``dst`` are
    ``src[e : e + fine]`` for ``e`` in ``elements`` (a second gather, for what no whole row
    covers)."""
    out = src.new_empty(numel)
    if starts.numel():
        windows = src.unfold(0, row, 1)  # row i: src[i : i + row] (a view)
        torch.index_select(windows, 0, starts, out=out[: starts.numel() * row].view(-1, row))
    if dst.numel():
        out.view(-1, fine).index_copy_(0, dst, src.unfold(0, fine, 1).index_select(0, elements))
    return out


RAGGED_ROWS = (8, 32, 128)  # the row lengths a ragged reorder tries


def run_gather(lengths: Sequence[int], order: Sequence[int]) -> RunGather | RaggedGather:
    """The reorder of these runs whose indices take the fewest bytes: a
    :class:`RunGather`, or a :class:`RaggedGather` with one of :data:`RAGGED_ROWS`."""
    aligned = RunGather(lengths, order)
    rows = [row for row in RAGGED_ROWS if row > aligned.row]
    if not rows:
        return aligned
    row = min(rows, key=lambda r: _ragged_bytes(lengths, order, r))  # one plan made
    return min(aligned, RaggedGather(lengths, order, row), key=lambda g: g.index_bytes)


def _fine(lengths: Sequence[int], row: int) -> int:
    """The rows a :class:`RaggedGather` of rows of ``row`` fixes: of the runs' gcd where it
    divides ``row``, else of one element."""
    fine = math.gcd(*lengths) or 1
    return fine if row % fine == 0 else 1


def _ragged_bytes(lengths: Sequence[int], order: Sequence[int], row: int) -> int:
    """At most :attr:`RaggedGather.index_bytes` of these runs in rows of ``row``, from the
    runs alone (no plan made): each way, a row holding a run's end inside it is fixed."""
    numel, fine = sum(lengths), _fine(lengths, min(row, sum(lengths)) or 1)
    total = 0
    for dst in ([lengths[i] for i in order], lengths):  # forward, backward
        ends = {end // row for end in itertools.accumulate(dst) if end % row}
        fixed = len(ends - {numel // row}) * row + numel % row
        total += 4 * (numel // row) + 12 * fixed // fine
    return total


class PartsOrder:
    """Every kind of part of segments encoded in flat order (``seg_bytes[f][p]``: bytes of
    part ``p`` of flat segment ``f``, as :meth:`~.base.Codec.encode_whole` leaves them, one
    tensor per kind) moved to shard order (``positions[j]``: shard ``j``'s segments) and
    back, one :class:`RunGather` per kind; ``ragged``: per kind, a :class:`RunGather` or a
    :class:`RaggedGather`, whichever's indices are smaller."""

    def __init__(self, seg_bytes: Sequence[Sequence[int]],
                 positions: Sequence[Sequence[int]], ragged: bool = False) -> None:
        kinds = len(seg_bytes[0]) if seg_bytes else 0
        by_shard = [f for flat in positions for f in flat]
        make = run_gather if ragged else RunGather
        self.gathers = [make([b[p] for b in seg_bytes], by_shard) for p in range(kinds)]
        self._layout = (tuple(map(tuple, seg_bytes)), tuple(map(tuple, positions)), kinds)
        self.shard_bytes = [[sum(seg_bytes[f][p] for f in flat) for flat in positions]
                            for p in range(kinds)]  # per kind, each shard's bytes
        self.index_bytes = sum(g.index_bytes for g in self.gathers)
        self._numels = [g.numel for g in self.gathers]
        self.numel = sum(self._numels)
        self._cuts: dict[tuple, list[tuple]] = {}  # per (records, device): each kind's plan

    def to_shards(self, wholes: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Per shard, its parts (views of one shard-ordered tensor per kind)."""
        return list(map(list, zip(*self._kinds(wholes))))  # no Python per shard

    def shard_after_shard(self, wholes: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Every shard's parts, shard after shard, in one list (what a send buffer joins)."""
        return list(itertools.chain.from_iterable(zip(*self._kinds(wholes))))

    @cached_property
    def sends(self) -> RunGather | RaggedGather:
        """The kinds joined kind after kind (one ``cat`` of the wholes) to the send buffer,
        every shard's parts shard after shard, as one reorder of their runs
        (:func:`run_gather`; its :attr:`~RunGather.index_bytes` for the caller to weigh)."""
        seg_bytes, positions, kinds = self._layout
        count = len(seg_bytes)  # run p·count + f: part p of flat segment f
        return run_gather([b[p] for p in range(kinds) for b in seg_bytes],
                          [p * count + f for flat in positions for p in range(kinds)
                           for f in flat])

    def send_buffer(self, wholes: Sequence[torch.Tensor]) -> torch.Tensor:
        """:meth:`shard_after_shard`'s parts joined, in two gathers of bytes whatever the
        shards (a ``cat`` of the kinds, :attr:`sends`): no ``cat`` of ``kinds·N`` parts."""
        return self.sends.forward(torch.cat([w.view(torch.uint8) for w in wholes]))

    def receives(self, records: Sequence[int]) -> RunGather | RaggedGather:
        """Every shard's record of ``records[j]`` bytes (its parts kind after kind, then its
        rest: side bytes, padding), back to back, to the kinds whole in flat order kind
        after kind and the rests last (:meth:`kinds_of` cuts them), as one reorder of their
        runs (:func:`run_gather`; its :attr:`~RunGather.index_bytes` for the caller to
        weigh)."""
        seg_bytes, positions, kinds = self._layout
        lengths, where, rests = [], {}, []
        for j, flat in enumerate(positions):
            for p in range(kinds):
                for f in flat:
                    where[p, f] = len(lengths)
                    lengths.append(seg_bytes[f][p])
            rests.append(len(lengths))
            lengths.append(records[j] - sum(b[j] for b in self.shard_bytes))
        return run_gather(lengths, [where[p, f] for p in range(kinds)
                                    for f in range(len(seg_bytes))] + rests)

    def kinds_of(self, joined: torch.Tensor) -> list[torch.Tensor]:
        """The kinds whole (views) at the front of ``joined``, kind after kind."""
        return list(joined.split([*self._numels, joined.numel() - self.numel]))[:-1]

    def _kinds(self, wholes: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
        """Per kind, every shard's part (views of one shard-ordered tensor: one gather)."""
        return [g.forward(w).split(b) for g, w, b in zip(self.gathers, wholes, self.shard_bytes)]

    def from_records(self, buf: torch.Tensor, records: Sequence[int]) -> list[torch.Tensor]:
        """The kinds whole, in flat order, from every shard's record of ``records[j]`` bytes
        (its parts, then the rest: side bytes, padding) back to back in ``buf``: one gather
        per kind straight from the records (:func:`gather_rows`; its plan made once per
        records' sizes and device), no ``cat`` of the parts first."""
        key = (tuple(records), torch.device(buf.device))
        if key not in self._cuts:  # the same records every step
            self._cuts[key] = [(g.row, g.fine, on_device(self._rebased(g, p, key[0]), key[1]))
                               for p, g in enumerate(self.gathers)]
        return [gather_rows(buf, row, *plan, numel, fine)
                for (row, fine, plan), numel in zip(self._cuts[key], self._numels)]

    def _rebased(self, gather, kind: int, records: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        """``gather``'s backward plan with its sources, positions in kind ``kind``'s parts
        back to back in shard order, moved to where they lie in the records (host int64):
        shard ``j``'s part of the kind starts after the records before it and its kinds
        before this one (a row never straddles two shards' parts)."""
        starts, dst, elements = gather.plan(backward=True)
        parts = torch.tensor(self.shard_bytes[kind], dtype=torch.long)
        before = torch.tensor([sum(b[j] for b in self.shard_bytes[:kind])
                               for j in range(len(records))], dtype=torch.long)
        record_start = torch.tensor((0, *records[:-1]), dtype=torch.long).cumsum(0)
        part_start = parts.cumsum(0) - parts
        shift = record_start + before - part_start  # per shard, record offset − kind offset

        def moved(q: torch.Tensor) -> torch.Tensor:
            return q + shift[torch.searchsorted(part_start + parts, q, right=True)]
        return moved(starts), dst, moved(elements)
