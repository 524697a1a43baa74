"""Block codecs (NVFP4, MXFP4, MXFP8): exact values, limits, policies, error bounds, byte
layouts, stochastic rounding, the exact collective on gloo and 20-step DDP replicas."""

from __future__ import annotations

import hashlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run_ranks
from geofp8 import GeoFP8Config
from geofp8.codecs import NVFP4Codec, make_codec, native
from geofp8.codecs.fp4 import E2M1_VALUES, e2m1_encode, e2m1_round, e2m1_values
from geofp8.codecs.mx import e8m0_scales, e8m0_values
from geofp8.comm import ShardLayout, decode, encode, exact_allreduce, simulate_exact_allreduce
from geofp8.geometry.factory import make_transform
from geofp8.geometry.transforms import RandomHadamard, transform_from_state
from geofp8.methods import METHODS
from toymodels import loss_fn, make_model

BLOCK_FORMATS = ["nvfp4", "mxfp4", "mxfp8"]
E2M1 = torch.tensor(E2M1_VALUES)


def _encode(codec, x, segments=None, seed=None):
    segments = segments or [codec.groups(tuple(x.shape))]
    buf = torch.empty(codec.payload_bytes(segments), dtype=torch.uint8)
    codec.encode_into(buf, x.reshape(-1).float(), segments, seed=seed)
    return buf


def _decode(codec, buf, segments):
    out = torch.empty(sum(sum(s) for s in segments))
    ok = codec.decode_into(out, buf, segments)
    return out, ok


# -- E2M1 codes ------------------------------------------------------------------------------

def test_every_e2m1_code_decodes_to_its_value_and_encodes_back():
    codes = torch.arange(16, dtype=torch.int16)
    values = e2m1_values(codes)
    expected = torch.cat([E2M1, -E2M1])
    assert torch.equal(values, expected)
    assert torch.equal(e2m1_encode(expected).to(torch.int16)[1:], codes[1:])  # -0 → 8, 0 → 0
    assert int(e2m1_encode(torch.tensor([-0.0]))) == 8


def test_e2m1_ties_go_to_the_even_code_and_saturate_at_six():
    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.2500001, 6.9, 1e30])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 6.0, 6.0])
    got = e2m1_values(e2m1_encode(v))
    assert torch.equal(got, want)
    assert torch.equal(e2m1_values(e2m1_encode(-v)), -want)


def test_e2m1_table_encode_equals_grid_rounding_for_every_key():
    """The lookup encoder agrees with the grid rounding on every 16-bit key, with the 16 low
    bits zero, one, all set and random, and on both neighbours of every tie."""
    keys = torch.arange(1 << 16, dtype=torch.int32) << 16
    gen = torch.Generator().manual_seed(0)
    for low in (torch.zeros_like(keys), torch.ones_like(keys), torch.full_like(keys, 0xFFFF),
                torch.randint(0, 1 << 16, keys.shape, generator=gen, dtype=torch.int32)):
        v = (keys | low).view(torch.float32)
        finite = v.isfinite()
        assert torch.equal(e2m1_encode(v)[finite], e2m1_round(v)[finite])
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    ties = torch.cat([ties, -ties])
    near = torch.cat([ties, torch.nextafter(ties, ties * 2), torch.nextafter(ties, ties * 0)])
    assert torch.equal(e2m1_encode(near), e2m1_round(near))



def _every_key(gen: torch.Generator):
    """Every non-negative FP32 16-bit key (NaN and +Inf included) with its 16 low bits zero,
    one, all set and random: what a block's amax or its scale quotient can be."""
    keys = torch.arange(1 << 15, dtype=torch.int32) << 16
    for low in (torch.zeros_like(keys), torch.ones_like(keys), torch.full_like(keys, 0xFFFF),
                torch.randint(0, 1 << 16, keys.shape, generator=gen, dtype=torch.int32)):
        yield (keys | low).view(torch.float32)


