"""Fused Triton kernels of the FP8 codec's batched path, bit for bit the torch reference's.

The torch reference (:meth:`~.fp8.FP8Codec.encode_shards` / ``decode_shards`` and the
stages around them) takes a dozen kernels per stage; these take one pass each:

* :func:`amax` — ``u = x (+ r)`` (the error feedback add, ``u`` written when ``r`` is given)
  and the max ``|u|`` of every scale group, one pass; then the groups' FP32 scales
  ``s = amax / fmax`` (448 for E4M3, 57344 for E5M2) with the reference's policies
  (:meth:`~.fp8.FP8Codec.scales_from_amax`), one tiny pass over the groups;
* :func:`encode` — ``code = fp8(u / s_g)`` and, optionally, the sender's rounding error
  ``u − value(code)·s_g``, one pass;
* :func:`decode` — ``value(code)·s_g``, one pass; :func:`decode_sum` — the ``N`` senders'
  copies of a shard decoded and summed in FP32 in sender order, one pass.

The exact collective's stages (:mod:`geofp8.comm.stages`, placed and bound to their
launches, :class:`Launch`, by :class:`geofp8.comm.plan.FP8Stages`) take the *placed*
kernels, five per bucket: ``_amax_kernel`` then ``_encode_placed_kernel``
(scales and codes written where they travel, the rounding error at the values' places);
``_reduce_kernel`` (the ``N`` received records decoded, summed sender after sender from
+0, and the sum's amax) then ``_encode_placed_kernel`` (into the padded record; a
reduce-scatter ends with the reduction alone, ``SCATTER``: no amax, the sum divided and
written where the caller says, and its finite flag decided by the ticket, below);
``_decode_placed_kernel`` (the decode, ``/ N``, all NaN unless every gathered scale is
finite, and that flag: below). The sender's
pair takes a bucket's error feedback ``(R, keep)``: both read ``Ũ = G + where(keep, R,
0)`` (``R`` FP32 or BF16, ``keep`` a 0-dim device flag read in the kernel) and the encode
writes the new residual into ``R`` (BF16: rounded to nearest even on the bits, as torch's
``.to(torch.bfloat16)``). :func:`verdict`: a step's units' finite flags reduced, in one
program, into its verdict and its skipped-step counter; :func:`agreed`: the same from the
counts of ranks whose flag is down, with the units' poison factors (1 or NaN).

The groups come as a *tile map* (:func:`tiles`, :func:`placed_tiles`), an int64 ``[T, 7]``
device tensor made once per map: each tile is at most ``TILE`` elements of one run of
equal-length groups of one segment, ``(first element, end, first group of the run, group
length, first element of the run, byte of that element's code, byte of the run's first
scale)``, so an element's group is ``g₀ + (i − run start) // length``, its code at
``code₀ + (i − run start)`` and its group's FP32 scale at ``scale₀ + 4·(g − g₀)`` (any
alignment: read and written byte by byte). The kernels import nothing above ``codecs`` and
take every map as a tensor.

Amax slots: a group's ``max |u|`` is an atomic max on the magnitudes' bits (exact and
order-free) into an int64 slot whose high word is the call's *epoch*
(:class:`AmaxSlots`): every value of a new call beats every slot of an earlier one, so a
layout's slots are zeroed once, not by a launch per call.

The gathered decode decides its own finite flag with a *ticket*, as
:mod:`.triton_map`'s map kernel does: each program checks the scales it reads (exponent all
ones, over its elements' groups), stores its values, and adds ``1 + 2³² · [a scale it read
is not finite]`` to an int64 ticket (one atomic); the program that finds ``P − 1`` counted
before it is the last: it reads the others' verdicts in the high word, writes the flag,
zeroes the ticket for the next call and, when not finite, writes NaN over every tile's
elements (a loop over the ``P`` tiles in one program: slow, ``numel / TILE`` iterations, but
only on a skipped step). The scales read are those a separate check over the records would
read: every group has at least one element (a tile of its run reads its scale) and padding
has no scale (no tile reads it); a unit with no element has one empty tile, finite. So the
flag and the values are the bits of "check, then decode, all NaN unless finite". The
``VERDICT`` variant's last program then decides the step (:func:`_decide`). One ticket per
layout and device: its calls run in order on one stream, as a stage's kernels do. The
memory ordering (the NaN stores land after every other program's values) rests on the
atomic's ``acq_rel``: the interpreter runs programs one after the other and cannot test it;
``make gpu-check`` does (its fused gathered decode rows).

Bit-exactness: the rounding to E4M3 / E5M2 and the code's value are integer arithmetic on
the FP32 bits (as :mod:`.native`'s C kernels do; c10's conversions: nearest even, E4M3
saturating at 448 with NaN to ``0x7F``, E5M2 to Inf past 57344), divisions are ``div_rn``
(IEEE, as torch divides two tensors) and the kernels are compiled without FMA contraction,
so every byte and every FP32 value equals the reference's on a GPU and under Triton's
interpreter (``TRITON_INTERPRET=1``, whose own FP8 casts round differently).
"""

