"""Per-sender (local) factors on the wire: each sender's inverse map travels with its payload.

With :class:`~geofp8.geometry.sources.LocalFactors` no two ranks share a map, so the sum of
the senders' mapped rows cannot be mapped back once. Each sender appends, per shard, the
inverse map ``T_r⁻¹ = I + U_r diag(a_r) U_rᵀ`` of every per-sender tensor in that shard
(``U`` ``d_in × k`` and ``a_inv`` ``k``: float32 side bytes; each map up to its own scale,
as :class:`~geofp8.geometry.transforms.LowRankInput` applies it), and the shard's owner
maps each sender's decoded rows back with its own map before the FP32 sum:
``Σ_r V_r T_r⁻¹``.
"""

from __future__ import annotations

import torch

from .comm.layout import ShardLayout
from .geometry.transforms import LowRankInput, Transform

__all__ = ["factor_bytes", "sender_factors", "unmap_per_sender"]


def factor_bytes(source, d_in: int) -> int:
    """``U`` (``d_in × k``) and ``a_inv`` (``k``) as float32 (``k`` the rank ``source``
    gives a width ``d_in``)."""
    k = source.rank_of(d_in)
    return 4 * (d_in * k + k)


def sender_factors(source, shapes, per_sender, routes: list[Transform], layout: ShardLayout,
                   device: torch.device) -> list[torch.Tensor]:
    """Per shard: this sender's inverse map of every per-sender-decoded tensor in it."""
    blobs = {}
    for i, (shape, mapped, t) in enumerate(zip(shapes, per_sender, routes)):
        if not mapped:
            continue
        d, k = shape[1], source.rank_of(shape[1])
        if isinstance(t, LowRankInput):
            parts = [t.U.reshape(-1), t.a_inv]
        else:  # no factor on this rank this step: the identity map (U = 0, a = 0)
            parts = [torch.zeros(d * k + k, device=device)]
        blobs[i] = torch.cat([p.to(device, torch.float32) for p in parts]).view(torch.uint8)
    return [torch.cat([blobs[i] for i in layout.owners[j] if i in blobs] or
                      [torch.zeros(0, dtype=torch.uint8, device=device)])
            for j in range(layout.world_size)]


def unmap_per_sender(source, encoded, receiver: int):
    """``unmap(rows, sides)`` for ``receiver``'s shard of ``encoded`` (``[N, shard]`` decoded
    copies and ``[N, side bytes]``): ``V T_r⁻¹`` per sender ``r`` (``None`` when nothing in
    ``encoded`` is decoded per sender)."""
    if not any(encoded.per_sender):
        return None
    j, layout, shapes = receiver, encoded.layout, encoded.shapes

    def unmap(rows: torch.Tensor, sides: torch.Tensor) -> torch.Tensor:
        for values, side in zip(rows, sides):  # one sender's factors each
            pos = spos = 0
            for (lo, hi), i in zip(layout.segments[j], layout.owners[j]):
                if encoded.per_sender[i]:
                    d, k = shapes[i][1], source.rank_of(shapes[i][1])
                    nb = factor_bytes(source, d)
                    f = side[spos : spos + nb].clone().view(torch.float32)
                    U, a_inv = f[: d * k].view(d, k), f[d * k :]
                    Y = values[pos : pos + hi - lo].view(-1, d)
                    torch.addmm(Y, Y @ (U * a_inv), U.T, out=Y)  # as LowRankInput.inverse
                    spos += nb
                pos += hi - lo
        return rows
    return unmap
