"""Every fused Triton kernel compiled for an H100 (sm_90) without a GPU, as the library launches it.

What the interpreter (``TRITON_INTERPRET=1``, the bit-for-bit tests) cannot show: that a
kernel compiles for a real GPU at all (where it does not, the launch fails on the user's
H100 and the torch path takes over for good: a silent performance cliff), and what its PTX
does with floating point. Triton's own ptxas makes an sm_90 cubin here (``triton.compile``,
no GPU needed) of every kernel :func:`gpu_check.triton_kernels` finds (:data:`KERNELS` has
an entry for each, with each of its constexprs, or the first test fails), in the constexpr
variants its launch sites give it (the ``Launch`` / ``.bind`` sites of ``comm/plan.py`` and
``comm/block_plan.py``, the calls of ``codecs/triton_*.py``: read by hand, each entry's
comment says which), with the FMA contraction option those launches pass and the types of
the pointers a variant reads (one it does not read may be given any tensor). Each asserts:

* a cubin;
* the kernels whose bits must equal the torch reference (all but the map kernel): no fused
  multiply-add and no FP32 multiply ptxas may contract into one (it may a ``mul`` and an
  ``add`` without rounding modifiers), every FP32 division ``div.rn``, no approximate or
  flush-to-zero instruction but libdevice's floor (:data:`_ROUGH`);
* the map kernel: its ``tl.dot`` in IEEE FP32, not TF32 (it sums in another order than the
  BLAS by design, bounded in ``codecs/triton_map.py``: FMAs are expected there);
* a kernel that takes a ticket (``triton_fp8._settle``: the gathered decodes, the map back,
  a reduce-scatter's end) adds to it with an ``acq_rel`` atomic, the memory ordering
  ``_settle`` documents.

A kernel's variants multiply (141 in all, 60 of the block encode: 100 s to compile here), so
each kernel compiles a subset in which every pair of settings found together in one of its
variants is found together again (:func:`all_pairs`): every constexpr branch, and every two
of them together, compiled at least once.
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch

pytest.importorskip("triton")

from geofp8.codecs import triton_fp4, triton_fp8, triton_map, triton_stats  # noqa: E402
from geofp8.config import GeoFP8Config  # noqa: E402
from geofp8.tools import gpu_check  # noqa: E402


def _product(*axes: list[dict]) -> list[dict]:
    """Every merge of one dict from each axis."""
    return [{k: v for d in choice for k, v in d.items()} for choice in itertools.product(*axes)]


def _flags(names: str, *rows: str) -> list[dict]:
    """A dict per row of ``T`` / ``F`` letters, one for each of the constexprs ``names``."""
    return [{n: c == "T" for n, c in zip(names.split(), row, strict=True)} for row in rows]


def _formats(*keys: str) -> list[dict]:
    """The block formats' constexprs among ``keys`` (as ``triton_fp4.Bound`` binds them),
    each distinct set once (MXFP4 and MXFP8 share a block length)."""
    every = [dict(FMT=triton_fp4._element(f), NVFP4=f == "nvfp4", B=triton_fp4.block_length(f),
                  EMAX=triton_fp4._MX.get(f, (0, 0))[0],
                  THRESHOLD=triton_fp4._MX.get(f, (0, 0))[1]) for f in triton_fp4.FORMATS]
    return list({tuple(d[k] for k in keys): {k: d[k] for k in keys} for d in every}.values())


def _map_shape() -> dict:
    """The map kernel's tile constexprs as :class:`triton_map.GroupedMaps` binds them for a
    layer of the default rank ``k``."""
    k = GeoFP8Config.k
    fixed = triton_map.GroupedMaps([(0, 1, k, *[torch.zeros(k, k)] * 3)],
                                   torch.device("cpu")).launches[0].keywords
    return {a: fixed[a] for a in ("RANK", "BLOCK_M", "BLOCK_K")}


# each argument's type as the launches pass it, where not a value pointer (*fp32) or an i32
_TYPES = {
    **dict.fromkeys(("tiles_ptr", "bits_ptr", "slots_ptr", "block_at_ptr", "seg_at_ptr",
                     "seg_start_ptr", "where_ptr", "empty_ptr", "rows_ptr", "seeds_ptr",
                     "ticket_ptr", "skipped_ptr", "table_ptr", "moments_ptr", "marks_ptr",
                     "dropped_ptr"), "*i64"),
    **dict.fromkeys(("keep_ptr", "codes_ptr", "flag_ptr", "flags_ptr", "verdict_ptr",
                     "buf_ptr", "recv_ptr", "s_in", "blk_in", "code_in", "s_out", "blk_out",
                     "code_out"), "*u8"),
    "seg_of_ptr": "*i32", "finite_ptr": "*u1", "epoch": "i64", "seed0": "i64",
    "divisor": "fp32"}
_TILE = [{"TILE": triton_fp8.TILE}]
_FP8 = [{"E5M2": fmt == "e5m2"} for fmt in triton_fp8.FMAX]
_FMAX = [{"E5M2": fmt == "e5m2", "FMAX": fmax} for fmt, fmax in triton_fp8.FMAX.items()]
_R16 = {"r_ptr": "*i16", "err_ptr": "*i16"}  # an FP8 BF16 residual: its bits as int16
_B16 = {"r_ptr": "*bf16", "err_ptr": "*i16"}  # a block BF16 residual, the error's bits
_SEEDS = [{"SEEDS": s} for s in range(4)]  # none; a table; a StepSeed with, without prefix

# name: (whether launched with FMA contraction, its variants: constexprs in capitals, the
# arguments' types where not _TYPES')
KERNELS = {
    # amax(): with and without a residual; FP8Stages: no feedback, FP32 or BF16 R with and
    # without keep (STORE_U off); BoundSend without R (keep given or not)
    "triton_fp8._amax_kernel": (True, _product(
        _flags("HAS_R HAS_KEEP BF16 STORE_U", "FFFF", "FTFF", "TFFT", "TFFF", "TTFF")
        + [dict(f, r_ptr="*i16") for f in _flags("HAS_R HAS_KEEP BF16 STORE_U", "TFTF", "TTTF")],
        _TILE)),
    "triton_fp8._scales_kernel": (True, [dict(FMAX=f, BLOCK=1024)
                                         for f in triton_fp8.FMAX.values()]),
    "triton_fp8._encode_kernel": (False, _product(_flags("HAS_ERR", "T", "F"), _FP8, _TILE)),
    "triton_fp8._decode_kernel": (False, _product(_FP8, _TILE)),
    "triton_fp8._decode_sum_kernel": (False, _product(_FP8, _TILE)),
    # FP8Stages: send (error or not), with FP32 / BF16 R (keep or not), owner (error or
    # not, a sum's none); BoundSend without R (keep given or not: it takes both)
    "triton_fp8._encode_placed_kernel": (False, _product(
        _flags("HAS_R HAS_KEEP BF16 HAS_ERR", "FFFF", "FFFT", "FTFF", "TFFT", "TTFT")
        + [dict(f, **_R16) for f in _flags("HAS_R HAS_KEEP BF16 HAS_ERR", "TFTT", "TTTT")],
        _FMAX, _TILE, [{"out_ptr": "*u8"}])),
    # FP8Stages: the owner's (the sum's amax), a reduce-scatter's end (divided or not)
    "triton_fp8._reduce_kernel": (False, _product(_flags("SCATTER DIVIDE", "FF", "TF", "TT"),
                                                  _FP8, _TILE)),
    # decode_launches: plain and deciding; the stages' divisor or none
    "triton_fp8._decode_placed_kernel": (False, _product(
        _flags("DIVIDE VERDICT", "FF", "FT", "TF", "TT"), _FP8, _TILE)),
    "triton_fp8._verdict_kernel": (True, [{"BLOCK": 128}]),
    "triton_fp8._agreed_kernel": (True, [{"BLOCK": 128}]),
    # amax(): a residual (u stored: encode()'s) and keep, or none; BlockStages: no
    # feedback, FP32 / BF16 R (keep or not)
    "triton_fp4._amax_kernel": (True, _product(
        _flags("HAS_R KEEP STORE_U", "FFF", "TFT", "TTT", "TFF", "TTF")
        + [dict(f, r_ptr="*bf16") for f in _flags("HAS_R KEEP STORE_U", "TFF", "TTF")],
        _formats("NVFP4", "B"), _TILE)),
    # the codec's (error or not; to nearest or a seed table) and the stages' (no feedback:
    # error or not; FP32 / BF16 R, keep or not; owner, error or not; any seeding: a
    # sender's StepSeed has a prefix, an owner's none)
    "triton_fp4._encode_kernel": (False, _product(
        _product(_flags("HAS_R KEEP HAS_ERR ERR_BF16", "FFFF", "FFTF"), _SEEDS)
        + _product(_flags("HAS_R KEEP HAS_ERR ERR_BF16", "TFTF", "TTTF")
                   + [dict(f, **_B16) for f in _flags("HAS_R KEEP HAS_ERR ERR_BF16", "TFTT",
                                                      "TTTT")], _SEEDS[:3]),
        _formats("FMT", "NVFP4", "EMAX", "THRESHOLD"), _TILE)),
    # BlockStages: the owner's (the sum's amax), a reduce-scatter's end (divided or not)
    "triton_fp4._reduce_kernel": (False, _product(_flags("SCATTER DIVIDE", "FF", "TF", "TT"),
                                                  _formats("FMT", "NVFP4", "B"), _TILE)),
    # the codec's decode (poison or not); the stages' (poison; a divisor or none; plain or
    # deciding)
    "triton_fp4._decode_kernel": (False, _product(
        _flags("DIVIDE POISON VERDICT", "FFF", "FTF", "TTF", "FTT", "TTT"),
        _formats("FMT", "NVFP4"), _TILE)),
    # forward; GroupedMaps' back without a flag; BoundMaps' back, plain and deciding
    "triton_map._map_kernel": (True, _product(
        [dict(INVERSE=0, FLAG=False, VERDICT=False), dict(INVERSE=1, FLAG=False, VERDICT=False),
         dict(INVERSE=1, FLAG=True, VERDICT=False), dict(INVERSE=1, FLAG=True, VERDICT=True)],
        [_map_shape()])),
    "triton_stats._commit_moment_kernel": (True, [{"TILE": triton_stats.TILE}]),
    "triton_stats._nonfinite_kernel": (True, [{"TILE": triton_stats.TILE}]),
    "triton_stats._commit_kernel": (True, [{"TILE": triton_stats.TILE}]),
}
_SUMS_ANOTHER_WAY = {"triton_map._map_kernel"}  # tl.dot: FMAs in its own order, by design
# the variants the block kernels' compile test of test_triton_fp4.py compiled, kept first
_ENCODE = dict(HAS_R=True, KEEP=True, HAS_ERR=True, ERR_BF16=True, **_B16, TILE=triton_fp8.TILE)
_FIRST = {
    "triton_fp4._amax_kernel": [dict(HAS_R=True, KEEP=True, STORE_U=True, NVFP4=True, B=16,
                                     TILE=triton_fp8.TILE)],
    "triton_fp4._encode_kernel": [
        dict(_ENCODE, SEEDS=2, FMT=0, NVFP4=True, EMAX=0, THRESHOLD=0),
        dict(_ENCODE, SEEDS=1, FMT=1, NVFP4=False, EMAX=8, THRESHOLD=0x600000)],
    "triton_fp4._reduce_kernel": [dict(SCATTER=False, DIVIDE=False, FMT=0, NVFP4=True, B=16,
                                       TILE=triton_fp8.TILE)],
    "triton_fp4._decode_kernel": [
        dict(DIVIDE=True, POISON=True, VERDICT=True, FMT=0, NVFP4=True, TILE=triton_fp8.TILE),
        dict(DIVIDE=False, POISON=False, VERDICT=False, FMT=1, NVFP4=False,
             TILE=triton_fp8.TILE)],
    "triton_fp8._decode_placed_kernel": [dict(DIVIDE=True, VERDICT=v, E5M2=False,
                                              TILE=triton_fp8.TILE) for v in (True, False)]}

# an FP32 fused multiply-add, or a multiply ptxas may fuse with an add (no rounding modifier)
_FMA = re.compile(r"\bfma\.|\bmad(?:\.\w+)*\.f32\b|\bmul(?:\.ftz)?(?:\.sat)?\.f32\b")
# an approximate or flush-to-zero instruction; but libdevice's floor (tl.floor: the block
# encode's stochastic rounding, of a value >= 0, where a flushed subnormal floors to +0 too)
_ROUGH = re.compile(r"\b[a-z]+(?:\.\w+)*\.(?:approx|ftz)(?:\.\w+)*")
_TICKET = re.compile(r"\batom\.global\.(?:\w+\.)*acq_rel\.(?:\w+\.)*add\.u64\b")


def all_pairs(variants: list[dict], first: list[dict]) -> list[dict]:
    """``first``, then variants of ``variants`` until every pair of settings (constexpr or
    argument type; a setting with itself too) found together in one of them is found
    together in one chosen (greedy: the variant with most pairs not yet covered next, the
    earliest where tied)."""
    pairs = [set(itertools.combinations_with_replacement(sorted(v.items(), key=str), 2))
             for v in variants]
    chosen, left = list(first), set().union(*pairs)
    for v in first:
        left -= pairs[variants.index(v)]
    while left:
        best = max(range(len(variants)), key=lambda i: len(pairs[i] & left))
        chosen.append(variants[best])
        left -= pairs[best]
    return chosen


def _compile(fn, variant: dict, contracts: bool):
    """``fn`` compiled for sm_90 with ``variant``'s constexprs and argument types."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = {a: v for a, v in variant.items() if a.isupper()}
    types = {**_TYPES, **{a: v for a, v in variant.items() if a.islower()}}
    signature = {a: "constexpr" if a in constexprs else types.get(
        a, "*fp32" if a.endswith("_ptr") else "i32") for a in fn.arg_names}
    source = ASTSource(fn, signature, {(fn.arg_names.index(a),): v
                                       for a, v in constexprs.items()})
    try:  # the options of the launch: the default's contraction, or none
        return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={} if contracts else triton_fp8._NO_FUSION)
    except FileNotFoundError as exc:  # a Triton without its CUDA toolchain
        pytest.skip(f"no CUDA toolchain in this Triton: {exc}")


