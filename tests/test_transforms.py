"""Transforms: invertibility, explicit matrix forms, memory, Hadamard, rebase, FP8 premise."""

from __future__ import annotations

import pytest
import torch

from geofp8.codecs import FP8Codec
from geofp8.geometry.factory import make_transform
from geofp8.geometry.statistics import LowRankFactor, SecondMoment
from geofp8.geometry.transforms import (
    BlockInput,
    DiagonalInput,
    Hadamard,
    Identity,
    LowRankInput,
    OutputSide,
    TwoSided,
    rebase,
    transform_from_state,
)

F64 = torch.float64
D_IN, D_OUT = 24, 10
DAMPING = 0.01


def _full(A, damping):
    """The full input-side ``(A+λI)^{-1/2}`` from the library's factory."""
    return make_transform("full", damping, A=A)


def _psd(d, seed, rank=None, scale=1.0):
    """A random PSD matrix with a spread-out spectrum (rank ``rank`` if given)."""
    gen = torch.Generator().manual_seed(seed)
    r = d if rank is None else rank
    B = torch.randn(d, r, generator=gen, dtype=F64) * torch.logspace(1, -1, r, dtype=F64)
    return scale * (B @ B.T) / r


def _grad(rows, cols, seed=7):
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _lam(A, damping):
    return damping * float(torch.trace(A)) / A.shape[0]


def _scale(factor, lam):
    """``c = (σ²+λ)^{-1/2}``: a low-rank map sends ``G T / c`` and maps back with ``c T⁻¹``."""
    return float(factor.sigma2 + lam) ** -0.5


def _mat_pow(M, p):
    w, V = torch.linalg.eigh(0.5 * (M + M.T))
    return (V * w.clamp_min(0) ** p) @ V.T


def _all_transforms():
    A, S = _psd(D_IN, 1), _psd(D_OUT, 2)
    return {
        "identity": Identity(),
        "lowrank": LowRankInput(LowRankFactor.from_matrix(A, 5), DAMPING),
        "lowrank-k0": LowRankInput(LowRankFactor.from_matrix(A, 0), DAMPING),
        "full": _full(A, DAMPING),
        "diag": DiagonalInput(A, DAMPING),
        "block": BlockInput(A, 7, DAMPING),  # 24 = 7 + 7 + 7 + 3: a short last block
        "output": OutputSide(S, DAMPING),
        "kfac": TwoSided(A, S, DAMPING),
        "hadamard": Hadamard(D_IN, dtype=F64),
        "hadamard-odd": Hadamard(21, dtype=F64),
        "hadamard-96": Hadamard(96, dtype=F64),
    }


def _width(name):
    return {"hadamard-odd": 21, "hadamard-96": 96}.get(name, D_IN)


@pytest.mark.parametrize("name", list(_all_transforms()))
def test_inverse_recovers_input(name):
    T = _all_transforms()[name]
    G = _grad(D_OUT, _width(name))
    Gt = T.forward(G)
    assert Gt.shape == G.shape and Gt.dtype == F64
    assert _rel(T.inverse(Gt), G) < 1e-10
    assert _rel(T.forward(T.inverse(G)), G) < 1e-10
    if name == "lowrank-k0":  # T = c I, applied up to its scale: the identity, bitwise
        assert torch.equal(Gt, G)
    elif name != "identity":
        assert _rel(Gt, G) > 1e-3  # it really is a change of coordinates


@pytest.mark.parametrize("name", list(_all_transforms()))
@pytest.mark.parametrize("way", ["forward", "inverse"])
def test_a_map_written_over_its_input_has_the_bits_of_the_map(name, way):
    """The bucket maps each gradient in its slot and the decode maps the sum back in place
    (a low-rank map's GEMM writes over it): the same bits as ``forward`` / ``inverse``, in
    float64 and, restored from FP32 state, FP32."""
    T = _all_transforms()[name]
    G = _grad(D_OUT, _width(name))
    Y = G.clone()
    assert getattr(T, f"{way}_over")(Y) is Y and torch.equal(Y, getattr(T, way)(G))
    if isinstance(T, LowRankInput):
        T32 = transform_from_state("lowrank", {k: v.float() for k, v in T.state().items()})
        Y32, G32 = G.float().clone(), G.float()
        getattr(T32, f"{way}_over")(Y32)
        assert torch.equal(Y32, getattr(T32, way)(G32))


