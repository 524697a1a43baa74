"""Whole-step comparison of DDP communication hooks on real gloo processes.

Every method trains the same Llama from the same initialisation on the same batches:
``warmup`` untimed steps (so refreshes and selections have happened), ``steps`` timed
steps, then ``shadow_steps`` steps in which :mod:`geofp8.shadow` also all-reduces the
same gradients in FP32 to measure the communicated gradient's RelL2 and cosine per layer.

Bytes are *counted*: during the timed steps the ``torch.distributed`` collectives are
wrapped and every tensor handed to them is charged with what its standard algorithm
sends from this rank (all-reduce ``2(N−1)/N·size``, all-gather and broadcast ``(N−1)·size``,
all-to-all the splits meant for others). DDP's built-in all-reduce (no hook) is not
visible to Python; its bytes are the FP32 ring figure of the gradient size.
"""

import contextlib
import json
import os
import re
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .collectives import fp32_allreduce_wire_bytes

DEFAULT_METHODS = ("fp32", "bf16", "powersgd4", "powersgd8", "torch-int8", "fp8", "fp8-ef",
                   "hadamard", "geofp8-profile", "geofp8-auto", "geofp8-fresh-auto",
                   "geofp8-local-all")


CALLBACK_ISSUING = ("powersgd4", "powersgd8", "torch-int8")


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
    """``(state, hook)`` for ``method``; ``(None, None)`` means DDP's built-in all-reduce."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.distributed.algorithms.ddp_comm_hooks import quantization_hooks as qh

    from . import hook as g
    from .config import FP8Config, GeoFP8Config

    if method == "fp32":
        return None, None
    if method == "bf16":
        return None, default_hooks.bf16_compress_hook
    if method.startswith("powersgd"):
        rank = int(method.removeprefix("powersgd"))
        state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=rank,
                                            start_powerSGD_iter=2, use_error_feedback=True)
        return state, powerSGD_hook.powerSGD_hook
    if method == "torch-int8":
        return None, qh.quantization_pertensor_hook
    if method == "fp8":
        return g.FP8State(model, FP8Config()), g.fp8_hook
    if method == "fp8-ef":
        return g.FP8State(model, FP8Config(error_feedback=True)), g.fp8_hook
    if method == "hadamard":
        return g.HadamardFP8State(model, FP8Config(error_feedback=True)), g.hadamard_fp8_hook
    geometry = {  # method -> (layers, factor_source)
        "geofp8-profile": ("profile", "refresh"), "geofp8-auto": ("auto", "refresh"),
        "geofp8-refresh-all": ("all", "refresh"), "geofp8-fresh-all": ("all", "fresh"),
        "geofp8-fresh-auto": ("auto", "fresh"), "geofp8-local-all": ("all", "local"),
    }
    if method in geometry:
        layers, source = geometry[method]
        config = GeoFP8Config(layers=layers, factor_source=source, error_feedback=True,
                              refresh_every=cfg.refresh_every, profile_steps=cfg.profile_steps)
        return g.GeoFP8State(model, config), g.geofp8_hook
    raise ValueError(f"unknown method {method!r}; expected one of {DEFAULT_METHODS} or "
                     f"{sorted(geometry)}")


class _ByteCounter:
    """Charges every collective issued through ``torch.distributed`` with its wire bytes."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.n, self.bytes = rank, world_size, 0

    @staticmethod
    def _size(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def charges(self) -> dict[str, Callable[..., int]]:
        n = self.n
        return {
            "all_reduce": lambda t, *a, **k: 2 * (n - 1) * self._size(t) // n,
            "all_gather": lambda out, t, *a, **k: (n - 1) * self._size(t),
            "broadcast": lambda t, src, *a, **k: (n - 1) * self._size(t) if src == self.rank
            else 0,
            "all_to_all_single": lambda out, t, out_splits=None, in_splits=None, *a, **k:
                self._size(t) - (self._size(t) // n if in_splits is None else
                                 in_splits[self.rank] * t.element_size()),
        }

    @contextlib.contextmanager
    def counting(self):
        originals = {name: getattr(dist, name) for name in self.charges()}

        def wrap(name, fn, charge):
            def counted(*args, **kwargs):
                if name == "all_to_all_single":
                    self.bytes += charge(*args[:2], kwargs.get("output_split_sizes"),
                                         kwargs.get("input_split_sizes"))
                else:
                    self.bytes += charge(*args, **kwargs)
                return fn(*args, **kwargs)
            return counted

        for name, charge in self.charges().items():
            setattr(dist, name, wrap(name, originals[name], charge))
        try:
            yield self
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)


