"""Reliability (issue 6): non-finite steps, edge tensors, misconfiguration, a killed rank,
checkpoints, the real collective on extreme values, and the memory that ``stats()`` reports.

What each fault produces is summarised in ``docs/failure-behaviour.md``; every statement
there names the test below that proves it. Multi-process tests run on gloo over loopback
with bounded timeouts (``run_ranks``, or :func:`_spawn_bounded` where a rank must die).
"""

import datetime
import functools
import hashlib
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils import _pytree as pytree

from distributed import _context, _free_port, run_ranks
from geofp8 import GeoFP8Config, GeoFP8State, geofp8_hook
from geofp8.codecs import FP8Codec
from geofp8.comm import (
    Communicator,
    ShardLayout,
    decode,
    encode,
    exact_allreduce,
    simulate_exact_allreduce,
)
from geofp8.comm.group import DeviceGroup
from geofp8.ddp import backend_of
from geofp8.feedback import ErrorFeedback
from geofp8.geometry.transforms import Identity
from toymodels import batch, loss_fn, make_model

U_ROUND = {"e4m3": 2.0**-4, "e5m2": 2.0**-3}  # unit round-off of the FP8 formats
U_STORAGE = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def _overflow(grad: torch.Tensor) -> torch.Tensor:
    """A gradient hook: one element of this layer's gradient becomes +inf (an overflow)."""
    grad = grad.clone()
    grad.view(-1)[0] = float("inf")
    return grad


def _poison_nan(grad: torch.Tensor) -> torch.Tensor:
    return grad * float("nan")


def _all_finite(model) -> bool:
    return all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()
               if p.grad is not None)


# == 1. Non-finite gradients ===============================================================


def as_if_skipped(state) -> None:
    """What a skipped step leaves (docs/failure-behaviour.md), done by hand: the decisions
    due at its start taken, every residual reset to zero, the step clock one step on."""
    engine = state.engine
    engine.pipeline.start_step(engine.step)
    for feedback in engine.feedbacks.values():
        for name in feedback.residuals:
            feedback.finite[name] = torch.tensor(False)
    engine.ledger.step += 1


def _poison_run(rank, kw, poison, bad, steps):
    """Train ``steps`` batches; at batch ``poison`` rank 1's ``blocks.0.up`` gradient goes
    non-finite (``bad``: "inf" or "nan"). With ``bad=None``, the clean twin: that batch never
    happens, and the state is left as a skipped step leaves it (:func:`as_if_skipped`)."""
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.01)
    state = GeoFP8State(model, GeoFP8Config(**kw))
    ddp.register_comm_hook(state, geofp8_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    saw_bad, transforms = [], []
    for step in range(steps):
        if bad is None and step == poison:
            as_if_skipped(state)  # the clean twin: this batch never happens
            continue
        opt.zero_grad()
        handle = None
        if bad is not None and step == poison and rank == 1:
            handle = model.blocks[0]["up"].weight.register_hook(
                _overflow if bad == "inf" else _poison_nan)
        loss_fn(ddp, step, rank).backward()
        finite = _all_finite(model)
        saw_bad.append(not finite)
        if finite:
            opt.step()
        if handle is not None:
            handle.remove()
        maps = state.pipeline.transforms()
        transforms.append(_digest(t for n in sorted(maps) for t in maps[n].tensors()))
    stats = state.stats()
    residuals = state.pipeline.feedback.residuals
    return {"params": _digest(model.parameters()), "saw_bad": saw_bad,
            "step": stats["step"], "skipped": stats["skipped_steps"],
            "transforms": transforms[-1],
            "selected": sorted(state.pipeline.selection.selected),
            "residuals": _digest(residuals[n] for n in sorted(residuals)),
            "profile": getattr(state.pipeline.selection, "totals", torch.zeros(0)).tolist()}


POISON_CASES = {
    # Inf at a refresh step (state.step 4 = refresh_every·2) of the auto selection, exact path
    "inf-refresh-auto": ({"layers": "auto", "refresh_every": 2}, 4, "inf"),
    # NaN with the all-gather collective and two-sided factors (output-side statistics too)
    "nan-allgather-kfac": ({"layers": "all", "refresh_every": 2, "collective": "allgather",
                            "transform": "kfac"}, 3, "nan"),
    # during the paper's profiling window: the scores of the skipped step must not count
    "nan-profiling": ({"layers": "profile", "refresh_every": 2, "profile_steps": 4}, 2, "nan"),
    # during FP32 warm-up (plain all-reduce): only the affected elements are non-finite
    "inf-warmup": ({"layers": "all", "refresh_every": 2, "warmup_steps": 3}, 1, "inf"),
    # this step's factors (sketched in the forward) and each sender's own factor
    "nan-fresh-auto": ({"layers": "auto", "refresh_every": 2, "factor_source": "fresh"}, 4,
                       "nan"),
    "inf-local": ({"layers": "all", "factor_source": "local"}, 2, "inf"),
}
POISON_STEPS = 7


def _poison_worker(rank, world_size):
    return {case: (_poison_run(rank, kw, poison, bad, POISON_STEPS),
                   _poison_run(rank, kw, poison, None, POISON_STEPS))
            for case, (kw, poison, bad) in POISON_CASES.items()}


@functools.cache
def _poison_results():
    return run_ranks(_poison_worker, 2, timeout=180)  # one launch for every case


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(POISON_CASES))
def test_nonfinite_step_is_seen_everywhere_and_only_resets_its_residuals(case):
    steps, poison = POISON_STEPS, POISON_CASES[case][1]
    for out in _poison_results():
        poisoned, clean = out[case]
        expected = [False] * steps
        expected[poison] = True
        assert poisoned["saw_bad"] == expected  # every rank sees it, at that step only
        assert (poisoned["step"], poisoned["skipped"]) == (steps - 1, 1)
        assert (clean["step"], clean["skipped"]) == (steps, 0)  # the clock went on by hand
        for key in ("params", "transforms", "selected", "residuals", "profile"):
            assert poisoned[key] == clean[key], key


