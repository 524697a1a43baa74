"""Fused Triton kernels of the block-scaled codecs' batched paths (NVFP4, MXFP4, MXFP8), bit
for bit the torch reference's.

The formats are :mod:`.fp4`'s (NVFP4: E2M1 codes, an E4M3 scale ``β_b`` per block of 16,
an FP32 scale ``s`` per segment) and :mod:`.mx`'s (MXFP4 / MXFP8: E2M1 / E4M3 codes, an
E8M0 scale ``2^e`` per block of 32), rounding to nearest even or stochastically (with
:mod:`.uniforms`' counter-based draw, which the kernels compute from the seeds, the segment
and the element's index). Every kernel reads and writes where a
:class:`~.block_records.Placement` says (the codec's whole-bucket parts, or a layout's send
buffer, records and flat vector: :mod:`geofp8.comm.block_plan`), two kernels a stage, the
decode one:

* :func:`amax` — ``u = x + where(keep, r, 0)`` (the error feedback add, ``r`` FP32 or
  BF16) and every block's max ``|u|`` (a tile's whole blocks reduced in registers, one
  atomic max per block) and, for NVFP4, every segment's max over its finite blocks (one
  atomic per tile), into epoch-tagged slots (:class:`~.triton_fp8.AmaxSlots`: zeroed once
  per map, never per call);
* :func:`encode_placed` — every block's scale computed from the slots where it is used
  (NVFP4: ``s = max(A / 2688, 2⁻¹⁴⁹)``, ``β`` the smallest E4M3 ``≥ a / (6 s)``; MX: the
  E8M0 exponent), written with the segment's by the block's first element, and the codes of
  ``u / d_b`` (``d_b`` the block's scale, 1 where that is 0 or NaN), packed two per byte for
  E2M1, and, optionally, the rounding error ``u − value(code)·scale_b`` in FP32 or BF16
  (to nearest even, as ``Tensor.to`` rounds);
* :func:`reduce` — the ``N`` senders' payloads of a shard decoded and summed in FP32 in
  sender order from +0, and the sum's amax as :func:`amax` takes it;
* :func:`decode_placed` — ``value(code)·scale_b`` (``/ N``) and the flag "every stored
  scale finite", every value NaN unless it is set (``poison``, as
  :func:`~.base.poison_scales_` does): one kernel, whose programs each check the scales
  they read and whose last program writes the flag (the ticket of
  :mod:`.triton_fp8`'s gathered decode: every block has at least one element, so the
  scales read are every block's, the ones a separate check would read).

Stochastic keys are mixed in the encoding pass from a per-map ``(shard, index in it)`` of
every segment and the shard's seed: the step's seed and the stage's prefix as kernel
scalars (:class:`.uniforms.StepSeed`), or a table of one int64 per shard (the codecs' own
calls), so nothing per call is ``O(segments)`` on the host.

Packed codes are laid out as :func:`~.fp4.pack_shards` lays them: each shard's ``⌈n/2⌉``
bytes, element ``2i`` of the shard in the low nibble of its byte ``i``; the packed encode
walks the placement's byte rows (``pairs``), each lane a byte and its two elements, which
may lie in two segments far apart in the flat vector.

Bit-exactness as in :mod:`.triton_fp8`: every rounding is integer arithmetic on the FP32
bits or exact comparisons (E2M1 to nearest even: seven thresholds; E4M3 as c10 casts,
saturating at 448 as torch's cast does), divisions are ``div_rn``, no FMA contraction.

On CUDA a kernel that fails to compile or launch is caught at first use: a warning, and the
torch path from then on (:func:`available` turns false). Under the interpreter it raises.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import NamedTuple

import torch

from . import triton_fp8
from .base import interleave, joined
from .block_records import Placement, place, whole_places
from .groups import GroupMap, group_map
from .triton_fp8 import _INTERPRET, _NO_FUSION, TILE, AmaxSlots, Launch, triton
from .uniforms import StepSeed

if triton is not None:
    import triton.language as tl

    from .triton_fp8 import (
        _e4m3_round,
        _e4m3_value,
        _load_f32,
        _nonfinite,
        _places,
        _scattered,
        _settle,
        _store_f32,
        _tile,
    )

__all__ = ["FORMATS", "Bound", "Encoded", "amax", "available", "block_length", "decode",
           "decode_placed", "decode_shards", "decode_sum", "decode_whole", "encode",
           "encode_placed", "encode_shards", "encode_whole", "failed", "guarded", "keep_arg",
           "placement", "reduce", "seed_args",
           "torch_only"]

FORMATS = ("nvfp4", "mxfp4", "mxfp8")
E2M1, E4M3 = 0, 1  # element formats (constexpr)
# MX: the E8M0 exponent is one above ⌊log₂ amax⌋ − emax when amax's mantissa bits exceed
# these (amax > 1.5·2^k for E2M1's 6 = 1.5·2², > 1.75·2^k for E4M3's 448 = 1.75·2⁸)
_MX = {"mxfp4": (2, 0x400000), "mxfp8": (8, 0x600000)}  # (emax, mantissa threshold)
_STATE = {"off": 0, "broken": False}


def available(*tensors: torch.Tensor) -> bool:
    """Whether the kernels run on these tensors (:func:`.triton_fp8.available`), unless a
    launch failed on CUDA before or :func:`torch_only` is in force."""
    return not (_STATE["off"] or _STATE["broken"]) and triton_fp8.available(*tensors)


@contextlib.contextmanager
def torch_only():
    """The codecs' torch path inside (the reference the kernels are checked against)."""
    _STATE["off"] += 1
    try:
        yield
    finally:
        _STATE["off"] -= 1


