"""The reference data-parallel pretraining loop, readable top to bottom.

Run by every rank (``torchrun``, or ``geofp8 train --nproc N`` which launches it):

1. process group (gloo on CPU, NCCL on GPU) with a collective timeout;
2. corpus → BPE tokens → train / validation blocks; the model (a preset or a local HF
   directory), identical on every rank;
3. DDP with the ``--method``'s communication hook (:data:`geofp8.tools.train.config.METHODS`),
   or ``--parallel fsdp|hsdp``: ``fully_shard`` and GeoFP8's FP8 reduce-scatter / replica
   all-reduce (:mod:`geofp8.tools.train.parallel`);
4. optimizers (:mod:`.optim`): Muon for the hidden 2-D weights and AdamW for embeddings,
   head and norms (or AdamW throughout), Muon's Newton–Schulz in BF16 where the device has
   it natively and FP32 elsewhere; linear warm-up then cosine from ``lr`` to ``lr_min``;
5. the step loop: batch of this step (by index, so a resumed run reads the same data),
   forward, backward (the hook communicates), optional shadow fidelity, clipping,
   optimizer step, JSONL log line, validation every ``eval_every`` steps, checkpoints.

**Shadow fidelity** (``shadow_every = M``): on every M-th step the communication hook
also keeps a copy of this rank's *local* gradient buckets before they are communicated;
after the backward they are all-reduced in FP32 (not counted in ``bytes_sent``) and the
communicated gradient in ``.grad`` is compared to that exact mean per parameter:
``rel_l2 = ‖Ĝ − Ḡ‖/‖Ḡ‖`` and ``cos(Ĝ, Ḡ)``. Measured, not estimated; the cost is one
copy of the gradients and one FP32 all-reduce on those steps, no extra forward/backward.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...comm import fp32_allreduce_wire_bytes
from ...integrations.checkpoint import warn_missing
from ..data import get_batch, load_token_data, read_text
from ..models import PRESETS, build_preset, load_model
from ..shadow import shadow_fidelity
from ..wire import ByteCounter
from . import checkpoint as ckpt
from .config import METHODS, TrainConfig
from .launch import end_process_group
from .optim import build_optimizers, optimizer_info
from .parallel import wrap

__all__ = ["train"]


def train(cfg: TrainConfig) -> dict | None:
    """Train one run on this rank; rank 0 writes ``<out>/log.jsonl`` and returns its last
    record (other ranks return ``None``)."""
    # -- 1. process group -------------------------------------------------------------------
    owns_group = not dist.is_initialized()
    if owns_group:
        _single_process_env()
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // local_world))
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out)
    completed = False
    try:
        result = _train(cfg, rank, world, device, out)
        completed = True
        return result
    finally:
        if owns_group:
            end_process_group(completed)


def _train(cfg: TrainConfig, rank: int, world: int, device: torch.device, out: Path):
    # -- 2. data and model ------------------------------------------------------------------
    model, data = _model_and_data(cfg)
    model.to(device).train()
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)

    # -- resume: DDP's weights before it wraps (it broadcasts rank 0's); fsdp|hsdp after 4. --
    start, shared, mine = 0, None, None
    sharded = cfg.parallel != "ddp"  # fsdp|hsdp: DCP's sharded checkpoint, loaded after 4.
    if cfg.resume and (step := ckpt.latest_step(out)) is not None:
        start = step
        shared, mine = ckpt.load_shared(out, step), ckpt.load_rank(out, rank, step, world)
        if not sharded:
            model.load_state_dict(shared["model"])

    # -- 3. DDP with the method's hook, or FSDP/HSDP with GeoFP8's reduction ------------------
    wrapped = wrap(model, cfg, rank, world, device)
    ddp, state, width = wrapped.module, wrapped.state, wrapped.width
    counter, comm = wrapped.counter, wrapped.shadow

    # -- 4. optimizers and schedule ---------------------------------------------------------
    optimizers = build_optimizers(model, cfg)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: lr_factor(s, cfg))
                  for o in optimizers]
    elapsed = 0.0
    if shared is not None:
        if sharded:
            ckpt.load_sharded(out, start, model, optimizers, state)
        else:
            for o, s in zip(optimizers, shared["optimizers"]):
                o.load_state_dict(s)
            if state is not None and mine["geofp8"] is None:  # written by a stateless method
                warn_missing(str(ckpt.step_dir(out, start)))
            elif state is not None:
                state.load_state_dict(mine["geofp8"])
        for sch, s in zip(schedulers, shared["schedulers"]):
            sch.load_state_dict(s)
        torch.set_rng_state(mine["rng"])
        if device.type == "cuda" and mine.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(mine["cuda_rng"], device)
        elapsed = float(shared["elapsed_s"])

    log = _Log(out / "log.jsonl", start) if rank == 0 else None
    if rank == 0:
        _write_run_info(out, cfg, world, n_params, data, device, optimizers)
    end = min(cfg.steps, cfg.stop_after) if cfg.stop_after is not None else cfg.steps
    bar = _progress(cfg, rank, start)
    tokens_per_step = world * cfg.batch_size * data.seq_len
    last, formats, geometry = None, None, 0

    # -- 5. the step loop -------------------------------------------------------------------
    for step in range(start, end):
        t0 = time.perf_counter()
        x, y = get_batch(data.train, step, cfg.batch_size, rank, world, cfg.seed)
        x, y = x.to(device), y.to(device)
        shadow = cfg.shadow_every > 0 and step % cfg.shadow_every == 0
        if comm is not None:
            comm.capture = shadow
        elif hasattr(state, "fidelity"):
            state.shadow = shadow
        logits = ddp(input_ids=x).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        with counter.counting() if counter is not None else contextlib.nullcontext():
            loss.backward()  # the hook all-reduces the gradients here
        if comm is not None:
            comm.capture = False
        record: dict = {"step": step}
        if shadow:
            measured = shadow_fidelity(model, comm) if comm is not None else \
                state.fidelity() if hasattr(state, "fidelity") else None
            if measured is not None:
                record["fidelity"], record["rel_l2"], record["cos"] = measured
        grad_norm = torch.nn.utils.clip_grad_norm_(
            model.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
        lr = optimizers[0].param_groups[0]["lr"]
        for o in optimizers:
            o.step()
        for s in schedulers:
            s.step()
        for o in optimizers:
            o.zero_grad(set_to_none=True)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        record.update(loss=float(mean_loss) / world, lr=lr, grad_norm=float(grad_norm),
                      **_bytes(state, width, counter, n_params, world))
        if hasattr(state, "stats"):
            stats = state.stats()
            record["geometry_layers"] = len(stats["geometry_layers"])
            if stats.get("geometry_since_step") is not None:
                record["geometry_since_step"] = stats["geometry_since_step"]
            if stats.get("formats") and stats["formats"] != formats:  # a budget's new choice
                formats = record["formats"] = stats["formats"]
                record["budget_planned"] = stats["budget_planned"]
        changed = record.get("geometry_layers", 0) != geometry  # logged and said, always
        geometry = record.get("geometry_layers", 0)
        if changed and rank == 0 and not cfg.quiet:
            (bar.write if bar is not None else print)(
                f"step {step}: geometry on {geometry} layer(s) (first on at step "
                f"{record['geometry_since_step']})" if geometry else
                f"step {step}: geometry off on every layer")
        if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
            t_eval = time.perf_counter()
            record["val_loss"] = evaluate(model, data.val, cfg, rank, world, device)
            record["eval_s"] = time.perf_counter() - t_eval  # inside step_time_s
        dt = time.perf_counter() - t0
        elapsed += dt
        record.update(step_time_s=dt, tokens_per_s=tokens_per_step / dt, elapsed_s=elapsed)
        if log is not None and (step % cfg.log_every == 0 or "val_loss" in record
                                or "formats" in record or changed or step + 1 == end):
            log.write(record)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.3f}",
                            **({"val": f"{record['val_loss']:.3f}"} if "val_loss" in record
                               else {}))
        if cfg.checkpoint_every and ((step + 1) % cfg.checkpoint_every == 0 or step + 1 == end):
            save_checkpoint(out, step + 1, model, optimizers, schedulers, state, elapsed, cfg,
                            rank, device)
        last = record
    if bar is not None:
        bar.close()
    if log is not None:
        log.close()
    return last if rank == 0 else None


# -- building blocks ------------------------------------------------------------------------


def _single_process_env() -> None:
    """Without torchrun: a world of one process on a free local port."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def corpus_text(cfg: TrainConfig) -> str:
    """``--dataset`` (Hugging Face ``datasets``), ``--data`` files, or the default corpus."""
    if not cfg.dataset:
        return read_text(cfg.data)
    try:
        import datasets
    except ImportError as e:
        raise ImportError("--dataset needs the 'datasets' package: pip install datasets") from e
    if Path(cfg.dataset).is_dir():
        ds = datasets.load_from_disk(cfg.dataset)
        if isinstance(ds, datasets.DatasetDict):
            ds = ds[cfg.dataset_split]
    else:
        ds = datasets.load_dataset(cfg.dataset, split=cfg.dataset_split)
    pieces, size = [], 0
    for row in ds:
        pieces.append(row[cfg.text_column])
        size += len(pieces[-1])
        if size >= cfg.dataset_max_chars:
            break
    return "\n\n".join(pieces)


