"""``geofp8 demo``: the main job, a training comparison that fits a laptop.

``geofp8 compare`` of fp32, fp8, fp8-ef, geofp8 and geofp8-auto on ``llama-tiny`` with 2
ranks (gloo) on the corpus that ships with Python: same seed, same data order, shadow
fidelity every 10 steps. It first times a short run of the last method (the list ends with
the dearest) on this machine (:func:`probe`, :data:`PROBE_STEPS` steps) and prints the
estimate that gives for every run, says why when a run takes longer, then prints the table
and writes the report (report.md, loss.png, fidelity.png, results.json) under
``reports/demo/``.

The same experiment at the paper's scale on a GPU cluster is ``geofp8 compare`` with
``--model llama-300m`` and more ranks; see the README.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

from .errors import RunFailed
from .flags import at_least, choice_list, flatten
from .needs import available
from .train import TrainConfig, check_inputs, to_argv
from .train.compare import compare
from .train.config import METHODS as ALL_METHODS
from .train.launch import launch
from .train.report import format_table, read_log

METHODS = ["fp32", "fp8", "fp8-ef", "geofp8", "geofp8-auto"]  # the dearest per step last
# CPU-sized: ~1.3 M parameters, 2 × 4 × 128 tokens per step. Paper recipe otherwise,
# except a higher peak lr for the short run and earlier geofp8 profiling (the paper
# profiles 100 steps of a much longer run).
SETTINGS = dict(model="llama-tiny", seq_len=128, batch_size=4, steps=250, warmup=25,
                lr=1e-3, lr_min=1e-4, eval_every=25, shadow_every=10, profile_steps=50)
PROBE_STEPS = 12  # a shadow step every 4, one evaluation at the end
SLOWER = 1.25  # a run this much over its estimate is reported, with the reasons found


@dataclass(frozen=True)
class RunCost:
    """Wall seconds of one run's parts, timed on this machine (:func:`probe`)."""

    start_s: float  # launch, set-up, first step and teardown
    step_s: float  # an ordinary step
    shadow_s: float  # what a shadow-fidelity step adds
    eval_s: float  # one validation

    def run_s(self, steps: int, shadow_every: int, eval_every: int) -> float:
        """Estimated wall seconds of a run of ``steps`` steps."""
        shadows = math.ceil(steps / shadow_every) if shadow_every else 0
        evals = steps // eval_every + (steps % eval_every > 0) if eval_every else 1
        return (self.start_s + steps * self.step_s + shadows * self.shadow_s
                + evals * self.eval_s)


def cost_from_log(records: list[dict], wall_s: float) -> RunCost:
    """:class:`RunCost` of a run that took ``wall_s`` and logged every step in ``records``
    (step 0, with its one-time work, counts as start-up)."""
    later = records[1:]
    plain = statistics.median(r["step_time_s"] for r in later
                              if "rel_l2" not in r and "val_loss" not in r)
    shadow = [r["step_time_s"] - plain for r in later if "rel_l2" in r and "val_loss" not in r]
    evals = [r["eval_s"] for r in records if "eval_s" in r]
    return RunCost(start_s=wall_s - sum(r["step_time_s"] for r in later), step_s=plain,
                   shadow_s=max(0.0, statistics.median(shadow)) if shadow else 0.0,
                   eval_s=statistics.mean(evals) if evals else 0.0)


