"""Where a data-parallel step stands, and what it has cost.

A step is a sequence of *units* (DDP buckets, FSDP reduce-scatters, HSDP all-reduces); it is
*launched* once its last unit has been started and *settled* when every unit's result is
ready, finite on every rank or skipped: a verdict that stays on the device. The ledger holds
that phase, the step clock (every settled step, skipped or not: the schedule of warm-up,
refreshes and rounding seeds), the skipped steps (a device counter, read when asked) and the
per-step figures (bytes, seconds);
:attr:`StepLedger.last` is the last settled step's figures, read without side effects.
Figures are added without a lock: :meth:`StepLedger.add` appends ``(figure, value)`` to the
step's list (``list.append``, or ``list.extend`` of a ``zip`` of tuples: one atomic step
under the GIL, whichever thread calls it), and the list is swapped out at settling, which
follows every unit's adds (the units' results are ready; an add of the next step finds the
new list), with the bytes every :class:`~geofp8.comm.group.DeviceGroup` counted at its door
that step (by kind). Both are summed when :attr:`~StepLedger.last` is read, not in the step.
"""

from __future__ import annotations

import enum
import math

import torch

__all__ = ["Phase", "StepLedger"]

COUNTERS = ("bytes_sent", "factor_bytes_sent", "bytes_fp32_equivalent", "elements",
            "codec_s", "transform_s", "statistics_s", "bytes_intra_node", "bytes_inter_node")
# the figure of each kind of bytes a DeviceGroup charges (the finite flags': payload bytes)
BYTE_FIGURES = {"payload": "bytes_sent", "factor": "factor_bytes_sent",
                "fp32_equivalent": "bytes_fp32_equivalent", "flag": "bytes_sent"}
LINK_KINDS = ("payload", "factor", "flag")  # what a group's link figure counts


class Phase(enum.Enum):
    IDLE = "idle"  # between steps
    LAUNCHING = "launching"  # some units of this step started, not the last
    LAUNCHED = "launched"  # the last unit started; the step awaits settling


class StepLedger:
    """Step clock, skipped steps, the phase and the per-step figures."""

    def __init__(self) -> None:
        self.step = 0
        self._skipped: torch.Tensor | int = 0  # a device counter once a step settled
        self.phase = Phase.IDLE
        self.units = 0  # the units started in the step in flight
        self._added: list[tuple[str, float]] = []  # (figure, value) added this step, in order
        # the last settled step's adds, and its groups' links and bytes by kind
        self._settled: tuple[list, list, list] = ([], [], [])

    def add(self, key: str, value: float) -> None:
        """Add ``value`` to this step's figure ``key`` (one of :data:`COUNTERS`)."""
        self._added.append((key, value))

    def add_each(self, keys: tuple[str, ...], values) -> None:
        """:meth:`add` of each of ``values`` to its figure in ``keys`` (no Python per
        figure)."""
        self._added.extend(zip(keys, values))

    @property
    def last(self) -> dict[str, float]:
        """The last settled step's figures (summed here, not in the step)."""
        return _summed(*self._settled)

    def begin_unit(self, last: bool) -> int:
        """Record a unit's start; its number in the step (1: the first)."""
        self.units = 1 if self.phase is Phase.IDLE else self.units + 1
        self.phase = Phase.LAUNCHED if last else Phase.LAUNCHING
        return self.units

    @property
    def skipped_steps(self) -> int:
        """Steps settled as not finite (a host read of the device counter)."""
        return int(self._skipped)

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        if isinstance(self._skipped, torch.Tensor):  # (in place: a decision holds it)
            self._skipped.fill_(int(value))
        else:
            self._skipped = int(value)

    def skipped_counter(self, device: torch.device) -> torch.Tensor:
        """The skipped steps' int64 0-dim counter on ``device``, for a caller that advances it
        in place when it decides a verdict (then :meth:`settle` with ``counted``); the same
        tensor until it is asked for on another device (advanced and set in place)."""
        if not isinstance(self._skipped, torch.Tensor) or self._skipped.device != device:
            self._skipped = torch.tensor(int(self._skipped), dtype=torch.int64, device=device)
        return self._skipped

    def settle(self, finite: torch.Tensor, counted: torch.Tensor | None,
               links: list[str | None], taken: list[dict[str, float]]) -> None:
        """Close the launched step (``finite``: its 0-dim verdict, on the device; counted
        there when false, unless ``counted``: the :meth:`skipped_counter` already advanced;
        ``taken``: every group's :meth:`~geofp8.comm.group.DeviceGroup.take_bytes`, by kind,
        ``links`` their links). Its figures become :attr:`last`."""
        self.step += 1
        if counted is None:
            self.skipped_counter(finite.device).add_((~finite).to(torch.int64))
        self._settled, self._added = (self._added, links, taken), []
        self.phase = Phase.IDLE

    def reset_phase(self) -> None:
        """No step in flight (after a checkpoint load or a failed step); its figures go."""
        self._added = []
        self.phase = Phase.IDLE


def _summed(added: list[tuple[str, float]], links: list[str | None],
            taken: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's values summed, every group's bytes (``taken``) included under their
    figures and their link's (exactly rounded: bytes stay exact integers)."""
    values: dict[str, list[float]] = {k: [] for k in COUNTERS}
    for key, value in added:
        values[key].append(value)
    for link, by_kind in zip(links, taken):
        for kind, figure in BYTE_FIGURES.items():
            values[figure].append(by_kind.get(kind, 0.0))
        if link is not None:
            values[f"bytes_{link}"].append(sum(by_kind.get(k, 0.0) for k in LINK_KINDS))
    return {k: math.fsum(v) for k, v in values.items()}
