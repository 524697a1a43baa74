"""Checkpoints of ``geofp8 train``: written atomically, resumed bit-identically on CPU.

Layout of ``<out>/checkpoint/``:

* ``step-<step>/shared.pt`` (rank 0): model, optimizers, schedulers, step, the config. Under
  ``--parallel fsdp|hsdp`` the model's and optimizers' whole (unsharded) states, gathered to
  rank 0 with ``torch.distributed.checkpoint.state_dict`` (:func:`full_states`) and sharded
  again on load (:func:`load_optimizers`); the model is loaded before ``fully_shard``;
* ``step-<step>/rank<r>.pt`` (every rank): the GeoFP8 state (error-feedback residuals
  differ per rank), the torch RNG state, the step;
* ``meta.json`` (rank 0, after a barrier that every rank reaches only once its files are
  written): the step of the newest complete checkpoint. Older ``step-*`` directories are
  removed only after ``meta.json`` has moved on.

Each file goes to a temporary name in the same directory and is renamed with
:func:`os.replace`, so a crash mid-write never leaves a half file under the real name, and
a crash anywhere while writing step ``s`` leaves the previous checkpoint whole and named
by ``meta.json``. Everything is tensors and plain containers, read with ``weights_only=True``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

__all__ = ["atomic_save", "checkpoint_dir", "full_states", "latest_step", "load_optimizers",
           "load_rank", "load_shared", "step_dir", "write_meta"]


def checkpoint_dir(out: str | os.PathLike) -> Path:
    return Path(out) / "checkpoint"


def step_dir(out: str | os.PathLike, step: int) -> Path:
    return checkpoint_dir(out) / f"step-{step:08d}"


def atomic_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to ``path`` through a temporary file in the same directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_meta(out: str | os.PathLike, step: int) -> None:
    """Point ``meta.json`` at ``step`` (atomically), then remove the other step folders."""
    path = checkpoint_dir(out) / "meta.json"
    tmp = path.with_name(f".meta.json.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"step": step}))
    os.replace(tmp, path)
    keep = step_dir(out, step).name
    for old in checkpoint_dir(out).glob("step-*"):
        if old.name != keep:
            shutil.rmtree(old, ignore_errors=True)


def latest_step(out: str | os.PathLike) -> int | None:
    """The step of the complete checkpoint under ``out``, or ``None``."""
    path = checkpoint_dir(out) / "meta.json"
    if not path.exists():
        return None
    return int(json.loads(path.read_text())["step"])


def _load(path: Path, step: int) -> dict:
    obj = torch.load(path, map_location="cpu", weights_only=True)
    if obj["step"] != step:
        raise RuntimeError(f"{path.name} holds step {obj['step']}, meta.json says {step}: "
                           "the checkpoint is incomplete")
    return obj


def load_shared(out: str | os.PathLike, step: int) -> dict:
    return _load(step_dir(out, step) / "shared.pt", step)


def load_rank(out: str | os.PathLike, rank: int, step: int) -> dict:
    path = step_dir(out, step) / f"rank{rank}.pt"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: resume with the same number of ranks")
    return _load(path, step)


def full_states(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
                sharded: bool) -> tuple[dict, list | dict]:
    """The model's and optimizers' whole states. ``sharded`` (``fully_shard``-ed model): a
    collective, every rank calls it; the FQN-keyed states, on CPU, are rank 0's only."""
    if not sharded:
        return model.state_dict(), [o.state_dict() for o in optimizers]
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return (get_model_state_dict(model, options=options),
            get_optimizer_state_dict(model, optimizers, options=options))


def load_optimizers(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
                    saved: list | dict, sharded: bool) -> None:
    """Restore :func:`full_states`' optimizer states (``sharded``: every rank holds ``saved``
    whole and keeps its shards)."""
    if not sharded:
        for o, s in zip(optimizers, saved):
            o.load_state_dict(s)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizers, saved,
                             options=StateDictOptions(full_state_dict=True))
