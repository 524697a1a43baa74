"""`geofp8 cluster`: namespaces, shaped links and training through them.

Needs root and iproute2 (``ip``, ``tc``); those tests are skipped with the reason otherwise.
Every namespace, process and transfer is bounded in time; every test checks that nothing
of its run is left on the host.
"""

import ipaddress
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from distributed import run_ranks, train_in_process
from geofp8.tools import cluster, netem
from geofp8.tools.cli import main
from geofp8.tools.train import TrainConfig
from geofp8.tools.train.loop import _model_and_data
from geofp8.tools.train.report import read_log


def _why_not() -> str | None:
    try:
        netem.require_tools()
    except netem.ClusterUnavailable as e:
        return str(e)
    return None


needs_root = pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")
BENCHMARK_RANGE = ipaddress.ip_network("198.18.0.0/15")


def _host_state() -> tuple[str, str]:
    """The host namespace's links and qdiscs (what the emulation must never touch)."""
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True, timeout=10)
    qdiscs = subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True,
                            timeout=10)
    return links.stdout, qdiscs.stdout


def _ip(*argv: str) -> str:
    return subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=10,
                          check=True).stdout


# -- without the means: a clear message at once ---------------------------------------------

def test_missing_root_and_tools_are_named(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(netem.shutil, "which", lambda tool: None)
    with pytest.raises(netem.ClusterUnavailable) as e:
        netem.require_tools()
    assert "root" in str(e.value) and "'ip'" in str(e.value) and "'tc'" in str(e.value)
    with pytest.raises(netem.ClusterUnavailable):
        netem.Cluster(2, 1e9)
    t0 = time.perf_counter()
    assert main(["cluster", "--rates", "1", "--methods", "fp32", "--out", "unused"]) == 2
    assert time.perf_counter() - t0 < 5  # stops before any run
    assert "needs root privileges" in capsys.readouterr().err


def test_bad_input_is_refused(capsys):
    with pytest.raises(ValueError, match="rate"):
        netem.parse_rate("fast")
    assert netem.parse_rate("10") == netem.parse_rate("10gbit") == 1e10
    assert netem.parse_rate("500m") == 5e8
    for argv, message in [(["--nproc", "9"], "--nproc must be in 2..8"),
                          (["--methods", "fp64"], "unknown 'fp64'")]:  # more: test_cli.py
        with pytest.raises(SystemExit) as e:
            main(["cluster", *argv, "--out", "unused"])
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_time_to_loss_and_break_even():
    curve = [(10.0, 5.0), (20.0, 4.0), (30.0, 3.0)]
    assert cluster.time_to_loss(curve, 3.5) == pytest.approx(25.0)
    assert cluster.time_to_loss(curve, 5.5) == 10.0
    assert cluster.time_to_loss(curve, 2.0) is None
    # saves 1 MB per step for 10 ms of work: even at 8e6 bit / 0.01 s = 0.8 Gbit/s
    geo, ref = {"step_s": 0.11, "bytes_per_step": 1e6}, {"step_s": 0.10, "bytes_per_step": 2e6}
    assert cluster.break_even(geo, ref) == pytest.approx(8e8)
    assert cluster.break_even(ref, geo) is None  # sends more bytes: never pays
    # the model's ring: 2(N−1)/N of the vector per rank, so the bytes per rank over the rate
    assert cluster.link_time(1.25e8, 4, 1e9) == pytest.approx(1.0)


# -- namespaces -----------------------------------------------------------------------------

@needs_root
def test_namespaces_are_set_up_shaped_and_removed():
    before = _host_state()
    with netem.Cluster(3, 1e9) as c:
        assert set(c.namespaces + [c.bridge_ns]) <= set(netem.leftovers(c.prefix))
        for i, ns in enumerate(c.namespaces):
            addrs = json.loads(_ip("-j", "-n", ns, "addr", "show"))
            inet = [a["local"] for link in addrs for a in link["addr_info"]
                    if a["family"] == "inet" and link["ifname"] != "lo"]
            assert inet == [c.address(i)]
            assert ipaddress.ip_address(inet[0]) in BENCHMARK_RANGE
            assert {link["ifname"] for link in addrs} == {"lo", netem.IFACE}
            routes = json.loads(_ip("-j", "-n", ns, "route", "show"))
            assert [r["dst"] for r in routes] == ["198.18.0.0/24"]  # no way out
            for where, dev in ((ns, netem.IFACE), (c.bridge_ns, f"p{i}")):
                q = subprocess.run(["tc", "-n", where, "qdisc", "show", "dev", dev],
                                   capture_output=True, text=True, timeout=10).stdout
                assert "tbf" in q and "rate 1Gbit" in q
        assert _host_state() == before  # the host's interfaces and qdiscs are untouched
    assert netem.leftovers(c.prefix) == []
    assert _host_state() == before


@needs_root
def test_teardown_after_a_failing_run_and_an_exception():
    with netem.Cluster(2, 1e9) as c:
        sleeper = c.popen(0, [sys.executable, "-c", "import time; time.sleep(60)"])
        failing = c.popen(1, [sys.executable, "-c", "import sys; sys.exit(3)"])
        t0 = time.perf_counter()
        assert netem.wait_all([sleeper, failing], timeout=30)[1] == 3
        assert time.perf_counter() - t0 < 15 and sleeper.poll() is not None  # stopped
    assert netem.leftovers(c.prefix) == []
    with pytest.raises(RuntimeError, match="boom"):
        with netem.Cluster(2, None) as c:
            orphan = c.popen(1, [sys.executable, "-c", "import time; time.sleep(60)"])
            raise RuntimeError("boom")
    assert orphan.poll() is not None and netem.leftovers(c.prefix) == []


@needs_root
def test_interrupted_command_leaves_nothing(tmp_path):
    p = subprocess.Popen([sys.executable, "-m", "geofp8.tools.cli", "cluster", "--nproc", "2",
                          "--rates", "1", "--methods", "fp32", "--model", "llama-tiny",
                          "--steps", "1000", "--seq-len", "32", "--batch-size", "2",
                          "--out", str(tmp_path)], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    mine = f"{netem.PREFIX}{p.pid:x}-"
    deadline = time.monotonic() + 60
    while not (tmp_path / "runs" / "1gbit" / "fp32" / "log.jsonl").exists():  # training
        assert p.poll() is None and time.monotonic() < deadline, p.stdout.read()
        time.sleep(0.2)
    assert len(netem.leftovers(mine)) == 3
    p.send_signal(signal.SIGTERM)
    assert p.wait(30) != 0
    assert netem.leftovers(mine) == []
    ranks = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True)
    assert ranks.stdout == ""  # no trainer survives


def _link_capacity(c: netem.Cluster, src: int, dst: int, nbytes: int, rate: float,
                   transfers: int = 5) -> float:
    """The best goodput of a few transfers (bit/s), checked against the shaper's ceiling.

    The token bucket bounds every transfer from above: ``rate`` plus its burst spread over
    the transfer. Whatever delays the kernel's servicing of the bucket (other work on the
    host or under the hypervisor) only lowers a transfer's figure, by the tokens it loses
    (figures at :meth:`netem.Shaping.for_rate`), so the link's capacity is the best of
    several transfers, as iperf users read it."""
    goodputs = [netem.measure_throughput(c, src=src, dst=dst, nbytes=nbytes, timeout=20)
                for _ in range(transfers)]
    # over T s a bucket passes at most rate·T + 8·burst bits: goodput·(1 − burst/nbytes) ≤ rate
    assert max(goodputs) * (1 - c.shaping.burst / nbytes) <= rate * 1.01, goodputs
    return max(goodputs)


@needs_root
def test_rate_limit_is_real():
    with netem.Cluster(2, 1e9) as c:
        capacity = _link_capacity(c, src=1, dst=0, nbytes=32 << 20, rate=1e9)
    assert netem.leftovers(c.prefix) == []
    assert capacity == pytest.approx(1e9, rel=0.15)


@needs_root
def test_two_level_cluster_shapes_only_the_link_between_nodes():
    before = _host_state()
    rate = 2e8
    with netem.Cluster(4, rate, ranks_per_node=2) as c:
        assert (c.nodes, len(c.namespaces)) == (2, 2)
        assert c.address(0) == c.address(1) != c.address(2) == c.address(3)
        inside = netem.measure_throughput(c, src=1, dst=0, nbytes=16 << 20, timeout=20)
        between = _link_capacity(c, src=2, dst=0, nbytes=16 << 20, rate=rate)
        assert _host_state() == before
    assert netem.leftovers(c.prefix) == [] and _host_state() == before
    assert between == pytest.approx(rate, rel=0.15)
    assert inside > 5 * rate  # the node's own loopback, unshaped
    with pytest.raises(ValueError, match="at least 2 nodes"):
        netem.Cluster(4, rate, ranks_per_node=4)


def test_link_time_counts_what_crosses_a_node_link():
    one = cluster.link_time(1e6, 4, 1e9)
    assert one == pytest.approx(8e6 / 1e9)  # a rank's own bytes over its own link
    # 2 nodes of 2: each rank sends 2/3 of its bytes to the other node, two ranks per link
    assert cluster.link_time(1e6, 4, 1e9, ranks_per_node=2) == pytest.approx(one * 4 / 3)
    # hierarchical: each rank's measured hop between nodes, two ranks per link
    assert cluster.link_time(1e6, 4, 1e9, 2, inter_node_bytes=3e5) == pytest.approx(one * 0.6)


# -- training through the emulated link -----------------------------------------------------

def _train_on_loopback(base: TrainConfig, methods: list[str], nproc: int, out) -> None:
    """The loopback runs ``run_comparison(base, methods, ["loopback", …], nproc, out,
    reuse=True)`` reuses, trained by the same trainer and configuration on ``nproc`` ranks
    forked here (``base.threads`` set, as the comparison's own), not launched: a launch would
    import torch and transformers again in each rank. The emulated runs stay launched."""
    configs = [replace(base, quiet=True, method=m, out=str(out / "runs" / "loopback" / m))
               for m in methods]
    run_ranks(train_in_process, nproc, (configs,), timeout=120 * len(methods))


@needs_root
@pytest.mark.distributed
@pytest.mark.slow
def test_training_through_the_link_matches_loopback_bitwise(tmp_path):
    base = TrainConfig(model="llama-tiny", seq_len=32, batch_size=2, steps=4, warmup=1,
                       eval_every=2, eval_batches=2, refresh_every=1, profile_steps=1,
                       threads=1)
    _train_on_loopback(base, ["geofp8", "powersgd"], 2, tmp_path)
    results = cluster.run_comparison(base, ["geofp8", "powersgd"], ["loopback", "1"], 2,
                                     tmp_path, run_timeout=120, reuse=True,
                                     echo=lambda *a: None)
    for method in ("geofp8", "powersgd"):
        logs = [read_log(tmp_path / "runs" / rate / method / "log.jsonl")
                for rate in ("loopback", "1gbit")]
        keys = ("step", "loss", "grad_norm", "val_loss", "bytes_sent")
        assert [[r.get(k) for k in keys] for r in logs[0]] == \
               [[r.get(k) for k in keys] for r in logs[1]]  # the network changes time only
        assert all(math.isfinite(r["loss"]) for r in logs[1])
    # PowerSGD's bytes, counted from its collectives: two FP32 warm-up steps, then P and Q
    # (rank 4) of every matrix plus the vectors uncompressed; ring factor 2(N−1)/N = 1
    ps = read_log(tmp_path / "runs" / "1gbit" / "powersgd" / "log.jsonl")
    model, _ = _model_and_data(base)
    n_all = sum(p.numel() for p in model.parameters())
    low_rank = sum(4 * (p.shape[0] + p.shape[1]) if p.ndim == 2 else p.numel()
                   for p in model.parameters())
    assert [r["bytes_sent"] for r in ps] == [4 * n_all] * 2 + [4 * low_rank] * 2
    fig = results["rates"]["1gbit"]["geofp8"]
    assert fig["step_s"] > 0 and fig["link_s"] > 0 and "model_error" in fig
    assert (tmp_path / "time_to_loss.png").stat().st_size > 0
    assert "| 1gbit | powersgd |" in (tmp_path / "report.md").read_text()


@needs_root
@pytest.mark.distributed
@pytest.mark.slow
def test_training_on_two_nodes_of_two_ranks_matches_loopback_bitwise(tmp_path):
    # the hierarchical collective (FP32 inside a node, FP8 between), nodes of 2 at both
    # rates: on loopback they are emulated by --node-size, on the cluster they are real
    base = TrainConfig(model="llama-tiny", seq_len=32, batch_size=2, steps=3, warmup=1,
                       eval_every=3, eval_batches=1, hierarchy="node", node_size=2, threads=1)
    _train_on_loopback(base, ["fp8-ef"], 4, tmp_path)
    results = cluster.run_comparison(base, ["fp8-ef"], ["loopback", "1"], 4, tmp_path,
                                     run_timeout=180, reuse=True, echo=lambda *a: None,
                                     ranks_per_node=2)
    logs = [read_log(tmp_path / "runs" / rate / "fp8-ef" / "log.jsonl")
            for rate in ("loopback", "1gbit")]
    keys = ("step", "loss", "grad_norm", "bytes_sent", "bytes_inter_node")
    assert all(r["bytes_inter_node"] > 0 for r in logs[1])
    assert [[r.get(k) for k in keys] for r in logs[0]] == \
           [[r.get(k) for k in keys] for r in logs[1]]
    assert results["setup"]["ranks_per_node"] == 2
    assert "2 nodes of 2" in (tmp_path / "report.md").read_text()
