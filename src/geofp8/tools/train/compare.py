"""``geofp8 compare``: the same training with several methods and seeds, then a report.

Every (seed, method) pair is its own ``geofp8 train`` launch into ``<out>/runs/<method>-s<seed>``
with the same flags except ``--method`` and ``--seed``: identical initial weights and data
order for every method of a seed. The report (:mod:`geofp8.tools.train.report`) is computed from
those runs' ``log.jsonl`` files.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

from ..errors import RunFailed, UsageError
from ..flags import at_least, choice_list, comma_list, flatten
from ..needs import available, install_hint
from . import add_train_arguments, check_inputs, check_world, config_from_args, to_argv
from .config import METHODS, TrainConfig
from .launch import launch
from .report import build_report, format_table, read_log

DEFAULT_METHODS = ["fp32", "fp8", "fp8-ef", "geofp8-auto"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--methods", nargs="+", type=choice_list(METHODS),
                        default=DEFAULT_METHODS, metavar="METHOD",
                        help=f"methods to run, space- or comma-separated (default: "
                        f"{' '.join(DEFAULT_METHODS)}; all: {' '.join(METHODS)})")
    parser.add_argument("--seeds", nargs="+", type=comma_list(at_least(0)), default=[0],
                        help="seeds, space- or comma-separated (model initialisation and data "
                        "order; default: 0)")
    parser.add_argument("--nproc", type=at_least(1), default=2,
                        help="ranks per run (default: %(default)s)")
    parser.add_argument("--reuse", action="store_true",
                        help="keep runs whose log already reaches the last step")
    parser.add_argument("--run-timeout", type=at_least(0, float, above=True), default=None,
                        help="seconds before one run is stopped (default: none)")
    add_train_arguments(parser, skip=("method", "seed", "resume", "stop_after"))
    parser.set_defaults(out="reports/compare", shadow_every=10)


def run_dir(out: str | Path, method: str, seed: int) -> Path:
    return Path(out) / "runs" / f"{method}-s{seed}"


def _complete(path: Path, steps: int) -> bool:
    log = path / "log.jsonl"
    if not log.exists():
        return False
    records = read_log(log)
    return bool(records) and records[-1]["step"] + 1 == steps


def compare(base: TrainConfig, methods: list[str], seeds: list[int], nproc: int,
            out: str | Path, reuse: bool = False, run_timeout: float | None = None,
            command: str | None = None, echo=print, on_run=None) -> dict:
    """Run every method for every seed, then write the report under ``out``;
    ``on_run(method, seed, seconds)`` is called after each run that was not reused. What
    is missing is said before any run starts: an unknown method, a method's settings (e.g.
    a budget method's --budget), a package the runs need; without matplotlib the report
    has no plots."""
    check_methods(methods)
    for method in methods:  # each method's own settings (e.g. a budget method's --budget)
        replace(base, method=method)
    check_inputs(base)
    check_world(base, nproc)
    plots = available("matplotlib")
    if not plots:
        echo(f"matplotlib is not installed: the report will have no plots "
             f"({install_hint(['matplotlib'])}, then rerun with --reuse to draw them).")
    runs = []
    total, done = len(methods) * len(seeds), 0
    for seed in seeds:
        for method in methods:
            done += 1
            path = run_dir(out, method, seed)
            cfg = replace(base, method=method, seed=seed, out=str(path), quiet=True)
            runs.append({"method": method, "seed": seed, "dir": str(path)})
            if reuse and _complete(path, cfg.steps):
                echo(f"[{done}/{total}] {method} seed {seed}: reusing {path}")
                continue
            t0 = time.perf_counter()
            echo(f"[{done}/{total}] {method} seed {seed} ({nproc} ranks) ...")
            rc = launch(nproc, to_argv(cfg), timeout=run_timeout)
            if rc != 0:
                raise RunFailed(f"{method} seed {seed} failed (exit status {rc}); "
                                   f"rerun: geofp8 train --nproc {nproc} "
                                   + shlex.join(to_argv(cfg)))
            seconds = time.perf_counter() - t0
            records = read_log(path / "log.jsonl")
            val = [r["val_loss"] for r in records if "val_loss" in r]
            echo(f"      done in {seconds:.0f} s: final loss "
                 f"{records[-1]['loss']:.4f}" + (f", validation {val[-1]:.4f}" if val else ""))
            if on_run is not None:
                on_run(method, seed, seconds)
    return build_report(out, runs, command=command, plots=plots)


def check_methods(methods: list[str]) -> None:
    """Raise :class:`UsageError` naming the methods that :data:`METHODS` does not have."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise UsageError(f"unknown method(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(METHODS)}")


def run(args: argparse.Namespace) -> int:
    args.methods, args.seeds = flatten(args.methods), flatten(args.seeds)
    base = config_from_args(args)
    command = "geofp8 compare " + shlex.join(sys.argv[2:]) if len(sys.argv) > 1 else None
    results = compare(base, args.methods, args.seeds, args.nproc, args.out, args.reuse,
                      args.run_timeout, command)
    print()
    print(format_table(results["methods"]))
    print(f"\nreport: {Path(args.out) / 'report.md'}")
    return 0
