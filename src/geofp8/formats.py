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

Wire layout of :class:`Packed` (:meth:`Packed.to_bytes`), little-endian:
``[scales: G × float32][codes: numel × uint8]``. The receiver must know
``numel`` and the group lengths, which both sides derive from shared metadata
(shape and :class:`Codec`), so nothing else travels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["FORMATS", "Codec", "Packed", "group_lengths"]

FORMATS: dict[str, torch.dtype] = {
    "e4m3": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
}
SCALINGS = ("tensor", "row", "block")


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
class Codec:
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
        if self.format not in FORMATS:
            raise ValueError(f"unknown FP8 format {self.format!r}; expected one of {list(FORMATS)}")
        if self.scaling not in SCALINGS:
            raise ValueError(f"unknown scaling {self.scaling!r}; expected one of {SCALINGS}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    @property
    def dtype(self) -> torch.dtype:
        return FORMATS[self.format]

    @property
    def fmax(self) -> float:
        return float(torch.finfo(self.dtype).max)

    def lengths(self, shape: tuple[int, ...]) -> list[int]:
        return group_lengths(tuple(shape), self.scaling, self.block_size)

    def bytes_per_element(self, shape: tuple[int, ...]) -> float:
        """Wire bytes per element: 1 code byte plus 4 bytes per scale group."""
        numel = max(1, int(torch.Size(shape).numel()))
        return (numel + 4 * len(self.lengths(shape))) / numel

    def quantize(self, x: torch.Tensor, lengths: list[int] | None = None) -> Packed:
        """Encode ``x`` (fp32/bf16/fp16, any shape); ``lengths`` overrides the groups."""
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise TypeError(f"GeoFP8 codecs take floating-point tensors, got {x.dtype}")
        lengths = self.lengths(tuple(x.shape)) if lengths is None else list(lengths)
        if sum(lengths) != x.numel():
            raise ValueError(f"group lengths sum to {sum(lengths)} but x has {x.numel()} elements")
        flat = x.reshape(-1).float()
        scales = _group_amax(flat, lengths).div_(self.fmax)
        scales = torch.where(scales == 0, torch.ones_like(scales), scales)  # all-zero group
        scales = torch.where(torch.isfinite(scales), scales, torch.full_like(scales, float("nan")))
        codes = _per_group(flat, scales, lengths, torch.div).to(self.dtype)
        return Packed(codes.view(torch.uint8), scales, tuple(x.shape), self, tuple(lengths))

    def dequantize(self, packed: Packed, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return packed.dequantize(out_dtype)

    def round_trip(self, x: torch.Tensor, lengths: list[int] | None = None) -> torch.Tensor:
        """``dequantize(quantize(x))`` in fp32 — the codec's error model in one call."""
        return self.quantize(x, lengths).dequantize()


@dataclass
class Packed:
    """An FP8-encoded tensor: uint8 codes, float32 scales and the metadata to decode them."""

    codes: torch.Tensor  # uint8, numel
    scales: torch.Tensor  # float32, one per group
    shape: tuple[int, ...]
    codec: Codec
    lengths: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + 4 * self.scales.numel()

    def dequantize(self, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        values = self.codes.view(self.codec.dtype).float()
        values = _per_group(values, self.scales, list(self.lengths), torch.mul)
        return values.reshape(self.shape).to(out_dtype)

    def to_bytes(self) -> torch.Tensor:
        """``[scales as float32 bytes][codes]`` as one flat uint8 tensor."""
        return torch.cat([self.scales.contiguous().view(torch.uint8), self.codes])

    @classmethod
    def from_bytes(
        cls, buf: torch.Tensor, shape: tuple[int, ...], codec: Codec, lengths: list[int]
    ) -> Packed:
        n_groups, numel = len(lengths), sum(lengths)
        if buf.numel() < 4 * n_groups + numel:
            raise ValueError(f"buffer of {buf.numel()} bytes is too short for {n_groups} scales "
                             f"and {numel} codes")
        scales = buf[: 4 * n_groups].clone().view(torch.float32)
        codes = buf[4 * n_groups : 4 * n_groups + numel]
        return cls(codes, scales, tuple(shape), codec, tuple(lengths))


def _uniform(lengths: list[int]) -> int | None:
    """The common length when all groups but possibly the last short one are equal."""
    if not lengths:
        return None
    first = lengths[0]
    if all(n == first for n in lengths[:-1]) and lengths[-1] <= first:
        return first
    return None


def _group_amax(flat: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Max |x| of each contiguous group; NaN propagates (torch.amax keeps NaN)."""
    if not lengths:
        return flat.new_zeros(0)
    size = _uniform(lengths)
    if size is not None:
        full = (len(lengths) - 1) * size if lengths[-1] < size else len(lengths) * size
        parts = [flat[:full].abs().reshape(-1, size).amax(dim=1)] if full else []
        if full < flat.numel():
            parts.append(flat[full:].abs().amax().reshape(1))
        return torch.cat(parts) if len(parts) > 1 else parts[0]
    lens = torch.tensor(lengths, dtype=torch.long)
    amax = torch.segment_reduce(flat.abs(), "max", lengths=lens, unsafe=True)
    # segment_reduce drops NaN in max on some builds: restore the policy explicitly.
    bad = torch.segment_reduce((~torch.isfinite(flat)).float(), "max", lengths=lens, unsafe=True)
    return torch.where(bad > 0, torch.full_like(amax, float("nan")), amax)


def _per_group(flat: torch.Tensor, scales: torch.Tensor, lengths: list[int], op) -> torch.Tensor:
    """``op(x, s_g)`` for every element of every group, without materialising per-element scales
    when the groups are uniform."""
    if len(lengths) <= 1:
        return op(flat, scales) if lengths else flat.clone()
    size = _uniform(lengths)
    if size is None:
        per_elem = torch.repeat_interleave(scales, torch.tensor(lengths, dtype=torch.long),
                                           output_size=flat.numel())
        return op(flat, per_elem)
    n_full = len(lengths) if lengths[-1] == size else len(lengths) - 1
    head = op(flat[: n_full * size].view(n_full, size), scales[:n_full, None]).view(-1)
    if n_full == len(lengths):
        return head
    return torch.cat([head, op(flat[n_full * size :], scales[n_full:])])
