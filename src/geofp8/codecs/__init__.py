"""Wire formats behind one interface (:class:`Codec`), registered by name.

``make_codec(format, scaling, block_size)`` is the one entry point; a new format is one new
class and one line in :data:`FORMATS`.

=========  ====================================================  =======================
format     codes and scales                                       bytes per element
=========  ====================================================  =======================
``e4m3``   FP8 E4M3, one FP32 scale per tensor / row / block      1 + 4 per scale group
``e5m2``   FP8 E5M2, likewise                                     1 + 4 per scale group
=========  ====================================================  =======================
"""

from __future__ import annotations

from collections.abc import Callable

from .base import Codec, Segments
from .fp8 import SCALINGS, FP8Codec, Packed

__all__ = ["FORMATS", "SCALINGS", "Codec", "FP8Codec", "Packed", "Segments", "make_codec"]


def _fp8(fmt: str) -> Callable[..., Codec]:
    return lambda scaling="tensor", block_size=128: FP8Codec(fmt, scaling, block_size)


# name -> factory(scaling, block_size)
FORMATS: dict[str, Callable[..., Codec]] = {
    "e4m3": _fp8("e4m3"),
    "e5m2": _fp8("e5m2"),
}


def make_codec(format: str = "e4m3", scaling: str = "tensor", block_size: int = 128) -> Codec:
    """The codec of ``format`` with the given scale granularity (where the format has one)."""
    if format not in FORMATS:
        raise ValueError(f"unknown format {format!r}; expected one of {list(FORMATS)}")
    return FORMATS[format](scaling=scaling, block_size=block_size)
