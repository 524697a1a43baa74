"""Fused Triton kernels of the block-scaled codecs' batched paths (NVFP4, MXFP4, MXFP8), bit
for bit the torch reference's.

The formats are :mod:`.fp4`'s (NVFP4: E2M1 codes, an E4M3 scale ``β_b`` per block of 16,
an FP32 scale ``s`` per segment) and :mod:`.mx`'s (MXFP4 / MXFP8: E2M1 / E4M3 codes, an
E8M0 scale ``2^e`` per block of 32), rounding to nearest even or stochastically (with
:mod:`.uniforms`' counter-based draw, which the kernels compute from the seeds, the segment
and the element's index). Each stage is one pass over the elements:

Stochastic keys are mixed in the encoding pass from the shards' seeds (one int64 each, a
small copy per call) and a per-map ``(shard, index in it)`` of every segment, so nothing per
call is ``O(segments)`` on the host.

* :func:`encode` — ``u = x (+ r)`` and every block's max ``|u|`` (whole blocks reduced in
  registers, one atomic max on the bits per block); the scales, one pass over the blocks
  (NVFP4: one more for the segments' amax over their finite blocks); then the codes of
  ``u / d_b`` (``d_b`` the block's scale, 1 where that is 0 or NaN), packed two per byte
  for E2M1, and, optionally, the sender's rounding error ``u − value(code)·scale_b``;
* :func:`decode` — ``value(code)·scale_b``; :func:`decode_sum` — the ``N`` senders' copies
  of a shard decoded and summed in FP32 in sender order. Both first take the blocks' FP32
  scales from the payload in a pass over the blocks, counting the non-finite ones: the
  finite flag, and ``poison`` (every value NaN when any scale is not finite, as
  :func:`~.base.poison_scales_` does).

Packed codes are laid out as :func:`~.fp4.pack_shards` lays them: each shard's ``⌈n/2⌉``
bytes, element ``2i`` of the shard in the low nibble of its byte ``i``. The packed kernels
walk a *byte tile map* (:func:`byte_tiles`, made once per :class:`~.groups.GroupMap`): a
tile is at most ``TILE / 2`` bytes of one shard whose low and high elements each lie in one
run of equal-length blocks, ``(first byte, end, first element, shard end, g₀, length, run
start)`` for the low elements and ``(g₀, length, run start)`` for the high ones (they differ
only in a one-byte tile that straddles two runs: a segment of odd length).

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
from .base import group_runs, interleave, joined
from .groups import GroupMap, group_map
from .triton_fp8 import _INTERPRET, _NO_FUSION, TILE, triton

if triton is not None:
    import triton.language as tl

    from .triton_fp8 import _e4m3_round, _e4m3_value, _tile

__all__ = ["FORMATS", "Encoded", "amax_slots", "available", "byte_tiles", "decode", "decode_shards",
           "decode_sum", "decode_whole", "encode", "encode_shards", "encode_whole", "guarded",
           "torch_only"]

FORMATS = ("nvfp4", "mxfp4", "mxfp8")
E2M1, E4M3 = 0, 1  # element formats (constexpr)
BLOCK = 1024  # blocks per program of the per-block passes
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
    """``run()``, or ``None`` after a warning when a kernel fails on CUDA (remembered)."""
    if _INTERPRET:
        return run()
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 - any compile or launch failure: the torch path
        _STATE["broken"] = True
        warnings.warn(f"geofp8: the block-scaled Triton kernels failed ({exc!r}); the torch "
                      "path runs from now on", RuntimeWarning, stacklevel=3)
        return None


def byte_tiles(groups: GroupMap, device: torch.device) -> torch.Tensor:
    """The byte tile map of ``groups`` (module notes), int64 ``[T, 10]`` on ``device``, made
    once per map."""
    def make() -> torch.Tensor:
        runs = [(first, first + count * size, g0, size) for first, g0, count, size
                in group_runs(groups.segments) if count and size]
        rows, j, pos, byte, step = [], 0, 0, 0, TILE // 2

        def run_at(e: int) -> tuple[int, int, int]:
            nonlocal j
            while runs[j][1] <= e:
                j += 1
            first, _, g0, size = runs[j]
            return g0, size, first

        for n in groups.numels:
            stop = pos + n
            while pos < stop:
                low = run_at(pos)
                end = min(runs[j][1], stop)
                pairs = (end - pos) // 2
                rows += [(byte + a, byte + min(a + step, pairs), pos + 2 * a, stop, *low, *low)
                         for a in range(0, pairs, step)]
                pos, byte = pos + 2 * pairs, byte + pairs
                if pos < end:  # a byte whose high element is in the next run, or padding
                    high = run_at(pos + 1) if pos + 1 < stop else low
                    rows.append((byte, byte + 1, pos, stop, *low, *high))
                    pos, byte = pos + 2, byte + 1
            pos = stop
        return torch.tensor(rows or [(0, 0, 0, 0, 0, 1, 0, 0, 1, 0)],
                            dtype=torch.int64).to(device)
    return groups.memo(("triton-byte-tiles", TILE, torch.device(device)), make)


def _segment_of(groups: GroupMap, device: torch.device) -> torch.Tensor:
    """The segment of every block (int32, on ``device``), made once per map."""
    return groups.memo(("triton-segment-of", torch.device(device)), lambda: torch.repeat_interleave(
        torch.arange(len(groups.counts), dtype=torch.int32),
        torch.tensor(groups.counts, dtype=torch.long)).to(device))


def _segment_shards(groups: GroupMap, device: torch.device) -> torch.Tensor:
    """Every segment's ``(shard, index in its shard)`` (int64 ``[S, 2]``, on ``device``): what
    its stochastic key is mixed from with the shard's seed, made once per map."""
    return groups.memo(("triton-segment-shards", torch.device(device)), lambda: torch.tensor(
        [(j, i) for j, shard in enumerate(groups) for i in range(len(shard))] or [(0, 0)],
        dtype=torch.int64).to(device))


