"""The pure stages of the exact collective, shared by the real one and the simulation.

For a flat FP32 vector ``x_r`` on each of ``N`` ranks and a :class:`ShardLayout`:

1. :func:`encode`: cut ``x_r`` into ``N`` shards, encode each with this rank's own scales;
2. (all-to-all: rank ``j`` receives shard ``j`` from every sender, scales included);
3. :func:`decode_sum`: rank ``j`` decodes the ``N`` payloads and sums them in FP32 — a
   reduce-scatter stops here;
4. :func:`encode_reduced`: it re-encodes its reduced shard (all-gathered next);
5. :func:`decode_gathered`: every rank decodes the ``N`` reduced shards: ``Σ_r x_r`` up to
   two roundings. If any shard carries a non-finite scale, *every* element is NaN.

No arithmetic happens on encoded values: every sum is in FP32 after decoding.

``seed`` (stochastic rounding): the same on every rank for a given step and bucket. Sender
``r`` encodes shard ``j`` with ``mix_seed(seed, r, j)`` in stage 1, so the ``N`` roundings
that enter a sum are independent (a stream shared by all senders would round every
sender's copy of an element with the same uniform, and their errors would add up instead of
averaging out); the owner re-encodes with ``mix_seed(seed, N + j)`` in stage 4. The
simulation derives the same streams, so it reproduces the real collective bit for bit.
"""

from __future__ import annotations

import torch

from ..codecs.base import mix_seed
from .layout import ShardLayout

__all__ = ["decode", "decode_gathered", "decode_sum", "encode", "encode_reduced",
           "poison_unless", "simulate_exact_allreduce"]


def _shard_seed(seed: int | None, *index: int) -> int | None:
    return None if seed is None else mix_seed(seed, *index)


def encode(flat: torch.Tensor, layout: ShardLayout,
           side: list[torch.Tensor] | None = None, seed: int | None = None,
           sender: int = 0) -> torch.Tensor:
    """Stage 1: every shard quantized with its own scales (then its ``side`` bytes, if any),
    one after the other in one uint8 buffer; ``sender``: this rank (its rounding stream)."""
    out = torch.empty(sum(layout.send_bytes(j) for j in range(layout.world_size)),
                      dtype=torch.uint8, device=flat.device)
    offset = 0
    for j in range(layout.world_size):
        payload = layout.shard_bytes(j)
        layout.encode_shard(out[offset : offset + payload], layout.gather(flat, j), j,
                            seed=_shard_seed(seed, sender, j))
        if layout.side[j]:
            out[offset + payload : offset + layout.send_bytes(j)] = side[j]
        offset += layout.send_bytes(j)
    return out


def decode_sum(received: torch.Tensor, layout: ShardLayout, shard: int,
               unmap=None) -> torch.Tensor:
    """Stage 3: dequantize the ``N`` senders' copies of ``shard`` and sum them in FP32.

    ``unmap(values, side)``, when given, maps one sender's decoded shard back with that
    sender's side metadata (per-sender decoding) before it enters the sum.
    """
    nbytes, numel = layout.send_bytes(shard), layout.shard_numel(shard)
    payload = layout.shard_bytes(shard)
    total = torch.zeros(numel, dtype=torch.float32, device=received.device)
    values = torch.empty_like(total)
    for r in range(layout.world_size):
        buf = received[r * nbytes : (r + 1) * nbytes]
        layout.decode_shard(values, buf[:payload], shard)
        total += values if unmap is None else unmap(values, buf[payload:nbytes])
    return total


def encode_reduced(shard_sum: torch.Tensor, layout: ShardLayout, shard: int,
                   seed: int | None = None) -> torch.Tensor:
    """Stage 4: the reduced shard re-quantized, zero-padded to ``max_shard_bytes``."""
    out = torch.zeros(layout.max_shard_bytes, dtype=torch.uint8, device=shard_sum.device)
    layout.encode_shard(out[: layout.shard_bytes(shard)], shard_sum, shard,
                        seed=_shard_seed(seed, layout.world_size + shard))
    return out


def decode_shard(buf: torch.Tensor, layout: ShardLayout, shard: int) -> torch.Tensor:
    """The values of one encoded shard (its owner's view of what it re-encoded)."""
    values = torch.empty(layout.shard_numel(shard), dtype=torch.float32, device=buf.device)
    layout.decode_shard(values, buf[: layout.shard_bytes(shard)], shard)
    return values


def decode_gathered(gathered: list[torch.Tensor], layout: ShardLayout) -> torch.Tensor:
    """Stage 5: the full reduced vector; all NaN if any shard carries a non-finite scale."""
    out = torch.empty(layout.numel, dtype=torch.float32, device=gathered[0].device)
    finite = torch.ones((), dtype=torch.bool, device=out.device)
    for j, buf in enumerate(gathered):
        values = torch.empty(layout.shard_numel(j), dtype=torch.float32, device=buf.device)
        finite &= layout.decode_shard(values, buf[: layout.shard_bytes(j)], j)
        layout.scatter(out, values, j)
    return poison_unless(out, finite)


def poison_unless(values: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """``values`` in place, all NaN unless the 0-dim bool ``finite`` (on the device: no host
    sync)."""
    return values.masked_fill_(~finite, float("nan"))


def decode(sent: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """What ``encode(flat, layout)`` decodes to (the sender's own view, for error feedback)."""
    out = torch.empty(layout.numel, dtype=torch.float32, device=sent.device)
    offset = 0
    for j in range(layout.world_size):
        values = torch.empty(layout.shard_numel(j), dtype=torch.float32, device=sent.device)
        layout.decode_shard(values, sent[offset : offset + layout.shard_bytes(j)], j)
        layout.scatter(out, values, j)
        offset += layout.send_bytes(j)
    return out


def simulate_exact_allreduce(inputs: list[torch.Tensor], layout: ShardLayout,
                             seed: int | None = None) -> torch.Tensor:
    """What :func:`exact_allreduce` returns when rank ``r`` holds ``inputs[r]`` (one process)."""
    n = layout.world_size
    if len(inputs) != n:
        raise ValueError(f"layout is for {n} ranks but {len(inputs)} inputs were given")
    sent = [encode(x.reshape(-1).float(), layout, seed=seed, sender=r)
            for r, x in enumerate(inputs)]
    offsets = [0]
    for j in range(n):
        offsets.append(offsets[-1] + layout.send_bytes(j))
    gathered = []
    for j in range(n):
        received = torch.cat([s[offsets[j] : offsets[j + 1]] for s in sent])
        gathered.append(encode_reduced(decode_sum(received, layout, j), layout, j, seed))
    return decode_gathered(gathered, layout)