def _nan_residual_run(rank, storage, inject, steps=6, bad=3):
    """Train ``steps`` batches of fp8-ef over ``storage`` residuals. ``inject``: before batch
    ``bad``, rank 1's residuals turn NaN (a corrupted state); else the twin, in which that
    batch never happens and the state is left as a skipped step leaves it."""
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.01)
    state = GeoFP8State(model, GeoFP8Config(layers="none"))
    if storage != "fp32":
        state.engine.pipeline.feedback = state.engine.feedbacks["sender"] = ErrorFeedback(
            storage)
    ddp.register_comm_hook(state, geofp8_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    finite = []
    for step in range(steps):
        feedback = state.pipeline.feedback
        if step == bad and not inject:
            as_if_skipped(state)
            continue
        if step == bad and rank == 1:
            for stored in feedback.residuals.values():
                for t in pytree.tree_leaves(stored):
                    if isinstance(t, torch.Tensor):  # uint8 codes: NaN scales, -6 values
                        t.fill_(float("nan") if t.is_floating_point() else 0xFF)
        opt.zero_grad()
        loss_fn(ddp, step, rank).backward()
        finite.append(_all_finite(model))
        if finite[-1]:
            opt.step()
    residuals = state.pipeline.feedback.state_dict()["residuals"]
    return {"params": _digest(model.parameters()), "finite": finite,
            "residuals": _digest(t for n in sorted(residuals)
                                 for t in pytree.tree_leaves(residuals[n])
                                 if isinstance(t, torch.Tensor)),
            "skipped": state.stats()["skipped_steps"]}


def _nan_residual_worker(rank, world_size):
    return {storage: (_nan_residual_run(rank, storage, True),
                      _nan_residual_run(rank, storage, False))
            for storage in ("fp32", "fp8", "nvfp4")}


@pytest.mark.distributed
def test_nan_residuals_recover_within_one_step_as_if_zeroed_there():
    """A state whose residuals turned NaN (a bad checkpoint, a corrupted buffer) costs one
    skipped step: that step resets them to zero, and the run goes on bit for bit like a
    run whose residuals were zeroed at that step."""
    for out in run_ranks(_nan_residual_worker, 2, timeout=180):
        for storage, (injected, twin) in out.items():
            assert injected["finite"] == [True, True, True, False, True, True], storage
            assert injected["skipped"] == 1 and twin["skipped"] == 0, storage
            assert injected["params"] == twin["params"], storage
            assert injected["residuals"] == twin["residuals"], storage


def _scaler_run(rank, kw, bad_step, clean, steps=6):
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.01)
    state = GeoFP8State(model, GeoFP8Config(**kw))
    ddp.register_comm_hook(state, geofp8_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    log = []
    for step in range(steps):
        if clean and step == bad_step:
            # the run that never saw the bad batch, at the scale the skip would have left
            scaler.update(scaler.get_scale() * scaler.get_backoff_factor())
            as_if_skipped(state)
            continue
        opt.zero_grad()
        handle = None
        if not clean and step == bad_step and rank == 1:
            handle = model.blocks[0]["up"].weight.register_hook(_overflow)
        before = _digest(model.parameters())
        scaler.scale(loss_fn(ddp, step, rank)).backward()
        finite = _all_finite(model)
        scaler.step(opt)
        scaler.update()
        log.append((step, finite, before == _digest(model.parameters()), scaler.get_scale()))
        if handle is not None:
            handle.remove()
    return _digest(model.parameters()), log, state.stats()["step"], state.stats()["skipped_steps"]


def _scaler_worker(rank, world_size, kw, bad_step):
    return _scaler_run(rank, kw, bad_step, False), _scaler_run(rank, kw, bad_step, True)


@pytest.mark.distributed
def test_grad_scaler_skips_an_overflow_on_every_rank():
    kw = {"layers": "all", "refresh_every": 2}
    out = run_ranks(_scaler_worker, 2, (kw, 3), timeout=120)
    for (params, log, step, skipped), (clean_params, _, clean_step, _) in out:
        bad = [entry for entry in log if entry[0] == 3][0]
        assert bad[1] is False  # the overflow of rank 1 reached rank 0 too
        assert bad[2] is True  # the scaler skipped the optimizer step: parameters unchanged
        assert bad[3] == 2.0**9  # and backed the scale off
        assert all(entry[1] and not entry[2] for entry in log if entry[0] != 3)
        assert (step, skipped) == (5, 1) and clean_step == 6
        assert params == clean_params  # the next steps are those of a run without the bad one
    assert out[0][0][0] == out[1][0][0]


def _loss_scale_worker(rank, world_size):
    """Two runs whose loss scales differ by a power of two from step 3 on (as after a
    GradScaler back-off). FP8 with amax scales is exactly invariant to a power-of-two factor,
    so the unscaled gradients, hence the parameters, should be bit-identical."""
    return {ef: _loss_scale_runs(rank, ef) for ef in (False, True)}


@functools.cache
def _loss_scale_results():
    return run_ranks(_loss_scale_worker, 2, timeout=120)


def _loss_scale_runs(rank, error_feedback):
    digests = []
    for change in (False, True):
        model = make_model()
        ddp = DDP(model, bucket_cap_mb=0.01)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
        state = GeoFP8State(model, GeoFP8Config(layers="none", error_feedback=error_feedback),
                            grad_scaler=scaler)
        ddp.register_comm_hook(state, geofp8_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(6):
            if change and step == 3:
                scaler.update(2.0**9)
            opt.zero_grad()
            scaler.scale(loss_fn(ddp, step, rank)).backward()
            scaler.step(opt)
            scaler.update()
        digests.append(_digest(model.parameters()))
    return digests


@pytest.mark.distributed
@pytest.mark.parametrize("error_feedback", [False, True])
def test_loss_scale_change_is_invisible_to_the_optimizer(error_feedback):
    for out in _loss_scale_results():
        constant, changed = out[error_feedback]
        assert constant == changed


# == 2. Edge tensors ======================================================================


class EdgeModel(nn.Module):
    """Every awkward kind of parameter in one small model."""

    def __init__(self, wide: int = 96, d: int = 24, vocab: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, wide)
        self.wide = nn.Linear(wide, d)  # d_in > sketch_above: sketched statistics
        self.frozen = nn.Linear(d, d)  # requires_grad False: in no bucket, never a candidate
        self.frozen.requires_grad_(False)
        self.gain = nn.Parameter(torch.ones(d))  # a bare 1-D parameter
        self.branch = nn.Linear(d, d)  # unused in some steps, on some ranks
        self.dead = nn.Linear(d, d)  # zero input: zero weight gradient, zero statistics
        self.tiny = nn.Linear(1, 1)  # 1×1 weight and 1-element bias: fewer elements than ranks
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens, use_branch: bool = True):
        h = self.wide(self.embed(tokens))
        h = torch.tanh(self.frozen(h)) * self.gain
        if use_branch:
            h = h + self.branch(h)
        h = h + self.dead(h * 0.0) + self.tiny(h.mean(-1, keepdim=True))
        return self.head(h)


def _edge_loss(model, step, rank, scale=1.0):
    x, y = batch(step, rank)
    use_branch = step % 3 == 0 or (step % 3 == 1 and rank == 0)  # both / rank 0 / none
    logits = model(x, use_branch)
    return nn.functional.cross_entropy(logits.reshape(-1, 64), y.reshape(-1)) * scale


def _reference_grads(model, make, step, rank, loss, world_size):
    """Each rank's local FP32 gradient (zeros where unused) and the rank-average of them."""
    ref = make()
    ref.load_state_dict(model.state_dict())
    ref.to(next(model.parameters()).dtype)
    loss(ref, step, rank).backward()
    local = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).float()
             for n, p in ref.named_parameters() if p.requires_grad}
    flat = torch.cat([g.reshape(-1) for g in local.values()])
    dist.all_reduce(flat)
    mean, pos = {}, 0
    for n, g in local.items():
        mean[n] = flat[pos : pos + g.numel()].view_as(g) / world_size
        pos += g.numel()
    return local, mean


