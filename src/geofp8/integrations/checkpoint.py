"""GeoFP8's state in a framework's checkpoint, so that a resumed run continues bit-identically.

The state (:meth:`geofp8.engine.SyncEngine.state_dict`: error-feedback residuals, factors,
selections, step) differs per rank, so a checkpoint holds every rank's, in one of two forms:

* per-rank files ``geofp8-rank<r>.pt`` (``r``: the global rank) in the framework's checkpoint
  directory, each written by its own rank: :func:`save_files` / :func:`load_files`
  (Accelerate, the ``transformers`` Trainer);
* one entry ``{"world_size": N, "ranks": [state_0, …, state_N−1]}`` in a checkpoint dict that
  rank 0 writes: :func:`gather` (a collective; rank 0 briefly holds all ``N`` states) /
  :func:`restore` (Lightning).

Everything is tensors and plain containers, read with ``weights_only=True``; the state is
verified before anything is loaded from it (:mod:`geofp8.verification`: the rank that wrote
it, the world size, the model, the config, a checksum, finiteness). A checkpoint
without GeoFP8 state resumes with a :class:`UserWarning` (residuals start at zero, factors and
selections are recomputed: the run is no longer the one that never stopped). One written on
another number of ranks is refused with a ``ValueError`` naming both: residuals are per rank and
are not resharded.
"""

from __future__ import annotations

import io
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = ["FILE", "gather", "load_files", "other_world", "read", "restore", "save_files",
           "warn_missing"]

FILE = "geofp8-rank{rank}.pt"


def save_files(state, directory: str | os.PathLike) -> Path:
    """Write this rank's ``state.state_dict()`` to ``directory``; return the file's path."""
    path = Path(directory) / FILE.format(rank=dist.get_rank())
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state.state_dict(), path)
    return path


def load_files(state, directory: str | os.PathLike) -> bool:
    """Load this rank's file of :func:`save_files` into ``state``; ``False`` (with a warning)
    when ``directory`` holds no GeoFP8 state.

    Raises:
        ValueError: the files were written by another number of ranks (or another config:
            see :meth:`geofp8.engine.SyncEngine.load_state_dict`).
    """
    path = Path(directory) / FILE.format(rank=dist.get_rank())
    if path.exists():
        state.load_state_dict(read(path, _device(state)))
        return True
    written = len(list(Path(directory).glob(FILE.format(rank="*"))))
    if written:
        raise ValueError(other_world(written))
    warn_missing(str(directory))
    return False


def read(path: str | os.PathLike, device: torch.device | str = "cpu"):
    """``torch.load(path, weights_only=True)`` onto ``device``; a file that cannot be read
    (truncated, damaged) is one clear ``ValueError``."""
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as error:
        raise ValueError(f"GeoFP8 checkpoint refused: {path} cannot be read ({error}); it is "
                         "damaged or not a checkpoint: use another one. Nothing was "
                         "loaded.") from error


def gather(state) -> dict | None:
    """Every rank's ``state.state_dict()`` (CPU tensors) on rank 0, ``None`` on the others.

    A collective on the default group: call it on every rank. The states travel as
    ``torch.save`` bytes in uint8 tensors and are read back with ``weights_only=True``.
    """
    world, device = dist.get_world_size(), _device(state)
    buffer = io.BytesIO()
    torch.save(state.state_dict(), buffer)
    raw = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([raw.numel()], device=device))
    padded = torch.zeros(int(max(sizes)), dtype=torch.uint8)
    padded[: raw.numel()] = raw
    padded = padded.to(device)
    parts = [torch.empty_like(padded) for _ in range(world)] if dist.get_rank() == 0 else None
    dist.gather(padded, parts, dst=0)
    if parts is None:
        return None
    return {"world_size": world, "ranks": [
        torch.load(io.BytesIO(p[: int(n)].cpu().numpy().tobytes()), map_location="cpu",
                   weights_only=True) for p, n in zip(parts, sizes)]}


def restore(state, saved: dict | None, where: str) -> bool:
    """Load this rank's entry of :func:`gather`'s ``saved`` into ``state``; ``False`` (with a
    warning naming ``where``) when ``saved`` is ``None`` (a checkpoint without GeoFP8 state).

    Raises:
        ValueError: ``saved`` was gathered on another number of ranks (or another config).
    """
    if saved is None:
        warn_missing(where)
        return False
    if saved["world_size"] != dist.get_world_size():
        raise ValueError(other_world(saved["world_size"]))
    state.load_state_dict(_to(saved["ranks"][dist.get_rank()], _device(state)))
    return True


def _device(state) -> torch.device:
    return state.engine.group.device


def _to(obj, device: torch.device):
    """``obj`` (tensors in plain containers) with every tensor on ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(v, device) for v in obj)
    return obj


def other_world(written: int) -> str:
    """The refusal's message: a checkpoint of ``written`` ranks, this run has another number."""
    return (f"GeoFP8 checkpoint was written on {written} ranks, this run has "
            f"{dist.get_world_size()}: the error-feedback residuals are per rank and cannot be "
            f"resharded; resume on {written} ranks")


def warn_missing(where: str) -> None:
    """Warn that the checkpoint ``where`` holds no GeoFP8 state (training goes on afresh)."""
    warnings.warn(f"GeoFP8: the checkpoint {where} holds no GeoFP8 state; training resumes "
                  "with zero error-feedback residuals and freshly computed factors (not "
                  "bit-identical to a run that never stopped)", UserWarning, stacklevel=3)