def test_key_tables_equal_the_torch_ops_they_replace_for_every_key():
    """The torch path's lookups of a value's key (fp4.round_key): NVFP4's block scale rounded
    up (e4m3_ceil: clamp at 448, the E4M3 cast, one step up when below; NaN and +Inf to the
    NaN code), the E2M1 values of the codes, an MX block's E8M0 byte and its divisor, and
    the E8M0 bytes' values, bit for bit against the ops on every key."""
    from geofp8.codecs.fp4 import _encode_table, e4m3_ceil, round_key
    from geofp8.codecs.mx import _e8m0_table, _scale_tables

    cpu = torch.device("cpu")
    tables, gen = _encode_table(cpu), torch.Generator().manual_seed(1)
    for v in _every_key(gen):
        key = round_key(v)
        assert torch.equal(torch.take(tables.scales, key), e4m3_ceil(v))
        codes = torch.take(tables.codes, key)
        assert torch.equal(torch.take(tables.values, key).view(torch.int32),
                           e2m1_values(codes).view(torch.int32))
        for element in ("e2m1", "e4m3"):
            byte = e8m0_scales(torch.where(v.isfinite(), v, float("inf")), element)
            mx = _scale_tables(element, cpu)
            assert torch.equal(torch.take(mx.bytes, key), byte)
            assert torch.equal(torch.take(mx.divisors, key).view(torch.int32),
                               e8m0_values(byte).nan_to_num_(nan=1.0).view(torch.int32))
    byte = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    assert torch.equal(_e8m0_table(cpu).view(torch.int32), e8m0_values(byte).view(torch.int32))

# -- NVFP4 -----------------------------------------------------------------------------------

def test_nvfp4_scales_are_the_documented_ones_and_the_block_scale_rounds_up():
    codec = NVFP4Codec()
    x = torch.zeros(40)
    x[0] = 2688.0  # segment amax: s = 2688 / (6 · 448) = 1
    x[16] = 10.0  # a_b / (6 s) = 1.667 → E4M3 1.75 (round up; nearest would be 1.625)
    x[17] = -1.0
    x[32:40] = 0.0  # an all-zero (short) block
    segments = [codec.groups((40,))]
    assert segments == [[16, 16, 8]]
    buf = _encode(codec, x, segments)
    assert buf.numel() == codec.payload_bytes(segments) == 4 + 3 + 20
    assert float(buf[:4].clone().view(torch.float32)) == 1.0
    scales = buf[4:7].view(torch.float8_e4m3fn).float().tolist()
    assert scales == [448.0, 1.75, 0.0]
    out, ok = _decode(codec, buf, segments)
    assert ok
    assert out[0] == 2688.0 and out[16] == 10.5 and out[17] == -0.875  # 6·1.75, 0.5·1.75
    assert torch.equal(out[32:], torch.zeros(8))


def test_nvfp4_never_saturates_and_tiny_segments_keep_a_normal_scale():
    codec = NVFP4Codec()
    x = torch.tensor([3e-42, -1e-42] + [0.0] * 14)  # FP32 subnormals
    buf = _encode(codec, x)
    assert float(buf[:4].clone().view(torch.float32)) == 2.0**-149
    out, ok = _decode(codec, buf, [[16]])
    assert ok and out.abs().max() <= 3e-42 * 1.2 and out[0] > 0
    big = torch.full((16,), 3.0e38)
    out, ok = _decode(codec, _encode(codec, big), [[16]])
    assert ok and torch.isfinite(out).all() and torch.allclose(out, big, rtol=0.13)


# -- MX: E8M0 --------------------------------------------------------------------------------

