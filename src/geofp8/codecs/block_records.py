"""Where a block-scaled payload's parts lie: the placed maps of :mod:`.triton_fp4`'s kernels.

A shard's payload (:meth:`~.base.Codec.part_bytes`) is NVFP4's FP32 segment scales, E4M3
block scales and packed E2M1 codes (element ``2i`` of the shard in the low nibble of its
byte ``i``), or MX's E8M0 block scales and codes, one after the other. A
:class:`Placement` says, for every shard of a map, where each of these lies in the buffers
a kernel reads or writes (``(segment scales, block scales, codes)`` base pointers, the
same buffer for a record or the all-to-all's send buffer), and where each element's value
lies in the FP32 vector (the flat bucket, a shard, or the codec's whole order). So one
kernel writes a bucket's payload straight where it travels, and one reads the ``N``
records where they arrived, with no part cut, joined or reordered in between. The maps
are int64 device tensors, made once per layout (:class:`~geofp8.comm.block_plan.BlockPlan`)
or per group map.

* ``tiles`` ``[T, 7]``: ``(first element, end, first group of the run, group length, first
  element of the run, code slot of that element, 0)``, the rows of
  :func:`~.triton_fp8.placed_tiles`; a code slot is a nibble (``2·byte + high``) for E2M1,
  a byte for E4M3. A run of whole blocks of the format's length is cut into tiles of whole
  blocks; a shorter block (a tensor's last, a shard's cut) is a tile of its own, so every
  tile's blocks lie whole in it and one segment (a block's max in registers).
* ``pairs`` ``[P, 11]`` (E2M1 only, the encode writes whole bytes): ``(first byte, end,
  then for the low and the high nibbles (first element, first group, group length, first
  element of the run), then the number of bytes whose high nibble is an element)``: byte
  ``b`` of a row holds elements ``e_lo + 2(b − b₀)`` and ``e_hi + 2(b − b₀)``. A byte whose
  two elements lie in two segments (an odd segment), or whose high nibble is the shard's
  padding, is a row of its own.
* ``block_at`` ``[G]``, ``seg_at`` ``[S]``: the byte of every block scale and of every FP32
  segment scale; ``seg_of`` ``[G]`` (int32), every block's segment; ``seg_start`` ``[S]``
  its first element; ``seg_where`` ``[S, 2]``: ``(shard, index in it)``, what its
  stochastic key is mixed from; ``seg_empty``: the scale bytes of the segments without a
  block (a tensor with no block in a shard), whose scale is the smallest, ``2⁻¹⁴⁹``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch

from .base import group_runs
from .groups import GroupMap

__all__ = ["Placement", "ShardPlace", "TILE", "place", "whole_places"]

TILE = 1024  # elements per program (:data:`.triton_fp8.TILE`)


class ShardPlace(NamedTuple):
    """One shard of a placement: the byte offsets of its segment scales, block scales and
    codes in their buffers, and per segment ``(first element in the values, group
    lengths)``."""

    seg_base: int
    block_base: int
    code_base: int
    segments: Sequence[tuple[int, Sequence[int]]]


class Placement(NamedTuple):
    """The placed maps of one map's shards (module notes), on one device."""

    tiles: torch.Tensor
    pairs: torch.Tensor | None
    block_at: torch.Tensor
    seg_at: torch.Tensor
    seg_of: torch.Tensor
    seg_start: torch.Tensor
    seg_where: torch.Tensor
    seg_empty: torch.Tensor
    n_groups: int
    n_segments: int
    n_empty: int
    numel: int


def _runs(shard: ShardPlace) -> Iterable[tuple[int, int, int, int, int]]:
    """``(segment, first element, first group, groups, length)`` of the shard's runs of
    equal-length blocks, in shard order (groups counted in the shard)."""
    group = 0
    for i, (e0, lengths) in enumerate(shard.segments):
        for first, g, count, size in group_runs((tuple(lengths),)):
            if count and size:
                yield i, e0 + first, group + g, count, size
        group += len(lengths)