def _model_and_data(cfg: TrainConfig):
    text = corpus_text(cfg)
    if cfg.model in PRESETS:
        data = load_token_data(seq_len=cfg.seq_len, vocab_size=cfg.vocab_size,
                               val_fraction=cfg.val_fraction, text=text)
        return build_preset(cfg.model, data.vocab_size, cfg.seed), data
    model, tokenizer = load_model(cfg.model)
    limit = int(model.config.vocab_size)
    data = load_token_data(seq_len=cfg.seq_len, tokenizer=tokenizer,
                           vocab_size=min(cfg.vocab_size, limit),
                           val_fraction=cfg.val_fraction, text=text)
    return model, data


def _bytes(state, width: int | None, counter: ByteCounter | None, n_params: int,
           world: int) -> dict:
    """This step's wire bytes: GeoFP8's own counters, the counted collectives of another
    Python hook (PowerSGD), or the ring all-reduce of a fixed width (FP32, bf16)."""
    if hasattr(state, "stats"):
        st = state.stats()
        parts = {k: st[k] for k in ("factor_bytes_sent", "bytes_inter_node",
                                    "bytes_intra_node") if k in st}
        return {"bytes_sent": st["bytes_sent"],
                "bytes_fp32_equivalent": st["bytes_fp32_equivalent"],
                "bytes_per_element": st["bytes_per_element"], **parts}
    if counter is not None:
        sent, counter.bytes = counter.bytes, 0
    else:
        sent = fp32_allreduce_wire_bytes(n_params, world, width)
    return {"bytes_sent": sent,
            "bytes_fp32_equivalent": fp32_allreduce_wire_bytes(n_params, world),
            "bytes_per_element": sent / n_params}


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to 1, then cosine down to ``lr_min / lr`` at the last step."""
    warmup = min(cfg.warmup, cfg.steps)
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, cfg.steps - warmup))
    floor = cfg.lr_min / cfg.lr
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def evaluate(model: torch.nn.Module, blocks: torch.Tensor, cfg: TrainConfig, rank: int,
             world: int, device: torch.device) -> float:
    """Mean next-token loss over (up to ``eval_batches`` batches per rank of) the validation
    blocks, the same blocks whatever the method; reduced over ranks. Every rank runs the
    same number of forwards (FSDP's forward is a collective): a rank with fewer blocks
    repeats its first batch without counting it."""
    model.eval()
    n = min(blocks.shape[0], cfg.eval_batches * cfg.batch_size * world)
    mine = blocks[rank:n:world]
    total = torch.zeros(2, dtype=torch.float64, device=device)
    most = -(-n // world)  # blocks of the rank with the most
    for i in range(0, most, cfg.batch_size):
        b = mine[i : i + cfg.batch_size].to(device)
        if b.shape[0] == 0:
            model(input_ids=blocks[: cfg.batch_size, :-1].to(device))
            continue
        logits = model(input_ids=b[:, :-1]).logits
        total[0] += F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                    b[:, 1:].reshape(-1), reduction="sum").double()
        total[1] += b[:, 1:].numel()
    dist.all_reduce(total)
    model.train()
    return float(total[0] / total[1])


def save_checkpoint(out: Path, step: int, model, optimizers, schedulers, state, elapsed: float,
                    cfg: TrainConfig, rank: int, device: torch.device) -> None:
    sharded = cfg.parallel != "ddp"
    if sharded:
        ckpt.save_sharded(out, step, model, optimizers, state)
    if rank == 0:
        whole = {} if sharded else {"model": model.state_dict(),
                                    "optimizers": [o.state_dict() for o in optimizers]}
        ckpt.atomic_save({"step": step, **whole,
                          "schedulers": [s.state_dict() for s in schedulers],
                          "elapsed_s": elapsed, "config": cfg.to_dict()},
                         ckpt.step_dir(out, step) / "shared.pt")
    ckpt.atomic_save({"step": step,
                      "geofp8": state.state_dict() if state is not None and not sharded
                      else None,
                      "rng": torch.get_rng_state(),
                      "cuda_rng": torch.cuda.get_rng_state(device)
                      if device.type == "cuda" else None},
                     ckpt.step_dir(out, step) / f"rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        ckpt.write_meta(out, step)
    dist.barrier()


def _write_run_info(out: Path, cfg: TrainConfig, world: int, n_params: int, data,
                    device: torch.device, optimizers: list[torch.optim.Optimizer]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    starts, why = cfg.geometry_start()
    info = {"config": cfg.to_dict(), "world_size": world, "parameters": n_params,
            "method_description": METHODS[cfg.method].description,
            "geometry_start": {"step": starts, "why": why},
            "train_blocks": int(data.train.shape[0]), "val_blocks": int(data.val.shape[0]),
            "device": str(device), "torch": torch.__version__, **optimizer_info(optimizers)}
    (out / "run.json").write_text(json.dumps(info, indent=1))


class _Log:
    """``log.jsonl``: one JSON object per step. A resumed run first drops the lines of
    steps at or after the checkpoint it resumes from."""

    def __init__(self, path: Path, start: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if start > 0 and path.exists():
            kept = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] < start]
        path.write_text("".join(line + "\n" for line in kept))
        self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def _progress(cfg: TrainConfig, rank: int, start: int):
    if rank != 0 or cfg.quiet or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=cfg.steps, initial=start, desc=cfg.method, dynamic_ncols=True)