def test_lowrank_with_full_rank_is_the_damped_inverse_square_root():
    A = _psd(D_IN, 3)
    for damping in (0.0, 1e-3, 0.1, 1.0):
        lam = _lam(A, damping)
        T = LowRankInput(LowRankFactor.from_matrix(A, D_IN), damping)
        F = _full(A, damping)
        G = _grad(D_OUT, D_IN)
        I = torch.eye(D_IN, dtype=F64)
        if damping == 0.0:  # λ is floored at 1e-12·tr/d so that A + λI is never singular
            lam = 1e-12 * float(torch.trace(A)) / D_IN
        expected = _mat_pow(A + lam * I, -0.5)
        # two eigendecompositions in fp64 agree to ~eps·cond(A + λI) on (A + λI)^{-1/2}
        w = torch.linalg.eigvalsh(A) + lam
        tol = max(1e-10, 1e-15 * float(w.max() / w.min()))
        c = _scale(LowRankFactor.from_matrix(A, D_IN), lam)
        assert _rel(T.forward(I) * c, expected) < tol
        assert _rel(F.forward(G), T.forward(G)) < 1e-12
        assert _rel(T.forward(G) * c, G @ expected) < tol
        assert _rel(T.inverse(I) / c, _mat_pow(A + lam * I, 0.5)) < 1e-10


@pytest.mark.parametrize("k", [1, 4, 12, 23])
def test_lowrank_equals_its_explicit_matrix(k):
    d = D_IN
    A = _psd(d, 4)
    f = LowRankFactor.from_matrix(A, k)
    lam = _lam(A, DAMPING)
    w = torch.linalg.eigvalsh(A).flip(0)
    sigma2 = float(w[k:].sum()) / (d - k)  # mean of the discarded eigenvalues
    assert f.sigma2 == pytest.approx(sigma2, rel=1e-10)
    U, I = f.U, torch.eye(d, dtype=F64)
    P = U @ U.T
    T_fwd = (U * (f.eigvals + lam) ** -0.5) @ U.T + (sigma2 + lam) ** -0.5 * (I - P)
    T_inv = (U * (f.eigvals + lam) ** 0.5) @ U.T + (sigma2 + lam) ** 0.5 * (I - P)
    T = LowRankInput(f, DAMPING)
    G = _grad(D_OUT, d)
    c = (sigma2 + lam) ** -0.5  # applied up to the complement's scale: G T / c, c G T⁻¹
    assert _rel(T.forward(G) * c, G @ T_fwd) < 1e-12
    assert _rel(T.inverse(G) / c, G @ T_inv) < 1e-12


def test_lowrank_never_materialises_a_d_by_d_matrix():
    d, k = 4096, 8
    gen = torch.Generator().manual_seed(0)
    U, _ = torch.linalg.qr(torch.randn(d, k, generator=gen))
    f = LowRankFactor(U, torch.linspace(10, 1, k), trace=100.0, dim=d)
    T = LowRankInput(f, DAMPING)
    assert all(t.numel() <= d * k for t in T.tensors())
    assert T.nbytes <= (3 * d * k + 2 * k) * 4  # U and U diag(a) each way
    G = torch.randn(3, d, generator=gen)
    assert _rel(T.inverse(T.forward(G)).double(), G.double()) < 1e-5  # fp32 factor


@pytest.mark.parametrize("width,block", [(64, 64), (96, 32), (21, 1), (1, 1), (768, 256),
                                         (1024, 256)])
def test_hadamard_is_orthogonal_and_deterministic(width, block):
    H = Hadamard(width, dtype=F64)
    assert H.block == block
    I = torch.eye(width, dtype=F64)
    M = H.forward(I)
    assert torch.allclose(M.T @ M, I, atol=1e-12)  # orthogonal: preserves every norm
    G = _grad(5, width)
    assert torch.allclose(H.forward(G).norm(dim=1), G.norm(dim=1), rtol=1e-12)
    assert torch.allclose(H.inverse(I), M.T, atol=1e-12)  # inverse is the transpose
    again = Hadamard(width, dtype=F64)
    assert all(torch.equal(a, b) for a, b in zip(H.tensors(), again.tensors()))
    assert torch.equal(H.forward(G), again.forward(G))
    if width > 1:  # another seed: other signs, same orthogonality
        other = Hadamard(width, seed=1, dtype=F64)
        assert not torch.equal(other.signs, H.signs)


