"""Where a data-parallel step stands, and what it has cost.

A step is a sequence of *units* (DDP buckets, FSDP reduce-scatters, HSDP all-reduces); it is
*launched* once its last unit has been started and *settled* when every unit's result is
ready: committed if the step came back finite on every rank, discarded otherwise. The ledger
holds that phase, the step counters and the per-step figures (bytes, seconds);
:attr:`StepLedger.last` is the last settled step's figures, read without side effects.
Figures may be added from completion callbacks on other threads: :meth:`StepLedger.add`
takes a lock.
"""

from __future__ import annotations

import enum
import threading

__all__ = ["Phase", "StepLedger"]

COUNTERS = ("bytes_sent", "factor_bytes_sent", "bytes_fp32_equivalent", "elements",
            "codec_s", "transform_s", "statistics_s", "bytes_intra_node", "bytes_inter_node")


class Phase(enum.Enum):
    IDLE = "idle"  # between steps
    LAUNCHING = "launching"  # some units of this step started, not the last
    LAUNCHED = "launched"  # the last unit started; the step awaits settling


class StepLedger:
    """Step counter, skipped steps, the phase and the per-step figures."""

    def __init__(self) -> None:
        self.step = 0
        self.skipped_steps = 0
        self.phase = Phase.IDLE
        self.current = dict.fromkeys(COUNTERS, 0.0)
        self.last = dict.fromkeys(COUNTERS, 0.0)
        self._lock = threading.Lock()

    def add(self, key: str, value: float) -> None:
        with self._lock:
            self.current[key] += value

    def begin_unit(self, last: bool) -> bool:
        """Record a unit's start; ``True`` if it is the first unit of a step."""
        first = self.phase is Phase.IDLE
        self.phase = Phase.LAUNCHED if last else Phase.LAUNCHING
        return first

    @property
    def unsettled(self) -> bool:
        return self.phase is Phase.LAUNCHED

    def settle(self, finite: bool) -> None:
        """Close the launched step: counted if ``finite``, else skipped. Its figures become
        :attr:`last`."""
        if finite:
            self.step += 1
        else:
            self.skipped_steps += 1
        with self._lock:
            self.last, self.current = self.current, dict.fromkeys(COUNTERS, 0.0)
        self.phase = Phase.IDLE

    def reset_phase(self) -> None:
        """No step in flight (after a checkpoint load or a failed step); its figures go."""
        with self._lock:
            self.current = dict.fromkeys(COUNTERS, 0.0)
        self.phase = Phase.IDLE
