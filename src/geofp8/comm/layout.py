"""Where each rank's values go: shards, segments and scale groups of a flat vector.

A layout is pure metadata, derived identically on every rank from the tensors' shapes and
the codec; the stages (:mod:`geofp8.comm.stages`) and collectives read it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..codecs import Codec

__all__ = ["ShardLayout", "fp32_allreduce_wire_bytes"]


@dataclass(frozen=True)
class ShardLayout:
    """Shards and scale groups of a flat vector made of tensors of the given ``shapes``.

    Every tensor is cut into ``N`` contiguous chunks of ``⌈numel/N⌉`` elements; shard ``j``
    is the concatenation of every tensor's chunk ``j`` (``segments[j]``, ranges of the flat
    vector). Scale groups follow the codec per tensor (per-tensor, per-row or per-block)
    and are cut at chunk boundaries. So a tensor is quantized the same way whichever other
    tensors share its bucket: DDP's bucket rebuild changes nothing numerically.

    ``row_aligned`` tensors are chunked at whole rows (``⌈rows/N⌉`` rows per chunk), so a
    receiver can apply a right-multiplication to its chunk. ``side_bytes[i]`` bytes of sender
    metadata about tensor ``i`` (e.g. each sender's own factor) travel with every shard that
    holds a chunk of it, after the payload (``side[j]``: their total for shard ``j``).
    """

    numel: int
    world_size: int
    codec: Codec
    segments: tuple[tuple[tuple[int, int], ...], ...]  # per shard: flat ranges [lo, hi)
    groups: tuple[tuple[tuple[int, ...], ...], ...]  # per shard, per segment: group lengths
    owners: tuple[tuple[int, ...], ...] = ()  # per shard: the tensor index of each segment
    side: tuple[int, ...] = ()  # per shard: bytes of sender metadata after the payload

    @classmethod
    def build(cls, shapes: list[tuple[int, ...]], codec: Codec, world_size: int,
              row_aligned: list[bool] | None = None,
              side_bytes: list[int] | None = None) -> ShardLayout:
        segments: list[list[tuple[int, int]]] = [[] for _ in range(world_size)]
        side = [0] * world_size
        owners: list[list[int]] = [[] for _ in range(world_size)]
        groups: list[list[tuple[int, ...]]] = [[] for _ in range(world_size)]
        offset = 0
        for index, shape in enumerate(shapes):
            lengths = codec.groups(tuple(shape))
            numel = sum(lengths)
            chunk = -(-numel // world_size) if numel else 0
            if row_aligned and row_aligned[index] and numel:
                cols = numel // shape[0]
                chunk = -(-shape[0] // world_size) * cols
            it, pending, pos = iter(lengths), 0, 0
            for j in range(world_size):
                hi = min((j + 1) * chunk, numel)
                if hi > pos:
                    segments[j].append((offset + pos, offset + hi))
                    owners[j].append(index)
                    side[j] += side_bytes[index] if side_bytes else 0
                cut = []
                while pos < hi:
                    if pending == 0:
                        pending = next(it)
                    take = min(pending, hi - pos)
                    cut.append(take)
                    pending -= take
                    pos += take
                if cut:
                    groups[j].append(tuple(cut))
            offset += numel
        return cls(offset, world_size, codec, tuple(tuple(s) for s in segments),
                   tuple(tuple(g) for g in groups), tuple(tuple(o) for o in owners),
                   tuple(side))

    @classmethod
    def for_rows(cls, shapes: list[tuple[int, ...]], codec: Codec, world_size: int,
                 side_bytes: int = 0) -> ShardLayout:
        """The layout of FSDP's reduce-scatter input: a flat ``[N, M]`` buffer whose row
        ``r`` is every tensor's dim-0 chunk ``r`` (``⌈d₀/N⌉`` rows, zero-padded) in order,
        ``M = Σ_p ⌈d₀,p/N⌉·numel_p/d₀,p``. Shard ``r`` is row ``r``: one segment per tensor
        chunk, scale groups of the chunk's own shape (so a right-multiplication, acting on
        columns, applies chunk by chunk). ``side_bytes`` travel with every shard."""
        chunks = []
        for shape in shapes:
            if len(shape) == 0:
                raise ValueError("for_rows: 0-dim tensors have no dim-0 chunks")
            rows = -(-shape[0] // world_size)
            chunks.append((rows, *shape[1:]))
        sizes = [torch.Size(c).numel() for c in chunks]
        width = sum(sizes)
        segments, groups, owners = [], [], []
        for r in range(world_size):
            seg, grp, own, pos = [], [], [], r * width
            for index, (chunk, n) in enumerate(zip(chunks, sizes)):
                if n:
                    seg.append((pos, pos + n))
                    grp.append(tuple(codec.groups(chunk)))
                    own.append(index)
                pos += n
            segments.append(tuple(seg))
            groups.append(tuple(grp))
            owners.append(tuple(own))
        return cls(world_size * width, world_size, codec, tuple(segments), tuple(groups),
                   tuple(owners), (side_bytes,) * world_size)

    def shard_numel(self, j: int) -> int:
        return sum(hi - lo for lo, hi in self.segments[j])

    def shard_bytes(self, j: int) -> int:
        """Bytes of shard ``j``'s payload (codes and scales, see the codec)."""
        return self.codec.payload_bytes(self.groups[j])

    def send_bytes(self, j: int) -> int:
        """Bytes every sender hands over for shard ``j``: payload plus side metadata."""
        return self.shard_bytes(j) + self.side[j]

    def group_spans(self, j: int) -> list[tuple[int, int]]:
        """Flat ranges of shard ``j``'s scale groups (a group never spans two segments)."""
        spans, groups = [], iter([n for seg in self.groups[j] for n in seg])
        for lo, hi in self.segments[j]:
            pos = lo
            while pos < hi:
                n = next(groups)
                spans.append((pos, pos + n))
                pos += n
        return spans

    @property
    def max_shard_bytes(self) -> int:
        return max(self.shard_bytes(j) for j in range(self.world_size))

    def wire_bytes(self, rank: int) -> int:
        """Bytes this rank sends to other ranks: the all-to-all shards meant for others plus
        ``N − 1`` copies of its padded reduced shard (ring or direct all-gather alike)."""
        a2a = sum(self.send_bytes(j) for j in range(self.world_size) if j != rank)
        return a2a + (self.world_size - 1) * self.max_shard_bytes

    def scatter_bytes(self, rank: int) -> int:
        """Bytes this rank sends in a reduce-scatter (the all-to-all stage only)."""
        return sum(self.send_bytes(j) for j in range(self.world_size) if j != rank)

    def gather(self, flat: torch.Tensor, j: int) -> torch.Tensor:
        """Shard ``j`` of ``flat`` as one contiguous tensor."""
        parts = [flat[lo:hi] for lo, hi in self.segments[j]]
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts) if parts else flat.new_zeros(0)

    @functools.cached_property
    def _order(self) -> tuple[list[int], list[int], list[int], list[int]] | None:
        """The segments of all shards partition the flat vector: ``(their lengths in flat
        order, in shard-major order, the flat position of each shard-major one, the
        shard-major position of each flat one)``; ``None`` when both orders agree."""
        spans = [span for segs in self.segments for span in segs]
        by_pos = sorted(range(len(spans)), key=lambda i: spans[i][0])
        if by_pos == list(range(len(spans))):
            return None
        flat_of = [0] * len(spans)
        for f, i in enumerate(by_pos):
            flat_of[i] = f
        return ([spans[i][1] - spans[i][0] for i in by_pos], [hi - lo for lo, hi in spans],
                flat_of, by_pos)

    def shard_major(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` reordered shard after shard (shard ``j``'s segments in order): one split
        and one copy whatever the number of shards and segments (``flat`` itself when it is
        in that order already)."""
        if self._order is None:
            return flat
        sizes, _, flat_of, _ = self._order
        pieces = flat.split(sizes)
        return torch.cat([pieces[f] for f in flat_of])

    def from_shard_major(self, values: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`shard_major` (``values`` itself when the orders agree)."""
        if self._order is None:
            return values
        _, sizes, _, by_pos = self._order
        pieces = values.split(sizes)
        return torch.cat([pieces[i] for i in by_pos])

    @functools.cached_property
    def parts(self) -> tuple[tuple[int, ...], ...]:
        """Per shard: the bytes of its payload's parts (:meth:`Codec.part_bytes`)."""
        return tuple(self.codec.part_bytes(g) for g in self.groups)

    def scatter(self, out: torch.Tensor, shard: torch.Tensor, j: int) -> None:
        """Write shard ``j``'s values back to their places in ``out``."""
        pos = 0
        for lo, hi in self.segments[j]:
            out[lo:hi] = shard[pos : pos + hi - lo]
            pos += hi - lo


def fp32_allreduce_wire_bytes(numel: int, world_size: int, bytes_per_element: int = 4) -> int:
    """Bytes one rank sends in a ring all-reduce: ``2(N−1)/N · n · bytes``."""
    return (2 * (world_size - 1) * numel * bytes_per_element) // max(world_size, 1)
