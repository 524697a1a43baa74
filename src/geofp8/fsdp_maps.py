"""A ``fully_shard`` unit's routes, resolved once and kept while they hold, and its low-rank
maps over FSDP's layout in one Triton launch each way (the FSDP counterpart of a DDP bucket's
record, :mod:`geofp8.bucket_record`, and of its grouped maps,
:class:`~geofp8.codecs.triton_map.GroupedMaps`).

FSDP's reduce-scatter input is ``[n, M]``: rank chunk ``r`` holds every parameter's dim-0
chunk ``r`` of ``rows`` rows of ``width`` elements at ``pos`` (``_Unit.rows``), the rows past
the parameter's end zero (FSDP's ``chunk_cat`` pads with zeros). An input-side map acts on
each row alone, so a parameter on a low-rank map is ``n`` slots of ``rows × width``
contiguous elements, at ``r M + pos``, and :class:`UnitMaps` writes ``Ũ = G T`` over every
mapped parameter's slots in one launch, each map packed once for its ``n`` slots. A padding
row stays zero: ``0 + (0 V) Uᵀ`` is ``+0`` (every product ``±0``, added to ``+0``; the maps
are finite, a source resets a non-finite one), as the per-parameter path leaves it. The sum
is mapped back on this rank's chunk only: a slot per parameter, at ``pos``, one launch.

An ordinary step routes a unit as the last one did: every parameter
:meth:`~geofp8.bucket_path.BucketPath.steady` (the identity, or a map that needs nothing of
this step) and no residual to add (the reduce-scatter keeps none by default: ``GeoFP8FSDP``'s
``sender_feedback``). :func:`resolve` makes a :class:`UnitRecord` of it, kept while the
pipeline's decisions keep their generation (new maps, a measuring step, a loaded state: a new
one), so a kept unit runs no Python per parameter. Its maps are grouped where a DDP bucket's
would be (the batched stages on the device, FP32 low-rank maps of 2-D weights the Triton
kernel places); elsewhere the unit goes parameter by parameter, as it always has.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .codecs import triton_map
from .geometry.transforms import IDENTITY, LowRankInput

__all__ = ["UnitMaps", "UnitRecord", "resolve"]


class UnitMaps:
    """A unit's mapped parameters over FSDP's layout (module notes): :meth:`forward` over the
    whole input, :meth:`back` over this rank's reduced chunk, one launch each."""

    __slots__ = ("_back", "_forward")

    def __init__(self, mapped: list[tuple[int, int, int, LowRankInput]], n: int, chunk: int,
                 device: torch.device, last: UnitMaps | None) -> None:
        """``mapped``: ``(pos, rows, width, T)`` of each mapped parameter in each of the
        ``n`` rank chunks of ``chunk`` elements; ``last``: the unit's previous maps, lending
        their program tables where the slots are the same."""
        slots = [(pos, rows, width, t.U, t.V_fwd, t.V_inv) for pos, rows, width, t in mapped]
        self._forward = triton_map.GroupedMaps(
            [(r * chunk + pos, *slot) for r in range(n) for pos, *slot in slots], device,
            last and last._forward)
        self._back = triton_map.GroupedMaps(slots, device, last and last._back)

    def forward(self, flat: torch.Tensor) -> None:
        """``G ← G T`` over each mapped parameter's rows of the input ``flat`` (``[n, M]``,
        flattened)."""
        self._forward(flat, False)

    def back(self, total: torch.Tensor) -> None:
        """``Y ← Y T⁻¹`` over each mapped parameter's rows of this rank's chunk ``total``."""
        self._back(total, True)

    def then(self, total: torch.Tensor, finite: torch.Tensor) -> torch.Tensor | None:
        """A fused reduce-scatter's ``then``: :meth:`back` over its ``total``, ANDing its
        0-dim bool ``finite`` with "every value written finite"; that flag, or ``None``
        where the torch path ran, which checks nothing (:meth:`GroupedMaps.__call__`)."""
        return finite if self._back(total, True, finite.view(torch.uint8)) else None


@dataclass(frozen=True)
class UnitRecord:
    """What :func:`resolve` found for a unit, in the ``key`` ``(generation, world size)``:
    ``plain``, every route the identity (``Ũ = G`` as it is); ``maps``, its grouped maps;
    neither, parameter by parameter this generation."""

    key: tuple
    plain: bool = False
    maps: UnitMaps | None = None


def resolve(pipeline, names: list[str], shapes: list[tuple[int, ...]],
            rows: list[tuple[int, int, int]], flat: torch.Tensor, n: int, batched: bool,
            last: UnitRecord | None) -> UnitRecord:
    """The record of a unit with no residual to add (module notes): its parameters
    ``names`` of ``shapes`` at ``rows`` (``_Unit.rows(n)``) in the input ``flat``;
    ``batched``: the unit's layout takes the batched stages on ``flat``'s device."""
    key = (pipeline.generation(), n)
    if not pipeline.recordable():  # (the pipeline's rule; FSDP has no budget nor owner)
        return UnitRecord(key)
    routes = []
    for name in names:  # (the first that is not steady decides)
        routes.append(pipeline.steady(name))
        if routes[-1] is None:
            return UnitRecord(key)
    mapped = [(*place, route) for place, route in zip(rows, routes) if route is not IDENTITY]
    if not mapped:
        return UnitRecord(key, plain=True)
    grouped = batched and all(isinstance(route, LowRankInput) and len(shape) == 2
                              for shape, route in zip(shapes, routes) if route is not IDENTITY) \
        and triton_map.places(flat, [t.U for *_, t in mapped])
    if not grouped:
        return UnitRecord(key)
    return UnitRecord(key, maps=UnitMaps(mapped, n, flat.numel() // n, flat.device,
                                         last and last.maps))
