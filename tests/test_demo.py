"""`geofp8 demo`'s duration estimate (timed here by a short run) and its explanations when a
run is late (the demo itself runs in tests/test_train.py)."""

import os

import pytest

from geofp8.tools import demo
from geofp8.tools.train import TrainConfig, optim


@pytest.fixture
def idle(monkeypatch):
    """A 2-core machine with nothing else running, Muon's dtype chosen automatically."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    monkeypatch.delenv(optim.NS_DTYPE_ENV, raising=False)


def _step(step, seconds, shadow=False, eval_s=None):
    r = {"step": step, "step_time_s": seconds}
    if shadow:
        r["rel_l2"] = 0.1
    if eval_s is not None:
        r["val_loss"], r["eval_s"] = 5.0, eval_s
    return r


def test_cost_comes_from_the_timed_steps():
    records = [_step(0, 3.0, shadow=True), _step(1, 0.2), _step(2, 0.3, shadow=True),
               _step(3, 0.2), _step(4, 0.25), _step(5, 1.2, eval_s=1.0)]
    cost = demo.cost_from_log(records, wall_s=10.0)
    assert cost.step_s == pytest.approx(0.2)  # median of the ordinary steps 1, 3, 4
    assert cost.shadow_s == pytest.approx(0.1)
    assert cost.eval_s == pytest.approx(1.0)
    assert cost.start_s == pytest.approx(10.0 - (0.2 + 0.3 + 0.2 + 0.25 + 1.2))  # step 0 too
    # 100 steps: 10 shadow steps (every 10th), 4 evaluations (every 25th, the last included)
    assert cost.run_s(100, 10, 25) == pytest.approx(cost.start_s + 100 * 0.2 + 10 * 0.1 + 4)
    assert cost.run_s(110, 10, 25) == pytest.approx(cost.start_s + 110 * 0.2 + 11 * 0.1 + 5)


@pytest.mark.distributed
@pytest.mark.slow
def test_probe_times_a_short_run_here(tmp_path):
    base = TrainConfig(model="llama-tiny", seq_len=32, batch_size=2, eval_batches=1,
                       out=str(tmp_path))
    cost = demo.probe(base, "fp8", nproc=2)
    assert cost.step_s > 0 and cost.eval_s > 0 and cost.start_s > cost.step_s
    assert not (tmp_path / "probe").exists()


def test_slowdowns_name_what_they_see(idle, monkeypatch):
    assert demo.slowdowns(2) == []
    assert demo.slowdowns(4) == ["2 CPU core(s) for 4 ranks"]
    monkeypatch.setattr(os, "getloadavg", lambda: (5.0, 5.0, 5.0))
    assert demo.slowdowns(2) == ["other work is running (1-minute load average 5.0 on 2 cores)"]
    assert demo.slowdowns(2, own_load=4.5) == []  # our own ranks are not "other work"
    monkeypatch.setattr(os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    monkeypatch.setenv(optim.NS_DTYPE_ENV, "bfloat16")
    monkeypatch.setattr(optim, "native_bf16", lambda device: (False, "no BF16 here"))
    (why,) = demo.slowdowns(2)
    assert "emulated BF16" in why and "GEOFP8_MUON_NS_DTYPE=bfloat16" in why


def test_a_late_run_is_reported_with_the_remaining_time(idle, monkeypatch, capsys):
    clock = demo._Clock(["fp32", "fp8"], 60.0, 2)
    clock("fp32", 0, 60.0)  # on time: nothing printed
    assert capsys.readouterr().out == ""
    clock = demo._Clock(["fp32", "fp8"], 60.0, 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (6.0, 6.0, 6.0))
    clock("fp32", 0, 120.0)
    out = capsys.readouterr().out
    assert "fp32 took 120 s against 60 s estimated" in out
    assert "other work is running (1-minute load average 6.0" in out
    assert "remaining 1 run(s) will take about 2 min" in out  # 60 s, twice as slow
