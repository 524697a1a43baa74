"""Where a data-parallel step stands, and what it has cost.

A DDP step is a sequence of bucket launches; it ends when the last bucket is launched and is
*settled* when the last bucket's result is ready (before ``backward()`` returns): committed
if every bucket came back finite on every rank, discarded otherwise. The ledger holds that
phase, the step counters and the per-step figures (bytes, seconds); :attr:`StepLedger.last`
is the last settled step's figures, read without side effects.
"""

from __future__ import annotations

import enum

__all__ = ["Phase", "StepLedger"]

COUNTERS = ("bytes_sent", "factor_bytes_sent", "bytes_fp32_equivalent", "elements",
            "codec_s", "transform_s", "statistics_s")


class Phase(enum.Enum):
    IDLE = "idle"  # between steps
    LAUNCHING = "launching"  # some buckets of this step launched, not the last
    LAUNCHED = "launched"  # the last bucket launched; the step awaits settling


class StepLedger:
    """Step counter, skipped steps, the phase and the per-step figures."""

    def __init__(self) -> None:
        self.step = 0
        self.skipped_steps = 0
        self.phase = Phase.IDLE
        self.finite = True
        self.current = dict.fromkeys(COUNTERS, 0.0)
        self.last = dict.fromkeys(COUNTERS, 0.0)

    def add(self, key: str, value: float) -> None:
        self.current[key] += value

    def begin_bucket(self, last: bool) -> bool:
        """Record a bucket launch; ``True`` if it is the first bucket of a step."""
        first = self.phase is not Phase.LAUNCHING
        self.phase = Phase.LAUNCHED if last else Phase.LAUNCHING
        return first

    @property
    def unsettled(self) -> bool:
        return self.phase is Phase.LAUNCHED

    def settle(self) -> bool:
        """Close the launched step: ``True`` if it was finite (counted), ``False`` if it was
        skipped. Its figures become :attr:`last`."""
        finite = self.finite
        if finite:
            self.step += 1
        else:
            self.skipped_steps += 1
        self.phase, self.finite = Phase.IDLE, True
        self.last, self.current = self.current, dict.fromkeys(COUNTERS, 0.0)
        return finite

    def reset_phase(self) -> None:
        """After loading a checkpoint: no step in flight."""
        self.phase, self.finite = Phase.IDLE, True
        self.current = dict.fromkeys(COUNTERS, 0.0)
