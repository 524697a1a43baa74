"""The study's tables and plot from the compare folders' results (and, when present, the runs'
logs): per-seed paired gap to fp32, bytes per element per round trip, the budget's choices.

    python docs/results/budget-2026-12-04/study.py
    python docs/results/budget-2026-12-04/study.py 0.67=reports/budget-ef2 --plot OUT.png

Arguments: ``BUDGET=FOLDER`` compare folders (default: this study's two) and where the plot
goes (default: ``gap_vs_bytes.png`` next to this file). ``--fsdp STORAGE=FOLDER ...``: compare
folders of ``--parallel fsdp`` runs (fp32 and nvfp4-ef) with that ``--residual`` storage;
prints nvfp4-ef's paired gap to FSDP's own fp32 per storage.

Bytes per element per round trip = the report's bytes/element (what one rank sends per step
over the model's elements) / 2(N−1)/N (the exact collective's round trip).
Prints Markdown.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import Counter
from pathlib import Path

HERE = Path(__file__).parent
FOLDERS = {"0.67": HERE, "0.8": HERE / "budget-0.8"}  # the budget of each compare folder
KINDS = [("attention q/k/v", r"self_attn\.[qkv]_proj"), ("attention o", r"self_attn\.o_proj"),
         ("mlp gate/up", r"mlp\.(gate|up)_proj"), ("mlp down", r"mlp\.down_proj"),
         ("embedding", r"embed_tokens"), ("lm_head", r"lm_head"), ("norms", r"norm")]


def runs(folders: dict[str, Path]) -> dict[str, dict[int, dict]]:
    """``{method label: {seed: run}}`` over every compare folder that has results."""
    out: dict[str, dict[int, dict]] = {}
    for budget, folder in folders.items():
        path = folder / "results.json"
        if not path.exists():
            continue
        results = json.loads(path.read_text())
        ring = 2 * (results["setup"]["world_size"] - 1) / results["setup"]["world_size"]
        for run in results["runs"]:
            method = run["method"]
            label = f"{method} {budget}" if method.startswith("budget") else method
            run = {**run, "per_round_trip": run["bytes_per_element"] / ring,
                   "log": folder / "runs" / run["dir"] / "log.jsonl"}
            out.setdefault(label, {}).setdefault(run["seed"], run)
    return out


def table(by_method: dict[str, dict[int, dict]]) -> list[dict]:
    base = by_method["fp32"]
    rows = []
    for method, seeds in by_method.items():
        gaps = {s: r["final_val_loss"] - base[s]["final_val_loss"] for s, r in seeds.items()
                if s in base}
        values = list(gaps.values())
        mean = sum(values) / len(values)
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        bpe = sum(r["per_round_trip"] for r in seeds.values()) / len(seeds)
        rows.append({"method": method, "gaps": gaps, "mean": mean, "spread": spread,
                     "bytes": bpe})
    return rows


def kind_of(name: str) -> str:
    return next((k for k, pattern in KINDS if re.search(pattern, name)), "other")


def short(name: str) -> str:
    """``model.layers.3.mlp.down_proj.weight`` → ``3.down``."""
    m = re.search(r"layers\.(\d+)\.\w+\.(\w+?)(_proj)?\.weight", name)
    return f"{m[1]}.{m[2]}" if m else name.removeprefix("model.").removesuffix(".weight")


def choices(log: Path) -> list[tuple[int, dict[str, str], float]]:
    """``(step, formats, planned)`` of every decision logged in ``log``."""
    out = []
    for line in log.read_text().splitlines():
        record = json.loads(line)
        if "formats" in record:
            out.append((record["step"], record["formats"], record.get("budget_planned")))
    return out


def refresh_share(log: Path, ring: float = 1.5) -> float:
    """B/element per round trip of the refreshes, averaged over the run: the excess of a
    refresh step (``step % 25 == 0``) over the step before it (same formats)."""
    per_step = {r["step"]: r["bytes_per_element"] for r in map(json.loads,
                                                               log.read_text().splitlines())
                if "bytes_per_element" in r}
    excess = sum(per_step[s] - per_step[s - 1] for s in per_step if s and s % 25 == 0)
    return excess / len(per_step) / ring


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for row in rows:
        if row["method"] == "fp32":
            continue
        ax.errorbar(row["bytes"], row["mean"], yerr=row["spread"], fmt="o", capsize=4)
        for gap in row["gaps"].values():
            ax.plot(row["bytes"], gap, ".", color="grey")
        ax.annotate(row["method"], (row["bytes"], row["mean"]), textcoords="offset points",
                    xytext=(6, 4))
    fp8 = next((r for r in rows if r["method"] == "fp8-ef"), None)
    if fp8 is not None:
        ax.axhline(max(fp8["gaps"].values()) + 0.003, ls="--", color="k", lw=0.8)
        ax.axvline(0.67, ls=":", color="k", lw=0.8)
        ax.text(0.68, max(fp8["gaps"].values()) + 0.004,
                "goal: ≤ 0.67 B, fp8-ef (worst seed) + 0.003", fontsize=8)
    ax.set_xlabel("bytes per element per round trip")
    ax.set_ylabel("val. loss gap to fp32 (mean ± std; dots: seeds)")
    ax.set_title("llama-small, 4 ranks, 200 steps")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


EF_BYTES = {"fp32": "4", "bf16": "2", "fp8": "1 + 4 per row", "nvfp4": "0.5625"}  # per param


def fsdp_table(folders: dict[str, Path]) -> None:
    """nvfp4-ef's gap to FSDP's fp32 per residual storage (issue 21, item 4)."""
    print("\n| EF residual storage | B per model parameter per rank | "
          "gap to fp32 per seed | mean | B/element on the wire |")
    print("|---|---|---|---|---|")
    for storage, folder in folders.items():
        by_method = runs({storage: folder})
        if "nvfp4-ef" not in by_method or "fp32" not in by_method:
            continue
        row = next(r for r in table(by_method) if r["method"] == "nvfp4-ef")
        seeds = ", ".join(f"{s}: {g:+.4f}" for s, g in sorted(row["gaps"].items()))
        wire = row["bytes"] * 1.5  # FSDP's reduce-scatter: one way, not a round trip
        print(f"| {storage} | {EF_BYTES.get(storage, '?')} | {seeds} | {row['mean']:+.4f} | "
              f"{wire:.4f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="*", metavar="BUDGET=FOLDER")
    parser.add_argument("--plot", type=Path, default=HERE / "gap_vs_bytes.png")
    parser.add_argument("--fsdp", nargs="*", default=[], metavar="STORAGE=FOLDER")
    args = parser.parse_args()
    folders = dict((b, Path(f)) for b, f in (a.split("=", 1) for a in args.folders)) \
        if args.folders else FOLDERS
    by_method = runs(folders)
    rows = sorted(table(by_method), key=lambda r: (r["bytes"], r["method"]))
    seeds = sorted({s for r in rows for s in r["gaps"]})
    print("| method | gap to fp32 (mean ± sample std) | "
          + " | ".join(f"gap seed {s}" for s in seeds) + " | B/element per round trip |")
    print("|---|---|" + "---|" * len(seeds) + "---|")
    for r in rows:
        print(f"| {r['method']} | {r['mean']:+.4f} ± {r['spread']:.4f} | "
              + " | ".join(f"{r['gaps'][s]:+.4f}" if s in r["gaps"] else "—" for s in seeds)
              + f" | {r['bytes']:.4f} |")
    plot(rows, args.plot)
    if args.fsdp:
        fsdp_table(dict((k, Path(f)) for k, f in (a.split("=", 1) for a in args.fsdp)))
    for method, seeds_runs in by_method.items():
        if not method.startswith("budget"):
            continue
        for seed, run in sorted(seeds_runs.items()):
            if not run["log"].exists():
                continue
            decisions = choices(run["log"])
            print(f"\n{method}, seed {seed}: {run['per_round_trip']:.4f} B/element per round "
                  f"trip, of which refreshes {refresh_share(run['log']):.4f}; "
                  f"{len(decisions)} decisions at steps {[d[0] for d in decisions]}, planned "
                  f"B/element {[round(d[2], 4) for d in decisions if d[2] is not None]}")
            print("| tensors | " + " | ".join(f"step {d[0]}" for d in decisions) + " |")
            print("|---|" + "---|" * len(decisions))
            for kind, _ in [*KINDS, ("other", "")]:
                cells = []
                for _, formats, _ in decisions:
                    count = Counter(p for n, p in formats.items() if kind_of(n) == kind)
                    cells.append(", ".join(f"{c} {p}" for p, c in sorted(count.items())))
                if any(cells):
                    print(f"| {kind} | " + " | ".join(cells) + " |")
            last = decisions[-1][1]
            for path in ("e4m3", "nvfp4"):
                names = [short(n) for n, p in last.items() if p == path and "norm" not in n]
                print(f"\nstep {decisions[-1][0]}, {path} (norms aside): {', '.join(names)}")


if __name__ == "__main__":
    main()
