"""Whole-step comparison of DDP communication hooks on real gloo processes.

Every method trains the same Llama from the same initialisation on the same batches:
``warmup`` untimed steps (so refreshes and selections have happened), ``steps`` timed
steps, then ``shadow_steps`` steps in which :mod:`geofp8.tools.shadow` also all-reduces the
same gradients in FP32 to measure the communicated gradient's RelL2 and cosine per layer.

The methods train side by side, one step of each in turn (the order reversed every step),
so that step ``i`` of every method is timed within moments of fp32's step ``i``: a method's
ratio to fp32 is the median over steps of those paired ratios. Run one after the other, a
shared machine's drift over a minute (10–30 % here) swamps the few percent being measured.
Every method's model, optimizer and hook state are held at once.

Bytes are *counted*: during the timed steps the ``torch.distributed`` collectives are
wrapped and every tensor handed to them is charged with what its standard algorithm
sends from this rank (all-reduce ``2(N−1)/N·size``, all-gather and broadcast ``(N−1)·size``,
all-to-all the splits meant for others). DDP's built-in all-reduce (no hook) is not
visible to Python; its bytes are the FP32 ring figure of the gradient size.
"""

import json
import os
import re
import socket
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..comm import fp32_allreduce_wire_bytes
from ..methods import METHODS
from .wire import ByteCounter

DEFAULT_METHODS = ("fp32", "bf16", "powersgd", "powersgd8", "fp8", "fp8-ef",
                   "hadamard", "geofp8", "geofp8-auto", "geofp8-fresh", "geofp8-local")


@dataclass
class DDPBenchConfig:
    world_size: int = 2
    model: str = "llama-tiny"
    seq_len: int = 64
    batch_size: int = 4
    warmup: int = 11  # past the first refresh and the profile window
    steps: int = 10  # one full refresh period, so factor traffic is amortised honestly
    shadow_steps: int = 2
    refresh_every: int = 10
    profile_steps: int = 5
    methods: tuple[str, ...] = DEFAULT_METHODS
    seed: int = 0
    timeout_s: float = 600.0