from __future__ import annotations

import functools
import itertools
import operator
import os
import warnings
from collections.abc import Callable
from typing import TypeVar

import torch

from .base import group_runs
from .groups import GroupMap

try:  # an optional dependency (geofp8[gpu])
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None

__all__ = ["NO_FEEDBACK", "TILE", "AmaxSlots", "Feedback", "Launch", "agreed", "amax",
           "attempt", "available", "decode", "decode_sum", "encode", "failed",
           "feedback_fits", "no_scatter", "placed_tiles", "reference", "ticket", "tiles",
           "verdict"]

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# whether a tensor is where the kernels run (no Python per tensor in `available`)
_ON_DEVICE = operator.attrgetter("is_cpu" if _INTERPRET else "is_cuda")
_FAILED: list[Exception] = []  # the first compile or launch failure (see attempt)
T = TypeVar("T")
TILE = 1024  # elements per program
FMAX = {"e4m3": 448.0, "e5m2": 57344.0}  # the largest finite value of each format
_NO_FUSION = {"enable_fp_fusion": False}  # x − v·s rounds twice, as the reference does


def available(*tensors: torch.Tensor) -> bool:
    """Whether the kernels run on these tensors: Triton imports, no kernel has failed to
    compile or launch here (:func:`attempt`), and they are on a CUDA device, or on the CPU
    under Triton's interpreter (``TRITON_INTERPRET=1`` when this module was imported: the
    tests' way to run them without a GPU)."""
    return triton is not None and not _FAILED and all(map(_ON_DEVICE, tensors))


def attempt(fused: Callable[..., T], fallback: Callable[..., T], *args) -> T:
    """``fused(*args)``, or ``fallback(*args)`` (the torch reference) once a kernel has
    failed to compile or launch on this machine (:func:`failed`)."""
    if not _FAILED:
        try:
            return fused(*args)
        except Exception as exc:  # noqa: BLE001 - any compile or launch error
            failed(exc)
    return fallback(*args)


def failed(exc: Exception) -> None:
    """After a kernel raised ``exc``: the first failure is warned about and remembered, and
    :func:`available` is ``False`` from then on (the torch path). Under the interpreter a
    failure is a bug, and an out-of-memory error is not Triton's fault: both re-raised."""
    if _INTERPRET or isinstance(exc, torch.OutOfMemoryError):
        raise exc
    _FAILED.append(exc)
    warnings.warn(f"GeoFP8's Triton FP8 kernels failed ({type(exc).__name__}: {exc}); "
                  "falling back to the torch path from now on", RuntimeWarning, stacklevel=3)


class Launch(functools.partial):
    """One kernel bound to its grid and to the arguments and constexprs that do not change
    from call to call (a layout's maps, counts and slots, the format): ``launch(*args,
    **kwargs)`` runs ``kernel[grid](*args, **fixed, **kwargs)`` with only the call's own
    tensors, scalars and flags. A :class:`functools.partial` of the kernel's ``run``: a call
    runs no Python of its own (the arguments merged by the partial), and the ``run`` is the
    one the kernel had when the launch was made (a test or a benchmark that replaces it
    does so before)."""

    __slots__ = ()

    def __new__(cls, kernel, grid: tuple[int, ...], **fixed) -> Launch:
        return super().__new__(cls, kernel.run, grid=grid, warmup=False, **fixed)

    def bind(self, **more) -> Launch:
        """This launch with ``more`` arguments fixed too (a stage's own slots, padding)."""
        return functools.partial.__new__(type(self), self, **more)


def tiles(groups: GroupMap, device: torch.device) -> torch.Tensor:
    """The tile map of ``groups`` (module notes) on ``device``, made once per map: codes
    and scales at the elements' and groups' own positions."""
    def runs():
        elem = group = 0
        for seg in groups.segments:
            yield elem, group, seg, elem, 4 * group
            elem, group = elem + sum(seg), group + len(seg)
    return groups.memo(("triton-tiles", TILE, torch.device(device)),
                       lambda: placed_tiles(runs(), device))


def placed_tiles(segments, device: torch.device) -> torch.Tensor:
    """The int64 ``[T, 7]`` tile map (module notes) of ``segments``: per segment ``(first
    element, first group, its group lengths, byte of its first element's code, byte of its
    first group's scale)`` in the buffers a kernel reads or writes (the codes of a segment
    back to back, its FP32 scales too). A tile never spans two segments."""
    rows = []
    for elem0, g_first, seg, code0, scale0 in segments:
        for first, g, count, size in group_runs((seg,)):
            if not size:
                continue
            lo, run = elem0 + first, (g_first + g, size, elem0 + first, code0 + first,
                                      scale0 + 4 * g)
            if size >= TILE:  # every group cut into tiles: a tile lies in one group
                spans, step = [(lo + k * size, lo + (k + 1) * size) for k in range(count)], TILE
            else:  # whole groups per tile
                spans, step = [(lo, lo + count * size)], TILE // size * size
            for a0, stop in spans:
                rows += [(a, min(a + step, stop), *run) for a in range(a0, stop, step)]
    return torch.tensor(rows or [(0, 0, 0, 1, 0, 0, 0)], dtype=torch.int64).to(device)


