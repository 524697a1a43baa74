"""Exact FP8 all-reduce over ``torch.distributed``: no FP8 arithmetic on the wire.

The *exact* all-reduce of a flat FP32 vector ``x_r`` on each of ``N`` ranks:

1. cut ``x_r`` into ``N`` shards; quantize each with this rank's own scales;
2. all-to-all: rank ``j`` receives shard ``j`` from every sender, scales included;
3. rank ``j`` dequantizes the ``N`` payloads and sums them in FP32;
4. it re-quantizes its reduced shard and all-gathers it;
5. every rank dequantizes the ``N`` reduced shards: ``Σ_r x_r`` up to two FP8 roundings.

Per rank and element that is ``2(N−1)/N`` code bytes plus scales — the traffic of a
ring all-reduce of FP8. If any payload in any shard carries a NaN scale (non-finite
input, see :mod:`geofp8.formats`), *every* element of the result is NaN on every
rank, so a ``GradScaler`` or the caller can skip the step.

The same encode / decode-and-sum / re-encode functions drive
:func:`simulate_exact_allreduce`, a single-process model of ``N`` ranks used by the
analysis tools; the real path is :class:`Communicator`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .formats import Codec, Packed

__all__ = [
    "COLLECTIVES",
    "Communicator",
    "ShardLayout",
    "decode",
    "encode",
    "exact_allreduce",
    "fp32_allreduce_wire_bytes",
    "simulate_exact_allreduce",
    "wire_bytes",
]


@dataclass(frozen=True)
class ShardLayout:
    """Shards and scale groups of a flat vector made of tensors of the given ``shapes``.

    Every tensor is cut into ``N`` contiguous chunks of ``⌈numel/N⌉`` elements; shard ``j``
    is the concatenation of every tensor's chunk ``j`` (``segments[j]``, ranges of the flat
    vector). Scale groups follow the codec per tensor (per-tensor, per-row or per-block)
    and are cut at chunk boundaries. So a tensor is quantized the same way whichever other
    tensors share its bucket: DDP's bucket rebuild changes nothing numerically.

    ``row_aligned`` tensors are chunked at whole rows (``⌈rows/N⌉`` rows per chunk), so a
    receiver can apply a right-multiplication to its chunk. ``side_bytes[i]`` bytes of sender
    metadata about tensor ``i`` (e.g. each sender's own factor) travel with every shard that
    holds a chunk of it, after the payload (``side[j]``: their total for shard ``j``).
    """

    numel: int
    world_size: int
    codec: Codec
    segments: tuple[tuple[tuple[int, int], ...], ...]  # per shard: flat ranges [lo, hi)
    groups: tuple[tuple[int, ...], ...]  # per shard, scale-group lengths in shard order
    owners: tuple[tuple[int, ...], ...] = ()  # per shard: the tensor index of each segment
    side: tuple[int, ...] = ()  # per shard: bytes of sender metadata after the payload

    @classmethod
    def build(cls, shapes: list[tuple[int, ...]], codec: Codec, world_size: int,
              row_aligned: list[bool] | None = None,
              side_bytes: list[int] | None = None) -> ShardLayout:
        segments: list[list[tuple[int, int]]] = [[] for _ in range(world_size)]
        side = [0] * world_size
        owners: list[list[int]] = [[] for _ in range(world_size)]
        groups: list[list[int]] = [[] for _ in range(world_size)]
        offset = 0
        for index, shape in enumerate(shapes):
            lengths = codec.lengths(tuple(shape))
            numel = sum(lengths)
            chunk = -(-numel // world_size) if numel else 0
            if row_aligned and row_aligned[index] and numel:
                cols = numel // shape[0]
                chunk = -(-shape[0] // world_size) * cols
            it, pending, pos = iter(lengths), 0, 0
            for j in range(world_size):
                hi = min((j + 1) * chunk, numel)
                if hi > pos:
                    segments[j].append((offset + pos, offset + hi))
                    owners[j].append(index)
                    side[j] += side_bytes[index] if side_bytes else 0
                while pos < hi:
                    if pending == 0:
                        pending = next(it)
                    take = min(pending, hi - pos)
                    groups[j].append(take)
                    pending -= take
                    pos += take
            offset += numel
        return cls(offset, world_size, codec, tuple(tuple(s) for s in segments),
                   tuple(tuple(g) for g in groups), tuple(tuple(o) for o in owners),
                   tuple(side))

    def shard_numel(self, j: int) -> int:
        return sum(hi - lo for lo, hi in self.segments[j])

    def shard_bytes(self, j: int) -> int:
        """Bytes of shard ``j``'s FP8 payload (scales and codes)."""
        return self.shard_numel(j) + 4 * len(self.groups[j])

    def send_bytes(self, j: int) -> int:
        """Bytes every sender hands over for shard ``j``: payload plus side metadata."""
        return self.shard_bytes(j) + self.side[j]

    def group_spans(self, j: int) -> list[tuple[int, int]]:
        """Flat ranges of shard ``j``'s scale groups (a group never spans two segments)."""
        spans, groups = [], iter(self.groups[j])
        for lo, hi in self.segments[j]:
            pos = lo
            while pos < hi:
                n = next(groups)
                spans.append((pos, pos + n))
                pos += n
        return spans

    @property
    def max_shard_bytes(self) -> int:
        return max(self.shard_bytes(j) for j in range(self.world_size))

    def wire_bytes(self, rank: int) -> int:
        """Bytes this rank sends to other ranks: the all-to-all shards meant for others plus
        ``N − 1`` copies of its padded reduced shard (ring or direct all-gather alike)."""
        a2a = sum(self.send_bytes(j) for j in range(self.world_size) if j != rank)
        return a2a + (self.world_size - 1) * self.max_shard_bytes

    def gather(self, flat: torch.Tensor, j: int) -> torch.Tensor:
        """Shard ``j`` of ``flat`` as one contiguous tensor."""
        parts = [flat[lo:hi] for lo, hi in self.segments[j]]
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts) if parts else flat.new_zeros(0)

    def scatter(self, out: torch.Tensor, shard: torch.Tensor, j: int) -> None:
        """Write shard ``j``'s values back to their places in ``out``."""
        pos = 0
        for lo, hi in self.segments[j]:
            out[lo:hi] = shard[pos : pos + hi - lo]
            pos += hi - lo


