"""Error feedback in communication coordinates.

For a parameter routed through ``T`` (identity for Euclidean FP8): the sender encodes
``Ũ = G T + R`` and keeps ``R ← Ũ − deq(Q(Ũ))`` for the next step. The residual remembers the
coordinates it lives in; when a refresh or a selection change moves them, it is re-based
``R ← R T_old⁻¹ T_new`` so its Euclidean meaning is kept (DESIGN rule 3).

A step's residuals are *staged* while its buckets are encoded and *committed* only when the
whole step came back finite; a non-finite step discards them (it leaves no trace).
"""

from __future__ import annotations

import torch

from .geometry.transforms import Identity, Transform, rebase, transform_from_state

__all__ = ["ErrorFeedback"]

IDENTITY = Identity()


class ErrorFeedback:
    """Per-parameter residuals ``R`` (float32, the gradient's shape) and their coordinates."""

    def __init__(self) -> None:
        self.residuals: dict[str, torch.Tensor] = {}
        self.basis: dict[str, Transform] = {}
        self._staged: dict[str, tuple[torch.Tensor, Transform]] = {}

    def residual_in(self, name: str, route: Transform) -> torch.Tensor | None:
        """The committed residual of ``name`` in ``route``'s coordinates (``None``: none yet)."""
        residual = self.residuals.get(name)
        if residual is None:
            return None
        basis = self.basis.get(name, IDENTITY)
        return residual if basis is route else rebase(residual, basis, route)

    def stage(self, name: str, residual: torch.Tensor, route: Transform) -> None:
        """This step's new residual of ``name`` (in ``route``'s coordinates)."""
        self._staged[name] = (residual, route)

    def commit(self) -> None:
        for name, (residual, basis) in self._staged.items():
            self.residuals[name], self.basis[name] = residual, basis
        self._staged = {}

    def discard(self) -> None:
        self._staged = {}

    def rescale(self, factor: float) -> None:
        """Multiply every residual by ``factor`` (a loss scale changed by that ratio)."""
        for residual in self.residuals.values():
            residual.mul_(factor)

    @property
    def nbytes(self) -> int:
        return sum(r.numel() * r.element_size() for r in self.residuals.values())

    def state_dict(self) -> dict:
        """Residuals and their coordinates as tensors and plain containers."""
        return {"residuals": {n: r.clone() for n, r in self.residuals.items()},
                "basis": {n: {"kind": t.name, "state": t.state()}
                          for n, t in self.basis.items()}}

    def load_state_dict(self, state: dict, transforms: dict[str, Transform]) -> None:
        """Restore; a basis equal to a live transform of ``transforms`` becomes that object
        again, so the residual is not re-based needlessly."""
        self.residuals = {n: r.clone() for n, r in state["residuals"].items()}
        self.basis, self._staged = {}, {}
        for name, saved in state["basis"].items():
            live = transforms.get(name)
            if live is not None and _same(live, saved):
                self.basis[name] = live
            elif saved["kind"] == IDENTITY.name:
                self.basis[name] = IDENTITY
            else:
                self.basis[name] = transform_from_state(saved["kind"], saved["state"])


def _same(t: Transform, saved: dict) -> bool:
    mine = t.state()
    return t.name == saved["kind"] and mine.keys() == saved["state"].keys() and all(
        torch.equal(mine[k].cpu(), saved["state"][k].cpu()) for k in mine)