def guarded(run):
    """``run()``, or ``None`` after a warning when a kernel fails on CUDA (:func:`failed`)."""
    if _INTERPRET:
        return run()
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 - any compile or launch failure: the torch path
        return failed(exc)


def failed(exc: Exception) -> None:
    """After a kernel raised ``exc``: remembered (the torch path from now on: :func:`available`
    is false) and warned about; re-raised under the interpreter (a bug there)."""
    if _INTERPRET:
        raise exc
    _STATE["broken"] = True
    warnings.warn(f"geofp8: the block-scaled Triton kernels failed ({exc!r}); the torch "
                  "path runs from now on", RuntimeWarning, stacklevel=4)


def seed_args(seeds, device: torch.device) -> tuple[int, tuple, dict]:
    """``(SEEDS, (seeds tensor or None, seed0, prefix, offset))`` of the kernels' draw: none;
    a :class:`.uniforms.StepSeed` (scalars, mixed in the kernel: nothing copied); else the
    shards' seeds (``None`` counting as 0), one int64 each, copied from pinned memory
    without a host sync."""
    if seeds is None:
        return 0, (None, 0, 0, 0)
    if isinstance(seeds, StepSeed):
        return (3 if seeds.prefix is None else 2), (None, seeds.seed, seeds.prefix or 0,
                                                    seeds.offset)
    table = torch.tensor([seed or 0 for seed in seeds], dtype=torch.int64,
                         pin_memory=device.type == "cuda").to(device, non_blocking=True)
    return 1, (table, 0, 0, 0)