def _codec_bounds(state, local, world_size):
    """Per parameter, the documented bound on ‖hook result − FP32 average‖ (EF off):

    each rank's payload and the reduced shard are rounded once each, ≤ u relative to their
    norms, so in communication coordinates ‖E‖ ≤ 2u·Σ_r‖G_r T‖ (the triangle inequality,
    loose); mapping back multiplies by T⁻¹ on the right: ‖E T⁻¹‖ ≤ ‖E‖·‖T⁻¹‖₂. Divided by N."""
    u = U_ROUND[state.config.format]
    names = list(local)
    routes = [state.pipeline.route(n) for n in names]
    norms = torch.tensor([float((g if isinstance(t, Identity) else t.forward(g)).norm())
                          for g, t in zip(local.values(), routes)], dtype=torch.float64)
    dist.all_reduce(norms)
    bounds = {}
    for n, t, s in zip(names, routes, norms.tolist()):
        inv_norm = 1.0
        if not isinstance(t, Identity):
            d_in = local[n].shape[1]
            inv_norm = float(torch.linalg.matrix_norm(t.inverse(torch.eye(d_in)).double(), ord=2))
        bounds[n] = 2 * u * s * inv_norm / world_size
    return bounds, {n: not isinstance(t, Identity) for n, t in zip(names, routes)}


def _edge_worker(rank, world_size):
    torch.manual_seed(0)
    cfg = dict(layers="all", refresh_every=2, sketch_above=64, k=8, oversample=4,
               error_feedback=False)
    model = EdgeModel()
    frozen_before = model.frozen.weight.detach().clone()
    ddp = DDP(model, find_unused_parameters=True)
    state = GeoFP8State(model, GeoFP8Config(**cfg))
    ddp.register_comm_hook(state, geofp8_hook)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    checks = []
    for step in range(7):
        opt.zero_grad(set_to_none=True)
        scale = 0.0 if step == 4 else 1.0  # step 4: every gradient exactly zero
        _edge_loss(ddp, step, rank, scale).backward()
        local, mean = _reference_grads(
            model, EdgeModel, step, rank, lambda m, s, r, c=scale: _edge_loss(m, s, r, c),
            world_size)
        bounds, routed = _codec_bounds(state, local, world_size)
        for n, p in model.named_parameters():
            if not p.requires_grad:
                checks.append((step, n, "frozen-grad", p.grad is None))
                continue
            if p.grad is None:  # DDP leaves a globally unused parameter's grad untouched
                checks.append((step, n, "none", float(mean[n].abs().max())))
                continue
            err = float((p.grad.float() - mean[n]).norm())
            checks.append((step, n, "err", err, bounds[n], routed[n], float(mean[n].norm()),
                           p.grad.dtype == p.dtype))
        opt.step()
    info = {
        "sketch": state.pipeline.source.window["wide.weight"]["A"].mode,
        "candidates": sorted(state.layers),
        "routed": state.stats()["geometry_layers"],
        "frozen_unchanged": torch.equal(model.frozen.weight, frozen_before),
        "params": _digest(model.parameters()),
    }
    # the same schedule with error feedback: still finite and bit-identical on every rank
    torch.manual_seed(0)
    model = EdgeModel()
    ddp = DDP(model, find_unused_parameters=True)
    state = GeoFP8State(model, GeoFP8Config(**{**cfg, "error_feedback": True}))
    ddp.register_comm_hook(state, geofp8_hook)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    for step in range(7):
        opt.zero_grad(set_to_none=True)
        _edge_loss(ddp, step, rank).backward()
        info.setdefault("ef_finite", []).append(_all_finite(model))
        opt.step()
    info["ef_params"] = _digest(model.parameters())
    return checks, info


