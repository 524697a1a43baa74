"""The torch fallback's launches and Python per bucket, counted rather than timed.

One rank's share of a 25 MB bucket's stages (``benchmarks/gpu_bucket.py``: ``rank_share``,
the sender's encode with the bucket's BF16 residual as the DDP hook runs it, the owner's
decode-and-sum and re-encode, the decode of the gathered shards) on the ``meta`` device
with no Triton kernel taken: the aten ops that are neither views nor allocations (each a
launch on a GPU) and the lines of GeoFP8's own Python. Both are deterministic; neither may
grow with the number of ranks (the owner's sum of the ``N`` copies is one kernel, the
records' cuts are made once per layout)."""

import importlib.util
import os

import pytest
import torch

from fakedevice import FakeDevice, to_device, to_host
from geofp8.codecs import make_codec
from geofp8.comm import ShardLayout
from geofp8.comm.stages import sender_sum

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "gpu_bucket.py")
_SPEC = importlib.util.spec_from_file_location("gpu_bucket", _PATH)
gpu_bucket = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(gpu_bucket)


def _counts(fmt: str, kind: str, n: int) -> tuple[int, int]:
    """``(launches, py lines)`` of one steady call of a 25 MB bucket's stages on the torch
    path (its first call made before)."""
    layout = ShardLayout.build(gpu_bucket.shapes(25, kind), make_codec(fmt), n,
                               kernels="batched")
    run = gpu_bucket.rank_share(layout, torch.zeros(layout.numel, device="meta"), True)
    run()
    mode = gpu_bucket.Launches()
    with mode:
        run()
    return mode.launches + mode.triton, gpu_bucket.python_lines(run)


@pytest.mark.parametrize(("fmt", "most"), [("nvfp4", 72), ("e4m3", 60)])
def test_the_fallback_launches_the_same_few_kernels_for_2_or_8_ranks(fmt, most):
    """A 25 MB bucket of Llama-layer tensors (their blocks cut where shards fall) and of
    equal matrices, 2 and 8 ranks: the same launches, at most ``most`` (main before this
    round, NVFP4 with the residual: 80 for 2 ranks, 86 for 8; E4M3 62 and 68: the owner
    added the copies one by one; NVFP4's block scales took six ops to round up, and the
    sender's error unpacked its codes again)."""
    for kind in ("unequal", "equal"):
        launches = {n: _counts(fmt, kind, n)[0] for n in (2, 8)}
        assert len(set(launches.values())) == 1 and launches[2] <= most, (kind, launches)


def test_the_fallback_runs_the_same_python_for_2_8_or_64_ranks():
    """Equal matrices, NVFP4 with the residual: the same lines of Python for 2, 8 and 64
    ranks, up to the owner's two ways of taking its copies' parts (a cat of them, or from
    ``WINDOW_COPIES`` copies one gather per kind: a line apart) (main before this round:
    761, 857 and 1753; a loop over the senders in the owner's sum and its records' cuts,
    and one over the shards in the sender's buffer)."""
    lines = {n: _counts("nvfp4", "equal", n)[1] for n in (2, 8, 64)}
    assert lines[2] == lines[8] and abs(lines[64] - lines[8]) <= 2, lines


@pytest.mark.parametrize("n", [5, 8, 64])
def test_the_owner_sums_the_senders_in_order_in_one_kernel_off_the_cpu(n):
    """``stages.sender_sum`` on the fake accelerator (its segmented sum, one kernel) gives the
    CPU's row-by-row sum bit for bit: ``0 + rows[0] + rows[1] + …`` in FP32, NaN, ±Inf,
    −0 and values whose order of addition changes their sum included."""
    gen = torch.Generator().manual_seed(n)
    rows = torch.randn(n, 4099, generator=gen) * torch.rand(n, 4099, generator=gen) ** 8 * 1e8
    rows[0, :3] = torch.tensor([-0.0, float("nan"), float("inf")])
    rows[:, 3] = -0.0
    rows[1:, 4] = torch.tensor([1e8, -1e8, 1.0] * n)[: n - 1]
    want = sender_sum(rows)
    with FakeDevice() as dev:
        got = sender_sum(to_device(rows))
    adds = [op for op in dev.ops if "add" in op or "sum" in op]
    assert dev.ops["aten.segment_reduce.default"] == 1 and not adds, dev.ops
    assert torch.equal(to_host(got).view(torch.int32), want.view(torch.int32))