if triton is not None:

    @triton.jit
    def _e2m1_round(q):
        """The E2M1 code (0–15, to nearest even, saturating at 6, NaN to ±0) of FP32 ``q``."""
        a = tl.abs(q)
        code = ((a > 0.25).to(tl.uint32) + (a >= 0.75).to(tl.uint32) + (a > 1.25).to(tl.uint32)
                + (a >= 1.75).to(tl.uint32) + (a > 2.5).to(tl.uint32)
                + (a >= 3.5).to(tl.uint32) + (a > 5.0).to(tl.uint32))
        return code | ((q.to(tl.uint32, bitcast=True) >> 28) & 8)

    @triton.jit
    def _e2m1_value(c):
        """The FP32 value of E2M1 codes ``c`` (uint32, 0–15): ``0, ½, 1, 1.5, 2, 3, 4, 6``."""
        m = c & 7
        normal = (((m >> 1) + 126) << 23) | ((m & 1) << 22)
        bits = tl.where(m < 2, tl.where(m == 1, 0x3F000000, 0), normal)
        return (bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)

    @triton.jit
    def _round(q, FMT: tl.constexpr):
        """The code of FP32 ``q`` in the element format (both saturate, as torch casts)."""
        if FMT == 0:
            return _e2m1_round(q)
        return _e4m3_round(q)[0]

    @triton.jit
    def _value(c, FMT: tl.constexpr):
        if FMT == 0:
            return _e2m1_value(c)
        return _e4m3_value(c)

    @triton.jit
    def _mix32(x):
        """``lowbias32`` of the int64 ``x`` holding 32-bit values (:mod:`.uniforms`)."""
        m32 = tl.full(x.shape, 0xFFFFFFFF, tl.int64)
        x = x ^ (x >> 16)
        x = (x * tl.full(x.shape, 0x7FEB352D, tl.int64)) & m32
        x = x ^ (x >> 15)
        x = (x * tl.full(x.shape, 0x846CA68B, tl.int64)) & m32
        return x ^ (x >> 16)

    @triton.jit
    def _splitmix(h, v):
        """One step of :func:`~.base.mix_seed` (uint64, products wrapping modulo 2⁶⁴)."""
        h = (h ^ v) * tl.full(h.shape, 0xBF58476D1CE4E5B9, tl.uint64)
        h = (h ^ (h >> 31)) * tl.full(h.shape, 0x94D049BB133111EB, tl.uint64)
        return h ^ (h >> 29)

    @triton.jit
    def _uniform(offs, g, mask, seg_ptr, start_ptr, where_ptr, seeds_ptr, seed0, prefix, offset,
                 SEEDS: tl.constexpr):
        """:func:`.uniforms.uniforms`' draw for elements ``offs`` of blocks ``g``: the key
        ``mix_seed(seed of the shard, index of the segment in it)`` mixed here, per element,
        from the map's ``(shard, index)`` of every segment and the shard's seed: read from
        ``seeds_ptr`` (``SEEDS`` 1), or ``mix_seed(seed0, prefix, shard + offset)`` (2), or
        ``mix_seed(seed0, shard + offset)`` (3), mixed here too (:class:`.uniforms.StepSeed`)."""
        seg = tl.load(seg_ptr + g, mask=mask, other=0).to(tl.int64)
        j = offs - tl.load(start_ptr + seg, mask=mask, other=0)
        shard = tl.load(where_ptr + 2 * seg, mask=mask, other=0)
        start = tl.full(shard.shape, 0x9E3779B97F4A7C15, tl.uint64)
        if SEEDS == 1:
            seed = tl.load(seeds_ptr + shard, mask=mask, other=0).to(tl.uint64, bitcast=True)
        else:
            h = _splitmix(start, tl.full(shard.shape, seed0, tl.int64).to(tl.uint64,
                                                                           bitcast=True))
            if SEEDS == 2:
                h = _splitmix(h, tl.full(shard.shape, prefix, tl.int64).to(tl.uint64,
                                                                            bitcast=True))
            seed = _splitmix(h, (shard + offset).to(tl.uint64, bitcast=True)) >> 1
        index = tl.load(where_ptr + 2 * seg + 1, mask=mask, other=0).to(tl.uint64, bitcast=True)
        key = _splitmix(_splitmix(start, seed), index) >> 1
        m32 = tl.full(j.shape, 0xFFFFFFFF, tl.int64)
        lo = (key & 0xFFFFFFFF).to(tl.int64, bitcast=True)
        hi = (key >> 32).to(tl.int64, bitcast=True)
        h = _mix32(_mix32((j + lo) & m32) ^ hi)
        return (h >> 8).to(tl.float32) * 5.9604644775390625e-08

    @triton.jit
    def _round_stochastic(q, u, FMT: tl.constexpr):
        """The code of FP32 ``q`` rounded ``⌊|q|/2^e + u⌋·2^e`` on the element grid (``2^e``
        its spacing at ``|q|``), as :func:`.fp4.grid_round` and its callers round."""
        b = q.to(tl.uint32, bitcast=True)
        a = tl.abs(q)
        top = (a.to(tl.int32, bitcast=True) >> 23)
        if FMT == 0:
            e = tl.minimum(tl.maximum(top - 128, -1), 1)
        else:
            e = tl.minimum(tl.maximum(top - 130, -9), 5)
        n = tl.floor(a * ((127 - e) << 23).to(tl.float32, bitcast=True) + u)
        if FMT == 0:
            code = tl.minimum(tl.maximum(tl.minimum(n, 8.0).to(tl.int32) + 2 * e + 2, 0), 7)
            code = tl.where(n != n, 0, code)  # NaN: code 0, as the CPU's conversion gives
            return code.to(tl.uint32) | ((b >> 28) & 8)
        v = n * ((e + 127) << 23).to(tl.float32, bitcast=True)
        v = tl.where(v > 448.0, 448.0, v)
        v = (v.to(tl.uint32, bitcast=True) | (b & 0x80000000)).to(tl.float32, bitcast=True)
        return _e4m3_round(v)[0]

    @triton.jit
    def _segment_scale(amax):
        """``max(A / (6·448), 2⁻¹⁴⁹)`` (FP32)."""
        tiny = tl.full(amax.shape, 1, tl.int32).to(tl.float32, bitcast=True)
        return tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, 2688.0, tl.float32)), tiny)

    @triton.jit
    def _e8m0_value(byte):
        """``2^(byte − 127)`` (FP32; 0: the subnormal ``2⁻¹²⁷``, ``0xFF``: NaN)."""
        bits = tl.where(byte == 0, 0x00400000, tl.where(byte == 0xFF, 0x7FC00000, byte << 23))
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _block_scale(slots_ptr, g, seg, mask, n_groups, NVFP4: tl.constexpr,
                     EMAX: tl.constexpr, THRESHOLD: tl.constexpr):
        """``(FP32 scale, scale byte, FP32 segment scale)`` of blocks ``g`` from the low words
        of their amax slots. NVFP4: ``s = max(A / 2688, 2⁻¹⁴⁹)`` of the segment, ``β`` the
        smallest E4M3 ``≥ a / (6 s)`` (``0x7F``, NaN, for a non-finite block), the scale
        ``β·s``; MX: the E8M0 ``e``, the smallest with ``a ≤ fmax·2^e`` in ``[−127, 127]``
        (``0xFF`` for a non-finite block), as ``frexp`` gives it."""
        bits = tl.load(slots_ptr + g, mask=mask, other=0).to(tl.int32)
        if NVFP4:
            seg_amax = tl.load(slots_ptr + n_groups + seg, mask=mask, other=0).to(tl.int32)
            s = _segment_scale(seg_amax.to(tl.float32, bitcast=True))
            r = tl.minimum(tl.math.div_rn(bits.to(tl.float32, bitcast=True), 6.0 * s), 448.0)
            code, value = _e4m3_round(r)
            code = tl.where(bits < 0x7F800000, code + (value < r).to(tl.uint32), 0x7F)
            return _e4m3_value(code) * s, code, s
        k = (bits >> 23) - 126  # amax = m·2^k, m in [0.5, 1), for a normal amax
        e = k - EMAX - 1 + ((bits & 0x7FFFFF) > THRESHOLD).to(tl.int32)
        e = tl.where(bits == 0, -EMAX - 1, tl.where(bits < 0x00800000, -127, e))
        byte = tl.where(bits < 0x7F800000, tl.minimum(tl.maximum(e, -127), 127) + 127, 0xFF)
        scale = _e8m0_value(byte.to(tl.uint32))
        return scale, byte.to(tl.uint32), scale

    @triton.jit
    def _stored_scale(s_ptr, blk_ptr, g, mask, block_at_ptr, seg_at_ptr, seg_of_ptr,
                      NVFP4: tl.constexpr):
        """The FP32 scale of blocks ``g`` as a payload holds it (NVFP4: ``β·s``, ``s`` read
        from its 4 bytes at any alignment; MX: ``2^e``)."""
        code = tl.load(blk_ptr + tl.load(block_at_ptr + g, mask=mask, other=0), mask=mask,
                       other=0).to(tl.uint32)
        if NVFP4:
            seg = tl.load(seg_of_ptr + g, mask=mask, other=0)
            s = _load_f32(s_ptr + tl.load(seg_at_ptr + seg, mask=mask, other=0), mask)
            return _e4m3_value(code) * s
        return _e8m0_value(code)

    @triton.jit
    def _code_at(code_ptr, slot, mask, FMT: tl.constexpr):
        """The codes (uint32) at code slots ``slot``: nibbles of packed bytes for E2M1."""
        if FMT == 0:
            c = tl.load(code_ptr + slot // 2, mask=mask, other=0).to(tl.uint32)
            return (c >> (4 * (slot & 1)).to(tl.uint32)) & 15
        return tl.load(code_ptr + slot, mask=mask, other=0).to(tl.uint32)

    @triton.jit
    def _block_max(slots_ptr, x, mask, start, size, g0, run0, seg_of_ptr, n_groups, epoch,
                   NVFP4: tl.constexpr, B: tl.constexpr, TILE: tl.constexpr):
        """Every block's max ``|x|`` of a tile of whole blocks (in registers, one atomic per
        block) into its slot, and (NVFP4) the tile's max over its finite blocks into its
        segment's slot, both tagged with ``epoch`` (:class:`~.triton_fp8.AmaxSlots`)."""
        bits = tl.where(mask, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0)
        first = g0 + (start - run0) // size
        if size == B:  # whole blocks of the format's length
            rows = tl.arange(0, TILE // B)
            blocks = tl.max(tl.reshape(bits, (TILE // B, B)), axis=1)
            valid = rows * B < tl.sum(mask.to(tl.int32), axis=0)
            tl.atomic_max(slots_ptr + first + rows, blocks.to(tl.int64) + epoch, mask=valid)
            finite = tl.max(tl.where(valid & (blocks < 0x7F800000), blocks, 0), axis=0)
        else:  # one shorter block
            one = tl.max(bits, axis=0)
            tl.atomic_max(slots_ptr + first, one.to(tl.int64) + epoch)
            finite = tl.where(one < 0x7F800000, one, 0)
        if NVFP4:
            seg = tl.load(seg_of_ptr + first).to(tl.int64)
            tl.atomic_max(slots_ptr + n_groups + seg, finite.to(tl.int64) + epoch)

    @triton.jit
    def _plus_residual(x, r_ptr, keep_ptr, offs, mask, KEEP: tl.constexpr):
        """``x + where(keep, r, 0)`` in FP32 (``r`` FP32 or BF16, ``keep`` a 0-dim flag)."""
        r = tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if KEEP:
            r = tl.where(tl.load(keep_ptr) != 0, r, 0.0)
        return x + r

    @triton.jit
    def _amax_kernel(x_ptr, r_ptr, keep_ptr, u_ptr, tiles_ptr, seg_of_ptr, slots_ptr,
                     n_groups, epoch, HAS_R: tl.constexpr, KEEP: tl.constexpr,
                     STORE_U: tl.constexpr, NVFP4: tl.constexpr, B: tl.constexpr,
                     TILE: tl.constexpr):
        """``u = x + where(keep, r, 0)`` (stored with ``STORE_U``) and the blocks' and
        segments' amax of ``u`` (:func:`_block_max`)."""
        offs, mask, g, start, size, g0, run0 = _tile(tiles_ptr, TILE)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        if HAS_R:
            x = _plus_residual(x, r_ptr, keep_ptr, offs, mask, KEEP)
            if STORE_U:
                tl.store(u_ptr + offs, x, mask=mask)
        _block_max(slots_ptr, x, mask, start, size, g0, run0, seg_of_ptr, n_groups, epoch,
                   NVFP4, B, TILE)

    @triton.jit
    def _bf16_bits(x):
        """The BF16 bits (int16) of FP32 ``x``, to nearest even (c10's; NaN: ``0x7FC0``)."""
        b = x.to(tl.uint32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        r = tl.where((b & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r)
        return r.to(tl.uint16).to(tl.int16, bitcast=True)

    @triton.jit
    def _encode_lane(u_ptr, r_ptr, keep_ptr, err_ptr, s_out, blk_out, elem, g, run0, size, mask,
                     slots_ptr,
                     n_groups, block_at_ptr, seg_at_ptr, seg_of_ptr, seg_start_ptr, where_ptr,
                     seeds_ptr, seed0, prefix, offset, HAS_R: tl.constexpr,
                     KEEP: tl.constexpr, HAS_ERR: tl.constexpr, ERR_BF16: tl.constexpr,
                     SEEDS: tl.constexpr, FMT: tl.constexpr, NVFP4: tl.constexpr,
                     EMAX: tl.constexpr, THRESHOLD: tl.constexpr):
        """The codes (uint32) of elements ``elem`` of blocks ``g``: their blocks' scales from
        the slots, written (and the segment's) by a block's first element; the rounding
        error ``u − value(code)·scale`` stored (FP32, or BF16 to nearest even); ``u`` plus
        ``where(keep, r, 0)`` with ``HAS_R``."""
        seg = tl.load(seg_of_ptr + g, mask=mask, other=0).to(tl.int64)
        scale, byte, s = _block_scale(slots_ptr, g, seg, mask, n_groups, NVFP4, EMAX, THRESHOLD)
        first = mask & ((elem - run0) % size == 0)
        tl.store(blk_out + tl.load(block_at_ptr + g, mask=first, other=0), byte.to(tl.uint8),
                 mask=first)
        if NVFP4:
            lead = first & (elem == tl.load(seg_start_ptr + seg, mask=first, other=-1))
            _store_f32(s_out + tl.load(seg_at_ptr + seg, mask=lead, other=0), s, lead)
        x = tl.load(u_ptr + elem, mask=mask, other=0.0)
        if HAS_R:  # Ũ again, as the amax pass made it (R is read before it is written)
            x = _plus_residual(x, r_ptr, keep_ptr, elem, mask, KEEP)
        q = tl.math.div_rn(x, tl.where(scale > 0.0, scale, 1.0))
        if SEEDS:
            u = _uniform(elem, g, mask, seg_of_ptr, seg_start_ptr, where_ptr, seeds_ptr, seed0,
                         prefix, offset, SEEDS)
            code = _round_stochastic(q, u, FMT)
        else:
            code = _round(q, FMT)
        if HAS_ERR:  # may be u itself: each element read before it is written
            err = x - _value(code, FMT) * scale
            if ERR_BF16:
                tl.store(err_ptr + elem, _bf16_bits(err), mask=mask)
            else:
                tl.store(err_ptr + elem, err, mask=mask)
        return code

    @triton.jit
    def _first_program(out_ptr, pad_lo, pad_hi, s_out, empty_ptr, n_empty, TILE: tl.constexpr):
        """Program 0's extra stores: the record's padding zeroed; the scale ``2⁻¹⁴⁹`` of every
        segment without a block (NVFP4)."""
        if tl.program_id(0) == 0:
            for p in range(pad_lo, pad_hi, TILE):
                at = p + tl.arange(0, TILE)
                tl.store(out_ptr + at, tl.zeros((TILE,), tl.uint8), mask=at < pad_hi)
            for k in range(0, n_empty, TILE):
                i = k + tl.arange(0, TILE)
                tiny = tl.full((TILE,), 1, tl.int32).to(tl.float32, bitcast=True)
                _store_f32(s_out + tl.load(empty_ptr + i, mask=i < n_empty, other=0), tiny,
                           i < n_empty)

    @triton.jit
    def _encode_kernel(u_ptr, r_ptr, keep_ptr, err_ptr, s_out, blk_out, code_out, rows_ptr,
                       slots_ptr, n_groups, block_at_ptr, seg_at_ptr, seg_of_ptr, seg_start_ptr,
                       where_ptr, seeds_ptr, seed0, prefix, offset, pad_lo, pad_hi, empty_ptr,
                       n_empty, HAS_R: tl.constexpr, KEEP: tl.constexpr, HAS_ERR: tl.constexpr,
                       ERR_BF16: tl.constexpr, SEEDS: tl.constexpr, FMT: tl.constexpr,
                       NVFP4: tl.constexpr, EMAX: tl.constexpr, THRESHOLD: tl.constexpr,
                       TILE: tl.constexpr):
        """The encoding pass: E2M1 over the placement's byte rows (``rows_ptr`` its
        ``pairs``: a lane per byte, its low and high elements), E4M3 over its tiles."""
        if FMT == 0:
            row = rows_ptr + 11 * tl.program_id(0)
            a = tl.arange(0, TILE // 2).to(tl.int64)
            byte = tl.load(row) + a
            mask = byte < tl.load(row + 1)
            code = tl.zeros(a.shape, tl.uint32)
            for k in tl.static_range(2):  # the low nibble's element, then the high one's
                elem = tl.load(row + 2 + 4 * k) + 2 * a
                size, run0 = tl.load(row + 4 + 4 * k), tl.load(row + 5 + 4 * k)
                lane = mask if k == 0 else a < tl.load(row + 10)
                code |= _encode_lane(
                    u_ptr, r_ptr, keep_ptr, err_ptr, s_out, blk_out, elem,
                    tl.load(row + 3 + 4 * k) + (elem - run0) // size, run0, size, lane,
                    slots_ptr, n_groups, block_at_ptr, seg_at_ptr, seg_of_ptr, seg_start_ptr,
                    where_ptr, seeds_ptr, seed0, prefix, offset, HAS_R, KEEP, HAS_ERR,
                    ERR_BF16, SEEDS, FMT, NVFP4, EMAX, THRESHOLD) << (4 * k)
            tl.store(code_out + byte, code.to(tl.uint8), mask=mask)
        else:
            offs, mask, g, start, size, g0, run0 = _tile(rows_ptr, TILE)
            code = _encode_lane(u_ptr, r_ptr, keep_ptr, err_ptr, s_out, blk_out, offs, g, run0,
                                size, mask, slots_ptr, n_groups, block_at_ptr, seg_at_ptr,
                                seg_of_ptr, seg_start_ptr, where_ptr, seeds_ptr, seed0, prefix,
                                offset, HAS_R, KEEP, HAS_ERR, ERR_BF16, SEEDS, FMT, NVFP4, EMAX,
                                THRESHOLD)
            tl.store(code_out + _places(rows_ptr, offs, g)[0], code.to(tl.uint8), mask=mask)
        _first_program(code_out, pad_lo, pad_hi, s_out, empty_ptr, n_empty, TILE)

    @triton.jit
    def _reduce_kernel(s_in, s_stride, blk_in, blk_stride, code_in, code_stride, n_senders,
                       out_ptr, tiles_ptr, block_at_ptr, seg_at_ptr, seg_of_ptr, slots_ptr,
                       n_groups, epoch, ticket_ptr, flag_ptr, divisor, SCATTER: tl.constexpr,
                       DIVIDE: tl.constexpr, FMT: tl.constexpr, NVFP4: tl.constexpr,
                       B: tl.constexpr, TILE: tl.constexpr):
        """``0 + Σ_r value(code_r)·scale_r`` in sender order (FP32) of the ``N`` payloads
        (rows of the three part pointers), and its blocks' and segments' amax; a
        reduce-scatter's end (``SCATTER``): no amax, the sum ``/ divisor`` (``DIVIDE``) and
        the flag "every value finite" instead (``triton_fp8._scattered``)."""
        offs, mask, g, start, size, g0, run0 = _tile(tiles_ptr, TILE)
        slot = _places(tiles_ptr, offs, g)[0]
        acc = tl.zeros((TILE,), tl.float32)  # from +0 (-0 + 0 = +0), sender after sender
        for r in range(0, n_senders):
            scale = _stored_scale(s_in + r * s_stride, blk_in + r * blk_stride, g, mask,
                                  block_at_ptr, seg_at_ptr, seg_of_ptr, NVFP4)
            acc += _value(_code_at(code_in + r * code_stride, slot, mask, FMT), FMT) * scale
        if SCATTER:
            _scattered(out_ptr, offs, acc, mask, ticket_ptr, flag_ptr, divisor, DIVIDE, TILE)
        else:
            tl.store(out_ptr + offs, acc, mask=mask)
            _block_max(slots_ptr, acc, mask, start, size, g0, run0, seg_of_ptr, n_groups,
                       epoch, NVFP4, B, TILE)

    @triton.jit
    def _decode_kernel(s_in, blk_in, code_in, out_ptr, tiles_ptr, block_at_ptr, seg_at_ptr,
                       seg_of_ptr, ticket_ptr, flag_ptr, divisor, flags_ptr, n, verdict_ptr,
                       skipped_ptr, DIVIDE: tl.constexpr, POISON: tl.constexpr,
                       VERDICT: tl.constexpr, FMT: tl.constexpr, NVFP4: tl.constexpr,
                       TILE: tl.constexpr):
        """``value(code)·scale`` (``/ divisor``) of every element; the flag "every stored
        scale finite" from the scales read (the ticket, ``triton_fp8._settle``: the last
        program writes it, NaN over every element unless finite with ``POISON``, and with
        ``VERDICT`` the step's verdict from it and ``flags[:n]``)."""
        offs, mask, g, start, size, g0, run0 = _tile(tiles_ptr, TILE)
        slot = _places(tiles_ptr, offs, g)[0]
        scale = _stored_scale(s_in, blk_in, g, mask, block_at_ptr, seg_at_ptr, seg_of_ptr, NVFP4)
        v = _value(_code_at(code_in, slot, mask, FMT), FMT) * scale
        if DIVIDE:
            v = tl.math.div_rn(v, tl.full(v.shape, divisor, tl.float32))
        tl.store(out_ptr + offs, v, mask=mask)
        _settle(out_ptr, tiles_ptr, ticket_ptr, flag_ptr, _nonfinite(scale, mask), flags_ptr, n,
                verdict_ptr, skipped_ptr, POISON, VERDICT, TILE, False)

class Encoded(NamedTuple):
    """One encode's outputs: ``u`` (``x + r``), the segment scales (FP32, NVFP4 only), the
    block scale bytes (E4M3 ``β`` or E8M0), the codes (packed for E2M1) and the error."""

    u: torch.Tensor
    segment_scales: torch.Tensor | None
    block_bytes: torch.Tensor
    codes: torch.Tensor
    error: torch.Tensor | None


def _element(fmt: str) -> int:
    if fmt not in FORMATS:
        raise ValueError(f"no fused kernels for {fmt!r}; these cover {FORMATS}")
    return E4M3 if fmt == "mxfp8" else E2M1


def block_length(fmt: str) -> int:
    """Elements per block: 16 for NVFP4, 32 for MX."""
    return 16 if _element(fmt) == E2M1 and fmt == "nvfp4" else 32


class Bound:
    """A placement bound to a format: each kernel a :class:`~.triton_fp8.Launch` with its grid,
    the arguments that do not change from call to call (the placement's maps and counts) and
    the constexprs, made once, so a call only adds its tensors, slots and flags (nothing per
    call grows with the segments)."""

    def __init__(self, p: Placement, fmt: str) -> None:
        element, nvfp4 = _element(fmt), fmt == "nvfp4"
        emax, threshold = _MX.get(fmt, (0, 0))
        self.p, self.fmt, self.nvfp4 = p, fmt, nvfp4
        grid = (p.tiles.shape[0],)
        rows = p.pairs if element == E2M1 else p.tiles
        maps = {"block_at_ptr": p.block_at, "seg_at_ptr": p.seg_at, "seg_of_ptr": p.seg_of}
        common = {"NVFP4": nvfp4, "TILE": TILE}
        self.amax = Launch(_amax_kernel, grid, tiles_ptr=p.tiles, seg_of_ptr=p.seg_of,
                           n_groups=p.n_groups, B=block_length(fmt), **common)
        self.encode = Launch(
            _encode_kernel, (rows.shape[0],), rows_ptr=rows, n_groups=p.n_groups, **maps,
            seg_start_ptr=p.seg_start, where_ptr=p.seg_where, empty_ptr=p.seg_empty,
            n_empty=p.n_empty if nvfp4 else 0, FMT=element, EMAX=emax, THRESHOLD=threshold,
            **common, **_NO_FUSION)
        self.reduce = Launch(_reduce_kernel, grid, tiles_ptr=p.tiles, **maps,
                             n_groups=p.n_groups, FMT=element, B=block_length(fmt), **common,
                             **_NO_FUSION, **triton_fp8.no_scatter(p.tiles))
        self.decode = Launch(_decode_kernel, grid, tiles_ptr=p.tiles, **maps, FMT=element,
                             **common, **_NO_FUSION)


def placement(groups: GroupMap, fmt: str, device: torch.device) -> Bound:
    """The placed maps of the codec's whole-bucket parts of ``groups``
    (:func:`~.block_records.whole_places`), bound to ``fmt``, made once per map."""
    def make() -> Bound:
        packed = _element(fmt) == E2M1
        return Bound(place(whole_places(groups, fmt == "nvfp4", packed), packed,
                           block_length(fmt), device), fmt)
    return groups.memo(("triton-fp4-placement", fmt, torch.device(device)), make)


def _memo_slots(groups: GroupMap, what: str, n: int, device: torch.device) -> AmaxSlots:
    return groups.memo(("triton-fp4-slots", what, torch.device(device)),
                       lambda: AmaxSlots(n, device))


def amax(x: torch.Tensor, b: Bound, amax_slots: AmaxSlots,
         residual: torch.Tensor | None = None, keep: torch.Tensor | None = None,
         u: torch.Tensor | None = None) -> torch.Tensor:
    """Every block's and segment's amax of ``u = x + where(keep, residual, 0)`` (``x``
    without a residual; ``residual`` FP32 or BF16, ``keep`` a 0-dim bool device tensor or
    ``None`` for true) in the next epoch of ``amax_slots``: what :func:`encode_placed`
    reads. ``u``: where ``u`` is written, else nowhere. One kernel."""
    bits, epoch = amax_slots.buffer, next(amax_slots.epochs)
    b.amax(x, x if residual is None else residual, keep_arg(x, keep), x if u is None else u,
           slots_ptr=bits, epoch=epoch, HAS_R=residual is not None, KEEP=keep is not None,
           STORE_U=u is not None)
    return bits


def keep_arg(x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """The kernels' keep pointer: the flag's byte, or any pointer (``x``) without one."""
    return x if keep is None else keep.view(torch.uint8)


def encode_placed(u: torch.Tensor, bits: torch.Tensor, b: Bound,
                  outs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                  error: torch.Tensor | None = None, seeds=None,
                  pad: tuple[int, int] = (0, 0),
                  feedback: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> None:
    """The scales (from the amax ``bits``) and codes of ``u`` written where ``b`` places
    them in the uint8 ``outs`` ``(segment scales, block scales, codes)`` (one buffer thrice
    for a record or a send buffer); bytes ``pad`` of ``outs[2]`` zeroed; with ``error``
    (FP32 or BF16, may be ``u`` itself) the rounding error at the values' places; ``seeds``
    (one per shard, or a :class:`.uniforms.StepSeed`): stochastic rounding.
    ``feedback=(R, keep)``: the values are ``u + where(keep, R, 0)`` (as :func:`amax` took
    them; ``error`` may be ``R``). One kernel."""
    mode, (table, seed0, prefix, offset) = seed_args(seeds, u.device)
    bf16 = error is not None and error.dtype == torch.bfloat16
    residual, keep = feedback or (None, None)
    b.encode(u, u if residual is None else residual, keep_arg(u, keep),
             u if error is None else error.view(torch.int16) if bf16 else error, *outs,
             slots_ptr=bits, seeds_ptr=b.p.seg_start if table is None else table, seed0=seed0,
             prefix=prefix, offset=offset, pad_lo=pad[0], pad_hi=pad[1],
             HAS_R=residual is not None, KEEP=keep is not None, HAS_ERR=error is not None,
             ERR_BF16=bf16, SEEDS=mode)


def reduce(rows: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor], b: Bound,
           amax_slots: AmaxSlots) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum, bits)``: ``0 + Σ_r value(code_r)·scale_{r,b}`` in sender order (FP32) of the
    ``N`` payloads whose parts are the rows of ``rows`` ``(segment scales' bytes or None,
    block scales, codes)`` (uint8 ``[N, ·]``, any row stride, placed as ``b`` says), and its
    blocks' and segments' amax in the next epoch of ``amax_slots``. One kernel."""
    s, blk, codes = rows
    s = blk if s is None else s
    out = torch.empty(b.p.numel, dtype=torch.float32, device=codes.device)
    bits, epoch = amax_slots.buffer, next(amax_slots.epochs)
    b.reduce(s, s.stride(0), blk, blk.stride(0), codes, codes.stride(0), codes.shape[0], out,
             slots_ptr=bits, epoch=epoch)
    return out, bits


def decode_placed(out: torch.Tensor, ins: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor],
                  b: Bound, ticket: torch.Tensor, divisor: int | None = None,
                  poison: bool = False, flag: torch.Tensor | None = None) -> torch.Tensor:
    """``out = value(code)·scale`` (``/ divisor`` when given) of the payloads in ``ins``
    ``(segment scales' bytes or None, block scales, codes)``, placed as ``b`` says; all NaN
    unless every stored scale is finite (``poison``). Returns that 0-dim bool flag, written
    into the 0-dim uint8 ``flag`` when given (a step's slot); one kernel, which decides the
    flag with the zeroed int64 ``ticket`` (:func:`ticket`; module notes)."""
    s, blk, codes = ins
    s = blk if s is None else s
    if flag is None:
        flag = torch.empty((), dtype=torch.uint8, device=out.device)
    plain = triton_fp8.decode_launches(b.decode, ticket)[0]  # (no step's decision here)
    plain(s, blk, codes, out, ticket_ptr=ticket, flag_ptr=flag, divisor=float(divisor or 1),
          DIVIDE=divisor is not None, POISON=poison)
    return flag.view(torch.bool)


def _part_sizes(groups: GroupMap, fmt: str) -> tuple[int, int, int]:
    """Bytes of the whole bucket's ``(segment scales, block scales, codes)``."""
    codes = (sum((n + 1) // 2 for n in groups.numels) if _element(fmt) == E2M1
             else sum(groups.numels))
    return (4 * len(groups.counts) if fmt == "nvfp4" else 0), len(groups.lengths), codes


def encode(x: torch.Tensor, groups: GroupMap, fmt: str, residual: torch.Tensor | None = None,
           error: bool = False, seeds=None, into: tuple | None = None,
           error_out: torch.Tensor | None = None) -> Encoded:
    """``fmt``'s payload of ``u = x (+ residual)`` over ``groups`` (module notes): the amax
    pass and the encoding pass. ``seeds`` (one per shard, ``None`` counting as 0): round
    stochastically with :mod:`.uniforms`' draws, else to nearest. ``into``: ``(segment
    scales or None, block bytes, codes)``, contiguous tensors the payload is written into,
    else new ones; ``error_out``: where the rounding error goes, ``x`` itself included,
    else a new vector (the stages' error feedback in place: :func:`encode_placed`'s
    ``feedback``)."""
    device = x.device
    b = placement(groups, fmt, device)
    slots = _memo_slots(groups, fmt, b.p.n_groups + b.p.n_segments, device)
    err = (error_out if error_out is not None else torch.empty_like(x)) if error else None
    u = x if residual is None else torch.empty_like(x)
    bits = amax(x, b, slots, residual, u=None if residual is None else u)
    sizes = _part_sizes(groups, fmt)
    s, block_bytes, codes = into or (None, None, None)
    if s is None and fmt == "nvfp4":
        s = torch.empty(sizes[0] // 4, dtype=torch.float32, device=device)
    if block_bytes is None:
        block_bytes = torch.empty(sizes[1], dtype=torch.uint8, device=device)
    if codes is None:
        codes = torch.empty(sizes[2], dtype=torch.uint8, device=device)
    encode_placed(u, bits, b, (block_bytes if s is None else s.view(torch.uint8),
                               block_bytes, codes), err, seeds)
    return Encoded(u, s, block_bytes, codes, err)


def decode_sum(groups: GroupMap, fmt: str, block_bytes: torch.Tensor, codes: torch.Tensor,
               segment_scales: torch.Tensor | None = None) -> torch.Tensor:
    """``0 + Σ_r value(code_r)·scale_{r,b}`` in sender order (FP32) of the ``N`` senders'
    payloads of ``groups`` (rows of ``block_bytes`` ``[N, G]``, ``codes`` ``[N, C]``,
    NVFP4's ``segment_scales`` ``[N, S]`` FP32 or their bytes; each row contiguous): one
    kernel (:func:`reduce`)."""
    b = placement(groups, fmt, codes.device)
    s = None if segment_scales is None else segment_scales.view(torch.uint8)
    return reduce((s, block_bytes, codes), b,
                  _memo_slots(groups, fmt, b.p.n_groups + b.p.n_segments, codes.device))[0]


def decode(out: torch.Tensor, groups: GroupMap, fmt: str, block_bytes: torch.Tensor,
           codes: torch.Tensor, segment_scales: torch.Tensor | None = None,
           poison: bool = False) -> torch.Tensor:
    """``out = value(code)·scale_b`` (FP32) of one payload; returns the 0-dim bool flag
    "every block scale finite" (every value NaN unless it is set, with ``poison``)."""
    s = None if segment_scales is None else segment_scales.view(torch.uint8)
    return decode_placed(out, (s, block_bytes, codes), placement(groups, fmt, out.device),
                         groups.memo(("triton-fp4-ticket", torch.device(out.device)),
                                     lambda: triton_fp8.ticket(out.device)), poison=poison)


def encode_whole(codec, x: torch.Tensor, shards, seeds=None, error: bool = False,
                 error_out: torch.Tensor | None = None):
    """``(wholes, error or None)`` as ``codec.encode_whole`` returns them (each kind of part
    one tensor for the whole bucket; the error in ``error_out`` where given) from the
    kernels, or ``None`` where they do not run (not available, no groups, or a failure on
    CUDA): the caller's torch path then."""
    groups = group_map(shards)
    if not (groups.lengths and available(x)):
        return None
    stochastic = codec.rounding == "stochastic"

    def run():
        enc = encode(x, groups, codec.format, error=error, error_out=error_out,
                     seeds=(seeds or [None] * len(groups)) if stochastic else None)
        wholes = [enc.block_bytes, enc.codes]
        if enc.segment_scales is not None:
            wholes.insert(0, enc.segment_scales.view(torch.uint8))
        return wholes, enc.error
    return guarded(run)


def encode_shards(codec, x: torch.Tensor, shards, seeds=None, error: bool = False):
    """``codec.encode_shards(x, shards, seeds)``'s parts (``(parts, error)`` with ``error``),
    cut from :func:`encode_whole`'s, or ``None`` where the kernels do not run."""
    groups = group_map(shards)
    fused = encode_whole(codec, x, groups, seeds, error)
    if fused is None:
        return None
    wholes, err = fused
    sizes = groups.memo(("triton-parts", codec),
                        lambda: tuple(zip(*(codec.part_bytes(g) for g in groups))))
    parts = interleave(*(whole.split(size) for whole, size in zip(wholes, sizes)))
    return (parts, err) if error else parts


def decode_whole(codec, out: torch.Tensor, wholes, shards, check: bool = True,
                 poison: bool = False) -> tuple[bool, torch.Tensor | None]:
    """``(ran, flag)``: ``codec.decode_whole``'s decode into ``out`` and its return value
    from the kernels; ``ran`` false where they do not run (as :func:`encode_whole`)."""
    groups = group_map(shards)
    if not (groups.lengths and available(out)):
        return False, None

    def run():
        s = wholes[0].view(torch.float32) if len(wholes) == 3 else None
        finite = decode(out, groups, codec.format, wholes[-2], wholes[-1], s, poison)
        return True, (finite if check and not poison else None)
    done = guarded(run)
    return (False, None) if done is None else done


def decode_shards(codec, out: torch.Tensor, parts, shards, check: bool = True,
                  poison: bool = False) -> tuple[bool, torch.Tensor | None]:
    """:func:`decode_whole` of ``codec.decode_shards``' parts, each kind joined."""
    k = 3 if codec.format == "nvfp4" else 2
    wholes = [joined(parts[p::k], align=4 if k == 3 and p == 0 else 1) for p in range(k)]
    return decode_whole(codec, out, wholes, shards, check, poison)
