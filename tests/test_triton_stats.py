"""A step's statistics committed where finite in one Triton launch (a program per moment), or
two (tiles) for a layout with a very wide moment (geofp8.codecs.triton_stats), interpreted,
against the torch reference (JoinedMoments' nonfinite + add_where), bit for bit.

``TRITON_INTERPRET=1`` must be set before the kernels are decorated, so the checks run in a
child process (this file run as a script).
"""

from __future__ import annotations

import os

import pytest

from interpreted import Child

pytest.importorskip("triton")

DIMS = [3, 40, 1, 33]  # exact moments of 11, 1602 (two tiles), 3 and 1091 elements


def _joined(dtype):
    from geofp8.geometry.statistics import JoinedMoments, SecondMoment

    return JoinedMoments([SecondMoment(d, "exact", dtype=dtype) for d in DIMS])


def check() -> list[str]:
    """Five steps per dtype and design (one launch; tiles, :data:`ONE_PASS` set below the
    widest moment), fused and reference side by side from the same sums: a NaN in the
    first moment, an Inf in the second tile of the second, a skipped step with a -Inf;
    returns the failures."""
    import torch

    from geofp8.codecs import triton_stats

    failures = []
    one_pass = triton_stats.ONE_PASS
    for dtype, bits, wide in ((torch.float32, torch.int32, one_pass),
                              (torch.float64, torch.int64, one_pass),
                              (torch.float32, torch.int32, 1000),
                              (torch.float64, torch.int64, 1000)):
        triton_stats.ONE_PASS = wide
        design = "one launch" if wide == one_pass else "tiles"
        pending, window, ref_pending, ref_window = (_joined(dtype) for _ in range(4))
        if pending._fused is None:
            return ["the kernels are not available under the interpreter"]
        if isinstance(pending._fused, triton_stats.TiledCommit) != (design == "tiles"):
            failures.append(f"{design}: {type(pending._fused).__name__} chosen")
        window.flat.uniform_(-1, 1)
        ref_window.flat.copy_(window.flat)
        dropped = torch.full((len(DIMS),), 5, dtype=torch.int64)
        ref_dropped = dropped.clone()
        g = torch.Generator().manual_seed(0)
        for step in range(5):
            sums = torch.randn(pending.flat.numel(), generator=g, dtype=dtype)
            sums[4] = -0.0
            if step == 1:
                sums[5] = float("nan")
            if step in (2, 3):
                sums[11 + 1100] = float("inf") if step == 2 else float("-inf")
            pending.flat.copy_(sums)
            ref_pending.flat.copy_(sums)
            finite = torch.tensor(step != 3)
            pending.commit_into(window, finite, dropped)
            ref_pending._commit_reference(ref_window, finite, ref_dropped)
            ok = [torch.equal(window.flat.view(bits), ref_window.flat.view(bits)),
                  torch.equal(dropped, ref_dropped),
                  torch.equal(pending.flat.view(bits), ref_pending.flat.view(bits))]
            if not all(ok):
                failures.append(f"{dtype} {design} step {step}: window, dropped, zeroed {ok}")
        if dropped.tolist() != [6, 6, 5, 5]:
            failures.append(f"{dtype} {design}: dropped {dropped.tolist()}")
    triton_stats.ONE_PASS = one_pass
    return failures


def launches(wide: int) -> tuple[list[str], list[str]]:
    """(Triton kernels launched, torch ops dispatched) by a commit after the first, in
    order, with :data:`ONE_PASS` ``wide``."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from geofp8.codecs import triton_stats

    kernels, ops, ops_at = [], [], []  # ops_at: the ops' count after each launch

    class Ops(TorchDispatchMode):  # not the interpreter's own copies inside a launch
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if len(kernels) == len(ops_at):
                ops.append(str(func))
            return func(*args, **(kwargs or {}))

    triton_stats.ONE_PASS = wide
    for name in ("_commit_moment_kernel", "_nonfinite_kernel", "_commit_kernel"):
        kernel = getattr(triton_stats, name)

        def counted(*args, _run=kernel.run, _name=name, **kwargs):
            kernels.append(_name)
            try:
                return _run(*args, **kwargs)
            finally:
                ops_at.append(len(ops))
        kernel.run = counted
    pending, window = _joined(torch.float32), _joined(torch.float32)
    finite, dropped = torch.tensor(True), torch.zeros(len(DIMS), dtype=torch.int64)
    pending.commit_into(window, finite, dropped)  # the first makes the tile map and marks
    kernels.clear()
    ops_at.clear()
    with Ops():
        pending.commit_into(window, finite, dropped)
    for name in ("_commit_moment_kernel", "_nonfinite_kernel", "_commit_kernel"):
        del getattr(triton_stats, name).run  # the class's own again
    return kernels, ops


CHILD = Child([__file__])  # this file run as a script: the checks above


@pytest.mark.child(CHILD)
def test_one_launch_commits_the_finite_moments_bit_for_bit_as_torch():
    lines = CHILD.lines()
    assert lines[:-2] == [], lines  # no failure, either design
    # an ordinary commit: one kernel (a program per moment), no torch op (no host read, no
    # launch of torch's); a layout with a moment wider than ONE_PASS: two kernels
    assert lines[-2] == "launches ['_commit_moment_kernel'] torch ops []", lines[-2]
    assert lines[-1] == "launches ['_nonfinite_kernel', '_commit_kernel'] torch ops []", \
        lines[-1]


def test_the_layouts_of_auto_statistics_take_the_one_launch_commit():
    """The default ``statistics="auto"``: exact moments up to ``sketch_above`` wide, sketches
    ``d × (k + p)`` beyond, up to d = 16384: each within ONE_PASS (one launch)."""
    from geofp8.codecs import triton_stats
    from geofp8.config import GeoFP8Config

    config = GeoFP8Config()
    widest = max(config.sketch_above ** 2, 16384 * (config.k + config.oversample)) + 2
    assert widest <= triton_stats.ONE_PASS


def test_a_cpu_layout_without_the_interpreter_stays_on_the_torch_path():
    import torch

    assert _joined(torch.float32)._fused is None or os.environ.get("TRITON_INTERPRET") == "1"


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for failure in check():
        print(failure)
    for wide in (1 << 20, 1000):
        kernels, ops = launches(wide)
        print(f"launches {kernels} torch ops {ops}")
