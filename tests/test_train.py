"""`geofp8 train`, `compare` and the report, on real 2-process torchrun launches (gloo, CPU).

One `compare` of every method (3 steps of llama-tiny, 32-token sequences) is shared by the
tests that check the per-method logs and the report; resume is checked bitwise on its own.
Every method trains through the trainer on 2 real processes; all but ``LAUNCHED`` do so in one
pair of processes (``train`` in a loop: most of a launch is importing torch and transformers),
and ``compare`` launches ``LAUNCHED`` with torchrun and reuses the rest. The resume tests
train in pre-forked ranks too, the resumed run in fresh processes; `geofp8 train --resume` on
torchrun is tests/test_reliability.py's killed-training test.
"""

import argparse
import json
import math
import os
import shutil
import sys
from dataclasses import replace

import pytest
import torch

from distributed import run_ranks, train_in_process
from geofp8.tools.train import METHODS, TrainConfig, add_arguments, config_from_args, to_argv
from geofp8.tools.train.checkpoint import atomic_save, latest_step, load_rank, step_dir
from geofp8.tools.train.compare import compare, run_dir
from geofp8.tools.train.loop import lr_factor
from geofp8.tools.train.optim import orthogonalization_dtype
from geofp8.tools.train.report import aggregate, read_log, summarize_run

TINY = dict(model="llama-tiny", seq_len=32, batch_size=2, steps=3, warmup=1, eval_every=2,
            eval_batches=2, shadow_every=1, refresh_every=1, profile_steps=1, budget=0.9,
            quiet=True)
RUN_TIMEOUT = 120


LAUNCHED = ("geofp8-auto",)  # compare's own torchrun launch (the others reused)


