"""Where each rank's values go: shards, segments and scale groups of a flat vector.

A layout is pure metadata, derived identically on every rank from the tensors' shapes and
their codecs (one for all, or one per tensor); the stages (:mod:`geofp8.comm.stages`) and
collectives read it and encode or decode a shard only through it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ..codecs import Codec
from ..codecs.base import GroupMap
from .order import FlatOrder
from .plan import FusedPlan
from .shard_codecs import ShardCodecs

__all__ = ["KERNELS", "ShardLayout", "fp32_allreduce_wire_bytes", "tensor_wire_bytes"]

# How a layout runs the codecs over several shards (see ``ShardLayout.kernels``)
KERNELS = ("auto", "batched", "chunked")


@dataclass(frozen=True)
class ShardLayout(ShardCodecs, FlatOrder):
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

    ``codecs`` (one per tensor; empty: ``codec`` for all) gives each tensor its own format.
    Shard ``j``'s payload is then its *runs* (consecutive segments sharing a codec), each
    encoded by its codec, one after the other; a one-codec shard is a single run, encoded
    exactly as without ``codecs``.

    ``kernels`` chooses how the stages (:mod:`geofp8.comm.stages`) run the codecs, with
    bit-identical results: ``"batched"`` makes one codec call over all the shards
    (:meth:`encode_shards` / :meth:`decode_shards` of the shard-major vector: a number of
    kernels that does not grow with ``N``, what an accelerator needs, where every kernel is a
    launch); ``"chunked"`` goes shard by shard (:meth:`encode_into` / :meth:`decode_into`,
    through the codecs' own ``encode_into`` / ``decode_into``, which walk the data in
    cache-sized pieces), reading and writing the shards in place in the flat vector and the
    payloads (what a CPU needs, where launches are cheap and whole-bucket temporaries cost
    memory bandwidth and memory);
    ``"auto"``: chunked on a CPU, batched on any other device.

    The class is the metadata; running the codecs through it (:class:`ShardCodecs`) and the
    two orders of the flat vector (:class:`FlatOrder`) are its two mixins, in modules of
    their own.
    """

    numel: int
    world_size: int
    codec: Codec
    segments: tuple[tuple[tuple[int, int], ...], ...]  # per shard: flat ranges [lo, hi)
    groups: tuple[tuple[tuple[int, ...], ...], ...]  # per shard, per segment: group lengths
    owners: tuple[tuple[int, ...], ...] = ()  # per shard: the tensor index of each segment
    side: tuple[int, ...] = ()  # per shard: bytes of sender metadata after the payload
    codecs: tuple[Codec, ...] = ()  # per tensor (empty: ``codec`` for every tensor)
    kernels: str = "auto"  # batched | chunked | auto (above)

    def __post_init__(self) -> None:
        if self.kernels not in KERNELS:
            raise ValueError(f"unknown kernels {self.kernels!r}; expected one of {KERNELS}")

    @classmethod
    def build(cls, shapes: list[tuple[int, ...]], codec: Codec, world_size: int,
              row_aligned: list[bool] | None = None,
              side_bytes: list[int] | None = None,
              codecs: list[Codec] | None = None, kernels: str = "auto") -> ShardLayout:
        if codecs and len(set(codecs)) == 1:  # one format after all: a one-codec layout
            codec, codecs = codecs[0], None
        segments: list[list[tuple[int, int]]] = [[] for _ in range(world_size)]
        side = [0] * world_size
        owners: list[list[int]] = [[] for _ in range(world_size)]
        groups: list[list[tuple[int, ...]]] = [[] for _ in range(world_size)]
        offset = 0
        for index, shape in enumerate(shapes):
            lengths = (codecs[index] if codecs else codec).groups(tuple(shape))
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
                cut = []
                while pos < hi:
                    if pending == 0:
                        pending = next(it)
                    take = min(pending, hi - pos)
                    cut.append(take)
                    pending -= take
                    pos += take
                if cut:
                    groups[j].append(tuple(cut))
            offset += numel
        return cls(offset, world_size, codec, tuple(tuple(s) for s in segments),
                   tuple(tuple(g) for g in groups), tuple(tuple(o) for o in owners),
                   tuple(side), tuple(codecs or ()), str(kernels))

    @classmethod
    def for_rows(cls, shapes: list[tuple[int, ...]], codec: Codec, world_size: int,
                 side_bytes: int = 0, kernels: str = "auto") -> ShardLayout:
        """The layout of FSDP's reduce-scatter input: a flat ``[N, M]`` buffer whose row
        ``r`` is every tensor's dim-0 chunk ``r`` (``⌈d₀/N⌉`` rows, zero-padded) in order,
        ``M = Σ_p ⌈d₀,p/N⌉·numel_p/d₀,p``. Shard ``r`` is row ``r``: one segment per tensor
        chunk, scale groups of the chunk's own shape (so a right-multiplication, acting on
        columns, applies chunk by chunk). ``side_bytes`` travel with every shard."""
        chunks = []
        for shape in shapes:
            if len(shape) == 0:
                raise ValueError("for_rows: 0-dim tensors have no dim-0 chunks")
            rows = -(-shape[0] // world_size)
            chunks.append((rows, *shape[1:]))
        sizes = [torch.Size(c).numel() for c in chunks]
        width = sum(sizes)
        segments, groups, owners = [], [], []
        for r in range(world_size):
            seg, grp, own, pos = [], [], [], r * width
            for index, (chunk, n) in enumerate(zip(chunks, sizes)):
                if n:
                    seg.append((pos, pos + n))
                    grp.append(tuple(codec.groups(chunk)))
                    own.append(index)
                pos += n
            segments.append(tuple(seg))
            groups.append(tuple(grp))
            owners.append(tuple(own))
        return cls(world_size * width, world_size, codec, tuple(segments), tuple(groups),
                   tuple(owners), (side_bytes,) * world_size, kernels=str(kernels))

    @cached_property
    def plan(self) -> FusedPlan:
        """The fused FP8 kernels' launch plan (its tile maps made on first use, kept)."""
        return FusedPlan(self)

    @cached_property
    def _maps(self) -> dict[tuple, object]:
        """What the stages derive from the layout, made once: group maps per selection of
        shards, the cuts of received records per their sizes."""
        return {}

    def group_map(self, shards: list[int] | tuple[int, ...]) -> GroupMap:
        """The scale groups of ``shards`` laid one after the other, as the codecs' batched
        kernels take them (:class:`~geofp8.codecs.base.GroupMap`): made once per selection of
        shards (a stage asks for the same few every step), kept as long as the layout."""
        key = tuple(shards)
        found = self._maps.get(key)
        if found is None:
            found = self._maps[key] = GroupMap(self.groups[j] for j in key)
        return found

    def padding(self, j: int, device: torch.device) -> torch.Tensor:
        """The zero bytes after shard ``j``'s payload in a record of :attr:`max_shard_bytes`
        (uint8 on ``device``, made once and never written: a ``cat`` reads them, no fill
        kernel per call)."""
        key = ("padding", j, torch.device(device))
        if key not in self._maps:
            self._maps[key] = torch.zeros(self.max_shard_bytes - self.shard_bytes(j),
                                          dtype=torch.uint8, device=device)
        return self._maps[key]

    def shard_numel(self, j: int) -> int:
        return self._shard_numels[j]

    @cached_property
    def _shard_numels(self) -> tuple[int, ...]:
        return tuple(sum(hi - lo for lo, hi in spans) for spans in self.segments)

    @cached_property
    def runs(self) -> tuple[tuple[tuple[Codec, int, int, int, int, tuple], ...], ...]:
        """Per shard: ``(codec, first value, end value, first byte, end byte, segments)`` of
        each run of consecutive segments sharing a codec (module notes)."""
        out = []
        for j in range(self.world_size):
            if not self.codecs:
                out.append(((self.codec, 0, self.shard_numel(j), 0,
                             self.codec.payload_bytes(self.groups[j]), self.groups[j]),))
                continue
            runs, value, byte = [], 0, 0
            for index, segment in zip(self.owners[j], self.groups[j]):
                codec = self.codecs[index]
                if not runs or runs[-1][0] != codec:
                    runs.append([codec, []])
                runs[-1][1].append(segment)
            shard = []
            for codec, segments in runs:
                n, nbytes = sum(map(sum, segments)), codec.payload_bytes(segments)
                shard.append((codec, value, value + n, byte, byte + nbytes, tuple(segments)))
                value, byte = value + n, byte + nbytes
            out.append(tuple(shard))
        return tuple(out)

    def shard_bytes(self, j: int) -> int:
        """Bytes of shard ``j``'s payload (codes and scales of every run, see the codecs)."""
        return self.runs[j][-1][4] if self.runs[j] else 0

    def batched(self, device: torch.device) -> bool:
        """Whether the stages make whole-bucket codec calls on ``device`` (:meth:`encode_shards`,
        :meth:`decode_shards`) or go shard by shard (:meth:`encode_into`, :meth:`decode_into`):
        see :attr:`kernels`."""
        return self.kernels == "batched" or (self.kernels == "auto" and device.type != "cpu")

    def send_bytes(self, j: int) -> int:
        """Bytes every sender hands over for shard ``j``: payload plus side metadata."""
        return self.shard_bytes(j) + self.side[j]

    @cached_property
    def send_sizes(self) -> tuple[int, ...]:
        """Every shard's :meth:`send_bytes`, in shard order (made once: a stage that reads
        a whole send buffer walks no shards)."""
        return tuple(self.send_bytes(j) for j in range(self.world_size))

    def group_spans(self, j: int) -> list[tuple[int, int]]:
        """Flat ranges of shard ``j``'s scale groups (a group never spans two segments)."""
        spans, groups = [], iter([n for seg in self.groups[j] for n in seg])
        for lo, hi in self.segments[j]:
            pos = lo
            while pos < hi:
                n = next(groups)
                spans.append((pos, pos + n))
                pos += n
        return spans

    @cached_property
    def max_shard_bytes(self) -> int:
        return max(self.shard_bytes(j) for j in range(self.world_size))

    def wire_bytes(self, rank: int) -> int:
        """Bytes this rank sends to other ranks: the all-to-all shards meant for others plus
        ``N − 1`` copies of its padded reduced shard (ring or direct all-gather alike)."""
        a2a = sum(self.send_bytes(j) for j in range(self.world_size) if j != rank)
        return a2a + (self.world_size - 1) * self.max_shard_bytes

    def scatter_bytes(self, rank: int) -> int:
        """Bytes this rank sends in a reduce-scatter (the all-to-all stage only)."""
        return sum(self.send_bytes(j) for j in range(self.world_size) if j != rank)

    @cached_property
    def parts(self) -> tuple[tuple[int, ...], ...]:
        """Per shard: the bytes of its payload's parts (:meth:`Codec.part_bytes` of each run)."""
        return tuple(tuple(b for codec, *_, segments in runs for b in codec.part_bytes(segments))
                     for runs in self.runs)


def fp32_allreduce_wire_bytes(numel: int, world_size: int, bytes_per_element: int = 4) -> int:
    """Bytes one rank sends in a ring all-reduce: ``2(N−1)/N · n · bytes``."""
    return (2 * (world_size - 1) * numel * bytes_per_element) // max(world_size, 1)


def tensor_wire_bytes(shape: tuple[int, ...], codec: Codec, world_size: int) -> float:
    """Bytes one rank sends for a tensor of ``shape`` alone in the exact collective, averaged
    over the ranks (:meth:`ShardLayout.wire_bytes`). In a bucket with other tensors a shard's
    bytes add up over its tensors and the all-gather's padding is at most this sum."""
    layout = ShardLayout.build([tuple(shape)], codec, world_size)
    return sum(layout.wire_bytes(r) for r in range(world_size)) / world_size