def test_every_kernel_has_its_variants_with_each_of_its_constexprs():
    """A kernel :func:`gpu_check.triton_kernels` finds and :data:`KERNELS` leaves out, a
    constexpr a variant does not set, or an argument it names that the kernel has not, fails
    here (a new kernel or flag is not left uncompiled)."""
    kernels = gpu_check.triton_kernels()
    assert set(KERNELS) == set(kernels)
    for name, (_, variants) in KERNELS.items():
        fn = kernels[name]
        constexprs = {p.name for p in fn.params if p.is_constexpr}
        assert all(v in variants for v in _FIRST.get(name, [])), name
        for variant in variants:
            assert {k for k in variant if k.isupper()} == constexprs, (name, variant)
            assert set(variant) <= set(fn.arg_names), (name, variant)


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_compiles_for_an_h100_with_the_floating_point_and_ordering_it_needs(name):
    fn = gpu_check.triton_kernels()[name]
    contracts, variants = KERNELS[name]
    for variant in all_pairs(variants, _FIRST.get(name, [])):
        kernel = _compile(fn, variant, contracts)
        ptx, where = kernel.asm["ptx"], (name, variant)
        assert "cubin" in kernel.asm, where
        if name in _SUMS_ANOTHER_WAY:
            assert "tf32" not in ptx, where
        else:
            assert not _FMA.search(ptx), where
            assert set(re.findall(r"\bdiv(?:\.\w+)*\.f32\b", ptx)) <= {"div.rn.f32"}, where
            assert set(_ROUGH.findall(ptx)) <= {"cvt.rmi.ftz.f32.f32"}, where
        # the map's back with its flag, a reduce-scatter's end, a decode
        if "ticket_ptr" in fn.arg_names and variant.get("FLAG", variant.get("SCATTER", True)):
            assert _TICKET.search(ptx), where
