"""The memory accounting of ``benchmarks/memory.py`` holds: the parts found apart (GeoFP8's
state by a walk of its objects, the buffers its code created, the framework's tensors) add
up to the measured peak, and the error-feedback residuals are one set in their storage.
The ranks are forked from a preloaded server (``fresh=False``): the bytes counted are the
same, only the process's resident set (not asserted on here) is smaller."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))

import memory  # noqa: E402  (benchmarks/memory.py)


@pytest.mark.distributed
@pytest.mark.parametrize("storage, per_param", [("bf16", 2), ("fp32", 4)])
def test_the_parts_add_up_to_the_peak_and_the_residuals_are_one_set(storage, per_param):
    params, peak, _, parts = memory.measure("fp8-ef", 2, residual=storage, model="llama-tiny",
                                            fresh=False)
    assert abs(parts.framework + parts.geofp8 - peak) <= 0.05 * peak, (parts, peak)
    # every parameter has a gradient: one residual each, in the storage's bytes
    assert parts.residuals == {"sender": per_param * params}
    assert parts.staged == 0  # written in place: no second set at any moment


@pytest.mark.distributed
@pytest.mark.parametrize("sender, per_param", [(None, 0), (True, 2)])
def test_fsdp_keeps_a_sender_residual_only_when_asked(sender, per_param):
    # the default keeps none; kept, it covers the whole unsharded gradient on every rank
    params, peak, _, parts = memory.measure("fp8-ef", 2, fsdp=True, model="llama-tiny",
                                            sender=sender, fresh=False)
    assert abs(parts.framework + parts.geofp8 - peak) <= 0.05 * peak, (parts, peak)
    assert parts.residuals == {"sender": per_param * params}
    assert parts.staged == 0