@pytest.mark.distributed
def test_edge_tensors_frozen_unused_tiny_zero_and_sketched():
    out = run_ranks(_edge_worker, 2, timeout=150)
    (checks, info), (_, info1) = out
    assert info["params"] == info1["params"] and info["ef_params"] == info1["ef_params"]
    assert all(info["ef_finite"]) and all(info1["ef_finite"])
    assert info["sketch"] == "sketch"  # d_in 96 > sketch_above 64
    # the frozen layer and the 1×1 weight are never candidates; the others are
    assert info["candidates"] == ["branch.weight", "dead.weight", "head.weight", "wide.weight"]
    assert "wide.weight" in info["routed"] and "dead.weight" in info["routed"]
    assert info["frozen_unchanged"]
    for rank_checks in (checks, out[1][0]):
        none_steps = set()
        for c in rank_checks:
            step, name, kind = c[:3]
            if kind == "frozen-grad":
                assert c[3], name
            elif kind == "none":
                none_steps.add((step, name))
                assert c[3] == 0.0  # only a parameter unused on every rank keeps grad None
            else:
                err, bound, routed, ref_norm, same_dtype = c[3:]
                assert same_dtype
                # FP32 round-off of the transforms and the sum: 1e-5 of the reference
                assert err <= bound + 1e-5 * ref_norm, (step, name, err, bound, routed)
                if step == 4:
                    assert err == 0.0 and ref_norm == 0.0  # zero gradients come back exact
                if name == "dead.weight":
                    assert ref_norm == 0.0 and err == 0.0
        # branch is unused on both ranks at steps 2 and 5 only; at steps 1 and 4 only rank 1
        # skips it and receives rank 0's gradient averaged with its zeros
        assert {s for s, n in none_steps} == {2, 5}
        assert {n for s, n in none_steps} == {"branch.weight", "branch.bias"}
        routed_steps = {c[0] for c in rank_checks if c[2] == "err" and c[5]}
        assert routed_steps == {2, 3, 4, 5, 6}


def _lowp_worker(rank, world_size):
    return {name: _lowp_run(rank, world_size, name) for name in ("bfloat16", "float16")}


@functools.cache
def _lowp_results():
    return run_ranks(_lowp_worker, 2, timeout=150)


def _lowp_run(rank, world_size, dtype_name):
    dtype = getattr(torch, dtype_name)
    model = make_model().to(dtype)
    ddp = DDP(model, bucket_cap_mb=0.01)
    state = GeoFP8State(model, GeoFP8Config(layers="all", refresh_every=2, error_feedback=False))
    ddp.register_comm_hook(state, geofp8_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    checks = []
    for step in range(4):
        opt.zero_grad()
        loss_fn(ddp, step, rank).backward()
        local, mean = _reference_grads(model, make_model, step, rank, loss_fn, world_size)
        bounds, routed = _codec_bounds(state, local, world_size)
        for n, p in model.named_parameters():
            err = float((p.grad.float() - mean[n]).norm())
            checks.append((step, n, p.grad.dtype == dtype, err, bounds[n], routed[n],
                           float(mean[n].norm())))
        opt.step()
    return checks, _digest(model.parameters())


@pytest.mark.distributed
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
def test_low_precision_gradients_keep_their_dtype_and_bound(dtype_name):
    (checks, params), (checks1, params1) = (out[dtype_name] for out in _lowp_results())
    assert params == params1
    u_store = U_STORAGE[getattr(torch, dtype_name)]
    assert any(c[5] for c in checks)  # geometry was used in some steps
    for step, name, same_dtype, err, bound, _routed, ref_norm in checks + checks1:
        assert same_dtype, name
        # the FP32 result is rounded once more into the bucket's dtype
        assert err <= bound + u_store * (ref_norm + bound) + 1e-5 * ref_norm, (step, name)


def _accumulation_worker(rank, world_size):
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.01)
    state = GeoFP8State(model, GeoFP8Config(layers="all", refresh_every=50,
                                            error_feedback=False))
    ddp.register_comm_hook(state, geofp8_hook)
    x, y = batch(0, rank, batch_size=8)
    halves = [(x[:4], y[:4]), (x[4:], y[4:])]

    def loss(m, xb, yb):
        return nn.functional.cross_entropy(m(xb).reshape(-1, 64), yb.reshape(-1))

    with ddp.no_sync():
        (loss(ddp, *halves[0]) / 2).backward()
    (loss(ddp, *halves[1]) / 2).backward()
    window = state.pipeline.source.window
    weights = {n: float(window[state.pipeline.shared.of(n)]["A"].weight) for n in state.layers}
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    ref = make_model()
    ref.load_state_dict(model.state_dict())
    loss(ref, x, y).backward()  # one big batch
    local = {n: p.grad for n, p in ref.named_parameters()}
    flat = torch.cat([g.reshape(-1) for g in local.values()])
    norms = torch.tensor([float(g.norm()) for g in local.values()], dtype=torch.float64)
    dist.all_reduce(flat)
    dist.all_reduce(norms)
    out, pos = [], 0
    for (n, g), s in zip(local.items(), norms.tolist()):
        mean = flat[pos : pos + g.numel()].view_as(g) / world_size
        pos += g.numel()
        out.append((n, float((got[n] - mean).norm()), 2 * 2**-4 * s / world_size,
                    float(mean.norm())))
    return weights, out, x.numel()


