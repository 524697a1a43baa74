"""Host work per bucket, counted rather than timed: the lines of GeoFP8's own Python that one
rank's stages of a bucket execute (``benchmarks/gpu_bucket.py``: ``python_lines``, a trace on
the ``meta`` device, the fused Triton kernels taken as on CUDA and not run) do not grow with
the bucket's tensors, and a bucket runs the same lines after hundreds of other layouts have
run (no cache keyed by layouts or lengths that a large model overflows). Counts are
deterministic."""

import importlib.util
import os

import pytest
import torch

from geofp8.codecs import make_codec
from geofp8.comm import ShardLayout

pytest.importorskip("triton")
_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "gpu_bucket.py")
_SPEC = importlib.util.spec_from_file_location("gpu_bucket", _PATH)
gpu_bucket = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(gpu_bucket)


def _lines(shapes, fmt, n, fused, feedback=False):
    """Lines of one steady call of a bucket's stages (its first call made before);
    ``feedback``: the encode with the bucket's BF16 residual, as the DDP hook runs it."""
    with gpu_bucket.fused_path(fused):
        layout = ShardLayout.build(shapes, make_codec(fmt), n, kernels="batched")
        run = gpu_bucket.rank_share(layout, torch.zeros(layout.numel, device="meta"), feedback)
        run()
        return gpu_bucket.python_lines(run)


BUCKETS = [([(64, 64)] * 2, 2), ([(64, 64)] * 16, 8), ([(96, 64), (32,), (64, 160)] * 3, 8),
           ([(512, 64)] * 3 + [(7,)], 64)]


@pytest.mark.parametrize(("fmt", "feedback", "most"),
                         [("e4m3", False, 76), ("e4m3", True, 81), ("nvfp4", True, 92),
                          ("mxfp8", False, 94)])
def test_the_fused_stages_run_the_same_python_whatever_the_bucket(fmt, feedback, most):
    """Tensors, their shapes and the number of ranks change nothing on the host, with or
    without the bucket's residual, FP8 or block-scaled; and the lines stay under what a
    bucket takes once its stages are bound to their launches once per layout and device
    (``comm.bound``: before, with the harness's four lines, E4M3 223, 232 with the
    residual; NVFP4 with it 321; MXFP8 322; then 86, 91, 102 and 104 until the gathered
    decode decided its own flag, one launch and its epoch fewer; 83, 88, 99 and 101 until a
    launch was a partial of its kernel's run, no line of its own)."""
    counts = {_lines(shapes, fmt, n, fused=True, feedback=feedback) for shapes, n in BUCKETS}
    assert len(counts) == 1 and 0 < counts.pop() <= most, counts


@pytest.mark.parametrize("fmt", ["e4m3", "nvfp4"])
def test_the_torch_path_runs_no_python_per_tensor(fmt):
    """The fallback's Python grows with the ranks (a record per shard) but not with the
    tensors of the bucket: 4 or 16 of them, the same lines."""
    few, many = (_lines([(64, 64)] * t, fmt, 8, fused=False) for t in (4, 16))
    assert few == many, (few, many)


@pytest.mark.parametrize(("fmt", "fused"), [("e4m3", True), ("nvfp4", False)])
def test_a_bucket_runs_the_same_python_after_hundreds_of_other_layouts(fmt, fused):
    """One layout's steady call, before and after 260 distinct layouts ran (more than the
    256-entry caches the group helpers once had)."""
    def share(k):
        layout = ShardLayout.build([(64, 64), (2 * k + 2,)], make_codec(fmt), 8,
                                   kernels="batched")
        return gpu_bucket.rank_share(layout, torch.zeros(layout.numel, device="meta"))
    with gpu_bucket.fused_path(fused):
        control = share(0)
        control()
        before = gpu_bucket.python_lines(control)
        for k in range(1, 261):
            share(k)()
        assert gpu_bucket.python_lines(control) == before > 0


def test_the_nvfp4_torch_fallback_launches_at_most_82_kernels_a_bucket():
    """One rank's four stages of an NVFP4 bucket on the torch path (no Triton), N = 8: at
    most 82 launches (101 before the E2M1 key through ``torch.take``, the packing's cast in
    its OR, the device constants made once; 86 before the segment scale's clamp folded into
    its reduction, the poison in two kernels and the gathered records' kinds gathered
    without a ``cat``)."""
    layout = ShardLayout.build([(64, 64)] * 4, make_codec("nvfp4"), 8, kernels="batched")
    run = gpu_bucket.rank_share(layout, torch.zeros(layout.numel, device="meta"))
    run()
    mode = gpu_bucket.Launches()
    with mode:
        run()
    assert mode.triton == 0 and 0 < mode.launches <= 82, mode.launches
