"""Input-side K-FAC statistics ``A = E[x xᵀ]`` of a Linear layer, exact or sketched.

Both estimators keep *sums* (``total``) and a token *weight*, so the estimates of
several data-parallel ranks combine with a plain SUM all-reduce of
:meth:`SecondMoment.tensors`, and the mean is ``total / weight``. With
``decay = β < 1`` each update first scales the old sums by β (an exponential
moving average over updates); ``decay = 1`` is a running mean over all tokens.

* ``exact``: ``total = Σ_t x_t x_tᵀ`` (``d × d``).
* ``sketch``: ``total = Σ_t x_t (x_tᵀ Ω) = A·Ω·weight`` for a Gaussian test matrix
  ``Ω`` (``d × l``, ``l = k + p``) drawn from a fixed seed, so every rank has the
  same Ω; plus ``trace = Σ_t ‖x_t‖²``. Memory O(d·l). :meth:`factor` recovers the
  top-k eigenpairs by the stabilised Nyström method (Tropp et al., 2017).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..codecs import triton_fp8, triton_stats

__all__ = ["JoinedMoments", "LowRankFactor", "SecondMoment", "nystrom_factor", "sketch_matrix"]


@dataclass
class LowRankFactor:
    """Top-k eigenpairs ``(U, Λ)`` of ``A`` and its trace; the rest is modelled as isotropic.

    ``σ² = (tr A − ΣΛ) / (d − k)`` is the mean eigenvalue of the complement.
    """

    U: torch.Tensor  # d × k, orthonormal columns
    eigvals: torch.Tensor  # k, descending, >= 0
    trace: float | torch.Tensor  # a 0-dim tensor keeps the factor on the device
    dim: int

    @property
    def rank(self) -> int:
        return self.U.shape[1]

    @property
    def sigma2(self) -> float | torch.Tensor:
        """A float, or a 0-dim tensor when :attr:`trace` is one (no host read)."""
        rest = self.dim - self.rank
        if isinstance(self.trace, torch.Tensor):
            if rest <= 0:
                return torch.zeros_like(self.trace)
            return ((self.trace - self.eigvals.double().sum()) / rest).clamp_min(0)
        if rest <= 0:
            return 0.0
        return max((self.trace - float(self.eigvals.sum())) / rest, 0.0)

    @classmethod
    def from_matrix(cls, A: torch.Tensor, k: int) -> LowRankFactor:
        """Exact top-k of a symmetric PSD matrix (eigh in float64)."""
        A64 = A.double()
        A64 = 0.5 * (A64 + A64.T)
        w, V = torch.linalg.eigh(A64)
        k = min(k, A.shape[0])
        top = torch.arange(A.shape[0] - 1, A.shape[0] - k - 1, -1, device=A.device)
        return cls(V[:, top].to(A.dtype).contiguous(), w[top].clamp_min(0).to(A.dtype),
                   float(torch.trace(A64)), A.shape[0])


def sketch_matrix(dim: int, size: int, seed: int, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """The Gaussian sketch matrix ``Ω`` (``dim × min(size, dim)``) of ``seed``: drawn in
    float64 on the CPU, so every rank and device gets the same one."""
    gen = torch.Generator().manual_seed(seed)
    omega = torch.randn(dim, min(size, dim), generator=gen, dtype=torch.float64)
    return omega.to(device=device, dtype=dtype)


class SecondMoment:
    """Accumulates ``A = E[x xᵀ]`` over the tokens of a layer's input ``x`` (``... × d``).

    Args:
        dim: the input width ``d``.
        mode: ``"exact"`` or ``"sketch"``.
        sketch_size: columns ``l`` of the test matrix in sketch mode (``k`` + oversampling).
        decay: β of the EMA over updates; 1.0 is a running mean.
        dtype: accumulation dtype (float32 or float64).
        seed: seed of Ω; identical on every rank.
    """

    def __init__(self, dim: int, mode: str = "exact", sketch_size: int = 40, decay: float = 1.0,
                 dtype: torch.dtype = torch.float32, seed: int = 0,
                 device: torch.device | str = "cpu") -> None:
        if mode not in ("exact", "sketch"):
            raise ValueError(f"mode must be 'exact' or 'sketch', got {mode!r}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.dim, self.mode, self.decay, self.dtype = dim, mode, decay, dtype
        if mode == "exact":
            self.total = torch.zeros(dim, dim, dtype=dtype, device=device)
            self.omega = None
        else:
            self.omega = sketch_matrix(dim, sketch_size, seed, dtype, device)
            self.total = torch.zeros(dim, self.omega.shape[1], dtype=dtype, device=device)
        self.trace_total = torch.zeros((), dtype=dtype, device=device)
        self.weight = torch.zeros((), dtype=dtype, device=device)

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        """Add the tokens of ``x`` (any leading shape, last dim ``d``)."""
        x = x.detach().reshape(-1, self.dim).to(self.dtype)
        if self.decay < 1.0:
            for t in self.tensors():
                t.mul_(self.decay)
        if self.mode == "exact":
            self.total.addmm_(x.T, x)
        else:
            self.total.addmm_(x.T, x @ self.omega)
        self.trace_total.add_(x.pow(2).sum())
        self.weight.add_(x.shape[0])

    def tensors(self) -> list[torch.Tensor]:
        """The sums that a SUM all-reduce combines across ranks (in place)."""
        return [self.total, self.trace_total, self.weight]

    def reset(self) -> None:
        for t in self.tensors():
            t.zero_()

    @property
    def numel(self) -> int:
        """Elements of the sums (:meth:`tensors`)."""
        return sum(t.numel() for t in self.tensors())

    def place(self, storage: torch.Tensor) -> None:
        """Keep the sums as views of ``storage`` (1-D, :attr:`numel` elements of this
        moment's dtype and device), their values copied in: moments placed side by side in
        one buffer are then checked and summed at once (:class:`JoinedMoments`)."""
        views, pos = [], 0
        for t in self.tensors():
            views.append(storage[pos : pos + t.numel()].view(t.shape).copy_(t))
            pos += t.numel()
        self.total, self.trace_total, self.weight = views


    @property
    def nbytes(self) -> int:
        extra = self.omega.numel() * self.omega.element_size() if self.omega is not None else 0
        return sum(t.numel() * t.element_size() for t in self.tensors()) + extra

    def mean(self) -> torch.Tensor:
        """``A`` (exact mode) — the d × d estimate."""
        if self.mode != "exact":
            raise RuntimeError("mean() needs mode='exact'; use factor() in sketch mode")
        return self.total / self.weight.clamp_min(1)

    def trace(self) -> float:
        return float(self.trace_total / self.weight.clamp_min(1))

    def factor(self, k: int) -> LowRankFactor:
        """Top-k eigenpairs of the estimate of ``A``, plus its trace."""
        if self.mode == "exact":
            return LowRankFactor.from_matrix(self.mean(), k)
        return nystrom_factor(self.total / self.weight.clamp_min(1), self.omega, k, self.trace())


class JoinedMoments:
    """Moments of one dtype and device whose sums lie side by side in one flat buffer
    (:meth:`SecondMoment.place`), so a step's work on all of them takes a fixed number of
    launches, whatever their count: :meth:`commit_into` (one Triton launch on the kernels'
    device, :func:`~geofp8.codecs.triton_stats.commit`; else torch's, :meth:`nonfinite` and
    :meth:`add_where`)."""

    def __init__(self, moments: list[SecondMoment]) -> None:
        first = moments[0].total
        self.flat = torch.zeros(sum(m.numel for m in moments), dtype=first.dtype,
                                device=first.device)
        pos = 0
        for m in moments:
            m.place(self.flat[pos : pos + m.numel])
            pos += m.numel
        self.numels = [m.numel for m in moments]
        self.lengths = torch.tensor(self.numels, device=first.device)

    @functools.cached_property
    def _fused(self) -> triton_stats.Launch | triton_stats.TiledCommit | None:
        """The fused commit (:func:`~geofp8.codecs.triton_stats.commit`), made when a commit
        is first bound (a window's moments take none); ``None`` off the kernels' device."""
        return triton_stats.commit(self.numels, self.flat.device) \
            if triton_fp8.available(self.flat) else None

    def commit_into(self, window: JoinedMoments, finite: torch.Tensor,
                    dropped: torch.Tensor) -> None:
        """``window += where(finite ∧ ¬bad[i], moment i, 0)`` and ``dropped[i] += finite ∧
        bad[i]`` (``bad``: :meth:`nonfinite`; ``finite`` a 0-dim bool, ``dropped`` int64
        ``[moments]``, the same layout and device), then these sums zeroed; no host read."""
        self.bound_commit(window, dropped)(finite)

    def bound_commit(self, window: JoinedMoments, dropped: torch.Tensor
                     ) -> Callable[[torch.Tensor], None]:
        """:meth:`commit_into` ``window`` and ``dropped`` as ``commit(finite)``, the rest
        bound (a caller that commits every step binds it once): the fused launch, or
        torch's once a kernel has failed (:func:`~geofp8.codecs.triton_fp8.attempt`);
        torch's alone off the kernels' device."""
        reference = functools.partial(self._commit_reference, window, dropped=dropped)
        if self._fused is None:
            return reference
        return functools.partial(triton_fp8.attempt, functools.partial(
            self._fused, self.flat, window.flat, dropped), reference)

    def _commit_reference(self, window: JoinedMoments, finite: torch.Tensor,
                          dropped: torch.Tensor) -> None:
        bad = self.nonfinite()
        window.add_where(finite & ~bad, self)
        dropped.add_(finite & bad)
        self.flat.zero_()

    def nonfinite(self) -> torch.Tensor:
        """Per moment: whether any of its elements is NaN or ±Inf (bool, on the device)."""
        bad = (~torch.isfinite(self.flat)).to(self.flat.dtype)
        # unsafe: no check of the lengths (a host read on CUDA); they are ours, exact
        return torch.segment_reduce(bad, "max", lengths=self.lengths, unsafe=True) > 0

    def add_where(self, keep: torch.Tensor, other: JoinedMoments) -> None:
        """``self += where(keep[i], other's moment i, 0)``, moment by moment (the same
        moments' layout)."""
        kept = torch.repeat_interleave(keep, self.lengths, output_size=self.flat.numel())
        self.flat.add_(torch.where(kept, other.flat, 0))


def nystrom_factor(Y: torch.Tensor, omega: torch.Tensor, k: int,
                   trace: float | torch.Tensor) -> LowRankFactor:
    """Top-k eigenpairs from a sketch ``Y = A Ω`` (stabilised Nyström, in float64).

    With shift ``ν = ε‖Y‖``: ``Y_ν = Y + νΩ``, ``Ωᵀ Y_ν = V W Vᵀ``, ``B = Y_ν V W^{-1/2}``
    over the eigenvalues ``w > ε_Y·l·max|w|`` (the rest stands in the round-off of ``Y``,
    its own dtype: an FP32 sketch is noisy at ~1e-7; their columns of ``B`` are zero),
    ``B = U Σ Vᵀ``, ``Λ = max(Σ² − ν, 0)``. Exact when rank(A) ≤ l. Shapes do not depend on
    the values and nothing is read back to the host (``trace`` may be a 0-dim tensor):
    fresh factors run it on every step.
    """
    Y64, O64 = Y.double(), omega.double()
    nu = torch.finfo(torch.float64).eps * torch.linalg.matrix_norm(Y64).clamp_min(1e-300)
    Y_nu = Y64 + nu * O64
    core = O64.T @ Y_nu
    w, V = torch.linalg.eigh(0.5 * (core + core.T))
    # Dropping, not clamping: clamping the small ones to ν divided their noise by √ν and
    # inflated the eigenvalues ~100× for fp32 sketches of rank(A) < l.
    keep = w > torch.finfo(Y.dtype).eps * core.shape[0] * w.abs().max()
    B = (Y_nu @ V) * torch.where(keep, w, 1.0).rsqrt().where(keep, 0.0)
    U, S, _ = torch.linalg.svd(B, full_matrices=False)
    k = min(k, U.shape[1])
    lam = (S[:k] ** 2 - nu).clamp_min(0)
    return LowRankFactor(U[:, :k].to(Y.dtype).contiguous(), lam.to(Y.dtype), trace, Y.shape[0])
