"""Checkpoints of ``geofp8 train``: written atomically, resumed bit-identically on CPU.

Layout of ``<out>/checkpoint/``:

* ``step-<step>/shared.pt`` (rank 0): schedulers, step, elapsed time, the config; under
  ``--parallel ddp`` also the model and optimizers (every rank holds them whole);
* ``step-<step>/sharded/`` (``--parallel fsdp|hsdp``): a ``torch.distributed.checkpoint``
  (DCP) checkpoint that every rank writes its part of: the model's and optimizers' shards
  (DTensors, FQN-keyed: :func:`save_sharded`) and every rank's GeoFP8 state under its own keys
  (:mod:`geofp8.integrations.dcp`). Nothing is gathered to one rank; :func:`load_sharded`
  reads each rank's part back after ``fully_shard``;
* ``step-<step>/rank<r>.pt`` (every rank): the torch RNG state, the step, and under
  ``--parallel ddp`` the GeoFP8 state (error-feedback residuals differ per rank);
* ``meta.json`` (rank 0, after a barrier that every rank reaches only once its files are
  written): the step of the newest complete checkpoint. Older ``step-*`` directories are
  removed only after ``meta.json`` has moved on.

Each ``.pt`` file goes to a temporary name in the same directory and is renamed with
:func:`os.replace`, so a crash mid-write never leaves a half file under the real name, and
a crash anywhere while writing step ``s`` leaves the previous checkpoint whole and named
by ``meta.json``. Everything is read with ``weights_only=True`` (DCP's pickled values too:
:class:`~geofp8.integrations.dcp.SafeLoadPlanner`); a file that cannot be read is one clear
``ValueError``, and GeoFP8's state is verified before it is loaded (another rank's, another
model's, a damaged or non-finite one is refused: :mod:`geofp8.verification`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from ...integrations.checkpoint import read
from ..errors import UsageError

__all__ = ["atomic_save", "check_world", "checkpoint_dir", "latest_step", "load_rank",
           "load_shared", "load_sharded", "save_sharded", "step_dir", "write_meta"]


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
    obj = read(path)  # a file torch cannot read is one clear error
    if obj["step"] != step:
        raise RuntimeError(f"{path.name} holds step {obj['step']}, meta.json says {step}: "
                           "the checkpoint is incomplete")
    return obj


def load_shared(out: str | os.PathLike, step: int) -> dict:
    return _load(step_dir(out, step) / "shared.pt", step)


def load_rank(out: str | os.PathLike, rank: int, step: int, world: int) -> dict:
    """Rank ``rank``'s file of step ``step``.

    Raises:
        ValueError: the checkpoint was written on another number of ranks than ``world``
            (the RNG and GeoFP8 states are per rank: they are not resharded).
    """
    check_world(out, step, world)
    return _load(step_dir(out, step) / f"rank{rank}.pt", step)


def check_world(out: str | os.PathLike, step: int, world: int) -> None:
    """Raise :class:`~geofp8.tools.errors.UsageError` (a ``ValueError``) unless the
    checkpoint of ``step`` was written on ``world`` ranks."""
    written = len(list(step_dir(out, step).glob("rank*.pt")))
    if written != world:
        raise UsageError(f"the checkpoint {step_dir(out, step).name} was written on {written} "
                         f"ranks, this run has {world}: the error-feedback residuals and RNG "
                         f"states are per rank and cannot be resharded; resume on {written} "
                         "ranks")


def _sharded_states(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
                    state) -> dict:
    """What :func:`save_sharded` writes: DCP's model and optimizer state dicts (this rank's
    shards) and, with GeoFP8's reduction, its per-rank state."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from ... import fsdp
    from ...integrations.dcp import KEY, DCPState

    states = {"model": get_model_state_dict(model),
              "optimizers": get_optimizer_state_dict(model, optimizers)}
    if isinstance(state, fsdp.GeoFP8FSDP):
        states[KEY] = DCPState([state])
    return states


def save_sharded(out: str | os.PathLike, step: int, model: torch.nn.Module,
                 optimizers: list[torch.optim.Optimizer], state) -> None:
    """Write ``step-<step>/sharded/`` (module notes): a collective, every rank calls it."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_sharded_states(model, optimizers, state),
             checkpoint_id=step_dir(out, step) / "sharded")


def load_sharded(out: str | os.PathLike, step: int, model: torch.nn.Module,
                 optimizers: list[torch.optim.Optimizer], state) -> None:
    """Restore :func:`save_sharded`'s checkpoint into the ``fully_shard``-ed ``model``, its
    ``optimizers`` and GeoFP8's ``state`` (a collective). The model and optimizers reshard
    to this run's ranks; GeoFP8's state refuses another number of ranks (``ValueError``)."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from ...integrations import dcp

    states = _sharded_states(model, optimizers, state)
    dcp.load(states, step_dir(out, step) / "sharded")
    set_model_state_dict(model, states["model"])
    set_optimizer_state_dict(model, optimizers, states["optimizers"])
