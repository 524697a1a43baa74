"""Value types for the ``geofp8`` flags: argparse calls them on the text typed, so a bad value
ends as ``geofp8 <command>: error: argument --flag: ...`` (exit status 2) before any model,
data or process is touched. Each returns the parsed value or raises
:class:`argparse.ArgumentTypeError` with the reason."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

__all__ = ["at_least", "choice_list", "comma_list", "flatten", "fraction", "text_file"]


def _number(kind: type, text: str):
    try:
        return kind(text)
    except ValueError:
        noun = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None


def at_least(low: float, kind: type = int, above: bool = False) -> Callable[[str], Any]:
    """A number ``>= low`` (``> low`` when ``above``)."""
    def parse(text: str):
        value = _number(kind, text)
        if value < low or (above and value == low):
            raise argparse.ArgumentTypeError(
                f"must be {'>' if above else '>='} {low:g}, got {text}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its "invalid ..." message
    return parse


def fraction(text: str) -> float:
    """A number in ``[0, 1)``."""
    value = _number(float, text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def comma_list(item: Callable[[str], Any]) -> Callable[[str], list]:
    """A comma list (``"8,16,32"``), each item parsed by ``item`` (e.g. :func:`at_least`)."""
    def parse(text: str) -> list:
        values = [item(x.strip()) for x in text.split(",") if x.strip()]
        if not values:
            raise argparse.ArgumentTypeError("needs at least one value")
        return values
    return parse


def choice_list(choices: Iterable[str], accept: Callable[[str], bool] | None = None
                ) -> Callable[[str], list[str]]:
    """A comma list of names from ``choices`` (or any name ``accept`` takes)."""
    choices = list(choices)

    def parse(text: str) -> list[str]:
        values = [x.strip() for x in text.split(",") if x.strip()]
        unknown = [x for x in values if x not in choices and not (accept and accept(x))]
        if unknown or not values:
            what = f"unknown {', '.join(map(repr, unknown))}" if unknown else "empty"
            raise argparse.ArgumentTypeError(f"{what}; choose from {', '.join(choices)}")
        return values
    return parse


def text_file(text: str) -> str:
    """An existing file (a directory is refused: it names no corpus)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give the text files in it")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    return text


def flatten(values: list) -> list:
    """The items of a ``nargs="+"`` flag whose type is a list (``--methods a,b c`` gives
    ``[["a", "b"], ["c"]]`` → ``["a", "b", "c"]``); a default of plain items is kept."""
    return [v for item in values for v in (item if isinstance(item, list) else [item])]
