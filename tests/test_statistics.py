"""Input statistics: exact / EMA accumulation, sum-combinability, the Nyström sketch."""

from __future__ import annotations

import pytest
import torch

from geofp8.geometry.statistics import LowRankFactor, SecondMoment, nystrom_factor

F64 = torch.float64


def _batches(d, sizes, seed=0, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(d, d, generator=gen, dtype=F64)
    return [(torch.randn(n, d, generator=gen, dtype=F64) @ mix).to(dtype) for n in sizes]


def _spiked(d, n, top, noise, seed=0):
    """Tokens whose covariance has eigenvalues ``top`` (descending) + ``noise`` elsewhere,
    in a random orthonormal basis ``Q``; returns (X, Q)."""
    gen = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=F64))
    spec = torch.cat([torch.as_tensor(top, dtype=F64), torch.full((d - len(top),), noise,
                                                                  dtype=F64)])
    return (torch.randn(n, d, generator=gen, dtype=F64) * spec.sqrt()) @ Q.T, Q


def _close(a, b, rtol):
    return float((a - b).norm() / b.norm()) <= rtol


def test_exact_mean_over_several_updates():
    d = 12
    xs = _batches(d, [5, 17, 1, 40])
    sm = SecondMoment(d, "exact", dtype=F64)
    for i, x in enumerate(xs):
        # any leading shape is flattened into tokens
        sm.update(x.reshape(1, -1, d) if i % 2 else x)
    X = torch.cat(xs)
    assert float(sm.weight) == X.shape[0]
    assert _close(sm.mean(), X.T @ X / X.shape[0], 1e-12)
    assert sm.trace() == pytest.approx(float((X * X).sum()) / X.shape[0], rel=1e-12)
    assert sm.trace() == pytest.approx(float(torch.trace(sm.mean())), rel=1e-12)


def test_decay_is_the_ema_formula():
    d, beta = 6, 0.7
    xs = _batches(d, [4, 9, 3, 11, 2], seed=1)
    sm = SecondMoment(d, "exact", decay=beta, dtype=F64)
    for x in xs:
        sm.update(x)
    t = len(xs) - 1
    num = sum(beta ** (t - s) * x.T @ x for s, x in enumerate(xs))
    den = sum(beta ** (t - s) * x.shape[0] for s, x in enumerate(xs))
    assert float(sm.weight) == pytest.approx(den, rel=1e-12)
    assert _close(sm.mean(), num / den, 1e-12)
    tr = sum(beta ** (t - s) * float((x * x).sum()) for s, x in enumerate(xs)) / den
    assert sm.trace() == pytest.approx(tr, rel=1e-12)
    # the newest batch weighs more than under a running mean
    plain = SecondMoment(d, "exact", dtype=F64)
    for x in xs:
        plain.update(x)
    last = xs[-1].T @ xs[-1] / xs[-1].shape[0]
    assert (sm.mean() - last).norm() < (plain.mean() - last).norm()


def test_invalid_arguments():
    with pytest.raises(ValueError):
        SecondMoment(4, mode="dense")
    with pytest.raises(ValueError):
        SecondMoment(4, decay=0.0)
    with pytest.raises(ValueError):
        SecondMoment(4, decay=1.5)
    with pytest.raises(RuntimeError):
        SecondMoment(4, mode="sketch").mean()


