"""The codec interface: how one shard of a flat FP32 vector becomes bytes and back.

A *shard* is a list of *segments* (contiguous chunks of different tensors); each segment is
cut into contiguous *scale groups* (:meth:`Codec.groups` of its tensor, cut where the shard
boundary falls). A codec turns the FP32 values of a shard into exactly
:meth:`Codec.payload_bytes` bytes and back; both sides derive the group lengths from shared
metadata (the tensors' shapes and the codec), so nothing else travels. Formats need not use
one byte per element (4-bit codes pack two to a byte).

Policies every codec follows:

* an all-zero group decodes to exact zeros;
* a group containing NaN or ±Inf decodes to NaN as a whole, and :meth:`Codec.decode_into`
  reports it (a device flag, ``False``) so the caller can poison the whole result on the
  device, without reading the flag on the host.
"""

from __future__ import annotations

import functools
import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from .groups import GroupMap, group_map

__all__ = ["Codec", "GroupMap", "Segments", "Shards", "device_scalar", "exact_div",
           "finite_flag", "group_amax", "group_div", "group_fp8", "group_map", "group_mul_",
           "group_runs", "interleave", "joined", "joined_kinds", "mix_seed", "rows_amax",
           "segment_amax"]

Segments = Sequence[Sequence[int]]  # per segment of a shard: its scale-group lengths
Shards = Sequence[Segments]  # several shards, one after the other
_MASK64 = (1 << 64) - 1


def mix_seed(*values: int) -> int:
    """A 63-bit seed from integers (splitmix64 finaliser over each in turn): distinct inputs
    give unrelated streams, identical inputs the same one on every rank."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (int(v) & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & _MASK64
        h ^= h >> 29
    return h >> 1


def group_runs(segments: Segments) -> list[tuple[int, int, int, int]]:
    """``(first element, first group, groups, group length)`` of every run of equal-length
    groups: a segment's groups are ``[head?, b, …, b, tail?]`` (a tensor's blocks cut at the
    shard boundaries), so a shard has at most three runs per segment."""
    runs: list[tuple[int, int, int, int]] = []
    lo = g = 0

    def add(count: int, size: int) -> None:
        nonlocal lo, g
        if runs and runs[-1][3] == size and runs[-1][0] + runs[-1][2] * size == lo:
            first, g0, n, _ = runs[-1]
            runs[-1] = (first, g0, n + count, size)
        else:
            runs.append((lo, g, count, size))
        lo += count * size
        g += count

    for seg in segments:
        k = len(seg)
        body = seg[1] if k > 2 else None
        # the body is uniform: one C-speed count over the segment, no copy of it
        if k > 2 and seg.count(body) - (seg[0] == body) - (seg[-1] == body) == k - 2:
            add(1, seg[0])
            add(k - 2, body)
            add(1, seg[-1])
        else:
            for n in seg:
                add(1, n)
    return runs


def segment_amax(flat: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Max ``|x|`` of every contiguous group of the given (device) ``lengths``; NaN for a
    group holding NaN or ±Inf. Exact, so equal to any other way of taking it."""
    amax = torch.segment_reduce(flat.abs(), "max", lengths=lengths, unsafe=True)
    # segment_reduce's max keeps NaN (the CPU's and CUDA's kernels test each value with
    # _isnan), so a group's max is NaN or +Inf exactly when it holds NaN or ±Inf; adding
    # 0·amax (+0 for a finite amax ≥ 0, NaN for +Inf) makes it NaN, amax itself otherwise.
    return amax.add_(amax, alpha=0)


def rows_amax(v: torch.Tensor) -> torch.Tensor:
    """Max ``|v|`` of every row (NaN propagates). Off a CPU one reduction (the ∞-norm); on a
    CPU long rows ``|max(max v, −min v)|`` (no ``|v|`` temporary), short ones a halving tree
    of element-wise maxima when a power of two (torch's reductions over short rows are
    slow), else ``amax``. Exact, so the same values either way."""
    if v.device.type != "cpu":  # one kernel (on a CPU 2-8x slower than the passes below)
        return torch.linalg.vector_norm(v, float("inf"), dim=1)
    size = v.shape[1]
    if size > 64:
        # (two reductions beat aminmax over a dim on a CPU); abs: +0 for a row of -0
        return torch.maximum(v.amax(1), v.amin(1).neg_()).abs_()
    a = v.abs()
    if size & (size - 1):
        return a.amax(1)
    while size > 1:
        size //= 2
        a = torch.maximum(a[:, :size], a[:, size:])
    return a[:, 0]


