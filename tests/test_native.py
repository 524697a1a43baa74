"""The CPU's native kernels (E4M3; NVFP4's E2M1): bit for bit torch's conversion, rounding
and products, the same bytes through the codecs and the stages as torch's ops, refused
bounds, a failed build."""

import pytest
import torch

from geofp8.codecs import FP8Codec, NVFP4Codec, fp4, native
from geofp8.comm import ShardLayout
from geofp8.comm.stages import (
    decode_gathered,
    decode_sum,
    encode,
    encode_reduced,
    encode_with_error,
    rounding_error,
)

pytestmark = pytest.mark.skipif(native.kernels() is None, reason="no C compiler")


def _every_rounding_case() -> torch.Tensor:
    """FP32 values of every sign, exponent and top 11 mantissa bits, each with low bits
    just below, at and just above a tie of every E4M3 rounding position (7.3 M values: NaN,
    ±Inf, overflow, subnormals included)."""
    high = torch.arange(1 << 20, dtype=torch.int64) << 12
    low = torch.tensor([0, 1, 0x7FF, 0x800, 0x801, 0xFFE, 0xFFF])
    bits = (high[:, None] | low).reshape(-1)
    return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(
        torch.float32)


def test_encode_is_torchs_conversion_of_the_quotient():
    x = _every_rounding_case()
    got = torch.empty(x.numel(), dtype=torch.uint8)
    native.e4m3_encode(got, x, torch.ones(1), (x.numel(),))
    assert torch.equal(got, x.to(torch.float8_e4m3fn).view(torch.uint8))
    lengths = (x.numel() // 3, 1, x.numel() - x.numel() // 3 - 1)
    scales = torch.tensor([3.7e-3, 0.0, 2.5e30])  # a zero scale: x / 0 is ±Inf or NaN
    native.e4m3_encode(got, x, scales, lengths)
    per_element = torch.repeat_interleave(scales, torch.tensor(lengths))
    assert torch.equal(got, (x / per_element).to(torch.float8_e4m3fn).view(torch.uint8))


def test_the_rounding_error_is_the_decode_subtracted():
    """``x − value(code) · s`` from the encoding pass: the bits of decoding the codes and
    subtracting (a NaN's payload aside), for every rounding case and scales that are tiny,
    huge, zero (``x / 0``: ±Inf or NaN codes) or NaN (a non-finite group's), E4M3 and E2M1."""
    x = _every_rounding_case()
    n = x.numel()
    lengths = (7, n // 4, n // 4, 1, n - n // 2 - 8)  # the first group: +0 and subnormals
    scales = torch.tensor([0.0, 3.7e-3, 2.5e30, float("nan"), 1e-40])
    codes, error, values = torch.empty(n, dtype=torch.uint8), torch.empty(n), torch.empty(n)
    native.e4m3_encode(codes, x, scales, lengths, error=error)
    native.e4m3_decode(values, codes, scales, lengths)
    _assert_same_bits([codes, error], [_codes_of(x, scales, lengths), x - values])
    runs = [(0, 0, 1, 5), (5, 1, (n - 5) // 16, 16), (5 + (n - 5) // 16 * 16, 1 + (n - 5) // 16,
                                                       1, (n - 5) % 16)]
    scales = torch.rand(runs[-1][1] + 1, generator=torch.Generator().manual_seed(5)) * 1e3
    scales[:4] = torch.tensor([0.0, float("nan"), 1e-42, 3e38])
    packed = torch.empty((n + 1) // 2, dtype=torch.uint8)
    native.e2m1_encode(packed, x, scales, runs, error=error)
    native.e2m1_decode(values, packed, scales, runs)
    _assert_same_bits([packed, error], [_e2m1_packed(x, scales, runs), x - values])


def _codes_of(x, scales, lengths):
    codes = torch.empty(x.numel(), dtype=torch.uint8)
    native.e4m3_encode(codes, x, scales, lengths)
    return codes


def test_decode_is_torchs_product():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(40)
    lengths = (256 * 13, 1, 256 * 27 - 1)
    scales = torch.tensor([0.37, float("inf"), 1e-30])
    out = torch.empty(codes.numel())
    native.e4m3_decode(out, codes, scales, lengths)
    want = codes.view(torch.float8_e4m3fn).float() * torch.repeat_interleave(
        scales, torch.tensor(lengths))
    assert torch.equal(out.isnan(), want.isnan())
    assert torch.equal(out.nan_to_num().view(torch.int32), want.nan_to_num().view(torch.int32))


def _e2m1_packed(x: torch.Tensor, divisor: torch.Tensor, runs) -> torch.Tensor:
    packed = torch.empty((x.numel() + 1) // 2, dtype=torch.uint8)
    native.e2m1_encode(packed, x, divisor, runs)
    return packed


def _torch_packed(codes: torch.Tensor) -> torch.Tensor:
    packed = torch.empty((codes.numel() + 1) // 2, dtype=torch.uint8)
    fp4.pack_nibbles(codes, packed)
    return packed


def test_e2m1_encode_is_the_grid_rounding():
    """Every rounding case (ties at 0.25 … 5, saturation above 6, NaN a signed zero) as
    :func:`geofp8.codecs.fp4.e2m1_encode` rounds it, and the quotient by each group's
    divisor as torch divides, packed two per byte as :func:`fp4.pack_nibbles` packs (an odd
    count: a last byte alone)."""
    x = _every_rounding_case()
    n = x.numel()
    got = _e2m1_packed(x, torch.ones(1), [(0, 0, 1, n)])
    assert torch.equal(got, _torch_packed(fp4.e2m1_encode(x)))
    x = x[: 16 * 1000 + 3]  # groups of 16, a short last one
    divisor = torch.rand(1001, generator=torch.Generator().manual_seed(0)) * 1e3
    got = _e2m1_packed(x, divisor, [(0, 0, 1000, 16), (16000, 1000, 1, 3)])
    per_element = torch.repeat_interleave(divisor, torch.tensor([16] * 1000 + [3]))
    assert torch.equal(got, _torch_packed(fp4.e2m1_encode((x / per_element).contiguous())))


@pytest.mark.parametrize("numel", [255, 256])
def test_nibbles_are_decoded_as_torch_does(numel):
    """The decode of groups starting and ending in either nibble: ``value · scale_g`` as
    torch unpacks and scales."""
    codes = torch.arange(numel, dtype=torch.int64).remainder(16).to(torch.uint8)
    runs = [(0, 0, 1, 5), (5, 1, 14, 16), (229, 15, 1, numel - 229)]
    scales = torch.tensor([0.3, *torch.logspace(-20, 20, 14).tolist(), float("inf")])
    out = torch.empty(numel)
    native.e2m1_decode(out, _torch_packed(codes), scales, runs)
    lengths = torch.tensor([5] + [16] * 14 + [numel - 229])
    expect = fp4.e2m1_values(codes.long()) * torch.repeat_interleave(scales, lengths)
    assert torch.equal(out.isnan(), expect.isnan())
    assert torch.equal(out.nan_to_num().view(torch.int32), expect.nan_to_num().view(torch.int32))


def test_runs_amax_is_the_block_amax(monkeypatch):
    """Every group's largest magnitude as torch's ops take it (exact), ``+Inf`` once the
    codec's policy is applied for a group holding NaN or ±Inf; ``-0`` groups give 0."""
    x = torch.randn(16 * 50 + 7, generator=torch.Generator().manual_seed(2)) * 1e3
    x[3], x[20], x[40] = float("nan"), float("-inf"), float("inf")
    x[55:71] = -0.0  # group 4
    blocks = fp4.blocks_of([[7] + [16] * 50])
    got = fp4.block_amax(x, blocks)
    monkeypatch.setattr(native, "kernels", lambda: None)
    want = fp4.block_amax(x, blocks)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert (got[[0, 1, 3]] == float("inf")).all() and got[4] == 0 and not got.isnan().any()


def _assert_same_bits(got, want):
    """Tensor by tensor the same bits (a NaN's payload aside)."""
    for a, b in zip(got, want, strict=True):
        if a.is_floating_point():
            assert torch.equal(a.isnan(), b.isnan())
            a, b = a.nan_to_num().view(torch.uint8), b.nan_to_num().view(torch.uint8)
        assert torch.equal(a, b)


def test_nvfp4_block_scales_are_torchs(monkeypatch):
    """Segment and block scales, codes and values from blocks' amaxes of every magnitude
    (0, subnormal, huge, +Inf: non-finite) as torch's ops compute them; a segment of only
    non-finite blocks gets the smallest scale."""
    g = torch.Generator().manual_seed(4)
    amax = torch.rand(3000, generator=g) * torch.logspace(-44, 38, 3000)
    amax[::7], amax[5::11] = 0.0, float("inf")
    amax[2990:] = float("inf")
    segments = [[16] * 1000, [16] * 1, [16] * 1989, [16] * 10]
    codec = NVFP4Codec()
    got = codec._scales(amax, segments)
    monkeypatch.setattr(native, "kernels", lambda: None)
    want = codec._scales(amax, segments)
    _assert_same_bits(got, want)
    assert got[0][-1] == 2.0**-149


def test_a_call_split_across_threads_gives_the_same_bytes(monkeypatch):
    """Ranges cut at 64-element multiples (inside groups of every kernel but the amax, whose
    cuts move to group starts, or which takes each range's maxima where there are fewer
    groups than threads) give the bytes of one thread's call."""
    g = torch.Generator().manual_seed(3)
    segments = [[5] + [16] * 40 + [9], [16] * 13, [3, 16, 16, 1]]
    blocks = fp4.blocks_of(segments)
    lengths = tuple(n for seg in segments for n in seg)
    x = torch.randn(blocks.numel, generator=g) * torch.logspace(-4, 4, blocks.numel).flip(0)
    scales = torch.rand(blocks.groups, generator=g) + 0.01

    def every_kernel():
        codes, values = torch.empty(x.numel(), dtype=torch.uint8), torch.empty(x.numel())
        errors = torch.empty(2, x.numel())
        native.e4m3_encode(codes, x, scales, lengths, error=errors[0])
        native.e4m3_decode(values, codes, scales, lengths)
        packed = _e2m1_packed(x, scales, blocks.runs)
        native.e2m1_encode(torch.empty_like(packed), x, scales, blocks.runs, error=errors[1])
        nibbles = torch.empty(x.numel())
        native.e2m1_decode(nibbles, packed, scales, blocks.runs)
        few = [(0, 0, 1, 5), (5, 1, 2, (x.numel() - 5) // 2)]  # fewer groups than threads
        return (codes, values, errors, packed, nibbles,
                native.runs_amax(x, blocks.runs, blocks.groups),
                native.runs_amax(x[: few[-1][0] + 2 * few[-1][3]], few, 3),
                native.runs_amax(x, [(0, 0, 1, x.numel())], 1))

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = every_kernel()
        torch.set_num_threads(7)
        monkeypatch.setattr(native, "PARALLEL_MIN", 100)
        assert len(native._cuts(x.numel())) == 8 and len(native._cuts(x.numel(), blocks.runs)) == 8
        split = every_kernel()
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(alone, split):
        assert torch.equal(a, b)


def test_out_of_bounds_arguments_are_refused():
    x, codes = torch.randn(10), torch.empty(10, dtype=torch.uint8)
    with pytest.raises(ValueError, match="elements"):
        native.e4m3_encode(codes, x, torch.ones(2), (5, 6))
    with pytest.raises(ValueError, match="3 FP32 scales"):
        native.e4m3_encode(codes, x, torch.ones(3), (5, 5))
    with pytest.raises(ValueError, match="contiguous"):
        native.e4m3_decode(torch.empty(20)[::2], codes, torch.ones(1), (10,))
    with pytest.raises(ValueError, match="FP32"):
        native.e4m3_decode(torch.empty(10, dtype=torch.float64), codes, torch.ones(1), (10,))
    with pytest.raises(ValueError, match="tile"):
        native.e2m1_encode(codes[:5], x, torch.ones(2), [(0, 0, 1, 5), (6, 1, 1, 4)])
    with pytest.raises(ValueError, match="elements"):
        native.e2m1_encode(codes[:5], x, torch.ones(2), [(0, 0, 2, 16)])
    with pytest.raises(ValueError, match="packed"):
        native.e2m1_encode(codes, x, torch.ones(1), [(0, 0, 1, 10)])
    with pytest.raises(ValueError, match="packed"):
        native.e2m1_decode(torch.empty(10), codes[:4], torch.ones(1), [(0, 0, 1, 10)])


def _stages(layout, inputs):
    """Every stage of the exact collective for rank 0 of ``inputs`` (one vector per rank),
    the sender's rounding error both from the encoding pass and decoded back."""
    sent = [encode(x, layout, sender=r) for r, x in enumerate(inputs)]
    assert torch.equal(encode_with_error(inputs[0], layout)[0], sent[0])
    error = encode_with_error(inputs[0], layout)[1]
    nbytes = layout.send_bytes(0)
    reduced = decode_sum(torch.cat([s[:nbytes] for s in sent]), layout, 0)
    gathered = torch.stack([encode_reduced(reduced, layout, 0)] * layout.world_size)
    decoded_back = rounding_error(sent[0], inputs[0], layout)
    _assert_same_bits([error], [decoded_back])
    return (sent[0], decoded_back, error, reduced, gathered, decode_gathered(gathered, layout))


ODD = [(37, 11), (3,), (64, 16), (5, 300)]  # segments of odd lengths at N = 3


@pytest.mark.parametrize(("codec", "shapes"), [
    (FP8Codec("e4m3", "tensor"), ODD), (FP8Codec("e4m3", "row"), ODD),
    (FP8Codec("e4m3", "block", 32), ODD), (NVFP4Codec(), ODD),
    (NVFP4Codec(), [(36, 12), (64, 16), (6, 300)])], ids=["tensor", "row", "block", "nvfp4",
                                                          "nvfp4-segmentwise"])
def test_the_stages_give_torchs_bits_with_or_without_the_native_kernels(monkeypatch, codec,
                                                                         shapes):
    """A real bucket's layout (unequal tensors, several shards, irregular groups at N = 3):
    the same bytes and values whether the codec runs the native kernels or torch's ops."""
    n = 3
    layout = ShardLayout.build(shapes, codec, n, kernels="chunked")
    assert layout.encodes_error == (shapes != ODD or codec.format != "nvfp4")
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(layout.numel, generator=g) * torch.logspace(-3, 3, layout.numel)
              for _ in range(n)]
    inputs[1][7] = float("inf")  # a non-finite group: its scale and codes poison the sum
    results = {}
    for kind in ("native", "torch"):
        if kind == "torch":
            monkeypatch.setattr(native, "kernels", lambda: None)
        results[kind] = _stages(layout, inputs)
    _assert_same_bits(results["native"], results["torch"])


def test_a_failed_build_warns_and_falls_back(monkeypatch, tmp_path):
    """A compiler that fails: a warning, no kernels (torch's ops are used)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # exits 1
    native.kernels.cache_clear()
    try:
        with pytest.warns(UserWarning, match="did not build"):
            assert native.kernels() is None
        monkeypatch.setenv("GEOFP8_NATIVE", "0")
        native.kernels.cache_clear()
        assert native.kernels() is None
    finally:
        native.kernels.cache_clear()
