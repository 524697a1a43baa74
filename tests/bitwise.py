"""Bitwise comparison of a kernel's output with its reference (shared by the interpreter
tests, which import torch only once ``TRITON_INTERPRET`` is set)."""

from __future__ import annotations


def same(a, b) -> bool:
    """Bitwise equal, any NaN where the other has a NaN."""
    import torch

    if a.dtype == torch.uint8:
        return torch.equal(a, b)
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(
        a.masked_fill(nan, 0).view(torch.int32), b.masked_fill(nan, 0).view(torch.int32))