def test_hadamard_mixes_columns():
    """A gradient concentrated in one column spreads over the whole Hadamard block."""
    H = Hadamard(64, dtype=F64)
    G = torch.zeros(2, 64, dtype=F64)
    G[:, 3] = 1.0
    out = H.forward(G)
    assert torch.allclose(out.abs(), torch.full_like(out, 1 / 8))


def test_diagonal_block_output_two_sided_explicit_forms():
    A, S = _psd(D_IN, 5), _psd(D_OUT, 6)
    G = _grad(D_OUT, D_IN)
    lam_a, lam_s = _lam(A, DAMPING), _lam(S, DAMPING)
    Ia, Is = torch.eye(D_IN, dtype=F64), torch.eye(D_OUT, dtype=F64)
    diag = torch.diagonal(A)
    assert _rel(DiagonalInput(A, DAMPING).forward(G), G * (diag + lam_a).rsqrt()) < 1e-12
    blocks = [(0, 10), (10, 20), (20, 24)]
    expected = torch.cat([G[:, lo:hi] @ _mat_pow(A[lo:hi, lo:hi] + lam_a * torch.eye(hi - lo,
                                                                                     dtype=F64),
                                                 -0.5) for lo, hi in blocks], dim=1)
    assert _rel(BlockInput(A, 10, DAMPING).forward(G), expected) < 1e-10
    assert _rel(OutputSide(S, DAMPING).forward(G), _mat_pow(S + lam_s * Is, -0.5) @ G) < 1e-10
    kfac = _mat_pow(S + lam_s * Is, -0.5) @ G @ _mat_pow(A + lam_a * Ia, -0.5)
    assert _rel(TwoSided(A, S, DAMPING).forward(G), kfac) < 1e-10


@pytest.mark.parametrize("name", ["lowrank", "full", "diag", "block", "hadamard"])
def test_input_side_transforms_commute_with_row_sharding(name):
    T = _all_transforms()[name]
    G = _grad(D_OUT, D_IN)
    full = T.forward(G)
    parts = torch.cat([T.forward(G[lo:hi]) for lo, hi in [(0, 3), (3, 4), (4, D_OUT)]])
    assert torch.allclose(parts, full, rtol=0, atol=1e-12 * float(full.abs().max()))


@pytest.mark.parametrize("name", ["lowrank", "full", "diag", "block", "hadamard"])
def test_one_row_gradients(name):
    T = _all_transforms()[name]
    G = _grad(1, D_IN)
    out = T.forward(G)
    assert out.shape == (1, D_IN)
    assert _rel(T.inverse(out), G) < 1e-10


def test_rebase_keeps_the_euclidean_meaning():
    A_old, A_new = _psd(D_IN, 8), _psd(D_IN, 9, rank=6)
    pairs = [
        (LowRankInput(LowRankFactor.from_matrix(A_old, 4), DAMPING),
         LowRankInput(LowRankFactor.from_matrix(A_new, 4), DAMPING)),
        (Identity(), _full(A_new, 0.1)),
        (DiagonalInput(A_old, DAMPING), Hadamard(D_IN, dtype=F64)),
        (BlockInput(A_old, 5, DAMPING), Identity()),
        (TwoSided(A_old, _psd(D_OUT, 1), DAMPING), OutputSide(_psd(D_OUT, 2), DAMPING)),
    ]
    R = _grad(D_OUT, D_IN, seed=3)
    for old, new in pairs:
        moved = rebase(R, old, new)
        assert _rel(new.inverse(moved), old.inverse(R)) < 1e-10
        # error feedback after a refresh: residual + a new gradient, mapped back, is the same
        G = _grad(D_OUT, D_IN, seed=4)
        assert _rel(new.inverse(new.forward(G) + moved), G + old.inverse(R)) < 1e-10


