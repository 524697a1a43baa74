"""A step's finite verdict, decided on the device from its units' flags.

Every unit of a step (a DDP bucket, an FSDP reduction) gives a 0-dim bool device flag "its
result is finite" (:meth:`StepVerdict.observe`, in the same order on every rank). The step's
verdict is their conjunction: one non-finite unit on one rank skips the step on every rank
(the exact collective already poisons such a bucket on every rank; adapters whose collective
does not, e.g. a reduce-scatter, *agree*: the flags are all-reduced first). The verdict stays
on the device, and so does the count of skipped steps.

Slots: a fused decode (:func:`geofp8.codecs.triton_fp8.decode_launches`) writes its unit's flag
into the next of the step's slots (:meth:`StepVerdict.slot`: a persistent uint8 vector sized
at settling, twice the step's units and at least 64, so DDP's rebuilt buckets still fit;
every slot handed out is written in its step, so nothing zero-fills it). When the step's
flags are its slots in order, one kernel makes the verdict and advances the skipped-step
counter (:func:`~geofp8.codecs.triton_fp8.verdict`). An agreement (its per-unit
factors wanted: FSDP's) all-reduces the FP32 "my flag is down" of the units, read from the
slots without a stack where they are the step's flags, and one kernel makes the units'
factors (1 or NaN), the verdict and the counter from the agreed counts
(:func:`~geofp8.codecs.triton_fp8.agreed`); else (the torch path, per-unit factors wanted
without an agreement) torch ops stack and reduce the flags.

The last unit's decode decides: when the engine starts a step's last unit and may let it
decide (:meth:`StepVerdict.arm`: no agreement, no per-unit callbacks), the slot that
unit will be handed (the ``n``-th of ``n`` units) is *armed*; the fused decode that writes
it finds the step by that slot (:func:`decode_into`) and, in its last program, reads the
``n - 1`` earlier slots (written by earlier kernels on the same stream), writes the verdict
and advances the counter. Settling then launches nothing. A unit whose map back ANDs or
rewrites its flag after the decode (a DDP bucket with layers on a map) hands the armed slot
to that (:meth:`StepVerdict.to_map`): the grouped map kernel decides instead
(:func:`map_into`; the torch path's map back takes none, and the verdict kernel settles).
Settling checks that the step's flags were its slots in order (else the torch verdict, the
counter corrected by ``made − finite``); a rollback takes the advance back
(``skipped −= ¬made``): the counter moves once per skipped step, on the device.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterator

import torch

from .codecs import triton_fp8
from .codecs.base import device_scalar

__all__ = ["StepVerdict", "decode_into", "map_into"]

_ADDRESS = torch.Tensor.data_ptr
_ARMED: dict[int, StepVerdict] = {}  # the address of a step's last slot -> that step
_ARMED_MAPS: dict[int, StepVerdict] = {}  # the same, handed to its map back (to_map)


def decode_into(launches: tuple, flag: torch.Tensor, *args,
                armed: dict[int, StepVerdict] = _ARMED, **kwargs) -> None:
    """Launch a fused decode writing its unit's flag into ``flag``: ``launches``' deciding
    one (:func:`~geofp8.codecs.triton_fp8.decode_launches`) when ``flag`` is a step's armed
    last slot (taken: once), then the step is decided; else the plain one. ``armed``: the
    slots armed for this kind of kernel (:func:`map_into`'s, a map back's)."""
    step = armed.pop(flag.data_ptr(), None) if armed else None
    if step is None:
        return launches[0](*args, flag_ptr=flag, **kwargs)
    launches[1](*args, flag_ptr=flag, **kwargs, **step.args)
    step.made, step.args = step.args, None  # (taken: nothing left to disarm)


def _new_bytes(device: torch.device) -> Iterator[torch.Tensor]:
    """0-dim uint8 tensors on ``device``, each a byte no other one was given (a verdict may
    be held past its step: the residuals' keep flag), made 256 at a time as they are taken
    (one allocation each; no Python per tensor taken)."""
    blocks = map(lambda _: torch.empty(256, dtype=torch.uint8, device=device).unbind(),
                 itertools.count())
    return itertools.chain.from_iterable(blocks)


def _factors(ok: torch.Tensor) -> torch.Tensor:
    """The units' factors (:meth:`StepVerdict.settle`) of their bool flags ``ok``: one
    ``where`` of two device constants."""
    one, nan = device_scalar(1.0, torch.float32, ok.device), \
        device_scalar(math.nan, torch.float32, ok.device)
    return torch.where(ok, one, nan)


# a map back's kernel that ANDs its unit's flag after the decode (StepVerdict.to_map)
map_into = functools.partial(decode_into, armed=_ARMED_MAPS)


class StepVerdict:
    """The flags of the step in flight and the slots they may be written into."""

    def __init__(self, skipped: Callable[[torch.device], torch.Tensor]) -> None:
        self._skipped = skipped  # the skipped steps' int64 counter on a device
        self.flags: list[torch.Tensor] = []  # per observed unit, in order
        self._slots: torch.Tensor | None = None  # uint8 [capacity]
        self._views: list[torch.Tensor] = []  # each slot's 0-dim view, made with the vector
        self._free: list[torch.Tensor] = []  # the views not handed out this step, last first
        self._addresses: list[int] = []  # the views' data_ptr, in order
        self._armable = 0  # a step of up to this many units may be decided by its decode
        # the slots and the skipped counter, and new uint8 verdicts, for the armed decisions
        self._decision: dict[str, torch.Tensor] = {}
        self._verdicts: Iterator[torch.Tensor] = iter(())
        self.args: dict | None = None  # the armed decision's kernel arguments (arm)
        self.made: dict | None = None  # those of the decision the last unit's decode made

    def arm(self, n: int) -> None:
        """The step's last unit, its ``n``-th, starts and its decode may decide the step
        (module notes): its slot is armed with the decision's arguments (the earlier flags,
        a new uint8 verdict, the skipped counter; :func:`decode_into`), when the slots hold
        ``n`` flags and the kernels run on them."""
        if n <= self._armable:
            self.args = {**self._decision, "n": n - 1, "verdict_ptr": next(self._verdicts)}
            _ARMED[self._addresses[n - 1]] = self

    def to_map(self) -> None:
        """The last unit, armed, maps its result back after its decode, ANDing or rewriting
        its flag: its map kernel decides the step (:func:`map_into`), its decode does not
        (none decides where the map back runs in torch: the verdict kernel settles)."""
        if self.args is not None:
            address = self._addresses[self.args["n"]]
            _ARMED_MAPS[address] = _ARMED.pop(address, self)

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
        self.flags, self._free, self.made = [], self._views[::-1], None
        if self.args is not None:  # armed, not taken: disarmed
            _ARMED.pop(self._addresses[self.args["n"]], None)
            _ARMED_MAPS.pop(self._addresses[self.args["n"]], None)
            self.args = None

    def rollback(self) -> None:
        """Forget the step in flight, and the skipped step its decode counted."""
        if self.made is not None:
            self.made["skipped_ptr"].sub_((1 - self.made["verdict_ptr"]).to(torch.int64))
        self.reset()

    def settle(self, device: torch.device,
               agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
               per_unit=False) -> tuple:
        """``(finite, factors, counted)``: the step's 0-dim bool verdict; with ``per_unit``
        (truthy: e.g. the engine's ``on_skip`` callbacks) its units' factors (FP32 ``[U]``:
        1 for a unit finite, after the agreement, NaN for one that is not: what poisons a
        unit's results by one multiply, as :func:`~geofp8.comm.stages.poison_unless` does),
        else ``None``; the skipped steps' int64 counter when advanced here, else ``None``
        (the caller counts).
        ``agree(bad)``: the sum over ranks of the FP32 ``[U]`` "my flag is down"
        (``per_unit``, a step whose flags are its slots: the factors, the verdict and the
        counter from one kernel, :func:`~geofp8.codecs.triton_fp8.agreed`). ``device``:
        where a step without units decides."""
        flags, slots, made = self.flags, self._slots, self.made
        self.reset()
        if made is not None:  # the last unit's decode made it
            if agree is None and not per_unit and self._are_slots(flags, made["n"] + 1):
                return made["verdict_ptr"].view(torch.bool), None, made["skipped_ptr"]
            return self._remade(flags, made, agree, per_unit)
        if agree is None and not per_unit and self._are_slots(flags, len(flags)) and \
                triton_fp8.available(slots):
            counter = self._skipped(slots.device)
            return triton_fp8.verdict(slots, len(flags), counter), None, counter
        device = flags[0].device if flags else torch.device(device)
        if slots is None or slots.numel() < len(flags) or slots.device != device:
            self._fit(len(flags), device)  # (the flags, taken above, may view the old slots)
        if agree is None:  # the torch path's verdict
            ok = torch.stack(flags) if flags else torch.ones(1, dtype=torch.bool, device=device)
            return ok.all(), _factors(ok) if per_unit else None, None
        # per unit, count the ranks whose flag is down (FP32; no stack where they are the slots)
        if self._are_slots(flags, len(flags)):
            ok = slots[: len(flags)].view(torch.bool)
        else:
            ok = torch.stack(flags) if flags else torch.ones(1, dtype=torch.bool, device=device)
        down = agree(torch.logical_not(ok, out=ok.new_empty(ok.shape, dtype=torch.float32)))
        if per_unit and triton_fp8.available(down):  # factors, verdict, counter: one kernel
            counter = self._skipped(device)
            return *triton_fp8.agreed(down, counter), counter
        ok = down == 0
        return ok.all(), _factors(ok) if per_unit else None, None

    def _fit(self, n: int, device: torch.device) -> None:
        """Slots for steps of ``n`` units on ``device`` (module notes)."""
        self._slots = torch.empty(max(2 * n, 64), dtype=torch.uint8, device=device)
        self._views = list(self._slots.unbind())
        self._addresses = list(map(_ADDRESS, self._views))
        self._free = self._views[::-1]
        self._armable = len(self._views) if triton_fp8.available(self._slots) else 0
        self._decision = {"flags_ptr": self._slots, "skipped_ptr": self._skipped(device)}
        self._verdicts = _new_bytes(device)

    def _remade(self, flags: list[torch.Tensor], made: dict, agree, per_unit: bool) -> tuple:
        """:meth:`settle` of a step the last unit's decode decided and counted (``made``:
        its arguments) whose flags were not its slots in order, the armed one last (e.g. a
        unit's from the torch path), or are wanted per unit: the torch verdict, the counter
        corrected by ``made − finite``."""
        ok = torch.stack(flags)  # (not empty: the armed unit was observed or not, others)
        if agree is not None:
            ok = agree((~ok).to(torch.float32)) == 0
        finite = ok.all()
        made["skipped_ptr"].add_(made["verdict_ptr"].to(torch.int64) - finite.to(torch.int64))
        return finite, _factors(ok) if per_unit else None, made["skipped_ptr"]

    def _are_slots(self, flags: list[torch.Tensor], n: int) -> bool:
        """Whether ``flags`` are the first ``n`` slots, in order (addresses compared without
        Python per flag: CUDA's unified addressing gives every device's and the host's
        memory addresses of their own)."""
        return 0 < n == len(flags) and list(map(_ADDRESS, flags)) == self._addresses[:n]