@pytest.mark.parametrize("mode", ["exact", "sketch"])
def test_tensors_combine_by_summation(mode):
    """Two ranks' accumulators, summed tensor by tensor (a SUM all-reduce), describe the
    union of their tokens."""
    d = 10
    xa, xb = _batches(d, [7, 23], seed=2)
    a = SecondMoment(d, mode, sketch_size=6, dtype=F64, seed=5)
    b = SecondMoment(d, mode, sketch_size=6, dtype=F64, seed=5)
    union = SecondMoment(d, mode, sketch_size=6, dtype=F64, seed=5)
    a.update(xa)
    b.update(xb)
    union.update(torch.cat([xa, xb]))
    for ta, tb in zip(a.tensors(), b.tensors()):
        ta.add_(tb)  # in place, exactly what dist.all_reduce(SUM) does
    for ta, tu in zip(a.tensors(), union.tensors()):
        assert torch.allclose(ta, tu, rtol=1e-12, atol=0)
    X = torch.cat([xa, xb])
    if mode == "exact":
        assert _close(a.mean(), X.T @ X / X.shape[0], 1e-12)
    else:
        assert _close(a.total / a.weight, (X.T @ X / X.shape[0]) @ a.omega, 1e-12)
    assert a.trace() == pytest.approx(union.trace(), rel=1e-12)


def test_reset():
    sm = SecondMoment(5, "sketch", sketch_size=3)
    sm.update(torch.randn(4, 5))
    sm.reset()
    assert all(float(t.abs().sum()) == 0 for t in sm.tensors())
    assert sm.omega.abs().sum() > 0  # Ω is not statistics: it stays


def test_sketch_memory_is_linear_in_d():
    d, l = 2048, 24
    sk = SecondMoment(d, "sketch", sketch_size=l)
    # total (d×l) + Ω (d×l) + two scalars, fp32
    assert sk.nbytes == 2 * d * l * 4 + 2 * 4
    assert sk.total.shape == (d, l) and sk.omega.shape == (d, l)
    assert all(t.numel() <= d * l for t in sk.tensors())
    ex = SecondMoment(256, "exact")
    assert ex.nbytes == 256 * 256 * 4 + 2 * 4
    assert SecondMoment(8, "sketch", sketch_size=40).omega.shape == (8, 8)  # l capped at d


def test_same_seed_same_omega():
    a = SecondMoment(33, "sketch", sketch_size=7, seed=11)
    b = SecondMoment(33, "sketch", sketch_size=7, seed=11)
    c = SecondMoment(33, "sketch", sketch_size=7, seed=12)
    assert torch.equal(a.omega, b.omega)
    assert not torch.equal(a.omega, c.omega)
    # fp32 and fp64 accumulators draw the same Ω (drawn in fp64, then cast)
    d64 = SecondMoment(33, "sketch", sketch_size=7, seed=11, dtype=F64)
    assert torch.equal(d64.omega.float(), a.omega)


def _subspace_distance(U_ref, U):
    """‖(I − U Uᵀ) U_ref‖₂ = sin of the largest principal angle."""
    U_ref, U = U_ref.double(), U.double()
    return float(torch.linalg.matrix_norm(U_ref - U @ (U.T @ U_ref), 2))


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_sketched_factor_matches_exact_on_low_rank_plus_noise(dtype):
    d, k = 192, 8
    X, Q = _spiked(d, 4000, torch.linspace(100, 20, k), noise=0.05, seed=0)
    exact = SecondMoment(d, "exact", dtype=dtype)
    sketch = SecondMoment(d, "sketch", sketch_size=40, dtype=dtype, seed=3)
    for chunk in X.split(999):
        exact.update(chunk)
        sketch.update(chunk)
    fe, fs = exact.factor(k), sketch.factor(k)
    assert fs.U.shape == (d, k) and fs.eigvals.shape == (k,) and fs.dim == d
    assert fs.U.dtype == dtype
    ev_e, ev_s = fe.eigvals.double(), fs.eigvals.double()
    assert torch.all(ev_s[:-1] >= ev_s[1:])  # descending
    assert float(((ev_s - ev_e).abs() / ev_e).max()) < 0.03
    assert _subspace_distance(fe.U, fs.U) < 0.02
    assert float((fs.U.T.double() @ fs.U.double() - torch.eye(k, dtype=F64)).abs().max()) < 1e-5
    assert fs.trace == pytest.approx(fe.trace, rel=1e-5)
    # σ² is the trace left over by the top k: it moves only by what the eigenvalues miss
    slack = float((ev_e - ev_s).abs().sum()) + 1e-5 * fe.trace
    assert abs(fs.sigma2 - fe.sigma2) * (d - k) <= slack
    if dtype == F64:
        # Nyström never overestimates (Â ≼ A): eigenvalues at most the exact ones
        assert torch.all(ev_s <= ev_e * (1 + 1e-9))