def fp32_allreduce_wire_bytes(numel: int, world_size: int, bytes_per_element: int = 4) -> int:
    """Bytes one rank sends in a ring all-reduce: ``2(N−1)/N · n · bytes``."""
    return (2 * (world_size - 1) * numel * bytes_per_element) // max(world_size, 1)


# -- the three pure stages, shared by the real and the simulated collective ----------------

def _pack_into(buf: torch.Tensor, x: torch.Tensor, codec: Codec, groups) -> None:
    """Quantize ``x`` straight into ``buf`` in the :class:`Packed` byte layout
    (``[scales][codes]``), with no intermediate copy of the payload."""
    n_groups = len(groups)
    packed = codec.quantize(x, list(groups), out=buf[4 * n_groups : 4 * n_groups + x.numel()])
    buf[: 4 * n_groups].copy_(packed.scales.view(torch.uint8))


def encode(flat: torch.Tensor, layout: ShardLayout,
           side: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Stage 1: every shard quantized with its own scales (then its ``side`` bytes, if any),
    one after the other in one uint8 buffer."""
    out = torch.empty(sum(layout.send_bytes(j) for j in range(layout.world_size)),
                      dtype=torch.uint8, device=flat.device)
    offset = 0
    for j in range(layout.world_size):
        payload = layout.shard_bytes(j)
        _pack_into(out[offset : offset + payload], layout.gather(flat, j), layout.codec,
                   layout.groups[j])
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
        packed = Packed.from_bytes(buf, (numel,), layout.codec, list(layout.groups[shard]))
        packed.dequantize(out=values)
        total += values if unmap is None else unmap(values, buf[payload:nbytes])
    return total


def encode_reduced(shard_sum: torch.Tensor, layout: ShardLayout, shard: int) -> torch.Tensor:
    """Stage 4: the reduced shard re-quantized, zero-padded to ``max_shard_bytes``."""
    out = torch.zeros(layout.max_shard_bytes, dtype=torch.uint8, device=shard_sum.device)
    _pack_into(out[: layout.shard_bytes(shard)], shard_sum, layout.codec, layout.groups[shard])
    return out


def decode_gathered(gathered: list[torch.Tensor], layout: ShardLayout) -> torch.Tensor:
    """Stage 5: the full reduced vector; all NaN if any shard carries a non-finite scale."""
    out = torch.empty(layout.numel, dtype=torch.float32, device=gathered[0].device)
    poisoned = False
    for j, buf in enumerate(gathered):
        packed = Packed.from_bytes(buf, (layout.shard_numel(j),), layout.codec,
                                   list(layout.groups[j]))
        poisoned |= bool((~torch.isfinite(packed.scales)).any())
        layout.scatter(out, packed.dequantize(), j)
    if poisoned:
        out.fill_(float("nan"))
    return out


# -- the real collectives -------------------------------------------------------------------

COLLECTIVES = ("exact", "allgather")


def wire_bytes(layout: ShardLayout, rank: int, collective: str) -> int:
    """Bytes this rank sends for one bucket: see :meth:`ShardLayout.wire_bytes` for
    ``exact``; ``allgather`` sends its whole payload to each of the ``N − 1`` others."""
    if collective == "exact":
        return layout.wire_bytes(rank)
    total = sum(layout.send_bytes(j) for j in range(layout.world_size))
    return (layout.world_size - 1) * total


def decode(sent: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """What ``encode(flat, layout)`` decodes to (the sender's own view, for error feedback)."""
    out = torch.empty(layout.numel, dtype=torch.float32, device=sent.device)
    offset = 0
    for j in range(layout.world_size):
        packed = Packed.from_bytes(sent[offset : offset + layout.shard_bytes(j)],
                                   (layout.shard_numel(j),), layout.codec,
                                   list(layout.groups[j]))
        layout.scatter(out, packed.dequantize(), j)
        offset += layout.send_bytes(j)
    return out


class Communicator:
    """Launches all-reduces of :func:`encode` d payloads; several may be in flight at once.

    ``exact``: all-to-all of shards, FP32 sum, re-quantize, all-gather (two roundings,
    ``2(N−1)/N`` payloads per rank). ``allgather``: every rank gathers every payload and
    sums in FP32 itself (one rounding, ``N − 1`` payloads per rank).

    Ordering: every rank must issue collectives in the same order, but completion callbacks
    fire in different orders on different ranks. So the all-gather of launch ``i`` is issued
    from the caller's thread at launch ``i + 1`` (after waiting for all-to-all ``i``, which
    has been overlapping the caller's work since); the launch marked ``last`` waits for its
    own all-to-all and issues its all-gather before it returns. No collective is ever issued
    from a callback: DDP itself issues one right after the last bucket's hook when
    ``find_unused_parameters=True`` (the used-parameter map), and a callback's all-gather
    raced it into a different order on different ranks (a deadlock).
    """

    def __init__(self, collective: str = "exact", group: dist.ProcessGroup | None = None):
        if collective not in COLLECTIVES:
            raise ValueError(f"unknown collective {collective!r}; expected one of {COLLECTIVES}")
        self.collective, self.group = collective, group
        self.rank = dist.get_rank(group)
        self._previous = None  # (work, recv, layout, result, unmap): all-gather not issued

    def launch(self, sent: torch.Tensor, layout: ShardLayout, last: bool = True,
               unmap=None) -> torch.futures.Future:
        """Start the all-reduce; the future's value is ``Σ_r`` of the ranks' decoded payloads
        (each mapped back by ``unmap(values, side)`` first, see :func:`decode_sum`)."""
        self.flush()
        if self.collective == "allgather":
            if unmap is not None:
                raise ValueError("per-sender decoding needs collective='exact'")
            return self._allgather(sent, layout)
        result: torch.futures.Future = torch.futures.Future()
        n = layout.world_size
        recv = torch.empty(n * layout.send_bytes(self.rank), dtype=torch.uint8,
                           device=sent.device)
        work = dist.all_to_all_single(
            recv, sent,
            output_split_sizes=[layout.send_bytes(self.rank)] * n,
            input_split_sizes=[layout.send_bytes(j) for j in range(n)],
            group=self.group, async_op=True)
        self._previous = (work, recv, layout, result, unmap)
        if last:
            self.flush()  # issue the all-gather now, from this thread (see the class notes)
        return result

    def flush(self) -> None:
        """Issue the pending all-gather of the previous launch (waits for its all-to-all)."""
        if self._previous is not None:
            work, recv, layout, result, unmap = self._previous
            self._previous = None
            work.wait()
            self._gather(work.get_future(), recv, layout, result, unmap)

    def _gather(self, fut, recv: torch.Tensor, layout: ShardLayout,
                result: torch.futures.Future, unmap=None) -> None:
        try:
            fut.value()
            reduced = decode_sum(recv, layout, self.rank, unmap)
            shard = encode_reduced(reduced, layout, self.rank)
        except Exception as exc:  # noqa: BLE001 - hand every failure to the caller
            result.set_exception(exc)
            return
        gathered = [torch.empty_like(shard) for _ in range(layout.world_size)]

        def done(fut: torch.futures.Future) -> None:
            try:
                fut.value()
                result.set_result(decode_gathered(gathered, layout))
            except Exception as exc:  # noqa: BLE001
                result.set_exception(exc)

        dist.all_gather(gathered, shard, group=self.group, async_op=True).get_future().then(done)

    def _allgather(self, sent: torch.Tensor, layout: ShardLayout) -> torch.futures.Future:
        gathered = [torch.empty_like(sent) for _ in range(layout.world_size)]

        def decode_all(_fut: torch.futures.Future) -> torch.Tensor:
            total = torch.zeros(layout.numel, dtype=torch.float32, device=sent.device)
            for buf in gathered:
                total += decode(buf, layout)
            # a NaN scale decodes to NaN in its group; widen it to the bucket, as `exact` does
            return total if bool(torch.isfinite(total).all()) else total.fill_(float("nan"))

        work = dist.all_gather(gathered, sent, group=self.group, async_op=True)
        return work.get_future().then(decode_all)


def exact_allreduce(flat: torch.Tensor, layout: ShardLayout,
                    group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Blocking exact FP8 all-reduce of ``flat`` (FP32, ``layout.numel`` elements, the same
    ``layout`` on every rank): ``Σ_r flat_r`` in FP32. Collective over ``group``."""
    return Communicator("exact", group).launch(encode(flat, layout), layout).wait()


# -- the single-process model ---------------------------------------------------------------

def simulate_exact_allreduce(inputs: list[torch.Tensor], layout: ShardLayout) -> torch.Tensor:
    """What :func:`exact_allreduce` returns when rank ``r`` holds ``inputs[r]`` (one process)."""
    n = layout.world_size
    if len(inputs) != n:
        raise ValueError(f"layout is for {n} ranks but {len(inputs)} inputs were given")
    sent = [encode(x.reshape(-1).float(), layout) for x in inputs]
    offsets = [0]
    for j in range(n):
        offsets.append(offsets[-1] + layout.send_bytes(j))
    gathered = []
    for j in range(n):
        received = torch.cat([s[offsets[j] : offsets[j + 1]] for s in sent])
        gathered.append(encode_reduced(decode_sum(received, layout, j), layout, j))
    return decode_gathered(gathered, layout)
