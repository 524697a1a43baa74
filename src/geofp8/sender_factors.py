"""Per-sender (local) factors on the wire: each sender's inverse map travels with its payload.

With :class:`~geofp8.geometry.sources.LocalFactors` no two ranks share a map, so the sum of
the senders' mapped rows cannot be mapped back once. Each sender appends, per shard, the
inverse map ``T_r⁻¹ = c_r I + U_r diag(d_r) U_rᵀ`` of every per-sender tensor in that shard
(``U`` ``d_in × k``, ``d_inv`` ``k``, ``c_inv``: float32 side bytes), and the shard's owner
maps each sender's decoded rows back with its own map before the FP32 sum:
``Σ_r V_r T_r⁻¹``.
"""

from __future__ import annotations

import torch

from .comm.layout import ShardLayout
from .geometry.transforms import LowRankInput, Transform

__all__ = ["factor_bytes", "sender_factors", "unmap_per_sender"]


def factor_bytes(source, d_in: int) -> int:
    """``U`` (``d_in × k``), ``d_inv`` (``k``) and ``c_inv`` as float32 (``k`` the rank
    ``source`` gives a width ``d_in``)."""
    k = source.rank_of(d_in)
    return 4 * (d_in * k + k + 1)


def sender_factors(source, shapes, per_sender, routes: list[Transform], layout: ShardLayout,
                   device: torch.device) -> list[torch.Tensor]:
    """Per shard: this sender's inverse map of every per-sender-decoded tensor in it."""
    blobs = {}
    for i, (shape, mapped, t) in enumerate(zip(shapes, per_sender, routes)):
        if not mapped:
            continue
        d, k = shape[1], source.rank_of(shape[1])
        if isinstance(t, LowRankInput):
            parts = [t.U.reshape(-1), t.d_inv,  # c_inv: a float, or 0-dim on the device
                     torch.as_tensor(t.c_inv, dtype=torch.float32, device=device).reshape(1)]
        else:  # no factor on this rank this step: the identity map
            parts = [torch.zeros(d * k + k, device=device), torch.ones(1, device=device)]
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
                    U, d_inv, c_inv = f[: d * k].view(d, k), f[d * k : d * k + k], f[-1]
                    V = values[pos : pos + hi - lo].view(-1, d)
                    values[pos : pos + hi - lo] = (V * c_inv
                                                   + ((V @ U) * d_inv) @ U.T).view(-1)
                    spos += nb
                pos += hi - lo
        return rows
    return unmap
