"""Error feedback + transform + amax + quantize in few passes over memory.

:func:`ef_quantize` is the sender's hot path of one layer (or one flat bucket):

    U = T(G) + R;   packed = Q(U);   R ← U − deq(packed)

It works *in place in the residual buffer* ``R`` (which the caller owns), so nothing
of the gradient's size is allocated except the FP8 codes (and those can be reused via
``codes_out``):

1. ``R ← R + T(G)``. For :class:`~geofp8.geometry.transforms.LowRankInput` this is
   ``R += G`` then ``R += (G V) Uᵀ`` (a skinny GEMM accumulated into ``R``),
   so ``G T`` is never materialised. Other transforms add ``T.forward(G)``.
2. One fused read of ``R`` for the group amax (``aminmax``, no ``|R|`` temporary).
3. One walk over ``R`` in cache-sized pieces: divide, cast to FP8, decode the piece
   back and subtract it — ``R`` leaves the cache holding the new residual.

With the identity transform, codes, scales and residual are bit-identical to
:func:`naive_ef_quantize`; with ``LowRankInput`` they agree up to the fp32 round-off of
a different summation order.
"""

from __future__ import annotations

import torch

from ..codecs.fp8 import CHUNK, FP8Codec, Packed, _decode_into, _encode_into, _info, _pieces
from .transforms import Identity, LowRankInput, Transform

__all__ = ["ef_quantize", "naive_ef_quantize"]


@torch.no_grad()
def ef_quantize(grad: torch.Tensor, residual: torch.Tensor, codec: FP8Codec,
                transform: Transform | None = None, lengths: list[int] | None = None,
                codes_out: torch.Tensor | None = None) -> Packed:
    """Quantize ``T(grad) + residual`` and leave the new error in ``residual`` (in place).

    Args:
        grad: the gradient (fp32, 2-D when a transform other than identity is given).
        residual: fp32 buffer of ``grad``'s shape (zeros on the first step); updated.
        codec: the FP8 codec.
        transform: the map to communication coordinates (``None``: identity).
        lengths: scale groups (default: the codec's groups of ``grad.shape``).
        codes_out: optional uint8 buffer of ``grad.numel()`` bytes for the codes.
    """
    if residual.shape != grad.shape or residual.dtype != torch.float32:
        raise ValueError("residual must be a float32 tensor of the gradient's shape")
    if not residual.is_contiguous():
        raise ValueError("residual must be contiguous")
    # 1. U = T(G) + R, accumulated into R
    if transform is None or isinstance(transform, Identity):
        residual.add_(grad)
    elif isinstance(transform, LowRankInput):
        G = grad.to(transform.U.dtype)  # G T (up to its scale, as LowRankInput applies it)
        residual.add_(G).addmm_(G @ transform.V_fwd, transform.U.T)
    else:
        residual.add_(transform.forward(grad))
    flat = residual.view(-1)
    lengths = codec.groups(tuple(grad.shape)) if lengths is None else list(lengths)
    info = _info(lengths)
    # 2. scales from one fused amax pass
    scales = codec.scales_of(flat, lengths, info)
    if codes_out is None:
        codes = torch.empty(flat.numel(), dtype=codec.dtype, device=flat.device)
    else:
        codes = codes_out.view(-1).view(codec.dtype)
    packed = Packed(codes.view(torch.uint8), scales, tuple(grad.shape), codec, tuple(lengths))
    if info.irregular:  # rare: many irregular groups; plain passes
        packed.codes.copy_(codec.quantize(flat, lengths).codes)
        flat.sub_(packed.dequantize().view(-1))
        return packed
    # 3. encode, decode and subtract piece by piece while the piece is in cache
    deq = torch.empty(min(CHUNK + info.widest, flat.numel()) or 1, device=flat.device)
    for lo, hi, rows, s in _pieces(lengths, info, scales):
        piece_lengths = [hi - lo] if not rows else [(hi - lo) // rows] * rows
        piece_scales = s.reshape(-1)
        sub_info = _info(piece_lengths)
        _encode_into(codes[lo:hi], flat[lo:hi], piece_scales, piece_lengths, sub_info)
        d = deq[: hi - lo]
        _decode_into(d, packed.codes[lo:hi], piece_scales, piece_lengths, sub_info,
                     codec.format)
        flat[lo:hi].sub_(d)
    return packed


@torch.no_grad()
def naive_ef_quantize(grad: torch.Tensor, residual: torch.Tensor, codec: FP8Codec,
                      transform: Transform | None = None) -> Packed:
    """The same result written the obvious way (reference for tests and the benchmark)."""
    u = (transform.forward(grad) if transform is not None else grad) + residual
    packed = codec.quantize(u)
    residual.copy_(u - packed.dequantize())
    return packed
