"""The CPU's native E4M3 kernels: bit for bit torch's conversion and product, the same
bytes through the codec and the stages as torch's ops, refused bounds, a failed build."""

import pytest
import torch

from geofp8.codecs import FP8Codec, native
from geofp8.comm import ShardLayout
from geofp8.comm.stages import decode_gathered, decode_sum, encode, encode_reduced, rounding_error

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
    native.encode(got, x, torch.ones(1), (x.numel(),))
    assert torch.equal(got, x.to(torch.float8_e4m3fn).view(torch.uint8))
    lengths = (x.numel() // 3, 1, x.numel() - x.numel() // 3 - 1)
    scales = torch.tensor([3.7e-3, 0.0, 2.5e30])  # a zero scale: x / 0 is ±Inf or NaN
    native.encode(got, x, scales, lengths)
    per_element = torch.repeat_interleave(scales, torch.tensor(lengths))
    assert torch.equal(got, (x / per_element).to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("with_minus", [False, True])
def test_decode_is_torchs_product(with_minus):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(40)
    lengths = (256 * 13, 1, 256 * 27 - 1)
    scales = torch.tensor([0.37, float("inf"), 1e-30])
    minus = torch.randn(codes.numel()) if with_minus else None
    out = torch.empty(codes.numel())
    native.decode(out, codes, scales, lengths, minus)
    want = codes.view(torch.float8_e4m3fn).float() * torch.repeat_interleave(
        scales, torch.tensor(lengths))
    if with_minus:
        want = minus - want
    assert torch.equal(out.isnan(), want.isnan())
    assert torch.equal(out.nan_to_num().view(torch.int32), want.nan_to_num().view(torch.int32))


def test_out_of_bounds_arguments_are_refused():
    x, codes = torch.randn(10), torch.empty(10, dtype=torch.uint8)
    with pytest.raises(ValueError, match="elements"):
        native.encode(codes, x, torch.ones(2), (5, 6))
    with pytest.raises(ValueError, match="scale per group"):
        native.encode(codes, x, torch.ones(3), (5, 5))
    with pytest.raises(ValueError, match="contiguous"):
        native.decode(torch.empty(20)[::2], codes, torch.ones(1), (10,))
    with pytest.raises(ValueError, match="FP32"):
        native.decode(torch.empty(10, dtype=torch.float64), codes, torch.ones(1), (10,))


def _stages(layout, inputs):
    """Every stage of the exact collective for rank 0 of ``inputs`` (one vector per rank)."""
    sent = [encode(x, layout, sender=r) for r, x in enumerate(inputs)]
    nbytes = layout.send_bytes(0)
    reduced = decode_sum(torch.cat([s[:nbytes] for s in sent]), layout, 0)
    gathered = torch.stack([encode_reduced(reduced, layout, 0)] * layout.world_size)
    return (sent[0], rounding_error(sent[0], inputs[0], layout), reduced,
            gathered, decode_gathered(gathered, layout))


@pytest.mark.parametrize("scaling", ["tensor", "row", "block"])
def test_the_stages_give_torchs_bits_with_or_without_the_native_kernels(monkeypatch, scaling):
    """A real bucket's layout (unequal tensors, several shards, irregular groups at N = 3):
    the same bytes and values whether the codec runs the native kernels or torch's ops."""
    shapes, n = [(37, 11), (3,), (64, 16), (5, 300)], 3
    layout = ShardLayout.build(shapes, FP8Codec("e4m3", scaling, 32), n, kernels="chunked")
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(layout.numel, generator=g) * torch.logspace(-3, 3, layout.numel)
              for _ in range(n)]
    inputs[1][7] = float("inf")  # a non-finite group: its scale and codes poison the sum
    results = {}
    for kind in ("native", "torch"):
        if kind == "torch":
            monkeypatch.setattr(native, "kernels", lambda: None)
        results[kind] = _stages(layout, inputs)
    for a, b in zip(results["native"], results["torch"]):
        assert torch.equal(a.isnan(), b.isnan()) if a.is_floating_point() else True
        assert torch.equal(a.nan_to_num().view(torch.uint8) if a.is_floating_point() else a,
                           b.nan_to_num().view(torch.uint8) if b.is_floating_point() else b)


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
