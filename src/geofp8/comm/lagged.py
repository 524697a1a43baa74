"""Multi-hop collectives in flight at once, in the same order on every rank.

A *run* is a generator that issues one collective per stage and yields; the next stage
waits for it (``work.wait()``) and issues the next one. Every rank must issue its
collectives in the same order, but they complete in different orders on different ranks, so
no stage is started "when its collective is done": each :meth:`Lagged.start` advances every
run in flight by exactly one stage, oldest first, then starts the new one. Run ``i``'s stage
``s`` is therefore issued during start ``i + s`` on every rank; a start marked ``last``
drains the rest round by round, in that same order. Stages run under the
:class:`~geofp8.comm.streams.SideStream` (on CUDA only it waits for the network), and a run's
future is completed there with ``then(value)`` of its return value.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator

import torch

from .collective import device_future, fail
from .streams import SideStream

__all__ = ["Lagged"]

Run = Generator[None, None, torch.Tensor]


class Lagged:
    """Runs advanced one stage per start (module notes). ``on_failure()``: called on this
    thread before a run's future is failed (a stage or ``then`` raised)."""

    on_failure: Callable[[], None] | None = None

    def __init__(self, stream: SideStream | None = None) -> None:
        self.stream = stream
        self._side = stream.use if stream is not None else contextlib.nullcontext
        self._runs: list[tuple[Run, torch.futures.Future, Callable]] = []

    def start(self, run: Run, device: torch.device, last: bool,
              then: Callable[[torch.Tensor], torch.Tensor]) -> torch.futures.Future:
        """Advance the runs in flight, start ``run``; with ``last``, finish them all."""
        result = device_future(device)
        with self._side():
            self._advance()
            self._runs.append((run, result, then))
            self._step(self._runs[-1])
            while last and self._runs:
                self._advance()
        return result

    def reset(self) -> None:
        """Drop the runs in flight (after a failed step)."""
        self._runs = []

    def _advance(self) -> None:
        for entry in list(self._runs):
            if entry in self._runs:  # a failed run's `then` may have reset the rest
                self._step(entry)

    def _step(self, entry) -> None:
        run, result, then = entry
        try:
            next(run)
        except StopIteration as done:
            self._runs.remove(entry)
            try:
                result.set_result(then(done.value))
            except Exception as exc:  # noqa: BLE001 - hand every failure to the caller
                fail(result, exc, self.on_failure)
        except Exception as exc:  # noqa: BLE001 - hand every failure to the caller
            self._runs.remove(entry)
            fail(result, exc, self.on_failure)
