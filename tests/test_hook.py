"""The DDP hooks on real gloo processes (2 and 4 ranks, bounded timeouts)."""

import hashlib

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run_ranks
from geofp8 import (
    FP8Config,
    FP8State,
    GeoFP8Config,
    GeoFP8State,
    HadamardFP8State,
    fp8_hook,
    geofp8_hook,
    hadamard_fp8_hook,
)
from geofp8.codecs import FP8Codec
from geofp8.comm import ShardLayout, simulate_exact_allreduce
from geofp8.geometry.transforms import Identity
from toymodels import loss_fn, make_model

pytestmark = pytest.mark.distributed


def _make_state(kind, model, **kw):
    if kind == "fp32":
        return None, None
    if kind == "fp8":
        return FP8State(model, FP8Config(**{"error_feedback": False, **kw})), fp8_hook  # "fp8"
    if kind == "hadamard":
        return HadamardFP8State(model, FP8Config(**kw)), hadamard_fp8_hook
    return GeoFP8State(model, GeoFP8Config(**kw)), geofp8_hook


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _one_step_worker(rank, world_size, kind, kw):
    """Local FP32 gradient and the hook's averaged gradient of the same step."""
    torch.manual_seed(0)
    local = make_model()
    loss_fn(local, 0, rank).backward()
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.01)
    state, hook = _make_state(kind, model, **kw)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    loss_fn(ddp, 0, rank).backward()
    return _grads(local), _grads(model), state.stats() if state else None


def _default_and_warmup_worker(rank, world_size):
    return (_one_step_worker(rank, world_size, "fp32", {}),
            _one_step_worker(rank, world_size, "fp8", {"warmup_steps": 5}))


@pytest.mark.parametrize("world_size", [2, 4])
def test_warmup_passthrough_equals_default_allreduce(world_size):
    for ref, fp32 in run_ranks(_default_and_warmup_worker, world_size):
        for name, g in ref[1].items():
            torch.testing.assert_close(fp32[1][name], g, rtol=0, atol=0)


@pytest.mark.parametrize("world_size", [2, 4])
def test_fp8_average_within_codec_bound_and_identical_on_ranks(world_size):
    out = run_ranks(_one_step_worker, world_size, ("fp8", {"format": "e4m3"}))
    mean = {n: torch.stack([o[0][n] for o in out]).mean(0) for n in out[0][0]}
    for name, g in mean.items():
        got = out[0][1][name]
        for r in range(1, world_size):
            assert torch.equal(out[r][1][name], got)
        # each rank's payload and the reduced shard are rounded once each (≤ 2⁻⁴ relative
        # to the group's amax): ‖err‖ ≤ 2 · 2⁻⁴ · ‖·‖ is a loose but principled bound
        assert (got - g).norm() <= 2 * 2**-4 * torch.stack([o[0][name] for o in out]).norm(
            dim=tuple(range(1, g.dim() + 1))).sum() / world_size + 1e-12


def _single_param_worker(rank, world_size):
    torch.manual_seed(0)
    model = nn.Linear(32, 24, bias=False)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank)) * (rank + 1)
    model(x).pow(2).sum().backward()
    local = model.weight.grad.clone()
    model.weight.grad = None
    ddp = DDP(model)
    ddp.register_comm_hook(FP8State(model, FP8Config(format="e5m2")), fp8_hook)
    ddp(x).pow(2).sum().backward()
    return local, model.weight.grad.clone()


@pytest.mark.parametrize("world_size", [2, 4])
def test_exact_path_equals_fp32_sum_of_dequantized_payloads(world_size):
    out = run_ranks(_single_param_worker, world_size)
    layout = ShardLayout.build([(24, 32)], FP8Codec("e5m2"), world_size)
    expected = simulate_exact_allreduce([o[0] for o in out], layout).view(24, 32) / world_size
    for _, got in out:
        assert torch.equal(got, expected)


