"""Maps between a weight gradient ``G`` (``d_out × d_in``) and communication coordinates.

Every transform is invertible: ``inverse(forward(G)) == G`` up to round-off.
Input-side transforms multiply on the right (``G̃ = G T``), so rows stay
independent and any row sharding of ``G`` commutes with them.

Damping is relative: ``λ = damping · tr(M) / dim(M)`` for the factor ``M`` it damps.

=================  =========================================================
``Identity``       ``G̃ = G`` (plain Euclidean FP8)
``LowRankInput``   ``T = U(Λ+λ)^{-1/2}Uᵀ + c(I − UUᵀ)``, ``c = (σ²+λ)^{-1/2}``, applied
                   as ``T / c = G + (G U diag(a)) Uᵀ``: two skinny GEMMs, no ``d × d``
                   matrix (the inverse as ``c T⁻¹``). With ``k = d_in`` this is the
                   full ``(A+λI)^{-1/2}``, up to ``c``.
``DiagonalInput``  ``T = diag(A + λ)^{-1/2}``
``BlockInput``     ``T`` = block-diagonal ``(A_bb + λI)^{-1/2}``, blocks of ``b`` columns
                   (the last block takes the remainder)
``OutputSide``     ``G̃ = (S + λI)^{-1/2} G``
``TwoSided``       ``G̃ = (S + λ_S I)^{-1/2} G (A + λ_A I)^{-1/2}`` (full K-FAC)
``Hadamard``       ``G̃ = (G · diag(s)) (I ⊗ H_b) / √b``, fixed ±1 signs ``s`` (seed 0) and
                   Sylvester ``H_b`` with ``b`` the largest power of two dividing ``d_in``
                   (capped at ``max_block``). Odd ``d_in`` gives ``b = 1``: signs only.
``RandomHadamard`` the same map with ``b`` capped at the codec's scale block (16 for NVFP4,
                   32 for MX): each scale block of a row mixes only within itself (the
                   random Hadamard transform of NVFP4 training recipes)
=================  =========================================================
"""

from __future__ import annotations

import math

import torch

from .statistics import LowRankFactor

__all__ = [
    "IDENTITY",
    "BlockInput",
    "DiagonalInput",
    "Hadamard",
    "Identity",
    "LowRankInput",
    "OutputSide",
    "RandomHadamard",
    "Transform",
    "TwoSided",
    "rebase",
    "transform_from_state",
]


def _damping_of(trace: float | torch.Tensor, dim: int, damping: float) -> float | torch.Tensor:
    """Absolute ``λ = damping · tr / dim``, floored so that ``M + λI`` is never singular
    (a 0-dim tensor for a tensor ``trace``: no host read)."""
    lam = damping * trace / max(dim, 1)
    if isinstance(trace, torch.Tensor):
        return torch.maximum(lam, 1e-12 * trace.abs() / max(dim, 1)).clamp_min(1e-30)
    return max(lam, 1e-12 * abs(trace) / max(dim, 1), 1e-30)


def _lam(M: torch.Tensor, damping: float) -> float:
    return _damping_of(float(torch.trace(M.double())), M.shape[0], damping)


