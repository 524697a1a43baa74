"""The torch fallback's launches and Python per bucket, counted rather than timed.

One rank's share of a 25 MB bucket's stages (``benchmarks/gpu_bucket.py``: ``rank_share``,
the sender's encode with the bucket's BF16 residual as the DDP hook runs it, the owner's
decode-and-sum and re-encode, the decode of the gathered shards) on the ``meta`` device
with no Triton kernel taken: the aten ops that are neither views nor allocations (each a
launch on a GPU) and the lines of GeoFP8's own Python. Both are deterministic; neither may
grow with the number of ranks (the owner's sum of the ``N`` copies is one kernel, the
records' cuts are made once per layout)."""

import functools
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


@functools.cache  # the launches' test and the lines' test share the NVFP4 layouts
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


@pytest.mark.parametrize(("fmt", "most", "ragged"), [("nvfp4", 70, 86), ("e4m3", 54, 57)])
def test_the_fallback_launches_the_same_few_kernels_for_2_8_or_64_ranks(fmt, most, ragged):
    """A 25 MB bucket of equal matrices and of Llama-layer tensors (their blocks cut where
    shards fall), 2, 8 and 64 ranks: the same launches for 2 and 8 ranks, at most ``most``,
    and for 64 the same with equal matrices (main f8ae040, NVFP4 with the residual: 72 for
    2 and 8 ranks, 74 for 64; E4M3 60 and 42, 43 for 64: a ``cat`` of the sender's ``3N``
    parts, the EF ``where``'s 0 and the error's copy into ``R``). With Llama tensors at 64
    ranks a 768-vector's groups are cut in 12 (ragged groups: a segmented amax and
    per-element scales): at most ``ragged`` (f8ae040: 101 and 65)."""
    for kind in ("unequal", "equal"):
        launches = {n: _counts(fmt, kind, n)[0] for n in (2, 8, 64)}
        assert len({launches[2], launches[8]}) == 1 and launches[2] <= most, (kind, launches)
        assert launches[64] == launches[8] if kind == "equal" else launches[64] <= ragged, (
            kind, launches)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_the_fallback_runs_the_same_python_for_2_8_or_64_ranks(fmt):
    """Equal matrices with the residual: the same lines of Python for 2, 8 and 64 ranks
    (f8ae040: NVFP4 628, 628 and 626, the owner's two ways of taking its copies' parts and
    the sender's ``cat`` of its ``3N`` parts; main before: 761, 857 and 1753, a loop over
    the senders in the owner's sum and its records' cuts, and one over the shards in the
    sender's buffer. MXFP8 2676, 8772 and 65663: its whole-bucket calls cut into and
    joined from a part per segment in Python)."""
    lines = {n: _counts(fmt, "equal", n)[1] for n in (2, 8, 64)}
    assert len(set(lines.values())) == 1, lines


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
