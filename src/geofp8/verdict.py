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

from collections.abc import Callable

import torch

from .codecs import triton_fp8

__all__ = ["StepVerdict"]


class StepVerdict:
    """The flags of the step in flight and the slots they may be written into."""

    def __init__(self) -> None:
        self.flags: list[torch.Tensor] = []  # per observed unit, in order
        self._slots: torch.Tensor | None = None  # uint8 [capacity]
        self._handed = 0

    def slot(self, device: torch.device) -> torch.Tensor | None:
        """The next slot, a 0-dim uint8 on ``device`` for a unit's flag; ``None`` before the
        first settling, on another device, or past the last step's number of units."""
        slots = self._slots
        if slots is None or slots.device != torch.device(device) or \
                self._handed == slots.numel():
            return None
        self._handed += 1
        return slots[self._handed - 1]

    def observe(self, flag: torch.Tensor) -> None:
        self.flags.append(flag)

    def reset(self) -> None:
        """Forget the step in flight (settled or rolled back)."""
        self.flags, self._handed = [], 0

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
        if agree is None and not per_unit and _are_slots(flags, slots) and \
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
        return ok.all(), ok, None


def _are_slots(flags: list[torch.Tensor], slots: torch.Tensor | None) -> bool:
    """Whether ``flags`` are the first ``len(flags)`` slots, in order."""
    if slots is None or not flags:
        return False
    base = slots.data_ptr()
    return all(f.device == slots.device and f.data_ptr() == base + k
               for k, f in enumerate(flags))
