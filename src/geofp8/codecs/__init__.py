"""Wire formats behind one interface (:class:`Codec`), registered by name.

``make_codec(format, scaling, block_size, rounding)`` is the one entry point; a new format is
one new class and one line in :data:`FORMATS`. The block formats fix their own scale groups
(``scaling`` and ``block_size`` apply to the FP8 formats only).

==========  =====================================================  ==========================
format      codes and scales (byte layout: the codec's module)      bytes per element
==========  =====================================================  ==========================
``e4m3``    FP8 E4M3, one FP32 scale per tensor / row / block       1 + 4 per scale group
``e5m2``    FP8 E5M2, likewise                                      1 + 4 per scale group
``nvfp4``   E2M1, two per byte; an E4M3 scale per 16 elements;      0.5 + 1/16 (+ 4 per
            an FP32 scale per segment (:mod:`.fp4`)                 tensor chunk) ≈ 0.5625
``mxfp4``   E2M1, two per byte; an E8M0 scale per 32 (:mod:`.mx`)   0.5 + 1/32 = 0.53125
``mxfp8``   E4M3; an E8M0 scale per 32 (:mod:`.mx`)                 1 + 1/32 = 1.03125
==========  =====================================================  ==========================

``rounding``: ``"nearest"`` (ties to even) for every format, or ``"stochastic"`` (unbiased;
block formats only) with a seed passed to :meth:`Codec.encode_into`.
"""

from __future__ import annotations

from collections.abc import Callable

from .base import Codec, Segments
from .fp4 import ROUNDINGS, NVFP4Codec
from .fp8 import SCALINGS, FP8Codec, Packed
from .mx import MXCodec

__all__ = ["FORMATS", "ROUNDINGS", "SCALINGS", "Codec", "FP8Codec", "MXCodec", "NVFP4Codec",
           "Packed", "Segments", "make_codec"]


def _fp8(fmt: str) -> Callable[..., Codec]:
    def factory(scaling=None, block_size=None, rounding="nearest") -> Codec:
        if rounding != "nearest":
            raise ValueError(f"format {fmt!r} rounds to nearest only; stochastic rounding "
                             "is offered for nvfp4, mxfp4 and mxfp8")
        return FP8Codec(fmt, scaling or "tensor", block_size or 128)
    return factory


def _mx(fmt: str, element: str) -> Callable[..., Codec]:
    return lambda scaling=None, block_size=None, rounding="nearest": MXCodec(
        fmt, element, rounding)


# name -> factory(scaling, block_size, rounding)
FORMATS: dict[str, Callable[..., Codec]] = {
    "e4m3": _fp8("e4m3"),
    "e5m2": _fp8("e5m2"),
    "nvfp4": lambda scaling=None, block_size=None, rounding="nearest": NVFP4Codec(
        "nvfp4", rounding),
    "mxfp4": _mx("mxfp4", "e2m1"),
    "mxfp8": _mx("mxfp8", "e4m3"),
}


def make_codec(format: str = "e4m3", scaling: str | None = None, block_size: int | None = None,
               rounding: str = "nearest") -> Codec:
    """The codec of ``format`` with the given scale granularity (FP8 formats: ``None`` is
    ``"tensor"`` and 128 elements per block; the block formats fix their own) and rounding."""
    if format not in FORMATS:
        raise ValueError(f"unknown format {format!r}; expected one of {list(FORMATS)}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"unknown rounding {rounding!r}; expected one of {ROUNDINGS}")
    return FORMATS[format](scaling=scaling, block_size=block_size, rounding=rounding)
