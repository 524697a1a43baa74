"""The lines of GeoFP8's own Python a call executes, the stages' apart from the rest.

:class:`SplitLines` traces a call (as ``gpu_bucket.python_lines`` does) and splits its lines
into the stages' (run under a frame of :mod:`geofp8.comm.stages` or of a layout's bound stages,
:data:`STAGES`, whatever that calls) and the others (for the DDP hook: its own host work around
the stages). A count, not a time: deterministic whatever the machine's load; :data:`LINE_US`
converts it into modelled host µs. :func:`hooked` makes the DDP hook of a method as
``hook_launches.py`` and the tests count it. No environment is set here (``hook_launches``
sets Triton's interpreter).
"""

from __future__ import annotations

import dataclasses
import os
import sys

import geofp8

ROOT = os.path.dirname(geofp8.__file__) + os.sep  # GeoFP8's own files (as gpu_bucket's)

# a line under one of their frames is a stage's: the stages' entries (comm.stages) and the
# layouts' bound stages (comm.bound, comm.plan, comm.block_plan), which a bucket record and the
# collective call themselves
STAGES = tuple(os.path.join(ROOT, "comm", f"{name}.py")
               for name in ("stages", "bound", "plan", "block_plan"))
# Host µs of one library line executed, measured here as the fused stages' modelled host
# time less their launches, over their lines: `gpu_bucket.py --paths fused --methods fp8-ef
# nvfp4-ef --sizes 1 --ranks 8 --kinds equal --repeats 9`, twice on 2026-12-07 on the shared
# 2-core machine: fp8-ef (89 or 102 µs - 6 × 8) / 232 lines, nvfp4-ef (99 or 123 - 48) / 321:
# 0.16-0.23 µs a line.
LINE_US = 0.2


class SplitLines:
    """A trace of the lines of GeoFP8's own Python a call executes (as
    ``gpu_bucket.python_lines``), split into the stages' (under a frame of one of
    :data:`STAGES`, whatever it calls) and the hook's own (everything else);
    ``paused()``: true while the frames begun are not counted (an interpreted kernel)."""

    def __init__(self, paused=lambda: False) -> None:
        self.paused, self.hook, self.stages = paused, 0, 0
        self._stage = None  # the outermost frame of a STAGES file running, if any

    @property
    def in_stages(self) -> bool:
        return self._stage is not None

    def run(self, call) -> None:
        def local(frame, event, arg):
            if event == "line":
                if self._stage is None:
                    self.hook += 1
                else:
                    self.stages += 1
            elif event == "return" and frame is self._stage:
                self._stage = None
            return local

        def calls(frame, event, arg):
            name = frame.f_code.co_filename
            if self.paused() or not name.startswith(ROOT):
                return None
            if self._stage is None and name in STAGES:
                self._stage = frame
            return local

        sys.settrace(calls)
        try:
            call()
        finally:
            sys.settrace(None)


def hooked(model, method: str, mapped: int | None):
    """``(state, hook)`` of ``method`` on ``model``; a geometry method with refreshes every
    3 steps and (a profile) step 0 scored, its ``mapped`` best layers kept (all if None)."""
    from geofp8.ddp import GeoFP8State, geofp8_hook
    from geofp8.methods import METHODS

    spec = METHODS[method]
    settings = {"refresh_every": 3, "profile_steps": 1, "kernels": "batched"}
    config = spec.config(**{k: v for k, v in settings.items() if k in spec.overrides})
    if config is None:
        return spec.build(model)[:2]
    config = dataclasses.replace(config, profile_top=mapped or len(model))
    return GeoFP8State(model, config), geofp8_hook
