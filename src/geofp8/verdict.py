"""A step's finite verdict, decided on the device from its units' flags.

Every unit of a step (a DDP bucket, an FSDP reduction) gives a 0-dim bool device flag "its
result is finite" (:meth:`StepVerdict.observe`, in the same order on every rank). The step's
verdict is their conjunction: one non-finite unit on one rank skips the step on every rank
(the exact collective already poisons such a bucket on every rank; adapters whose collective
does not, e.g. a reduce-scatter, *agree*: the flags are all-reduced first). The verdict stays
on the device, and so does the count of skipped steps.

Slots: a fused decode (:func:`geofp8.codecs.triton_fp8.decode_placed`) writes its unit's flag
into the next of the step's slots (:meth:`StepVerdict.slot`: a persistent uint8 vector sized
at settling, twice the step's units and at least 64, so DDP's rebuilt buckets still fit;
every slot handed out is written in its step, so nothing zero-fills it). When the step's
flags are its slots in order, one kernel makes the verdict and advances the skipped-step
counter (:func:`~geofp8.codecs.triton_fp8.verdict`); else (the torch path, an agreement,
per-unit flags wanted) torch ops stack and reduce the flags.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch

from .codecs import triton_fp8

__all__ = ["StepVerdict"]

_ADDRESS, _DEVICE = torch.Tensor.data_ptr, operator.attrgetter("device")


class StepVerdict:
    """The flags of the step in flight and the slots they may be written into."""

    def __init__(self) -> None:
        self.flags: list[torch.Tensor] = []  # per observed unit, in order
        self._slots: torch.Tensor | None = None  # uint8 [capacity]
        self._views: list[torch.Tensor] = []  # each slot's 0-dim view, made with the vector
        self._free: list[torch.Tensor] = []  # the views not handed out this step, last first
        self._addresses: list[int] = []  # the views' data_ptr, in order

    def slot(self, device: torch.device) -> torch.Tensor | None:
        """The next slot, a 0-dim uint8 on ``device`` for a unit's flag; ``None`` before the
        first settling, on another device, or past the last step's number of units. (No lock:
        it is called on the thread that completes the units, DDP's hook's, the
        :class:`~geofp8.comm.collective.Communicator`'s completion; one ``list.pop``.)"""
        return self._free.pop() if self._free and self._free[0].device == torch.device(device) \
            else None

    def observe(self, flag: torch.Tensor) -> None:
        self.flags.append(flag)

    def reset(self) -> None:
        """Forget the step in flight (settled or rolled back)."""
        self.flags, self._free = [], self._views[::-1]

    def settle(self, device: torch.device, skipped: Callable[[torch.device], torch.Tensor],
               agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
               per_unit: bool = False) -> tuple:
        """``(finite, ok, counted)``: the step's 0-dim bool verdict; its units' flags (bool
        ``[U]``, after the agreement) unless they are not needed (``per_unit`` false and no
        ``agree``: ``None`` from the one-kernel path); ``skipped(device)``'s int64 counter
        when advanced here, else ``None`` (the caller counts). ``agree(bad)``: the sum over
        ranks of the FP32 ``[U]`` "my flag is down". ``device``: where a step without units
        decides."""
        flags, slots = self.flags, self._slots
        self.reset()
        if agree is None and not per_unit and self._are_slots(flags) and \
                triton_fp8.available(slots):
            counter = skipped(slots.device)
            return triton_fp8.verdict(slots, len(flags), counter), None, counter
        device = flags[0].device if flags else torch.device(device)
        ok = torch.stack(flags) if flags else torch.ones(1, dtype=torch.bool, device=device)
        if agree is not None:  # per unit, count the ranks whose flag is down
            ok = agree((~ok).to(torch.float32)) == 0
        if slots is None or slots.numel() < len(flags) or slots.device != device:
            self._slots = torch.empty(max(2 * len(flags), 64), dtype=torch.uint8,
                                      device=device)
            self._views = list(self._slots.unbind())
            self._addresses = list(map(_ADDRESS, self._views))
            self._free = self._views[::-1]
        return ok.all(), ok, None

    def _are_slots(self, flags: list[torch.Tensor]) -> bool:
        """Whether ``flags`` are the first ``len(flags)`` slots, in order (addresses and
        devices compared without Python per flag)."""
        return 0 < len(flags) <= len(self._addresses) and \
            list(map(_ADDRESS, flags)) == self._addresses[:len(flags)] and \
            set(map(_DEVICE, flags)) == {self._slots.device}