def _shard_seeds(seeds, device: torch.device) -> torch.Tensor:
    """The shards' seeds (``None`` counting as 0), int64 on ``device``: one small copy per
    call, ``O(shards)``, from pinned memory without a host sync."""
    return torch.tensor([seed or 0 for seed in seeds], dtype=torch.int64,
                        pin_memory=device.type == "cuda").to(device, non_blocking=True)


def _segment_starts(groups: GroupMap, device: torch.device) -> torch.Tensor:
    """The first element of every segment (int64, on ``device``), made once per map."""
    def make() -> torch.Tensor:
        sizes = torch.tensor([sum(seg) for seg in groups.segments], dtype=torch.int64)
        return (torch.cumsum(sizes, 0) - sizes).to(device)
    return groups.memo(("triton-segment-starts", torch.device(device)), make)


if triton is not None:

    @triton.jit
    def _byte_tile(tiles_ptr, BYTES: tl.constexpr):
        """``(byte, mask, low element, high element, high mask, low block, high block)``."""
        row = tiles_ptr + 10 * tl.program_id(0)
        start = tl.load(row)
        offs = start + tl.arange(0, BYTES).to(tl.int64)
        mask = offs < tl.load(row + 1)
        lo = tl.load(row + 2) + 2 * (offs - start)
        hi = lo + 1
        g_lo = tl.load(row + 4) + (lo - tl.load(row + 6)) // tl.load(row + 5)
        g_hi = tl.load(row + 7) + (hi - tl.load(row + 9)) // tl.load(row + 8)
        return offs, mask, lo, hi, mask & (hi < tl.load(row + 3)), g_lo, g_hi

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
    def _uniform(offs, g, mask, seg_ptr, start_ptr, where_ptr, seeds_ptr):
        """:func:`.uniforms.uniforms`' draw for elements ``offs`` of blocks ``g``: the key
        ``mix_seed(seed of the shard, index of the segment in it)`` mixed here, per element,
        from the shards' seeds and the map's ``(shard, index)`` of every segment."""
        seg = tl.load(seg_ptr + g, mask=mask, other=0).to(tl.int64)
        j = offs - tl.load(start_ptr + seg, mask=mask, other=0)
        seed = tl.load(seeds_ptr + tl.load(where_ptr + 2 * seg, mask=mask, other=0),
                       mask=mask, other=0).to(tl.uint64, bitcast=True)
        index = tl.load(where_ptr + 2 * seg + 1, mask=mask, other=0).to(tl.uint64, bitcast=True)
        key = _splitmix(_splitmix(tl.full(seed.shape, 0x9E3779B97F4A7C15, tl.uint64), seed),
                        index) >> 1
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
    def _encode_lanes(x_ptr, scale_ptr, err_ptr, offs, g, mask, seg_ptr, start_ptr, where_ptr,
                      seeds_ptr, HAS_ERR: tl.constexpr, STOCHASTIC: tl.constexpr,
                      FMT: tl.constexpr):
        """The codes (uint32) of elements ``offs`` of blocks ``g``; their errors stored."""
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        s = tl.load(scale_ptr + g, mask=mask, other=1.0)
        q = tl.math.div_rn(x, tl.where(s > 0.0, s, 1.0))
        if STOCHASTIC:
            code = _round_stochastic(
                q, _uniform(offs, g, mask, seg_ptr, start_ptr, where_ptr, seeds_ptr), FMT)
        else:
            code = _round(q, FMT)
        if HAS_ERR:
            tl.store(err_ptr + offs, x - _value(code, FMT) * s, mask=mask)
        return code

    @triton.jit
    def _encode_packed_kernel(x_ptr, scale_ptr, codes_ptr, err_ptr, tiles_ptr, seg_ptr,
                              start_ptr, where_ptr, seeds_ptr, HAS_ERR: tl.constexpr,
                              STOCHASTIC: tl.constexpr, BYTES: tl.constexpr):
        offs, mask, lo, hi, mask_hi, g_lo, g_hi = _byte_tile(tiles_ptr, BYTES)
        low = _encode_lanes(x_ptr, scale_ptr, err_ptr, lo, g_lo, mask, seg_ptr, start_ptr,
                            where_ptr, seeds_ptr, HAS_ERR, STOCHASTIC, 0)
        high = _encode_lanes(x_ptr, scale_ptr, err_ptr, hi, g_hi, mask_hi, seg_ptr, start_ptr,
                             where_ptr, seeds_ptr, HAS_ERR, STOCHASTIC, 0)
        tl.store(codes_ptr + offs, (low | (high << 4)).to(tl.uint8), mask=mask)

    @triton.jit
    def _encode_bytes_kernel(x_ptr, scale_ptr, codes_ptr, err_ptr, tiles_ptr, seg_ptr,
                             start_ptr, where_ptr, seeds_ptr, HAS_ERR: tl.constexpr,
                             STOCHASTIC: tl.constexpr, TILE: tl.constexpr):
        offs, mask, g, start, size, g0, run0 = _tile(tiles_ptr, TILE)
        code = _encode_lanes(x_ptr, scale_ptr, err_ptr, offs, g, mask, seg_ptr, start_ptr,
                             where_ptr, seeds_ptr, HAS_ERR, STOCHASTIC, 1)
        tl.store(codes_ptr + offs, code.to(tl.uint8), mask=mask)

    @triton.jit
    def _block_amax_kernel(x_ptr, r_ptr, u_ptr, tiles_ptr, bits_ptr, HAS_R: tl.constexpr,
                           B: tl.constexpr, TILE: tl.constexpr):
        """``u = x (+ r)`` and every block's max ``|u|`` (bits, atomic max): a tile of whole
        blocks of the format's length ``B`` reduces them in registers, one atomic per block;
        the short blocks (a tensor's last) take one per element (:mod:`.triton_fp8`)."""
        offs, mask, g, start, size, g0, run0 = _tile(tiles_ptr, TILE)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        if HAS_R:
            x = x + tl.load(r_ptr + offs, mask=mask, other=0.0)
            tl.store(u_ptr + offs, x, mask=mask)
        bits = tl.where(mask, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0)
        if size == B:  # whole blocks (a tile holds whole groups)
            rows = tl.arange(0, TILE // B)
            tl.atomic_max(bits_ptr + g0 + (start - run0) // B + rows,
                          tl.max(tl.reshape(bits, (TILE // B, B)), axis=1),
                          mask=rows * B < tl.sum(mask.to(tl.int32), axis=0))
        else:
            tl.atomic_max(bits_ptr + g, bits, mask=mask)

    @triton.jit
    def _segment_amax_kernel(bits_ptr, seg_ptr, seg_bits_ptr, n, BLOCK: tl.constexpr):
        """Every segment's max over its finite blocks' amax (bits, atomic)."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        bits = tl.load(bits_ptr + offs, mask=offs < n, other=0)
        mask = (offs < n) & (bits < 0x7F800000)
        tl.atomic_max(seg_bits_ptr + tl.load(seg_ptr + offs, mask=mask, other=0), bits,
                      mask=mask)

    @triton.jit
    def _segment_scale(amax):
        """``max(A / (6·448), 2⁻¹⁴⁹)`` (FP32)."""
        tiny = tl.full(amax.shape, 1, tl.int32).to(tl.float32, bitcast=True)
        return tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, 2688.0, tl.float32)), tiny)

    @triton.jit
    def _nvfp4_scales_kernel(bits_ptr, seg_ptr, seg_bits_ptr, s_ptr, code_ptr, scale_ptr,
                             n, n_seg, BLOCK: tl.constexpr):
        """``s = max(A / 2688, 2⁻¹⁴⁹)`` of the segments; each block's E4M3 ``β`` (the
        smallest ``≥ a / (6 s)``, NaN ``0x7F`` for a non-finite block) and ``β·s``."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        seg_amax = tl.load(seg_bits_ptr + offs, mask=offs < n_seg, other=0).to(
            tl.float32, bitcast=True)
        s = _segment_scale(seg_amax)
        tl.store(s_ptr + offs, s, mask=offs < n_seg)
        mask = offs < n
        bits = tl.load(bits_ptr + offs, mask=mask, other=0)
        seg = tl.load(seg_ptr + offs, mask=mask, other=0)
        seg_amax = tl.load(seg_bits_ptr + seg, mask=mask, other=0).to(tl.float32, bitcast=True)
        s = _segment_scale(seg_amax)
        r = tl.minimum(tl.math.div_rn(bits.to(tl.float32, bitcast=True), 6.0 * s), 448.0)
        code, value = _e4m3_round(r)
        code = tl.where(bits < 0x7F800000, code + (value < r).to(tl.uint32), 0x7F)
        tl.store(code_ptr + offs, code.to(tl.uint8), mask=mask)
        tl.store(scale_ptr + offs, _e4m3_value(code) * s, mask=mask)

    @triton.jit
    def _e8m0_value(byte):
        """``2^(byte − 127)`` (FP32; 0: the subnormal ``2⁻¹²⁷``, ``0xFF``: NaN)."""
        bits = tl.where(byte == 0, 0x00400000, tl.where(byte == 0xFF, 0x7FC00000, byte << 23))
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _mx_scales_kernel(bits_ptr, byte_ptr, scale_ptr, n, EMAX: tl.constexpr,
                          THRESHOLD: tl.constexpr, BLOCK: tl.constexpr):
        """E8M0 ``e`` (the smallest with ``a ≤ fmax·2^e``, in ``[−127, 127]``; ``0xFF`` for a
        non-finite block) from the amax bits, as ``frexp`` gives it."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        bits = tl.load(bits_ptr + offs, mask=mask, other=0)
        k = (bits >> 23) - 126  # amax = m·2^k, m in [0.5, 1), for a normal amax
        e = k - EMAX - 1 + ((bits & 0x7FFFFF) > THRESHOLD).to(tl.int32)
        e = tl.where(bits == 0, -EMAX - 1, tl.where(bits < 0x00800000, -127, e))
        byte = tl.where(bits < 0x7F800000, tl.minimum(tl.maximum(e, -127), 127) + 127, 0xFF)
        tl.store(byte_ptr + offs, byte.to(tl.uint8), mask=mask)
        tl.store(scale_ptr + offs, _e8m0_value(byte.to(tl.uint32)), mask=mask)

    @triton.jit
    def _payload_scales_kernel(code_ptr, code_stride, s_ptr, s_stride, seg_ptr, scale_ptr,
                               bad_ptr, n, NVFP4: tl.constexpr, BLOCK: tl.constexpr):
        """Sender ``r``'s FP32 block scales from its payload (NVFP4: ``β·s``, ``s`` read as
        the bytes of row ``r`` of ``s_ptr``; MX: ``2^e``) into row ``r`` of ``scale``; a
        non-finite one counted in ``bad``."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        r = tl.program_id(1).to(tl.int64)
        mask = offs < n
        code = tl.load(code_ptr + r * code_stride + offs, mask=mask, other=0).to(tl.uint32)
        if NVFP4:  # the FP32 segment scale from its 4 bytes (a record need not be aligned)
            at = s_ptr + r * s_stride + 4 * tl.load(seg_ptr + offs, mask=mask, other=0)
            s = tl.zeros(offs.shape, tl.uint32)
            for k in tl.static_range(4):
                s |= tl.load(at + k, mask=mask, other=0).to(tl.uint32) << (8 * k)
            scale = _e4m3_value(code) * s.to(tl.float32, bitcast=True)
        else:
            scale = _e8m0_value(code)
        tl.store(scale_ptr + r * n + offs, scale, mask=mask)
        inf_or_nan = (scale.to(tl.uint32, bitcast=True) & 0x7F800000) == 0x7F800000
        bad = tl.where(mask & inf_or_nan, 1, 0)
        tl.atomic_max(bad_ptr, tl.max(bad, 0))

    @triton.jit
    def _code_at(ptr, mask, shift, FMT: tl.constexpr):
        """The codes at ``ptr`` (uint32): a byte, or its nibble at ``shift`` for E2M1."""
        c = tl.load(ptr, mask=mask, other=0).to(tl.uint32)
        if FMT == 0:
            c = (c >> shift) & 15
        return c

    @triton.jit
    def _sum_lanes(codes_ptr, code_stride, byte, shift, scale_ptr, g, n_groups, mask,
                   n_senders, FMT: tl.constexpr, SUM: tl.constexpr):
        """``Σ_r value(code_r)·scale_{r,g}`` from +0 (``SUM``), or sender 0's value."""
        if SUM:
            acc = tl.zeros(byte.shape, tl.float32)
            for r in range(0, n_senders):
                c = _code_at(codes_ptr + r * code_stride + byte, mask, shift, FMT)
                acc += _value(c, FMT) * tl.load(scale_ptr + r * n_groups + g, mask=mask,
                                                other=1.0)
            return acc
        c = _code_at(codes_ptr + byte, mask, shift, FMT)
        return _value(c, FMT) * tl.load(scale_ptr + g, mask=mask, other=1.0)

    @triton.jit
    def _decode_kernel(codes_ptr, code_stride, scale_ptr, out_ptr, tiles_ptr, bad_ptr,
                       n_senders, n_groups, FMT: tl.constexpr, SUM: tl.constexpr,
                       POISON: tl.constexpr, TILE: tl.constexpr):
        if FMT == 0:  # packed: byte tiles, two lanes
            offs, mask, lo, hi, mask_hi, g_lo, g_hi = _byte_tile(tiles_ptr, TILE // 2)
            low = _sum_lanes(codes_ptr, code_stride, offs, 0, scale_ptr, g_lo, n_groups, mask,
                             n_senders, FMT, SUM)
            high = _sum_lanes(codes_ptr, code_stride, offs, 4, scale_ptr, g_hi, n_groups,
                              mask_hi, n_senders, FMT, SUM)
            if POISON:
                low = tl.where(tl.load(bad_ptr) != 0, float("nan"), low)
                high = tl.where(tl.load(bad_ptr) != 0, float("nan"), high)
            tl.store(out_ptr + lo, low, mask=mask)
            tl.store(out_ptr + hi, high, mask=mask_hi)
        else:
            offs, mask, g, start, size, g0, run0 = _tile(tiles_ptr, TILE)
            value = _sum_lanes(codes_ptr, code_stride, offs, 0, scale_ptr, g, n_groups, mask,
                               n_senders, FMT, SUM)
            if POISON:
                value = tl.where(tl.load(bad_ptr) != 0, float("nan"), value)
            tl.store(out_ptr + offs, value, mask=mask)


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


def _tiles(groups: GroupMap, fmt: str, device: torch.device) -> torch.Tensor:
    return (byte_tiles if _element(fmt) == E2M1 else triton_fp8.tiles)(groups, device)


def amax_slots(groups: GroupMap, fmt: str) -> int:
    """The int32 amax slots :func:`encode` takes: one per block (and per segment, NVFP4)."""
    return len(groups.lengths) + (len(groups.counts) if fmt == "nvfp4" else 0)


def encode(x: torch.Tensor, groups: GroupMap, fmt: str, residual: torch.Tensor | None = None,
           error: bool = False, seeds=None, into: tuple | None = None,
           bits: torch.Tensor | None = None, error_out: torch.Tensor | None = None) -> Encoded:
    """``fmt``'s payload of ``u = x (+ residual)`` over ``groups`` (module notes): the amax
    pass, one or two per-block passes, the encoding pass. ``seeds`` (one per shard, ``None``
    counting as 0): round stochastically with :mod:`.uniforms`' draws, else to nearest.
    ``into``: ``(segment scales or None, block bytes, codes)``, contiguous tensors the
    payload is written into (e.g. views of the record it travels in), else new ones;
    ``bits``: zeroed int32 amax slots to use (:func:`amax_slots` of ``groups``);
    ``error_out``: where the rounding error goes, ``x`` itself included (each element is
    read by the encoding pass before its error is written), else a new vector."""
    element, device = _element(fmt), x.device
    n_groups, n_seg = len(groups.lengths), len(groups.counts)
    if bits is None:
        bits = torch.zeros(amax_slots(groups, fmt), dtype=torch.int32, device=device)
    u = x if residual is None else torch.empty_like(x)
    tiles = triton_fp8.tiles(groups, device)
    _block_amax_kernel[(tiles.shape[0],)](x, x if residual is None else residual, u, tiles,
                                          bits, HAS_R=residual is not None,
                                          B=16 if fmt == "nvfp4" else 32, TILE=TILE)
    s, block_bytes, codes = into or (None, None, None)
    if block_bytes is None:
        block_bytes = torch.empty(n_groups, dtype=torch.uint8, device=device)
    scale = torch.empty(n_groups, dtype=torch.float32, device=device)
    if fmt == "nvfp4":
        seg, seg_bits = _segment_of(groups, device), bits[n_groups:]
        _segment_amax_kernel[(triton.cdiv(n_groups, BLOCK),)](bits, seg, seg_bits, n_groups,
                                                              BLOCK=BLOCK)
        if s is None:
            s = torch.empty(n_seg, dtype=torch.float32, device=device)
        _nvfp4_scales_kernel[(triton.cdiv(max(n_groups, n_seg), BLOCK),)](
            bits, seg, seg_bits, s, block_bytes, scale, n_groups, n_seg, BLOCK=BLOCK)
    else:
        emax, threshold = _MX[fmt]
        _mx_scales_kernel[(triton.cdiv(n_groups, BLOCK),)](bits, block_bytes, scale, n_groups,
                                                           EMAX=emax, THRESHOLD=threshold,
                                                           BLOCK=BLOCK)
    numel = u.numel()
    if codes is None:
        codes = torch.empty(sum((n + 1) // 2 for n in groups.numels) if element == E2M1
                            else numel, dtype=torch.uint8, device=device)
    err = (error_out if error_out is not None else torch.empty_like(u)) if error else None
    tiles = _tiles(groups, fmt, device)
    kernel = _encode_packed_kernel if element == E2M1 else _encode_bytes_kernel
    size = {"BYTES": TILE // 2} if element == E2M1 else {"TILE": TILE}
    stochastic = seeds is not None
    kernel[(tiles.shape[0],)](u, scale, codes, u if err is None else err, tiles,
                              _segment_of(groups, device), _segment_starts(groups, device),
                              _segment_shards(groups, device),
                              _shard_seeds(seeds, device) if stochastic else codes,
                              HAS_ERR=error, STOCHASTIC=stochastic, **size, **_NO_FUSION)
    return Encoded(u, s, block_bytes, codes, err)


def decode_sum(groups: GroupMap, fmt: str, block_bytes: torch.Tensor, codes: torch.Tensor,
               segment_scales: torch.Tensor | None = None, poison: bool = False,
               out: torch.Tensor | None = None, total: bool = True,
               bad: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, bad)``: ``0 + Σ_r value(code_r)·scale_{r,b}`` in sender order (FP32) of the
    ``N`` senders' payloads of ``groups`` (rows of ``block_bytes`` ``[N, G]``, ``codes``
    ``[N, C]``, NVFP4's ``segment_scales`` ``[N, S]``; each row contiguous), and ``bad``, a
    0-dim int32 tensor, non-zero when any block scale is not finite. ``poison``: every value
    NaN then. ``total=False`` (one sender): its values, not added to ``+0``. The segment
    scales may be the rows' bytes (uint8 ``[N, 4·S]``, any alignment); ``bad``: a zeroed
    0-dim int32 tensor to use."""
    element, device = _element(fmt), codes.device
    n_senders, n_groups = codes.shape[0], len(groups.lengths)
    scale = torch.empty(n_senders, n_groups, dtype=torch.float32, device=device)
    if bad is None:
        bad = torch.zeros((), dtype=torch.int32, device=device)
    nvfp4 = fmt == "nvfp4"
    s = segment_scales.view(torch.uint8) if nvfp4 else scale
    _payload_scales_kernel[(triton.cdiv(n_groups, BLOCK), n_senders)](
        block_bytes, block_bytes.stride(0), s, s.stride(0),
        _segment_of(groups, device) if nvfp4 else block_bytes, scale, bad, n_groups,
        NVFP4=nvfp4, BLOCK=BLOCK, **_NO_FUSION)
    if out is None:
        out = torch.empty(sum(groups.numels), dtype=torch.float32, device=device)
    tiles = _tiles(groups, fmt, device)
    _decode_kernel[(tiles.shape[0],)](codes, codes.stride(0), scale, out, tiles, bad, n_senders,
                                      n_groups, FMT=element, SUM=total, POISON=poison,
                                      TILE=TILE, **_NO_FUSION)
    return out, bad


def decode(out: torch.Tensor, groups: GroupMap, fmt: str, block_bytes: torch.Tensor,
           codes: torch.Tensor, segment_scales: torch.Tensor | None = None,
           poison: bool = False) -> torch.Tensor:
    """``out = value(code)·scale_b`` (FP32) of one payload; returns ``bad`` (as
    :func:`decode_sum`)."""
    rows = [t[None] if t is not None else None for t in (block_bytes, codes, segment_scales)]
    return decode_sum(groups, fmt, *rows, poison=poison, out=out, total=False)[1]


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
        bad = decode(out, groups, codec.format, wholes[-2], wholes[-1], s, poison)
        return True, (bad.eq(0) if check and not poison else None)
    done = guarded(run)
    return (False, None) if done is None else done


def decode_shards(codec, out: torch.Tensor, parts, shards, check: bool = True,
                  poison: bool = False) -> tuple[bool, torch.Tensor | None]:
    """:func:`decode_whole` of ``codec.decode_shards``' parts, each kind joined."""
    k = 3 if codec.format == "nvfp4" else 2
    wholes = [joined(parts[p::k], align=4 if k == 3 and p == 0 else 1) for p in range(k)]
    return decode_whole(codec, out, wholes, shards, check, poison)
