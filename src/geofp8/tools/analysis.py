"""One-step round-trip fidelity of every Linear layer's weight gradient (``geofp8 fidelity``).

For a batch of ``B`` sequences split into ``R`` micro-batches ("ranks"), every Linear
layer has per-rank weight gradients ``G_r = Σ_t δ_t x_tᵀ`` (one backward per micro-batch,
loss = mean token cross-entropy) and the FP32 average ``G = (1/R) Σ_r G_r``. A method is a
transform ``T`` and a codec ``Q``; it produces

    ``Ĝ = T⁻¹( AllReduce_Q({G_r T}) / R )``

where the all-reduce is :func:`geofp8.comm.simulate_exact_allreduce` (each rank
quantizes its own shards, FP32 sums, re-quantized result); with ``R = 1`` it is a single
round trip ``T⁻¹(Q(G T))``. Metrics against ``G``: ``rel_l2 = ‖Ĝ−G‖/‖G‖``, ``cos``,
``max_err = max|Ĝ−G|`` and ``mse = mean (Ĝ−G)²``.

Every rank uses the same factors: ``A = E[x xᵀ]`` (and ``S = E[δ δᵀ]`` for ``output`` /
``kfac``) over all ranks' tokens, as after a reduction of statistics. ``same`` builds them
from the batch whose gradient is measured (the paper's analysis); ``previous`` from ``P``
other, earlier batches (what a run that refreshes its factors from past steps has).

Transforms (:mod:`geofp8.geometry.transforms`): ``euclidean``, ``diag``, ``block<b>``, ``full``,
``lowrank<k>``, ``output``, ``kfac``, ``hadamard``, ``rht<b>`` (random Hadamard over
``b``-column blocks); ``block`` and ``lowrank`` expand over the block-size and k lists,
``rht`` over the scale blocks of the block formats measured (16 for NVFP4, 32 for MX).
Formats: every name of :data:`geofp8.codecs.FORMATS` (``e4m3``, ``e5m2``, ``nvfp4``,
``mxfp4``, ``mxfp8``); ``scalings`` apply to the FP8 formats only. Method keys are
``transform/format/scaling[/d<damping>]``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics as stats
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ..codecs import FORMATS, SCALINGS, Codec, FP8Codec, make_codec
from ..comm import ShardLayout, simulate_exact_allreduce
from ..geometry.factory import make_transform
from ..geometry.statistics import LowRankFactor, SecondMoment
from ..geometry.transforms import Transform
from .data import get_batch
from .errors import UsageError
from .flags import at_least, choice_list, comma_list, text_file
from .models import check_model_spec
from .needs import require

__all__ = [
    "FidelityConfig",
    "LayerData",
    "add_arguments",
    "averaged_round_trip",
    "collect",
    "expand_transforms",
    "fidelity",
    "format_report",
    "layer_type",
    "layer_transforms",
    "method_table",
    "metrics",
    "run",
    "run_fidelity",
]

FAMILIES = ("euclidean", "diag", "block", "full", "lowrank", "output", "kfac", "hadamard",
            "rht")
FP8_FORMATS = ("e4m3", "e5m2")
DAMPED = {"diag", "block", "full", "lowrank", "output", "kfac"}
NEEDS_S = {"output", "kfac"}


@dataclass
class FidelityConfig:
    """What ``geofp8 fidelity`` measures; the defaults run in seconds on a CPU."""

    model: str = "llama-tiny"
    data: list[str] = field(default_factory=list)
    seq_len: int = 128
    batch_size: int = 8
    ranks: int = 1
    factor_source: str = "same"
    previous_batches: int = 4
    formats: list[str] = field(default_factory=lambda: ["e4m3", "e5m2"])
    scalings: list[str] = field(default_factory=lambda: ["tensor"])
    block_size: int = 128
    transforms: list[str] = field(
        default_factory=lambda: ["euclidean", "diag", "block", "full", "lowrank", "hadamard"])
    ks: list[int] = field(default_factory=lambda: [8, 16, 32])
    a_blocks: list[int] = field(default_factory=lambda: [64])
    dampings: list[float] = field(default_factory=lambda: [0.1])
    vocab_size: int = 2048
    seed: int = 0

    def __post_init__(self) -> None:
        if self.factor_source not in ("same", "previous"):
            raise ValueError(f"factor_source must be 'same' or 'previous', "
                             f"got {self.factor_source!r}")
        if self.ranks < 1 or self.batch_size % self.ranks:
            raise UsageError(f"--batch-size {self.batch_size} must be a positive multiple of "
                             f"--ranks {self.ranks}")
        unknown = [f for f in self.formats if f not in FORMATS]
        if unknown:
            raise ValueError(f"unknown format(s) {unknown}; expected some of {list(FORMATS)}")
        expand_transforms(self.transforms, self.ks, self.a_blocks, self.rht_blocks())

    def codecs(self) -> list[Codec]:
        """Every FP8 format at every scaling, and every block format once."""
        return [make_codec(f, s, self.block_size) for f in self.formats
                for s in (self.scalings if f in FP8_FORMATS else self.scalings[:1])]

    def rht_blocks(self) -> list[int]:
        """The scale blocks of the block formats measured (``rht`` expands over them; 16 if
        only FP8 formats are measured)."""
        blocks = sorted({c.block_size for c in self.codecs() if not isinstance(c, FP8Codec)})
        return blocks or [16]


def expand_transforms(names: Iterable[str], ks: Iterable[int], a_blocks: Iterable[int],
                      rht_blocks: Iterable[int] = (16,)) -> list[str]:
    """``lowrank`` → ``lowrank<k>`` for every k, ``block`` → ``block<b>``, ``rht`` →
    ``rht<b>``; explicit ``lowrank16`` / ``block32`` / ``rht32`` are kept. Order is
    preserved, duplicates dropped."""
    out: list[str] = []
    for name in names:
        if name == "lowrank":
            out += [f"lowrank{k}" for k in ks]
        elif name == "block":
            out += [f"block{b}" for b in a_blocks]
        elif name == "rht":
            out += [f"rht{b}" for b in rht_blocks]
        elif _family(name) in FAMILIES:
            out.append(name)
        else:
            raise ValueError(f"unknown transform {name!r}; expected one of {FAMILIES} "
                             "(lowrank, block and rht optionally with a size, e.g. lowrank16)")
    return list(dict.fromkeys(out))


def _family(name: str) -> str:
    m = re.fullmatch(r"(lowrank|block|rht)(\d+)", name)
    return m.group(1) if m else name


def layer_type(name: str) -> str:
    """``model.layers.3.mlp.down_proj`` → ``down``; ``lm_head`` → ``lm_head``."""
    return name.rsplit(".", 1)[-1].removesuffix("_proj")


def scaling_label(codec: Codec) -> str:
    if not isinstance(codec, FP8Codec):
        return f"block{codec.block_size}"
    return f"block{codec.block_size}" if codec.scaling == "block" else codec.scaling


# -- gradients and statistics ---------------------------------------------------------------

@dataclass
class LayerData:
    """Per-batch weight gradients of every Linear layer and its factors over all batches."""

    grads: dict[str, list[torch.Tensor]]  # name -> [G_b], d_out × d_in, float32
    A: dict[str, SecondMoment]  # input side, float64
    S: dict[str, SecondMoment]  # output side (empty unless asked for)


def collect(model: torch.nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
            output_side: bool = False, keep_grads: bool = True) -> LayerData:
    """One forward and backward per ``(inputs, targets)`` batch with hooks on every Linear.

    ``G_b = Σ_t δ_t x_tᵀ`` is the weight gradient of the batch's mean cross-entropy (the
    layer's own contribution, also when weights are tied); ``A`` sums ``x xᵀ`` and ``S``
    sums ``δ δᵀ`` over the tokens of all batches. Parameter ``.grad`` is left empty.
    """
    layers = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    A = {n: SecondMoment(m.in_features, dtype=torch.float64) for n, m in layers.items()}
    S = ({n: SecondMoment(m.out_features, dtype=torch.float64) for n, m in layers.items()}
         if output_side else {})
    grads: dict[str, list[torch.Tensor]] = {n: [] for n in layers}
    current: dict[str, torch.Tensor] = {}

    def hook(name: str):
        def forward_hook(_module, inputs, out):
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1])
            A[name].update(x)

            def backward_hook(grad: torch.Tensor) -> None:
                delta = grad.detach().reshape(-1, grad.shape[-1])
                G = delta.float().T @ x.float()
                current[name] = current[name] + G if name in current else G
                if output_side:
                    S[name].update(delta)

            out.register_hook(backward_hook)
        return forward_hook

    handles = [m.register_forward_hook(hook(n)) for n, m in layers.items()]
    try:
        with torch.enable_grad():
            for inputs, targets in batches:
                current.clear()
                logits = model(input_ids=inputs).logits
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                       targets.reshape(-1))
                loss.backward()
                model.zero_grad(set_to_none=True)
                if keep_grads:
                    for n in layers:
                        grads[n].append(current[n])
    finally:
        for h in handles:
            h.remove()
    return LayerData(grads, A, S)


# -- methods --------------------------------------------------------------------------------

def _top(factor: LowRankFactor, k: int) -> LowRankFactor:
    return LowRankFactor(factor.U[:, :k], factor.eigvals[:k], factor.trace, factor.dim)


def layer_transforms(names: list[str], dampings: list[float], A: torch.Tensor,
                     S: torch.Tensor | None = None) -> dict[str, Transform]:
    """The transforms of one layer, keyed ``name`` or ``name/d<damping>`` (damped ones),
    built by the library's one factory (:func:`geofp8.geometry.factory.make_transform`).

    ``full`` and every ``lowrank<k>`` share one eigendecomposition of ``A``.
    """
    d_in = A.shape[0]
    eig = (LowRankFactor.from_matrix(A, d_in)
           if any(_family(n) in ("full", "lowrank") for n in names) else None)
    out: dict[str, Transform] = {}
    for name in names:
        fam = _family(name)
        if fam in ("euclidean", "hadamard"):
            out[name] = make_transform(fam, 0.0, dim=d_in, A=A)
        elif fam == "rht":
            out[name] = make_transform("rht", 0.0, dim=d_in, A=A, block=int(name[len("rht"):]))
        for d in dampings if fam in DAMPED else []:
            size = int(name[len(fam):]) if name != fam else None
            factor = _top(eig, size) if fam == "lowrank" else eig
            out[f"{name}/d{d:g}"] = make_transform(fam, d, A=A, S=S, factor=factor,
                                                   block=size or 128)
    return out


def method_table(names: list[str], dampings: list[float],
                 codecs: list[Codec]) -> list[tuple[str, str, Codec]]:
    """``(method key, transform key, codec)`` for every method, codec-major; transform keys
    are those of :func:`layer_transforms`."""
    tkeys = [k for n in names
             for k in ([f"{n}/d{d:g}" for d in dampings] if _family(n) in DAMPED else [n])]
    out = []
    for codec in codecs:
        for tkey in tkeys:
            transform, _, damping = tkey.partition("/d")
            key = f"{transform}/{codec.format}/{scaling_label(codec)}"
            out.append((key + (f"/d{damping}" if damping else ""), tkey, codec))
    return out


def _describe(key: str, tkey: str, codec: Codec) -> dict:
    transform, _, damping = tkey.partition("/d")
    return {"key": key, "transform": transform, "format": codec.format,
            "scaling": scaling_label(codec), "damping": float(damping) if damping else None}


def averaged_round_trip(grads: list[torch.Tensor], transform: Transform,
                        codec: Codec) -> torch.Tensor:
    """``Ĝ = T⁻¹(AllReduce_Q({G_r T}) / R)`` through the shared exact-all-reduce model;
    ``R = 1`` is one round trip ``T⁻¹(Q(G T))``. Returns float32."""
    coords = [transform.forward(G) for G in grads]
    R, shape = len(coords), coords[0].shape
    if R == 1:
        mean = codec.round_trip(coords[0])
    else:
        layout = ShardLayout.build([tuple(shape)], codec, R)
        mean = simulate_exact_allreduce(coords, layout).reshape(shape) / R
    return transform.inverse(mean.to(coords[0].dtype)).float()


def metrics(approx: torch.Tensor, exact: torch.Tensor) -> dict[str, float]:
    """``rel_l2``, ``cos``, ``max_err`` and ``mse`` of ``approx`` against ``exact`` (float64)."""
    a, e = approx.double().reshape(-1), exact.double().reshape(-1)
    err = a - e
    norm_e, norm_a, norm_err = float(e.norm()), float(a.norm()), float(err.norm())
    if norm_e:
        rel = norm_err / norm_e
    else:  # an all-zero reference: exact reproduction is error 0
        rel = float("inf") if norm_err else 0.0
    return {
        "rel_l2": rel,
        "cos": float(a @ e) / (norm_a * norm_e) if norm_a and norm_e else float("nan"),
        "max_err": float(err.abs().max()) if err.numel() else 0.0,
        "mse": float(err.pow(2).mean()) if err.numel() else 0.0,
    }


# -- the analysis ---------------------------------------------------------------------------

def _progress(items: list[str]):
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return items
    return tqdm(items, desc="fidelity", unit="layer", file=sys.stderr, disable=None)


def fidelity(model: torch.nn.Module, blocks: torch.Tensor, config: FidelityConfig) -> dict:
    """The report for ``model`` on token ``blocks`` (``n × (seq_len+1)``): the JSON layout
    ``{"config", "layers": {name: {method: metrics}}, "summary": {method: {rel_l2_mean,
    rel_l2_median}}, "by_type": {type: {method: rel_l2 mean}}}``."""
    model.eval()
    B, R, P = config.batch_size, config.ranks, config.previous_batches
    previous = config.factor_source == "previous"
    names = expand_transforms(config.transforms, config.ks, config.a_blocks,
                              config.rht_blocks())
    output_side = any(_family(n) in NEEDS_S for n in names)

    # The measured batch comes after the P factor batches in the data stream.
    step = P if previous else 0
    inputs, targets = get_batch(blocks, step, B, seed=config.seed)
    m = B // R
    micro = [(inputs[r * m:(r + 1) * m], targets[r * m:(r + 1) * m]) for r in range(R)]
    data = collect(model, micro, output_side)
    factors = data
    if previous:
        factors = collect(model, (get_batch(blocks, s, B, seed=config.seed) for s in range(P)),
                          output_side, keep_grads=False)

    methods = method_table(names, config.dampings, config.codecs())
    layers: dict[str, dict[str, dict[str, float]]] = {}
    for name in _progress(list(data.grads)):
        G_r = data.grads[name]
        G = torch.stack(G_r).mean(0)
        S = factors.S[name].mean() if output_side else None
        transforms = layer_transforms(names, config.dampings, factors.A[name].mean(), S)
        layers[name] = {key: metrics(averaged_round_trip(G_r, transforms[tkey], codec), G)
                        for key, tkey, codec in methods}

    keys = [key for key, _, _ in methods]
    rel = {k: [layers[n][k]["rel_l2"] for n in layers] for k in keys}
    summary = {k: {"rel_l2_mean": stats.fmean(v), "rel_l2_median": stats.median(v)}
               for k, v in rel.items()}
    by_type: dict[str, dict[str, float]] = {}
    for t in dict.fromkeys(layer_type(n) for n in layers):
        members = [n for n in layers if layer_type(n) == t]
        by_type[t] = {k: stats.fmean(layers[n][k]["rel_l2"] for n in members) for k in keys}

    tokens = int(inputs.numel())
    cfg = asdict(config) | {
        "transforms_expanded": names, "tokens": tokens,
        "methods": [_describe(key, tkey, codec) for key, tkey, codec in methods],
        "tokens_per_rank": tokens // R,
        "factor_tokens": tokens * P if previous else tokens,
        "data": config.data or ["<pydoc_data.topics>"], "torch": torch.__version__,
    }
    return {"config": cfg, "layers": layers, "summary": summary, "by_type": by_type}


def run_fidelity(config: FidelityConfig) -> dict:
    """Load the model and corpus named by ``config`` and run :func:`fidelity`."""
    from .models import load_model_and_data

    model, data = load_model_and_data(config.model, config.data, config.seq_len,
                                      config.vocab_size, config.seed)
    report = fidelity(model, data.train, config)
    report["config"]["vocab_size_used"] = data.vocab_size
    return report


# -- output ---------------------------------------------------------------------------------

def _table(rows: list[tuple[str, list[float]]], columns: list[str]) -> list[str]:
    first = max(len(label) for label, _ in rows)
    widths = [max(len(c), 9) for c in columns]
    lines = ["  ".join([" " * first] + [c.rjust(w) for c, w in zip(columns, widths)])]
    for label, values in rows:
        cells = [f"{v:.3e}".rjust(w) for v, w in zip(values, widths)]
        lines.append("  ".join([label.ljust(first)] + cells))
    return lines


def format_report(report: dict, table: str = "full") -> str:
    """RelL2 tables: per codec, one table per layer type (a row per layer and a mean row),
    then a summary table (mean per layer type, all-layer mean and median). ``table =
    "summary"`` prints only the summary tables."""
    cfg, layers = report["config"], report["layers"]
    one_damping = len(cfg["dampings"]) == 1
    out = [f"RelL2 of the averaged gradient vs FP32 — model {cfg['model']}, "
           f"{cfg['ranks']} rank(s) × {cfg['tokens_per_rank']} tokens, factor from "
           f"{cfg['factor_source']} batch(es) ({cfg['factor_tokens']} tokens), damping "
           f"{', '.join(f'{d:g}' for d in cfg['dampings'])}"]
    groups: dict[str, list[dict]] = {}
    for meth in cfg["methods"]:
        groups.setdefault(f"{meth['format']} / {meth['scaling']} scaling", []).append(meth)
    types = list(report["by_type"])
    for label, meths in groups.items():
        cols = [m["transform"] if one_damping or m["damping"] is None
                else f"{m['transform']}/d{m['damping']:g}" for m in meths]
        keys = [m["key"] for m in meths]
        if table == "full":
            for t in types:
                members = [n for n in layers if layer_type(n) == t]
                rows = [(n, [layers[n][k]["rel_l2"] for k in keys]) for n in members]
                rows.append((f"mean ({t})", [report["by_type"][t][k] for k in keys]))
                out += ["", f"== {label}: {t} =="] + _table(rows, cols)
        rows = [(f"mean ({t})", [report["by_type"][t][k] for k in keys]) for t in types]
        rows.append(("all layers: mean", [report["summary"][k]["rel_l2_mean"] for k in keys]))
        rows.append(("all layers: median",
                     [report["summary"][k]["rel_l2_median"] for k in keys]))
        out += ["", f"== {label}: summary =="] + _table(rows, cols)
    return "\n".join(out)


# -- command line ---------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = FidelityConfig()
    a = parser.add_argument
    count, counts = at_least(1), comma_list(at_least(1))
    a("--model", default=d.model,
      help="preset (llama-tiny, llama-small, llama-300m, llama-600m), a Hugging Face model "
           "directory or a .gguf file (default: %(default)s)")
    a("--data", nargs="*", default=[], metavar="FILE", type=text_file,
      help="UTF-8 text files (default: the Python language reference from pydoc_data)")
    a("--seq-len", type=count, default=d.seq_len, help="tokens per sequence "
      "(default: %(default)s)")
    a("--batch-size", type=count, default=d.batch_size,
      help="sequences in the measured batch, split evenly over the ranks "
           "(default: %(default)s)")
    a("--ranks", type=count, default=d.ranks,
      help="simulated data-parallel ranks R (default: %(default)s)")
    a("--factor-source", choices=["same", "previous"], default=d.factor_source,
      help="factors from the measured batch, or from earlier batches (default: %(default)s)")
    a("--previous-batches", type=count, default=d.previous_batches,
      help="batches the 'previous' factors are built from (default: %(default)s)")
    a("--formats", type=choice_list(FORMATS), default=d.formats,
      help=f"comma list of {', '.join(FORMATS)} (default: {','.join(d.formats)})")
    a("--scalings", type=choice_list(SCALINGS), default=d.scalings,
      help=f"comma list of {', '.join(SCALINGS)} (default: {','.join(d.scalings)})")
    a("--block-size", type=count, default=d.block_size,
      help="elements per FP8 scale block (the block formats fix their own; "
           "default: %(default)s)")
    a("--transforms", type=choice_list(FAMILIES, accept=lambda n: _family(n) in FAMILIES),
      default=d.transforms, help=f"comma list of {', '.join(FAMILIES)}; lowrank, block and rht "
      f"optionally with a size, e.g. lowrank16 (default: {','.join(d.transforms)})")
    a("--ranks-k", type=counts, default=d.ks,
      help=f"k list of 'lowrank' (default: {','.join(map(str, d.ks))})")
    a("--a-blocks", type=counts, default=d.a_blocks,
      help=f"block sizes of 'block' (default: {','.join(map(str, d.a_blocks))})")
    a("--dampings", type=comma_list(at_least(0, float)), default=d.dampings,
      help=f"relative damping list (default: {','.join(map(str, d.dampings))})")
    a("--vocab-size", type=count, default=d.vocab_size,
      help="BPE vocabulary when trained (default: %(default)s)")
    a("--seed", type=at_least(0), default=d.seed,
      help="model initialisation and data order (default: %(default)s)")
    a("--table", choices=["full", "summary"], default="full",
      help="every layer, or the summary tables only (default: %(default)s)")
    a("--json", type=Path, default=None, metavar="PATH", help="write the report as JSON")


def run(args: argparse.Namespace) -> int:
    check_model_spec(args.model)
    require("geofp8 fidelity", "transformers", "tokenizers")
    config = FidelityConfig(
        model=args.model, data=[str(p) for p in args.data], seq_len=args.seq_len,
        batch_size=args.batch_size, ranks=args.ranks, factor_source=args.factor_source,
        previous_batches=args.previous_batches, formats=args.formats, scalings=args.scalings,
        block_size=args.block_size, transforms=args.transforms, ks=args.ranks_k,
        a_blocks=args.a_blocks, dampings=args.dampings, vocab_size=args.vocab_size,
        seed=args.seed)
    report = run_fidelity(config)
    print(format_report(report, args.table))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return 0
