"""``geofp8 cluster``: training measured on an emulated bandwidth-limited cluster.

Every node runs its ranks' ``geofp8 train`` processes in its own network namespace, on a
link shaped to the given rate (:mod:`geofp8.tools.netem`); gloo runs over real TCP through
those links. A node is one rank unless ``--ranks-per-node R`` (or ``--nodes M``) makes it
several, which then reach each other over the node's unshaped loopback: the two networks
of a real cluster (fast inside a node, the shaped link between nodes). For
each rate (``loopback``: the plain local launch, the wire there is practically free) and
each method, one run with the same seed, data and flags; the network changes time, not
numbers (the tests check the losses bitwise). Then the report:

* per method and rate: step time (median over the steps without validation, after the
  first ``SETTLE`` steps), tokens/s, bytes per step, validation loss against training
  seconds (validation time excluded), seconds to reach fp32's final validation loss
  (linear interpolation between validation points), speed-ups over fp32 and bf16;
* the alpha-beta model of :mod:`geofp8.tools.scaling` against the measurement: predicted
  step = loopback step of the method + ``all_reduce_time`` of its bytes on a link of the
  rate (``hidden = 0``, ``alpha = 0``); error = predicted / measured − 1;
* overlap: ``hidden = 1 − (step(rate) − step(loopback)) / link_time`` — the share of the
  link time that did not show up in the step (DDP overlaps buckets with the backward);
* break-even: GeoFP8's extra work per step (loopback step − the other method's) against
  the bytes it saves: above ``8·Δbytes / Δcompute`` bit/s the work costs more than the
  bytes save (no overlap assumed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import statistics
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

from . import netem, scaling
from .errors import UsageError
from .flags import at_least, choice_list, comma_list, flatten
from .needs import require
from .train import add_train_arguments, check_inputs, check_world, config_from_args, to_argv
from .train.compare import _complete
from .train.config import METHODS, TrainConfig
from .train.launch import launch
from .train.report import _bytes, read_log

__all__ = ["add_arguments", "launch_emulated", "run", "run_comparison", "summarize"]

DEFAULT_METHODS = ["fp32", "bf16", "fp8-ef", "geofp8", "geofp8-fresh", "powersgd"]
DEFAULT_RATES = ["loopback", "1", "10"]
SETTLE = 3  # first steps left out of the step time (DDP bucket rebuild, PowerSGD warm-up)
MEASURABLE = 0.05  # hidden share shown only when the link time is ≥ 5 % of the step
MASTER_PORT = 29500  # inside rank 0's own namespace: nothing else listens there


def add_arguments(parser: argparse.ArgumentParser) -> None:
    positive = at_least(0, float, above=True)
    parser.add_argument("--methods", nargs="+", type=choice_list(METHODS),
                        default=DEFAULT_METHODS, metavar="METHOD",
                        help="methods, space- or comma-separated (default: "
                        f"{' '.join(DEFAULT_METHODS)})")
    parser.add_argument("--rates", nargs="+", type=comma_list(_rate), default=DEFAULT_RATES,
                        metavar="RATE",
                        help="link rates, space- or comma-separated: Gbit/s (1, 10), with a "
                        "unit (500m, 25g), or 'loopback' (the plain local launch, needed for "
                        f"the overlap and the model; default: {' '.join(DEFAULT_RATES)})")
    parser.add_argument("--nproc", type=at_least(2), default=4, help="ranks in all, "
                        f"2..{netem.MAX_RANKS} (default: %(default)s)")
    parser.add_argument("--ranks-per-node", type=at_least(1), default=1,
                        help="ranks sharing a node's namespace and link (default: 1)")
    parser.add_argument("--nodes", type=at_least(2), default=None,
                        help="nodes; sets --nproc to nodes × ranks-per-node")
    parser.add_argument("--queue-ms", type=positive, default=20.0,
                        help="token-bucket queue bound in ms (tbf latency; not a delay; "
                        "default: %(default)s)")
    parser.add_argument("--burst", type=at_least(1), default=None,
                        help="token-bucket burst in bytes (default: max(128 KiB, 1 ms of rate))")
    parser.add_argument("--mtu", type=at_least(68), default=1500,
                        help="MTU of the links (default: %(default)s)")
    parser.add_argument("--run-timeout", type=positive, default=3600.0,
                        help="seconds before one run is stopped (default: %(default)s)")
    parser.add_argument("--loss-slack", type=at_least(0, float), default=1e-3,
                        help="a method has reached fp32's final validation loss when it is "
                        "within this much above it (default: %(default)s; seed spreads are "
                        "≈1e-2)")
    parser.add_argument("--reuse", action="store_true",
                        help="keep runs whose log already reaches the last step")
    add_train_arguments(parser, skip=("method", "resume", "stop_after"))
    parser.set_defaults(out="reports/cluster", model="llama-small", eval_every=25,
                        log_every=1, quiet=True)


def _rate(text: str) -> str:
    """A ``--rates`` item, checked (argparse type)."""
    try:
        rate_label(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def rate_label(rate: str) -> str:
    """``"1"`` → ``"1gbit"``, ``"500m"`` → ``"0.5gbit"``, ``"loopback"`` unchanged."""
    if rate == "loopback":
        return rate
    return f"{netem.parse_rate(rate) / 1e9:g}gbit"


def launch_emulated(cluster: netem.Cluster, train_argv: list[str], threads: int,
                    timeout: float) -> int:
    """One ``geofp8 train`` process per rank, in its node's namespace, with torchrun's
    variables (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``: the node), rendezvous at
    rank 0's address, gloo bound to the node's link. Exit status: 0, the first failing
    rank's, or 124 at the timeout; every rank is stopped before it returns."""
    r = cluster.ranks_per_node
    env = dict(os.environ, WORLD_SIZE=str(cluster.n), MASTER_ADDR=cluster.address(0),
               MASTER_PORT=str(MASTER_PORT), LOCAL_WORLD_SIZE=str(r),
               GLOO_SOCKET_IFNAME=netem.IFACE, OMP_NUM_THREADS=str(threads))
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # namespaces have no DNS: c10d warns
    argv = [sys.executable, "-m", "geofp8.tools.cli", "train", *train_argv]
    procs = [cluster.popen(i, argv, env={**env, "RANK": str(i), "LOCAL_RANK": str(i % r),
                                         "GROUP_RANK": str(i // r)})
             for i in range(cluster.n)]
    codes = netem.wait_all(procs, timeout)
    return next((c for c in codes if c != 0), 0)


def run_comparison(base: TrainConfig, methods: list[str], rates: list[str], nproc: int,
                   out: str | Path, queue_ms: float = 20.0, burst: int | None = None,
                   mtu: int = 1500, run_timeout: float = 3600.0, reuse: bool = False,
                   command: str | None = None, loss_slack: float = 1e-3, echo=print,
                   ranks_per_node: int = 1) -> dict:
    """Train every method at every rate into ``<out>/runs/<rate>/<method>``, then write the
    report (``report.md``, ``results.json``, ``time_to_loss.png``) under ``out``."""
    out = Path(out)
    if any(r != "loopback" for r in rates):
        netem.require_tools()  # before any run: say at once what is missing
    threads = base.threads or max(1, (os.cpu_count() or 1) // nproc)
    base = replace(base, threads=threads, quiet=True)
    runs = []
    labels = {rate: rate_label(rate) for rate in rates}
    todo = []
    for method in methods:  # method-major: the rates of a method run back to back, so
        for rate in rates:  # a change in the host's load hits them alike
            path = out / "runs" / labels[rate] / method
            runs.append({"method": method, "rate": labels[rate], "dir": str(path)})
            if reuse and _complete(path, base.steps):
                echo(f"{labels[rate]} {method}: reusing {path}")
            else:
                todo.append((rate, method, path))
    with contextlib.ExitStack() as stack:
        clusters = {}
        for rate in dict.fromkeys(r for r, _, _ in todo if r != "loopback"):
            c = clusters[rate] = stack.enter_context(
                netem.Cluster(nproc, netem.parse_rate(rate), queue_ms / 1e3, burst, mtu,
                              ranks_per_node))
            echo(f"{labels[rate]}: namespaces {c.prefix}* up ({c.nodes} nodes × "
                 f"{ranks_per_node} ranks)")
        for rate, method, path in todo:
            argv = to_argv(replace(base, method=method, out=str(path)))
            start = (partial(launch, nproc, argv, run_timeout) if rate == "loopback" else
                     partial(launch_emulated, clusters[rate], argv, threads, run_timeout))
            _one(labels[rate], method, start, path, echo)
    return write_report(out, runs, nproc, command, loss_slack, ranks_per_node)


def _one(label: str, method: str, start, path: Path, echo) -> None:
    echo(f"{label} {method} ...")
    t0 = time.perf_counter()
    rc = start()
    if rc != 0:
        raise RuntimeError(f"{label} {method} failed (exit status {rc})")
    s = summarize(read_log(path / "log.jsonl"))
    echo(f"      {time.perf_counter() - t0:.0f} s: step {s['step_s']:.3f} s, "
         f"validation {s['final_val_loss']:.4f}")


# -- the report -----------------------------------------------------------------------------


def summarize(records: list[dict]) -> dict:
    """Step time, bytes and the validation curve against training seconds of one run."""
    if not records:
        raise ValueError("empty log")
    steady = [r["step_time_s"] for r in records if "val_loss" not in r and r["step"] >= SETTLE]
    steady = steady or [r["step_time_s"] - r.get("eval_s", 0.0) for r in records]
    eval_total, curve = 0.0, []
    for r in records:
        eval_total += r.get("eval_s", 0.0)
        if "val_loss" in r:
            curve.append((r["elapsed_s"] - eval_total, r["val_loss"]))
    inter = [r["bytes_inter_node"] for r in records if "bytes_inter_node" in r]
    return {"step_s": statistics.median(steady),
            "bytes_per_step": statistics.fmean(r["bytes_sent"] for r in records),
            "inter_node_bytes_per_step": statistics.fmean(inter) if inter else None,
            "bytes_per_element": statistics.fmean(r["bytes_per_element"] for r in records),
            "final_val_loss": curve[-1][1] if curve else None,
            "train_s": records[-1]["elapsed_s"] - eval_total, "val_curve": curve,
            "steps": records[-1]["step"] + 1}


def time_to_loss(curve: list[tuple[float, float]], target: float) -> float | None:
    """First training second at which the validation curve reaches ``target`` (linear
    between validation points), or ``None``."""
    prev = None
    for t, v in curve:
        if v <= target:
            if prev is None or prev[1] == v:
                return t
            (t0, v0) = prev
            return t0 + (t - t0) * (v0 - target) / (v0 - v)
        prev = (t, v)
    return None


def link_time(bytes_per_step: float, n: int, rate: float, ranks_per_node: int = 1,
              inter_node_bytes: float | None = None) -> float:
    """Seconds the scaling model gives one step's bytes on a node link of ``rate`` bit/s.

    A flat collective spreads a rank's ``bytes_per_step`` evenly over its ``n − 1`` peers, so
    a node of ``r`` ranks sends ``r·bytes·(n − r)/(n − 1)`` over its link; the hierarchical
    one sends ``r·inter_node_bytes`` (each rank's hop between nodes; the hops inside a node
    stay on its loopback). That is costed as a ring all-reduce whose traffic per rank it
    is (``r = 1``, flat: the rank's own bytes)."""
    r = ranks_per_node
    crossing = r * (inter_node_bytes if inter_node_bytes is not None else
                    bytes_per_step * (n - r) / (n - 1))
    fabric = scaling.Fabric(f"{rate / 1e9:g} Gbit/s", alpha=0.0, inter_bw=rate / 8)
    return scaling.all_reduce_time(crossing * n / (2 * (n - 1)), n, fabric)


def break_even(geo: dict, other: dict) -> float | None:
    """The rate (bit/s) above which GeoFP8's extra work per step costs more than the bytes
    it saves against ``other`` (both: loopback ``step_s`` and ``bytes_per_step``); ``None``
    when it saves no bytes, ``inf`` when it costs no extra time."""
    saved = other["bytes_per_step"] - geo["bytes_per_step"]
    extra = geo["step_s"] - other["step_s"]
    if saved <= 0:
        return None
    return float("inf") if extra <= 0 else 8 * saved / extra


def fit_hidden(rows: list[dict]) -> float | None:
    """The one hidden fraction ``h`` in [0, 1] that minimises the squared relative error of
    ``loopback step + (1 − h)·link_s`` over ``rows`` (closed form, then clipped)."""
    a = [s["link_s"] / s["step_s"] for s in rows]
    b = [(s["predicted_step_s"] - s["link_s"] - s["step_s"]) / s["step_s"] for s in rows]
    if not rows or not any(a):
        return None
    exposed = -sum(x * y for x, y in zip(a, b)) / sum(x * x for x in a)
    return 1 - min(1.0, max(0.0, exposed))


def write_report(out: Path, runs: list[dict], nproc: int, command: str | None,
                 loss_slack: float = 1e-3, ranks_per_node: int = 1) -> dict:
    table: dict[str, dict[str, dict]] = {}  # rate -> method -> figures
    info = {}
    for r in runs:
        s = summarize(read_log(Path(r["dir"]) / "log.jsonl"))
        info = info or json.loads((Path(r["dir"]) / "run.json").read_text())
        table.setdefault(r["rate"], {})[r["method"]] = s
    cfg = info["config"]
    tokens = info["world_size"] * cfg["batch_size"] * cfg["seq_len"]
    base = table.get("loopback", {})
    for label, rows in table.items():
        rate = None if label == "loopback" else netem.parse_rate(label)
        final = rows.get("fp32", {}).get("final_val_loss")
        target = final + loss_slack if final is not None else None
        for name, s in rows.items():
            s["tokens_per_s"] = tokens / s["step_s"]
            s["s_to_fp32_loss"] = time_to_loss(s["val_curve"], target) if final else None
            for ref in ("fp32", "bf16"):
                if ref in rows:
                    s[f"speedup_vs_{ref}"] = rows[ref]["step_s"] / s["step_s"]
                    t_ref, t = rows[ref].get("s_to_fp32_loss"), s["s_to_fp32_loss"]
                    s[f"ttl_speedup_vs_{ref}"] = t_ref / t if t_ref and t else None
            if rate is not None:
                s["link_s"] = link_time(s["bytes_per_step"], nproc, rate, ranks_per_node,
                                        s.get("inter_node_bytes_per_step"))
                if name in base:
                    s["predicted_step_s"] = base[name]["step_s"] + s["link_s"]
                    s["model_error"] = s["predicted_step_s"] / s["step_s"] - 1
                    s["exposed_s"] = s["step_s"] - base[name]["step_s"]
                    s["hidden"] = 1 - s["exposed_s"] / s["link_s"]
    shaped = [s for rows in table.values() for s in rows.values() if "model_error" in s]
    errors = [s["model_error"] for s in shaped]
    hidden = fit_hidden(shaped)
    for s in shaped:
        s["calibrated_error"] = (s["predicted_step_s"] - hidden * s["link_s"]) / s["step_s"] - 1
    even = {}
    for geo in ("geofp8", "geofp8-fresh"):
        for ref in ("fp32", "bf16"):
            if geo in base and ref in base:
                even[f"{geo}_vs_{ref}"] = break_even(base[geo], base[ref])
    results = {"command": command, "setup": {**{k: cfg[k] for k in (
        "model", "seq_len", "batch_size", "steps", "optimizer", "eval_every", "seed", "threads")},
        "world_size": info["world_size"], "ranks_per_node": ranks_per_node,
        "parameters": info["parameters"],
        "tokens_per_step": tokens, "loss_slack": loss_slack}, "rates": table,
        "break_even_bit_s": even,
        "model_error_mean_abs": statistics.fmean(abs(e) for e in errors) if errors else None,
        "model_error_max_abs": max((abs(e) for e in errors), default=None),
        "fitted_hidden": hidden,
        "calibrated_error_mean_abs": statistics.fmean(abs(s["calibrated_error"])
                                                      for s in shaped) if shaped else None,
        "cpus": os.cpu_count(), "load_average": os.getloadavg()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    plot_time_to_loss(table, out / "time_to_loss.png")
    (out / "report.md").write_text(markdown(results))
    return results


def _f(x, spec: str) -> str:
    if x is None:
        return "—"
    if x == float("inf"):
        return "∞"
    return format(x, spec)


def format_table(table: dict[str, dict[str, dict]]) -> str:
    rows = ["| rate | method | step s | tokens/s | bytes/step | final val | s to fp32 loss | "
            "× fp32 (step / to loss) | × bf16 (step / to loss) | predicted step s | "
            "model error | exposed s | link s | hidden |", "|" + "---|" * 14]
    for label, methods in table.items():
        for name, s in methods.items():
            rows.append("| " + " | ".join([
                label, name, _f(s["step_s"], ".3f"), _f(s["tokens_per_s"], ".0f"),
                _bytes(s["bytes_per_step"]), _f(s["final_val_loss"], ".4f"),
                _f(s["s_to_fp32_loss"], ".1f"),
                f"{_f(s.get('speedup_vs_fp32'), '.2f')} / "
                f"{_f(s.get('ttl_speedup_vs_fp32'), '.2f')}",
                f"{_f(s.get('speedup_vs_bf16'), '.2f')} / "
                f"{_f(s.get('ttl_speedup_vs_bf16'), '.2f')}",
                _f(s.get("predicted_step_s"), ".3f"), _f(s.get("model_error"), "+.0%"),
                _f(s.get("exposed_s"), "+.3f"), _f(s.get("link_s"), ".3f"),
                _f(s.get("hidden") if s.get("link_s", 0) >= MEASURABLE * s["step_s"] else None,
                   ".0%")]) + " |")
    return "\n".join(rows)


def markdown(results: dict) -> str:
    s = results["setup"]
    parts = ["# Time to loss on an emulated cluster", ""]
    if results.get("command"):
        parts += ["```", results["command"], "```", ""]
    r = s.get("ranks_per_node", 1)
    layout = "one network namespace each" if r == 1 else \
        f"{s['world_size'] // r} nodes of {r}, a network namespace per node"
    parts += [f"{s['model']} ({s['parameters']:,} parameters), {s['world_size']} ranks "
              f"({layout}, links shaped by tbf), {s['batch_size']} × "
              f"{s['seq_len']} tokens per rank and step, {s['steps']} steps, {s['optimizer']},"
              f" seed {s['seed']}, {s['threads']} torch thread(s) per rank on a "
              f"{results['cpus']}-CPU host (load average when the report was written: "
              f"{results['load_average'][0]:.1f}).", "", format_table(results["rates"]), ""]
    parts += ["Step: median over the steps without validation after the first "
              f"{SETTLE}. Bytes: what one rank puts on the wire per step. s to fp32 loss: "
              "training seconds (validation excluded) until the validation loss is within "
              f"{s['loss_slack']:g} of fp32's final one at the same rate (— : not reached). "
              "Speed-ups: fp32's (bf16's) step time or time to loss over the method's. "
              "Predicted: the method's loopback step + the alpha-beta model's all-reduce time "
              "of its bytes on the link (alpha = 0, nothing hidden); model error = predicted / "
              "measured − 1. Exposed: step − loopback step. Hidden: 1 − exposed / link s, the "
              "share of the link time DDP overlapped (shown when link s ≥ "
              f"{MEASURABLE:.0%} of the step).", ""]
    if results["model_error_mean_abs"] is not None:
        parts += [f"Model error (nothing hidden): mean |error| "
                  f"{results['model_error_mean_abs']:.0%}, max "
                  f"{results['model_error_max_abs']:.0%}. Calibrated (one hidden fraction for "
                  f"every method and rate, least squares): hidden = "
                  f"{results['fitted_hidden']:.0%}, mean |error| "
                  f"{results['calibrated_error_mean_abs']:.0%}.", ""]
    for key, rate in results["break_even_bit_s"].items():
        geo, ref = key.split("_vs_")
        text = ("it saves no bytes" if rate is None else "its extra work costs nothing here"
                if rate == float("inf") else f"above {rate / 1e9:.2f} Gbit/s its extra work "
                "costs more than the bytes it saves")
        parts.append(f"* {geo} vs {ref} (from the loopback steps, no overlap): {text}.")
    parts += ["", "![time to loss](time_to_loss.png)", ""]
    return "\n".join(parts)


def plot_time_to_loss(table: dict[str, dict[str, dict]], path: Path) -> None:
    """Validation loss against training seconds, one panel per rate, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(m for rows in table.values() for m in rows))
    cmap = plt.get_cmap("tab10")
    fig, axes = plt.subplots(1, len(table), figsize=(6 * len(table), 4.5), squeeze=False)
    for ax, (label, rows) in zip(axes[0], table.items()):
        for name in names:
            if name in rows and rows[name]["val_curve"]:
                t, v = zip(*rows[name]["val_curve"])
                ax.plot(t, v, marker="o", ms=3, lw=1.3, color=cmap(names.index(name) % 10),
                        label=f"{name} ({rows[name]['step_s']:.2f} s/step)")
        if "fp32" in rows and rows["fp32"]["final_val_loss"] is not None:
            ax.axhline(rows["fp32"]["final_val_loss"], color="k", lw=0.8, ls=":")
        ax.set(title=f"{label}: validation loss vs training seconds", xlabel="seconds",
               ylabel="validation loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the command ----------------------------------------------------------------------------


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def run(args: argparse.Namespace) -> int:
    methods, rates = flatten(args.methods), flatten(args.rates)
    if args.nodes is not None:
        args.nproc = args.nodes * args.ranks_per_node
    if not 2 <= args.nproc <= netem.MAX_RANKS:
        raise UsageError(f"--nproc must be in 2..{netem.MAX_RANKS}, got {args.nproc}")
    if args.nproc % args.ranks_per_node or args.nproc // args.ranks_per_node < 2:
        raise UsageError(f"--ranks-per-node {args.ranks_per_node} must divide the "
                         f"{args.nproc} ranks into at least 2 nodes")
    labels = [rate_label(r) for r in rates]
    if len(set(labels)) != len(labels):
        raise UsageError(f"--rates: a rate is repeated in {' '.join(rates)}")
    base = config_from_args(args)
    check_inputs(base)
    check_world(base, args.nproc)
    require("geofp8 cluster's report (time_to_loss.png)", "matplotlib")
    # the command that produces these runs (--reuse only skips finished ones)
    command = "geofp8 cluster " + shlex.join(a for a in getattr(args, "_argv", [])[1:]
                                             if a != "--reuse")
    previous = signal.signal(signal.SIGTERM, _interrupt)  # teardown runs on kill, too
    try:
        results = run_comparison(base, methods, rates, args.nproc, args.out, args.queue_ms,
                                 args.burst, args.mtu, args.run_timeout, args.reuse, command,
                                 args.loss_slack, ranks_per_node=args.ranks_per_node)
    except netem.ClusterUnavailable as e:
        print(f"geofp8 cluster: {e}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)
    print()
    print(format_table(results["rates"]))
    print(f"\nreport: {Path(args.out) / 'report.md'}")
    return 0
