"""The README's "Which method" table, generated from the dated result folders.

    python docs/method_table.py           # rewrite the table in README.md
    python docs/method_table.py --check   # exit 1 when README.md's table is not this output

Which methods are recommended, for what, and which study is their evidence is decided here
(``ROWS``); every figure comes from that study's ``results.json`` (``geofp8 compare``) and
from the emulated-cluster runs' loopback rows (``geofp8 cluster``). Nothing is typed.

* bytes: bytes per gradient element per round trip, ``bytes_per_element`` (what a rank sent,
  ``2(N−1)/N`` round trips on the exact collective) ÷ ``2(N−1)/N``; FP32 is 4.
* gap: final validation loss minus fp32's of the same seed, mean ± std over the seeds.
* CPU step: fp32's tokens/s over the method's in the study itself (4 gloo ranks on 2 cores,
  runs one after another on a shared machine, so it also holds the machine's drift: read it
  as ±30 %), then in brackets the step time over fp32's on loopback, the range over every
  ``geofp8 cluster`` run of the newest date that has the method (runs of a few minutes).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
README = RESULTS.parent.parent / "README.md"
BEGIN, END = "<!-- method-table:begin (docs/method_table.py) -->", "<!-- method-table:end -->"

# (method, the study that is its evidence, when to use it)
ROWS = [
    ("fp8-ef", "study-4bit-2026-12-05",
     "**the default**, `GeoFP8Config()`: FP8 where links are fast; a quarter of FP32's bytes "
     "for a gap inside the seed spread"),
    ("nvfp4-fresh8-ef", "study-4bit-2026-12-05",
     "4 bits where the link is the bottleneck: the best loss under 1 B/element (this step's "
     "geometry, its sketch in E4M3)"),
    ("budget", "study-4bit-2026-12-05",
     "a byte figure between 4 and 8 bits, `from_method(\"budget\", budget=B)`: formats chosen "
     "per tensor by measured error"),
    ("nvfp4-ef", "study-4bit-2026-12-05",
     "the fewest bytes and the least host work of the 4-bit recipes; the largest gap"),
    ("geofp8-auto", "compare-2026-12-02",
     "geometry at FP8 (`layers=\"auto\"`): no loss gain measured there; for studies of "
     "wider models and early training, where whitening measurably helps"),
    ("bf16", "study-4bit-2026-12-05",
     "PyTorch's `bf16_compress_hook`: half FP32's bytes, no loss change; the bar to beat"),
]


def _load(name: str) -> dict:
    return json.loads((RESULTS / name / "results.json").read_text())


def _round_trips(study: dict) -> float:
    n = study["setup"]["world_size"]
    return 2 * (n - 1) / n


def _cluster_step_ratios() -> dict[str, tuple[float, float, str]]:
    """method → (lowest, highest) step time over fp32's on loopback, over the cluster runs of
    the newest date that ran it, and that date's folder."""
    runs: dict[str, list[tuple[str, dict]]] = {}
    for path in sorted(RESULTS.glob("cluster-*/**/results.json")):
        folder = path.relative_to(RESULTS).parts[0]
        loopback = json.loads(path.read_text())["rates"].get("loopback")
        if loopback and "fp32" in loopback:
            runs.setdefault(folder, []).append(loopback)
    ratios: dict[str, tuple[float, float, str]] = {}
    for folder in sorted(runs):  # dated names: the newest last, and it wins
        for method in {m for loopback in runs[folder] for m in loopback}:
            r = [lb[method]["step_s"] / lb["fp32"]["step_s"] for lb in runs[folder]
                 if method in lb]
            ratios[method] = (min(r), max(r), folder)
    return ratios


def table() -> str:
    steps = _cluster_step_ratios()
    lines = ["| method | B/element | loss gap to FP32 | evidence | CPU step × fp32 | when |",
             "|---|---|---|---|---|---|"]
    cluster_folders = set()
    for method, folder, when in ROWS:
        study = _load(folder)
        row, fp32, setup = study["methods"][method], study["methods"]["fp32"], study["setup"]
        width = row["bytes_per_element"] / _round_trips(study)
        gap = f"{row['val_gap_to_fp32']:+.4f} ± {row['val_gap_to_fp32_std']:.4f}"
        evidence = (f"{setup['model']}, {setup['world_size']} ranks, {len(setup['seeds'])} "
                    f"seeds, {setup['steps']} steps ([{folder}](docs/results/{folder}/))")
        step = f"{fp32['tokens_per_s'] / row['tokens_per_s']:.2f}"
        if method in steps:
            low, high, where = steps[method]
            step += f" ({low:.2f}–{high:.2f})"
            cluster_folders.add(where)
        lines.append(f"| `{method}` | {width:.3f} | {gap} | {evidence} | {step} | {when} |")
    clusters = ", ".join(f"[{f}](docs/results/{f}/)" for f in sorted(cluster_folders))
    note = ("B/element: per gradient element and round trip (FP32: 4). Gap: final validation "
            "loss minus fp32's, mean ± std over the seeds. CPU step: fp32's tokens/s over the "
            "method's in the study's own runs (one after another on a shared 2-core machine: "
            f"±30 %); in brackets, its step over fp32's in the loopback runs of {clusters} "
            "(the range). GPU step times: not measured yet.")
    return "\n".join(lines) + "\n\n" + note + "\n"


def splice(text: str, generated: str) -> str:
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{generated}{END}{tail}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when README.md's table differs from this output")
    args = parser.parse_args(argv)
    text = README.read_text()
    wanted = splice(text, table())
    if args.check:
        if wanted != text:
            print("README.md's method table is stale: run python docs/method_table.py",
                  file=sys.stderr)
            return 1
        return 0
    README.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
