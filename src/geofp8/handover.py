"""The owner's residual handed over to the sender when a tensor takes a map again.

With ``owner_feedback``, the second rounding's residual ``O`` of a tensor lives in Euclidean
coordinates, on the rank that owns its piece of the reduced shard, and is kept only while
the tensor is sent without a map (:meth:`geofp8.pipeline.GradientPipeline.owner_keys`). In
the first step in which the tensor takes a map again (a budget's or an ``auto`` selection's
change of route), its owner's residual cannot be re-based on the owner's piece (``T`` mixes
whole rows): it is *handed over* to this rank's send instead, ``Ũ = G T + R + O T`` (``O``
zero outside the piece), and so reaches the sum whole, its rounding error going on in the
sender's residual ``R`` (with ``error_feedback``), which is re-based with the route. Every
rank does so with the piece it owns. The owner's residual is dropped at once; a non-finite
step resets the sender's residual it wrote to zero, so the handed-over error is then lost,
as every residual of a skipped step is. A change of format alone (``nvfp4`` ↔ ``e4m3``)
keeps the owner's residual as it is, as the sender's.
"""

from __future__ import annotations

import torch

from .comm.layout import ShardLayout
from .feedback import ErrorFeedback
from .geometry.transforms import IDENTITY

__all__ = ["hand_over"]


def hand_over(owner: ErrorFeedback, name: str, shape, codec, world_size: int, rank: int
              ) -> torch.Tensor:
    """``O`` of ``name``: this rank's owner residual as a whole FP32 tensor of ``shape``
    (Euclidean, zero outside this rank's piece of the tensor as the exact collective cuts it
    by itself), removed from ``owner``."""
    piece = owner.residual_in(name, IDENTITY).reshape(-1)
    alone = ShardLayout.build([tuple(shape)], codec, world_size)
    [(lo, hi)] = alone.segments[rank] or [(0, 0)]
    if piece.numel() != hi - lo:
        raise RuntimeError(f"GeoFP8: the owner residual of {name} has {piece.numel()} "
                           f"elements, not its piece's {hi - lo}")
    whole = torch.zeros(alone.numel, dtype=torch.float32, device=piece.device)
    whole[lo:hi] = piece
    owner.drop(name)
    return whole.view(shape)
