"""Where a data-parallel step stands, and what it has cost.

A step is a sequence of *units* (DDP buckets, FSDP reduce-scatters, HSDP all-reduces); it is
*launched* once its last unit has been started and *settled* when every unit's result is
ready, finite on every rank or skipped: a verdict that stays on the device. The ledger holds
that phase, the step clock (every settled step, skipped or not: the schedule of warm-up,
refreshes and rounding seeds), the skipped steps (a device counter, read when asked) and the
per-step figures (bytes, seconds);
:attr:`StepLedger.last` is the last settled step's figures, read without side effects.
Figures are added without a lock: :meth:`StepLedger.add` appends to a per-figure list
(``list.append`` is one atomic step under the GIL, whichever thread calls it), and the
step's lists are swapped out and summed once, at settling, which follows every unit's
adds (the units' results are ready; an add of the next step finds the new lists).
"""

from __future__ import annotations

import enum
import math

import torch

__all__ = ["Phase", "StepLedger"]

COUNTERS = ("bytes_sent", "factor_bytes_sent", "bytes_fp32_equivalent", "elements",
            "codec_s", "transform_s", "statistics_s", "bytes_intra_node", "bytes_inter_node")


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
        self.last = dict.fromkeys(COUNTERS, 0.0)
        self._added = _nothing_added()  # figure -> the values added this step, in order

    def add(self, key: str, value: float) -> None:
        """Add ``value`` to this step's figure ``key`` (one of :data:`COUNTERS`)."""
        self._added[key].append(value)

    def add_each(self, keys: tuple[str, ...], values) -> None:
        """:meth:`add` of each of ``values`` to its figure in ``keys`` (no Python per
        figure)."""
        list(map(list.append, map(self._added.__getitem__, keys), values))

    @property
    def current(self) -> dict[str, float]:
        """This step's figures so far."""
        return _summed(self._added)

    def begin_unit(self, last: bool) -> bool:
        """Record a unit's start; ``True`` if it is the first unit of a step."""
        first = self.phase is Phase.IDLE
        self.phase = Phase.LAUNCHED if last else Phase.LAUNCHING
        return first

    @property
    def unsettled(self) -> bool:
        return self.phase is Phase.LAUNCHED

    @property
    def skipped_steps(self) -> int:
        """Steps settled as not finite (a host read of the device counter)."""
        return int(self._skipped)

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._skipped = int(value)

    def skipped_counter(self, device: torch.device) -> torch.Tensor:
        """The skipped steps' int64 0-dim counter on ``device``, for a caller that advances it
        in place when it decides a verdict (then :meth:`settle` with ``counted``)."""
        if not isinstance(self._skipped, torch.Tensor) or self._skipped.device != device:
            self._skipped = torch.tensor(int(self._skipped), dtype=torch.int64, device=device)
        return self._skipped

    def settle(self, finite: torch.Tensor, counted: torch.Tensor | None = None) -> None:
        """Close the launched step (``finite``: its 0-dim verdict, on the device; counted
        there when false, unless ``counted``: the :meth:`skipped_counter` already advanced).
        Its figures become :attr:`last`."""
        self.step += 1
        self._skipped = counted if counted is not None else (~finite).to(torch.int64) + \
            self._skipped
        added, self._added = self._added, _nothing_added()  # a late add lands in `added`
        self.last = _summed(added)
        self.phase = Phase.IDLE

    def reset_phase(self) -> None:
        """No step in flight (after a checkpoint load or a failed step); its figures go."""
        self._added = _nothing_added()
        self.phase = Phase.IDLE


def _nothing_added() -> dict[str, list[float]]:
    """A new empty list per figure (``iter(list, None)``: ``list()`` called for each)."""
    return dict(zip(COUNTERS, iter(list, None)))


def _summed(added: dict[str, list[float]]) -> dict[str, float]:
    """Each figure's values summed (exactly rounded: bytes stay exact integers)."""
    return dict(zip(added, map(math.fsum, added.values())))
