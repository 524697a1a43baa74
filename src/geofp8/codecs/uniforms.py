"""Stochastic rounding's uniforms: a counter-based hash, the same bits on every device.

A segment (one tensor's chunk of a shard) with key ``k = mix_seed(seed, i)`` (``i`` its
index in the shard) draws, for its element ``j``,

    h_j = mix32(mix32((j + k_lo) mod 2³²) xor k_hi),    u_j = ⌊h_j / 2⁸⌋ · 2⁻²⁴ ∈ [0, 1),

``k_lo``, ``k_hi`` the low and high 32 bits of ``k`` and ``mix32`` the ``lowbias32`` integer
hash (C. Wellons: xor-shift 16, multiply ``0x7FEB352D``, xor-shift 15, multiply
``0x846CA68B``, xor-shift 16, all modulo 2³²). Integer arithmetic only, so the CPU, a GPU
and the Triton kernels (:mod:`.triton_fp4`, which compute the same formula on the device)
draw identical numbers (and the CPU's native kernel, :func:`.native.hash_uniforms`); torch's
generators draw different streams on the CPU and on CUDA.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import native
from .base import mix_seed

__all__ = ["M32", "StepSeed", "key_halves", "mix32", "uniforms_into"]

M32 = 0xFFFFFFFF


class StepSeed(NamedTuple):
    """The shards' seeds of one step as scalars: shard ``j``'s is ``mix_seed(seed, prefix,
    j + offset)``, or ``mix_seed(seed, j + offset)`` without a prefix (the exact collective's
    sender ``r`` and owner of shard ``j``: ``(seed, r, 0)`` and ``(seed, None, N + j)``).
    The Triton kernels mix them per element from these, so no per-shard table is built or
    copied per call."""

    seed: int
    prefix: int | None
    offset: int

    def of(self, j: int) -> int:
        """Shard ``j``'s seed."""
        return mix_seed(self.seed, *(() if self.prefix is None else (self.prefix,)),
                        j + self.offset)


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


def uniforms_into(out: torch.Tensor, key: tuple[int, int]) -> torch.Tensor:
    """``out = u_0 … u_{n−1}`` (a contiguous FP32 vector) of a segment with key halves
    ``key`` (module notes): one pass of the CPU's native kernel where it is built, else a
    dozen torch ops."""
    if native.usable(out):
        native.hash_uniforms(out, key)
        return out
    lo, hi = key
    j = torch.arange(out.numel(), dtype=torch.int64, device=out.device)
    h = mix32(mix32((j + lo) & M32) ^ hi)
    return torch.mul((h >> 8).float(), 2.0**-24, out=out)
