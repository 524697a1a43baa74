"""``make gpu-check`` and the GPU round (``benchmarks/gpu_round.sh``) on the CPU: what they
print, how they judge, and what they would install, without a GPU (stand-ins for the CUDA
timers; the kernels' bits are checked under the interpreter in test_triton_fp8/fp4)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from geofp8.codecs import triton_fp8
from geofp8.tools import gpu_check
from interpreted import Child

ROOT = Path(__file__).resolve().parents[1]
needs_triton = pytest.mark.skipif(triton_fp8.triton is None, reason="triton does not import")


def test_the_install_hint_names_the_gpu_extra_of_this_checkout(monkeypatch):
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert any(dep.startswith("triton") for dep in extras["gpu"])
    assert "pip install -e '.[gpu]'" in gpu_check.NO_TRITON
    monkeypatch.setattr(gpu_check, "DEVICE", torch.device("cpu"))
    monkeypatch.setattr(triton_fp8, "_INTERPRET", False)  # the CPU: no kernels here
    rows = []
    gpu_check.check_fused(rows)
    gpu_check.check_fused_blocks(rows)
    if triton_fp8.triton is not None:  # it imports: the device is why
        assert rows == [
            ("fused kernels", "triton_fp8 does not run on cpu (CUDA, or the CPU under "
             "TRITON_INTERPRET=1)", "FAIL"),
            ("fused block kernels", "triton_fp4 does not run on cpu (CUDA, or the CPU under "
             "TRITON_INTERPRET=1)", "FAIL")]
    monkeypatch.setattr(triton_fp8, "triton", None)
    rows = []
    gpu_check.check_fused(rows)
    gpu_check.check_fused_blocks(rows)
    assert rows == [("fused kernels", gpu_check.NO_TRITON, "FAIL"),
                    ("fused block kernels", gpu_check.NO_TRITON, "FAIL")]


def test_every_method_builds_from_the_settings_its_gpu_rows_give_it():
    from geofp8.methods import METHODS

    for name, spec in METHODS.items():  # the budget's methods need a budget
        given = spec.takes(**gpu_check.SETTINGS)
        spec.config(**given)  # raises on a setting missing or refused
        assert ("budget" in given) == ("budget" in spec.required), name


@needs_triton
def test_the_kernel_census_sees_every_fused_kernel_and_nests(monkeypatch):
    kernels = gpu_check.triton_kernels()
    assert {"triton_fp8._encode_placed_kernel", "triton_fp8._decode_placed_kernel",
            "triton_fp4._encode_kernel", "triton_fp4._decode_kernel"} <= set(kernels)
    fn = kernels["triton_fp8._reduce_kernel"]
    calls = []
    monkeypatch.setattr(fn, "run", lambda *args, **kwargs: calls.append(args), raising=False)
    stand_in = fn.run
    with gpu_check.kernel_census() as outer:
        with gpu_check.kernel_census() as inner:
            fn.run(1)
        fn.run(2)
    assert fn.run is stand_in and calls == [(1,), (2,)]
    assert inner == outer == {"triton_fp8._reduce_kernel"}
    with gpu_check.kernel_census():
        pass
    assert "run" not in vars(kernels["triton_fp8._amax_kernel"])  # the class's own again


def test_the_timed_rows_judge_against_the_goals(monkeypatch):
    monkeypatch.setattr(gpu_check, "DEVICE", torch.device("cpu"))
    monkeypatch.setattr(gpu_check, "BUCKET_NUMEL", 3 * 4096)
    monkeypatch.setattr(gpu_check, "cuda_seconds", lambda fn, repeats=20: (fn(), 120e-6)[1])
    rows = []
    gpu_check.check_bucket_stages(rows)
    assert [(name, verdict) for name, _, verdict in rows] == [
        ("stages e4m3 0 MiB N=2", "SLOW"), ("stages e4m3 0 MiB N=8", "SLOW"),
        ("stages nvfp4 0 MiB N=2", "ok"), ("stages nvfp4 0 MiB N=8", "ok")]
    assert all("120 µs" in detail for _, detail, _ in rows), rows
    x = torch.empty(10**6)
    for per_element, verdict in ((16, "ok"), (4, "SLOW")):  # the stages take 2x a copy
        times = [1e-3, 0.5e-3]  # the stages', then the copy's
        monkeypatch.setattr(gpu_check, "cuda_seconds", lambda fn, repeats=20, t=times: t.pop(0))
        gpu_check._bandwidth_row(rows, "q+d", lambda: None, x, per_element)
        assert rows[-1][2] == verdict and f"{per_element} GB/s, " in rows[-1][1], rows[-1]
        assert f"{per_element / 16:.0%} of a D2D copy's 16 GB/s" in rows[-1][1], rows[-1]


def test_main_prints_each_row_as_made_and_fails_on_failures_only(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a stand-in")

    def broken(rows):
        raise RuntimeError("set-up failed")
    monkeypatch.setitem(gpu_check.SECTIONS, "good", lambda rows: rows.append(("a", "x", "ok")))
    monkeypatch.setitem(gpu_check.SECTIONS, "slow", lambda rows: rows.append(("b", "y", "SLOW")))
    monkeypatch.setitem(gpu_check.SECTIONS, "broken", broken)
    assert gpu_check.main(["--sections", "good", "slow"]) == 0
    out = capsys.readouterr().out
    assert "[good] a  ok  x" in out and "[slow] b  SLOW  y" in out
    assert out.rstrip().endswith("1 passed, 0 failed, 1 over their goal")
    assert gpu_check.main(["--sections", "broken", "good"]) == 1
    out = capsys.readouterr().out
    assert "[broken] broken  FAIL  RuntimeError: set-up failed" in out
    assert out.index("[broken]") < out.index("[good]")  # in the order asked
    assert out.rstrip().endswith("1 passed, 1 failed, 0 over their goal")


def _trace(path: Path, kernels) -> str:
    events = [{"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": s}}
              for name, s, ts, dur in kernels]
    path.write_text(json.dumps({"traceEvents": events}))
    return str(path)


@needs_triton
def test_the_overlap_verdict_needs_codec_kernels_on_a_side_stream_under_a_gemm(
        tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from overlap_trace import report

    gemms = [("sm90_xmma_gemm_f32f32", 7, 0, 100), ("sm90_xmma_gemm_f32f32", 7, 200, 100)]
    assert report(_trace(tmp_path / "a.json", gemms + [("_encode_placed_kernel", 13, 50, 30),
                                                       ("_amax_kernel", 13, 120, 30)]))
    assert "VERDICT: overlap yes: 2 codec kernels on side streams (0 on backward's), 30.0 µs" \
        in capsys.readouterr().out
    assert not report(_trace(tmp_path / "b.json", gemms + [("_amax_kernel", 13, 120, 30)]))
    assert not report(_trace(tmp_path / "c.json", gemms + [("_amax_kernel", 7, 120, 30)]))
    assert not report(_trace(tmp_path / "d.json", [("_amax_kernel", 13, 120, 30)]))
    out = capsys.readouterr().out
    assert "(1 on backward's)" in out and "no GEMM kernel in the trace" in out


STUB = r"""#!/usr/bin/env bash
# a stand-in python3: what each of the round's steps prints on a GPU
case "$*" in
  -c*) echo "torch 2.11.0+cu130 cuda 13.0 NVIDIA H100"; echo "triton 3.6.0" ;;
  "-m geofp8.tools.gpu_check")
    echo "[fused] fused e4m3/row decode  ok  fine"
    echo "[fused-stages] fused stages e5m2/tensor N=4  FAIL  EF encode: [False]"
    echo "[bucket] stages nvfp4 25 MiB N=8  SLOW  170 µs (goal <= 150)"
    echo "1 passed, 1 failed, 1 over their goal"; exit 1 ;;
  *cuda_bucket.py*) echo "| path | method |"; echo "| fused | fp8-ef | 25 | 88 |" ;;
  *overlap_trace.py*) echo '{}' > "${@: -1}"; echo "VERDICT: overlap yes: 12 codec kernels" ;;