def _train_worker(rank, world_size, kind, kw, steps):
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.01)
    state, hook = _make_state(kind, model, **kw)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    transform_digests = []
    for step in range(steps):
        opt.zero_grad()
        loss_fn(ddp, step, rank).backward()
        opt.step()
        if isinstance(state, GeoFP8State):
            transforms = state.pipeline.transforms()
            transform_digests.append(_digest([t for name in sorted(transforms)
                                              for t in transforms[name].tensors()]))
    stats = state.stats()
    return (_digest(model.parameters()), transform_digests, stats,
            sorted(state.pipeline.selection.selected), sorted(state.pipeline.feedback.residuals))


@pytest.mark.parametrize("world_size,kind,kw", [
    (2, "geofp8", {"layers": "all", "refresh_every": 5}),
    (4, "geofp8", {"layers": "auto", "refresh_every": 4, "format": "e5m2"}),
    (2, "hadamard", {"error_feedback": True}),
    (2, "geofp8", {"layers": "profile", "refresh_every": 3, "profile_steps": 4,
                   "transform": "kfac"}),
    (2, "geofp8", {"layers": "all", "factor_source": "fresh", "rank": 8}),
    (4, "geofp8", {"layers": "auto", "factor_source": "fresh", "refresh_every": 3}),
    (2, "geofp8", {"layers": "auto", "factor_source": "local", "refresh_every": 3}),
])
def test_parameters_and_transforms_bit_identical_after_20_steps(world_size, kind, kw):
    out = run_ranks(_train_worker, world_size, (kind, kw, 20), timeout=240)
    params, transforms, stats, selected, residuals = out[0]
    for other in out[1:]:
        assert other[0] == params  # parameters bit-identical on every rank
        if kw.get("factor_source") != "local":  # local factors are each rank's own, by design
            assert other[1] == transforms  # transforms bit-identical at every step
        assert other[3] == selected
    assert stats["step"] == 20
    if kind == "geofp8":
        assert len(set(transforms)) > 1  # refreshed during the run
    if kw.get("layers") == "profile":
        assert len(selected) >= 1


def test_bytes_sent_about_a_quarter_of_fp32_for_2d_weights():
    out = run_ranks(_train_worker, 2, ("geofp8", {"layers": "all", "refresh_every": 50}, 3))
    stats = out[0][2]
    assert stats["bytes_sent"] <= 0.27 * stats["bytes_fp32_equivalent"]
    assert stats["factor_bytes_sent"] == 0  # no refresh in the last step
    assert 1.0 <= stats["bytes_per_element"] <= 1.08  # 2(N−1)/N = 1 code byte + scales


def _mismatch_worker(rank, world_size):
    model = make_model()
    ddp = DDP(model)
    cfg = GeoFP8Config(damping=0.1 if rank == 0 else 0.2)
    ddp.register_comm_hook(GeoFP8State(model, cfg), geofp8_hook)
    try:
        loss_fn(ddp, 0, rank).backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_mismatched_config_fails_fast_on_every_rank():
    messages = run_ranks(_mismatch_worker, 2, timeout=60)
    for m in messages:
        assert "damping" in m and "ranks disagree" in m