def group_amax(flat: torch.Tensor, groups: GroupMap) -> torch.Tensor:
    """Max ``|x|`` of every contiguous group of ``groups`` (exact); non-finite (NaN or +Inf)
    for a group holding NaN or ±Inf. Equal groups: one ``[G, size]`` reduction; else
    segmented."""
    size = groups.common
    if size is not None:
        return rows_amax(flat.view(-1, size))
    return segment_amax(flat, groups.on("lengths", flat.device))


def _per_element(values: torch.Tensor, groups: GroupMap, numel: int) -> torch.Tensor:
    return torch.repeat_interleave(values, groups.on("lengths", values.device),
                                   output_size=numel)


def group_div(x: torch.Tensor, divisor: torch.Tensor, groups: GroupMap,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """``x_i / divisor_g`` for every element ``i`` of group ``g`` (a new tensor, or ``out``:
    an FP8 ``out`` receives the quotients cast as ``.to()`` casts them, in the same kernel):
    broadcast over ``[G, size]`` when the groups are equal, else through a per-element
    divisor."""
    size = groups.common
    if size is not None:
        q = None if out is None else out.view(-1, size)
        return torch.div(x.view(-1, size), divisor[:, None], out=q).view(-1)
    d = _per_element(divisor, groups, x.numel())
    return torch.div(x, d, out=d if out is None else out)


def group_fp8(x: torch.Tensor, divisor: torch.Tensor, groups: GroupMap,
              dtype: torch.dtype) -> torch.Tensor:
    """The FP8 ``dtype`` codes (uint8) of ``x_i / divisor_g`` (:func:`group_div`), cast as
    ``.to(dtype)`` casts them in the division's own kernel: no FP32 quotient."""
    codes = torch.empty(x.numel(), dtype=dtype, device=x.device)
    group_div(x, divisor, groups, out=codes)
    return codes.view(torch.uint8)


def group_mul_(out: torch.Tensor, scale: torch.Tensor, groups: GroupMap) -> None:
    """``out_i ·= scale_g`` for every element ``i`` of group ``g`` (as :func:`group_div`)."""
    size = groups.common
    if size is not None:
        out.view(-1, size).mul_(scale[:, None])
    else:
        out.mul_(_per_element(scale, groups, out.numel()))


def joined(parts: Sequence[torch.Tensor], fresh: bool = False, align: int = 1) -> torch.Tensor:
    """The 1-D ``parts`` back to back in one tensor: a view, no copy, when they already lie
    back to back in one tensor (the parts of one :meth:`Codec.encode_shards` call, in their
    order), starting at a multiple of ``align`` elements (bytes a wider dtype's view needs)
    and not ``fresh`` (the caller writes into the result); else ``torch.cat``."""
    view = None if fresh else _back_to_back(parts, align)
    return view if view is not None else torch.cat(list(parts))


def joined_kinds(parts: Sequence[torch.Tensor], aligns: Sequence[int],
                 fresh: Sequence[bool] = ()) -> list[torch.Tensor]:
    """Each kind of the per-shard ``parts`` (``[a₀, b₀, …, a₁, b₁, …]``, ``len(aligns)``
    kinds) back to back, as :func:`joined` makes each: the kinds that are not already views
    are made by one ``cat`` of all their parts, kind after kind, then cut (one kernel, not
    one per kind; the first of them starts the new tensor, so its ``align`` holds)."""
    k = len(aligns)
    fresh = tuple(fresh) + (False,) * (k - len(fresh))
    kinds = [parts[p::k] for p in range(k)]
    out = [None if f else _back_to_back(kind, a) for kind, a, f in zip(kinds, aligns, fresh)]
    missing = [p for p in range(k) if out[p] is None]
    if len(missing) == 1:
        out[missing[0]] = torch.cat(list(kinds[missing[0]]))
    elif missing:
        whole = torch.cat(list(itertools.chain.from_iterable(kinds[p] for p in missing)))
        sizes = [sum(map(torch.Tensor.numel, kinds[p])) for p in missing]  # no Python per part
        for p, piece in zip(missing, whole.split(sizes)):
            out[p] = piece
    return out


def _back_to_back(parts: Sequence[torch.Tensor], align: int) -> torch.Tensor | None:
    """``parts`` as one view when they lie back to back in one tensor from a multiple of
    ``align`` elements (:func:`joined`), else ``None``."""
    first = parts[0]
    base, end = first._base, first.storage_offset()
    if base is None or end % align:
        return None
    for p in parts:
        if (p._base is not base or p.dtype != first.dtype or p.storage_offset() != end
                or p.dim() != 1 or (p.numel() > 1 and p.stride(0) != 1)):
            return None
        end += p.numel()
    return first.as_strided((end - first.storage_offset(),), (1,))


def interleave(*kinds: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per-shard parts from per-kind lists: ``[a₀, b₀, a₁, b₁, …]`` from ``[a…], [b…]``."""
    return list(itertools.chain.from_iterable(zip(*kinds)))  # no Python per shard


def finite_flag(t: torch.Tensor) -> torch.Tensor:
    """The 0-dim bool device flag "every element of the small ``t`` is finite" (``True`` for
    none) in three kernels: ``t·0`` is ``±0`` for a finite element and NaN otherwise, so
    their sum is 0 exactly when all are finite (``isfinite(t).all()`` takes five)."""
    return t.mul(0).sum().eq(0)


def poison_scales_(scales: torch.Tensor) -> None:
    """``scales`` in place, all NaN unless every one is finite, so that every value they
    decode is NaN then (:func:`finite_flag` folded into the scales: no pass over the decoded
    values). ``s + 0·max(s)`` is ``s + 0 = s`` when all are finite (scales are never ``-0``;
    the maximum propagates NaN and never overflows) and NaN otherwise; two kernels."""
    scales.add_(scales.amax(), alpha=0)


def scales_flag(scales: torch.Tensor, check: bool = True,
                poison: bool = False) -> torch.Tensor | None:
    """What a decode returns about its ``scales``, taken before they multiply: with
    ``poison``, ``None`` and the scales poisoned in place (:func:`poison_scales_`); else their
    :func:`finite_flag`, or ``None`` without ``check``."""
    if poison:
        poison_scales_(scales)
        return None
    return finite_flag(scales) if check else None


@functools.lru_cache(maxsize=4096)
def shape_map(codec: Codec, shape: tuple[int, ...]) -> GroupMap:
    """The one-shard :class:`GroupMap` of a whole tensor of ``shape`` under ``codec``, made
    once per shape (keyed by the shape, a few integers: never by group lengths)."""
    return GroupMap([[codec.groups(shape)]])


def exact_div(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """``x / divisor`` correctly rounded on every device. CUDA evaluates a division by a
    Python (CPU) scalar as ``x · fl(1/divisor)``, up to one ulp off the CPU's quotient; a
    divisor held on ``x``'s device (:func:`device_scalar`) is divided exactly there, as on
    the CPU."""
    return x / device_scalar(divisor, x.dtype, x.device)


@functools.cache
def device_scalar(value: float | tuple[float, ...], dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """``value`` as a 0-dim ``dtype`` tensor on ``device`` (a tuple of numbers: a 1-D one,
    e.g. the offsets of a segmented reduction), made once per value (a blocking
    copy from the host, in place when it returns) and never written: an operand that costs
    no fill kernel per call (``new_full``, or a Python scalar in ``torch.where``, launch one
    each time)."""
    return torch.tensor(value, dtype=dtype).to(device)


class Codec(ABC):
    """One wire format. Subclasses are small frozen dataclasses registered by name in
    :data:`geofp8.codecs.FORMATS`."""

    format: str
    block_size: int  # elements per scale block (FP8: of scaling="block"; the rht block)

    def segmentwise(self, lengths: Sequence[int]) -> bool:
        """Whether a shard whose segments hold ``lengths`` elements has, part by part, the
        payload of each segment encoded alone, back to back (no scale, packed byte or random
        stream shared by two segments). Then a layout encodes and decodes a whole bucket in
        its flat order and reorders bytes rather than FP32 values
        (:meth:`ShardLayout.encode_pieces`)."""
        return False

    @abstractmethod
    def groups(self, shape: tuple[int, ...]) -> list[int]:
        """Scale-group lengths of a whole row-major tensor of ``shape`` (contiguous runs)."""

    @abstractmethod
    def part_bytes(self, segments: Segments) -> tuple[int, ...]:
        """Bytes of each part of one encoded shard (scales, codes, …) in wire order."""

    def payload_bytes(self, segments: Segments) -> int:
        """Exact bytes of one encoded shard (codes and scales)."""
        return sum(self.part_bytes(segments))

    @abstractmethod
    def encode_into(self, out: torch.Tensor, x: torch.Tensor, segments: Segments,
                    seed: int | None = None, overwrite: bool = False) -> None:
        """Encode the flat FP32 ``x`` (``Σ`` group lengths elements) into the uint8 ``out``
        (``payload_bytes(segments)`` bytes). ``seed``: for stochastic rounding, identical on
        every rank for a given step and tensor; ignored by round-to-nearest codecs.
        ``overwrite``: ``x`` is a temporary whose values may be lost: the codec divides it
        by its scales in place instead of into new FP32 pieces or a scratch vector."""

    @abstractmethod
    def decode_into(self, out: torch.Tensor, buf: torch.Tensor, segments: Segments,
                    poison: bool = False) -> torch.Tensor | None:
        """Decode ``buf`` into the flat FP32 ``out``; returns a 0-dim bool tensor on ``buf``'s
        device, ``False`` if any scale is non-finite (no host sync: the caller poisons on the
        device with it). ``poison``: instead, every value is NaN unless every scale is finite
        (:func:`poison_scales_`, no pass over ``out``), and ``None`` is returned."""

    def fuses_error(self, *tensors: torch.Tensor) -> bool:
        """Whether :meth:`encode_into` takes an ``error`` vector for these tensors: kernels
        that leave the rounding error from the encoding pass itself (none by default)."""
        return False

    def encode_with_error(self, out: torch.Tensor, error: torch.Tensor, x: torch.Tensor,
                          segments: Segments) -> None:
        """:meth:`encode_into` (round to nearest) and ``error = x − decode(out)``, the FP32
        rounding error (``x``'s size): from the encoding pass where :meth:`fuses_error`, else
        by decoding ``out`` back (the same bits)."""
        if self.fuses_error(out, error, x):
            self.encode_into(out, x, segments, error=error)
            return
        self.encode_into(out, x, segments)
        self.decode_into(error, out, segments)
        torch.sub(x, error, out=error)

    @abstractmethod
    def encode_shards(self, x: torch.Tensor, shards: Shards,
                      seeds: Sequence[int | None]) -> list[torch.Tensor]:
        """Encode the flat FP32 ``x`` holding ``shards`` one after the other, each with its
        own scales and ``seeds[i]``, in a number of kernels that does not grow with the
        number of shards (``shards``: a :class:`GroupMap` that a layout keeps, whose derived
        values are made once, or any nested sequence). Returns every shard's parts in order
        (shard 0's
        :meth:`part_bytes`, then shard 1's, …); their concatenation is, shard by shard, the
        payload :meth:`encode_into` writes."""

    def encode_shards_with_error(self, x: torch.Tensor, shards: Shards
                                 ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """``(parts, error)``: :meth:`encode_shards` (round to nearest, no seeds) and the FP32
        rounding error ``x − decode(parts)``, a new vector: by decoding the parts back (the
        same bits), unless a codec's kernels leave it from the encoding pass."""
        parts = self.encode_shards(x, shards, [None] * len(shards))
        error = torch.empty_like(x)
        self.decode_shards(error, parts, shards, check=False)
        return parts, torch.sub(x, error, out=error)

    def encode_whole(self, x: torch.Tensor, shards: Shards, with_error: bool = False,
                     error_out: torch.Tensor | None = None
                     ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """``(wholes, error)``: :meth:`encode_shards` (round to nearest, no seeds) with each
        kind of part whole, ``wholes[p]`` (uint8) holding part ``p`` of shard 0, of shard
        1, … back to back; ``with_error``, the rounding error as
        :meth:`encode_shards_with_error` leaves it (else ``None``). ``error_out``: an FP32
        vector of ``x``'s size (``x`` itself included) that a codec's torch ops may write
        the error into, returned then (no copy of a new one; where it is not returned, the
        caller copies). The codecs make the wholes directly; this default joins
        :meth:`encode_shards`' parts."""
        groups = group_map(shards)
        if with_error:
            parts, error = self.encode_shards_with_error(x, groups)
        else:
            parts, error = self.encode_shards(x, groups, [None] * len(groups)), None
        k = len(parts) // len(groups) if groups else 0
        return [joined(parts[p::k]).view(torch.uint8) for p in range(k)], error

    def decode_whole(self, out: torch.Tensor, wholes: Sequence[torch.Tensor], shards: Shards,
                     check: bool = True, poison: bool = False) -> torch.Tensor | None:
        """:meth:`decode_shards` of the parts as :meth:`encode_whole` returns them, each a
        contiguous temporary the codec may overwrite. This default cuts them into parts."""
        groups = group_map(shards)
        sizes = groups.memo(("part bytes", self), lambda: tuple(
            zip(*(self.part_bytes(g) for g in groups))))
        return self.decode_shards(out, interleave(*(w.split(n) for w, n in zip(wholes, sizes))),
                                  groups, check, poison)

    @abstractmethod
    def decode_shards(self, out: torch.Tensor, parts: Sequence[torch.Tensor],
                      shards: Shards, check: bool = True,
                      poison: bool = False) -> torch.Tensor | None:
        """Decode ``parts`` (as :meth:`encode_shards` returns them) into the flat FP32
        ``out`` (the shards' values one after the other), in a number of kernels that does
        not grow with the number of shards; returns a 0-dim bool device tensor, ``False`` if
        any scale is non-finite (``None`` without ``check``: its kernels are skipped).
        ``poison``: as :meth:`decode_into`'s (returns ``None``)."""

    def clipped_fraction(self, x: torch.Tensor) -> torch.Tensor:
        """Share of the elements of ``x`` that the codec saturates at its largest code or
        flushes to zero (the paper's per-layer vulnerability score): a 0-dim float64 tensor
        on ``x``'s device (nothing is read back to the host)."""
        raise NotImplementedError(f"{type(self).__name__} has no clipped-fraction score")

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """``decode(encode(x))`` of a whole tensor, shaped like ``x`` (FP32): the codec's
        error model in one call. Off a CPU through the batched kernels and the shape's
        :class:`GroupMap` (made once per shape: nothing copied to the device per call)."""
        flat = x.detach().reshape(-1).float()
        out = torch.empty_like(flat)
        if x.device.type != "cpu":
            groups = shape_map(self, tuple(x.shape))
            self.decode_shards(out, self.encode_shards(flat, groups, [None]), groups,
                               check=False)
            return out.view(x.shape)
        segments = [self.groups(tuple(x.shape))]
        buf = torch.empty(self.payload_bytes(segments), dtype=torch.uint8, device=x.device)
        self.encode_into(buf, flat, segments)
        self.decode_into(out, buf, segments)
        return out.view(x.shape)

    def bytes_per_element(self, shape: tuple[int, ...]) -> float:
        """Wire bytes per element of a whole tensor of ``shape``, scales included."""
        numel = max(1, int(torch.Size(shape).numel()))
        return self.payload_bytes([self.groups(tuple(shape))]) / numel