esac
"""


def test_the_gpu_round_runs_each_step_and_summarizes_it(tmp_path):
    stub = tmp_path / "python3"
    stub.write_text(STUB)
    stub.chmod(0o755)
    out = tmp_path / "out"  # given relative to where the round is started
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_round.sh"), "out"],
                          env={**os.environ, "PYTHON": str(stub)}, capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    summary = (out / "summary.txt").read_text()
    assert sorted(p.name for p in out.iterdir()) == [
        "cuda_bucket.txt", "env.txt", "gpu_check.txt", "overlap.txt", "overlap_trace.json.gz",
        "summary.txt"]
    assert "torch 2.11.0+cu130" in summary
    assert "gpu_check rows: 1 ok, 1 FAIL, 1 SLOW" in summary
    assert "fused stages e5m2/tensor N=4  FAIL" in summary and "N=8  SLOW" in summary
    assert "gpu_check    rc=1" in summary and "cuda_bucket  rc=0" in summary
    assert "| fused | fp8-ef | 25 | 88 |" in summary
    assert "VERDICT: overlap yes" in summary
    assert summary == done.stdout[done.stdout.index("GPU round summary"):]


def test_the_bucket_timer_runs_the_stages_on_the_cpu():
    done = subprocess.run(
        [sys.executable, "cuda_bucket.py", "--device", "cpu", "--sizes", "0.01", "--ranks",
         "2", "--repeats", "1", "--methods", "fp8-ef"], cwd=ROOT / "benchmarks",
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines()
            if line.startswith("| fused") or line.startswith("| torch")]
    assert [(r[0].strip(), r[1].strip(), r[4].strip()) for r in rows] == [
        (p, "fp8-ef", "2") for p in ("fused", "torch")]
    triton_ran = os.environ.get("TRITON_INTERPRET") == "1" and triton_fp8.triton is not None
    assert int(rows[0][5]) > 0 if triton_ran else int(rows[0][5]) == 0
    assert int(rows[1][5]) == 0  # the torch path launches no Triton kernel


def test_the_stage_rows_take_up_a_sender_encode_with_the_buckets_residual(monkeypatch):
    from geofp8.codecs import make_codec
    from geofp8.comm import stages

    plain = stages.encode_with_error

    def with_feedback(flat, layout, *args, feedback=None, ignore_keep=False, **kwargs):
        """The sender stage of the EF contract: ``G + where(keep, R, 0)`` encoded, its new
        residual written into ``R``."""
        r, keep = feedback
        flat.add_(r.float() if ignore_keep else torch.where(keep, r.float(), 0.0))
        sent, error = plain(flat, layout, *args, **kwargs)
        r.copy_(error)
        return sent, error

    monkeypatch.setattr(gpu_check, "DEVICE", torch.device("cpu"))
    monkeypatch.setattr(gpu_check, "SHAPES", [(5, 40), (21,)])
    monkeypatch.setattr(stages, "encode_with_error", with_feedback)
    detail, ok = gpu_check._collective_matches(make_codec("e4m3", "row", 32))
    assert ok and detail.startswith("EF encode (R kept, dropped)"), detail

    def batched_ignores_keep(flat, layout, *args, feedback=None, **kwargs):
        return with_feedback(flat, layout, *args, feedback=feedback,
                             ignore_keep=layout.kernels == "batched", **kwargs)
    monkeypatch.setattr(stages, "encode_with_error", batched_ignores_keep)
    detail, ok = gpu_check._collective_matches(make_codec("e4m3", "row", 32))
    assert not ok and "[True, False, True, True]" in detail, detail


_FUSED_SECTIONS = """
import torch
from geofp8.tools import gpu_check as g
g.SHAPES, g.DEVICE = [(3, 40), (21,)], torch.device("cpu")  # small; the interpreter's CPU
rows = []
g.run_sections(g.FUSED, rows)
"""
FUSED_CHILD = Child(["-c", _FUSED_SECTIONS], cwd=ROOT, path=(ROOT / "src",))


@needs_triton
@pytest.mark.child(FUSED_CHILD)
def test_the_fused_sections_pass_and_launch_every_kernel_under_the_interpreter():
    """What ``make gpu-check`` runs first on a GPU, here under ``TRITON_INTERPRET=1`` on
    small shapes: every row passes, and the census row finds no kernel that no row launched
    (a kernel added without a gpu_check row would fail the GPU round)."""
    out = FUSED_CHILD.lines()
    lines = [line for line in out if line.startswith("[")]
    assert len(lines) > 25, "\n".join(out)
    assert not [line for line in lines if "  FAIL  " in line], "\n".join(out)
    census = [line for line in lines if "every Triton kernel launched" in line]
    assert census and "  ok  " in census[0], "\n".join(out)
