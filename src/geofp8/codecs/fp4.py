"""NVFP4: E2M1 codes (two per byte), an E4M3 scale per 16 elements, an FP32 scale per segment.

E2M1 (1 sign, 2 exponent, 1 mantissa bit, bias 1, no Inf/NaN) has the magnitudes
``0, 0.5, 1, 1.5, 2, 3, 4, 6`` (codes 0–7; bit 3 is the sign). Its unit round-off is 2⁻²
on normal values.

Scales of a segment (one tensor's chunk of a shard, see :mod:`geofp8.codecs.base`) with
amax ``A`` and a 16-element block ``b`` with amax ``a_b``:

* segment scale ``s = max(A / (6·448), 2⁻¹⁴⁹)`` (FP32; the floor keeps it non-zero);
* block scale ``β_b`` = the smallest E4M3 value ``≥ a_b / (6 s)`` (rounded *up*, so that
  ``|x| / (β_b s) ≤ 6``: no element saturates and stochastic rounding stays unbiased);
* element code = E2M1 of ``x / (β_b s)``; decoding is ``code · (β_b s)`` with ``β_b s``
  evaluated in FP32 (the same product on both sides).

Blocks are runs of 16 elements of the row-major flattened tensor (the last one shorter),
cut where a shard boundary falls. Policies: an all-zero block has ``β_b = 0`` and decodes
to exact zeros; a block holding NaN or ±Inf gets the E4M3 NaN code ``0x7F`` as its scale
and decodes to NaN as a whole (its segment scale comes from the finite blocks only).

Byte layout of a shard with ``S`` segments, ``G`` blocks and ``n`` elements::

    [S × float32 segment scales][G × uint8 E4M3 block scales][⌈n/2⌉ × uint8 codes]

little-endian; element ``2i`` in the low nibble of code byte ``i``, element ``2i+1`` in the
high nibble (a zero nibble pads an odd ``n``). Bytes per element: ``1/2 + 1/16`` plus
``4/numel`` per segment (≈ 0.5625 = 0.14× FP32).

Rounding: to nearest even by default; ``rounding="stochastic"`` rounds ``|v|`` up to the
next grid point with probability equal to its distance from the one below, which is
unbiased (``E[q] = v``). Its uniforms come from :func:`segment_uniforms`: one stream per
segment, keyed by the caller's ``seed`` and the segment's index (a counter-based hash,
:mod:`.uniforms`), so every rank that encodes the same values with the same seed gets the
same codes, on any device.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch

from . import native, triton_fp4
from .base import (
    Codec,
    GroupMap,
    Segments,
    Shards,
    device_scalar,
    exact_div,
    group_amax,
    group_div,
    group_map,
    group_mul_,
    group_runs,
    interleave,
    joined_kinds,
    rows_amax,
    scales_flag,
)
from .fp8 import e4m3_values, group_lengths, lookup_into
from .groups import segment_index
from .uniforms import key_halves, uniforms_into

__all__ = ["E2M1_VALUES", "NVFP4Codec", "ROUNDINGS", "e2m1_encode", "e2m1_values",
           "segment_uniforms"]

ROUNDINGS = ("nearest", "stochastic")
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of codes 0..7
E2M1_MAX = 6.0
E4M3_MAX = 448.0
NVFP4_BLOCK = 16
S_FLOOR_AMAX = 1345 * 2.0**-149  # the least amax whose s = amax / (6·448) is not below 2⁻¹⁴⁹:
# the division rounds monotonically, so max(amax, this) / (6·448) = max(amax / (6·448), 2⁻¹⁴⁹)
NAN = float("nan")  # a non-finite block's scale quotient on the torch path (NVFP4Codec._scales)


def segment_uniforms(segments: Segments, numel: int, seed: int | None,
                     device: torch.device) -> torch.Tensor:
    """Uniforms in ``[0, 1)`` for a shard: segment ``i`` draws its own counter-based stream
    keyed by ``mix_seed(seed, i)`` (``seed=None`` counts as 0; :mod:`.uniforms`: the same
    bits on every device and in the Triton kernels)."""
    u = torch.empty(numel, dtype=torch.float32, device=device)
    lo = 0
    for i, seg in enumerate(segments):
        n = sum(seg)
        uniforms_into(u[lo : lo + n], key_halves(seed, i))
        lo += n
    return u


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


_HIGH = int(sys.byteorder == "little")  # which 16-bit half of an FP32 holds its top bits


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """``2^e`` (FP32) for an int32 tensor of normal exponents ``-126 ≤ e ≤ 127``."""
    return ((e + 127) << 23).view(torch.float32)


def grid_round(a: torch.Tensor, mbits: int, emin: int, u: torch.Tensor | None,
               emax: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """Round the non-negative FP32 ``a`` onto a float grid with ``mbits`` mantissa bits whose
    finest spacing is ``2^emin``: returns ``(n, e)`` with the result ``n · 2^e`` (``n`` an
    FP32 integer, ``e`` int32, ``emin ≤ e ≤ emax``). ``u is None``: to nearest, ties to even;
    else ``⌊a/2^e + u⌋`` (stochastic, unbiased for ``u ~ U[0, 1)``)."""
    e = ((_bits(a) >> 23) - (127 + mbits)).clamp_(emin, emax)
    y = a * _pow2(-e)  # exact: a power-of-two scaling of a normal quotient
    n = y.add_(u).floor_() if u is not None else y.round_()
    return n, e


def e2m1_round(v: torch.Tensor, u: torch.Tensor | None = None) -> torch.Tensor:
    """E2M1 codes (uint8, 0–15) of the FP32 ``v`` (``|v| ≤ 6``; larger saturates at 6),
    computed on the grid: the reference that :func:`e2m1_encode`'s table is built from."""
    sign = (_bits(v) >> 28) & 8
    a = v.abs()
    # spacing 2^e of E2M1 at |v|: 0.5 below 2, 1 on [2, 4), 2 from 4
    n, e = grid_round(a, 1, -1, u, emax=1)
    # the code of n·2^e is n + 2(e + 1): e = -1 counts halves 0..4 (codes 0–4),
    # e = 0 counts 2, 3, 4 (codes 4–6), e = 1 counts 4 and 6 (codes 6, 7)
    code = (n.clamp_(max=8.0).to(torch.int32) + 2 * e + 2).clamp_(0, 7)
    return (code | sign).to(torch.uint8)


