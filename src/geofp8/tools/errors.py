"""The exception types of the tools that end the ``geofp8`` command with one line, and how a
rank of a local launch hands its error to the launcher instead of printing it."""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path

__all__ = ["FAILURES_ENV", "RunFailed", "UsageError", "record_failure"]

# The folder where the ranks of `geofp8 train --nproc N` write their errors
# (geofp8.tools.train.launch reads it).
FAILURES_ENV = "GEOFP8_RANK_FAILURES"


class UsageError(ValueError):
    """The user's input is wrong, not the program (a flag's value, a file that does not
    exist): ``geofp8`` prints the message as ``geofp8 <command>: error: ...`` and exits with
    status 2 (:func:`geofp8.tools.cli.main`). Its own module, so that ``python -m
    geofp8.tools.cli`` (where cli.py runs as ``__main__``) catches the same class the tools
    raise."""


class RunFailed(RuntimeError):
    """A launched run failed and its ranks' error has been printed already: ``geofp8``
    prints this message as ``geofp8 <command>: error: ...`` and exits with status 1."""


def record_failure(error: BaseException) -> bool:
    """In a rank of a launch by :func:`geofp8.tools.train.launch.launch`: write ``error``
    (its message, its traceback, whether it is a :class:`UsageError`) for the launcher to
    report, and return True. Elsewhere return False: the caller reports it itself."""
    folder, rank = os.environ.get(FAILURES_ENV), os.environ.get("RANK")
    if not folder or rank is None or not Path(folder).is_dir():
        return False
    record = {"rank": int(rank), "usage": isinstance(error, UsageError), "message": str(error),
              "traceback": "".join(traceback.format_exception(error))}
    Path(folder, f"rank{rank}.json").write_text(json.dumps(record))
    return True
