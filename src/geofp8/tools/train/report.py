"""The comparison report, computed from the runs' ``log.jsonl`` files and nothing else.

Per run: final validation loss (the last logged ``val_loss``), mean ``bytes_sent`` per
step and ``bytes_per_element``, mean communicated RelL2 and cosine over the shadow steps,
training wall time (``elapsed_s`` of the last step). Per method: mean and spread (sample
standard deviation) over seeds, and the gap to ``fp32`` on the same seed.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

__all__ = ["build_report", "format_table", "read_log", "summarize_run"]


def read_log(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def summarize_run(records: list[dict]) -> dict:
    """The figures of one run, from its log records."""
    val = [r for r in records if "val_loss" in r]
    shadow = [r for r in records if "rel_l2" in r]
    tail = records[-max(1, len(records) // 10):]
    return {
        "steps": records[-1]["step"] + 1 if records else 0,
        "final_val_loss": val[-1]["val_loss"] if val else None,
        "final_train_loss": _mean(r["loss"] for r in tail),
        "bytes_per_step": _mean(r["bytes_sent"] for r in records),
        "bytes_fp32_per_step": _mean(r["bytes_fp32_equivalent"] for r in records),
        "bytes_per_element": _mean(r["bytes_per_element"] for r in records),
        "mean_rel_l2": _mean(r["rel_l2"] for r in shadow),
        "mean_cos": _mean(r["cos"] for r in shadow),
        "wall_s": records[-1]["elapsed_s"] if records else None,
        "tokens_per_s": _mean(r["tokens_per_s"] for r in records),
        **_geometry(records),
        **_peak_bytes(records),
    }


def _geometry(records: list[dict]) -> dict:
    """From which step geometry was on (``stats()``'s ``geometry_since_step``) and on how
    many layers at most and at the end (``None`` for a method without geometry)."""
    counts = [r["geometry_layers"] for r in records if "geometry_layers" in r]
    if not counts:
        return {}
    since = [r["geometry_since_step"] for r in records if "geometry_since_step" in r]
    return {"geometry_since_step": since[-1] if since else None,
            "geometry_layers_max": max(counts), "geometry_layers_final": counts[-1]}


def _peak_bytes(records: list[dict]) -> dict:
    """The step that sent the most (a factor refresh) against a typical step (the median):
    ``peak_bytes_ratio``, and how much of the peak was factor traffic."""
    sent = [r["bytes_sent"] for r in records]
    if not sent:
        return {}
    peak = max(records, key=lambda r: r["bytes_sent"])
    typical = statistics.median(sent)
    return {"peak_bytes_step": peak["step"], "peak_bytes": peak["bytes_sent"],
            "peak_factor_bytes": peak.get("factor_bytes_sent"),
            "peak_bytes_ratio": peak["bytes_sent"] / typical if typical else None}


def _spread(xs):
    xs = [x for x in xs if x is not None]
    return statistics.stdev(xs) if len(xs) > 1 else (0.0 if xs else None)


def aggregate(runs: list[dict]) -> dict[str, dict]:
    """Per method: mean and seed spread of each figure, and the same-seed gap to fp32."""
    fp32 = {r["seed"]: r["summary"]["final_val_loss"] for r in runs if r["method"] == "fp32"}
    methods: dict[str, dict] = {}
    for name in dict.fromkeys(r["method"] for r in runs):
        mine = [r for r in runs if r["method"] == name]
        out: dict = {"seeds": [r["seed"] for r in mine]}
        for key in mine[0]["summary"]:
            vals = [r["summary"][key] for r in mine]
            out[key] = _mean(vals)
            out[key + "_std"] = _spread(vals)
        gaps = [r["summary"]["final_val_loss"] - fp32[r["seed"]] for r in mine
                if r["seed"] in fp32 and r["summary"]["final_val_loss"] is not None
                and fp32[r["seed"]] is not None]
        out["val_gap_to_fp32"] = _mean(gaps) if gaps else None
        out["val_gap_to_fp32_std"] = _spread(gaps) if gaps else None
        methods[name] = out
    return methods


def _fmt(x, spec, std=None):
    if x is None:
        return "—"
    s = format(x, spec)
    return s + (f" ± {format(std, spec.lstrip('+'))}" if std else "")


def _bytes(x):
    if x is None:
        return "—"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= div:
            return f"{x / div:.2f} {unit}"
    return f"{x:.0f} B"


def format_table(methods: dict[str, dict]) -> str:
    head = ("| method | final val loss | gap to fp32 | bytes/step | bytes/elem | "
            "RelL2 (comm.) | cos | wall s |")
    rows = [head, "|" + "---|" * 8]
    for name, m in methods.items():
        rows.append("| " + " | ".join([
            name,
            _fmt(m["final_val_loss"], ".4f", m["final_val_loss_std"]),
            _fmt(m["val_gap_to_fp32"], "+.4f", m["val_gap_to_fp32_std"]),
            _bytes(m["bytes_per_step"]),
            _fmt(m["bytes_per_element"], ".3f"),
            _fmt(m["mean_rel_l2"], ".4f"),
            _fmt(m["mean_cos"], ".5f"),
            _fmt(m["wall_s"], ".0f"),
        ]) + " |")
    return "\n".join(rows)


def build_report(out: str | Path, runs: list[dict], command: str | None = None,
                 plots: bool = True) -> dict:
    """Write ``report.md``, ``results.json``, ``loss.png`` and ``fidelity.png`` under
    ``out``. ``runs``: dicts with ``method``, ``seed`` and ``dir`` (holding log.jsonl)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for r in runs:
        r["records"] = read_log(Path(r["dir"]) / "log.jsonl")
        r["summary"] = summarize_run(r["records"])
        info = Path(r["dir"]) / "run.json"
        r["info"] = json.loads(info.read_text()) if info.exists() else {}
    methods = aggregate(runs)
    first = runs[0]["info"] if runs else {}
    setup = {k: first.get("config", {}).get(k) for k in
             ("model", "seq_len", "batch_size", "steps", "optimizer", "lr", "lr_min", "warmup",
              "format", "refresh_every", "profile_steps", "shadow_every", "eval_every",
              "budget")}
    setup.update(world_size=first.get("world_size"), parameters=first.get("parameters"),
                 seeds=sorted({r["seed"] for r in runs}))
    results = {
        "command": command, "setup": setup, "methods": methods,
        "runs": [{"method": r["method"], "seed": r["seed"],
                  "dir": Path(r["dir"]).name, **r["summary"]} for r in runs],
    }
    (out / "results.json").write_text(json.dumps(results, indent=1))
    if plots:
        plot_loss(runs, methods, out / "loss.png")
        plot_fidelity(runs, out / "fidelity.png")
    (out / "report.md").write_text(_markdown(results, methods, runs, plots))
    return results


def _verdict(methods: dict[str, dict], runs: list[dict]) -> list[str]:
    lines = []
    fp8ish = {k: m for k, m in methods.items() if k not in ("fp32", "bf16")
              and m["final_val_loss"] is not None}
    if fp8ish:
        # "equal bytes": the methods within 10% of the cheapest FP8 method's bytes per step
        cheapest = min(m["bytes_per_step"] for m in fp8ish.values())
        equal = {k: m for k, m in fp8ish.items() if m["bytes_per_step"] <= 1.1 * cheapest}
        best = min(equal, key=lambda k: equal[k]["final_val_loss"])
        m = equal[best]
        lines.append(f"* Best at equal bytes (within 10% of {_bytes(cheapest)}/step: "
                     f"{', '.join(equal)}): **{best}**, final validation loss "
                     f"{_fmt(m['final_val_loss'], '.4f', m['final_val_loss_std'])}"
                     + (f", {m['val_gap_to_fp32']:+.4f} vs fp32."
                        if m["val_gap_to_fp32"] is not None else "."))
    for geo in ("geofp8", "geofp8-auto"):
        if geo not in methods or "fp8-ef" not in methods:
            continue
        by_seed = {(r["method"], r["seed"]): r["summary"]["final_val_loss"] for r in runs}
        diffs = [by_seed[(geo, s)] - by_seed[("fp8-ef", s)] for s in methods[geo]["seeds"]
                 if by_seed.get((geo, s)) is not None
                 and by_seed.get(("fp8-ef", s)) is not None]
        if not diffs:
            continue
        d, spread = sum(diffs) / len(diffs), _spread(diffs)
        g, e = methods[geo], methods["fp8-ef"]
        rel = ""
        if g["mean_rel_l2"] is not None and e["mean_rel_l2"] is not None:
            rel = f"; communicated RelL2 {g['mean_rel_l2']:.4f} vs {e['mean_rel_l2']:.4f}"
        lower = sum(x < 0 for x in diffs)
        if len(diffs) < 2:
            word = "one seed: no spread to judge by"
        else:
            word = (f"lower in {lower} of {len(diffs)} seeds; seed-to-seed std of the "
                    f"difference {spread:.5f}")
        lines.append(f"* {geo} − fp8-ef (same seed, same EF and codec): validation loss "
                     f"{d:+.5f} ({word}); bytes/step {_bytes(g['bytes_per_step'])} vs "
                     f"{_bytes(e['bytes_per_step'])}{rel}.")
    return lines


PEAK_NOTED = 1.5  # a step sending more than this many typical steps' bytes is explained


def _geometry_lines(runs: list[dict]) -> list[str]:
    """Per run of a geometry method: from which step and on how many layers geometry was on,
    or why it never was (the run ended before the method could start it, or it measured
    no better than plain coordinates); and what its refresh steps sent, when they stand
    out."""
    lines, peaks = [], False
    for r in runs:
        plan, m = r["info"].get("geometry_start"), r["summary"]
        if not plan or plan["step"] is None or "geometry_layers_max" not in m:
            continue
        name = f"{r['method']} (seed {r['seed']})"
        if m["geometry_since_step"] is not None:
            line = (f"* {name}: geometry on from step {m['geometry_since_step']}, on up to "
                    f"{m['geometry_layers_max']} layer(s) ({m['geometry_layers_final']} at "
                    "the end).")
        elif m["steps"] <= plan["step"]:
            line = (f"* {name}: no geometry in these {m['steps']} steps: it can start at "
                    f"step {plan['step']} at the earliest ({plan['why']}); until then it "
                    "sends every gradient in plain coordinates. More steps, or smaller "
                    "values of the settings named, show it.")
        else:
            line = (f"* {name}: no geometry in {m['steps']} steps (possible from step "
                    f"{plan['step']}): on no layer did it measure better than plain "
                    "coordinates.")
        ratio = m.get("peak_bytes_ratio")
        if ratio and ratio > PEAK_NOTED:
            peaks, factor = True, m.get("peak_factor_bytes")
            every = r["info"]["config"]["refresh_every"]
            line += (f" Step {m['peak_bytes_step']} sent {_bytes(m['peak_bytes'])}, "
                     f"{ratio:.1f}× a typical step"
                     + (f" ({_bytes(factor)} factor traffic)" if factor else "")
                     + f"; once every {every} steps, that is +{(ratio - 1) / every:.0%} bytes "
                     "a step on average.")
        lines.append(line)
    if peaks:
        lines += ["", f"A step above {PEAK_NOTED}× a typical one is a factor refresh: the FP32 "
                  "statistics of the candidate layers' inputs (a d_in × d_in second moment "
                  "where a layer is narrow, a d_in × (k+p) sketch where it is wide) are reduced "
                  "once a refresh, and the maps built from them sent; on narrow layers that "
                  "is more than their FP8 gradients, so small models see the largest ratio."]
    return lines


def _markdown(results: dict, methods: dict[str, dict], runs: list[dict], plots: bool) -> str:
    s = results["setup"]
    parts = ["# GeoFP8 training comparison", ""]
    if results.get("command"):
        parts += ["```", results["command"], "```", ""]
    parts += [f"{s['model']} ({s['parameters']:,} parameters), {s['world_size']} ranks, "
              f"{s['batch_size']} × {s['seq_len']} tokens per rank and step, {s['steps']} "
              f"steps, {s['optimizer']} lr {s['lr']} → {s['lr_min']} (warm-up {s['warmup']}), "
              f"FP8 format {s['format']}, seeds {s['seeds']}"
              + (f", budget {s['budget']} B/element per round trip" if s.get("budget") else "")
              + "." if s.get("parameters") else "", ""]
    parts += [format_table(methods), ""]
    parts += ["Final val loss: mean ± sample std over seeds of the last logged validation "
              "loss. Gap: mean over seeds of (method − fp32, same seed). Bytes: what one rank "
              "puts on the wire per step (ring all-reduce 2(N−1)/N·n·width for fp32/bf16; "
              "payload + scales + factor/selection traffic for FP8 methods), mean over steps. "
              "RelL2/cos: communicated gradient vs the exact FP32 mean of the same local "
              "gradients, over all parameters, mean over shadow steps. Wall: training loop.",
              ""]
    verdict = _verdict(methods, runs)
    if verdict:
        parts += ["## At a glance", "", *verdict, ""]
    geometry = _geometry_lines(runs)
    if geometry:
        parts += ["## Geometry", "", *geometry, ""]
    if plots:
        parts += ["![loss](loss.png)", "", "![fidelity](fidelity.png)", ""]
    else:
        parts += ["No plots: matplotlib was not installed when this report was written "
                  "(`pip install matplotlib`, the [report] extra of geofp8; then the same "
                  "command with `--reuse` draws them without training again).", ""]
    return "\n".join(parts)


# -- plots ----------------------------------------------------------------------------------


def _colors(names):
    import matplotlib.pyplot as plt

    cmap = plt.get_cmap("tab10")
    return {n: cmap(i % 10) for i, n in enumerate(names)}


def _smooth(xs, k):
    out, acc = [], []
    for x in xs:
        acc.append(x)
        if len(acc) > k:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out


def _val_curve(run: dict) -> dict[int, float]:
    return {x["step"] + 1: x["val_loss"] for x in run["records"] if "val_loss" in x}


def plot_loss(runs: list[dict], methods: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = _colors(methods)
    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    ax_loss, ax_dval, ax_gap = axes
    fp32 = {r["seed"]: _val_curve(r) for r in runs if r["method"] == "fp32"}
    for name in methods:
        mine = [r for r in runs if r["method"] == name]
        for i, r in enumerate(mine):
            steps = [x["step"] + 1 for x in r["records"]]
            k = max(1, len(steps) // 40)
            ax_loss.plot(steps, _smooth([x["loss"] for x in r["records"]], k),
                         color=colors[name], lw=1, alpha=0.6, label=f"{name} train"
                         if i == 0 else None)
            val = _val_curve(r)
            if val:
                ax_loss.plot(list(val), list(val.values()), ls="--", marker="o", ms=3,
                             color=colors[name], lw=1, alpha=0.9,
                             label=f"{name} val" if i == 0 else None)
        # validation loss minus fp32 of the same seed, averaged over seeds
        diffs: dict[int, list[float]] = {}
        for r in mine:
            ref = fp32.get(r["seed"], {})
            for step, v in _val_curve(r).items():
                if step in ref:
                    diffs.setdefault(step, []).append(v - ref[step])
        if diffs:
            xs = sorted(diffs)
            ax_dval.plot(xs, [sum(diffs[x]) / len(diffs[x]) for x in xs], marker="o", ms=3,
                         color=colors[name], lw=1.3, label=name)
            if len(mine) > 1:
                lo = [min(diffs[x]) for x in xs]
                hi = [max(diffs[x]) for x in xs]
                ax_dval.fill_between(xs, lo, hi, color=colors[name], alpha=0.12)
    ax_loss.set(title="train (moving average) and validation loss", xlabel="step",
                ylabel="loss")
    ax_loss.legend(fontsize=7, ncol=2)
    ax_dval.axhline(0, color="k", lw=0.8)
    ax_dval.set(title="validation loss − fp32 (same seed; mean, band: min–max over seeds)",
                xlabel="step", ylabel="Δ val loss")
    if ax_dval.get_lines():
        ax_dval.legend(fontsize=8)
    # the answer: gap to fp32 against bytes on the wire
    for n, m in methods.items():
        if m["val_gap_to_fp32"] is None:
            continue
        ax_gap.errorbar(m["bytes_per_element"], m["val_gap_to_fp32"],
                        yerr=m["val_gap_to_fp32_std"] or 0, fmt="o", ms=7, capsize=4,
                        color=colors[n], label=n)
    ax_gap.axhline(0, color="k", lw=0.8)
    ax_gap.set(title="final validation loss − fp32 (same seed; ± seed std)",
               xlabel="bytes per gradient element on the wire (lower-left is better)",
               ylabel="Δ val loss")
    if methods:
        ax_gap.legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _short(name: str) -> str:
    name = name.removesuffix(".weight").replace("model.layers.", "L")
    for long, short in (("self_attn.", ""), ("mlp.", ""), ("_proj", ""),
                        ("model.embed_tokens", "embed"), ("input_layernorm", "ln1"),
                        ("post_attention_layernorm", "ln2"), ("model.norm", "norm")):
        name = name.replace(long, short)
    return name


def plot_fidelity(runs: list[dict], path: Path) -> None:
    """Left: communicated RelL2 over training of the lossy methods (RelL2 > 1e-2), the
    others' means in the legend. Right: per-layer RelL2 relative to fp8-ef (when it ran),
    so what a transform does to each layer shows at a glance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(r["method"] for r in runs))
    colors = _colors(methods)
    fig, (ax_t, ax_l) = plt.subplots(1, 2, figsize=(18, 5.5),
                                     gridspec_kw={"width_ratios": [1, 2]})
    per_layer: dict[str, dict[str, float]] = {}
    overall: dict[str, float] = {}
    for name in methods:
        mine = [r for r in runs if r["method"] == name]
        values: dict[str, list[float]] = {}
        totals = []
        for r in mine:
            for x in r["records"]:
                if "rel_l2" in x:
                    totals.append(x["rel_l2"])
                for layer, f in x.get("fidelity", {}).items():
                    values.setdefault(layer, []).append(f["rel_l2"])
        if totals:
            overall[name] = sum(totals) / len(totals)
            per_layer[name] = {k: sum(v) / len(v) for k, v in values.items()
                               if "norm" not in k}  # matrices: the readable part
    lossy = [n for n in overall if overall[n] > 1e-2]
    for name in methods:
        for i, r in enumerate(r for r in runs if r["method"] == name):
            pts = [(x["step"] + 1, x["rel_l2"]) for x in r["records"] if "rel_l2" in x]
            if pts and name in lossy:
                ax_t.plot(*zip(*pts), color=colors[name], lw=1.2, alpha=0.85,
                          label=f"{name} (mean {overall[name]:.4f})" if i == 0 else None)
    if not overall:
        ax_t.text(0.5, 0.5, "no shadow steps (run with --shadow-every M)",
                  ha="center", transform=ax_t.transAxes)
    others = [f"{n}: {overall[n]:.1e}" for n in overall if n not in lossy]
    ax_t.set(title="communicated gradient RelL2 vs exact FP32 mean (all parameters)"
             + (f"\nnot drawn (mean): {', '.join(others)}" if others else ""),
             xlabel="step", ylabel="‖Ĝ − Ḡ‖ / ‖Ḡ‖")
    if lossy:
        ax_t.legend(fontsize=8)
    ref = per_layer.get("fp8-ef")
    layers = list(ref) if ref else list(next(iter(per_layer.values()), {}))
    for name in lossy:
        if name == "fp8-ef" or not layers:
            continue
        ys = [per_layer[name][k] / ref[k] if ref else per_layer[name][k] for k in layers]
        ax_l.plot(range(len(layers)), ys, marker="o", ms=3, lw=1, color=colors[name],
                  label=f"{name}")
    if layers:
        ax_l.set_xticks(range(len(layers)), [_short(k) for k in layers], rotation=90,
                        fontsize=7)
    if ref:
        ax_l.axhline(1, color=colors["fp8-ef"], lw=1.5, label="fp8-ef")
        ax_l.set(title="per-layer RelL2 / fp8-ef's (mean over shadow steps and seeds; "
                 "< 1: closer to the exact mean)",
                 ylabel="RelL2 / RelL2(fp8-ef)")
    else:
        ax_l.set(title="per-layer RelL2 (mean over shadow steps and seeds)", ylabel="RelL2")
    if ax_l.get_lines():
        ax_l.legend(fontsize=8)
    for ax in (ax_t, ax_l):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