def e4m3_ceil(r: torch.Tensor) -> torch.Tensor:
    """E4M3 codes (uint8) of the smallest E4M3 value ``≥ min(r, 448)`` for the FP32 ``r ≥ 0``
    (the block scale rounded *up*, module notes); the NaN code ``0x7F`` for NaN or ``+Inf``:
    the reference that :func:`_encode_table`'s block-scale table is built from."""
    r = r.nan_to_num(nan=NAN, posinf=NAN).clamp_(max=E4M3_MAX)
    nearest = r.to(torch.float8_e4m3fn)  # NaN (positive: nan_to_num's): 0x7F
    return nearest.view(torch.uint8) + (e4m3_values(nearest) < r)  # round up (bool: 0/1)


class KeyTables(NamedTuple):
    """What a 16-bit key (:func:`round_key`) stands for, one entry per key: rounded from the
    value with bit pattern ``k·2¹⁶``."""

    codes: torch.Tensor  # E2M1 code (uint8), to nearest
    values: torch.Tensor  # that code's FP32 value
    scales: torch.Tensor  # E4M3 code of the block scale (uint8), rounded up (e4m3_ceil)


@functools.cache
def _encode_table(device: torch.device) -> KeyTables:
    """The :class:`KeyTables` on ``device``, made once: every key's value rounded on the
    grid (:func:`e2m1_round`, :func:`e4m3_ceil`)."""
    keys = (torch.arange(1 << 16, dtype=torch.int32) << 16).view(torch.float32)
    codes = e2m1_round(keys)
    return KeyTables(codes.to(device), e2m1_values(codes).to(device),
                     e4m3_ceil(keys).to(device))


