"""Nothing non-finite survives in the factors: a statistic, sketch or map that is not finite
is detected, reset (the layer keeps its last finite map, the identity before its first),
counted in ``stats()["nonfinite_factors"]`` and warned once per layer; training goes on."""

import warnings

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run_ranks
from geofp8 import GeoFP8Config, GeoFP8State, geofp8_hook

pytestmark = pytest.mark.distributed


class Muted(nn.Module):
    """Two Linear layers whose output the loss can ignore (``mute``): a huge input then
    overflows the layers' statistics ``x xᵀ`` while every gradient stays finite (zero)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x, mute=False):
        out = self.b(torch.relu(self.a(x)))
        return out * 0 if mute else out


def _worker(rank, world_size):
    torch.manual_seed(0)
    model = Muted()
    ddp = DDP(model)
    state = GeoFP8State(model, GeoFP8Config(layers="all", candidates="linear", refresh_every=2,
                                            k=4, statistics="exact"))
    ddp.register_comm_hook(state, geofp8_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    source = state.pipeline.source
    counts, maps = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(7):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * step + rank))
            overflow = step == 1 and rank == 0  # this rank's statistics are inf, grads finite
            if step == 3:  # any other path: the window itself poisoned (every rank)
                source.window["b.weight"]["A"].total.fill_(float("nan"))
            opt.zero_grad()
            ddp(x * 1e20 if overflow else x, mute=overflow).pow(2).mean().backward()
            opt.step()
            counts.append(state.stats()["nonfinite_factors"])
            maps.append({n: t.state()["U"].clone() for n, t in state.pipeline.transforms().items()})
    said = [str(w.message) for w in caught if "not finite" in str(w.message)]
    params = [p.detach().clone() for p in model.parameters()]
    return counts, maps, said, params, state.stats()["skipped_steps"]


def test_non_finite_statistics_are_reset_counted_and_said_once():
    results = run_ranks(_worker, 2, timeout=90)
    for rank, (counts, maps, said, params, skipped) in enumerate(results):
        assert skipped == 0 and all(torch.isfinite(p).all() for p in params)
        # step 1's overflowing statistics (rank 0, layers a and b) are dropped on the device
        # and counted at the refresh of step 2; step 3's poisoned window of b is refused at
        # the refresh of step 4 on every rank, b keeping its map of step 2
        assert counts == ([0, 0, 2, 2, 3, 3, 3] if rank == 0 else [0, 0, 0, 0, 1, 1, 1])
        assert set(maps[2]) == {"a.weight", "b.weight"}
        assert torch.equal(maps[4]["b.weight"], maps[2]["b.weight"])
        assert not torch.equal(maps[4]["a.weight"], maps[2]["a.weight"])
        assert all(torch.isfinite(u).all() for m in maps for u in m.values())
        layers = sorted(s.split(" of ")[1].split()[0] for s in said)
        assert layers == (["'a.weight'", "'b.weight'"] if rank == 0 else ["'b.weight'"])
    for a, b in zip(results[0][3], results[1][3]):
        assert torch.equal(a, b)
    for name, u in results[0][1][-1].items():
        assert torch.equal(u, results[1][1][-1][name])
