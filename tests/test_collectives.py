"""The exact FP8 all-reduce on real gloo processes, against its single-process model."""

import pytest
import torch

from distributed import run_ranks
from geofp8.collectives import (
    ShardLayout,
    exact_allreduce,
    fp32_allreduce_wire_bytes,
    simulate_exact_allreduce,
)
from geofp8.formats import Codec

SHAPES = [(5, 7), (3,), (64,), (10, 10)]
NUMEL = sum(torch.Size(s).numel() for s in SHAPES)


def _inputs(world_size):
    return [torch.randn(NUMEL, generator=torch.Generator().manual_seed(i)) * (i + 1)
            for i in range(world_size)]


def _exact_worker(rank, world_size, codec):
    layout = ShardLayout.build(SHAPES, codec, world_size)
    return exact_allreduce(_inputs(world_size)[rank].clone(), layout).wait()


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("scaling", ["tensor", "row", "block"])
def test_exact_allreduce_matches_model_on_every_rank(world_size, scaling):
    codec = Codec("e5m2", scaling, 16)
    outs = run_ranks(_exact_worker, world_size, (codec,))
    expected = simulate_exact_allreduce(_inputs(world_size), ShardLayout.build(SHAPES, codec,
                                                                               world_size))
    for out in outs:
        assert torch.equal(out, expected)  # bit-identical on all ranks, and equal to the model
    ref = torch.stack(_inputs(world_size)).sum(0)
    assert (expected - ref).norm() / ref.norm() < 2 * 2**-3


def test_wire_bytes_close_to_a_quarter_of_fp32():
    layout = ShardLayout.build([(1024, 1024)], Codec("e4m3", "tensor"), 4)
    ratio = layout.wire_bytes(0) / fp32_allreduce_wire_bytes(layout.numel, 4)
    assert 0.25 <= ratio < 0.2501
