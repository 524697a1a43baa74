"""Bytes on the wire, counted from what Python hands to ``torch.distributed``.

:class:`ByteCounter` wraps the collectives while it is active and charges every tensor with
what its standard algorithm sends from this rank: all-reduce ``2(N−1)/N·size``, all-gather
and broadcast ``(N−1)·size``, all-to-all the splits meant for others. DDP's built-in
all-reduce (no hook) runs in C++ and is not seen.
"""

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist


class ByteCounter:
    """Charges every collective issued through ``torch.distributed`` with its wire bytes."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.n, self.bytes = rank, world_size, 0

    @staticmethod
    def _size(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def charges(self) -> dict[str, Callable[..., int]]:
        n = self.n
        return {
            "all_reduce": lambda t, *a, **k: 2 * (n - 1) * self._size(t) // n,
            "all_gather": lambda out, t, *a, **k: (n - 1) * self._size(t),
            "all_gather_single": lambda out, t, *a, **k: (n - 1) * self._size(t),
            "all_gather_into_tensor": lambda out, t, *a, **k: (n - 1) * self._size(t),  # < 2.12
            "broadcast": lambda t, src, *a, **k: (n - 1) * self._size(t) if src == self.rank
            else 0,
            "all_to_all_single": lambda out, t, out_splits=None, in_splits=None, *a, **k:
                self._size(t) - (self._size(t) // n if in_splits is None else
                                 in_splits[self.rank] * t.element_size()),
        }

    @contextlib.contextmanager
    def counting(self):
        originals = {name: getattr(dist, name) for name in self.charges()
                     if hasattr(dist, name)}  # torch < 2.12 has no all_gather_single

        def wrap(name, fn, charge):
            def counted(*args, **kwargs):
                if name == "all_to_all_single":
                    self.bytes += charge(*args[:2], kwargs.get("output_split_sizes"),
                                         kwargs.get("input_split_sizes"))
                else:
                    self.bytes += charge(*args, **kwargs)
                return fn(*args, **kwargs)
            return counted

        for name, charge in self.charges().items():
            if name in originals:
                setattr(dist, name, wrap(name, originals[name], charge))
        try:
            yield self
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)
