"""The benchmark's code paths at tiny sizes, the fused EF path and the scaling model."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import pytest
import torch

from geofp8.codecs import FP8Codec
from geofp8.geometry.fused import ef_quantize, naive_ef_quantize
from geofp8.geometry.statistics import LowRankFactor
from geofp8.geometry.transforms import LowRankInput
from geofp8.tools import bench, scaling
from geofp8.tools.cli import COMMANDS


@pytest.fixture(scope="module")
def quick_results():
    return bench.run_bench([1, 2, 4], [0.05], quick=True, repeats=1, log=lambda _s: None)


def test_codec_part_rows_are_positive(quick_results):
    rows = quick_results["codec"]["rows"]
    assert {(r["format"], r["scaling"]) for r in rows} == set(bench.CODECS) | {
        (f, f"block ({rounding})") for f, rounding in bench.BLOCK_CODECS}
    for r in rows:
        fp8 = (r["format"], r["scaling"]) in bench.CODECS
        for key in ("memcpy_gbps", "quantize_gbps", "dequantize_gbps", "q+d_gbps",
                    "q+d_vs_memcpy") + (("ef_fused_gbps",) if fp8 else ()):
            assert r[key] > 0 and r[key] == r[key]
    assert "memcpy" in quick_results["codec"]["table"]


def test_geometry_part_ratios(quick_results):
    rows = quick_results["geometry"]["rows"]
    assert rows and all(r["transform_vs_wgrad"] > 0 and r["wgrad_ms"] > 0 for r in rows)
    assert all(r["reduction_bytes"] == 4 * r["d_in"] * (r["k"] + 8) for r in rows)


def test_scaling_part_and_markdown(quick_results, tmp_path):
    cal = quick_results["scaling"]["calibration"]
    assert 0.0 <= cal["hidden"] <= 1.0
    if cal["hidden"] > 0:  # reachable: calibrated exactly (a slow codec can make it unreachable)
        assert cal["fp8_vs_fp32"] == pytest.approx(-0.1079, abs=1e-3)
    assert cal["gap_points_sketch_every_step"] >= cal["gap_points_refresh_every_K"] - 1e-9
    md = bench.to_markdown(quick_results, "geofp8 bench --quick")
    assert md.startswith("# Performance") and "CPU cores" in md and "Part 4b" in md


def main(argv: list[str]) -> int:
    """``geofp8 bench ...`` through the bench module's own parser (independent of the other
    subcommands' imports)."""
    assert COMMANDS["bench"][0] == "geofp8.tools.bench" and argv[0] == "bench"
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return bench.run(parser.parse_args(argv[1:]))


def test_cli_writes_json_and_markdown(tmp_path):
    out, md = tmp_path / "b.json", tmp_path / "perf.md"
    assert main(["bench", "--quick", "--parts", "1,4", "--sizes", "0.02", "--repeats", "1",
                 "--json", str(out), "--markdown", str(md)]) == 0
    data = json.loads(out.read_text())
    assert set(data) >= {"meta", "codec", "scaling"} and "geometry" not in data
    assert data["meta"]["cpu_count"] >= 1
    assert "Part 1" in md.read_text()


