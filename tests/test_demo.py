"""`geofp8 demo`'s duration estimate and its explanations when a run is late (no runs here;
the demo itself runs in tests/test_train.py)."""

import os

import pytest

from geofp8.tools import demo
from geofp8.tools.train import optim


@pytest.fixture
def idle(monkeypatch):
    """A 2-core machine with nothing else running, Muon's dtype chosen automatically."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    monkeypatch.delenv(optim.NS_DTYPE_ENV, raising=False)


def test_estimate_is_the_sum_of_the_measured_runs():
    steps = demo.SETTINGS["steps"]
    total = sum(demo.run_estimate_s(m, steps) for m in demo.METHODS)
    start, per_step = demo.RUN_COST_S["fp32"]
    assert demo.run_estimate_s("fp32", 100) == pytest.approx(demo.WAIT * (start + 100 * per_step))
    assert demo.run_estimate_s("kfac", 10) == max(demo.run_estimate_s(m, 10) for m in demo.METHODS)
    assert 3 * 60 < total < 10 * 60  # the README's "about 7 minutes"


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
    clock = demo._Clock(["fp32", "fp8"], 500, 2)
    clock("fp32", 0, demo.run_estimate_s("fp32", 500))  # on time: nothing printed
    assert capsys.readouterr().out == ""
    clock = demo._Clock(["fp32", "fp8"], 500, 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (6.0, 6.0, 6.0))
    late = 2 * demo.run_estimate_s("fp32", 500)
    clock("fp32", 0, late)
    out = capsys.readouterr().out
    assert f"fp32 took {late:.0f} s against {late / 2:.0f} s estimated" in out
    assert "other work is running (1-minute load average 6.0" in out
    rest = 2 * demo.run_estimate_s("fp8", 500)
    assert f"remaining 1 run(s) will take about {rest / 60:.0f} min" in out