def _anisotropic_layer(d_in=256, d_out=64, n=1024, seed=0):
    """G = Δᵀ X for tokens X with 8 dominant input directions (a strongly anisotropic A)."""
    gen = torch.Generator().manual_seed(seed)
    spec = torch.cat([torch.logspace(3, 2, 8, dtype=F64), torch.full((d_in - 8,), 1e-2,
                                                                     dtype=F64)])
    Q, _ = torch.linalg.qr(torch.randn(d_in, d_in, generator=gen, dtype=F64))
    X = (torch.randn(n, d_in, generator=gen, dtype=F64) * spec.sqrt()) @ Q.T
    delta = torch.randn(n, d_out, generator=gen, dtype=F64)
    return delta.T @ X, X


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("scaling", ["tensor", "row", "block"])
def test_whitening_reduces_fp8_error_on_anisotropic_inputs(fmt, scaling):
    """The method's premise: with A from the same tokens, input-side whitening cuts the FP8
    round-trip error of G (measured in the original coordinates) well below Euclidean."""
    G, X = _anisotropic_layer()
    stats = SecondMoment(X.shape[1], "exact", dtype=F64)
    stats.update(X)
    codec = FP8Codec(fmt, scaling, 64)

    def round_trip_error(T):
        back = T.inverse(codec.round_trip(T.forward(G)).double())
        return _rel(back, G)

    euclid = round_trip_error(Identity())
    assert euclid > 0.01  # the mantissa floor of FP8
    low_rank = round_trip_error(LowRankInput(stats.factor(16), 0.1))
    assert low_rank < 0.6 * euclid
    assert round_trip_error(_full(stats.mean(), 0.1)) < 0.6 * euclid
    # and a rotation alone does not change the floor much (no geometry, no gain)
    assert round_trip_error(Hadamard(X.shape[1], dtype=F64)) > 0.8 * euclid


def test_zero_statistics_give_a_finite_invertible_transform():
    d = 16
    G = _grad(5, d).float()
    Z, Zs = torch.zeros(d, d), torch.zeros(5, 5)
    transforms = [
        LowRankInput(SecondMoment(d, "exact").factor(4), DAMPING),
        LowRankInput(SecondMoment(d, "sketch", sketch_size=8).factor(4), DAMPING),
        _full(Z, DAMPING),
        DiagonalInput(Z, DAMPING),
        BlockInput(Z, 4, DAMPING),
        OutputSide(Zs, DAMPING),
        TwoSided(Z, Zs, DAMPING),
    ]
    for T in transforms:
        assert all(torch.isfinite(t).all() for t in T.tensors())
        out = T.forward(G)
        assert torch.isfinite(out).all()
        assert _rel(T.inverse(out).double(), G.double()) < 1e-6
        back = T.inverse(FP8Codec("e4m3").round_trip(out))
        assert torch.isfinite(back).all() and _rel(back.double(), G.double()) < 2**-4


def test_fp32_transforms_on_low_precision_gradients():
    A = _psd(D_IN, 10).float()
    G = _grad(D_OUT, D_IN).to(torch.bfloat16)
    for T in (LowRankInput(LowRankFactor.from_matrix(A, 4), DAMPING), DiagonalInput(A, DAMPING),
              Hadamard(D_IN)):
        out = T.forward(G)
        assert out.dtype == torch.float32
        assert _rel(T.inverse(out).double(), G.double()) < 1e-5


def test_lowrank_needs_a_matrix():
    T = _all_transforms()["lowrank"]
    with pytest.raises(ValueError):
        T.forward(torch.zeros(D_IN, dtype=F64))
    assert torch.allclose((1 + T.a_fwd) * (1 + T.a_inv), torch.ones_like(T.a_fwd))


def test_a_lowrank_map_is_chosen_with_one_where_a_buffer_and_the_bits_of_remaking_it():
    """``LowRankInput.chosen`` (a fresh or local source's choice between this step's map
    and the last, on the device): two ``torch.where`` launches whatever the map's size
    (the state's buffer and V's), and the chosen map is bit for bit the one its state
    would make again; with no last map the identity (U = 0, a = 0)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    fresh, last = (LowRankInput(LowRankFactor.from_matrix(_psd(D_IN, seed).float(), 5), DAMPING)
                   for seed in (20, 21))
    G = _grad(D_OUT, D_IN).float()
    for ok, other, want in ((True, last, fresh), (False, last, last), (False, None, None)):
        flag = torch.tensor(ok)
        with Ops() as counted:
            chosen = LowRankInput.chosen(flag, fresh, other)
        launched = [op for op in counted.ops if not op.startswith(  # views; the identity's 0:
            ("aten.view.", "aten.slice.", "aten.scalar_tensor."))]   # a host scalar
        assert launched == ["aten.where.self"] * 2, counted.ops
        remade = transform_from_state(chosen.name, {k: v.clone()
                                                    for k, v in chosen.state().items()})
        for field in ("U", "a_fwd", "a_inv", "V_fwd", "V_inv"):
            assert torch.equal(getattr(chosen, field), getattr(remade, field)), field
            if want is not None:
                assert torch.equal(getattr(chosen, field), getattr(want, field)), field
        if want is None:
            assert torch.equal(chosen.forward(G), G)  # the identity