@pytest.mark.parametrize("element,fmax", [("e2m1", 6.0), ("e4m3", 448.0)])
def test_e8m0_scale_is_the_smallest_power_of_two_that_fits(element, fmax):
    amax = torch.tensor([fmax, fmax * (1 + 2**-23), fmax / 2, fmax * 2**-130, 0.0,
                         float(torch.finfo(torch.float32).max), float("inf")])
    byte = e8m0_scales(amax, element)
    assert byte.tolist()[:3] == [127, 128, 126]
    assert byte[3] == 0  # clamped to 2^-127
    assert byte[6] == 0xFF
    finite = amax[:6] <= fmax * e8m0_values(byte[:6])
    assert finite.all()
    assert (amax[:3] > fmax * e8m0_values(byte[:3]) / 2).all()  # smallest
    assert e8m0_values(torch.tensor([0, 127, 254], dtype=torch.uint8)).tolist() == [
        2.0**-127, 1.0, 2.0**127]
    assert torch.isnan(e8m0_values(torch.tensor([255], dtype=torch.uint8))).all()


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_mx_limits_round_trip(fmt):
    codec = make_codec(fmt)
    fmax = 1e38  # (within one code spacing of the FP32 maximum a value may decode to Inf)
    x = torch.tensor([fmax, -fmax / 3] + [0.0] * 30 + [1e-45] + [0.0] * 31)
    out, ok = _decode(codec, _encode(codec, x), [[32, 32]])
    assert ok and torch.isfinite(out).all()
    assert out[0] == fmax or abs(out[0] / fmax - 1) < 0.25
    assert out[32] in (0.0, 1e-45)  # below every code: flushed or kept, never garbage


# -- policies (all block codecs) --------------------------------------------------------------

@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_zero_and_nonfinite_blocks(fmt):
    codec = make_codec(fmt)
    b = codec.block_size
    x = torch.randn(4 * b, generator=torch.Generator().manual_seed(5))
    x[b : 2 * b] = 0.0
    x[2 * b : 3 * b] *= 0.01  # the poisoned block is not the segment's amax
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[2 * b + 3] = bad
        segments = [codec.groups((4 * b,))]
        out, ok = _decode(codec, _encode(codec, y, segments), segments)
        assert not ok
        assert torch.isnan(out[2 * b : 3 * b]).all()
        assert torch.equal(out[b : 2 * b], torch.zeros(b))
        assert torch.isfinite(out[:b]).all() and torch.isfinite(out[3 * b :]).all()
        clean = codec.round_trip(x)
        assert torch.equal(out[:b], clean[:b]) and torch.equal(out[3 * b :], clean[3 * b :])
    out, ok = _decode(codec, _encode(codec, torch.zeros(3)), [[3]])
    assert ok and torch.equal(out, torch.zeros(3))


# -- error bounds (property-based) -------------------------------------------------------------

def _block_bound(fmt, a_b, seg_amax):
    """Largest round-to-nearest error of an element of a block with amax ``a_b``."""
    if fmt == "nvfp4":  # ≤ one E2M1 unit of β s, β ≤ a_b/(6s)·(1+2⁻³) or + 2⁻⁹ (subnormal β)
        s = max(seg_amax / 2688, 2.0**-126)
        return max(a_b / 6 * 1.125, a_b / 6 + 2.0**-9 * s) * (1 + 1e-6)
    if fmt == "mxfp4":  # X = 2^e < a_b / 3; error ≤ X (half of the top spacing 2)
        return a_b / 3
    return a_b / 14  # mxfp8: X < a_b / 224, error ≤ 16 X


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fmt=st.sampled_from(BLOCK_FORMATS), n=st.integers(1, 200), seed=st.integers(0, 2**16),
       decades=st.floats(0, 8))
def test_round_trip_error_bounds(fmt, n, seed, decades):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.logspace(-decades, decades, n)
    codec = make_codec(fmt)
    out = codec.round_trip(x).double()
    xd, pos = x.double(), 0
    for length in codec.groups((n,)):
        g, o = xd[pos : pos + length], out[pos : pos + length]
        a_b = float(g.abs().max())
        assert float((o - g).abs().max()) <= _block_bound(fmt, a_b, float(xd.abs().max()))
        pos += length