if triton is not None:

    @triton.jit
    def _tile(tiles_ptr, TILE: tl.constexpr):
        row = tiles_ptr + 7 * tl.program_id(0)
        start = tl.load(row)
        stop = tl.load(row + 1)
        g0 = tl.load(row + 2)
        size = tl.load(row + 3)
        run0 = tl.load(row + 4)
        offs = start + tl.arange(0, TILE).to(tl.int64)
        return offs, offs < stop, g0 + (offs - run0) // size, start, size, g0, run0

    @triton.jit
    def _places(tiles_ptr, offs, g):
        """``(each element's code byte, each element's group's first scale byte)`` in the
        buffer of a placed tile map (:func:`placed_tiles`)."""
        row = tiles_ptr + 7 * tl.program_id(0)
        g0 = tl.load(row + 2)
        return tl.load(row + 5) + (offs - tl.load(row + 4)), tl.load(row + 6) + 4 * (g - g0)

    @triton.jit
    def _load_f32(ptr, mask):
        """The little-endian FP32 at the byte pointers ``ptr`` (any alignment)."""
        b = tl.load(ptr, mask=mask, other=0).to(tl.uint32)
        for k in tl.static_range(1, 4):
            b = b | (tl.load(ptr + k, mask=mask, other=0).to(tl.uint32) << (8 * k))
        return b.to(tl.float32, bitcast=True)

    @triton.jit
    def _store_f32(ptr, x, mask):
        b = x.to(tl.uint32, bitcast=True)
        for k in tl.static_range(4):
            tl.store(ptr + k, ((b >> (8 * k)) & 0xFF).to(tl.uint8), mask=mask)

    @triton.jit
    def _scale_of(slot, FMAX: tl.constexpr):
        """The FP32 scale of a group whose amax slot is ``slot`` (int64, module notes): the
        reference's policies (:meth:`~.fp8.FP8Codec.scales_from_amax`)."""
        bits = slot.to(tl.int32)  # the low word: the bits of max |u|
        a = bits.to(tl.float32, bitcast=True)
        s = tl.math.div_rn(a, tl.full(a.shape, FMAX, tl.float32))
        over = tl.math.div_rn(a, s) > FMAX  # s rounded down: one ulp up, towards amax
        s = tl.where(over, (s.to(tl.int32, bitcast=True) + 1).to(tl.float32, bitcast=True), s)
        s = tl.where(s == 0.0, 1.0, s)
        return tl.where(bits < 0x7F800000, s, float("nan"))  # +Inf or NaN: a NaN scale

    @triton.jit
    def _group_max(bits_ptr, x, mask, g, start, size, g0, run0, epoch, TILE: tl.constexpr):
        # |x| as int bits: their order is the magnitudes' (NaN above +Inf), max is exact;
        # the call's epoch above them: any slot of an earlier call is smaller
        bits = tl.where(mask, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0).to(tl.int64) + epoch
        if size >= TILE:  # the tile lies in one group
            tl.atomic_max(bits_ptr + g0 + (start - run0) // size, tl.max(bits, 0))
        else:
            tl.atomic_max(bits_ptr + g, bits, mask=mask)

    @triton.jit
    def _e4m3_round(q):
        """``(code, value)``: the E4M3 code of the FP32 ``q`` (c10's conversion) and its FP32
        value, from the bits (:mod:`.native`'s ``e4m3_round``)."""
        b = q.to(tl.uint32, bitcast=True)
        mag = b & 0x7FFFFFFF
        sign = b & 0x80000000
        nan = mag > 0x7F800000
        m = tl.minimum(mag, 0x43E00000)
        below = (m.to(tl.float32, bitcast=True) + 16384.0).to(tl.uint32, bitcast=True)
        rounded = (m + 0x7FFFF + ((m >> 20) & 1)) & 0xFFF00000
        subnormal = m < (121 << 23)
        sub_value = (below.to(tl.float32, bitcast=True) - 16384.0).to(tl.uint32, bitcast=True)
        v = tl.where(subnormal, sub_value, rounded)
        value = (tl.where(nan, 0x7FF00000, v) | sign).to(tl.float32, bitcast=True)
        code = tl.where(subnormal, below - (141 << 23), (rounded - (120 << 23)) >> 20)
        code = code | tl.where(nan, 0x7F, 0) | (sign >> 24)
        return code, value

    @triton.jit
    def _e5m2_round(q):
        """``(code, value)`` of the FP32 ``q`` in E5M2 (c10's conversion: nearest even; from
        the largest finite value up, Inf; NaN stays NaN) and its FP32 value, from the bits."""
        b = q.to(tl.uint32, bitcast=True)
        sign = b & 0x80000000
        mag = b ^ sign
        big = mag >= (143 << 23)  # rounds past 57344: Inf, or NaN
        small = mag < (113 << 23)  # an E5M2 subnormal: a magic add rounds to 2^-16
        denorm = (mag.to(tl.float32, bitcast=True) + 128.0).to(tl.uint32, bitcast=True)
        # rebias the exponent (−112 << 23, wrapping) and round the mantissa to 2 bits
        normal = ((mag + 0xC80FFFFF + ((mag >> 21) & 1)) >> 21) & 0xFF
        code = tl.where(small, denorm - (134 << 23), normal)
        code = tl.where(big, tl.where(mag > 0x7F800000, 0x7F, 0x7C), code) | (sign >> 24)
        return code, _e5m2_value(code)

    @triton.jit
    def _e5m2_value(c):
        """The FP32 value of the E5M2 bytes ``c`` (uint32): the top byte of an IEEE half."""
        return (c << 8).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _fp8_round(q, E5M2: tl.constexpr):
        if E5M2:
            return _e5m2_round(q)
        return _e4m3_round(q)

    @triton.jit
    def _fp8_value(c, E5M2: tl.constexpr):
        if E5M2:
            return _e5m2_value(c)
        return _e4m3_value(c)

    @triton.jit
    def _e4m3_value(c):
        """torch's FP32 value of the E4M3 bytes ``c`` (uint32), from the bits."""
        m = c & 0x7F
        normal = (m << 20) + (120 << 23)
        sub = ((m & 7).to(tl.float32) * 0.001953125).to(tl.uint32, bitcast=True)
        v = tl.where((m >> 3) == 0, sub, normal)
        v = tl.where(m == 0x7F, 0x7FF00000, v)
        return (v | ((c & 0x80) << 24)).to(tl.float32, bitcast=True)

    @triton.jit
    def _with_feedback(x_ptr, r_ptr, keep_ptr, offs, mask, HAS_R: tl.constexpr,
                       HAS_KEEP: tl.constexpr, BF16: tl.constexpr):
        """``Ũ = x + where(keep, r, 0)`` (``x + r`` without ``keep``; ``x`` without ``r``) as
        torch adds it: ``r`` widened exactly (BF16: its bits, read as int16, are the FP32's
        high half), one FP32 add (a kept-away residual adds +0: ``-0`` becomes ``+0``)."""
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        if HAS_R:
            if BF16:
                bits = tl.load(r_ptr + offs, mask=mask, other=0).to(tl.uint32)
                r = (bits << 16).to(tl.float32, bitcast=True)
            else:
                r = tl.load(r_ptr + offs, mask=mask, other=0.0)
            if HAS_KEEP:
                r = tl.where(tl.load(keep_ptr) != 0, r, 0.0)
            x = x + r
        return x

    @triton.jit
    def _store_error(err_ptr, offs, e, mask, BF16: tl.constexpr):
        """``e`` (FP32) stored as FP32, or rounded to BF16 to nearest even in integer
        arithmetic (c10's ``round_to_nearest_even``: NaN as ``0x7FC0``) into int16 bits."""
        if BF16:
            b = e.to(tl.uint32, bitcast=True)
            r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
            r = tl.where((b & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r)
            tl.store(err_ptr + offs, r.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
        else:
            tl.store(err_ptr + offs, e, mask=mask)

    @triton.jit
    def _amax_kernel(x_ptr, r_ptr, keep_ptr, u_ptr, tiles_ptr, bits_ptr, epoch,
                     HAS_R: tl.constexpr, HAS_KEEP: tl.constexpr, BF16: tl.constexpr,
                     STORE_U: tl.constexpr, TILE: tl.constexpr):
        offs, mask, g, start, size, g0, run0 = _tile(tiles_ptr, TILE)
        x = _with_feedback(x_ptr, r_ptr, keep_ptr, offs, mask, HAS_R, HAS_KEEP, BF16)
        if STORE_U:
            tl.store(u_ptr + offs, x, mask=mask)
        _group_max(bits_ptr, x, mask, g, start, size, g0, run0, epoch, TILE)

    @triton.jit
    def _scales_kernel(bits_ptr, scales_ptr, n, FMAX: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        bits = tl.load(bits_ptr + offs, mask=mask, other=0)
        tl.store(scales_ptr + offs, _scale_of(bits, FMAX), mask=mask)

    @triton.jit
    def _encode_kernel(u_ptr, scales_ptr, codes_ptr, err_ptr, tiles_ptr,
                       HAS_ERR: tl.constexpr, E5M2: tl.constexpr, TILE: tl.constexpr):
        offs, mask, g, start, size, g0, run0 = _tile(tiles_ptr, TILE)
        s = tl.load(scales_ptr + g, mask=mask, other=1.0)
        x = tl.load(u_ptr + offs, mask=mask, other=0.0)
        code, value = _fp8_round(tl.math.div_rn(x, s), E5M2)
        tl.store(codes_ptr + offs, code.to(tl.uint8), mask=mask)
        if HAS_ERR:
            tl.store(err_ptr + offs, x - value * s, mask=mask)

    @triton.jit
    def _decode_kernel(codes_ptr, scales_ptr, out_ptr, tiles_ptr, E5M2: tl.constexpr,
                       TILE: tl.constexpr):
        offs, mask, g, start, size, g0, run0 = _tile(tiles_ptr, TILE)
        c = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.uint32)
        s = tl.load(scales_ptr + g, mask=mask, other=1.0)
        tl.store(out_ptr + offs, _fp8_value(c, E5M2) * s, mask=mask)

    @triton.jit
    def _decode_sum_kernel(codes_ptr, scales_ptr, out_ptr, tiles_ptr, n_senders, numel,
                           groups, E5M2: tl.constexpr, TILE: tl.constexpr):
        offs, mask, g, start, size, g0, run0 = _tile(tiles_ptr, TILE)
        acc = tl.zeros((TILE,), tl.float32)  # from +0 (-0 + 0 = +0), sender after sender
        for r in range(0, n_senders):
            c = tl.load(codes_ptr + r * numel + offs, mask=mask, other=0).to(tl.uint32)
            acc += _fp8_value(c, E5M2) * tl.load(scales_ptr + r * groups + g, mask=mask, other=1.0)
        tl.store(out_ptr + offs, acc, mask=mask)

    @triton.jit
    def _encode_placed_kernel(u_ptr, r_ptr, keep_ptr, bits_ptr, out_ptr, err_ptr, tiles_ptr,
                              pad_lo, pad_hi, HAS_R: tl.constexpr, HAS_KEEP: tl.constexpr,
                              BF16: tl.constexpr, HAS_ERR: tl.constexpr, E5M2: tl.constexpr,
                              FMAX: tl.constexpr, TILE: tl.constexpr):
        offs, mask, g, start, size, g0, run0 = _tile(tiles_ptr, TILE)
        code_at, scale_at = _places(tiles_ptr, offs, g)
        s = _scale_of(tl.load(bits_ptr + g, mask=mask, other=0), FMAX)
        x = _with_feedback(u_ptr, r_ptr, keep_ptr, offs, mask, HAS_R, HAS_KEEP, BF16)
        code, value = _fp8_round(tl.math.div_rn(x, s), E5M2)
        tl.store(out_ptr + code_at, code.to(tl.uint8), mask=mask)
        _store_f32(out_ptr + scale_at, s, mask & ((offs - run0) % size == 0))  # its 1st element
        if HAS_ERR:  # may be u or r itself: each element read before it is written
            _store_error(err_ptr, offs, x - value * s, mask, BF16)
        if tl.program_id(0) == 0:  # the record's padding
            for p in range(pad_lo, pad_hi, TILE):
                at = p + tl.arange(0, TILE)
                tl.store(out_ptr + at, tl.zeros((TILE,), tl.uint8), mask=at < pad_hi)

    @triton.jit
    def _reduce_kernel(recv_ptr, out_ptr, bits_ptr, epoch, tiles_ptr, n_senders, record,
                       ticket_ptr, flag_ptr, divisor, SCATTER: tl.constexpr,
                       DIVIDE: tl.constexpr, E5M2: tl.constexpr, TILE: tl.constexpr):
        offs, mask, g, start, size, g0, run0 = _tile(tiles_ptr, TILE)
        code_at, scale_at = _places(tiles_ptr, offs, g)
        acc = tl.zeros((TILE,), tl.float32)  # from +0 (-0 + 0 = +0), sender after sender
        for r in range(0, n_senders):
            base = recv_ptr + r * record
            c = tl.load(base + code_at, mask=mask, other=0).to(tl.uint32)
            acc += _fp8_value(c, E5M2) * _load_f32(base + scale_at, mask)
        if SCATTER:
            _scattered(out_ptr, offs, acc, mask, ticket_ptr, flag_ptr, divisor, DIVIDE, TILE)
        else:
            tl.store(out_ptr + offs, acc, mask=mask)
            _group_max(bits_ptr, acc, mask, g, start, size, g0, run0, epoch, TILE)

    @triton.jit
    def _scattered(out_ptr, offs, v, mask, ticket_ptr, flag_ptr, divisor, DIVIDE: tl.constexpr,
                   TILE: tl.constexpr):
        """A reduce-scatter's end (``SCATTER``), after its program summed ``v``: ``v /
        divisor`` (``DIVIDE``) stored, and the flag "every value stored is finite" decided by
        the ticket (:func:`_settle`: no poison, no decision)."""
        if DIVIDE:
            v = tl.math.div_rn(v, tl.full(v.shape, divisor, tl.float32))
        tl.store(out_ptr + offs, v, mask=mask)
        _settle(out_ptr, ticket_ptr, ticket_ptr, flag_ptr, _nonfinite(v, mask), ticket_ptr, 0,
                ticket_ptr, ticket_ptr, False, False, TILE, False)

    @triton.jit
    def _decide(flags_ptr, n, bad0, verdict_ptr, skipped_ptr, BLOCK: tl.constexpr):
        """``verdict = all(flags[:n]) and not bad0`` (uint8 flags; ``bad0``: 0 or 1, the
        caller's own flag down), ``skipped += !verdict``; in the calling program."""
        bad = tl.zeros((BLOCK,), tl.int32) + bad0
        for lo in range(0, n, BLOCK):
            at = lo + tl.arange(0, BLOCK)
            flag = tl.load(flags_ptr + at, mask=at < n, other=1)
            bad = tl.maximum(bad, (flag == 0).to(tl.int32))
        worse = tl.max(bad, 0)
        tl.store(verdict_ptr, (1 - worse).to(tl.uint8))
        tl.store(skipped_ptr, tl.load(skipped_ptr) + worse.to(tl.int64))

    @triton.jit
    def _settle(out_ptr, tiles_ptr, ticket_ptr, flag_ptr, bad, flags_ptr, n, verdict_ptr,
                skipped_ptr, POISON: tl.constexpr, VERDICT: tl.constexpr, TILE: tl.constexpr,
                AND_FLAG: tl.constexpr):
        """A fused kernel's end, after its program stored its values: the ticket (module
        notes) counts this program and its ``bad`` (0 or 1: a non-finite scale read, or
        value written); the last program writes ``flag = every program's bad is 0`` (ANDed
        with the flag's own value with ``AND_FLAG``: :mod:`.triton_map`'s map back), zeroes
        the ticket, writes NaN over every tile's elements unless finite (``POISON``) and
        (``VERDICT``) decides the step from ``flags[:n]`` and its flag (:func:`_decide`)."""
        # acq_rel (Triton's default, scope gpu) is enough: a program's threads store its
        # values, meet at a barrier (the reduction of `bad`), then one thread's atomic
        # releases those stores; the last program's atomic acquires every earlier release,
        # and its threads meet at a barrier again (the result's broadcast) before its NaN
        # stores, which so land after every program's values (sm_90 PTX: the stores,
        # bar.sync, atom.global.gpu.acq_rel.add.u64, bar.sync). The interpreter runs the
        # programs one by one and cannot show it: make gpu-check's gathered decode rows do
        before = tl.atomic_add(ticket_ptr, 1 + (bad.to(tl.int64) << 32))
        # programs counted before this one (the low word), then its high word's verdicts
        if before - ((before >> 32) << 32) == tl.num_programs(0) - 1:
            worse = ((before >> 32) + bad > 0).to(tl.int32)
            if AND_FLAG:
                worse = tl.maximum(worse, (tl.load(flag_ptr) == 0).to(tl.int32))
            tl.store(flag_ptr, (1 - worse).to(tl.uint8))
            tl.store(ticket_ptr, tl.zeros((), dtype=tl.int64))
            if POISON:
                if worse != 0:  # a skipped step: all NaN, tile after tile
                    for t in range(0, tl.num_programs(0)):
                        at = tl.load(tiles_ptr + 7 * t) + tl.arange(0, TILE).to(tl.int64)
                        tl.store(out_ptr + at, tl.full((TILE,), float("nan"), tl.float32),
                                 mask=at < tl.load(tiles_ptr + 7 * t + 1))
            if VERDICT:  # the step's last unit: its verdict, from the earlier units' flags
                _decide(flags_ptr, n, worse, verdict_ptr, skipped_ptr, TILE)

    @triton.jit
    def _nonfinite(scale, mask):
        """1 if a masked lane's FP32 ``scale`` has its exponent all ones (±Inf, NaN), else 0."""
        bits = scale.to(tl.uint32, bitcast=True)
        return tl.max((((bits & 0x7F800000) == 0x7F800000) & mask).to(tl.int32), 0)

    @triton.jit
    def _decode_placed_kernel(buf_ptr, out_ptr, ticket_ptr, flag_ptr, tiles_ptr, divisor,
                              flags_ptr, n, verdict_ptr, skipped_ptr, DIVIDE: tl.constexpr,
                              VERDICT: tl.constexpr, E5M2: tl.constexpr, TILE: tl.constexpr):
        offs, mask, g, start, size, g0, run0 = _tile(tiles_ptr, TILE)
        code_at, scale_at = _places(tiles_ptr, offs, g)
        c = tl.load(buf_ptr + code_at, mask=mask, other=0).to(tl.uint32)
        s = _load_f32(buf_ptr + scale_at, mask)
        v = _fp8_value(c, E5M2) * s
        if DIVIDE:
            v = tl.math.div_rn(v, tl.full(v.shape, divisor, tl.float32))
        tl.store(out_ptr + offs, v, mask=mask)
        _settle(out_ptr, tiles_ptr, ticket_ptr, flag_ptr, _nonfinite(s, mask), flags_ptr, n,
                verdict_ptr, skipped_ptr, True, VERDICT, TILE, False)

    @triton.jit
    def _verdict_kernel(flags_ptr, n, verdict_ptr, skipped_ptr, BLOCK: tl.constexpr):
        """One program: ``verdict = all(flags[:n])`` (uint8 flags), ``skipped += !verdict``."""
        _decide(flags_ptr, n, 0, verdict_ptr, skipped_ptr, BLOCK)

    @triton.jit
    def _agreed_kernel(down_ptr, n, factors_ptr, verdict_ptr, skipped_ptr, BLOCK: tl.constexpr):
        """One program: ``factors = where(down[:n] == 0, 1, NaN)`` (FP32),
        ``verdict = all(down[:n] == 0)``, ``skipped += !verdict``."""
        bad = tl.zeros((BLOCK,), tl.int32)
        for lo in range(0, n, BLOCK):
            at = lo + tl.arange(0, BLOCK)
            up = tl.load(down_ptr + at, mask=at < n, other=0.0) == 0.0
            tl.store(factors_ptr + at, tl.where(up, 1.0, float("nan")), mask=at < n)
            bad = tl.maximum(bad, 1 - up.to(tl.int32))
        worse = tl.max(bad, 0)
        tl.store(verdict_ptr, (1 - worse).to(tl.uint8))
        tl.store(skipped_ptr, tl.load(skipped_ptr) + worse.to(tl.int64))


def _grid(map_: torch.Tensor) -> tuple[int]:
    return (map_.shape[0],)


def amax(x: torch.Tensor, groups: GroupMap, residual: torch.Tensor | None = None,
         fmt: str = "e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """``(u, scales)``: ``u = x + residual`` (``x`` itself without one) and the FP32 scale of
    every group of ``u`` for ``fmt`` (module notes); two kernels and a zeroed ``[G]``
    buffer."""
    t = tiles(groups, x.device)
    bits = torch.zeros(len(groups.lengths), dtype=torch.int64, device=x.device)
    u = x if residual is None else torch.empty_like(x)
    _amax_kernel[_grid(t)](x, x if residual is None else residual, x, u, t, bits, 0,
                           HAS_R=residual is not None, HAS_KEEP=False, BF16=False,
                           STORE_U=residual is not None, TILE=TILE)
    scales = torch.empty(bits.numel(), dtype=torch.float32, device=x.device)
    block = 1024
    _scales_kernel[(triton.cdiv(bits.numel(), block),)](bits, scales, bits.numel(),
                                                         FMAX=FMAX[fmt], BLOCK=block)
    return u, scales


def encode(u: torch.Tensor, scales: torch.Tensor, groups: GroupMap, error: bool = False,
           fmt: str = "e4m3") -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(codes, error)``: the ``fmt`` codes (uint8) of ``u`` under the groups' ``scales``
    and, with ``error``, ``u − value(code)·s`` (a new FP32 vector), one kernel."""
    t = tiles(groups, u.device)
    codes = torch.empty(u.numel(), dtype=torch.uint8, device=u.device)
    err = torch.empty_like(u) if error else None
    _encode_kernel[_grid(t)](u, scales, codes, u if err is None else err, t, HAS_ERR=error,
                             E5M2=fmt == "e5m2", TILE=TILE, **_NO_FUSION)
    return codes, err


def decode(out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, groups: GroupMap,
           fmt: str = "e4m3") -> torch.Tensor:
    """``out = value(code)·s_g`` (FP32), one kernel."""
    t = tiles(groups, out.device)
    _decode_kernel[_grid(t)](codes, scales, out, t, E5M2=fmt == "e5m2", TILE=TILE,
                             **_NO_FUSION)
    return out


def decode_sum(codes: torch.Tensor, scales: torch.Tensor, groups: GroupMap,
               n_senders: int, fmt: str = "e4m3") -> torch.Tensor:
    """``0 + Σ_r value(code_r)·s_{r,g}`` added sender after sender (FP32; the reference's
    order, ``stages.sender_sum``): the ``N`` senders' copies of a shard of ``groups``
    (``codes``: ``[N, numel]`` uint8, ``scales``: ``[N, G]``), decoded and summed in one
    kernel."""
    numel, n_groups = sum(groups.numels), len(groups.lengths)
    t = tiles(groups, codes.device)
    out = torch.empty(numel, dtype=torch.float32, device=codes.device)
    _decode_sum_kernel[_grid(t)](codes, scales, out, t, n_senders, numel, n_groups,
                                 E5M2=fmt == "e5m2", TILE=TILE, **_NO_FUSION)
    return out


class AmaxSlots:
    """Persistent amax slots of ``n`` groups on ``device`` (module notes): an int64 buffer
    zeroed once, and an epoch per call, so no call zeroes it (a launch) again:
    ``next(slots.epochs)`` is this call's, ``k << 32`` for the ``k``-th call (its high
    word; a C iterator, no Python frame per call). The calls of one :class:`AmaxSlots` must
    run in order on one stream (a stage's kernels do)."""

    __slots__ = ("buffer", "epochs")

    def __init__(self, n: int, device: torch.device) -> None:
        self.buffer = torch.zeros(max(n, 1), dtype=torch.int64, device=device)
        self.epochs = itertools.count(1 << 32, 1 << 32)


Feedback = tuple[torch.Tensor, torch.Tensor | None]  # (R, keep): see feedback_fits
NO_FEEDBACK = {"HAS_R": False, "HAS_KEEP": False, "BF16": False}


def feedback_fits(x: torch.Tensor, feedback: Feedback | None) -> bool:
    """Whether the kernels take ``feedback`` for the FP32 vector ``x``: ``R`` contiguous,
    FP32 or BF16, of ``x``'s length and device; ``keep`` a 0-dim bool there or ``None``."""
    if feedback is None:
        return True
    r, keep = feedback
    return (r.dtype in (torch.float32, torch.bfloat16) and r.is_contiguous()
            and r.numel() == x.numel() and r.device == x.device
            and (keep is None or (keep.dtype == torch.bool and keep.dim() == 0
                                  and keep.device == x.device)))


def no_scatter(anywhere: torch.Tensor) -> dict:
    """A reduction kernel's arguments for its amax variant (not a reduce-scatter's end: no
    ticket nor flag, their pointers ``anywhere``, not read)."""
    return {"ticket_ptr": anywhere, "flag_ptr": anywhere, "divisor": 1.0, "SCATTER": False,
            "DIVIDE": False}


def ticket(device: torch.device) -> torch.Tensor:
    """A fused decode's ticket (module notes): one int64, zeroed once; each call's last
    program zeroes it again."""
    return torch.zeros(1, dtype=torch.int64, device=device)


def decode_launches(decode: Launch, anywhere: torch.Tensor) -> tuple[Launch, Launch]:
    """``(plain, deciding)``: a fused decode's launch (its kernel has a ``VERDICT``
    constexpr and the step's decision's ``flags_ptr, n, verdict_ptr, skipped_ptr``:
    :func:`geofp8.verdict.decode_into`) without the decision (those pointers ``anywhere``,
    not read) and with it (its arguments given per call)."""
    return (decode.bind(flags_ptr=anywhere, n=0, verdict_ptr=anywhere, skipped_ptr=anywhere,
                        VERDICT=False), decode.bind(VERDICT=True))


def verdict(flags: torch.Tensor, n: int, skipped: torch.Tensor) -> torch.Tensor:
    """A step's 0-dim bool verdict ``all(flags[:n])`` from its units' uint8 flags, and the
    int64 0-dim counter ``skipped`` advanced in place when it is false: one kernel, no
    host read."""
    out = torch.empty((), dtype=torch.uint8, device=flags.device)
    _verdict_kernel[(1,)](flags, n, out, skipped, BLOCK=128)
    return out.view(torch.bool)


def agreed(down: torch.Tensor, skipped: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(verdict, factors)`` of a step whose units' flags were agreed over the ranks
    (``down``: FP32 ``[U]``, per unit the ranks whose flag is down): the 0-dim bool
    ``verdict = all(down == 0)``, per unit the FP32 factor 1 where ``down == 0`` and NaN
    where not, and the int64 0-dim counter ``skipped`` advanced in place when the verdict is
    false: one kernel, no host read."""
    factors = torch.empty_like(down)
    out = torch.empty((), dtype=torch.uint8, device=down.device)
    _agreed_kernel[(1,)](down, down.numel(), factors, out, skipped, BLOCK=128)
    return out.view(torch.bool), factors


def reference(x: torch.Tensor, groups: GroupMap, fmt: str = "e4m3") -> tuple[torch.Tensor, ...]:
    """``(scales, codes, values)`` of ``x`` in ``fmt`` by the torch batched path these kernels
    replace (:meth:`~.fp8.FP8Codec.encode_shards`' ops, then the decode): what the checks
    compare them with, on any device."""
    from .base import group_amax, group_fp8, group_mul_
    from .fp8 import FP8Codec, e4m3_into

    codec = FP8Codec(fmt)
    scales = codec.scales_from_amax(group_amax(x, groups))
    codes = group_fp8(x, scales, groups, codec.dtype)
    values = torch.empty_like(x)
    if fmt == "e4m3":
        e4m3_into(values, codes)
    else:
        values.copy_(codes.view(codec.dtype))
    group_mul_(values, scales, groups)
    return scales, codes, values