def probe(base: TrainConfig, method: str, nproc: int) -> RunCost:
    """Time :data:`PROBE_STEPS` steps of ``method`` with ``base``'s settings here (a launch of
    its own, in ``<base.out>/probe``, removed afterwards)."""
    folder = Path(base.out) / "probe"
    cfg = replace(base, method=method, steps=PROBE_STEPS, warmup=1, shadow_every=4,
                  eval_every=PROBE_STEPS, out=str(folder), quiet=True)
    t0 = time.perf_counter()
    rc = launch(nproc, to_argv(cfg))
    wall = time.perf_counter() - t0
    if rc != 0:
        raise RunFailed(f"the timing run of {method} failed (exit status {rc})")
    try:
        return cost_from_log(read_log(folder / "log.jsonl"), wall)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def slowdowns(nproc: int, own_load: float = 0.0) -> list[str]:
    """Why runs are slower than they could be here, as far as can be seen: fewer cores
    than ranks, other work running (1-minute load average above ``own_load``,
    the load of our own ranks), Muon's Newton–Schulz forced into emulated BF16."""
    import torch

    from .train.optim import native_bf16, orthogonalization_dtype

    reasons = []
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    if cores < nproc:
        reasons.append(f"{cores} CPU core(s) for {nproc} ranks")
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = 0.0
    if load - own_load > 0.5 * cores:
        reasons.append(f"other work is running (1-minute load average {load:.1f} on {cores} "
                       "cores)")
    cpu = torch.device("cpu")
    dtype, why = orthogonalization_dtype(cpu)
    if dtype == torch.bfloat16 and not native_bf16(cpu)[0]:
        reasons.append(f"Muon's Newton–Schulz runs in emulated BF16 ({why}; unset it to use "
                       "FP32)")
    return reasons


class _Clock:
    """Compares every finished run with the estimate and says so when the demo runs late."""

    def __init__(self, methods: list[str], run_s: float, nproc: int) -> None:
        self.left = list(methods)
        self.run_s, self.nproc = run_s, nproc
        self.spent = self.expected = 0.0

    def __call__(self, method: str, seed: int, seconds: float) -> None:
        self.left.remove(method)
        self.spent += seconds
        self.expected += self.run_s
        if seconds <= SLOWER * self.run_s:
            return
        why = slowdowns(self.nproc, own_load=self.nproc) or [
            "its later steps cost more than the timed ones"]
        rest = len(self.left) * self.run_s * self.spent / self.expected
        print(f"      {method} took {seconds:.0f} s against {self.run_s:.0f} s estimated: "
              + "; ".join(why) + "." + (f" The remaining {len(self.left)} run(s) will take "
                                        f"about {rest / 60:.0f} min." if self.left else ""))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="reports/demo",
                        help="report folder (default: %(default)s)")
    parser.add_argument("--steps", type=at_least(1), default=SETTINGS["steps"],
                        help="steps per run (default: %(default)s)")
    parser.add_argument("--nproc", type=at_least(1), default=2,
                        help="ranks (default: %(default)s)")
    parser.add_argument("--methods", nargs="+", type=choice_list(ALL_METHODS), default=METHODS,
                        help=f"methods, space- or comma-separated (default: {' '.join(METHODS)})")
    parser.add_argument("--reuse", action="store_true", help="keep finished runs")


def run(args: argparse.Namespace) -> int:
    methods = flatten(args.methods)
    settings = {**SETTINGS, "steps": args.steps,
                "warmup": min(SETTINGS["warmup"], max(1, args.steps // 10))}
    base = TrainConfig(**settings, out=args.out)
    check_inputs(base)  # before the timing run
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in settings.items())
    command = (f"geofp8 compare --methods {' '.join(methods)} --nproc {args.nproc} "
               f"{flags} --out {args.out}")
    print(f"GeoFP8 demo: {len(methods)} methods on {settings['model']}, {args.nproc} ranks, "
          f"{settings['steps']} steps each\n{command}\n")
    t0 = time.perf_counter()
    run_s = None
    if settings["steps"] > PROBE_STEPS:
        cost = probe(base, methods[-1], args.nproc)
        run_s = cost.run_s(settings["steps"], settings["shadow_every"], settings["eval_every"])
        print(f"Timed {PROBE_STEPS} steps of {methods[-1]} here: {cost.step_s:.2f} s per step, "
              f"{cost.start_s:.0f} s start-up; at most about "
              f"{len(methods) * run_s / 60:.1f} minutes in all.")
        if why := slowdowns(args.nproc):
            print("Timed while: " + "; ".join(why) + ".")
        print()
    results = compare(base, methods, [0], args.nproc, args.out, reuse=args.reuse,
                      command=command,
                      on_run=_Clock(methods, run_s, args.nproc) if run_s else None)
    print()
    print(format_table(results["methods"]))
    figures = "loss.png, fidelity.png, " if available("matplotlib") else ""
    print(f"\n{time.perf_counter() - t0:.0f} s. Report: {Path(args.out) / 'report.md'} "
          f"(with {figures}results.json)")
    return 0
