"""FP8 codecs: error bounds, zero and non-finite policies, dtypes, byte layout, fuzzing."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from geofp8.codecs import native
from geofp8.codecs.fp8 import FP8Codec, Packed, group_lengths


@pytest.fixture(params=["native", "torch"])
def kernels(request, monkeypatch):
    """The CPU's E4M3 kernels: native (where a C compiler is) or torch's ops."""
    if request.param == "torch":
        monkeypatch.setattr(native, "kernels", lambda: None)
    elif native.kernels() is None:
        pytest.skip("no C compiler")
    return request.param

FORMATS = ["e4m3", "e5m2"]
SCALINGS = ["tensor", "row", "block"]
# Unit round-off of round-to-nearest with m mantissa bits: 2^-(m+1).
REL_BOUND = {"e4m3": 2.0**-4, "e5m2": 2.0**-3}


def _groups(x: torch.Tensor, codec: FP8Codec, lengths=None):
    """Yield (group values as float64, group slice) for every scale group of ``x``."""
    lengths = codec.groups(tuple(x.shape)) if lengths is None else lengths
    flat = x.reshape(-1).double()
    pos = 0
    for n in lengths:
        yield flat[pos : pos + n], slice(pos, pos + n)
        pos += n
    assert pos == x.numel()


def check_codec_contract(x: torch.Tensor, codec: FP8Codec, out: torch.Tensor, lengths=None) -> int:
    """Assert every documented property of ``out = round_trip(x)``; return #bound-checked elems.

    Per scale group g with ``amax_g`` and ``s_g = amax_g / fmax``:
    * non-finite group -> every output element NaN;
    * all-zero group -> exact zeros;
    * otherwise finite output, and
      - elements with ``|x| >= fp8_smallest_normal * s_g`` (normal FP8 range) have relative
        error <= 2^-4 (E4M3) / 2^-3 (E5M2);
      - every element has absolute error <= u * amax_g (half an ulp of the top binade of
        the format is at most u * fmax), whatever its magnitude.
    """
    assert out.shape == x.shape
    u = REL_BOUND[codec.format]
    fp8_normal = torch.finfo(codec.dtype).smallest_normal
    out_flat = out.reshape(-1).double()
    checked = 0
    for g, sl in _groups(x, codec, lengths):
        o = out_flat[sl]
        if not torch.isfinite(g).all():
            assert torch.isnan(o).all(), "a non-finite group must decode to all-NaN"
            continue
        assert torch.isfinite(o).all(), "a finite group must decode to finite values"
        amax = float(g.abs().max())
        if amax == 0.0:
            assert torch.equal(o, torch.zeros_like(o))
            continue
        err = (o - g).abs()
        assert float(err.max()) <= u * amax * (1 + 1e-6) + 1e-44  # fp32-subnormal output slack
        s = amax / codec.fmax
        normal = g.abs() >= fp8_normal * s
        if normal.any():
            rel = err[normal] / g.abs()[normal]
            assert float(rel.max()) <= u, f"relative error {float(rel.max())} > {u}"
            checked += int(normal.sum())
    return checked


# -- the decode table against torch's conversion ----------------------------------------------

@pytest.mark.parametrize("scaling", SCALINGS)
def test_e4m3_lookup_decode_equals_torch_conversion_bitwise(scaling):
    """Every code (all 256 bytes, NaN codes included) decodes to torch's ``code.float() · s``."""
    codec = FP8Codec("e4m3", scaling, block_size=64)
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(4)
    x = torch.randn(32, 32, generator=torch.Generator().manual_seed(0)) * 1e-3
    packed = codec.quantize(x)
    packed.codes.copy_(every)  # all codes under every scale
    want = packed.codes.view(torch.float8_e4m3fn).float() * torch.repeat_interleave(
        packed.scales, torch.tensor(packed.lengths))
    got = packed.dequantize().reshape(-1)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num().view(torch.int32), want.nan_to_num().view(torch.int32))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("lengths", [[2100], [300] * 7, [5, 900, 17, 1178],
                                     [4096, 4100] * 130, [1, 2, 3] * 200 + [900]])
