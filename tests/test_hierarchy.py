"""The hierarchical collective for DDP (FP32 inside a node, the exact collective between
nodes) on real gloo ranks: node layouts, uneven shards, replicas identical, bytes per link,
non-finite steps, bitwise resume."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed import run_ranks
from geofp8 import GeoFP8Config, GeoFP8State, geofp8_hook
from geofp8.hierarchy import node_size, row_chunks

pytestmark = pytest.mark.distributed


class Odd(nn.Module):
    """Rows that do not divide by the ranks per node; a bias; a ModuleList of blocks."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(24, 33), nn.Linear(33, 24)])
        self.head = nn.Linear(24, 5)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def _x(step, rank):
    return torch.randn(8, 24, generator=torch.Generator().manual_seed(100 * step + rank))


def _ddp(fields):
    torch.manual_seed(0)
    model = Odd()
    state = GeoFP8State(model, GeoFP8Config(**{"layers": "auto", **fields}))  # auto unless told
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.002)  # several buckets
    ddp.register_comm_hook(state, geofp8_hook)
    return model, ddp, state, torch.optim.SGD(model.parameters(), lr=0.05)


def _train(model, ddp, opt, steps, rank, start=0, bad=None):
    for step in range(start, start + steps):
        x = _x(step, rank)
        if bad == (step, rank):
            x = x * float("inf")
        ddp(x).pow(2).mean().backward()
        if all(torch.isfinite(p.grad).all() for p in model.parameters()):
            opt.step()
        opt.zero_grad()


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _layout_worker(rank, world, fields):
    model, ddp, state, opt = _ddp(fields)
    # the first step's averaged gradient against FP32's (an uncounted reference all-reduce)
    reference = Odd()
    reference.load_state_dict(model.state_dict())
    reference(_x(0, rank)).pow(2).mean().backward()
    ref = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    dist.all_reduce(ref)
    ref /= world
    ddp(_x(0, rank)).pow(2).mean().backward()
    got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    rel = float((got - ref).norm() / ref.norm())
    opt.step()
    opt.zero_grad()
    _train(model, ddp, opt, 4, rank, start=1)
    return _flat(model), rel, state.stats(), state.hierarchy is not None


@pytest.mark.parametrize("world,fields", [
    (4, dict(node_size=2)),  # 2 nodes of 2
    (4, dict(node_size=1, hierarchy="node")),  # 4 nodes of 1: the node hops are trivial
    (6, dict(node_size=3, layers="all", refresh_every=2, k=4)),  # 2 nodes of 3, geometry
])
def test_node_layouts_keep_replicas_identical_and_close_to_fp32(world, fields):
    fields = dict(candidates="linear", **fields)
    results = run_ranks(_layout_worker, world, args=(fields,))
    for params, rel, stats, hierarchical in results:
        assert hierarchical and torch.equal(params, results[0][0])
        assert rel < 0.06  # two E4M3 roundings of a node sum (2⁻⁴ each, relative to amax)
        assert stats["bytes_inter_node"] > 0 and stats["skipped_steps"] == 0
        assert ("bytes_intra_node" in stats) and stats["step"] == 5


def _bytes_worker(rank, world, fields):
    model, ddp, state, opt = _ddp(fields)
    _train(model, ddp, opt, 2, rank)
    return state.stats()


def test_only_the_node_sum_crosses_between_nodes():
    hier = run_ranks(_bytes_worker, 4, args=(dict(node_size=2, transform="euclidean",
                                                   layers="none"),))[0]
    flat = run_ranks(_bytes_worker, 4, args=(dict(hierarchy="flat", transform="euclidean",
                                                   layers="none"),))[0]
    assert "bytes_inter_node" not in flat
    # a flat rank sends 2/3 of its bytes to the other node; a hierarchical one half a
    # payload's worth of its node's chunk: half as much crosses
    flat_crossing = flat["payload_bytes_sent"] * 2 / 3
    assert hier["bytes_inter_node"] <= 0.55 * flat_crossing
    assert hier["bytes_intra_node"] > 0


def _nan_worker(rank, world):
    model, ddp, state, opt = _ddp(dict(node_size=2))
    _train(model, ddp, opt, 3, rank, bad=(1, 3))  # rank 3 (node 1) overflows at step 1
    return _flat(model), state.stats()


def test_a_non_finite_gradient_on_one_rank_skips_the_step_everywhere():
    results = run_ranks(_nan_worker, 4)
    for params, stats in results:
        assert (stats["step"], stats["skipped_steps"]) == (2, 1)
        assert torch.equal(params, results[0][0]) and torch.isfinite(params).all()


def _resume_worker(rank, world):
    fields = dict(node_size=2, layers="all", candidates="linear", refresh_every=2, k=4)
    model, ddp, state, opt = _ddp(fields)
    _train(model, ddp, opt, 6, rank)
    straight = _flat(model)
    model, ddp, state, opt = _ddp(fields)
    _train(model, ddp, opt, 3, rank)
    saved = (model.state_dict(), opt.state_dict(), state.state_dict())
    model, ddp, state, opt = _ddp(fields)
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    state.load_state_dict(saved[2])
    _train(model, ddp, opt, 3, rank, start=3)
    return torch.equal(straight, _flat(model))


def test_resume_is_bitwise():
    assert run_ranks(_resume_worker, 4) == [True] * 4


def test_node_size_from_the_config_or_torchrun(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert node_size(GeoFP8Config(), 4) == 2
    assert node_size(GeoFP8Config(hierarchy="flat"), 4) is None
    assert node_size(GeoFP8Config(collective="allgather"), 4) is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert node_size(GeoFP8Config(), 4) is None  # one node
    assert node_size(GeoFP8Config(node_size=2), 4) == 2
    with pytest.raises(ValueError, match="whole nodes of 3"):
        node_size(GeoFP8Config(node_size=3), 4)
    with pytest.raises(ValueError, match="needs collective='exact'"):
        GeoFP8Config(hierarchy="node", collective="allgather")


def test_row_chunks_pad_the_last_rank():
    assert row_chunks([(33, 24), (5,)], 2) == [(0, 17, 24), (17 * 24, 3, 1)]
