"""The core pipeline behind the DDP adapter: tensor-only checkpoints, read-only stats, one
door to torch.distributed, shared input statistics, and the EF-aware ``auto`` rule."""

import hashlib
import inspect
import io

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run_ranks
from geofp8 import GeoFP8Config, GeoFP8State, geofp8_hook
from geofp8.comm import group as group_module
from toymodels import loss_fn, make_model

pytestmark = pytest.mark.distributed


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class QKV(nn.Module):
    """Three projections reading one normalised input (like q/k/v), then an MLP pair."""

    def __init__(self, vocab: int = 64, d: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([nn.ModuleDict({
            "norm": nn.LayerNorm(d), "q": nn.Linear(d, d), "k": nn.Linear(d, d),
            "v": nn.Linear(d, d), "out": nn.Linear(d, d)})])
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        for b in self.blocks:
            x = b["norm"](h)
            q, k, v = b["q"](x), b["k"](x), b["v"](x)
            h = h + b["out"](torch.softmax(q @ k.transpose(1, 2), -1) @ v)
        return self.head(h)


def _train(model, state, steps, rank, start=0):
    ddp = DDP(model, bucket_cap_mb=0.01)
    ddp.register_comm_hook(state, geofp8_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(start, start + steps):
        opt.zero_grad()
        loss_fn(ddp, step, rank).backward()
        opt.step()
    return ddp


# -- checkpoints are tensors and plain containers ------------------------------------------

def _checkpoint_worker(rank, world_size, kw):
    cfg = GeoFP8Config(**kw)
    model = make_model()
    _train(model, GeoFP8State(model, cfg), 6, rank)
    reference = _digest(model.parameters())

    model = make_model()
    state = GeoFP8State(model, cfg)
    _train(model, state, 3, rank)
    buf = io.BytesIO()
    torch.save({"geofp8": state.state_dict(), "model": model.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)  # nothing in it can run code
    resumed = make_model()
    resumed.load_state_dict(saved["model"])
    state2 = GeoFP8State(resumed, cfg)
    state2.load_state_dict(saved["geofp8"])
    # the optimizer (plain SGD, no state) and the data order resume with the step
    _train(resumed, state2, 3, rank, start=3)
    return reference, _digest(resumed.parameters()), state2.stats()["step"]


@pytest.mark.parametrize("kw", [
    dict(layers="all", refresh_every=2),
    dict(layers="auto", refresh_every=2, factor_source="fresh", k=8),
    dict(layers="profile", profile_steps=2, refresh_every=2, transform="kfac"),
])
def test_checkpoint_loads_weights_only_and_resumes_bitwise(kw):
    for reference, resumed, step in run_ranks(_checkpoint_worker, 2, (kw,), timeout=300):
        assert resumed == reference and step == 6


def test_no_pickle_on_the_state_and_factor_paths():
    """Nothing on the checkpoint or factor-broadcast path unpickles: no ``pickle``, no
    ``weights_only=False``, no ``*_object`` collective anywhere in the core."""
    import geofp8
    from geofp8 import comm, ddp, feedback, geometry, pipeline, selection
    from geofp8.geometry import sources, transforms
    for module in (ddp, pipeline, feedback, selection, sources, transforms, comm.group,
                   comm.collective, geometry.factory, geofp8.codecs.fp8):
        text = inspect.getsource(module)
        for banned in ("pickle", "weights_only=False", "_object(", "torch.load("):
            assert banned not in text, (module.__name__, banned)


# -- stats() reads, and changes nothing ------------------------------------------------------

def _stats_worker(rank, world_size):
    model = make_model()
    state = GeoFP8State(model, GeoFP8Config(layers="all", refresh_every=2))
    _train(model, state, 3, rank)
    before = {k: v for k, v in state.state_dict().items()}
    first, second = state.stats(), state.stats()
    after = state.state_dict()
    residuals = [s["feedback"]["sender"]["residuals"] for s in (before, after)]
    same_state = _digest(v for _, v in sorted(residuals[0].items())) == \
        _digest(v for _, v in sorted(residuals[1].items()))
    return first, second, same_state, before["step"] == after["step"]


def test_stats_twice_returns_the_same_and_changes_nothing():
    for first, second, same_state, same_step in run_ranks(_stats_worker, 2, timeout=300):
        assert first == second and same_state and same_step
        assert first["step"] == 3 and first["bytes_sent"] > 0  # the last step is settled


# -- one door to torch.distributed, on the gradients' device ----------------------------------

COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_to_all_single",
               "all_gather_object", "broadcast_object_list", "reduce_scatter_tensor",
               "all_gather_into_tensor", "all_gather_single", "send", "recv", "isend", "irecv")


def _door_worker(rank, world_size, kw, steps):
    calls = []
    originals = {name: getattr(dist, name) for name in COLLECTIVES
                 if hasattr(dist, name)}  # torch < 2.12: no all_gather_single

    def wrap(name, fn):
        def recorded(*args, **kwargs):
            caller = inspect.stack()[1]
            module = caller.frame.f_globals.get("__name__", "?")
            tensors = [a for a in list(args) + list(kwargs.values())
                       if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, list) for t in a
                        if isinstance(t, torch.Tensor)]
            calls.append((name, module, sorted({str(t.device) for t in tensors})))
            return fn(*args, **kwargs)
        return recorded

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        model = make_model()
        state = GeoFP8State(model, GeoFP8Config(**kw))
        _train(model, state, steps, rank)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    grad_device = str(next(model.parameters()).device)
    return calls, grad_device, state.stats()


@pytest.mark.parametrize("kw", [
    dict(layers="all", refresh_every=2),  # refresh: reduce, owner broadcast
    dict(layers="profile", profile_steps=2, refresh_every=2),
    dict(layers="auto", refresh_every=2),
    dict(layers="auto", factor_source="fresh", refresh_every=2, k=8),
    dict(layers="all", factor_source="local", k=8),
    dict(layers="none", warmup_steps=2, transform="euclidean"),  # FP32 warm-up path
])
def test_every_collective_goes_through_the_device_group(kw):
    for calls, grad_device, stats in run_ranks(_door_worker, 2, (kw, 5), timeout=300):
        kinds = {name for name, _, _ in calls}
        # the consistency check and the payloads ran (torch < 2.12: the collective's old name)
        assert kinds & {"all_gather_single", "all_gather_into_tensor"}
        assert {module for _, module, _ in calls} == {group_module.__name__}, calls
        assert all(devices == [grad_device] for _, _, devices in calls if devices)
        assert stats["step"] == 5


# -- layers that read one input share one statistic --------------------------------------------

def _shared_worker(rank, world_size, kw):
    torch.manual_seed(0)
    model = QKV()
    state = GeoFP8State(model, GeoFP8Config(**kw))
    reduced = []  # sizes of the factor all-reduces (the refresh's statistics)
    all_reduce = state.group.all_reduce

    def recorded(t, kind, async_op=False):
        if kind == "factor":
            reduced.append(t.numel())
        return all_reduce(t, kind, async_op)

    state.group.all_reduce = recorded
    ddp = DDP(model, bucket_cap_mb=0.01)
    ddp.register_comm_hook(state, geofp8_hook)
    for step in range(3):
        tokens = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(step))
        ddp(tokens).pow(2).mean().backward()
    maps = state.pipeline.transforms()
    return (sorted(state.pipeline.shared.owner.items()), reduced,
            [maps[f"blocks.0.{p}.weight"] is maps["blocks.0.q.weight"] for p in "kv"])