def _pairs(shard: ShardPlace, g_base: int) -> list[tuple[int, ...]]:
    """The byte rows of one packed shard (module notes)."""
    rows, byte, carry, step = [], shard.code_base, None, TILE // 2
    for _, e0, g0, count, size in _runs(shard):
        run, n, k = (g_base + g0, size, e0), count * size, 0
        if carry is not None:  # the previous run's odd element and this run's first
            rows.append((byte, byte + 1, *carry, e0, *run, 1))
            byte, k, carry = byte + 1, 1, None
        pairs = (n - k) // 2
        rows += [(byte + a, byte + min(a + step, pairs), e0 + k + 2 * a, *run,
                  e0 + k + 2 * a + 1, *run, min(step, pairs - a)) for a in range(0, pairs, step)]
        byte, k = byte + pairs, k + 2 * pairs
        if k < n:
            carry = (e0 + k, *run)
    if carry is not None:  # the shard's last byte: its high nibble is padding
        rows.append((byte, byte + 1, *carry, 0, 0, 1, 0, 0))
    return rows


def place(shards: Sequence[ShardPlace], packed: bool, block: int,
          device: torch.device) -> Placement:
    """The :class:`Placement` of ``shards`` (module notes): E2M1 codes ``packed`` (two per
    byte) or one per byte, blocks of ``block`` elements."""
    tiles, pairs, block_at, seg_at, seg_of, seg_start, seg_where = [], [], [], [], [], [], []
    seg_empty = []
    g_base = s_base = 0
    for j, shard in enumerate(shards):
        slot, firsts = (2 if packed else 1) * shard.code_base, []
        for i, (e0, lengths) in enumerate(shard.segments):
            seg_at.append(shard.seg_base + 4 * i)
            if not lengths:
                seg_empty.append(seg_at[-1])
            seg_start.append(e0)
            seg_where.append((j, i))
            seg_of += [s_base + i] * len(lengths)
            firsts.append(slot - e0)  # a segment's code slot minus its first element
            slot += sum(lengths)
        n_groups = sum(len(lengths) for _, lengths in shard.segments)
        block_at += range(shard.block_base, shard.block_base + n_groups)
        for i, e0, g0, count, size in _runs(shard):
            spans = ([(e0, e0 + count * size)] if size == block
                     else [(e0 + k * size, e0 + (k + 1) * size) for k in range(count)])
            tiles += [(a, min(a + TILE, hi), g_base + g0 + (a - e0) // size, size, a,
                       firsts[i] + a, 0) for lo, hi in spans for a in range(lo, hi, TILE)]
        if packed:
            pairs += _pairs(shard, g_base)
        g_base, s_base = g_base + n_groups, s_base + len(shard.segments)

    def on(rows, width: int, dtype=torch.int64) -> torch.Tensor:
        return torch.tensor(rows or [(0,) * width], dtype=dtype).reshape(-1, width).to(device)
    return Placement(on(tiles or [(0, 0, 0, 1, 0, 0, 0)], 7),
                     on(pairs or [(0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0)], 11) if packed else None,
                     on(block_at, 1).view(-1), on(seg_at, 1).view(-1),
                     on(seg_of, 1, torch.int32).view(-1), on(seg_start, 1).view(-1),
                     on(seg_where, 2), on(seg_empty or [0], 1).view(-1), g_base, s_base,
                     len(seg_empty),
                     sum(sum(map(sum, (lengths for _, lengths in shard.segments)))
                         for shard in shards))


def whole_places(groups: GroupMap, nvfp4: bool, packed: bool) -> list[ShardPlace]:
    """The shards of ``groups`` as the codec's whole-bucket parts lay them: the values one
    shard after the other, the segment scales of every shard in one buffer, the block
    scales in another, the codes in a third (each shard's ``⌈n/2⌉`` bytes when packed)."""
    places, elem, seg, group, code = [], 0, 0, 0, 0
    for shard, n in zip(groups, groups.numels):
        segments = []
        for lengths in shard:
            segments.append((elem, lengths))
            elem += sum(lengths)
        places.append(ShardPlace(4 * seg if nvfp4 else 0, group, code, segments))
        seg, group = seg + len(shard), group + sum(len(lengths) for lengths in shard)
        code += (n + 1) // 2 if packed else n
    return places