@pytest.mark.distributed
def test_no_sync_accumulation_equals_one_big_batch_and_counts_all_tokens():
    for weights, errors, tokens in run_ranks(_accumulation_worker, 2, timeout=90):
        # the statistics saw both micro-batches (4×16 tokens each), not only the synced one
        assert set(weights.values()) == {float(tokens)}
        for name, err, bound, ref_norm in errors:
            # FP32 round-off: (g₀ + g₁)/2 vs the big batch's own reduction order
            assert err <= bound + 1e-5 * ref_norm, (name, err, bound)


# == 3. Misconfiguration ===================================================================


def _capture(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the message is what the test checks
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _misconfig_worker(rank, world_size):
    from collections import OrderedDict

    out = {}

    def layers_differ():  # different selections
        model = make_model()
        ddp = DDP(model)
        layers = ["blocks.0.up"] if rank == 0 else ["blocks.1.up"]
        ddp.register_comm_hook(GeoFP8State(model, GeoFP8Config(layers=layers)), geofp8_hook)
        loss_fn(ddp, 0, rank).backward()
    out["layers"] = _capture(layers_differ)

    def names_differ():  # same shapes (DDP's own check passes), different structure
        torch.manual_seed(0)
        second = "b" if rank == 0 else "c"
        model = nn.Sequential(OrderedDict([("a", nn.Linear(16, 16)), (second, nn.Linear(16, 16))]))
        ddp = DDP(model)
        ddp.register_comm_hook(GeoFP8State(model, GeoFP8Config()), geofp8_hook)
        ddp(torch.randn(4, 16)).sum().backward()
    out["names"] = _capture(names_differ)

    def extra_layer():  # one rank has an extra layer: DDP itself refuses, on every rank
        layers = [nn.Linear(16, 16) for _ in range(2 if rank == 1 else 1)]
        DDP(nn.Sequential(*layers))
    out["extra"] = _capture(extra_layer)

    def complex_parameter():
        model = nn.Linear(16, 16).to(torch.complex64)
        DDP(model)
        GeoFP8State(model, GeoFP8Config())
    out["complex"] = _capture(complex_parameter)
    return out


@pytest.mark.distributed
def test_misconfiguration_fails_fast_naming_the_difference():
    t0 = time.monotonic()
    for out in run_ranks(_misconfig_worker, 2, timeout=90):
        assert "ranks disagree" in out["layers"] and "layers" in out["layers"]
        assert "blocks.0.up" in out["layers"] and "blocks.1.up" in out["layers"]
        assert "model structure differs" in out["names"]
        assert "b.weight" in out["names"] and "c.weight" in out["names"]
        assert "same model across all ranks" in out["extra"]
        assert out["complex"].startswith("TypeError") and "complex" in out["complex"]
    assert time.monotonic() - t0 < 60  # fails fast: no collective timeout was waited for


def test_unsupported_backend_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "mpi")
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "mpi")
    with pytest.raises(ValueError, match=r"supports the \('gloo', 'nccl'\) backends, got 'mpi'"):
        GeoFP8State(make_model(), GeoFP8Config())


def test_a_group_made_without_naming_a_backend_uses_the_devices_own(monkeypatch):
    """``init_process_group()`` with no backend reports ``"undefined"`` (torch 2.13) and
    keeps one backend per device type: the model's device picks."""
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "undefined")
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:nccl")
    assert backend_of(None, torch.device("cpu")) == "gloo"
    assert backend_of(None, torch.device("cuda", 0)) == "nccl"
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:mpi")
    assert backend_of(None, torch.device("cpu")) == "mpi"


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.complex64, torch.bool])
def test_codec_rejects_non_real_floating_input(dtype):
    with pytest.raises(TypeError, match="floating-point"):
        FP8Codec().quantize(torch.zeros(8, dtype=dtype))
    layout = ShardLayout.build([(8,)], FP8Codec(), 1)
    with pytest.raises(TypeError, match="floating-point"):
        encode(torch.zeros(8, dtype=dtype), layout)


# == 4. A killed rank ======================================================================


KILLED_EXIT = 17
_TO_TEST: list = []  # in a rank: (its rank, the test's queue)


def _die() -> None:
    """This rank is killed here, with no goodbye to its group: it only tells the test when
    (``time.monotonic``: one clock for every process of this machine), then exits
    ``KILLED_EXIT``."""
    rank, queue = _TO_TEST[0]
    queue.put((rank, "died", None, time.monotonic()))
    queue.close()
    queue.join_thread()
    os._exit(KILLED_EXIT)


def _bounded_entry(rank, world_size, port, pg_timeout_s, fn, args, queue, environ):
    os.environ.clear()  # the caller's, not the pre-forked server's
    os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    _TO_TEST.append((rank, queue))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        report = ("ok", fn(rank, world_size, *args))
    except BaseException as exc:  # noqa: BLE001
        report = ("error", f"{type(exc).__name__}: {exc}")
    queue.put((rank, *report, time.monotonic()))
    queue.close()
    queue.join_thread()
    os._exit(0)  # skip the process group's teardown: a peer may be gone