@functools.cache
def _pair_table(device: torch.device) -> torch.Tensor:
    """For every byte, the FP32 values of its low and high nibble, as one int64."""
    values = e2m1_values(torch.arange(16))
    byte = torch.arange(256)
    pairs = torch.stack([values[byte & 15], values[byte >> 4]], dim=1).contiguous()
    return pairs.view(torch.int64).view(-1).to(device)


def round_key(v: torch.Tensor) -> torch.Tensor:
    """The lookup key (int64, sign-extended) of every FP32 of the contiguous ``v``: the top
    16 bits of its pattern with the lowest bit set when any of the 16 bits below is
    (rounding to odd). A grid whose points have at most 7 significant bits (E2M1, E4M3)
    has each point at an even key, so an odd key lies strictly between two of them and
    between two ties: every ``v`` of one key rounds the same way (to nearest or up), which
    its :class:`KeyTables` entry holds. A negative key ``k`` reads entry ``k + 2¹⁶`` of a
    table (``torch.take``)."""
    halves = v.view(torch.int16).view(-1, 2)  # each FP32 pattern's two 16-bit halves
    key = torch.empty(v.numel(), dtype=torch.int64, device=v.device)
    torch.bitwise_or(halves[:, _HIGH], halves[:, 1 - _HIGH] != 0, out=key)
    return key


def e2m1_encode(v: torch.Tensor, u: torch.Tensor | None = None) -> torch.Tensor:
    """E2M1 codes (uint8, 0–15) of the contiguous FP32 ``v`` (``|v| ≤ 6``; larger saturates
    at 6); ``u``: uniforms for stochastic rounding (:func:`e2m1_round`). To nearest, one
    lookup of :func:`round_key` (every E2M1 tie has two significant bits)."""
    if u is not None:
        return e2m1_round(v, u)
    return torch.take(_encode_table(v.device).codes, round_key(v))


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """Exact FP32 values of E2M1 codes (integers 0–15; code 8 is -0)."""
    values = torch.tensor(E2M1_VALUES).to(codes.device)
    return torch.cat([values, -values])[codes.long()]


def pack_nibbles(codes: torch.Tensor, out: torch.Tensor) -> None:
    """Two 4-bit codes per byte into ``out`` (``⌈n/2⌉`` bytes): element ``2i`` low. The codes
    are read as little-endian int16 pairs ``c₂ᵢ + 256·c₂ᵢ₊₁``; ``pair | pair >> 4`` brings
    ``c₂ᵢ₊₁`` next to ``c₂ᵢ`` in the low byte."""
    n = codes.numel()
    pairs = n // 2
    if pairs:
        even = codes[: 2 * pairs]
        if even.storage_offset() % 2:
            even = even.clone()
        p = even.view(torch.int16)
        torch.bitwise_or(p, p >> 4, out=out[:pairs])  # the cast to uint8 keeps the low byte
    if n % 2:
        out[pairs] = codes[-1]


def unpack_into(out: torch.Tensor, buf: torch.Tensor) -> None:
    """The FP32 values of the ``out.numel()`` E2M1 codes packed in ``buf`` by
    :func:`pack_nibbles`: one lookup per byte in the 256-entry table of value pairs."""
    n = out.numel()
    pairs = n // 2
    table = _pair_table(out.device)
    if pairs:
        dst = out[: 2 * pairs]
        aligned = dst.storage_offset() % 2 == 0  # an int64 view needs 8-byte alignment
        target = (dst.view(torch.int64) if aligned
                  else torch.empty(pairs, dtype=torch.int64, device=out.device))
        lookup_into(target, table, buf[:pairs])
        if not aligned:
            dst.copy_(target.view(torch.float32))
    if n % 2:
        last = torch.index_select(table, 0, buf[pairs : pairs + 1].to(torch.int32))
        out[n - 1 :] = last.view(torch.float32)[:1]


