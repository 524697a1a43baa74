"""Round-trip fidelity analysis and the `geofp8 fidelity` command."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from geofp8.codecs import FP8Codec
from geofp8.comm import ShardLayout, simulate_exact_allreduce
from geofp8.geometry.factory import make_transform
from geofp8.geometry.transforms import Identity
from geofp8.tools import analysis, cli, data, models

SMALL = dict(seq_len=32, batch_size=4, vocab_size=512)


def _full(A, damping):
    """The full input-side ``(A+λI)^{-1/2}`` from the library's factory."""
    return make_transform("full", damping, A=A)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("cache")
        mp.setenv("GEOFP8_CACHE", str(path))
        yield path


@pytest.fixture(scope="module")
def setup(cache):
    return models.load_model_and_data("llama-tiny", seq_len=32, vocab_size=512, seed=0)


def _param_grads(model, inputs, targets):
    """Weight gradients of every Linear from autograd, independently of the hooks."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=inputs).logits
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()
    out = {n: m.weight.grad.clone() for n, m in model.named_modules()
           if isinstance(m, torch.nn.Linear)}
    model.zero_grad(set_to_none=True)
    return out


def test_hooked_gradients_are_the_weight_gradients(setup):
    model, td = setup
    x, y = data.get_batch(td.train, 0, 4)
    ref = _param_grads(model, x, y)
    halves = analysis.collect(model, [(x[:2], y[:2]), (x[2:], y[2:])], output_side=True)
    assert set(halves.grads) == set(ref) and len(ref) == 4 * 7 + 1
    for name, G in ref.items():
        mean = torch.stack(halves.grads[name]).mean(0)  # equal micro-batches: full-batch grad
        assert torch.allclose(mean, G, rtol=1e-4, atol=1e-6 * float(G.abs().max()))
    # A and S count every token of both micro-batches.
    first = "model.layers.0.self_attn.q_proj"
    assert int(halves.A[first].weight) == x.numel()
    assert halves.S[first].mean().shape == (128, 128)
    assert all(p.grad is None for p in model.parameters())


def test_averaged_round_trip_uses_the_exact_all_reduce():
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(24, 32, generator=gen) for _ in range(3)]
    codec = FP8Codec("e5m2")
    single = analysis.averaged_round_trip(grads[:1], Identity(), codec)
    assert torch.equal(single, codec.round_trip(grads[0]))
    three = analysis.averaged_round_trip(grads, Identity(), codec)
    layout = ShardLayout.build([(24, 32)], codec, 3)
    assert torch.equal(three, simulate_exact_allreduce(grads, layout).reshape(24, 32) / 3)
    # A whitening transform maps back to the same Euclidean average.
    X = torch.randn(512, 32, generator=gen) * torch.logspace(0, -2, 32)
    T = _full((X.T @ X / 512).double(), 0.1)
    approx = analysis.averaged_round_trip(grads, T, codec)
    mean = torch.stack(grads).mean(0)
    assert approx.dtype == torch.float32
    assert 0 < analysis.metrics(approx, mean)["rel_l2"] < 0.1


def test_metrics():
    exact = torch.tensor([3.0, 4.0])
    m = analysis.metrics(torch.tensor([3.0, 5.0]), exact)
    assert m["rel_l2"] == pytest.approx(0.2)
    assert m["cos"] == pytest.approx(29 / (5 * math.sqrt(34)))
    assert m["max_err"] == 1.0 and m["mse"] == 0.5
    assert analysis.metrics(torch.zeros(3), torch.zeros(3))["rel_l2"] == 0.0


def test_transform_names():
    assert analysis.expand_transforms(["euclidean", "lowrank", "block", "lowrank16"],
                                      [8, 16], [32]) == [
        "euclidean", "lowrank8", "lowrank16", "block32"]
    with pytest.raises(ValueError, match="unknown transform"):
        analysis.expand_transforms(["lowrankx"], [8], [32])
    assert analysis.layer_type("model.layers.3.mlp.down_proj") == "down"
    assert analysis.layer_type("lm_head") == "lm_head"
    with pytest.raises(ValueError, match="multiple"):
        analysis.FidelityConfig(batch_size=6, ranks=4)


def test_report_schema_and_geometry_gain(setup):
    model, td = setup
    config = analysis.FidelityConfig(
        **SMALL, formats=["e4m3", "e5m2"],
        transforms=["euclidean", "diag", "full", "lowrank", "output", "kfac"], ks=[8])
    report = json.loads(json.dumps(analysis.fidelity(model, td.train, config)))
    assert set(report) == {"config", "layers", "summary", "by_type"}
    keys = [m["key"] for m in report["config"]["methods"]]
    assert "euclidean/e5m2/tensor" in keys and "lowrank8/e4m3/tensor/d0.1" in keys
    assert len(keys) == 2 * 6
    assert len(report["layers"]) == 29
    for name, per_method in report["layers"].items():
        assert list(per_method) == keys, name
        for m in per_method.values():
            assert set(m) == {"rel_l2", "cos", "max_err", "mse"}
            assert 0 < m["rel_l2"] < 0.2 and 0.98 < m["cos"] <= 1 + 1e-9
            assert m["max_err"] >= math.sqrt(m["mse"]) > 0
    for k in keys:
        rel = [report["layers"][n][k]["rel_l2"] for n in report["layers"]]
        assert report["summary"][k]["rel_l2_mean"] == pytest.approx(sum(rel) / len(rel))
        assert min(rel) <= report["summary"][k]["rel_l2_median"] <= max(rel)
    assert list(report["by_type"]) == ["q", "k", "v", "o", "gate", "up", "down", "lm_head"]
    mean = {k: v["rel_l2_mean"] for k, v in report["summary"].items()}
    # Plain FP8 sits at the mantissa floor; E5M2 has one bit less than E4M3.
    assert 0.015 < mean["euclidean/e4m3/tensor"] < 0.04
    assert 1.5 < mean["euclidean/e5m2/tensor"] / mean["euclidean/e4m3/tensor"] < 2.5
    # Same-batch whitening beats it, a diagonal factor does not (DESIGN §3).
    assert mean["full/e5m2/tensor/d0.1"] < 0.85 * mean["euclidean/e5m2/tensor"]
    assert mean["diag/e5m2/tensor/d0.1"] == pytest.approx(mean["euclidean/e5m2/tensor"], rel=0.05)
    text = analysis.format_report(report)
    assert "== e5m2 / tensor scaling: down ==" in text and "all layers: median" in text


def test_euclidean_single_rank_is_the_codec_round_trip(setup):
    model, td = setup
    config = analysis.FidelityConfig(**SMALL, formats=["e4m3"], scalings=["tensor", "row"],
                                     transforms=["euclidean"])
    report = analysis.fidelity(model, td.train, config)
    x, y = data.get_batch(td.train, 0, 4)
    for name, G in _param_grads(model, x, y).items():
        for scaling in ("tensor", "row"):
            direct = float((FP8Codec("e4m3", scaling).round_trip(G) - G).norm() / G.norm())
            got = report["layers"][name][f"euclidean/e4m3/{scaling}"]["rel_l2"]
            assert got == pytest.approx(direct, rel=1e-3), (name, scaling)


def test_cli_end_to_end_with_ranks_and_previous_factors(cache, tmp_path, capsys):
    out = tmp_path / "r" / "fidelity.json"
    rc = cli.main(["fidelity", "--model", "llama-tiny", "--seq-len", "32", "--batch-size", "4",
                   "--vocab-size", "512", "--ranks", "2", "--factor-source", "previous",
                   "--previous-batches", "2", "--formats", "e5m2", "--scalings", "tensor,block",
                   "--block-size", "64", "--transforms", "euclidean,lowrank,hadamard",
                   "--ranks-k", "8", "--dampings", "0.1,1", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    cfg = report["config"]
    assert (cfg["ranks"], cfg["tokens_per_rank"], cfg["factor_tokens"]) == (2, 64, 256)
    assert cfg["factor_source"] == "previous"
    keys = {m["key"] for m in cfg["methods"]}
    assert keys == {f"{t}/e5m2/{s}{d}" for s in ("tensor", "block64")
                    for t, d in [("euclidean", ""), ("hadamard", ""), ("lowrank8", "/d0.1"),
                                 ("lowrank8", "/d1")]}
    down = report["layers"]["model.layers.1.mlp.down_proj"]
    assert 0.01 < down["euclidean/e5m2/tensor"]["rel_l2"] < 0.1
    assert set(report["summary"]) == keys
    printed = capsys.readouterr().out
    assert "2 rank(s)" in printed and "e5m2 / block64 scaling: summary" in printed


def test_block_formats_and_rht_at_the_codec_block(setup):
    model, td = setup
    config = analysis.FidelityConfig(**SMALL, formats=["nvfp4", "mxfp4"],
                                     scalings=["tensor", "row"], transforms=["euclidean", "rht"])
    assert config.rht_blocks() == [16, 32]
    report = analysis.fidelity(model, td.train, config)
    keys = [m["key"] for m in report["config"]["methods"]]
    assert keys == [f"{t}/{f}/block{b}" for f, b in (("nvfp4", 16), ("mxfp4", 32))
                    for t in ("euclidean", "rht16", "rht32")]
    mean = {k: v["rel_l2_mean"] for k, v in report["summary"].items()}
    # 4-bit codes: about 4x the FP8 error; MX's power-of-two scales cost a little more
    assert 0.06 < mean["euclidean/nvfp4/block16"] < 0.2
    assert mean["euclidean/nvfp4/block16"] < mean["euclidean/mxfp4/block32"] < 0.25
    with pytest.raises(ValueError, match="unknown format"):
        analysis.FidelityConfig(formats=["fp4"])