def _nonfinite_worker(rank, world_size, poison_step):
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.01)
    state = GeoFP8State(model, GeoFP8Config(layers="all", refresh_every=2))
    ddp.register_comm_hook(state, geofp8_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    saw_nan = []
    for step in range(6):
        opt.zero_grad()
        handle = None
        if step == poison_step and rank == 1:  # one layer of one rank goes NaN
            handle = model.blocks[0]["up"].weight.register_hook(lambda g: g * float("nan"))
        loss_fn(ddp, step, rank).backward()
        finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
        saw_nan.append(not finite)
        if finite:
            opt.step()
        if handle is not None:
            handle.remove()
    stats = state.stats()
    return _digest(model.parameters()), saw_nan, stats["step"], stats["skipped_steps"]


def _clean_worker(rank, world_size, skip_step):
    """The same run, but the poisoned step never happens (its batch is skipped, the state
    left as a skipped step leaves it)."""
    from test_reliability import as_if_skipped

    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.01)
    state = GeoFP8State(model, GeoFP8Config(layers="all", refresh_every=2))
    ddp.register_comm_hook(state, geofp8_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(6):
        if step == skip_step:
            as_if_skipped(state)
            continue
        opt.zero_grad()
        loss_fn(ddp, step, rank).backward()
        opt.step()
    return _digest(model.parameters())


def test_nonfinite_gradient_poisons_every_rank_and_only_resets_the_residuals():
    poisoned = run_ranks(_nonfinite_worker, 2, (3,))
    for _, saw_nan, step, skipped in poisoned:
        assert saw_nan == [False, False, False, True, False, False]  # every rank, that step only
        assert (step, skipped) == (5, 1)
    clean = run_ranks(_clean_worker, 2, (3,))
    assert poisoned[0][0] == poisoned[1][0] == clean[0]


def _checkpoint_worker(rank, world_size, path):
    def run(model, state, opt, ddp, steps):
        for step in steps:
            opt.zero_grad()
            loss_fn(ddp, step, rank).backward()
            opt.step()

    cfg = GeoFP8Config(layers="auto", refresh_every=3)
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.01)
    state = GeoFP8State(model, cfg)
    ddp.register_comm_hook(state, geofp8_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run(model, state, opt, ddp, range(7))
    snapshot = {"model": model.state_dict(), "opt": opt.state_dict(), "geo": state.state_dict()}
    torch.save(snapshot, f"{path}/{rank}.pt")
    run(model, state, opt, ddp, range(7, 12))
    uninterrupted = _digest(model.parameters())

    snapshot = torch.load(f"{path}/{rank}.pt")
    model2 = make_model(seed=5)
    model2.load_state_dict(snapshot["model"])
    ddp2 = DDP(model2, bucket_cap_mb=0.01)
    state2 = GeoFP8State(model2, cfg)
    state2.load_state_dict(snapshot["geo"])
    ddp2.register_comm_hook(state2, geofp8_hook)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    opt2.load_state_dict(snapshot["opt"])
    run(model2, state2, opt2, ddp2, range(7, 12))
    return uninterrupted, _digest(model2.parameters()), sorted(state.pipeline.feedback.residuals)


def test_state_dict_resume_is_bit_identical(tmp_path):
    for uninterrupted, resumed, residual_names in run_ranks(_checkpoint_worker, 2,
                                                            (str(tmp_path),)):
        assert uninterrupted == resumed
        # EF is keyed by parameter name: it survives DDP's bucket rebuild after step 1
        assert len(residual_names) == len(list(make_model().parameters()))


def _rebase_worker(rank, world_size):
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.01)
    state = GeoFP8State(model, GeoFP8Config(layers="all", refresh_every=2))
    ddp.register_comm_hook(state, geofp8_hook)
    pipeline, checks = state.pipeline, []
    refresh = pipeline.source.refresh

    def observed_refresh():  # look across each refresh: the residual keeps its meaning
        residuals = pipeline.feedback.residuals
        before = {n: (pipeline.route(n), r.clone()) for n, r in residuals.items()}
        refresh()
        for n, (old, r_old) in before.items():
            new = pipeline.route(n)
            if old is not new and not isinstance(new, Identity):
                r_new = pipeline.feedback.residual_in(n, new)
                checks.append(float((old.inverse(r_old) - new.inverse(r_new)).norm()
                                    / old.inverse(r_old).norm()))

    pipeline.source.refresh = observed_refresh
    for step in range(5):
        loss_fn(ddp, step, rank).backward()
    return checks


def test_ef_residual_rebased_on_refresh_keeps_its_euclidean_meaning():
    checks = run_ranks(_rebase_worker, 2)[0]
    assert len(checks) >= 3
    assert max(checks) < 1e-4


def test_unsupported_backend_and_bad_config_are_clear_errors():
    with pytest.raises(ValueError, match="native"):
        GeoFP8Config(collective="native")
    with pytest.raises(ValueError, match="format"):
        GeoFP8Config(format="e3m4")
    with pytest.raises(RuntimeError, match="initialised"):
        GeoFP8State(make_model())
    assert not dist.is_initialized()
