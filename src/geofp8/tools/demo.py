"""``geofp8 demo``: the main job, a training comparison that fits a laptop.

``geofp8 compare`` of fp32, fp8, fp8-ef, geofp8 and geofp8-auto on ``llama-tiny`` with 2
ranks (gloo) on the corpus that ships with Python: same seed, same data order, shadow
fidelity every 10 steps. About 7 minutes on 2 CPU cores (under 10). Prints the table and writes the
report (report.md, loss.png, fidelity.png, results.json) under ``reports/demo/``.

The same experiment at the paper's scale on a GPU cluster is ``geofp8 compare`` with
``--model llama-300m`` and more ranks; see the README.
"""

from __future__ import annotations

import argparse
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
    print(f"GeoFP8 demo: {len(methods)} methods on {settings['model']}, {args.nproc} ranks, "
          f"{settings['steps']} steps each (1.5–2.5 minutes per method on 2 cores)\n{command}\n")
    t0 = time.perf_counter()
    results = compare(base, methods, [0], args.nproc, args.out, reuse=args.reuse,
                      command=command)
    print()
    print(format_table(results["methods"]))
    print(f"\n{time.perf_counter() - t0:.0f} s. Report: {Path(args.out) / 'report.md'} "
          "(with loss.png, fidelity.png, results.json)")
    return 0
