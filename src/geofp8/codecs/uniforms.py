"""Stochastic rounding's uniforms: a counter-based hash, the same bits on every device.

A segment (one tensor's chunk of a shard) with key ``k = mix_seed(seed, i)`` (``i`` its
index in the shard) draws, for its element ``j``,

    h_j = mix32(mix32((j + k_lo) mod 2³²) xor k_hi),    u_j = ⌊h_j / 2⁸⌋ · 2⁻²⁴ ∈ [0, 1),

``k_lo``, ``k_hi`` the low and high 32 bits of ``k`` and ``mix32`` the ``lowbias32`` integer
hash (C. Wellons: xor-shift 16, multiply ``0x7FEB352D``, xor-shift 15, multiply
``0x846CA68B``, xor-shift 16, all modulo 2³²). Integer arithmetic only, so the CPU, a GPU
and the Triton kernels (:mod:`.triton_fp4`, which compute the same formula on the device)
draw identical numbers; torch's generators draw different streams on the CPU and on CUDA.
"""

from __future__ import annotations

import torch

from .base import mix_seed

__all__ = ["M32", "key_halves", "mix32", "uniforms"]

M32 = 0xFFFFFFFF


def key_halves(seed: int | None, index: int) -> tuple[int, int]:
    """``(k_lo, k_hi)`` of segment ``index`` under ``seed`` (``None`` counts as 0)."""
    k = mix_seed(seed or 0, index)
    return k & M32, k >> 32 & M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """``lowbias32`` of the int64 ``x`` holding 32-bit values (products wrap; the mask keeps
    their low 32 bits, which wrapping leaves exact)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def uniforms(key: tuple[int, int], n: int, device: torch.device) -> torch.Tensor:
    """``u_0 … u_{n−1}`` (FP32) of a segment with key halves ``key`` (module notes)."""
    lo, hi = key
    j = torch.arange(n, dtype=torch.int64, device=device)
    h = mix32(mix32((j + lo) & M32) ^ hi)
    return (h >> 8).float().mul_(2.0**-24)
