"""``geofp8 demo``: the main job, a training comparison that fits a laptop.

``geofp8 compare`` of fp32, fp8, fp8-ef, geofp8 and geofp8-auto on ``llama-tiny`` with 2
ranks (gloo) on the corpus that ships with Python: same seed, same data order, shadow
fidelity every 10 steps. Prints an estimate of its duration first (:data:`RUN_COST_S`), says
why when a run takes longer, then prints the table and writes the report (report.md,
loss.png, fidelity.png, results.json) under ``reports/demo/``.

The same experiment at the paper's scale on a GPU cluster is ``geofp8 compare`` with
``--model llama-300m`` and more ranks; see the README.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from .train import TrainConfig
from .train.compare import compare, split_list
from .train.report import format_table

METHODS = ["fp32", "fp8", "fp8-ef", "geofp8", "geofp8-auto"]
# CPU-sized: ~1.3 M parameters, 2 × 4 × 128 tokens per step. Paper recipe otherwise,
# except a higher peak lr for the short run and earlier geofp8 profiling (the paper
# profiles 100 steps of a much longer run).
SETTINGS = dict(model="llama-tiny", seq_len=128, batch_size=4, steps=500, warmup=50,
                lr=1e-3, lr_min=1e-4, eval_every=25, shadow_every=10, profile_steps=50)
# One run of SETTINGS on 2 ranks: (start-up s, s per step) per rank on an AVX2-only x86 CPU
# (no AVX-512, no native BF16; emulated by capping oneDNN and ATen at AVX2, which takes the
# same slow BF16 path). CPU seconds, which other work on a shared machine barely changes,
# per rank: the launch's total CPU time over runs of 5 and 30 steps, halved; a step's share
# of the evaluation every 25 steps and of the shadow step every 10 is included. A method not
# listed costs as much as the dearest listed one.
RUN_COST_S = {"fp32": (5.8, 0.117), "fp8": (6.5, 0.113), "fp8-ef": (5.9, 0.119),
              "geofp8": (6.5, 0.115), "geofp8-auto": (5.9, 0.182)}
WAIT = 1.25  # wall time per CPU second of a rank: waits for the other rank, the launcher
SLOWER = 1.25  # a run this much over its estimate is reported, with the reasons found


def run_estimate_s(method: str, steps: int) -> float:
    """Estimated wall seconds of one ``method`` run of ``steps`` steps on 2 idle cores:
    ``WAIT · (start-up + steps · per step)`` (:data:`RUN_COST_S`)."""
    start, per_step = RUN_COST_S.get(method, max(RUN_COST_S.values(), key=lambda c: c[1]))
    return WAIT * (start + steps * per_step)


def slowdowns(nproc: int, own_load: float = 0.0) -> list[str]:
    """Why this machine is slower than the estimate's reference, as far as can be seen:
    fewer cores than ranks, other work running (1-minute load average above ``own_load``,
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
    """Compares every finished run with its estimate and says so when the demo runs late."""

    def __init__(self, methods: list[str], steps: int, nproc: int) -> None:
        self.left = list(methods)
        self.steps, self.nproc = steps, nproc
        self.spent = self.expected = 0.0

    def __call__(self, method: str, seed: int, seconds: float) -> None:
        self.left.remove(method)
        expected = run_estimate_s(method, self.steps)
        self.spent += seconds
        self.expected += expected
        if seconds <= SLOWER * expected:
            return
        why = slowdowns(self.nproc, own_load=self.nproc) or [
            "this CPU is slower than the estimate's reference"]
        rest = sum(run_estimate_s(m, self.steps) for m in self.left) * self.spent / self.expected
        print(f"      {method} took {seconds:.0f} s against {expected:.0f} s estimated: "
              + "; ".join(why) + "." + (f" The remaining {len(self.left)} run(s) will take "
                                        f"about {rest / 60:.0f} min." if self.left else ""))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="reports/demo",
                        help="report folder (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=SETTINGS["steps"],
                        help="steps per run (default: %(default)s)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (default: %(default)s)")
    parser.add_argument("--methods", nargs="+", default=METHODS,
                        help="methods (default: %(default)s)")
    parser.add_argument("--reuse", action="store_true", help="keep finished runs")


def run(args: argparse.Namespace) -> int:
    methods = split_list(args.methods)
    settings = {**SETTINGS, "steps": args.steps,
                "warmup": min(SETTINGS["warmup"], max(1, args.steps // 10))}
    base = TrainConfig(**settings, out=args.out)
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in settings.items())
    command = (f"geofp8 compare --methods {' '.join(methods)} --nproc {args.nproc} "
               f"{flags} --out {args.out}")
    estimate = sum(run_estimate_s(m, settings["steps"]) for m in methods)
    print(f"GeoFP8 demo: {len(methods)} methods on {settings['model']}, {args.nproc} ranks, "
          f"{settings['steps']} steps each: about {estimate / 60:.0f} minutes on 2 idle cores "
          f"of an AVX2-only CPU, the slowest kind measured\n{command}\n")
    if why := slowdowns(args.nproc):
        print("It will take longer here: " + "; ".join(why) + ".\n")
    t0 = time.perf_counter()
    results = compare(base, methods, [0], args.nproc, args.out, reuse=args.reuse,
                      command=command, on_run=_Clock(methods, settings["steps"], args.nproc))
    print()
    print(format_table(results["methods"]))
    print(f"\n{time.perf_counter() - t0:.0f} s. Report: {Path(args.out) / 'report.md'} "
          "(with loss.png, fidelity.png, results.json)")
    return 0
