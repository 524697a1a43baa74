"""The one exception type of the tools that means "the user's input is wrong"."""

from __future__ import annotations

__all__ = ["UsageError"]


class UsageError(ValueError):
    """The user's input is wrong, not the program (a flag's value, a file that does not
    exist): ``geofp8`` prints the message as ``geofp8 <command>: error: ...`` and exits with
    status 2 (:func:`geofp8.tools.cli.main`). Its own module, so that ``python -m
    geofp8.tools.cli`` (where cli.py runs as ``__main__``) catches the same class the tools
    raise."""