def pack_shards(codes: torch.Tensor, shards: GroupMap) -> list[torch.Tensor]:
    """Every shard's codes (one after the other) packed by :func:`pack_nibbles` on its own:
    ``⌈n/2⌉`` bytes for a shard of ``n`` elements."""
    sizes = shards.memo("packed bytes", lambda: [(n + 1) // 2 for n in shards.numels])
    return list(pack_whole(codes, shards).split(sizes))


def _odd(shards: GroupMap) -> tuple[bool, ...] | None:
    """Per shard, whether its element count is odd; ``None`` when none is (made once per
    map: nothing per call walks the shards)."""
    def make():
        odd = tuple(n % 2 == 1 for n in shards.numels)
        return odd if any(odd) else None
    return shards.memo("odd shards", make)


def pack_whole(codes: torch.Tensor, shards: GroupMap) -> torch.Tensor:
    """:func:`pack_shards`' bytes back to back, one tensor."""
    if (odd := _odd(shards)) is not None:  # a zero nibble after each odd shard, as
        pad = codes.new_zeros(1)  # pack_nibbles pads its last byte
        codes = torch.cat([p for c, o in zip(codes.split(list(shards.numels)), odd)
                           for p in ((c, pad) if o else (c,))])
    packed = codes.new_empty(codes.numel() // 2)
    pack_nibbles(codes, packed)
    return packed


def unpack_shards(out: torch.Tensor, packed: torch.Tensor, shards: GroupMap) -> None:
    """The inverse of :func:`pack_shards`: the values of every shard into ``out``."""
    if (odd := _odd(shards)) is None:
        unpack_into(out, packed)
        return
    sizes, keep = shards.memo("unpacked pieces", lambda: (  # a shard's values, its pad nibble
        [p for n, o in zip(shards.numels, odd) for p in ((n, 1) if o else (n,))],
        [k for o in odd for k in ((True, False) if o else (True,))]))
    values = out.new_empty(2 * packed.numel())
    unpack_into(values, packed)
    torch.cat([p for p, k in zip(values.split(sizes), keep) if k], out=out)


def shard_uniforms(shards: GroupMap, seeds, device: torch.device) -> torch.Tensor:
    """:func:`segment_uniforms` of every shard with its own seed, one after the other (one
    generator per segment: these kernels grow with the segments)."""
    return torch.cat([segment_uniforms(s, n, seed, device)
                      for s, n, seed in zip(shards, shards.numels, seeds)])


def _check_rounding(rounding: str) -> None:
    if rounding not in ROUNDINGS:
        raise ValueError(f"unknown rounding {rounding!r}; expected one of {ROUNDINGS}")


def _check_input(x: torch.Tensor, numel: int) -> torch.Tensor:
    if not x.is_floating_point():
        raise TypeError(f"GeoFP8 codecs take floating-point tensors, got {x.dtype}")
    if numel != x.numel():
        raise ValueError(f"group lengths sum to {numel} but x has {x.numel()} elements")
    return x.reshape(-1).float()


def whole_bytes(lengths: Sequence[int]) -> bool:
    """Whether segments of ``lengths`` elements each pack into whole bytes of two nibbles
    (each segment's nibbles then start a byte: a run of them packs as they do one by one)."""
    return all(n % 2 == 0 for n in lengths)


CHUNK = 1 << 16  # elements per kernel piece: the temporaries of a piece stay in cache


class Blocks(NamedTuple):
    """A shard's scale groups as runs of equal length (:func:`~.base.group_runs`) and their
    totals, found once per codec call: an NVFP4 shard has a group per 16 elements, and a walk
    over their lengths in Python costs milliseconds per bucket."""

    runs: list[tuple[int, int, int, int]]
    groups: int
    numel: int


_BLOCKS: dict[int, tuple[Segments, Blocks]] = {}  # id(segments) -> (segments, their blocks)


def blocks_of(segments: Segments) -> Blocks:
    """The blocks of ``segments``, remembered for the last 256 tuples of tuples passed (a
    layout passes the same ones every step; hashing them would cost as much as the walk)."""
    hit = _BLOCKS.get(id(segments))
    if hit is not None and hit[0] is segments:
        return hit[1]
    runs = group_runs(segments)
    lo, g0, count, size = runs[-1] if runs else (0, 0, 0, 0)
    blocks = Blocks(runs, g0 + count, lo + count * size)
    if isinstance(segments, tuple) and all(type(seg) is tuple for seg in segments):
        if len(_BLOCKS) >= 256:
            del _BLOCKS[next(iter(_BLOCKS))]
        _BLOCKS[id(segments)] = (segments, blocks)
    return blocks


def pieces(blocks: Blocks):
    """Yield ``(lo, hi, g0, g1, size)``: elements ``[lo, hi)`` holding groups ``[g0, g1)`` of
    ``size`` elements each, at most about :data:`CHUNK` elements per piece."""
    for lo, g0, count, size in blocks.runs:
        per = max(1, CHUNK // size)
        for a in range(0, count, per):
            b = min(a + per, count)
            yield lo + a * size, lo + b * size, g0 + a, g0 + b, size


def block_amax(flat: torch.Tensor, blocks: Blocks) -> torch.Tensor:
    """Max ``|x|`` of every group; ``+Inf`` for a group holding NaN or ±Inf."""
    if native.usable(flat):  # one pass of the CPU's native kernel
        return native.runs_amax(flat, blocks.runs, blocks.groups)
    amax = flat.new_empty(blocks.groups)
    for lo, hi, g0, g1, size in pieces(blocks):
        amax[g0:g1] = rows_amax(flat[lo:hi].view(g1 - g0, size))
    return _inf_unless_finite(amax)


def _inf_unless_finite(amax: torch.Tensor) -> torch.Tensor:
    """``amax`` (never negative) with NaN made ``+Inf``, in place: one kernel."""
    return amax.nan_to_num_(nan=float("inf"), posinf=float("inf"))


def encode_blocks(flat: torch.Tensor, divisor: torch.Tensor, blocks: Blocks,
                  u: torch.Tensor | None, kernel, in_place: bool = False) -> torch.Tensor:
    """``kernel(x / divisor_g, u)`` piece by piece: the codes (uint8, one per element).
    ``in_place``: the quotients are written over ``flat`` (its values are lost) instead of
    into a new piece."""
    codes = torch.empty(flat.numel(), dtype=torch.uint8, device=flat.device)
    for lo, hi, g0, g1, size in pieces(blocks):
        x = flat[lo:hi].view(g1 - g0, size)
        v = torch.div(x, divisor[g0:g1, None], out=x if in_place else None)
        codes[lo:hi] = kernel(v.view(-1), None if u is None else u[lo:hi])
    return codes


def scale_blocks(out: torch.Tensor, scale: torch.Tensor, blocks: Blocks) -> None:
    """``out_g ·= scale_g`` for every group, piece by piece."""
    for lo, hi, g0, g1, size in pieces(blocks):
        out[lo:hi].view(g1 - g0, size).mul_(scale[g0:g1, None])


@dataclass(frozen=True)
class NVFP4Codec(Codec):
    """NVFP4 (see the module notes for scales and byte layout)."""

    format: str = "nvfp4"
    rounding: str = "nearest"
    block_size: ClassVar[int] = NVFP4_BLOCK  # elements per E4M3 scale

    def __post_init__(self) -> None:
        _check_rounding(self.rounding)

    def groups(self, shape: tuple[int, ...]) -> list[int]:
        return group_lengths(tuple(shape), "block", NVFP4_BLOCK)

    def segmentwise(self, lengths: Sequence[int]) -> bool:
        """Nearest rounding (no random stream) and whole bytes of two nibbles per segment."""
        return self.rounding == "nearest" and whole_bytes(lengths)

    def part_bytes(self, segments: Segments) -> tuple[int, int, int]:
        """Segment scales, block scales, packed codes."""
        return self._parts(len(segments), blocks_of(segments))

    @staticmethod
    def _parts(n_seg: int, blocks: Blocks) -> tuple[int, int, int]:
        return 4 * n_seg, blocks.groups, (blocks.numel + 1) // 2

    def _scales(self, amax: torch.Tensor, segments: Segments,
                groups: GroupMap | None = None) -> tuple[torch.Tensor, ...]:
        """``(segment scales s, block scale codes, block scales β·s per block)`` from the blocks'
        ``amax`` (``+Inf`` for a non-finite block, :func:`block_amax`). On the torch path
        every quotient's code is one lookup of its key (:func:`round_key`) in the table of
        :func:`e4m3_ceil`, which gives a non-finite block's (NaN or ``+Inf``) the E4M3 NaN
        code ``0x7F`` (no mask of its own). ``groups``: the
        segments' map, whose device counts and segment index are made once (else made
        here)."""
        if native.usable(amax):  # two passes of the CPU's native kernels
            per_segment = tuple(len(seg) for seg in segments)
            seg_amax = native.runs_amax(amax, native.length_runs(per_segment), len(segments),
                                        finite_only=True)
            s = exact_div(seg_amax, E2M1_MAX * E4M3_MAX).clamp_min_(2.0**-149)
            return (s, *native.nvfp4_scales(amax, s, per_segment))
        if groups is None:
            counts = torch.tensor([len(seg) for seg in segments]).to(amax.device)
        else:
            counts = groups.on("counts", amax.device)
        finite = amax.nan_to_num(posinf=0.0)  # a non-finite block (+Inf) counts as 0
        seg_amax = torch.segment_reduce(finite, "max", lengths=counts, unsafe=True,
                                        initial=S_FLOOR_AMAX)  # the clamp of s, folded in
        s = exact_div(seg_amax, E2M1_MAX * E4M3_MAX)
        s_block = (torch.repeat_interleave(s, counts, output_size=amax.numel()) if groups is None
                   else s.index_select(0, segment_index(groups, amax.device)))
        r = amax / (E2M1_MAX * s_block)
        code = torch.take(_encode_table(r.device).scales, round_key(r))  # e4m3_ceil(r)
        return s, code, e4m3_values(code).mul_(s_block)

    def encode_into(self, out: torch.Tensor, x: torch.Tensor, segments: Segments,
                    seed: int | None = None, overwrite: bool = False,
                    error: torch.Tensor | None = None) -> None:
        """``error``: see :meth:`encode_with_error`."""
        blocks = blocks_of(segments)
        flat = _check_input(x, blocks.numel)
        n_seg, n_groups = len(segments), blocks.groups
        nbytes = sum(self._parts(n_seg, blocks))
        if out.numel() != nbytes:
            raise ValueError(f"out has {out.numel()} bytes, the payload {nbytes}")
        if not n_groups:
            return
        s, code, scale = self._scales(block_amax(flat, blocks), segments)
        out[: 4 * n_seg].copy_(s.view(torch.uint8))
        out[4 * n_seg : 4 * n_seg + n_groups].copy_(code)
        u = (segment_uniforms(segments, flat.numel(), seed, flat.device)
             if self.rounding == "stochastic" else None)
        packed = out[4 * n_seg + n_groups :]
        if u is None and native.usable(flat, packed):  # one pass of the CPU's native kernel
            native.e2m1_encode(packed, flat, scale, blocks.runs, error=error)
            return
        if error is not None:
            raise ValueError("only the native CPU kernel with nearest rounding leaves the "
                             "rounding error")
        divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
        pack_nibbles(encode_blocks(flat, divisor, blocks, u, e2m1_encode, in_place=overwrite),
                     packed)

    def fuses_error(self, *tensors: torch.Tensor) -> bool:
        """Nearest rounding on a CPU: the native kernel leaves the rounding error in its
        encoding pass."""
        return self.rounding == "nearest" and native.usable(*tensors)

    def decode_into(self, out: torch.Tensor, buf: torch.Tensor, segments: Segments,
                    poison: bool = False) -> torch.Tensor | None:
        blocks = blocks_of(segments)
        n_seg, n_groups, n = len(segments), blocks.groups, blocks.numel
        nbytes = sum(self._parts(n_seg, blocks))
        if buf.numel() < nbytes:
            raise ValueError(f"buffer of {buf.numel()} bytes is shorter than the payload {nbytes}")
        if not n_groups:
            return torch.ones((), dtype=torch.bool, device=buf.device)
        s = buf[: 4 * n_seg].clone().view(torch.float32)
        code = buf[4 * n_seg : 4 * n_seg + n_groups]
        per_segment = tuple(len(seg) for seg in segments)  # blocks of each segment
        packed = buf[4 * n_seg + n_groups :]
        fast = native.usable(out, packed)  # one pass of the CPU's native kernels each
        if fast:
            scale = torch.empty(n_groups, dtype=torch.float32)
            native.e4m3_decode(scale, code, s, per_segment)
        else:
            counts = torch.tensor(per_segment, dtype=torch.long).to(buf.device)
            scale = e4m3_values(code).mul_(
                torch.repeat_interleave(s, counts, output_size=n_groups))
        finite = scales_flag(scale, poison=poison)
        if fast:
            native.e2m1_decode(out[:n], packed, scale, blocks.runs)
        else:
            unpack_into(out[:n], packed)
            scale_blocks(out, scale, blocks)
        return finite

    def encode_shards(self, x: torch.Tensor, shards: Shards, seeds) -> list[torch.Tensor]:
        """As :meth:`encode_into` shard by shard, every segment's and block's scale from
        segmented reductions, every code from one division by the per-element divisor."""
        shards = group_map(shards)
        if not shards.lengths:
            return [x.new_empty(0, dtype=torch.uint8)] * (3 * len(shards))
        if (fused := triton_fp4.encode_shards(self, x, shards, seeds)) is not None:
            return fused
        return self._split(shards, *self._encode_whole(x, shards, seeds)[:3])

    def _encode_whole(self, x: torch.Tensor, shards: GroupMap, seeds,
                      decoded: bool = False) -> tuple[torch.Tensor, ...]:
        """``(segment scales, block scale codes, packed codes, block scales)`` of the whole
        bucket, each one tensor (torch ops); ``decoded``: then what the codes decode to, FP32
        in ``x``'s order, from the codes (to nearest: one lookup of their keys' values, no
        unpacking)."""
        amax = group_amax(x, shards)  # NaN or +Inf for a non-finite block: _scales' torch
        if native.usable(amax):  # ops read either, the native kernel +Inf only
            _inf_unless_finite(amax)
        s, code, scale = self._scales(amax, shards.segments, shards)
        divisor = torch.where(scale > 0, scale, device_scalar(1.0, scale.dtype, scale.device))
        u = (shard_uniforms(shards, seeds, x.device)
             if self.rounding == "stochastic" else None)
        # the quotients x / divisor live only until their keys (or codes) are made
        key = None if u is not None else round_key(group_div(x, divisor, shards))
        codes = (e2m1_encode(group_div(x, divisor, shards), u) if key is None
                 else torch.take(_encode_table(x.device).codes, key))
        values = None
        if decoded:
            values = (e2m1_values(codes) if key is None
                      else torch.take(_encode_table(x.device).values, key))
        del key  # 8 bytes an element, freed before the packing
        whole = (s, code, pack_whole(codes, shards), scale)
        if values is None:
            return whole
        group_mul_(values, scale, shards)
        return (*whole, values)

    def _split(self, shards: GroupMap, *whole: torch.Tensor) -> list[torch.Tensor]:
        """Every shard's parts, cut from the whole bucket's three."""
        sizes = shards.memo(self, lambda: tuple(zip(*(self.part_bytes(g) for g in shards))))
        return interleave(*(t.view(torch.uint8).split(n) for t, n in zip(whole, sizes)))

    def encode_shards_with_error(self, x: torch.Tensor, shards: Shards
                                 ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """:meth:`encode_shards` and the rounding error decoded back from the whole bucket's
        codes and block scales (no parts joined back)."""
        shards = group_map(shards)
        if not shards.lengths:
            return super().encode_shards_with_error(x, shards)
        wholes, error = self.encode_whole(x, shards, with_error=True)
        return self._split(shards, *wholes), error

    def encode_whole(self, x: torch.Tensor, shards: Shards, with_error: bool = False,
                     error_out: torch.Tensor | None = None
                     ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        shards = group_map(shards)
        if (done := whole_elsewhere(self, x, shards, with_error, error_out)) is not None:
            return done
        s, code, packed, *_, decoded = self._encode_whole(x, shards, [None] * len(shards),
                                                          decoded=with_error)
        error = None
        if with_error:
            error = torch.sub(x, decoded, out=decoded if error_out is None else error_out)
        return [s.view(torch.uint8), code, packed], error

    def decode_shards(self, out: torch.Tensor, parts, shards: Shards, check: bool = True,
                      poison: bool = False) -> torch.Tensor | None:
        return self.decode_whole(out, joined_kinds(parts, (4, 1, 1)), shards, check, poison)

    def decode_whole(self, out: torch.Tensor, wholes, shards: Shards, check: bool = True,
                     poison: bool = False) -> torch.Tensor | None:
        shards = group_map(shards)
        if not shards.lengths:
            return torch.ones((), dtype=torch.bool, device=out.device)
        ran, finite = triton_fp4.decode_whole(self, out, wholes, shards, check, poison)
        if ran:
            return finite
        s, code, packed = wholes
        scale = e4m3_values(code).mul_(s.view(torch.float32).index_select(
            0, segment_index(shards, out.device)))
        finite = scales_flag(scale, check, poison)
        self._decode_values(out, packed, scale, shards)
        return finite

    @staticmethod
    def _decode_values(out: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                       shards: GroupMap) -> None:
        """The FP32 values of the whole bucket's packed codes and block scales into ``out``."""
        unpack_shards(out, packed, shards)
        group_mul_(out, scale, shards)

    def clipped_fraction(self, x: torch.Tensor) -> torch.Tensor:
        return flushed_fraction(self, x)


def whole_elsewhere(codec: Codec, x: torch.Tensor, shards: GroupMap, with_error: bool,
                    error_out: torch.Tensor | None):
    """A block-scaled codec's :meth:`Codec.encode_whole` where its torch ops do not make
    it: no groups (the default's), or the kernels' (:func:`.triton_fp4.encode_whole`);
    ``None`` otherwise."""
    if not shards.lengths:
        return Codec.encode_whole(codec, x, shards, with_error, error_out)
    return triton_fp4.encode_whole(codec, x, shards, error=with_error, error_out=error_out)


def flushed_fraction(codec: Codec, x: torch.Tensor) -> torch.Tensor:
    """Share of the non-zero elements of ``x`` that decode to zero: the clipped-fraction score
    of a block-scaled codec whose blocks never saturate."""
    flat = x.reshape(-1).float()
    flushed = (codec.round_trip(flat) == 0) & (flat != 0)
    return flushed.sum().double() / max(flat.numel(), 1)