# -- byte layout -------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_payload_bytes_exact_and_shard_layout_round_trip(fmt):
    codec = make_codec(fmt)
    b = codec.block_size
    segments = [(b, 5), (3, b, b, 1), (7,)]  # chunks of three tensors, cut at shard bounds
    n, g = sum(map(sum, segments)), sum(map(len, segments))
    codes = (n + 1) // 2 if fmt != "mxfp8" else n
    extra = 4 * len(segments) if fmt == "nvfp4" else 0
    assert codec.payload_bytes(segments) == extra + g + codes
    x = torch.randn(n, generator=torch.Generator().manual_seed(3)) * 10
    buf = _encode(codec, x, segments)
    out, ok = _decode(codec, buf, segments)
    assert ok
    # segment by segment, the same values as encoding each segment on its own
    pos = 0
    for seg in segments:
        alone, _ = _decode(codec, _encode(codec, x[pos : pos + sum(seg)], [seg]), [seg])
        assert torch.equal(out[pos : pos + sum(seg)], alone)
        pos += sum(seg)
    # the scale bytes sit where the layout says: decode them by hand
    scales = buf[extra : extra + g]
    if fmt == "nvfp4":
        assert torch.equal(buf[:extra].clone().view(torch.float32),
                           torch.stack([x[:b + 5].abs().max(), x[b + 5 : 2 * b + 9].abs().max(),
                                        x[-7:].abs().max()]) / 2688)
    else:
        first = e8m0_values(scales[:1])
        assert x[:b].abs().max() <= first * (6 if fmt == "mxfp4" else 448)
    with pytest.raises(ValueError):
        codec.encode_into(torch.empty(codec.payload_bytes(segments) + 1, dtype=torch.uint8),
                          x, segments)


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
@pytest.mark.parametrize("n", [1, 47, 64])
def test_decode_into_an_unaligned_slice(fmt, n):
    """Decoding into a view at an odd element offset (a shard inside a flat buffer) gives
    the same values as decoding into a fresh tensor."""
    codec = make_codec(fmt)
    segments = [codec.groups((n,))]
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    buf = _encode(codec, x, segments)
    fresh, _ = _decode(codec, buf, segments)
    flat = torch.full((n + 2,), 7.0)
    assert codec.decode_into(flat[1 : n + 1], buf, segments)
    assert torch.equal(flat[1 : n + 1], fresh)
    assert flat[0] == 7.0 and flat[-1] == 7.0


def test_bytes_per_element_of_a_large_tensor():
    shape = (1024, 1024)
    assert make_codec("nvfp4").bytes_per_element(shape) == pytest.approx(0.5625, abs=1e-5)
    assert make_codec("mxfp4").bytes_per_element(shape) == 0.53125
    assert make_codec("mxfp8").bytes_per_element(shape) == 1.03125


# -- stochastic rounding -----------------------------------------------------------------------

@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_stochastic_rounding_is_unbiased_and_seeded(fmt):
    codec = make_codec(fmt, rounding="stochastic")
    nearest = make_codec(fmt)
    x = torch.randn(256, generator=torch.Generator().manual_seed(0))
    trials = 400  # the same 256 values as 400 segments: each segment draws its own stream
    segments = [codec.groups((256,))] * trials
    outs, _ = _decode(codec, _encode(codec, x.repeat(trials), segments, seed=7), segments)
    outs = outs.view(trials, 256)
    again, _ = _decode(codec, _encode(codec, x.repeat(trials), segments, seed=7), segments)
    assert torch.equal(outs.reshape(-1), again)  # same seed, same codes (as on every rank)
    other, _ = _decode(codec, _encode(codec, x, segments[:1], seed=8), segments[:1])
    assert not torch.equal(other, outs[0])  # another seed (step), another stream
    assert not torch.equal(outs[0], outs[1])
    # unbiased: the mean over streams approaches x within 5 standard errors (a rounding's
    # standard deviation is at most half a spacing, at most a_b / 3 in every format), while
    # round to nearest keeps its deterministic error
    gap = (outs.mean(0) - x).abs()
    a_b = torch.stack([c.abs().max().expand(c.numel()) for c in x.split(codec.block_size)])
    assert bool((gap <= 5 * a_b.reshape(-1) / 3 / trials**0.5).all())
    bias_nn = (nearest.round_trip(x) - x).abs()
    assert float(gap.mean()) < 0.3 * float(bias_nn.mean())


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_senders_round_independently_so_their_errors_average_out(fmt):
    """Stage 1 draws one stream per sender: four ranks holding the same gradient send four
    different roundings, and the error of their mean is about half (1/√4) of one rounding's.
    A stream shared by the senders would give four identical payloads and no reduction."""
    world = 4
    layout = ShardLayout.build([(64, 256)], make_codec(fmt, rounding="stochastic"), world)
    x = torch.randn(64 * 256, generator=torch.Generator().manual_seed(0))
    sent = [encode(x, layout, seed=5, sender=r) for r in range(world)]
    assert torch.equal(sent[0], encode(x, layout, seed=5, sender=0))  # seeded
    assert not torch.equal(sent[0], sent[1])
    one = (decode(sent[0], layout) - x).norm()
    mean = (sum(decode(s, layout) for s in sent) / world - x).norm()
    assert mean < 0.6 * one