def test_layers_reading_one_input_share_one_statistic_and_one_map():
    kw = dict(layers="all", refresh_every=2, statistics="exact")
    out = run_ranks(_shared_worker, 2, (kw,), timeout=300)
    owners, reduced, shared_maps = out[0]
    assert ("blocks.0.k.weight", "blocks.0.q.weight") in owners
    assert ("blocks.0.v.weight", "blocks.0.q.weight") in owners
    assert ("blocks.0.out.weight", "blocks.0.out.weight") in owners
    assert all(shared_maps)
    # the refresh reduces 2 statistics (q/k/v's input and out's input), not 4:
    # each is A's sum (32 × 32), its trace and its token count
    assert reduced == [2 * (32 * 32 + 2)]
    assert out[0] == out[1]


# -- auto decides on the error that error feedback really sends --------------------------------

def _auto_worker(rank, world_size):
    model = make_model()
    state = GeoFP8State(model, GeoFP8Config(layers="auto", refresh_every=2, format="e5m2"))
    ddp = DDP(model, bucket_cap_mb=0.01)
    ddp.register_comm_hook(state, geofp8_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    decisions = []
    for step in range(9):
        opt.zero_grad()
        loss_fn(ddp, step, rank).backward()
        opt.step()
        selection = state.pipeline.selection
        if selection.last_measurement:
            decisions.append((dict(selection.last_measurement), sorted(selection.selected)))
    return decisions


def test_auto_with_ef_never_selects_a_layer_whose_ef_error_is_worse():
    decisions = run_ranks(_auto_worker, 2, timeout=300)
    assert decisions[0] == decisions[1]  # identical on every rank
    assert decisions[0], "auto never measured"
    for measured, selected in decisions[0]:
        for name in selected:
            assert measured[name]["geometry"] <= measured[name]["euclidean"], name
