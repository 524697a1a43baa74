"""The one door to ``torch.distributed``: every collective of the core goes through a
:class:`DeviceGroup`, which moves each tensor to the gradients' device first (NCCL accepts
only CUDA tensors) and charges the bytes this rank sends to a named counter.

Bytes follow each collective's standard algorithm: all-reduce ``2(N−1)/N·size`` (ring),
all-to-all the splits meant for the others, all-gather and broadcast ``(N−1)·size`` (the
broadcast charged to its source).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["DeviceGroup"]


class DeviceGroup:
    """A process group and the device its collectives run on.

    Args:
        group: the process group (``None``: the world).
        device: the gradients' device; every tensor handed over is moved there.
    """

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.group, self.device = group, torch.device(device)
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.bytes: dict[str, float] = {}

    def _charge(self, kind: str, nbytes: float) -> None:
        self.bytes[kind] = self.bytes.get(kind, 0.0) + nbytes

    def take_bytes(self) -> dict[str, float]:
        """The bytes charged since the last call, by kind (and reset)."""
        taken, self.bytes = self.bytes, {}
        return taken

    def on_device(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.device == self.device else t.to(self.device)

    def global_rank(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def all_reduce(self, t: torch.Tensor, kind: str, async_op: bool = False):
        """SUM all-reduce of ``t`` (moved to the device); returns ``(tensor, work)``."""
        t = self.on_device(t)
        self._charge(kind, 2 * (self.size - 1) * t.numel() * t.element_size() // self.size)
        work = dist.all_reduce(t, group=self.group, async_op=async_op)
        return t, work

    def broadcast(self, t: torch.Tensor, src: int, kind: str) -> torch.Tensor:
        """Broadcast from group rank ``src``; returns the (device) tensor."""
        t = self.on_device(t)
        if src == self.rank:
            self._charge(kind, (self.size - 1) * t.numel() * t.element_size())
        dist.broadcast(t, src=self.global_rank(src), group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, kind: str, async_op: bool = False):
        """``(list of every rank's t, work)``."""
        t = self.on_device(t)
        out = [torch.empty_like(t) for _ in range(self.size)]
        self._charge(kind, (self.size - 1) * t.numel() * t.element_size())
        work = dist.all_gather(out, t, group=self.group, async_op=async_op)
        return out, work

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int],
                   in_splits: list[int], kind: str):
        """Asynchronous ``all_to_all_single`` of uint8 buffers already on the device."""
        if out.device != self.device or inp.device != self.device:
            raise ValueError(f"all_to_all buffers must live on {self.device}")
        self._charge(kind, sum(n for j, n in enumerate(in_splits) if j != self.rank))
        return dist.all_to_all_single(out, inp, output_split_sizes=out_splits,
                                      input_split_sizes=in_splits, group=self.group,
                                      async_op=True)