def _sym_powers(M: torch.Tensor, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``((M+λI)^{-1/2}, (M+λI)^{1/2})`` of a symmetric PSD matrix, via eigh in float64."""
    M64 = M.double()
    M64 = 0.5 * (M64 + M64.T)
    w, V = torch.linalg.eigh(M64)
    w = w.clamp_min(0) + lam
    inv_sqrt = (V * w.rsqrt()) @ V.T
    sqrt = (V * w.sqrt()) @ V.T
    return inv_sqrt.to(M.dtype), sqrt.to(M.dtype)


class Transform:
    """Base class: ``forward`` to communication coordinates, ``inverse`` back.

    :meth:`state` is the map as plain tensors, and
    :func:`transform_from_state` rebuilds it exactly: checkpoints and factor broadcasts
    carry tensors only, never serialised Python objects.
    """

    name = "transform"
    fields: tuple[str, ...] = ()  # attributes that define the map (tensors or floats)

    def forward(self, G: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def inverse(self, Gt: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward_over(self, G: torch.Tensor) -> torch.Tensor:
        """``G T`` written over ``G`` (the bits of :meth:`forward`); returns ``G``."""
        return G.copy_(self.forward(G))

    def inverse_over(self, Gt: torch.Tensor) -> torch.Tensor:
        """``Gt T⁻¹`` written over ``Gt`` (the bits of :meth:`inverse`); returns ``Gt``."""
        return Gt.copy_(self.inverse(Gt))

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the map depends on (for hashing, memory and checkpoints)."""
        return []

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def state(self) -> dict[str, torch.Tensor]:
        """``{field: tensor}``; list fields as ``field.i``."""
        out = {}
        for f in self.fields:
            value = getattr(self, f)
            if isinstance(value, list):
                out.update({f"{f}.{i}": v for i, v in enumerate(value)})
            else:
                out[f] = value
        return out

    @classmethod
    def _from_state(cls, state: dict[str, torch.Tensor]) -> Transform:
        self = cls.__new__(cls)
        for f in cls.fields:
            if f in state:
                setattr(self, f, state[f])
            else:
                n = sum(1 for k in state if k.startswith(f + "."))
                setattr(self, f, [state[f"{f}.{i}"] for i in range(n)])
        self._restored()
        return self

    def _restored(self) -> None:
        """Derive non-state attributes after :meth:`_from_state` (default: none)."""


class Identity(Transform):
    name = "euclidean"

    def forward(self, G: torch.Tensor) -> torch.Tensor:
        return G

    def inverse(self, Gt: torch.Tensor) -> torch.Tensor:
        return Gt


IDENTITY = Identity()  # the one identity route: compared by ``is``


class LowRankInput(Transform):
    """Input-side ``T ≈ A^{-1/2}`` from the top-k eigenpairs plus an isotropic complement,
    applied up to its complement's scale ``c = (σ²+λ)^{-1/2}`` (module notes).

    ``T = c (I + U diag(a) Uᵀ)`` with ``a = ((σ²+λ)/(Λ+λ))^{1/2} − 1``, and
    ``T⁻¹ = c⁻¹ (I + U diag(a⁻) Uᵀ)`` with ``a⁻ = ((Λ+λ)/(σ²+λ))^{1/2} − 1``. The map sends
    ``G T / c`` and maps back with ``c T⁻¹``: one global factor per layer, which per-group
    scaled codecs absorb into their scales, and which the inverse undoes (``c · c⁻¹ = 1``),
    so the mean, the round-trip error and the residual's Euclidean meaning are those of ``T``.
    Each way is two GEMMs and nothing else: ``G + (G V) Uᵀ`` with ``V = U diag(a)``, made
    once per map from its state (``U``, ``a_fwd``, ``a_inv``), on the map's device. The state
    lies in one buffer and ``V`` each way in another (the fields are views of them), so a
    source chooses between two maps with one ``torch.where`` a buffer (:meth:`chosen`).
    """

    name = "lowrank"
    fields = ("U", "a_fwd", "a_inv")

    def __init__(self, factor: LowRankFactor, damping: float) -> None:
        lam = _damping_of(factor.trace, factor.dim, damping)
        rest = factor.sigma2 + lam  # a float, or 0-dim on the device: no host read
        eig = factor.eigvals.double().clamp_min(0) + lam
        dtype = factor.U.dtype
        self.a_fwd = ((rest / eig).sqrt() - 1).to(dtype)
        self.a_inv = ((eig / rest).sqrt() - 1).to(dtype)
        self.U = factor.U
        self._restored()

    def _restored(self) -> None:
        """The state packed into one buffer (``[U | a_fwd | a_inv]``) and ``V = U diag(a)``
        each way made into another (``[V_fwd | V_inv]``; a pure function of the state: a
        restored map gives the bits of the one it was saved from)."""
        d, k = self.U.shape
        self.packed = torch.cat([self.U.reshape(-1), self.a_fwd, self.a_inv])
        self.packed_V = self.packed.new_empty(2 * d * k)
        self._views(d, k)
        torch.mul(self.U, self.a_fwd, out=self.V_fwd)
        torch.mul(self.U, self.a_inv, out=self.V_inv)

    def _views(self, d: int, k: int) -> None:
        """The fields and ``V`` as views of :attr:`packed` and :attr:`packed_V`."""
        n = d * k
        self.U, self.a_fwd, self.a_inv = (self.packed[:n].view(d, k),
                                          self.packed[n : n + k], self.packed[n + k :])
        self.V_fwd, self.V_inv = self.packed_V[:n].view(d, k), self.packed_V[n:].view(d, k)

    @classmethod
    def chosen(cls, ok: torch.Tensor, fresh: LowRankInput, last: LowRankInput | None
               ) -> LowRankInput:
        """``fresh`` where the 0-dim ``ok`` holds, else ``last`` (the identity when ``None``:
        ``U = 0``, ``a = 0``), on the device: one ``torch.where`` over each buffer, ``V``
        chosen with the state (the bits of remaking it from the chosen state)."""
        chosen = cls.__new__(cls)
        pick = ((fresh.packed, 0.0), (fresh.packed_V, 0.0)) if last is None else \
            ((fresh.packed, last.packed), (fresh.packed_V, last.packed_V))
        chosen.packed, chosen.packed_V = (torch.where(ok, new, old) for new, old in pick)
        chosen._views(*fresh.U.shape)
        return chosen

    def _apply(self, G: torch.Tensor, V: torch.Tensor, out: torch.Tensor | None = None
               ) -> torch.Tensor:
        if G.dim() != 2:
            raise ValueError(f"{type(self).__name__} needs a 2-D gradient, got {tuple(G.shape)}")
        G = G.to(self.U.dtype)
        # G is read by the first GEMM before the second writes ``out`` (which may be G)
        return torch.addmm(G, G @ V, self.U.T, out=out)

    def forward(self, G: torch.Tensor) -> torch.Tensor:
        return self._apply(G, self.V_fwd)

    def inverse(self, Gt: torch.Tensor) -> torch.Tensor:
        return self._apply(Gt, self.V_inv)

    def forward_over(self, G: torch.Tensor) -> torch.Tensor:
        if G.dtype != self.U.dtype:  # the GEMM writes U's dtype
            return super().forward_over(G)
        return self._apply(G, self.V_fwd, out=G)

    def inverse_over(self, Gt: torch.Tensor) -> torch.Tensor:
        if Gt.dtype != self.U.dtype:  # the GEMM writes U's dtype
            return super().inverse_over(Gt)
        return self._apply(Gt, self.V_inv, out=Gt)

    def tensors(self) -> list[torch.Tensor]:
        return [self.U, self.a_fwd, self.a_inv, self.V_fwd, self.V_inv]


class DiagonalInput(Transform):
    name = "diag"
    fields = ("s_fwd", "s_inv")

    def __init__(self, A: torch.Tensor, damping: float) -> None:
        a = torch.diagonal(A).double().clamp_min(0)
        lam = _damping_of(float(a.sum()), a.numel(), damping)
        self.s_fwd = (a + lam).rsqrt().to(A.dtype)
        self.s_inv = (a + lam).sqrt().to(A.dtype)

    def forward(self, G: torch.Tensor) -> torch.Tensor:
        return G.to(self.s_fwd.dtype) * self.s_fwd

    def inverse(self, Gt: torch.Tensor) -> torch.Tensor:
        return Gt.to(self.s_inv.dtype) * self.s_inv

    def tensors(self) -> list[torch.Tensor]:
        return [self.s_fwd, self.s_inv]


class BlockInput(Transform):
    name = "block"
    fields = ("fwd", "inv")

    def _restored(self) -> None:
        self.bounds, lo = [], 0
        for m in self.fwd:
            self.bounds.append((lo, lo + m.shape[0]))
            lo += m.shape[0]

    def __init__(self, A: torch.Tensor, block: int, damping: float) -> None:
        d = A.shape[0]
        lam = _damping_of(float(torch.trace(A.double())), d, damping)
        self.bounds = [(i, min(i + block, d)) for i in range(0, d, block)]
        self.fwd, self.inv = [], []
        for lo, hi in self.bounds:
            f, i = _sym_powers(A[lo:hi, lo:hi], lam)
            self.fwd.append(f)
            self.inv.append(i)

    def _apply(self, G: torch.Tensor, mats: list[torch.Tensor]) -> torch.Tensor:
        G = G.to(mats[0].dtype)
        return torch.cat([G[:, lo:hi] @ m for (lo, hi), m in zip(self.bounds, mats)], dim=1)

    def forward(self, G: torch.Tensor) -> torch.Tensor:
        return self._apply(G, self.fwd)

    def inverse(self, Gt: torch.Tensor) -> torch.Tensor:
        return self._apply(Gt, self.inv)

    def tensors(self) -> list[torch.Tensor]:
        return self.fwd + self.inv


class OutputSide(Transform):
    name = "output"
    fields = ("fwd", "inv")

    def __init__(self, S: torch.Tensor, damping: float) -> None:
        self.fwd, self.inv = _sym_powers(S, _lam(S, damping))

    def forward(self, G: torch.Tensor) -> torch.Tensor:
        return self.fwd @ G.to(self.fwd.dtype)

    def inverse(self, Gt: torch.Tensor) -> torch.Tensor:
        return self.inv @ Gt.to(self.inv.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.fwd, self.inv]


class TwoSided(Transform):
    name = "kfac"
    fields = ("a_fwd", "a_inv", "s_fwd", "s_inv")

    def __init__(self, A: torch.Tensor, S: torch.Tensor, damping: float) -> None:
        self.a_fwd, self.a_inv = _sym_powers(A, _lam(A, damping))
        self.s_fwd, self.s_inv = _sym_powers(S, _lam(S, damping))

    def forward(self, G: torch.Tensor) -> torch.Tensor:
        return self.s_fwd @ G.to(self.a_fwd.dtype) @ self.a_fwd

    def inverse(self, Gt: torch.Tensor) -> torch.Tensor:
        return self.s_inv @ Gt.to(self.a_inv.dtype) @ self.a_inv

    def tensors(self) -> list[torch.Tensor]:
        return [self.a_fwd, self.a_inv, self.s_fwd, self.s_inv]


def _sylvester(b: int, dtype: torch.dtype) -> torch.Tensor:
    H = torch.ones(1, 1, dtype=dtype)
    while H.shape[0] < b:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    return H


class Hadamard(Transform):
    """Data-independent rotation: random signs and a block Hadamard along ``d_in``."""

    name = "hadamard"
    fields = ("signs", "H")

    def _restored(self) -> None:
        self.dim, self.block = self.signs.numel(), self.H.shape[0]

    def __init__(self, dim: int, max_block: int = 256, seed: int = 0,
                 dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        b = 1
        while dim % (2 * b) == 0 and 2 * b <= max_block:
            b *= 2
        self.dim, self.block = dim, b
        gen = torch.Generator().manual_seed(seed)  # drawn on the CPU: the same signs anywhere
        signs = torch.randint(0, 2, (dim,), generator=gen) * 2 - 1
        self.signs = signs.to(device=device, dtype=dtype)
        self.H = (_sylvester(b, dtype) / math.sqrt(b)).to(device)

    def _mix(self, G: torch.Tensor) -> torch.Tensor:
        blocks = G.reshape(G.shape[0], self.dim // self.block, self.block)
        return (blocks @ self.H).reshape(G.shape[0], self.dim)

    def forward(self, G: torch.Tensor) -> torch.Tensor:
        return self._mix(G.to(self.H.dtype) * self.signs)

    def inverse(self, Gt: torch.Tensor) -> torch.Tensor:
        return self._mix(Gt.to(self.H.dtype)) * self.signs  # H/√b is symmetric and orthogonal

    def tensors(self) -> list[torch.Tensor]:
        return [self.signs, self.H]


class RandomHadamard(Hadamard):
    """Random signs and a Hadamard over blocks of the codec's scale block ``block``
    (a power of two; smaller when ``d_in`` is not a multiple of it)."""

    name = "rht"

    def __init__(self, dim: int, block: int, seed: int = 0,
                 dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        if block < 1 or block & (block - 1):
            raise ValueError(f"the RHT block must be a power of two, got {block}")
        super().__init__(dim, max_block=block, seed=seed, dtype=dtype, device=device)


def rebase(residual: torch.Tensor, old: Transform, new: Transform) -> torch.Tensor:
    """Error-feedback residual in new coordinates with the same Euclidean meaning:
    ``R ← R T_old⁻¹ T_new``."""
    return new.forward(old.inverse(residual))


KINDS: dict[str, type[Transform]] = {
    cls.name: cls for cls in (Identity, LowRankInput, DiagonalInput, BlockInput, OutputSide,
                              TwoSided, Hadamard, RandomHadamard)
}


def transform_from_state(kind: str, state: dict[str, torch.Tensor]) -> Transform:
    """Rebuild a transform from :meth:`Transform.state` (``kind`` is its ``name``; ``full``
    is a low-rank map of full rank)."""
    if kind not in KINDS and kind != "full":
        raise ValueError(f"unknown transform kind {kind!r}; expected one of {list(KINDS)}")
    t = KINDS["lowrank" if kind == "full" else kind]._from_state(state)
    t.name = str(kind)  # plain: it goes into checkpoints
    return t