@pytest.fixture(scope="module")
def all_methods(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    rest = [m for m in METHODS if m not in LAUNCHED]
    configs = [replace(TrainConfig(**TINY), method=m, seed=0, out=str(run_dir(out, m, 0)))
               for m in rest]
    run_ranks(train_in_process, 2, (configs,), timeout=RUN_TIMEOUT * 3)
    launched = []
    results = compare(TrainConfig(**TINY), list(METHODS), [0], nproc=2, out=out, reuse=True,
                      run_timeout=RUN_TIMEOUT, command="test", echo=lambda *a: None,
                      on_run=lambda method, seed, seconds: launched.append(method))
    assert tuple(launched) == LAUNCHED
    return out, results


# -- every method trains on 2 processes ------------------------------------------------------

@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_writes_log_and_validation(all_methods, method):
    out, _ = all_methods
    records = read_log(run_dir(out, method, 0) / "log.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records:
        assert math.isfinite(r["loss"]) and r["loss"] > 0
        assert r["bytes_sent"] > 0 and r["tokens_per_s"] > 0
        assert set(r["fidelity"]) and all(0 <= f["rel_l2"] < 1 for f in r["fidelity"].values())
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(vals) == 2 and all(math.isfinite(v) for v in vals)  # step 2 and the last step
    info = json.loads((run_dir(out, method, 0) / "run.json").read_text())
    assert info["world_size"] == 2 and info["config"]["method"] == method
    # Muon's Newton–Schulz precision is recorded: BF16 only where this CPU has it natively
    dtype, why = orthogonalization_dtype(torch.device("cpu"))
    assert info["optimizers"] == ["Muon", "AdamW"]
    assert (info["muon_ns_dtype"], info["muon_ns_reason"]) == (str(dtype)[6:], why)


@pytest.mark.distributed
@pytest.mark.slow
def test_methods_send_what_they_claim(all_methods):
    out, results = all_methods
    m = results["methods"]
    assert m["fp32"]["bytes_per_element"] == pytest.approx(4.0, rel=1e-6)  # ring, N=2
    assert m["bf16"]["bytes_per_element"] == pytest.approx(2.0, rel=1e-6)
    for name in ("fp8", "fp8-ef", "hadamard"):
        assert 1.0 <= m[name]["bytes_per_element"] < 1.05  # 1 byte + per-tensor scales
    # FP32 communication is exact: the shadow all-reduce reproduces it bit for bit
    assert m["fp32"]["mean_rel_l2"] == 0.0
    assert 0 < m["bf16"]["mean_rel_l2"] < m["fp8"]["mean_rel_l2"] < 0.2
    # the paper's configuration really routes layers through the geometry (profile: top 1/4)
    geo = read_log(run_dir(out, "geofp8", 0) / "log.jsonl")
    assert geo[-1]["geometry_layers"] > 0
    kfac = read_log(run_dir(out, "kfac", 0) / "log.jsonl")
    assert kfac[-1]["geometry_layers"] > 0


@pytest.mark.distributed
@pytest.mark.slow
def test_geometry_starts_where_the_method_says(all_methods):
    """stats()' geometry_since_step, logged, against TrainConfig.geometry_start: the methods
    that put every chosen layer on the map start exactly there; auto and budget methods
    there at the earliest (only where geometry measures better)."""
    out, _ = all_methods
    started = 0
    for method in METHODS:
        step, why = TrainConfig(**{**TINY, "method": method}).geometry_start()
        records = read_log(run_dir(out, method, 0) / "log.jsonl")
        since = [r.get("geometry_since_step") for r in records]
        first_on = next((r["step"] for r in records if r.get("geometry_layers")), None)
        assert since[-1] == first_on, method  # the library's figure and the logged counts
        info = json.loads((run_dir(out, method, 0) / "run.json").read_text())
        assert info["geometry_start"] == {"step": step, "why": why}
        if step is None:
            assert first_on is None, method
        elif "measured better" in why:
            assert first_on is None or first_on >= step, method
        else:
            assert first_on == step, method
            started += 1
    assert started >= 10  # rotations, refreshed, fresh and local factors, profile, K-FAC


def test_geometry_start_follows_the_methods_schedule():
    start = {m: TrainConfig(method=m, budget=0.9 if m.startswith("budget") else None,
                            refresh_every=50, profile_steps=100).geometry_start()[0]
             for m in METHODS}
    assert start["fp8-ef"] is None and start["powersgd"] is None and start["nvfp4-ef"] is None
    assert start["hadamard"] == start["nvfp4-rht-ef"] == 0  # fixed rotations
    assert start["geofp8-fresh-all"] == start["geofp8-local"] == 0  # this step's factor
    assert start["geofp8-all"] == start["kfac"] == 50  # the first refresh
    assert start["geofp8-auto"] == start["budget"] == 51  # measured at it, chosen after
    assert start["geofp8"] == 100  # the profile decides after 100 steps


def test_report_says_from_which_step_geometry_is_on_or_why_not():
    from geofp8.tools.train.report import _geometry_lines

    def run(method, records, plan_step, why="the first factor comes from the first refresh"):
        return {"method": method, "seed": 0, "summary": summarize_run(records),
                "info": {"geometry_start": {"step": plan_step, "why": why},
                         "config": {"refresh_every": 5}}}

    def rec(step, layers, since=None, sent=100, factor=0):
        r = _record(step, 5.0, sent)
        r.update(geometry_layers=layers, factor_bytes_sent=factor)
        return r if since is None else {**r, "geometry_since_step": since}

    on = run("geofp8-all", [rec(0, 0), rec(1, 3, 1, 400, 300), rec(2, 4, 1), rec(3, 4, 1)], 1)
    short = run("geofp8-auto", [rec(0, 0), rec(1, 0)], 51)
    never = run("geofp8-auto", [rec(s, 0) for s in range(60)], 51, "... measured better")
    plain = run("fp8-ef", [_record(0, 5.0, 100)], None)
    lines = _geometry_lines([on, short, never, plain])
    assert lines[0].startswith("* geofp8-all (seed 0): geometry on from step 1, on up to 4 "
                               "layer(s) (4 at the end). Step 1 sent 400 B, 4.0× a typical "
                               "step (300 B factor traffic); once every 5 steps, that is "
                               "+60% bytes a step on average.")
    assert lines[1].startswith("* geofp8-auto (seed 0): no geometry in these 2 steps: it can "
                               "start at step 51 at the earliest (the first factor comes")
    assert "no geometry in 60 steps (possible from step 51): on no layer" in lines[2]
    assert len([x for x in lines if x.startswith("*")]) == 3  # fp8-ef: nothing to say
    assert lines[-1].startswith("A step above 1.5× a typical one is a factor refresh")


# -- the report comes from the logs ----------------------------------------------------------

@pytest.mark.distributed
@pytest.mark.slow
def test_report_numbers_come_from_the_logs(all_methods):
    out, results = all_methods
    saved = json.loads((out / "results.json").read_text())
    report = (out / "report.md").read_text()
    assert (out / "loss.png").stat().st_size > 10_000
    assert (out / "fidelity.png").stat().st_size > 10_000
    fp32_val = None
    for run in saved["runs"]:
        records = read_log(run_dir(out, run["method"], run["seed"]) / "log.jsonl")
        final_val = [r["val_loss"] for r in records if "val_loss" in r][-1]
        assert run["final_val_loss"] == final_val
        assert run["bytes_per_step"] == pytest.approx(
            sum(r["bytes_sent"] for r in records) / len(records))
        rel = [r["rel_l2"] for r in records]
        assert run["mean_rel_l2"] == pytest.approx(sum(rel) / len(rel))
        assert run["wall_s"] == records[-1]["elapsed_s"]
        if run["method"] == "fp32":
            fp32_val = final_val
        method = saved["methods"][run["method"]]
        assert method["final_val_loss"] == pytest.approx(final_val)
        assert method["val_gap_to_fp32"] == pytest.approx(final_val - fp32_val)
        assert f"| {run['method']} | {final_val:.4f}" in report


@pytest.mark.distributed
@pytest.mark.slow
def test_compare_without_matplotlib_says_so_first_and_writes_the_report(all_methods, tmp_path,
                                                                         monkeypatch):
    out, _ = all_methods
    for method in ("fp32", "fp8-ef"):  # finished runs: --reuse trains nothing
        shutil.copytree(run_dir(out, method, 0), run_dir(tmp_path, method, 0))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    said = []
    results = compare(TrainConfig(**TINY), ["fp32", "fp8-ef"], [0], nproc=2, out=tmp_path,
                      reuse=True, echo=said.append)
    assert said[0].startswith("matplotlib is not installed: the report will have no plots "
                              "(pip install matplotlib (the [report] extra")
    report = (tmp_path / "report.md").read_text()
    assert "| fp8-ef |" in report and "No plots: matplotlib was not installed" in report
    assert "![loss]" not in report and not list(tmp_path.glob("*.png"))
    assert set(results["methods"]) == {"fp32", "fp8-ef"}


def test_compare_names_a_missing_package_before_any_run(tmp_path, monkeypatch):
    from geofp8.tools.errors import UsageError
    from geofp8.tools.train import compare as compare_module

    def launch(*args, **kwargs):
        raise AssertionError("a run started")

    monkeypatch.setattr(compare_module, "launch", launch)
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(UsageError, match="needs tokenizers, not installed here: pip install "
                       r"tokenizers \(the \[hf\] extra of geofp8\)"):
        compare(TrainConfig(**TINY), ["fp32"], [0], nproc=2, out=tmp_path)


def _record(step, loss, sent, val=None, rel=None):
    r = {"step": step, "loss": loss, "bytes_sent": sent, "bytes_fp32_equivalent": 4 * sent,
         "bytes_per_element": 1.0, "tokens_per_s": 10.0, "elapsed_s": float(step + 1)}
    if val is not None:
        r["val_loss"] = val
    if rel is not None:
        r["rel_l2"], r["cos"] = rel, 1 - rel
    return r


def test_summary_and_seed_aggregation():
    logs = {("fp32", 0): [_record(0, 5.0, 100, rel=0.0), _record(1, 4.0, 100, val=4.5)],
            ("fp32", 1): [_record(0, 5.0, 100, rel=0.0), _record(1, 4.0, 100, val=4.7)],
            ("fp8", 0): [_record(0, 5.0, 30, rel=0.1), _record(1, 4.1, 20, val=4.6, rel=0.3)],
            ("fp8", 1): [_record(0, 5.0, 30, rel=0.1), _record(1, 4.1, 20, val=5.0)]}
    runs = [{"method": m, "seed": s, "summary": summarize_run(r)} for (m, s), r in logs.items()]
    assert runs[2]["summary"]["bytes_per_step"] == 25
    assert runs[2]["summary"]["mean_rel_l2"] == pytest.approx(0.2)
    agg = aggregate(runs)
    assert agg["fp32"]["final_val_loss"] == pytest.approx(4.6)
    assert agg["fp32"]["final_val_loss_std"] == pytest.approx(math.sqrt(0.02))
    assert agg["fp8"]["val_gap_to_fp32"] == pytest.approx(0.2)  # (0.1 + 0.3) / 2, same seed
    assert agg["fp8"]["val_gap_to_fp32_std"] == pytest.approx(math.sqrt(0.02))


# -- resume is bitwise -----------------------------------------------------------------------

@pytest.mark.distributed
@pytest.mark.slow
def test_resume_continues_the_same_trajectory_bitwise(tmp_path):
    # geofp8-auto with a refresh every 2 steps: residuals, factors, statistics windows and the
    # selection all live in the checkpoint; Muon + AdamW; cosine schedule
    base = TrainConfig(**{**TINY, "steps": 6, "eval_every": 3, "shadow_every": 0,
                          "refresh_every": 2, "checkpoint_every": 3},
                       method="geofp8-auto")
    whole = replace(base, out=str(tmp_path / "whole"))
    part = replace(base, out=str(tmp_path / "part"), stop_after=3)
    run_ranks(train_in_process, 2, ([whole, part],), timeout=RUN_TIMEOUT * 2)
    assert latest_step(part.out) == 3
    assert len(read_log(tmp_path / "part" / "log.jsonl")) == 3
    resumed = replace(base, out=str(tmp_path / "part"), resume=True)
    run_ranks(train_in_process, 2, ([resumed],), timeout=RUN_TIMEOUT)  # fresh processes

    a = read_log(tmp_path / "whole" / "log.jsonl")
    b = read_log(tmp_path / "part" / "log.jsonl")
    assert [r["step"] for r in b] == list(range(6))
    keys = ("loss", "grad_norm", "lr", "bytes_sent", "val_loss", "geometry_layers",
            "geometry_since_step")
    assert [{k: r.get(k) for k in keys} for r in a] == [{k: r.get(k) for k in keys} for r in b]
    assert b[-1]["elapsed_s"] > b[2]["elapsed_s"]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["fsdp", "hsdp"])
def test_resume_fsdp_hsdp_continues_the_same_trajectory_bitwise(tmp_path, parallel):
    # GeoFP8's FP8 reduce-scatter (hsdp on 2 ranks: 2 replicas of 1 shard, the replica hop
    # too), a refresh every 2 steps; AdamW's sharded state goes through a full state dict
    base = TrainConfig(**{**TINY, "steps": 4, "eval_every": 0, "shadow_every": 0,
                          "refresh_every": 2, "checkpoint_every": 2},
                       method="geofp8", optimizer="adamw", parallel=parallel)
    whole = replace(base, out=str(tmp_path / "whole"))
    part = replace(base, out=str(tmp_path / "part"), stop_after=2)
    run_ranks(train_in_process, 2, ([whole, part],), timeout=RUN_TIMEOUT * 2)
    assert latest_step(part.out) == 2
    # sharded through DCP: no rank holds the whole model; each rank's GeoFP8 state its own
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(step_dir(part.out, 2) / "sharded")).read_metadata()
    assert {k.split("/")[0] for k in saved.state_dict_metadata if k.startswith("geofp8.")} \
        == {"geofp8.rank0", "geofp8.rank1"}
    resumed = replace(base, out=str(tmp_path / "part"), resume=True)
    run_ranks(train_in_process, 2, ([resumed],), timeout=RUN_TIMEOUT)  # fresh processes

    a = read_log(tmp_path / "whole" / "log.jsonl")
    b = read_log(tmp_path / "part" / "log.jsonl")
    assert [r["step"] for r in b] == list(range(4))
    keys = ("loss", "grad_norm", "lr", "bytes_sent", "geometry_layers")
    assert [{k: r.get(k) for k in keys} for r in a] == [{k: r.get(k) for k in keys} for r in b]
    assert b[-1]["geometry_layers"] > 0


