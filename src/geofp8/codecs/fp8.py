"""FP8 codecs: E4M3 / E5M2 with per-tensor, per-row or per-block scaling.

A tensor ``x`` is cut into contiguous *scale groups* (in row-major order). Group
``g`` gets one float32 scale ``s_g = amax_g / fmax`` (``fmax`` = 448 for E4M3,
57344 for E5M2) and every element is stored as the FP8 code of ``x / s_g``
(round to nearest even). Decoding is ``code * s_g``. On normal-range values the
relative error of one element is at most 2⁻⁴ (E4M3) or 2⁻³ (E5M2); values far
below ``amax_g`` lose precision as FP8 subnormals or flush to zero.

Policies (documented, tested):

* An all-zero group gets scale 1 and codes 0, so it decodes to exact zeros.
* A group containing NaN or ±Inf gets scale NaN, so *its whole group* decodes to
  NaN. Non-finite input therefore never comes back finite.

Wire layout of a shard (:meth:`FP8Codec.encode_into`, :meth:`Packed.to_bytes`),
little-endian: ``[scales: G × float32][codes: numel × uint8]`` — one byte per element plus
four per scale group. The receiver must know
``numel`` and the group lengths, which both sides derive from shared metadata
(shape and :class:`Codec`), so nothing else travels.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import native, triton_fp8
from .base import (
    Codec,
    GroupMap,
    Segments,
    Shards,
    exact_div,
    group_amax,
    group_fp8,
    group_map,
    group_mul_,
    interleave,
    joined_kinds,
    scales_flag,
    segment_amax,
)

__all__ = ["FP8_FORMATS", "SCALINGS", "FP8Codec", "Packed", "e4m3_into", "e4m3_table",
           "e4m3_values", "group_lengths", "lookup_into"]

FP8_FORMATS: dict[str, torch.dtype] = {
    "e4m3": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
}
SCALINGS = ("tensor", "row", "block")
_FMAX = {name: float(torch.finfo(dtype).max) for name, dtype in FP8_FORMATS.items()}


def group_lengths(shape: tuple[int, ...], scaling: str, block_size: int) -> list[int]:
    """Lengths of the contiguous scale groups of a row-major tensor of ``shape``.

    ``tensor``: one group. ``row``: one group per row of ``x.reshape(shape[0], -1)``
    (a 1-D tensor is one row). ``block``: consecutive runs of ``block_size``
    elements of the flattened tensor, the last one possibly shorter.
    """
    numel = 1
    for s in shape:
        numel *= s
    if numel == 0:
        return []
    if scaling == "tensor":
        return [numel]
    if scaling == "row":
        rows = shape[0] if len(shape) >= 2 else 1
        return [numel // rows] * rows
    if scaling == "block":
        full, rest = divmod(numel, block_size)
        return [block_size] * full + ([rest] if rest else [])
    raise ValueError(f"unknown scaling {scaling!r}; expected one of {SCALINGS}")


@dataclass(frozen=True)
class FP8Codec(Codec):
    """How a tensor becomes FP8: the format and the scale granularity.

    Args:
        format: ``"e4m3"`` (more mantissa, max 448) or ``"e5m2"`` (more range, max 57344).
        scaling: ``"tensor"``, ``"row"`` or ``"block"`` (see :func:`group_lengths`).
        block_size: elements per scale group when ``scaling == "block"``.
    """

    format: str = "e4m3"
    scaling: str = "tensor"
    block_size: int = 128

    def __post_init__(self) -> None:
        if self.format not in FP8_FORMATS:
            raise ValueError(f"unknown FP8 format {self.format!r}; "
                             f"expected one of {list(FP8_FORMATS)}")
        if self.scaling not in SCALINGS:
            raise ValueError(f"unknown scaling {self.scaling!r}; expected one of {SCALINGS}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    @property
    def dtype(self) -> torch.dtype:
        return FP8_FORMATS[self.format]

    def segmentwise(self, lengths: Sequence[int]) -> bool:
        return True  # a scale per group (never across segments), a byte per element

    @property
    def fmax(self) -> float:
        return _FMAX[self.format]

    def groups(self, shape: tuple[int, ...]) -> list[int]:
        return group_lengths(tuple(shape), self.scaling, self.block_size)

    def part_bytes(self, segments: Segments) -> tuple[int, int]:
        """A float32 scale per group, then one code byte per element."""
        return (4 * sum(len(seg) for seg in segments), sum(sum(seg) for seg in segments))

    def encode_into(self, out: torch.Tensor, x: torch.Tensor, segments: Segments,
                    seed: int | None = None, overwrite: bool = False,
                    error: torch.Tensor | None = None) -> None:
        """``[scales][codes]`` of the flat ``x`` straight into ``out`` (no payload copy);
        ``error``: see :meth:`encode_with_error`."""
        lengths = [n for seg in segments for n in seg]
        n_groups = len(lengths)
        packed = self.quantize(x, lengths, out=out[4 * n_groups : 4 * n_groups + x.numel()],
                               overwrite=overwrite, error=error)
        out[: 4 * n_groups].copy_(packed.scales.view(torch.uint8))

    def fuses_error(self, *tensors: torch.Tensor) -> bool:
        """E4M3 on a CPU: the native kernel leaves the rounding error in its encoding pass."""
        return self.format == "e4m3" and native.usable(*tensors)

    def decode_into(self, out: torch.Tensor, buf: torch.Tensor, segments: Segments,
                    poison: bool = False) -> torch.Tensor | None:
        lengths = [n for seg in segments for n in seg]
        packed = Packed.from_bytes(buf, (sum(lengths),), self, lengths)  # scales: a copy
        finite = scales_flag(packed.scales, poison=poison)
        packed.dequantize(out=out)
        return finite

    def encode_shards(self, x: torch.Tensor, shards: Shards,
                      seeds=None) -> list[torch.Tensor]:
        """Every group's scale from one segmented amax, every code from one division by the
        per-element scale: the same values as :meth:`encode_into`, shard by shard."""
        groups = group_map(shards)
        if not groups.lengths:
            return [x.new_empty(0, dtype=torch.uint8)] * (2 * len(shards))
        scales, codes, _ = self._whole(x, groups, False)
        return self._parts(scales, codes, groups)

    def encode_shards_with_error(self, x: torch.Tensor, shards: Shards
                                 ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """With the fused kernels, the rounding error from the encoding pass (three kernels
        in all); else decoded back from the whole bucket's scales and codes."""
        groups = group_map(shards)
        if not groups.lengths:
            return super().encode_shards_with_error(x, groups)
        scales, codes, error = self._whole(x, groups, True)
        return self._parts(scales, codes, groups), error

    def encode_whole(self, x: torch.Tensor, shards: Shards, with_error: bool = False,
                     error_out: torch.Tensor | None = None
                     ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        groups = group_map(shards)
        if not groups.lengths:
            return super().encode_whole(x, groups, with_error, error_out)
        scales, codes, error = self._whole(x, groups, with_error, error_out)
        return [scales.view(torch.uint8), codes], error

    def _whole(self, x: torch.Tensor, groups: GroupMap, with_error: bool,
               error_out: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(scales, codes, the rounding error or None)`` of the whole bucket: two or three
        fused passes, else torch ops (the error decoded back from scales and codes, into
        ``error_out`` when given, see :meth:`Codec.encode_whole`)."""
        if triton_fp8.available(x):
            _, scales = triton_fp8.amax(x, groups, fmt=self.format)
            codes, error = triton_fp8.encode(x, scales, groups, error=with_error,
                                             fmt=self.format)
            return scales, codes, error
        scales = self.scales_from_amax(group_amax(x, groups))
        codes = group_fp8(x, scales, groups, self.dtype)
        if not with_error:
            return scales, codes, None
        error = torch.empty_like(x)
        self._values(error, scales, codes, groups)
        return scales, codes, torch.sub(x, error, out=error if error_out is None else error_out)

    def _parts(self, scales: torch.Tensor, codes: torch.Tensor,
               groups: GroupMap) -> list[torch.Tensor]:
        """Every shard's ``[scales][codes]`` parts, cut from the whole bucket's."""
        scale_bytes, code_bytes = groups.memo(self, lambda: tuple(
            zip(*(self.part_bytes(s) for s in groups))))
        return interleave(scales.view(torch.uint8).split(scale_bytes), codes.split(code_bytes))

    def decode_shards(self, out: torch.Tensor, parts, shards: Shards, check: bool = True,
                      poison: bool = False) -> torch.Tensor | None:
        wholes = joined_kinds(parts, (4, 1), fresh=(poison,))  # scales poisoned in place
        return self.decode_whole(out, wholes, shards, check, poison)

    def decode_whole(self, out: torch.Tensor, wholes, shards: Shards, check: bool = True,
                     poison: bool = False) -> torch.Tensor | None:
        scales = wholes[0].view(torch.float32)
        finite = scales_flag(scales, check, poison)
        self._values(out, scales, wholes[1], group_map(shards))
        return finite

    def _values(self, out: torch.Tensor, scales: torch.Tensor, codes: torch.Tensor,
                groups: GroupMap) -> None:
        """The FP32 values of the whole bucket's ``codes`` and ``scales`` into ``out``: one
        fused pass, else a conversion and a multiplication."""
        if triton_fp8.available(out):
            triton_fp8.decode(out, codes, scales, groups, self.format)
            return
        if self.format == "e4m3":
            e4m3_into(out, codes)
        else:
            out.copy_(codes.view(torch.float8_e5m2))
        group_mul_(out, scales, groups)

    def clipped_fraction(self, x: torch.Tensor) -> torch.Tensor:
        """Share of codes saturated at ``±fmax`` or flushed to zero from a non-zero value,
        read off the code bytes (``|code|`` is 0 or the largest finite code)."""
        magnitude = self.quantize(x).codes.bitwise_and(0x7F)
        flushed = ((magnitude == 0) & (x.reshape(-1) != 0)).sum()
        saturated = (magnitude == _MAX_CODE[self.format]).sum()
        return (flushed + saturated).double() / max(x.numel(), 1)

    def quantize(self, x: torch.Tensor, lengths: list[int] | None = None, *,
                 out: torch.Tensor | None = None, overwrite: bool = False,
                 error: torch.Tensor | None = None) -> Packed:
        """Encode ``x`` (fp32/bf16/fp16, any shape); ``lengths`` overrides the groups.

        ``out`` (optional): a contiguous uint8 buffer of ``x.numel()`` bytes that receives
        the codes (reuse it across steps to skip the allocation). ``overwrite``: an FP32
        ``x`` may be divided by its scales in place (its values are lost) rather than
        through a scratch vector; the same codes either way. ``error`` (E4M3 on a CPU with
        the native kernels only): an FP32 vector of ``x.numel()`` values that receives
        ``x − dequantize(codes)`` from the encoding pass.
        """
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise TypeError(f"GeoFP8 codecs take floating-point tensors, got {x.dtype}")
        if lengths is None:
            lengths = self.groups(tuple(x.shape))
        else:
            lengths = list(lengths)
            if sum(lengths) != x.numel():
                raise ValueError(f"group lengths sum to {sum(lengths)} but x has {x.numel()} "
                                 "elements")
        flat = x.reshape(-1)
        if flat.dtype != torch.float32:
            flat, overwrite = flat.float(), True  # a copy of our own
        info = _info(lengths)
        scales = self.scales_of(flat, lengths, info)
        if out is None:
            codes = torch.empty(flat.numel(), dtype=self.dtype, device=flat.device)
        elif out.dtype != torch.uint8 or out.numel() != flat.numel() or not out.is_contiguous():
            raise ValueError("out must be a contiguous uint8 tensor with one byte per element")
        else:
            codes = out.view(-1).view(self.dtype)
        if error is not None:
            if not self.fuses_error(codes, flat, error):
                raise ValueError("only E4M3's native CPU kernel leaves the rounding error")
            native.e4m3_encode(codes, flat, scales, tuple(lengths), error=error)
        else:
            _encode_into(codes, flat, scales, lengths, info, in_place=overwrite)
        return Packed(codes.view(torch.uint8), scales, tuple(x.shape), self, tuple(lengths))

    def scales_of(self, flat: torch.Tensor, lengths: list[int], info=None) -> torch.Tensor:
        """The float32 scale of every group of the flat fp32 tensor ``flat`` (policies above)."""
        return self.scales_from_amax(_group_amax(flat, lengths, info or _info(lengths)))

    def scales_from_amax(self, amax: torch.Tensor) -> torch.Tensor:
        """The float32 scales of groups with the given amax (NaN for a non-finite group)."""
        scales = exact_div(amax, self.fmax)
        # When amax / fmax rounds down (far, once it is an fp32 subnormal), amax / s exceeds
        # fmax and E5M2 overflows to inf: step such scales up one ulp (towards amax, which
        # is above them) so codes stay in range.
        scales = torch.where(amax / scales > self.fmax, torch.nextafter(scales, amax), scales)
        scales.masked_fill_(scales == 0, 1.0)  # an all-zero group
        # amax is never negative: only +Inf is left to mark (NaN stays NaN)
        return scales.nan_to_num_(nan=float("nan"), posinf=float("nan"))

    def round_trip(self, x: torch.Tensor, lengths: list[int] | None = None) -> torch.Tensor:
        """``dequantize(quantize(x))`` in fp32 — the codec's error model in one call."""
        return self.quantize(x, lengths).dequantize()


@dataclass
class Packed:
    """An FP8-encoded tensor: uint8 codes, float32 scales and the metadata to decode them."""

    codes: torch.Tensor  # uint8, numel
    scales: torch.Tensor  # float32, one per group
    shape: tuple[int, ...]
    codec: FP8Codec
    lengths: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + 4 * self.scales.numel()

    def dequantize(self, out_dtype: torch.dtype = torch.float32,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """``code * s_g`` for every element, shaped like the original tensor.

        ``out`` (optional, float32, contiguous, ``numel`` elements) receives the result
        and avoids allocating it; it is returned reshaped when ``out_dtype`` is float32.
        """
        numel = self.codes.numel()
        if out is None:
            out = torch.empty(numel, dtype=torch.float32, device=self.codes.device)
        elif out.dtype != torch.float32 or out.numel() != numel or not out.is_contiguous():
            raise ValueError("out must be a contiguous float32 tensor with one slot per code")
        _decode_into(out.view(-1), self.codes, self.scales, self.lengths, _info(self.lengths),
                     self.codec.format)
        values = out.view(self.shape)
        return values if out_dtype == torch.float32 else values.to(out_dtype)

    def to_bytes(self) -> torch.Tensor:
        """``[scales as float32 bytes][codes]`` as one flat uint8 tensor."""
        return torch.cat([self.scales.contiguous().view(torch.uint8), self.codes])

    @classmethod
    def from_bytes(
        cls, buf: torch.Tensor, shape: tuple[int, ...], codec: FP8Codec, lengths: list[int]
    ) -> Packed:
        n_groups, numel = len(lengths), sum(lengths)
        if buf.numel() < 4 * n_groups + numel:
            raise ValueError(f"buffer of {buf.numel()} bytes is too short for {n_groups} scales "
                             f"and {numel} codes")
        scales = buf[: 4 * n_groups].clone().view(torch.float32)
        codes = buf[4 * n_groups : 4 * n_groups + numel]
        return cls(codes, scales, tuple(shape), codec, tuple(lengths))


# -- kernels ---------------------------------------------------------------------------------
#
# The codec is memory-bound on a CPU, so every kernel below walks the tensor in pieces of
# at most ``CHUNK`` elements: the temporaries of a piece (the quotients torch casts to FP8,
# the decoder's lookup index) stay in cache, and each big tensor is read or written once.
# A shard's few groups of unequal lengths (a piece of each tensor of a bucket) are instead
# divided or scaled by one op for all of them (``torch._foreach_*``): on a CPU each op costs
# microseconds of dispatch, more than a small group's data. Division by the scale is kept
# (not a multiply by its reciprocal), so the codes are bit-identical to ``(x / s).to(fp8)``.

CHUNK = 1 << 18  # elements per piece; 1 MiB of fp32
_MAX_CODE = {"e4m3": 0x7E, "e5m2": 0x7B}  # the byte of +fmax (448, 57344) without its sign


def _uniform(lengths) -> int | None:
    """The common length when all groups but possibly the last short one are equal."""
    if not lengths:
        return None
    first, same = lengths[0], lengths.count(lengths[0])  # list.count runs at C speed
    if same == len(lengths) or (same == len(lengths) - 1 and lengths[-1] < first):
        return first
    return None


class _Info(NamedTuple):
    """What the kernels need to know about a list of group lengths, computed once."""

    size: int | None  # common length (all but a shorter last group), None if irregular
    irregular: bool  # many groups of differing lengths: use per-element scales
    widest: int  # longest group (0 if irregular and unknown)


def _info(lengths) -> _Info:
    size = _uniform(lengths)
    if size is not None:
        return _Info(size, False, size)
    if len(lengths) > MANY_GROUPS and sum(lengths) < LONG_GROUP * len(lengths):
        return _Info(None, True, 0)
    return _Info(None, False, max(lengths, default=0))


# Many irregular groups (more than MANY_GROUPS, shorter than LONG_GROUP elements on average)
# go through per-element scales: a loop would cost an op per group for little data each.
MANY_GROUPS = 256
LONG_GROUP = 4096


def _per_element(scales: torch.Tensor, lengths, numel: int) -> torch.Tensor:
    counts = torch.tensor(lengths, dtype=torch.long).to(scales.device)
    return torch.repeat_interleave(scales, counts, output_size=numel)


def _pieces(lengths, info: _Info, scales: torch.Tensor):
    """Yield ``(lo, hi, rows, scale)``: a slice ``[lo, hi)`` of the flat tensor and the scale
    that divides it, either one element (``rows == 0``) or a ``rows × 1`` column of scales for
    a ``rows × size`` view of the slice. Pieces hold at most ~``CHUNK`` elements."""
    size = info.size
    if size is not None and len(lengths) > 1:
        n_full = len(lengths) if lengths[-1] == size else len(lengths) - 1
        per = max(1, CHUNK // size)
        for g in range(0, n_full, per):
            h = min(g + per, n_full)
            yield g * size, h * size, h - g, scales[g:h, None]
        if n_full < len(lengths):
            lo = n_full * size
            yield from _slices(lo, lo + lengths[-1], scales[n_full:])
        return
    lo = 0
    for g, n in enumerate(lengths):
        yield from _slices(lo, lo + n, scales[g : g + 1])
        lo += n


def _slices(lo: int, hi: int, scale: torch.Tensor):
    for a in range(lo, hi, CHUNK):
        yield a, min(a + CHUNK, hi), 0, scale


def _group_amax(flat: torch.Tensor, lengths, info: _Info) -> torch.Tensor:
    """Max |x| of each contiguous group; a non-finite group's is NaN (amax / amin keep NaN)
    or, from the native kernel, +Inf: the same NaN scale either way.

    ``max(max x, −min x)`` reads the data without materialising ``|x|``.
    """
    if not lengths:
        return flat.new_zeros(0)
    if native.usable(flat):  # one pass of the CPU's native kernel (+Inf for NaN: same scale)
        return native.runs_amax(flat, native.length_runs(tuple(lengths)), len(lengths))
    size = info.size
    if size is not None and len(lengths) > 1:
        out = flat.new_empty(len(lengths))
        n_full = len(lengths) if lengths[-1] == size else len(lengths) - 1
        per = max(1, CHUNK // size)
        for g in range(0, n_full, per):
            h = min(g + per, n_full)
            view = flat[g * size : h * size].view(h - g, size)
            torch.amax(view, dim=1, out=out[g:h])
            out[g:h] = torch.maximum(out[g:h], torch.amin(view, dim=1).neg_())
        if n_full < len(lengths):
            out[n_full:] = _amax1(flat[n_full * size :])
        return out
    if not info.irregular:  # few groups (per tensor, per shard): one fused pass each
        if len(lengths) == 1:
            return _amax1(flat).reshape(1)
        extremes = [torch.aminmax(v) for v in flat.split(list(lengths))]  # groups are not empty
        lowest = torch.stack([lo for lo, _ in extremes])
        return torch.maximum(torch.stack([hi for _, hi in extremes]), lowest.neg_())
    return segment_amax(flat, torch.tensor(lengths, dtype=torch.long).to(flat.device))


def _amax1(x: torch.Tensor) -> torch.Tensor:
    if x.numel() == 0:
        return x.new_zeros(())
    lo, hi = torch.aminmax(x)
    return torch.maximum(hi, lo.neg())


def _encode_into(codes: torch.Tensor, flat: torch.Tensor, scales: torch.Tensor,
                 lengths, info: _Info, in_place: bool = False) -> None:
    """``codes[i] = fp8(flat[i] / s_g)`` piece by piece, each quotient cast in the division's
    kernel (through a piece-sized buffer of torch's on a CPU). ``in_place`` (``flat``'s values
    may be lost): many irregular groups are divided by a per-element divisor, a few of
    different lengths each by its scale in one op, both in ``flat``, then cast at once.
    E4M3 on a CPU: one pass of the native kernel (:mod:`.native`) where it is built."""
    if codes.dtype == torch.float8_e4m3fn and native.usable(codes, flat):
        native.e4m3_encode(codes, flat, scales, tuple(lengths))
        return
    if info.irregular:
        per_element = _per_element(scales, lengths, flat.numel())
        codes.copy_(flat.div_(per_element) if in_place else flat / per_element)
        return
    if in_place and info.size is None and lengths:
        torch._foreach_div_(list(flat.split(list(lengths))), list(scales.split(1)))
        codes.copy_(flat)
        return
    for lo, hi, rows, s in _pieces(lengths, info, scales):
        if rows:
            torch.div(flat[lo:hi].view(rows, -1), s, out=codes[lo:hi].view(rows, -1))
        else:
            torch.div(flat[lo:hi], s, out=codes[lo:hi])


@functools.cache
def e4m3_table(device: torch.device) -> torch.Tensor:
    """The FP32 value of every E4M3 byte (NaN for ``S.1111.111``) on ``device``: torch's own
    (exact, but slow on a CPU) conversion, done once for the 256 codes."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    return codes.view(torch.float8_e4m3fn).float().to(device)


LOOKUP_PIECE = 1 << 16  # codes per lookup on a CPU: a 256 KB index (as fast as 1 MB's)
DEVICE_PIECE = 1 << 22  # codes per lookup off the CPU: a 16 MB index, one gather per DDP bucket


def e4m3_into(out: torch.Tensor, codes: torch.Tensor) -> None:
    """``out[i]`` = the FP32 value of the E4M3 byte ``codes[i]`` (exact either way): on a CPU
    a lookup in :func:`e4m3_table`; elsewhere torch's own conversion, one kernel and no
    index tensor."""
    if codes.device.type == "cpu":
        lookup_into(out, e4m3_table(codes.device), codes.view(torch.uint8))
    else:
        out.copy_(codes.view(torch.float8_e4m3fn))


def e4m3_values(codes: torch.Tensor) -> torch.Tensor:
    """The FP32 values of the 1-D E4M3 ``codes`` (uint8 or ``float8_e4m3fn``) as a new
    tensor, through :func:`e4m3_into` (on a CPU 6× faster than ``codes.float()``)."""
    out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    e4m3_into(out, codes)
    return out


def lookup_into(out: torch.Tensor, table: torch.Tensor, codes: torch.Tensor) -> None:
    """``out[i] = table[codes[i]]`` for uint8 ``codes``, through an int32 index of at most a
    piece of the codes: cache-sized on a CPU (:data:`LOOKUP_PIECE`), :data:`DEVICE_PIECE`
    elsewhere (a fixed number of kernels for buckets up to that size, the index's memory
    bounded)."""
    n = codes.numel()
    piece = LOOKUP_PIECE if codes.device.type == "cpu" else DEVICE_PIECE
    index = torch.empty(min(piece, n) or 1, dtype=torch.int32, device=codes.device)
    for lo in range(0, n, piece):
        hi = min(lo + piece, n)
        i = index[: hi - lo]
        i.copy_(codes[lo:hi])
        torch.index_select(table, 0, i, out=out[lo:hi])


def _decode_into(out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                 lengths, info: _Info, fmt: str) -> None:
    """``out[i] = value(code_i) · s_g``.

    E5M2 is the top byte of an IEEE half, and torch converts it fast; off a CPU torch
    converts E4M3 fast too. On a CPU E4M3 is one pass of the native kernel (:mod:`.native`)
    where it is built, else a lookup in the 256-entry value table; a piece with one scale
    looks its codes up in the table times that scale (the same FP32 product ``value · s``,
    in one pass).
    """
    u8 = codes.view(torch.uint8)
    if fmt == "e4m3" and native.usable(u8, out):
        native.e4m3_decode(out, u8, scales, tuple(lengths))
        return
    table = e4m3_table(codes.device) if fmt == "e4m3" and codes.device.type == "cpu" else None
    typed = codes.view(FP8_FORMATS[fmt])
    if info.irregular:
        if table is None:
            out.copy_(typed)
        else:
            lookup_into(out, table, u8)
        out.mul_(_per_element(scales, lengths, out.numel()))
        return
    if info.size is None and lengths:  # a few groups of unequal lengths: convert, then scale
        if table is None:
            out.copy_(typed)
        else:
            lookup_into(out, table, u8)
        torch._foreach_mul_(list(out.split(list(lengths))), list(scales.split(1)))
        return
    if table is None:
        for lo, hi, rows, s in _pieces(lengths, info, scales):
            o = out[lo:hi]
            o.copy_(typed[lo:hi])
            (o.view(rows, -1) if rows else o).mul_(s)
        return
    for lo, hi, rows, s in _pieces(lengths, info, scales):
        o = out[lo:hi]
        if rows:
            lookup_into(o, table, u8[lo:hi])
            o.view(rows, -1).mul_(s)
        else:
            lookup_into(o, table * s, u8[lo:hi])