@pytest.mark.parametrize("overwrite", [False, True])
def test_codes_and_values_are_torchs_division_and_product(fmt, lengths, overwrite, kernels):
    """Whatever way the kernels go (one group, equal groups, a few unequal ones divided and
    scaled one op for all, many long ones one op each, many short ones through per-element
    scales), every code is torch's ``(x / s_g).to(fp8)`` and every value its
    ``code.float() · s_g``, bit for bit (NaN where NaN)."""
    codec = FP8Codec(fmt)
    numel = sum(lengths)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(1)) * torch.logspace(
        -8, 8, numel)
    x[1000] = float("inf")  # poisons the group holding element 1000
    work = x.clone()
    packed = codec.quantize(work, lengths, overwrite=overwrite)
    per_element = torch.repeat_interleave(packed.scales, torch.tensor(lengths))
    want = (x / per_element).to(codec.dtype).view(torch.uint8)
    assert torch.equal(packed.codes, want)
    values = packed.codes.view(codec.dtype).float() * per_element
    got = packed.dequantize()
    assert torch.equal(got.isnan(), values.isnan())
    assert torch.equal(got.nan_to_num().view(torch.int32), values.nan_to_num().view(torch.int32))


# -- error bounds --------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scaling", SCALINGS)
def test_error_bound_normal_range(fmt, scaling):
    gen = torch.Generator().manual_seed(1)
    # rows of very different magnitudes, values spanning ~3 decades inside a row
    x = torch.randn(16, 96, generator=gen) * torch.logspace(-6, 6, 16)[:, None]
    x = x * torch.logspace(0, -3, 96)[None, :]
    codec = FP8Codec(fmt, scaling, 32)
    out = codec.round_trip(x)
    assert out.dtype == torch.float32
    checked = check_codec_contract(x, codec, out)
    # per-tensor scaling cannot cover 12 decades; the finer scalings cover most elements
    assert checked > (x.numel() // 2 if scaling != "tensor" else 0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_relative_bound_is_attained_not_exceeded(fmt):
    """Sweep a dense grid of mantissas: the worst relative error is close to, and at most, u."""
    codec = FP8Codec(fmt, "tensor")
    x = torch.linspace(1.0, 2.0, 20001, dtype=torch.float64)
    x = torch.cat([x, torch.tensor([codec.fmax / 8])]).float()  # amax pins s = 1/8 exactly
    out = codec.round_trip(x).double()
    rel = ((out - x.double()).abs() / x.double()).max().item()
    assert rel <= REL_BOUND[fmt]
    assert rel > 0.8 * REL_BOUND[fmt]  # the bound is not vacuous


@pytest.mark.parametrize("fmt", FORMATS)
def test_scaling_granularity_protects_small_groups(fmt):
    """Per-row / per-block scaling keeps a tiny row accurate next to a huge one;
    per-tensor scaling flushes it (that is what the finer scalings are for)."""
    x = torch.stack([torch.full((64,), 1e4), torch.linspace(1e-9, 2e-9, 64)])
    for scaling in ("row", "block"):
        out = FP8Codec(fmt, scaling, 64).round_trip(x)
        rel = ((out[1] - x[1]).abs() / x[1]).max()
        assert rel <= REL_BOUND[fmt]
    out = FP8Codec(fmt, "tensor").round_trip(x)
    assert ((out[1] - x[1]).abs() / x[1]).max() > REL_BOUND[fmt]


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp32_subnormal_group_stays_finite(fmt):
    """Regression: a group whose amax / fmax underflows to an fp32 subnormal (amax ~1e-40)
    used to get a scale rounded *down* by up to 50 %, so amax / s overflowed the format
    (E5M2 -> inf). A finite group must decode to finite values, with error <= u * amax."""
    codec = FP8Codec(fmt, "block", 4)
    x = torch.tensor([1e-40, -3e-41, 2e-42, 0.0, 1e-44, 3e-45, 0.0, 0.0, 1.0, 0.5, 0, 0])
    out = codec.round_trip(x)
    check_codec_contract(x, codec, out)
    assert out[0] != 0 and out[4] != 0  # not flushed as if it were an all-zero group


# -- zeros and non-finite policy -----------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scaling", SCALINGS)
def test_zeros_round_trip_exactly(fmt, scaling):
    codec = FP8Codec(fmt, scaling, 8)
    for shape in [(5, 7), (1,), (3, 4, 5)]:
        x = torch.zeros(shape)
        packed = codec.quantize(x)
        assert torch.equal(packed.scales, torch.ones_like(packed.scales))
        out = packed.dequantize()
        assert not torch.isnan(out).any()
        assert torch.equal(out, x)
    # zero groups next to non-zero ones
    x = torch.randn(4, 8)
    x[1] = 0
    x[3, :] = -0.0
    out = FP8Codec(fmt, "row").round_trip(x)
    assert torch.equal(out[1], torch.zeros(8)) and torch.equal(out[3], torch.zeros(8))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_poisons_exactly_its_group(fmt, scaling, bad):
    codec = FP8Codec(fmt, scaling, 8)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    x[2, 5] = bad
    packed = codec.quantize(x)
    out = packed.dequantize()
    flat = out.reshape(-1)
    lengths = codec.groups(tuple(x.shape))
    bad_index = 2 * 8 + 5
    pos = 0
    for n in lengths:
        group = flat[pos : pos + n]
        if pos <= bad_index < pos + n:
            assert torch.isnan(group).all()
        else:
            assert torch.isfinite(group).all()
        pos += n
    assert torch.isnan(packed.scales).sum() == 1
    # still NaN after the wire
    again = Packed.from_bytes(packed.to_bytes(), x.shape, codec, lengths).dequantize()
    assert torch.equal(torch.isnan(again), torch.isnan(out))
    assert not torch.isfinite(out.reshape(-1)[bad_index])


# -- dtypes -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scaling", SCALINGS)
def test_low_and_high_precision_inputs(dtype, fmt, scaling):
    x = (torch.randn(9, 33, generator=torch.Generator().manual_seed(3)) * 10).to(dtype)
    codec = FP8Codec(fmt, scaling, 16)
    out = codec.round_trip(x)
    assert out.dtype == torch.float32
    check_codec_contract(x, codec, out)
    assert codec.quantize(x).dequantize(dtype).dtype == dtype
    # the codec sees the same numbers whatever the storage dtype
    assert torch.equal(out, codec.round_trip(x.float()))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool,
                                   torch.complex64])
