"""The torch fallback's whole-bucket reorders: :class:`RunGather` moves runs of bytes between
flat and shard order with one gather, and a layout that takes it gives the bytes and values
of the split-and-cat path and of the chunked kernels, bit for bit."""

import pytest
import torch

from geofp8.codecs import make_codec
from geofp8.codecs.base import segment_amax
from geofp8.codecs.groups import PartsOrder, RaggedGather, RunGather
from geofp8.comm import ShardLayout
from geofp8.comm.stages import encode_with_error, simulate_exact_allreduce


def test_run_gather_moves_runs_as_split_and_cat_does():
    gen = torch.Generator().manual_seed(0)
    lengths = (6 * torch.randint(0, 5, (40,), generator=gen)).tolist()  # empty runs too
    order = torch.randperm(40, generator=gen).tolist()
    src = torch.randint(0, 256, (sum(lengths),), dtype=torch.uint8, generator=gen)
    runs = src.split(lengths)
    gather = RunGather(lengths, order)
    dst = gather.forward(src)
    assert gather.row == 6
    assert torch.equal(dst, torch.cat([runs[i] for i in order]))
    assert torch.equal(gather.backward(dst), src)


def _stages(layout, inputs):
    sent, error = encode_with_error(inputs[0], layout)
    return sent, error, simulate_exact_allreduce(inputs, layout)


# Tensors whose chunks share a factor (the gather) and a ragged one (the split-and-cat path)
@pytest.mark.parametrize("fmt", ["e4m3", "nvfp4", "mxfp4", "e5m2"])
@pytest.mark.parametrize("ragged", [False, True])
def test_a_layout_with_or_without_the_gather_gives_the_chunked_kernels_bits(fmt, ragged):
    n = 4
    shapes = [(64, 96), (32, 96), (96,), (128, 64)] + ([(7, 8)] if ragged else [])
    batched = ShardLayout.build(shapes, make_codec(fmt), n, kernels="batched")
    chunked = ShardLayout.build(shapes, make_codec(fmt), n, kernels="chunked")
    assert batched.segmentwise
    assert (batched._parts_order is None) == ragged
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(batched.numel, generator=gen) * 10.0 ** r for r in range(n)]
    for (a, b) in zip(_stages(batched, inputs), _stages(chunked, inputs)):
        assert torch.equal(a, b)
    inputs[2][100] = float("inf")  # every element NaN, on both paths
    assert simulate_exact_allreduce(inputs, batched).isnan().all()


def test_segment_amax_keeps_the_non_finite_policy_and_the_sign_of_zero():
    x = torch.tensor([1.0, -2.0, -0.0, -0.0, float("inf"), 3.0, float("nan"), -5.0, 0.0])
    amax = segment_amax(x, torch.tensor([2, 2, 2, 2, 1]))
    assert amax[:2].tolist() == [2.0, 0.0] and amax[1].signbit().item() is False
    assert amax[2:4].isnan().all() and amax[4].item() == 0.0


@pytest.mark.parametrize("ragged", [False, True])
def test_parts_are_gathered_straight_from_records_with_side_bytes(ragged):
    """``PartsOrder.from_records``: every kind whole in flat order, read straight from
    records that carry bytes after their parts (side bytes, padding), as the parts cut out
    of the records, joined kind by kind and moved back by each kind's own gather."""
    gen = torch.Generator().manual_seed(2)
    blocks = torch.randint(500, 1500, (12,), generator=gen) if ragged else torch.randint(
        1, 9, (12,), generator=gen) * 4  # block counts sharing no factor (ragged) or 4
    seg_bytes = [[4, int(b), 8 * int(b)] for b in blocks]
    positions = [list(range(j, 12, 3)) for j in range(3)]  # shard j: every third segment
    order = PartsOrder(seg_bytes, positions, ragged=ragged)
    assert any(isinstance(g, RaggedGather) for g in order.gathers) == ragged
    payload = [sum(b[j] for b in order.shard_bytes) for j in range(3)]
    records = [p + extra for p, extra in zip(payload, (0, 5, 3))]
    buf = torch.randint(0, 256, (sum(records) + 7,), dtype=torch.uint8, generator=gen)
    parts = [[] for _ in order.gathers]
    for j, record in enumerate(buf[: sum(records)].split(records)):
        for p, piece in enumerate(record[: payload[j]].split([b[j] for b in order.shard_bytes])):
            parts[p].append(piece)
    want = [g.backward(torch.cat(kind)) for g, kind in zip(order.gathers, parts)]
    for _ in range(2):  # the plan made, then reused
        got = order.from_records(buf, records)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