def test_stochastic_rounding_only_for_block_formats():
    with pytest.raises(ValueError, match="stochastic"):
        GeoFP8Config(format="e4m3", rounding="stochastic")
    with pytest.raises(ValueError, match="rounding"):
        make_codec("nvfp4", rounding="up")
    assert GeoFP8Config(format="nvfp4", rounding="stochastic").rounding == "stochastic"


# -- the random Hadamard transform at the codec block ----------------------------------------

def test_rht_mixes_within_codec_blocks_and_round_trips_through_state():
    t = make_transform("rht", 0.1, dim=96, block=16, seed=3)
    assert isinstance(t, RandomHadamard) and t.block == 16 and t.name == "rht"
    G = torch.randn(5, 96)
    Gt = t.forward(G)
    assert torch.allclose(t.inverse(Gt), G, atol=1e-5)
    # a block of 16 columns depends only on the same 16 columns of G
    G2 = G.clone()
    G2[:, 16:32] += 1.0
    changed = (t.forward(G2) - Gt).abs().amax(0) > 0
    assert changed[16:32].all() and not changed[:16].any() and not changed[32:].any()
    back = transform_from_state("rht", t.state())
    assert torch.equal(back.forward(G), Gt) and back.block == 16
    assert make_transform("rht", 0.1, dim=24, block=16).block == 8  # 8 divides 24, 16 not
    with pytest.raises(ValueError, match="power of two"):
        RandomHadamard(32, block=12)


def test_block_methods_keep_their_format_and_refuse_another():
    for name, fmt in [("nvfp4", "nvfp4"), ("nvfp4-auto-ef", "nvfp4"), ("mxfp4-rht-ef", "mxfp4"),
                      ("mxfp8-ef", "mxfp8")]:
        assert METHODS[name].config().format == fmt
        with pytest.raises(ValueError, match=r"does not take \['format'\]"):
            METHODS[name].config(format="e5m2")
    with pytest.raises(ValueError, match=r"does not take \['k'\]"):
        METHODS["fp8-ef"].config(k=8)
    with pytest.raises(ValueError, match="does not take"):
        METHODS["fp32"].build(None, format="e5m2")
    assert METHODS["nvfp4-geo-ef"].takes(format="e5m2", k=8, refresh_every=None) == {
        "k": 8, "refresh_every": None}
    assert METHODS["nvfp4-auto-ef"].config(k=8).k == 8
    assert METHODS["nvfp4"].config().error_feedback is False
    assert METHODS["nvfp4-ef"].config().error_feedback is True


# -- the exact collective on gloo equals its simulation ---------------------------------------

SHAPES = [(5, 7), (3,), (64,), (10, 40)]
NUMEL = sum(torch.Size(s).numel() for s in SHAPES)
CODECS = [(fmt, rounding) for fmt in BLOCK_FORMATS for rounding in ("nearest", "stochastic")]


def _inputs(world_size):
    return [torch.randn(NUMEL, generator=torch.Generator().manual_seed(i)) * (i + 1)
            for i in range(world_size)]


