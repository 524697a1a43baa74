"""The one transform factory, shared by the DDP/FSDP path and the analysis tool.

``make_transform(kind, damping, A=..., S=..., factor=...)`` builds the map of one layer from
its statistics: ``A = E[x xᵀ]`` (input side, ``d_in × d_in``), ``S = E[δ δᵀ]`` (output side)
or, for ``lowrank``/``full``, a :class:`LowRankFactor` of ``A`` (exact or sketched).
"""

from __future__ import annotations

import torch

from .statistics import LowRankFactor
from .transforms import (
    BlockInput,
    DiagonalInput,
    Hadamard,
    Identity,
    LowRankInput,
    OutputSide,
    RandomHadamard,
    Transform,
    TwoSided,
)

__all__ = ["TRANSFORMS", "make_transform", "needs"]

# kind -> the statistics it needs: "A" (d_in × d_in matrix), "factor" (top-k of A, exact or
# sketched), "S" (d_out × d_out), or nothing (data-independent).
TRANSFORMS: dict[str, tuple[str, ...]] = {
    "euclidean": (),
    "hadamard": (),
    "rht": (),
    "lowrank": ("factor",),
    "full": ("A",),
    "diag": ("A",),
    "block": ("A",),
    "output": ("S",),
    "kfac": ("A", "S"),
}


def needs(kind: str) -> tuple[str, ...]:
    """The statistics ``kind`` is built from (see :data:`TRANSFORMS`)."""
    if kind not in TRANSFORMS:
        raise ValueError(f"unknown transform {kind!r}; expected one of {list(TRANSFORMS)}")
    return TRANSFORMS[kind]


def make_transform(kind: str, damping: float, *, A: torch.Tensor | None = None,
                   S: torch.Tensor | None = None, factor: LowRankFactor | None = None,
                   dim: int | None = None, block: int = 128, seed: int = 0,
                   device: torch.device | str | None = None) -> Transform:
    """The map of one layer. ``dim``: ``d_in`` for ``hadamard`` and ``rht``; ``block``: the
    column block of ``block``, the codec's scale block for ``rht``; ``factor``: the top-k
    of ``A`` for ``lowrank`` (``full`` takes ``A`` or a full-rank factor); ``device``: where
    a data-independent map (``hadamard``, ``rht``) lives (default: ``A``'s device, else the
    CPU); the others live with their statistics."""
    kind = str(kind)  # a plain string in the map's name and state, also from an enum
    needs(kind)
    if kind == "euclidean":
        return Identity()
    dtype = A.dtype if A is not None else torch.float32
    device = device if device is not None else (A.device if A is not None else "cpu")
    if kind == "hadamard":
        return Hadamard(dim, seed=seed, dtype=dtype, device=device)
    if kind == "rht":
        return RandomHadamard(dim, block, seed=seed, dtype=dtype, device=device)
    if kind in ("lowrank", "full"):
        if factor is None:
            factor = LowRankFactor.from_matrix(A, A.shape[0])
        t = LowRankInput(factor, damping)
        t.name = kind
        return t
    if kind == "diag":
        return DiagonalInput(A, damping)
    if kind == "block":
        return BlockInput(A, block, damping)
    if kind == "output":
        return OutputSide(S, damping)
    return TwoSided(A, S, damping)