def _spawn_bounded(fn, world_size, args, pg_timeout_s, wall_s, wait_for=None):
    """Run ``fn`` on real ranks of which some may die (:func:`_die`). Returns ``(reports,
    exit codes, seconds from the first death to each report)``, both instants read by the
    ranks themselves (``None``: no rank died), so the figure holds under any load: it does
    not wait for this process to notice the death. Every process is killed after ``wall_s``
    seconds, or once the ranks in ``wait_for`` (default: all) reported: a hang shows up as a
    missing report, never as a stuck test."""
    wait_for = set(range(world_size)) if wait_for is None else set(wait_for)
    ctx = _context()  # forked from the server that has imported torch, as run_ranks' ranks
    queue = ctx.Queue()
    port = _free_port()
    environ = dict(os.environ)
    procs = [ctx.Process(target=_bounded_entry,
                         args=(r, world_size, port, pg_timeout_s, fn, args, queue, environ),
                         daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    reports, reported_at, deaths = {}, {}, []
    deadline = time.monotonic() + wall_s
    try:
        while time.monotonic() < deadline and not wait_for <= set(reports):
            try:
                rank, status, value, at = queue.get(timeout=0.2)
            except Exception:  # noqa: BLE001 - queue.Empty
                if all(p.exitcode is not None for p in procs) and queue.empty():
                    break
                continue
            if status == "died":
                deaths.append(at)
            else:
                reports[rank], reported_at[rank] = (status, value), at
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
    death = min(deaths, default=None)
    after_death = {r: None if death is None else at - death for r, at in reported_at.items()}
    return reports, [p.exitcode for p in procs], after_death


PG_TIMEOUT_S = 12
NETWORK_ERROR = ("gloo", "connection", "timed out", "timeout", "peer")


def _killed_worker(rank, world_size, die_at):
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.01)
    ddp.register_comm_hook(GeoFP8State(model, GeoFP8Config(layers="all", refresh_every=2)),
                           geofp8_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(die_at + 3):
        if rank == 1 and step == die_at:
            _die()  # killed mid-run, without any goodbye to its group
        try:
            opt.zero_grad()
            loss_fn(ddp, step, rank).backward()
            opt.step()
        except Exception as exc:  # noqa: BLE001
            return {"step": step, "error": f"{type(exc).__name__}: {exc}"}
    return {"step": None}


@pytest.mark.distributed
def test_killed_rank_makes_the_survivor_fail_within_the_timeout():
    reports, codes, after_death = _spawn_bounded(_killed_worker, 2, (3,), PG_TIMEOUT_S,
                                                 wall_s=60)
    assert codes[1] == KILLED_EXIT
    assert 0 in reports, "rank 0 hung: no report within the wall-clock bound"
    status, value = reports[0]
    assert status == "ok" and value["step"] == 3, reports[0]  # it raised, in the dead step
    assert after_death[0] <= PG_TIMEOUT_S + 5
    assert any(s in value["error"].lower() for s in NETWORK_ERROR), value["error"]


def _hung_worker(rank, world_size, hang_at, hang_s):
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.01)
    ddp.register_comm_hook(GeoFP8State(model, GeoFP8Config(layers="all", refresh_every=2)),
                           geofp8_hook)
    for step in range(hang_at + 1):
        if rank == 1 and step == hang_at:
            time.sleep(hang_s)  # alive, socket open, but silent
            return {"step": None}
        t0 = time.monotonic()
        try:
            model.zero_grad()
            loss_fn(ddp, step, rank).backward()
        except Exception as exc:  # noqa: BLE001
            return {"step": step, "error": f"{type(exc).__name__}: {exc}",
                    "seconds": time.monotonic() - t0}
    return {"step": None}


@pytest.mark.distributed
def test_hung_rank_makes_the_survivor_fail_at_the_timeout():
    timeout = 5
    reports, _, _ = _spawn_bounded(_hung_worker, 2, (2, 60), timeout, wall_s=45, wait_for={0})
    assert 0 in reports, "rank 0 hung past the process-group timeout"
    status, value = reports[0]
    assert status == "ok" and value["step"] == 2, reports[0]
    assert timeout - 1 <= value["seconds"] <= timeout + 5
    assert "timed out" in value["error"].lower() or "timeout" in value["error"].lower()


# -- checkpoints of `geofp8 train` ----------------------------------------------------------

TRAIN = dict(model="llama-tiny", seq_len=32, batch_size=2, steps=6, warmup=1, eval_every=3,
             eval_batches=2, shadow_every=0, refresh_every=2, checkpoint_every=2,
             method="geofp8-auto", quiet=True, threads=1, timeout_s=PG_TIMEOUT_S)


def _train_worker(rank, world_size, cfg_dict, kill_at):
    """``geofp8 train`` on this rank; with ``kill_at``, rank 1 dies as it starts that step."""
    from geofp8.tools.train import loop
    from geofp8.tools.train.config import TrainConfig

    if kill_at is not None and rank == 1:
        real = loop.get_batch

        def get_batch(data, step, *args, **kwargs):
            if step == kill_at:
                _die()
            return real(data, step, *args, **kwargs)
        loop.get_batch = get_batch
    try:
        loop.train(TrainConfig.from_dict(cfg_dict))
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return None


@pytest.mark.distributed
@pytest.mark.slow
def test_killed_training_resumes_bit_identically(tmp_path):
    from geofp8.tools.train import to_argv
    from geofp8.tools.train.checkpoint import latest_step
    from geofp8.tools.train.config import TrainConfig
    from geofp8.tools.train.launch import launch
    from geofp8.tools.train.report import read_log

    whole = {**TRAIN, "out": str(tmp_path / "whole")}
    reports, codes, _ = _spawn_bounded(_train_worker, 2, (whole, None), PG_TIMEOUT_S, 120)
    assert reports == {0: ("ok", None), 1: ("ok", None)}, reports

    part = {**TRAIN, "out": str(tmp_path / "part")}
    reports, codes, after_death = _spawn_bounded(_train_worker, 2, (part, 5), PG_TIMEOUT_S, 120)
    assert codes[1] == KILLED_EXIT
    assert 0 in reports, "rank 0 hung after rank 1 died"
    assert after_death[0] <= PG_TIMEOUT_S + 5
    assert any(s in str(reports[0][1]).lower() for s in NETWORK_ERROR), reports[0]
    assert latest_step(part["out"]) == 4  # checkpoints after steps 2 and 4; died in step 5

    resumed = TrainConfig(**{**part, "resume": True})
    assert launch(2, to_argv(resumed), timeout=120) == 0  # `geofp8 train --resume` on torchrun

    a = read_log(tmp_path / "whole" / "log.jsonl")
    b = read_log(tmp_path / "part" / "log.jsonl")
    assert [r["step"] for r in b] == list(range(6))
    keys = ("loss", "grad_norm", "lr", "bytes_sent", "val_loss", "geometry_layers")
    assert [{k: r.get(k) for k in keys} for r in a] == [{k: r.get(k) for k in keys} for r in b]


def _crashing_checkpoint_worker(rank, world_size, out):
    """Write a complete checkpoint at step 2; while writing step 4's, rank 1's ``torch.save``
    dies half-way (it wrote some bytes, then the process is gone)."""
    from geofp8.tools.train import checkpoint as ckpt
    from geofp8.tools.train import loop
    from geofp8.tools.train.config import TrainConfig

    cfg = TrainConfig(**{**TRAIN, "out": out})
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    state = GeoFP8State(model, GeoFP8Config())
    cpu = torch.device("cpu")
    loop.save_checkpoint(ckpt.checkpoint_dir(out).parent, 2, model, [opt], [sched], state,
                         1.0, cfg, rank, cpu)
    if rank == 1:
        real = torch.save

        def dying_save(obj, f, *args, **kwargs):
            real(obj, f, *args, **kwargs)
            f.seek(f.tell() // 2)
            f.truncate()
            _die()
        ckpt.torch.save = dying_save  # the one torch.save that atomic_save calls
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    loop.save_checkpoint(ckpt.checkpoint_dir(out).parent, 4, model, [opt], [sched], state,
                         2.0, cfg, rank, cpu)
    return "saved"


def test_atomic_save_survives_a_crash_mid_write(tmp_path, monkeypatch):
    from geofp8.tools.train import checkpoint as ckpt

    path = tmp_path / "checkpoint" / "rank0.pt"
    ckpt.atomic_save({"step": 2, "w": torch.arange(1000.0)}, path)

    def crash(obj, f, *args, **kwargs):
        f.write(b"half a checkpoint")
        raise OSError("disk full")
    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        ckpt.atomic_save({"step": 4, "w": torch.zeros(1000)}, path)
    monkeypatch.undo()
    previous = torch.load(path, weights_only=False)
    assert previous["step"] == 2 and torch.equal(previous["w"], torch.arange(1000.0))
    assert os.listdir(path.parent) == ["rank0.pt"]  # no temporary file left behind


@pytest.mark.distributed
def test_crash_while_writing_a_checkpoint_leaves_the_previous_one_usable(tmp_path):
    from geofp8.tools.train import checkpoint as ckpt

    out = str(tmp_path)
    reports, codes, after_death = _spawn_bounded(_crashing_checkpoint_worker, 2, (out,),
                                                 PG_TIMEOUT_S, 60)
    assert codes[1] == KILLED_EXIT and 0 in reports  # rank 0 failed in the barrier, no hang
    step = ckpt.latest_step(out)
    assert step == 2
    assert ckpt.load_shared(out, step)["step"] == 2
    for rank in range(2):
        assert ckpt.load_rank(out, rank, step, 2)["geofp8"]["step"] == 0


# == 5. The real collective on extreme values ==============================================


def _fuzz_case(i, world_size):
    """A fixed draw: shapes, codec and every rank's input, from the case's own seed."""
    cases = [
        ([(5, 7), (3,), (1,), (64,)], FP8Codec("e4m3", "tensor"), "mixed"),
        ([(6, 9), (17,)], FP8Codec("e5m2", "row"), "per-rank"),  # rank 0 ~1e-30, rank 1 ~1e30
        ([(40,), (2, 3), (0,)], FP8Codec("e4m3", "block", 16), "zeros"),
        ([(5, 7), (33,)], FP8Codec("e4m3", "tensor"), "inf"),
        ([(5, 7), (33,)], FP8Codec("e5m2", "block", 8), "nan"),
        ([(9, 4)], FP8Codec("e4m3", "row"), "overflow"),  # each finite, the sum overflows fp32
        ([(12,), (3, 3)], FP8Codec("e5m2", "tensor"), "opposite-inf"),
        ([(31,)], FP8Codec("e4m3", "tensor"), "fp32-subnormal"),
    ]
    shapes, codec, kind = cases[i]
    numel = sum(torch.Size(s).numel() for s in shapes)
    gen = torch.Generator().manual_seed(100 + i)
    inputs = []
    for r in range(world_size):
        sign = torch.randn(numel, generator=gen, dtype=torch.float64).sign()
        exps = torch.empty(numel, dtype=torch.float64).uniform_(-30, 30, generator=gen)
        if kind == "per-rank":
            exps = exps / 10 + (-30 if r == 0 else 30)
        x = (sign * 10**exps).float()
        if kind == "zeros":
            x[: numel // 2] = 0.0
            x[40:46] = 0.0  # the whole 2×3 tensor
        if kind == "inf" and r == 1:
            x[40] = float("inf")
        if kind == "nan" and r == 0:
            x[3] = float("nan")
        if kind == "overflow":
            x = sign.float() * 3.0e38
        if kind == "opposite-inf":
            x[0] = float("inf") if r == 0 else float("-inf")
        if kind == "fp32-subnormal":
            x = (sign * 1e-40).float()
        inputs.append(x)
    return shapes, codec, inputs


N_FUZZ_CASES = 8


def _collective_fuzz_worker(rank, world_size):
    out = []
    for i in range(N_FUZZ_CASES):
        shapes, codec, inputs = _fuzz_case(i, world_size)
        layout = ShardLayout.build(shapes, codec, world_size)
        exact = exact_allreduce(inputs[rank].clone(), layout)
        group = DeviceGroup(None, inputs[rank].device)
        gathered = Communicator("allgather", group).launch(
            encode(inputs[rank].clone(), layout), layout).wait()
        out.append((exact, gathered))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.distributed
def test_real_collectives_on_extreme_values_match_the_model_bitwise():
    world_size = 2
    outs = run_ranks(_collective_fuzz_worker, world_size, timeout=90)
    for i in range(N_FUZZ_CASES):
        shapes, codec, inputs = _fuzz_case(i, world_size)
        layout = ShardLayout.build(shapes, codec, world_size)
        model = simulate_exact_allreduce(inputs, layout)
        gather_model = torch.zeros(layout.numel)
        for x in inputs:
            gather_model += decode(encode(x, layout), layout)
        if not bool(torch.isfinite(gather_model).all()):
            gather_model.fill_(float("nan"))
        for rank in range(world_size):
            exact, gathered = outs[rank][i]
            assert torch.equal(_bits(exact), _bits(model)), i
            assert torch.equal(_bits(gathered), _bits(gather_model)), i
        X = torch.stack([x.double() for x in inputs])
        total = X.sum(0)
        if not bool(torch.isfinite(total).all()) or total.abs().max() > torch.finfo().max:
            # non-finite input, or a sum beyond fp32: NaN everywhere, never a finite lie
            assert bool(torch.isnan(model).all()) and bool(torch.isnan(gather_model).all()), i
            continue
        assert bool(torch.isfinite(model).all()), i
        u = U_ROUND[codec.format]
        out = model.double()
        for j in range(world_size):  # the bound of test_collectives' simulated fuzz, per group
            for a, b in layout.group_spans(j):
                A_g = float(X[:, a:b].abs().amax(dim=1).sum())
                M_g = float(total[a:b].abs().max())
                err = float((out[a:b] - total[a:b]).abs().max())
                assert err <= u * M_g + (u * (1 + u) + world_size * 2.0**-23) * A_g + 1e-44, i


# == 6. Memory =============================================================================


class _Wide(nn.Module):
    def __init__(self, d_in: int):
        super().__init__()
        self.embed = nn.Embedding(64, d_in)
        self.proj = nn.Linear(d_in, 32)
        self.head = nn.Linear(32, 64)

    def forward(self, tokens):
        return self.head(torch.relu(self.proj(self.embed(tokens))))


def _memory_worker(rank, world_size):
    out = {}
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.01)
    state = GeoFP8State(model, GeoFP8Config(layers="all", refresh_every=1))
    ddp.register_comm_hook(state, geofp8_hook)
    for step in range(3):
        model.zero_grad()
        loss_fn(ddp, step, rank).backward()
    out["ef_bytes"] = state.stats()["ef_bytes"]
    out["routed_elements"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    k, p = 8, 4
    for d_in in (256, 512):
        torch.manual_seed(0)
        model = _Wide(d_in)
        ddp = DDP(model)
        state = GeoFP8State(model, GeoFP8Config(layers="all", refresh_every=1, k=k,
                                                oversample=p, sketch_above=64))
        ddp.register_comm_hook(state, geofp8_hook)
        for step in range(2):
            model.zero_grad()
            x, y = batch(step, rank)
            nn.functional.cross_entropy(ddp(x).reshape(-1, 64), y.reshape(-1)).backward()
        stats = state.stats()
        out[d_in] = (stats["factor_bytes"], sorted(state.pipeline.transforms()),
                     sorted(state.layers))
    return out


@pytest.mark.distributed
def test_stats_report_ef_and_factor_memory():
    k, l = 8, 12
    for out in run_ranks(_memory_worker, 2, timeout=90):
        # EF: one BF16 copy (the default storage) of every routed gradient
        assert out["ef_bytes"] == 2 * out["routed_elements"]
        # sketched low-rank factor of proj (head has d_in 32: exact, d_in² = 1024 floats):
        # O(d_in·(k+p)), so doubling d_in doubles it (a d_in² term would quadruple it)
        small, big = out[256], out[512]
        assert small[1] == big[1] == small[2] == ["head.weight", "proj.weight"]
        # head (d_in 32 ≤ sketch_above) is exact and the same in both: the difference is
        # proj's 256 extra input columns. Documented bound per sketched layer: two moments
        # (pending, window) × (sums + Ω, d_in·(k+p) floats each) + the map's U and
        # U diag(a) each way (3 × d_in·k floats: geometry.transforms.LowRankInput)
        per_width = big[0] - small[0]
        assert 0 < per_width <= 4 * 256 * (4 * l + 3 * k)
        assert big[0] < 2 * small[0]  # linear in d_in (a d_in² term would quadruple it)