def _collective_worker(rank, world_size):
    outs = []
    for fmt, rounding in CODECS:
        layout = ShardLayout.build(SHAPES, make_codec(fmt, rounding=rounding), world_size)
        outs.append(exact_allreduce(_inputs(world_size)[rank].clone(), layout, seed=11))
    return outs


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_exact_collective_equals_simulation_bitwise(world_size):
    outs = run_ranks(_collective_worker, world_size)
    ref = torch.stack(_inputs(world_size)).sum(0)
    for i, (fmt, rounding) in enumerate(CODECS):
        layout = ShardLayout.build(SHAPES, make_codec(fmt, rounding=rounding), world_size)
        expected = simulate_exact_allreduce(_inputs(world_size), layout, seed=11)
        for out in outs:
            assert torch.equal(out[i], expected), (fmt, rounding)
        tol = 0.08 if fmt == "mxfp8" else 0.35  # two roundings (SR: ~1.5x the RelL2 of RN)
        assert (expected - ref).norm() / ref.norm() < tol, (fmt, rounding)


# -- replicas stay bit-identical with every block-format method ------------------------------

def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _train_worker(rank, world_size, names, steps):
    digests = []
    for name in names:
        model = make_model()
        ddp = DDP(model, bucket_cap_mb=0.01)
        state, hook, _ = METHODS[name].build(
            model, **METHODS[name].takes(refresh_every=4, profile_steps=2, k=8, budget=0.9))
        ddp.register_comm_hook(state, hook)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(steps):
            opt.zero_grad()
            loss_fn(ddp, step, rank).backward()
            opt.step()
        assert state.stats()["step"] == steps
        digests.append((_digest(model.parameters()),
                        all(bool(torch.isfinite(p).all()) for p in model.parameters())))
    return digests


BLOCK_METHODS = [m for m in METHODS if METHODS[m].settings.get("format") in BLOCK_FORMATS]


@pytest.mark.distributed
def test_replicas_bit_identical_after_20_steps_with_every_block_method():
    out = run_ranks(_train_worker, 2, (BLOCK_METHODS, 20), timeout=300)
    for i, name in enumerate(BLOCK_METHODS):
        assert out[0][i][1], f"{name}: non-finite parameters"
        assert out[1][i] == out[0][i], f"{name}: replicas differ"
    digest = {name: out[0][i][0] for i, name in enumerate(BLOCK_METHODS)}
    for plain, other in [("nvfp4", "nvfp4-ef"), ("nvfp4-ef", "nvfp4-rht-ef"),
                         ("nvfp4-ef", "nvfp4-sr-ef"),
                         ("nvfp4-ef", "nvfp4-geo-ef"), ("nvfp4-ef", "nvfp4-fresh-ef"),
                         ("mxfp4-ef", "mxfp4-rht-ef"), ("mxfp4-ef", "mxfp4-geo-ef"),
                         ("budget", "budget-ef2")]:
        assert digest[plain] != digest[other], f"{other} trains exactly like {plain}"


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_encoding_in_place_gives_the_same_payload(fmt, rounding):
    """``overwrite=True`` divides ``x`` by its block scales in place instead of into new
    pieces: the same payload byte for byte (two segments, a short last block, an Inf, more
    than one piece of the encoder), and ``x`` is used up (the CPU's native NVFP4 kernel,
    round to nearest, never writes it)."""
    codec = make_codec(fmt, rounding=rounding)
    numel = (1 << 17) + 37
    segments = [codec.groups((1000,)), codec.groups((numel - 1000,))]
    x = torch.randn(numel, generator=torch.Generator().manual_seed(4)) * torch.logspace(
        -8, 8, numel)
    x[77] = float("inf")
    expect = torch.empty(codec.payload_bytes(segments), dtype=torch.uint8)
    codec.encode_into(expect, x, segments, seed=9)
    got, work = torch.empty_like(expect), x.clone()
    codec.encode_into(got, work, segments, seed=9, overwrite=True)
    assert torch.equal(got, expect)
    native_kernel = fmt == "nvfp4" and rounding == "nearest" and native.kernels() is not None
    assert torch.equal(work.nan_to_num(), x.nan_to_num()) == native_kernel