def _make_hook(method: str, model, cfg: DDPBenchConfig):
    """``(state, hook)`` of ``method`` (a :data:`METHODS` name); ``(None, None)`` for fp32,
    which times DDP's built-in all-reduce."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {list(METHODS)}")
    spec = METHODS[method]
    if spec.kind == "allreduce":
        return None, None
    state, hook, _ = spec.build(model, **spec.takes(refresh_every=cfg.refresh_every,
                                                    profile_steps=cfg.profile_steps,
                                                    seed=cfg.seed))
    return state, hook


@dataclass
class _Trainee:
    """One method's model, DDP wrapper, hook and optimizer on this rank, and what its timed
    steps measured (``error``: why it stopped, the same on every rank)."""

    method: str
    model: torch.nn.Module
    ddp: torch.nn.Module
    state: object
    shadow: object
    opt: torch.optim.Optimizer
    counter: ByteCounter
    times: list[float] = field(default_factory=list)
    factor_bytes: int = 0
    error: str | None = None


def _trainee(method: str, cfg: DDPBenchConfig, vocab_size: int, rank: int) -> _Trainee:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .models import load_model
    from .shadow import ShadowState, shadow_hook

    model, _ = load_model(cfg.model, vocab_size, seed=cfg.seed)
    model.train()
    ddp = DDP(model, bucket_cap_mb=1024 if METHODS[method].one_bucket else None)
    state, hook = _make_hook(method, model, cfg)
    shadow = None
    if hook is not None:
        shadow = ShadowState(state, hook)
        ddp.register_comm_hook(shadow, shadow_hook)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return _Trainee(method, model, ddp, state, shadow, opt, ByteCounter(rank, cfg.world_size))


def _step(t: _Trainee, cfg: DDPBenchConfig, data, i: int, rank: int) -> float:
    """Step ``i`` of ``t`` on batch ``i`` (every method sees the same batches); seconds."""
    from .data import get_batch

    x, y = get_batch(data.train, i, cfg.batch_size, rank, cfg.world_size, cfg.seed)
    t0 = time.perf_counter()
    t.opt.zero_grad(set_to_none=True)
    t.ddp(input_ids=x, labels=y).loss.backward()
    t.opt.step()
    return time.perf_counter() - t0


def _train_interleaved(trainees: list[_Trainee], cfg: DDPBenchConfig, data, rank: int) -> None:
    """``warmup`` then ``steps`` timed steps of every method, one step of each in turn, the
    order reversed every step; a timed step starts at a barrier and counts its bytes."""
    for i in range(cfg.warmup + cfg.steps):
        for t in trainees if i % 2 == 0 else trainees[::-1]:
            if t.error is not None:
                continue
            try:
                if i < cfg.warmup:
                    _step(t, cfg, data, i, rank)
                    continue
                dist.barrier()
                with t.counter.counting():
                    t.times.append(_step(t, cfg, data, i, rank))
                if hasattr(t.state, "stats"):
                    t.factor_bytes += t.state.stats()["factor_bytes_sent"]
            except RuntimeError as exc:  # a peer's hook that fails fails on every rank alike
                t.error = _innermost_error(str(exc))
                dist.barrier()


def _row(t: _Trainee, cfg: DDPBenchConfig, data, rank: int) -> dict:
    """``t``'s figures: the slowest rank's time of each timed step, bytes, and the fidelity
    of ``shadow_steps`` further steps against an FP32 all-reduce of the same gradients."""
    from .shadow import shadow_fidelity

    if t.error is not None:
        return {"method": t.method, "error": t.error}
    numel = sum(p.numel() for p in t.model.parameters())
    bytes_per_step = t.counter.bytes / cfg.steps
    if t.shadow is None:  # DDP's C++ all-reduce is invisible to the counter
        bytes_per_step = fp32_allreduce_wire_bytes(numel, cfg.world_size)
    fidelity: dict[str, dict[str, float]] = {}
    if t.shadow is not None:  # mean over the shadow steps of each parameter's RelL2 and cosine
        for i in range(cfg.warmup + cfg.steps, cfg.warmup + cfg.steps + cfg.shadow_steps):
            t.shadow.capture = True
            _step(t, cfg, data, i, rank)
            t.shadow.capture = False
            for name, m in shadow_fidelity(t.model, t.shadow)[0].items():
                acc = fidelity.setdefault(name, {"rel_l2": 0.0, "cos": 0.0})
                for key in acc:
                    acc[key] += m[key] / cfg.shadow_steps
    slowest = torch.tensor(t.times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    stats = t.state.stats() if hasattr(t.state, "stats") else {}
    return {
        "method": t.method,
        "step_s": statistics.median(slowest.tolist()),
        "step_times_s": slowest.tolist(),
        "bytes_per_step": bytes_per_step,
        "bytes_per_element": bytes_per_step / numel,
        "fp32_bytes_per_step": fp32_allreduce_wire_bytes(numel, cfg.world_size),
        "fidelity": fidelity,
        "geometry_layers": stats.get("geometry_layers", []),
        "factor_bytes_per_step": t.factor_bytes / cfg.steps,
        "codec_s": stats.get("codec_s"),
        "transform_s": stats.get("transform_s"),
    }


def _against_fp32(rows: list[dict]) -> None:
    """Adds ``vs_fp32`` to every row: the median and quartiles over the timed steps of the
    step's time over fp32's step of the same index (taken moments apart)."""
    base = next((r["step_times_s"] for r in rows if r["method"] == "fp32" and "error" not in r),
                None)
    for r in rows:
        if base is not None and "error" not in r:
            ratios = [s / b for s, b in zip(r["step_times_s"], base)]
            q1, mid, q3 = (statistics.quantiles(ratios, n=4, method="inclusive")
                           if len(ratios) > 1 else ratios * 3)
            r["vs_fp32"] = [mid, q1, q3]


def _worker(rank: int, cfg: DDPBenchConfig, port: int, out_path: str) -> None:
    import datetime

    from .data import load_token_data
    from .train.launch import end_process_group

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=cfg.world_size,
                            timeout=datetime.timedelta(seconds=cfg.timeout_s))
    completed = False
    try:
        data = load_token_data(seq_len=cfg.seq_len)
        trainees = [_trainee(m, cfg, data.vocab_size, rank) for m in cfg.methods]
        if rank == 0:
            print(f"  ddp: {len(trainees)} methods side by side, {cfg.warmup} warm-up and "
                  f"{cfg.steps} timed steps each", flush=True)
        _train_interleaved(trainees, cfg, data, rank)
        rows = []
        for t in trainees:
            rows.append(_row(t, cfg, data, rank))
            if rank == 0:
                done = rows[-1]
                shown = (f"{done['step_s'] * 1e3:8.1f} ms/step" if "error" not in done
                         else f"failed: {done['error']}")
                print(f"  ddp: {t.method:>15}: {shown}", flush=True)
        _against_fp32(rows)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(rows, f)
        completed = True
    finally:
        end_process_group(completed)


def _innermost_error(text: str) -> str:
    """The last ``SomethingError: message`` of a chained callback error (no file paths)."""
    found = re.findall(r"(\w+(?:Error|Exception): [^\n]*)", text)
    return (found[-1] if found else text.strip().splitlines()[0])[:200]


def run_ddp_bench(cfg: DDPBenchConfig) -> list[dict]:
    """Spawn ``cfg.world_size`` gloo processes on this machine and return one row per method."""
    if cfg.steps < 1:
        raise ValueError(f"steps must be at least 1, got {cfg.steps}")
    from .data import load_token_data

    load_token_data(seq_len=cfg.seq_len)  # train/cache the tokenizer once, before the ranks
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rows.json")
        mp.start_processes(_worker, args=(cfg, port, out_path), nprocs=cfg.world_size,
                           start_method="spawn", join=True)
        with open(out_path) as f:
            return json.load(f)


def _by_type(fidelity: dict[str, dict[str, float]]) -> dict[str, float]:
    """Mean RelL2 of the 2-D Linear weights per layer type (``…mlp.down_proj.weight`` → down)."""
    groups: dict[str, list[float]] = {}
    for name, m in fidelity.items():
        if not name.endswith("proj.weight") and not name.startswith("lm_head"):
            continue
        kind = name.removesuffix(".weight").rsplit(".", 1)[-1].removesuffix("_proj")
        groups.setdefault(kind, []).append(m["rel_l2"])
    return {k: sum(v) / len(v) for k, v in sorted(groups.items())}


def format_rows(rows: list[dict], cfg: DDPBenchConfig) -> str:
    """Two Markdown tables: time / bytes / mean fidelity, and RelL2 per layer type."""
    one_bucket = ", ".join(m for m in cfg.methods if METHODS[m].one_bucket)
    lines = [f"Whole step, {cfg.world_size} gloo ranks, {cfg.model}, "
             f"{cfg.batch_size}×{cfg.seq_len} tokens per rank, median of {cfg.steps} steps "
             f"(the slowest rank's), the methods stepping in turn; vs fp32: the median "
             "(quartiles) over steps of the step's time over fp32's same step; "
             "bytes counted from the collectives"
             + (f"; {one_bucket} run with a single DDP bucket (they issue collectives from "
                "completion callbacks, which is only safe with one bucket)" if one_bucket
                else ""),
             "",
             "| method | ms/step | vs fp32 | bytes/step | bytes/elem | of which factors "
             "| RelL2 (2-D mean) | cos |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    failed = [r for r in rows if "error" in r]
    rows = [r for r in rows if "error" not in r]
    for r in rows:
        fid = [m for n, m in r["fidelity"].items() if n.endswith("weight")]
        rel = sum(m["rel_l2"] for m in fid) / len(fid) if fid else 0.0
        cos = sum(m["cos"] for m in fid) / len(fid) if fid else 1.0
        ratio = "–"
        if "vs_fp32" in r:
            ratio = "{:.3f} ({:.3f}–{:.3f})".format(*r["vs_fp32"])
        lines.append(f"| {r['method']} | {r['step_s'] * 1e3:.1f} | {ratio} | "
                     f"{r['bytes_per_step']:.3e} | {r['bytes_per_element']:.3f} | "
                     f"{r['factor_bytes_per_step'] / r['bytes_per_step']:.1%} | "
                     f"{rel:.2e} | {cos:.5f} |")
    types = sorted({k for r in rows for k in _by_type(r["fidelity"])})
    lines += ["", "RelL2 of the communicated average vs the FP32 all-reduce, per layer type:", "",
              "| method | " + " | ".join(types) + " | geometry layers |",
              "|---|" + "---:|" * len(types) + "---|"]
    for r in rows:
        if not r["fidelity"]:
            continue
        per = _by_type(r["fidelity"])
        cells = " | ".join(f"{per[t]:.2e}" if t in per else "–" for t in types)
        picked = ", ".join(n.removesuffix(".weight") for n in r["geometry_layers"]) or "–"
        lines.append(f"| {r['method']} | {cells} | {picked} |")
    lines += [f"\n{r['method']} failed: {r['error']}" for r in failed]
    return "\n".join(lines)


def to_json(rows: list[dict], cfg: DDPBenchConfig) -> dict:
    return {"config": asdict(cfg), "rows": rows}
