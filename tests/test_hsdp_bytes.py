"""HSDP's byte figures on every mesh shape: ``bytes_per_element`` is the bytes sent per
element of the (padded) unsharded gradient, also where one of the two hops is a single rank
(2 × 1: FSDP skips the reduce-scatter; 1 × 2: one replica)."""

import pytest
import torch
from torch import nn

from distributed import run_ranks
from geofp8 import GeoFP8Config

pytestmark = pytest.mark.distributed

SHAPES = {"a.weight": (64, 48), "a.bias": (64,), "b.weight": (33, 64), "b.bias": (33,)}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(48, 64), nn.Linear(64, 33)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _padded_elements(shard: int) -> int:
    """Elements of the unsharded gradient as FSDP lays it out: dim 0 padded to ``shard``."""
    return sum(-(-s[0] // shard) * shard * torch.Size(s[1:]).numel() for s in SHAPES.values())


def _worker(rank, world_size, replicate, shard):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from geofp8 import fsdp

    mesh = init_device_mesh("cpu", (replicate, shard), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    net = Net()
    fully_shard(net, mesh=mesh["shard"])
    state = fsdp.enable(net, GeoFP8Config(format="e4m3", transform="euclidean", layers="none"),
                        mesh=mesh)
    g = torch.Generator().manual_seed(rank)
    net(torch.randn(8, 48, generator=g)).pow(2).sum().backward()
    return state.stats()


@pytest.mark.parametrize("replicate,shard", [(2, 1), (1, 2), (2, 2)])
def test_hsdp_bytes_per_element_on_every_mesh_shape(replicate, shard):
    for stats in run_ranks(_worker, replicate * shard, (replicate, shard), timeout=90):
        elements = _padded_elements(shard)
        assert stats["bytes_sent"] > 0
        assert stats["bytes_per_element"] == pytest.approx(stats["bytes_sent"] / elements)
        # FP32: FSDP's reduce-scatter, (S-1)/S·4 bytes per element, and a ring all-reduce of
        # the shard (1/S of the elements) over the replicas, 2(R-1)/R·4 bytes per element
        fp32 = 4 * (shard - 1) / shard + 8 * (replicate - 1) / replicate / shard
        assert stats["bytes_fp32_equivalent"] / elements == pytest.approx(fp32, rel=1e-3)
        assert stats["bytes_per_element"] < 0.35 * fp32  # FP8 and its scales