@pytest.mark.distributed
@pytest.mark.slow
def test_resume_from_a_checkpoint_without_geofp8_state_warns(tmp_path):
    # an fp32 run's checkpoint (no hook state) resumed by a GeoFP8 method: a warning, no crash
    base = TrainConfig(**{**TINY, "steps": 2, "eval_every": 0, "shadow_every": 0,
                          "checkpoint_every": 1, "out": str(tmp_path)}, method="fp32")
    first = run_ranks(train_in_process, 2, ([replace(base, stop_after=1)],),
                      timeout=RUN_TIMEOUT)
    assert not any("holds no GeoFP8 state" in w for w in first[0])
    warned = run_ranks(train_in_process, 2, ([replace(base, method="geofp8", resume=True)],),
                       timeout=RUN_TIMEOUT)
    assert all(any("holds no GeoFP8 state" in w for w in rank) for rank in warned), warned
    assert [r["step"] for r in read_log(tmp_path / "log.jsonl")] == [0, 1]


# -- pieces ----------------------------------------------------------------------------------

def test_argv_round_trip(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("a.txt", "b.txt"):  # --data must name files
        (tmp_path / name).write_text("text")
    cfg = TrainConfig(model="llama-small", data=["a.txt", "b.txt"], steps=7, lr=3e-4,
                      method="geofp8", resume=True, stop_after=3, shadow_every=5)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args(to_argv(cfg))) == cfg
    assert to_argv(TrainConfig()) == []