def test_cli_threads_sets_and_reports_torch_threads(tmp_path):
    out, before = tmp_path / "b.json", torch.get_num_threads()
    try:
        assert main(["bench", "--quick", "--parts", "1", "--sizes", "0.02", "--repeats", "1",
                     "--threads", "1", "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(before)
    data = json.loads(out.read_text())
    assert data["meta"]["torch_threads"] == 1 and "; 1 torch threads;" in data["codec"]["table"]


@pytest.mark.distributed
def test_part3_whole_step_on_real_ranks(tmp_path):
    out = tmp_path / "b.json"
    assert main(["bench", "--quick", "--parts", "3", "--ddp-steps", "3",
                 "--json", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["ddp"]["runs"][0]["rows"]}
    assert set(rows) == {"fp32", "fp8", "geofp8-auto"}
    base = rows["fp32"]["step_times_s"]
    for r in rows.values():  # each step's time over fp32's step of the same index
        steps = r["step_times_s"]
        assert len(steps) == 3 and r["step_s"] == sorted(steps)[1]
        assert r["vs_fp32"][0] == sorted(s / b for s, b in zip(steps, base))[1]
        assert r["vs_fp32"][1] <= r["vs_fp32"][0] <= r["vs_fp32"][2]
    assert rows["fp32"]["vs_fp32"] == [1.0, 1.0, 1.0]
    assert rows["fp32"]["bytes_per_element"] == 4.0  # ring all-reduce of FP32, 2 ranks
    assert 1.0 <= rows["fp8"]["bytes_per_element"] < 1.1  # counted from the collectives
    fid = rows["fp8"]["fidelity"]
    assert fid and all(0 < m["rel_l2"] < 0.1 and m["cos"] > 0.99 for m in fid.values())


# -- fused EF path --------------------------------------------------------------------------

@pytest.mark.parametrize("codec", [FP8Codec("e4m3"), FP8Codec("e5m2", "block", 32),
                                   FP8Codec("e4m3", "row")])
def test_ef_quantize_matches_naive_identity(codec):
    g = torch.randn(37, 65)
    r1 = torch.randn(37, 65) * 0.01
    r2 = r1.clone()
    p1, p2 = ef_quantize(g, r1, codec), naive_ef_quantize(g, r2, codec)
    assert torch.equal(p1.codes, p2.codes) and torch.equal(p1.scales, p2.scales)
    assert torch.equal(r1, r2)


def test_ef_quantize_lowrank_close_to_naive():
    torch.manual_seed(0)
    X = torch.randn(500, 64)
    tr = LowRankInput(LowRankFactor.from_matrix(X.T @ X / 500, 8), 0.1)
    g = torch.randn(40, 64)
    r1 = torch.zeros(40, 64)
    r2 = r1.clone()
    p1 = ef_quantize(g, r1, FP8Codec("e4m3"), tr)
    p2 = naive_ef_quantize(g, r2, FP8Codec("e4m3"), tr)
    assert torch.allclose(p1.dequantize(), p2.dequantize(), rtol=0.07, atol=1e-5)
    assert torch.allclose(r1, r2, atol=1e-2 * float(r2.abs().max()) + 1e-6)
    # EF invariant: what was sent plus the new residual is T(g) + old residual
    assert torch.allclose(p1.dequantize() + r1, tr.forward(g), atol=1e-5)


def test_ef_quantize_nonfinite_group_poisons_only_scale():
    g = torch.randn(4, 32)
    g[0, 0] = float("nan")
    r = torch.zeros(4, 32)
    p = ef_quantize(g, r, FP8Codec("e4m3", "row"))
    assert torch.isnan(p.scales[0]) and torch.isfinite(p.scales[1:]).all()
    assert torch.isnan(p.dequantize()[0]).all()


def test_quantize_and_dequantize_into_buffers():
    codec = FP8Codec("e4m3", "block", 16)
    x = torch.randn(1000)
    codes = torch.empty(1000, dtype=torch.uint8)
    out = torch.empty(1000)
    p = codec.quantize(x, out=codes)
    assert p.codes.data_ptr() == codes.data_ptr()
    y = p.dequantize(out=out)
    assert y.data_ptr() == out.data_ptr() and torch.equal(y, codec.round_trip(x))
    with pytest.raises(ValueError):
        codec.quantize(x, out=torch.empty(10, dtype=torch.uint8))
    with pytest.raises(ValueError):
        p.dequantize(out=torch.empty(10))


# -- scaling model --------------------------------------------------------------------------

W = scaling.Workload(scaling.MODELS["0.6B"], 16384, scaling.DEVICES["gh200"])


def test_fp8_bytes_are_a_quarter_of_fp32():
    p = 1e9
    assert scaling.gradient_bytes(p, "fp8") == scaling.gradient_bytes(p, "fp32") / 4
    assert scaling.gradient_bytes(p, "bf16") == scaling.gradient_bytes(p, "fp32") / 2
    assert scaling.gradient_bytes(p, "fp8", block=128) == pytest.approx(p * (1 + 4 / 128))


def test_collective_formulas():
    fab = scaling.FABRICS["ib200"]
    assert scaling.all_reduce_time(1e9, 1, fab) == 0.0
    t2 = scaling.all_reduce_time(1e9, 2, fab)
    assert t2 == pytest.approx(2 * fab.alpha + 1e9 / fab.inter_bw)
    big = scaling.all_reduce_time(1e9, 4096, fab)
    assert big > t2  # more steps, bandwidth term → 2B/bw, latency grows with N
    assert scaling.all_gather_time(1e9, 8, fab) == pytest.approx(
        scaling.all_reduce_time(1e9, 8, fab) / 2)


def test_fp8_between_nodes_only_costs_fp32_inside_them():
    fab = scaling.FABRICS["ib400x8"]  # 8 GPUs per node on NVLink
    parts = {m: scaling.step_time(W, 64, fab, m)["comm"] for m in ("fp32", "fp8", "fp8-node")}
    assert parts["fp8"] < parts["fp8-node"] < parts["fp32"]
    fp8, fp32 = (scaling.gradient_bytes(W.model.params, f) for f in ("fp8", "fp32"))
    inside = scaling.all_reduce_time(fp32, 8, fab)  # one node: the NVLink ring alone
    assert parts["fp8-node"] == pytest.approx(parts["fp8"] - scaling.all_reduce_time(fp8, 8, fab)
                                              + inside)


def test_more_bandwidth_smaller_comm_share():
    slow, fast = scaling.FABRICS["ib200"], scaling.FABRICS["ib400"]
    s_slow = scaling.step_time(W, 64, slow, "fp32")
    s_fast = scaling.step_time(W, 64, fast, "fp32")
    assert s_fast["comm"] < s_slow["comm"]
    assert s_fast["comm"] / s_fast["total"] < s_slow["comm"] / s_slow["total"]
    # and FP8's saving shrinks when the network is faster
    assert scaling.step_change(W, 64, fast, "fp8") > scaling.step_change(W, 64, slow, "fp8")


def test_monotone_in_overhead_and_overlap():
    fab = scaling.FABRICS["ib200"]
    cheap = scaling.Overheads(codec_vs_memcpy=0.9, geo_fraction=0.1, geo_vs_memcpy=1.0)
    dear = replace(cheap, geo_vs_memcpy=10.0)
    assert (scaling.step_change(W, 64, fab, "geofp8", ovh=cheap)
            < scaling.step_change(W, 64, fab, "geofp8", ovh=dear))
    assert (scaling.step_change(W, 64, fab, "fp8", ovh=cheap)
            <= scaling.step_change(W, 64, fab, "geofp8", ovh=cheap))
    more_hidden = replace(W, hidden=0.8)
    assert scaling.step_change(more_hidden, 64, fab, "fp8") > scaling.step_change(W, 64, fab,
                                                                                 "fp8")


def test_calibration_hits_target_and_clamps():
    fab = scaling.FABRICS["ib200"]
    h = scaling.calibrate_hidden(W, 64, fab, -0.1079)
    assert 0 < h < 1
    assert scaling.step_change(replace(W, hidden=h), 64, fab, "fp8") == pytest.approx(-0.1079,
                                                                                     abs=1e-6)
    assert scaling.calibrate_hidden(W, 64, fab, -0.99) == 0.0  # unreachable saving


def test_optimizer_part_times_both_orthogonalization_dtypes():
    res = bench.run_bench([5], [], quick=True, repeats=1, log=lambda _s: None)["optimizer"]
    assert [r["optimizer"] for r in res["rows"]] == [
        "Muon, Newton–Schulz FP32 + AdamW", "Muon, Newton–Schulz BF16 + AdamW", "AdamW"]
    assert all(r["fwd_bwd_ms"] > 0 and r["step_ms"] > 0 and r["step_vs_fwd_bwd"] > 0
               for r in res["rows"])
    assert "Part 5" in bench.to_markdown({"meta": {"date": "d", "cpu_count": 2,
                                                   "torch_threads": 2, "torch": "t"},
                                          "optimizer": res}, "geofp8 bench --parts 5")


def test_methods_step_in_turn_the_order_reversed_every_step(monkeypatch):
    from geofp8.tools import ddp_bench

    ran = []

    def step(t, cfg, data, i, rank):
        if t.method == "b" and i == 3:
            raise RuntimeError("RuntimeError: hook failed on every rank")
        ran.append((t.method, i))
        return 0.1

    monkeypatch.setattr(ddp_bench, "_step", step)
    monkeypatch.setattr(ddp_bench.dist, "barrier", lambda: None)
    cfg = ddp_bench.DDPBenchConfig(warmup=2, steps=3)
    trainees = [ddp_bench._Trainee(m, None, None, None, None, None,
                                   ddp_bench.ByteCounter(0, 2)) for m in "abc"]
    ddp_bench._train_interleaved(trainees, cfg, None, 0)
    assert ran == [("a", 0), ("b", 0), ("c", 0), ("c", 1), ("b", 1), ("a", 1),
                   ("a", 2), ("b", 2), ("c", 2), ("c", 3), ("a", 3), ("a", 4), ("c", 4)]
    assert [len(t.times) for t in trainees] == [3, 1, 3]  # timed: steps 2, 3, 4
    assert trainees[1].error == "RuntimeError: hook failed on every rank"
