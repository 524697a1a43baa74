"""A layout's two orders of the flat vector: flat (tensor after tensor) and shard-major.

:class:`FlatOrder` is the part of :class:`~geofp8.comm.layout.ShardLayout` that cuts the flat
vector into its shards' segments and moves values between the two orders, one split and
one copy whatever the number of shards and segments.
"""

from __future__ import annotations

from functools import cached_property

import torch

__all__ = ["FlatOrder"]


class FlatOrder:
    """Segment views and reorders (a mixin of :class:`~geofp8.comm.layout.ShardLayout`,
    whose ``segments`` and ``numel`` it reads)."""

    def gather(self, flat: torch.Tensor, j: int) -> torch.Tensor:
        """Shard ``j`` of ``flat`` as one contiguous tensor: a view of ``flat`` when the
        shard is one segment of it, else a new tensor."""
        parts = self.segment_views(flat, j)
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts) if parts else flat.new_zeros(0)

    @cached_property
    def _segment_split(self) -> tuple[list[int], tuple[tuple[int, ...], ...]]:
        """``(the lengths of all segments in flat order, per shard the flat position of each
        of its segments)``."""
        if self._order is None:
            sizes, flat_of = [hi - lo for segs in self.segments for lo, hi in segs], None
        else:
            sizes, _, flat_of, _ = self._order
        positions, m = [], 0
        for segments in self.segments:
            positions.append(tuple(flat_of[m : m + len(segments)]) if flat_of
                             else tuple(range(m, m + len(segments))))
            m += len(segments)
        return sizes, tuple(positions)

    def segment_views(self, flat: torch.Tensor, j: int) -> list[torch.Tensor]:
        """Views of shard ``j``'s segments of the flat vector ``flat``, in shard order: one
        split for all of them (a slice per segment costs an op each on the host)."""
        if len(self.segments[j]) == 1:
            lo, hi = self.segments[j][0]
            return [flat[lo:hi]]
        sizes, positions = self._segment_split
        pieces = flat[: self.numel].split(sizes)
        return [pieces[f] for f in positions[j]]

    @cached_property
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

    @property
    def shard_major_is_flat(self) -> bool:
        """Whether shard-major order is flat order (every shard one run of the vector)."""
        return self._order is None

    def shard_major(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` reordered shard after shard (shard ``j``'s segments in order): one split
        and one copy whatever the number of shards and segments (``flat`` itself when it is
        in that order already)."""
        if self._order is None:
            return flat
        sizes, _, flat_of, _ = self._order
        pieces = flat.split(sizes)
        return torch.cat([pieces[f] for f in flat_of])

    def from_shard_major(self, values: torch.Tensor,
                         out: torch.Tensor | None = None) -> torch.Tensor:
        """The inverse of :meth:`shard_major`, written into ``out`` when given (else ``values``
        itself when the orders agree)."""
        if self._order is None:
            return values if out is None else out.copy_(values)
        _, sizes, _, by_pos = self._order
        pieces = values.split(sizes)
        return torch.cat([pieces[i] for i in by_pos], out=out)
