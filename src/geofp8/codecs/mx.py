"""MX formats (OCP microscaling): MXFP4 (E2M1) and MXFP8 (E4M3) codes, one E8M0 scale per 32.

A block ``b`` of 32 elements (runs of the row-major flattened tensor, the last one shorter,
cut where a shard boundary falls) with amax ``a_b`` gets the power-of-two scale
``X_b = 2^e``, ``e`` the smallest integer with ``a_b ≤ fmax · 2^e`` (``fmax`` = 6 for E2M1,
448 for E4M3), clamped to the E8M0 range ``[−127, 127]``. Rounding the exponent *up* (the
OCP spec's ``⌊log₂ a_b⌋ − emax`` would saturate the top of the block) means no element is
clipped; the quotient ``x / X_b`` is exact (a power-of-two scaling), so each element is
rounded once, to nearest even (or stochastically, see :mod:`geofp8.codecs.fp4`).

E8M0 byte ``e + 127``: ``0`` is ``2⁻¹²⁷``, ``254`` is ``2¹²⁷``, ``0xFF`` is NaN. Policies: an
all-zero block decodes to exact zeros; a block holding NaN or ±Inf gets the NaN scale
``0xFF`` and decodes to NaN as a whole. A block whose amax is below ``fmax · 2⁻¹²⁷`` keeps
the smallest scale and its elements round as subnormals of the element format. A value
within one code spacing of the FP32 maximum (``> 2¹²⁸ − 2¹²⁵`` for E2M1) rounds to ``2¹²⁸``
and decodes to ±Inf.

Byte layouts of a shard with ``G`` blocks and ``n`` elements::

    MXFP4: [G × uint8 E8M0 scales][⌈n/2⌉ × uint8 codes]   (element 2i in the low nibble)
    MXFP8: [G × uint8 E8M0 scales][n × uint8 E4M3 codes]

Bytes per element: ``1/2 + 1/32`` (MXFP4, 0.133× FP32) and ``1 + 1/32`` (MXFP8).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch

from . import triton_fp4
from .base import (
    Codec,
    GroupMap,
    Segments,
    Shards,
    group_amax,
    group_div,
    group_fp8,
    group_map,
    group_mul_,
    interleave,
    joined_kinds,
    poison_scales_,
)
from .fp4 import (
    Blocks,
    _check_input,
    _check_rounding,
    block_amax,
    blocks_of,
    e2m1_encode,
    encode_blocks,
    flushed_fraction,
    grid_round,
    pack_nibbles,
    pack_whole,
    round_key,
    scale_blocks,
    segment_uniforms,
    shard_uniforms,
    unpack_into,
    unpack_shards,
    whole_bytes,
    whole_elsewhere,
)
from .fp8 import e4m3_into, group_lengths, lookup_into

__all__ = ["MX_BLOCK", "MXCodec", "e8m0_scales"]

MX_BLOCK = 32
# element format -> (mantissa of fmax as frexp gives it, its exponent, fmax)
_ELEMENTS = {"e2m1": (0.75, 3, 6.0), "e4m3": (0.875, 9, 448.0)}


def e8m0_scales(amax: torch.Tensor, element: str) -> torch.Tensor:
    """E8M0 bytes of the blocks with the given amax (``+Inf`` marks a non-finite block)."""
    frac, top, _ = _ELEMENTS[element]
    m, k = torch.frexp(amax)  # amax = m·2^k, m in [0.5, 1): amax ≤ fmax·2^e iff e ≥ …
    e = (k - top + (m > frac).to(k.dtype)).clamp_(-127, 127)
    byte = (e + 127).to(torch.uint8)
    return byte.masked_fill_(amax.mul(0).ne(0), 0xFF)  # amax·0: NaN unless amax is finite


def e8m0_values(byte: torch.Tensor) -> torch.Tensor:
    """``2^(byte − 127)`` as FP32 (``0`` → the subnormal ``2⁻¹²⁷``, ``0xFF`` → NaN)."""
    bits = byte.to(torch.int32) << 23
    bits.masked_fill_(byte == 0, 0x00400000).masked_fill_(byte == 0xFF, 0x7FC00000)
    return bits.view(torch.float32)


class ScaleTables(NamedTuple):
    """An element format's E8M0 scale of a block by the 16-bit key of its amax
    (:func:`~geofp8.codecs.fp4.round_key`), made from the value with bit pattern ``k·2¹⁶``:
    the exponent steps up past ``fmax · 2^e`` and at powers of two, points of at most
    three significant bits (even keys), so every amax of one key gets the same byte
    (:func:`e8m0_scales`; NaN or ``+Inf``: ``0xFF``)."""

    bytes: torch.Tensor  # the E8M0 byte
    divisors: torch.Tensor  # what the block's elements are divided by: its scale, 1 for NaN


@functools.cache
def _scale_tables(element: str, device: torch.device) -> ScaleTables:
    """The :class:`ScaleTables` of ``element`` on ``device``, made once."""
    byte = e8m0_scales((torch.arange(1 << 16, dtype=torch.int32) << 16).view(torch.float32),
                       element)
    return ScaleTables(byte.to(device), e8m0_values(byte).nan_to_num_(nan=1.0).to(device))


@functools.cache
def _e8m0_table(device: torch.device) -> torch.Tensor:
    """The FP32 value of every E8M0 byte (:func:`e8m0_values`) on ``device``, made once."""
    return e8m0_values(torch.arange(256, dtype=torch.int32).to(torch.uint8)).to(device)


def _scales(byte: torch.Tensor, poison: bool) -> torch.Tensor:
    """The blocks' FP32 scales (one lookup of the contiguous ``byte``), all NaN with
    ``poison`` unless every one is finite."""
    values = torch.empty(byte.shape, dtype=torch.float32, device=byte.device)
    lookup_into(values, _e8m0_table(byte.device), byte)
    if poison:
        poison_scales_(values)
    return values


def e4m3_encode(v: torch.Tensor, u: torch.Tensor | None = None) -> torch.Tensor:
    """E4M3 codes (uint8) of the FP32 ``v`` (``|v| ≤ 448``): torch's cast (round to nearest
    even), or stochastic rounding onto the E4M3 grid followed by an exact cast."""
    if u is not None:
        n, e = grid_round(v.abs(), 3, -9, u, emax=5)
        v = torch.ldexp(n, e.float()).clamp_(max=448.0).copysign_(v)
    return v.to(torch.float8_e4m3fn).view(torch.uint8)


@dataclass(frozen=True)
class MXCodec(Codec):
    """MXFP4 (``element="e2m1"``) or MXFP8 (``element="e4m3"``); see the module notes."""

    format: str = "mxfp4"
    element: str = "e2m1"
    rounding: str = "nearest"
    block_size: ClassVar[int] = MX_BLOCK  # elements per E8M0 scale

    def __post_init__(self) -> None:
        if self.element not in _ELEMENTS:
            raise ValueError(f"unknown MX element format {self.element!r}; "
                             f"expected one of {list(_ELEMENTS)}")
        _check_rounding(self.rounding)

    @property
    def packed(self) -> bool:
        return self.element == "e2m1"

    def segmentwise(self, lengths: Sequence[int]) -> bool:
        """Nearest rounding (no random stream), one byte per code or whole bytes of two
        nibbles per segment."""
        return self.rounding == "nearest" and (not self.packed or whole_bytes(lengths))

    def groups(self, shape: tuple[int, ...]) -> list[int]:
        return group_lengths(tuple(shape), "block", MX_BLOCK)

    def _code_bytes(self, n: int) -> int:
        return (n + 1) // 2 if self.packed else n

    def part_bytes(self, segments: Segments) -> tuple[int, int]:
        """E8M0 scales, codes."""
        return self._parts(blocks_of(segments))

    def _parts(self, blocks: Blocks) -> tuple[int, int]:
        return blocks.groups, self._code_bytes(blocks.numel)

    def encode_into(self, out: torch.Tensor, x: torch.Tensor, segments: Segments,
                    seed: int | None = None, overwrite: bool = False) -> None:
        blocks = blocks_of(segments)
        flat = _check_input(x, blocks.numel)
        g = blocks.groups
        nbytes = sum(self._parts(blocks))
        if out.numel() != nbytes:
            raise ValueError(f"out has {out.numel()} bytes, the payload {nbytes}")
        if not g:
            return
        byte = e8m0_scales(block_amax(flat, blocks), self.element)
        out[:g].copy_(byte)
        scale = e8m0_values(byte).nan_to_num_(nan=1.0)  # a NaN block divided by 1
        u = (segment_uniforms(segments, flat.numel(), seed, flat.device)
             if self.rounding == "stochastic" else None)
        # x / X is exact (a power of two); the kernel rounds once
        codes = encode_blocks(flat, scale, blocks, u,
                              e2m1_encode if self.packed else e4m3_encode,
                              in_place=overwrite)
        if self.packed:
            pack_nibbles(codes, out[g:])
        else:
            out[g:].copy_(codes)

    def decode_into(self, out: torch.Tensor, buf: torch.Tensor, segments: Segments,
                    poison: bool = False) -> torch.Tensor | None:
        blocks = blocks_of(segments)
        g, n = blocks.groups, blocks.numel
        nbytes = sum(self._parts(blocks))
        if buf.numel() < nbytes:
            raise ValueError(f"buffer of {buf.numel()} bytes is shorter than the payload {nbytes}")
        if not g:
            return torch.ones((), dtype=torch.bool, device=buf.device)
        byte = buf[:g]
        if self.packed:
            unpack_into(out[:n], buf[g:])
        else:
            e4m3_into(out[:n], buf[g : g + n])
        scale_blocks(out, _scales(byte, poison), blocks)
        return None if poison else (byte != 0xFF).all()

    def encode_shards(self, x: torch.Tensor, shards: Shards, seeds) -> list[torch.Tensor]:
        """As :meth:`encode_into` shard by shard, from one segmented amax and one division by
        the per-element scale."""
        shards = group_map(shards)
        if not shards.lengths:
            return [x.new_empty(0, dtype=torch.uint8)] * (2 * len(shards))
        if (fused := triton_fp4.encode_shards(self, x, shards, seeds)) is not None:
            return fused
        byte, codes = self._encode_whole(x, shards, seeds)
        return interleave(byte.split(shards.memo("groups", lambda: [sum(map(len, g))
                                                                    for g in shards])),
                          codes.split(shards.memo(("code bytes", self.packed), lambda: [
                              (n + 1) // 2 if self.packed else n for n in shards.numels])))

    def _encode_whole(self, x: torch.Tensor, shards: GroupMap, seeds
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(E8M0 bytes, codes)`` of the whole bucket, each one tensor (torch ops; the codes
        packed shard by shard, :func:`pack_whole`)."""
        byte, scale = self._scales_of(group_amax(x, shards))
        u = (shard_uniforms(shards, seeds, x.device)
             if self.rounding == "stochastic" else None)
        if self.packed or u is not None:
            codes = (e2m1_encode if self.packed else e4m3_encode)(group_div(x, scale, shards), u)
        else:  # e4m3_encode's cast, in the division's kernel
            codes = group_fp8(x, scale, shards, torch.float8_e4m3fn)
        return byte, pack_whole(codes, shards) if self.packed else codes

    def encode_whole(self, x: torch.Tensor, shards: Shards, with_error: bool = False,
                     error_out: torch.Tensor | None = None
                     ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """:meth:`Codec.encode_whole` from the whole bucket's two tensors (no Python per
        shard or segment); the error decoded back from them (:meth:`decode_whole`)."""
        shards = group_map(shards)
        if (done := whole_elsewhere(self, x, shards, with_error, error_out)) is not None:
            return done
        wholes = list(self._encode_whole(x, shards, [None] * len(shards)))
        if not with_error:
            return wholes, None
        error = torch.empty_like(x)
        self.decode_whole(error, wholes, shards, check=False)
        return wholes, torch.sub(x, error, out=error if error_out is None else error_out)

    def _scales_of(self, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(E8M0 bytes, divisors)`` of the blocks of ``amax`` (NaN or ``+Inf`` for a
        non-finite block): one lookup each of its keys (:class:`ScaleTables`)."""
        key, tables = round_key(amax), _scale_tables(self.element, amax.device)
        return torch.take(tables.bytes, key), torch.take(tables.divisors, key)

    def encode_shards_with_error(self, x: torch.Tensor, shards: Shards
                                 ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """With the fused kernels, the rounding error from the encoding pass."""
        fused = triton_fp4.encode_shards(self, x, shards, error=True)
        return fused if fused is not None else super().encode_shards_with_error(x, shards)

    def decode_shards(self, out: torch.Tensor, parts, shards: Shards, check: bool = True,
                      poison: bool = False) -> torch.Tensor | None:
        return self.decode_whole(out, joined_kinds(parts, (1, 1)), shards, check, poison)

    def decode_whole(self, out: torch.Tensor, wholes, shards: Shards, check: bool = True,
                     poison: bool = False) -> torch.Tensor | None:
        shards = group_map(shards)
        if not shards.lengths:
            return torch.ones((), dtype=torch.bool, device=out.device)
        ran, finite = triton_fp4.decode_whole(self, out, wholes, shards, check, poison)
        if ran:
            return finite
        byte, codes = wholes
        if self.packed:
            unpack_shards(out, codes, shards)
        else:
            e4m3_into(out, codes)
        group_mul_(out, _scales(byte, poison), shards)
        return (byte != 0xFF).all() if check and not poison else None

    def clipped_fraction(self, x: torch.Tensor) -> torch.Tensor:
        return flushed_fraction(self, x)