def test_non_float_input_raises(dtype):
    with pytest.raises(TypeError):
        FP8Codec().quantize(torch.ones(4, dtype=dtype))


def test_invalid_codec_arguments():
    with pytest.raises(ValueError):
        FP8Codec("e3m4")
    with pytest.raises(ValueError):
        FP8Codec(scaling="column")
    with pytest.raises(ValueError):
        FP8Codec(block_size=0)
    with pytest.raises(ValueError):
        FP8Codec().quantize(torch.ones(5), lengths=[2, 2])


# -- wire layout -----------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scaling", SCALINGS)
def test_bytes_round_trip_and_layout(fmt, scaling):
    codec = FP8Codec(fmt, scaling, 10)
    x = torch.randn(7, 13, generator=torch.Generator().manual_seed(4))
    packed = codec.quantize(x)
    lengths = codec.groups(tuple(x.shape))
    n_groups = len(lengths)
    buf = packed.to_bytes()
    assert buf.dtype == torch.uint8 and buf.dim() == 1
    assert buf.numel() == 4 * n_groups + x.numel() == packed.nbytes
    # documented layout: [G float32 scales, little-endian][numel uint8 codes]
    scales = torch.frombuffer(bytearray(buf[: 4 * n_groups].numpy().tobytes()),
                              dtype=torch.float32)
    assert torch.equal(scales, packed.scales)
    assert torch.equal(buf[4 * n_groups :], packed.codes)
    assert torch.equal(packed.codes.view(codec.dtype).float().reshape(-1)[:3],
                       (buf[4 * n_groups : 4 * n_groups + 3].view(codec.dtype).float()))
    back = Packed.from_bytes(buf, x.shape, codec, lengths)
    assert torch.equal(back.dequantize(), packed.dequantize())
    # extra trailing bytes (padding) are ignored; a short buffer is refused
    padded = torch.cat([buf, torch.full((5,), 0xFF, dtype=torch.uint8)])
    assert torch.equal(Packed.from_bytes(padded, x.shape, codec, lengths).dequantize(),
                       packed.dequantize())
    with pytest.raises(ValueError):
        Packed.from_bytes(buf[:-1], x.shape, codec, lengths)


