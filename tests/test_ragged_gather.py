"""Ragged reorders: :class:`RaggedGather` moves runs of any lengths (no common factor) as
split-and-cat does, in three kernels each way, and a ragged layout takes it."""

import pytest
import torch

from geofp8.codecs import make_codec
from geofp8.codecs.groups import RaggedGather, RunGather, run_gather
from geofp8.comm import ShardLayout


@pytest.mark.parametrize("row", [1, 8, 64])
def test_ragged_gather_moves_runs_as_split_and_cat_does(row):
    gen = torch.Generator().manual_seed(row)
    for trial in range(40):
        k = int(torch.randint(1, 50, (1,), generator=gen))
        lengths = (torch.randint(0, 300, (k,), generator=gen) % (7 if trial % 3 else 300)).tolist()
        order = torch.randperm(k, generator=gen).tolist()
        src = torch.randint(0, 256, (sum(lengths),), dtype=torch.uint8, generator=gen)
        runs = src.split(lengths)
        gather = RaggedGather(lengths, order, row)
        dst = gather.forward(src)
        assert torch.equal(dst, torch.cat([runs[i] for i in order]))
        assert torch.equal(gather.backward(dst), src)


def test_run_gather_takes_the_smaller_index():
    aligned = ([64] * 30, list(range(29, -1, -1)))
    assert isinstance(run_gather(*aligned), RunGather)
    ragged = ([12, 4608, 6] * 20, list(range(59, -1, -1)))  # gcd 2
    chosen = run_gather(*ragged)
    assert isinstance(chosen, RaggedGather)
    assert chosen.index_bytes < RunGather(*ragged).index_bytes


def test_a_ragged_layout_reorders_without_split_and_cat():
    shapes = [(64, 96), (32, 96), (96,), (128, 64), (7, 8)]
    layout = ShardLayout.build(shapes, make_codec("nvfp4"), 4, kernels="batched")
    assert layout._parts_order is None  # the aligned gather's index is too large
    assert any(isinstance(g, RaggedGather) for g in layout._reorder.gathers)