def _run_method(method: str, cfg: DDPBenchConfig, data, rank: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .data import get_batch
    from .models import load_model
    from .shadow import ShadowState, shadow_fidelity, shadow_hook

    model, _ = load_model(cfg.model, data.vocab_size, seed=cfg.seed)
    model.train()
    # PyTorch's PowerSGD and int8 hooks issue collectives from completion callbacks; with
    # several buckets in flight those reach the ranks in different orders (on gloo with 4
    # ranks: "collective mismatch" abort). One bucket keeps them correct.
    ddp = DDP(model, bucket_cap_mb=1024 if method in CALLBACK_ISSUING else None)
    state, hook = _make_hook(method, model, cfg)
    shadow = None
    if hook is not None:
        shadow = ShadowState(state, hook)
        ddp.register_comm_hook(shadow, shadow_hook)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    numel = sum(p.numel() for p in model.parameters())
    counter = _ByteCounter(rank, cfg.world_size)

    def step(i: int) -> float:
        x, y = get_batch(data.train, i, cfg.batch_size, rank, cfg.world_size, cfg.seed)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        ddp(input_ids=x, labels=y).loss.backward()
        opt.step()
        return time.perf_counter() - t0

    for i in range(cfg.warmup):
        step(i)
    times, factor_bytes = [], 0
    with counter.counting():
        for i in range(cfg.warmup, cfg.warmup + cfg.steps):
            dist.barrier()
            times.append(step(i))
            if hasattr(state, "stats"):
                factor_bytes += state.stats()["factor_bytes_sent"]
    bytes_per_step = counter.bytes / cfg.steps
    if hook is None:  # DDP's C++ all-reduce is invisible to the counter
        bytes_per_step = fp32_allreduce_wire_bytes(numel, cfg.world_size)
    fidelity: dict[str, dict[str, float]] = {}
    if shadow is not None:  # mean over the shadow steps of each parameter's RelL2 and cosine
        for i in range(cfg.warmup + cfg.steps, cfg.warmup + cfg.steps + cfg.shadow_steps):
            shadow.capture = True
            step(i)
            shadow.capture = False
            for name, m in shadow_fidelity(model, shadow)[0].items():
                acc = fidelity.setdefault(name, {"rel_l2": 0.0, "cos": 0.0})
                for key in acc:
                    acc[key] += m[key] / cfg.shadow_steps
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    stats = state.stats() if hasattr(state, "stats") else {}
    return {
        "method": method,
        "step_s": float(slowest),
        "bytes_per_step": bytes_per_step,
        "bytes_per_element": bytes_per_step / numel,
        "fp32_bytes_per_step": fp32_allreduce_wire_bytes(numel, cfg.world_size),
        "fidelity": fidelity,
        "geometry_layers": stats.get("geometry_layers", []),
        "factor_bytes_per_step": factor_bytes / cfg.steps,
        "codec_s": stats.get("codec_s"),
        "transform_s": stats.get("transform_s"),
    }


def _worker(rank: int, cfg: DDPBenchConfig, port: int, out_path: str) -> None:
    import datetime

    from .data import load_token_data

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=cfg.world_size,
                            timeout=datetime.timedelta(seconds=cfg.timeout_s))
    try:
        data = load_token_data(seq_len=cfg.seq_len)
        rows = []
        for method in cfg.methods:
            try:
                rows.append(_run_method(method, cfg, data, rank))
            except RuntimeError as exc:  # a peer's hook that fails fails on every rank alike
                rows.append({"method": method, "error": _innermost_error(str(exc))})
                dist.barrier()
            if rank == 0:
                done = rows[-1]
                shown = (f"{done['step_s'] * 1e3:8.1f} ms/step" if "error" not in done
                         else f"failed: {done['error']}")
                print(f"  ddp: {method:>15}: {shown}", flush=True)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(rows, f)
        dist.barrier()  # every rank done with every collective before any tears down
    finally:
        dist.destroy_process_group()


def _innermost_error(text: str) -> str:
    """The last ``SomethingError: message`` of a chained callback error (no file paths)."""
    found = re.findall(r"(\w+(?:Error|Exception): [^\n]*)", text)
    return (found[-1] if found else text.strip().splitlines()[0])[:200]


def run_ddp_bench(cfg: DDPBenchConfig) -> list[dict]:
    """Spawn ``cfg.world_size`` gloo processes on this machine and return one row per method."""
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
    base = next((r["step_s"] for r in rows if r["method"] == "fp32"), None)
    lines = [f"Whole step, {cfg.world_size} gloo ranks, {cfg.model}, "
             f"{cfg.batch_size}×{cfg.seq_len} tokens per rank, median of {cfg.steps} steps "
             f"(the slowest rank's); bytes counted from the collectives; "
             f"{', '.join(CALLBACK_ISSUING)} run with a single DDP bucket (they issue "
             "collectives from completion callbacks, which is only safe with one bucket)",
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
        ratio = f"{r['step_s'] / base:.3f}" if base else "–"
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
