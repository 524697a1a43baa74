"""The fused kernels' launch plan of a layout: where every code and scale goes, made once.

A :class:`FusedPlan` turns a one-codec FP8 layout (no side bytes) into the placed tile maps
of :mod:`geofp8.codecs.triton_fp8` (:func:`~geofp8.codecs.triton_fp8.placed_tiles`), so
each stage of the exact collective is one or two kernels that read the flat vector and
write the wire bytes where they travel, or the reverse, with no split, cat or reorder of
values or bytes in between:

* ``send``: the flat vector → the all-to-all's send buffer (shard ``j``'s record at
  ``Σ_{i<j} shard_bytes(i)``: its FP32 scales, then its codes, segment after segment);
* ``shard j``: a shard's values (shard order) ↔ its record (a received copy, or the
  re-encoded shard the all-gather sends, padded to ``max_shard_bytes``);
* ``gather``: the all-gather's ``N`` padded records → the flat vector.

A block-scaled layout (one NVFP4 / MX codec, :attr:`FusedPlan.blocks`) is placed by
:class:`~geofp8.comm.block_plan.BlockPlan` (its own placed maps, two kernels a stage).

The maps are int64 device tensors, a few per layout and device, built on first use and
kept as long as the layout: nothing per call is ``O(tensors)`` or ``O(groups)`` on the
host.
"""

from __future__ import annotations

import torch

from ..codecs import triton_fp4, triton_fp8

__all__ = ["FusedPlan"]

_PLAIN = (torch.float32, torch.uint8)


class FusedPlan:
    """The tile maps of one layout (module notes); ``fmt``: its codec's FP8 format."""

    def __init__(self, layout) -> None:
        self.layout = layout
        self.fmt = getattr(layout.codec, "format", None)
        self._maps: dict[tuple, object] = {}
        self.group_counts = [sum(map(len, groups)) for groups in layout.groups]
        self.n_groups = sum(self.group_counts)
        self.shard_numels = [layout.shard_numel(j) for j in range(layout.world_size)]
        self.send_bytes = sum(layout.shard_bytes(j) for j in range(layout.world_size))
        plain = not layout.codecs and not any(layout.side)  # one codec, no side bytes
        self.fits = plain and self.fmt in triton_fp8.FMAX
        self.blocks = plain and self.fmt in triton_fp4.FORMATS  # NVFP4, MXFP4, MXFP8: BlockPlan

    @staticmethod
    def applies(layout, *tensors: torch.Tensor | None) -> bool:
        """Whether the fused stages run this layout on these tensors (``None``: none given):
        one FP8 codec (which rounds to nearest whatever the seed), no side bytes, batched
        kernels on their device, the Triton kernels available there, and every tensor
        contiguous, FP32 values or uint8 bytes (what the kernels' pointers read)."""
        if not layout.plan.fits:  # decided once per layout: most calls stop here
            return False
        given = [t for t in tensors if t is not None]
        return (layout.batched(given[0].device) and triton_fp8.available(*given)
                and all(t.dtype in _PLAIN and t.is_contiguous() for t in given))

    def _segments(self, shards, record_at, flat: bool):
        """Per segment of ``shards``: ``(first element, first group, its groups, first code
        byte, first scale byte)``, shard ``j``'s record at byte ``record_at(j)``; elements
        counted in the flat vector (``flat``) or in the shard, groups from the first
        shard's."""
        group = 0
        for j in shards:
            base, codes, pos, first = record_at(j), 4 * self.group_counts[j], 0, 0
            for (lo, hi), seg in zip(self.layout.segments[j], self.layout.groups[j]):
                yield lo if flat else pos, group, seg, base + codes + pos, base + 4 * first
                pos, first, group = pos + hi - lo, first + len(seg), group + len(seg)

    def tiles(self, what: str | int, device: torch.device) -> torch.Tensor:
        """The tile map of ``"send"``, ``"gather"`` or shard ``j`` (module notes)."""
        key = (what, device)  # a tensor's own device: normalised already
        if key not in self._maps:
            layout, every = self.layout, range(self.layout.world_size)
            if what == "send":
                offsets = [0]
                for j in every:
                    offsets.append(offsets[-1] + layout.shard_bytes(j))
                segments = self._segments(every, offsets.__getitem__, flat=True)
            elif what == "gather":
                segments = self._segments(every, lambda j: j * layout.max_shard_bytes,
                                          flat=True)
            else:
                segments = self._segments([what], lambda j: 0, flat=False)
            self._maps[key] = triton_fp8.placed_tiles(segments, device)
        return self._maps[key]

    def slots(self, what: str | int, device: torch.device) -> triton_fp8.AmaxSlots:
        """The persistent amax slots of ``"send"`` or shard ``j``'s groups on ``device``, or
        the one slot of the gathered records' finite check (``"finite"``)."""
        key = ("slots", what, device)
        if key not in self._maps:
            n = {"send": self.n_groups, "finite": 1}.get(what)
            self._maps[key] = triton_fp8.AmaxSlots(
                self.group_counts[what] if n is None else n, device)
        return self._maps[key]

    def scale_rows(self, device: torch.device) -> torch.Tensor:
        """Where the gathered records' FP32 scales lie, int64 ``[R, 2]`` on ``device``
        (:func:`~geofp8.codecs.triton_fp8.scale_rows`)."""
        key = ("scale rows", device)
        if key not in self._maps:
            size = self.layout.max_shard_bytes
            rows = triton_fp8.scale_rows((j * size, count)
                                         for j, count in enumerate(self.group_counts))
            self._maps[key] = torch.tensor(rows, dtype=torch.int64).to(device)
        return self._maps[key]