def test_unknown_method_is_rejected():
    with pytest.raises(ValueError, match="method"):
        TrainConfig(method="fp4")


def test_lr_schedule_warmup_then_cosine_to_lr_min():
    cfg = TrainConfig(steps=100, warmup=10, lr=5e-4, lr_min=5e-5)
    f = [lr_factor(s, cfg) for s in range(101)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[10:], f[11:]))
    assert f[100] == pytest.approx(0.1)  # lr_min / lr


def test_resume_on_another_number_of_ranks_is_refused(tmp_path):
    for rank in range(2):
        atomic_save({"step": 3}, step_dir(tmp_path, 3) / f"rank{rank}.pt")
    assert load_rank(tmp_path, 1, 3, world=2) == {"step": 3}
    for world in (1, 4):
        with pytest.raises(ValueError, match=f"written on 2 ranks, this run has {world}"):
            load_rank(tmp_path, 0, 3, world=world)


def test_atomic_save_leaves_only_the_file(tmp_path):
    atomic_save({"step": 1}, tmp_path / "x.pt")
    atomic_save({"step": 2}, tmp_path / "x.pt")
    assert os.listdir(tmp_path) == ["x.pt"]
    assert latest_step(tmp_path) is None


@pytest.mark.distributed
@pytest.mark.slow
def test_demo_runs_compare_and_prints_the_table(tmp_path, capsys):
    from geofp8.tools import cli

    out = tmp_path / "demo"
    assert cli.main(["demo", "--steps", "2", "--methods", "fp32,geofp8-auto", "--out",
                     str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| fp32 |" in printed and "| geofp8-auto |" in printed
    assert str(out / "report.md") in printed
    assert "Timed" not in printed  # runs no longer than the timing run: no timing run
    saved = json.loads((out / "results.json").read_text())
    assert [r["method"] for r in saved["runs"]] == ["fp32", "geofp8-auto"]
    # a short run says why it shows no geometry (the demo profiles and refreshes every 50)
    assert ("* geofp8-auto (seed 0): no geometry in these 2 steps: it can start at step 51 at "
            "the earliest (the first factor comes from the first refresh, after "
            "--refresh-every 50 steps;") in (out / "report.md").read_text()


class _CollectiveForward(torch.nn.Module):
    """A model whose forward is a collective, as FSDP's is (it all-gathers parameters)."""

    def forward(self, input_ids):
        import torch.distributed as dist

        dist.all_reduce(torch.ones(1))
        return argparse.Namespace(logits=torch.zeros(*input_ids.shape, 8))


def _uneven_evaluation(rank, world_size):
    from geofp8.tools.train.loop import evaluate

    cfg = TrainConfig(batch_size=2, eval_batches=4)
    blocks = torch.randint(0, 8, (5, 9))  # 5 blocks over 2 ranks: 3 and 2, i.e. 2 and 1 batches
    return evaluate(_CollectiveForward(), blocks, cfg, rank, world_size, torch.device("cpu"))


def test_evaluation_runs_the_same_forwards_on_every_rank():
    from distributed import run_ranks

    losses = run_ranks(_uneven_evaluation, world_size=2, timeout=60)
    assert losses[0] == losses[1] == pytest.approx(math.log(8))  # uniform logits, 5 blocks