def test_bytes_per_element():
    shape = (1024, 1024)
    n = 1024 * 1024
    assert FP8Codec("e4m3", "tensor").bytes_per_element(shape) == (n + 4) / n
    assert FP8Codec("e5m2", "row").bytes_per_element(shape) == 1 + 4 / 1024
    assert FP8Codec("e4m3", "block", 128).bytes_per_element(shape) == 1 + 4 / 128
    assert FP8Codec("e4m3", "block", 32).bytes_per_element((100,)) == (100 + 4 * 4) / 100
    assert FP8Codec("e4m3", "row").bytes_per_element((7,)) == (7 + 4) / 7
    for codec in (FP8Codec("e4m3", "block", 5), FP8Codec("e5m2", "row")):
        x = torch.randn(6, 11)
        assert codec.bytes_per_element(x.shape) * x.numel() == codec.quantize(x).nbytes


def test_group_lengths():
    assert group_lengths((4, 5), "tensor", 3) == [20]
    assert group_lengths((4, 5), "row", 3) == [5] * 4
    assert group_lengths((2, 3, 4), "row", 3) == [12, 12]
    assert group_lengths((9,), "row", 3) == [9]
    assert group_lengths((), "row", 3) == [1]
    assert group_lengths((4, 5), "block", 6) == [6, 6, 6, 2]
    assert group_lengths((0, 5), "block", 6) == []
    with pytest.raises(ValueError):
        group_lengths((3,), "col", 1)


def test_empty_and_scalar_tensors():
    codec = FP8Codec("e4m3", "block", 4)
    empty = torch.zeros(0, 3)
    out = codec.round_trip(empty)
    assert out.shape == (0, 3)
    assert codec.quantize(empty).to_bytes().numel() == 0
    scalar = torch.tensor(-3.0)
    assert codec.round_trip(scalar).shape == ()
    assert codec.round_trip(scalar).item() == -3.0


def test_explicit_non_uniform_lengths():
    """``lengths`` overrides the codec's groups (the collective cuts groups at shards)."""
    codec = FP8Codec("e4m3")
    x = torch.cat([torch.full((3,), 1e-3), torch.full((5,), 1e3), torch.full((2,), 1.0)])
    x = x * torch.linspace(1, 1.9, 10)
    lengths = [3, 5, 2]
    out = codec.round_trip(x, lengths)
    check_codec_contract(x, codec, out, lengths)
    assert codec.quantize(x, lengths).scales.numel() == 3
    x[4] = math.nan
    out = codec.round_trip(x, lengths)
    assert torch.isnan(out[3:8]).all() and torch.isfinite(out[:3]).all()
    assert torch.isfinite(out[8:]).all()


# -- property-based fuzzing ------------------------------------------------------------

_SPECIALS = [0.0, -0.0, math.nan, math.inf, -math.inf, 1e-30, -1e30]


@st.composite
def _tensors(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim)))
    numel = math.prod(shape)
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    # log-uniform magnitudes in [1e-30, 1e30] inside a drawn sub-range, random signs
    lo = draw(st.floats(-30, 30))
    hi = draw(st.floats(lo, 30))
    exps = lo + (hi - lo) * torch.rand(numel, generator=gen, dtype=torch.float64)
    signs = torch.randint(0, 2, (numel,), generator=gen, dtype=torch.float64) * 2 - 1
    x = signs * torch.pow(10.0, exps)
    if draw(st.booleans()):  # sprinkle special values
        n_special = draw(st.integers(1, min(3, numel)))
        for _ in range(n_special):
            idx = draw(st.integers(0, numel - 1))
            x[idx] = draw(st.sampled_from(_SPECIALS))
    if draw(st.booleans()):
        x[: draw(st.integers(0, numel))] = 0.0
    dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16, torch.float16,
                                  torch.float64]))
    return x.reshape(shape).to(dtype)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=_tensors(), fmt=st.sampled_from(FORMATS), scaling=st.sampled_from(SCALINGS),
       block=st.integers(1, 40))