def test_nystrom_is_exact_when_rank_fits_the_sketch():
    d, r = 64, 10
    gen = torch.Generator().manual_seed(4)
    B = torch.randn(d, r, generator=gen, dtype=F64)
    A = B @ B.T
    omega = torch.randn(d, 24, generator=gen, dtype=F64)
    f = nystrom_factor(A @ omega, omega, r, float(torch.trace(A)))
    ref = LowRankFactor.from_matrix(A, r)
    assert torch.allclose(f.eigvals, ref.eigvals, rtol=1e-8)
    A_hat = (f.U * f.eigvals) @ f.U.T
    assert _close(A_hat, A, 1e-8)
    assert f.sigma2 == pytest.approx(0.0, abs=1e-8 * float(torch.trace(A)))


@pytest.mark.parametrize("d,rank,n", [(64, 5, 300), (256, 10, 2000), (40, 10, 100),
                                      (128, 39, 1000)])
def test_fp32_sketch_of_a_rank_deficient_matrix(d, rank, n):
    """Regression: rank(A) < l with fp32 accumulation makes Ωᵀ(AΩ) indefinite by round-off;
    the fallback clamped those eigenvalues to ν ≈ 1e-16·‖Y‖ and divided the fp32 noise by
    √ν, giving eigenvalues 50-800× too large and a random subspace. Few tokens per step
    (n < l) or low-rank activations hit this on every refresh."""
    gen = torch.Generator().manual_seed(d + rank)
    B = torch.randn(rank, d, generator=gen, dtype=F64) * torch.logspace(0, -1, rank,
                                                                        dtype=F64)[:, None]
    X = torch.randn(n, rank, generator=gen, dtype=F64) @ B * 3
    exact = SecondMoment(d, "exact", dtype=F64)
    sketch = SecondMoment(d, "sketch", sketch_size=40, seed=1)  # default fp32
    exact.update(X)
    sketch.update(X)
    k = min(rank, 8)
    fe, fs = exact.factor(k), sketch.factor(k)
    assert fs.rank == k
    ev_e, ev_s = fe.eigvals, fs.eigvals.double()
    # fp32 statistics: eigenvalues good to ~1e-7·cond relative to the largest
    assert float((ev_s - ev_e).abs().max() / ev_e.max()) < 1e-3
    assert _subspace_distance(fe.U, fs.U) < 0.02


def test_factor_of_empty_statistics_is_finite():
    for mode in ("exact", "sketch"):
        f = SecondMoment(16, mode, sketch_size=8).factor(4)
        assert torch.isfinite(f.U).all() and torch.isfinite(f.eigvals).all()
        assert float(f.eigvals.abs().max()) == 0.0 and f.trace == 0.0


def test_low_rank_factor_from_matrix():
    d = 20
    X, Q = _spiked(d, 50, [9.0, 4.0, 1.0], noise=0.0, seed=6)
    A = X.T @ X / 50
    f = LowRankFactor.from_matrix(A, 3)
    w = torch.linalg.eigvalsh(A).flip(0)
    assert torch.allclose(f.eigvals, w[:3], rtol=1e-10)
    assert f.rank == 3 and f.dim == d
    assert f.trace == pytest.approx(float(torch.trace(A)), rel=1e-12)
    assert f.sigma2 == pytest.approx(float(w[3:].sum()) / (d - 3), rel=1e-8, abs=1e-14)
    assert torch.allclose(A @ f.U, f.U * f.eigvals, atol=1e-10 * float(w[0]))
    full = LowRankFactor.from_matrix(A, 100)  # k capped at d
    assert full.rank == d and full.sigma2 == 0.0