def test_fuzz_codec_contract(x, fmt, scaling, block):
    codec = FP8Codec(fmt, scaling, block)
    packed = codec.quantize(x)
    assert packed.codes.dtype == torch.uint8 and packed.codes.numel() == x.numel()
    assert packed.scales.dtype == torch.float32
    assert packed.scales.numel() == len(codec.groups(tuple(x.shape)))
    out = packed.dequantize()
    check_codec_contract(x, codec, out)
    back = Packed.from_bytes(packed.to_bytes(), x.shape, codec, codec.groups(tuple(x.shape)))
    assert torch.equal(back.dequantize().isnan(), out.isnan())
    assert torch.equal(back.dequantize().nan_to_num(), out.nan_to_num())


@settings(max_examples=150, deadline=None)
@given(data=st.data(), fmt=st.sampled_from(FORMATS))
def test_fuzz_explicit_lengths(data, fmt):
    lengths = data.draw(st.lists(st.integers(1, 12), min_size=1, max_size=8))
    x = data.draw(_tensors())
    x = x.reshape(-1)
    n = sum(lengths)
    x = torch.cat([x] * (n // x.numel() + 1))[:n]
    codec = FP8Codec(fmt)
    check_codec_contract(x, codec, codec.round_trip(x, lengths), lengths)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("scaling", ["tensor", "row"])
def test_clipped_fraction_counts_flushed_and_saturated_codes(fmt, scaling):
    """The share read off the code bytes equals the one counted on the decoded values: codes
    at ±fmax, and zeros from non-zero inputs (exact zeros are not clipped)."""
    codec = FP8Codec(fmt, scaling)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 200, generator=g) * torch.logspace(-40, 2, 200)  # far below amax: flushed
    x[:, :3] = 0.0
    x[0, 7] = -x[0].abs().max() * 2  # a row's ±amax saturates
    values = codec.quantize(x).codes.view(codec.dtype).float()
    flushed = ((values == 0) & (x.reshape(-1) != 0)).sum().item()
    saturated = (values.abs() == codec.fmax).sum().item()
    assert flushed > 0 and saturated > 0
    assert codec.clipped_fraction(x) == (flushed + saturated) / x.numel()


@pytest.mark.parametrize("lengths", [None, [300] * 7, [5, 900, 17, 1178],
                                     [1, 2, 3] * 200 + [900]])  # the last: many irregular
@pytest.mark.parametrize("scaling", ["tensor", "row", "block"])
def test_quantizing_in_place_gives_the_same_codes(scaling, lengths, kernels):
    """``overwrite=True`` lets the codec divide ``x`` by its scales in place: the same scales
    and codes bit for bit. With torch's ops groups of unequal lengths are divided in ``x``
    (used up); equal ones piece by piece straight into the codes (no scratch either way),
    ``x`` left alone; the native E4M3 kernel never writes ``x``."""
    codec = FP8Codec("e4m3", scaling, 64)
    x = torch.randn(2100, generator=torch.Generator().manual_seed(3)) * torch.logspace(
        -6, 6, 2100)
    x = x.view(30, 70)
    x[4, 5] = float("inf")
    expect = codec.quantize(x, lengths)
    work = x.clone()
    got = codec.quantize(work, lengths, overwrite=True)
    assert torch.equal(got.codes, expect.codes)
    assert torch.equal(got.scales.view(torch.int32), expect.scales.view(torch.int32))
    unequal = lengths is not None and len(set(lengths[:-1])) > 1
    assert torch.equal(work.nan_to_num(), x.nan_to_num()) != (unequal and kernels == "torch")
