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
from ..codecs.base import GroupMap, interleave, mix_seed

__all__ = ["KERNELS", "ShardLayout", "fp32_allreduce_wire_bytes", "tensor_wire_bytes"]

# How a layout runs the codecs over several shards (see ``ShardLayout.kernels``)
KERNELS = ("auto", "batched", "chunked")


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

    def shard_numel(self, j: int) -> int:
        return sum(hi - lo for lo, hi in self.segments[j])

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

    @cached_property
    def _run_maps(self) -> tuple[tuple[GroupMap, ...], ...]:
        """Per shard, per run: the run's segments as a one-shard :class:`GroupMap`."""
        return tuple(tuple(GroupMap((run[5],)) for run in runs) for runs in self.runs)

    def _runs_of(self, shards: list[int]):
        """``(i, r, codec, first value, end value, groups)`` of run ``r`` of every shard
        ``shards[i]`` (``groups``: the run as a one-shard map), values counted from the first
        shard's."""
        pos = 0
        for i, j in enumerate(shards):
            for r, (codec, lo, hi, *_) in enumerate(self.runs[j]):
                yield i, r, codec, pos + lo, pos + hi, self._run_maps[j][r]
            pos += self.shard_numel(j)

    def encode_shards(self, values: torch.Tensor, shards: list[int],
                      seeds: list[int | None]) -> list[torch.Tensor]:
        """Encode the FP32 ``values`` of ``shards`` laid one after the other, shard ``shards[i]``
        with ``seeds[i]``; returns every shard's payload parts in order (:attr:`parts`). A
        one-codec layout is one codec call for all of them (no growth with ``N``); a layout of
        several codecs one call per run. Run ``r > 0`` of a shard is encoded with
        ``mix_seed(seed, r)`` (independent streams per run)."""
        _check_float(values)
        if not self.codecs:
            return self.codec.encode_shards(values, self.group_map(shards), seeds)
        out = []
        for i, r, codec, lo, hi, groups in self._runs_of(shards):
            out += codec.encode_shards(values[lo:hi], groups, [_run_seed(seeds[i], r)])
        return out

    def decode_shards(self, out: torch.Tensor, parts: list[torch.Tensor],
                      shards: list[int], check: bool = True) -> torch.Tensor | None:
        """Decode the payload ``parts`` of ``shards`` (as :meth:`encode_shards` returns them)
        into the FP32 ``out`` (their values one after the other); returns the 0-dim bool device
        flag, ``False`` if any scale is non-finite, or ``None`` without ``check`` (see
        :meth:`Codec.decode_shards`)."""
        if not self.codecs:
            return self.codec.decode_shards(out, parts, self.group_map(shards), check)
        flags, part = [], 0
        for _, _, codec, lo, hi, groups in self._runs_of(shards):
            k = len(codec.part_bytes(groups[0]))
            flags.append(codec.decode_shards(out[lo:hi], parts[part : part + k], groups,
                                             check))
            part += k
        return _all(flags, out.device) if check else None

    @cached_property
    def _by_segment(self) -> tuple | None:
        """For a segmentwise codec (:meth:`Codec.segmentwise`) when shard-major order is not
        flat order: ``(every segment as a one-segment shard of its groups, in flat order;
        per shard, the flat position of each of its segments; per flat segment, its parts'
        bytes)``. ``None`` otherwise."""
        lengths = [hi - lo for spans in self.segments for lo, hi in spans]
        if self.codecs or self._order is None or not self.codec.segmentwise(lengths):
            return None
        by_pos = self._order[3]
        groups = [g for shard in self.groups for g in shard]  # shard-major order
        flat_shards = GroupMap((groups[i],) for i in by_pos)
        return (flat_shards, self._segment_split[1],
                [self.codec.part_bytes(s) for s in flat_shards])

    @cached_property
    def _flat_run(self) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
        """When :attr:`segmentwise`: every segment's groups in flat order, as the segments of
        one shard, and that shard's parts' bytes (part ``p`` of every segment back to back)."""
        segments = tuple(shard[0] for shard in self._by_segment[0])
        return segments, tuple(self.codec.part_bytes(segments))

    @property
    def segmentwise(self) -> bool:
        """Whether the stages run the codec over the segments in flat order and reorder bytes
        (:meth:`encode_pieces`, :meth:`decode_flat`) rather than FP32 values."""
        return self._by_segment is not None

    @property
    def encodes_error(self) -> bool:
        """Whether :meth:`encode_pieces` leaves the rounding error: a segmentwise codec, whose
        one call over the flat vector leaves its rounding error in flat order (chunked: from
        the encoding pass where :meth:`Codec.fuses_error`; batched: decoded from the payload
        parts before they are put in shard order, no copy of them)."""
        return self.segmentwise

    def encode_pieces(self, flat: torch.Tensor, seeds: list[int | None],
                      with_error: bool = False
                      ) -> tuple[list[list[torch.Tensor]], torch.Tensor | None]:
        """``(per shard, the pieces whose concatenation is its payload; the rounding error)``
        from the flat FP32 vector; shard ``j`` encoded with ``seeds[j]``. For a segmentwise
        codec, one codec call over the flat vector, segment by segment (batched:
        :meth:`Codec.encode_shards`; chunked: the codec's own :meth:`Codec.encode_into` of all
        segments as one shard, whose parts are cut by segment), its parts then put in shard
        order: bytes are reordered, not FP32 values (no shard-major copy). Otherwise (batched
        only) :meth:`encode_shards` of the shard-major vector. ``with_error`` (where
        :attr:`encodes_error`): the error is a new FP32 vector ``flat − decode(payloads)`` in
        flat order (else ``None``): chunked, from the encoding pass where
        :meth:`Codec.fuses_error`; batched, decoded from the parts before they are put in
        shard order (views, no copy), allocated once the codec's temporaries are freed."""
        if with_error and not self.encodes_error:
            raise ValueError("this layout does not leave the rounding error in flat order "
                             "(see encodes_error)")
        n, error = self.world_size, None
        if self._by_segment is None:
            parts = self.encode_shards(self.shard_major(flat), list(range(n)), seeds)
            bounds = [0]
            for j in range(n):
                bounds.append(bounds[-1] + len(self.parts[j]))
            return [parts[bounds[j] : bounds[j + 1]] for j in range(n)], None
        flat_shards, positions, seg_bytes = self._by_segment
        _check_float(flat)
        if self.batched(flat.device):
            parts = self.codec.encode_shards(flat, flat_shards, [None] * len(flat_shards))
            if with_error:
                error = torch.empty_like(flat)
                self.codec.decode_shards(error, parts, flat_shards, check=False)
                torch.sub(flat, error, out=error)
        else:
            segments, part_bytes = self._flat_run
            payload = flat.new_empty(sum(part_bytes), dtype=torch.uint8)
            if with_error:
                error = torch.empty_like(flat)
                self.codec.encode_with_error(payload, error, flat, segments)
            else:
                self.codec.encode_into(payload, flat, segments)
            parts = interleave(*(part.split([b[p] for b in seg_bytes])
                                 for p, part in enumerate(payload.split(part_bytes))))
        k = len(parts) // len(flat_shards)  # parts per segment
        return [[parts[f * k + p] for p in range(k) for f in positions[j]]
                for j in range(n)], error

    def _record_cuts(self, records: tuple[int, ...]) -> tuple[list[int], list[int]]:
        """``(the byte sizes that cut records of these sizes into every segment's parts and
        each record's rest, the index in them of every segment's part p at f·k + p)``, made
        once per records' sizes (a stage passes the same ones every step)."""
        found = self._maps.get(("records", records))
        if found is not None:
            return found
        _, positions, seg_bytes = self._by_segment
        k = len(seg_bytes[0]) if seg_bytes else 0
        sizes, where = [], [0] * (len(seg_bytes) * k)
        for j, record in enumerate(records):
            for p in range(k):
                for f in positions[j]:
                    where[f * k + p] = len(sizes)
                    sizes.append(seg_bytes[f][p])
            sizes.append(record - sum(self.parts[j]))  # the record's rest (side bytes, padding)
        self._maps[("records", records)] = sizes, where
        return sizes, where

    def decode_flat(self, out: torch.Tensor, buf: torch.Tensor, records: list[int],
                    check: bool = True, poison: bool = False) -> torch.Tensor | None:
        """When :attr:`segmentwise`: the flat FP32 vector into ``out`` from every shard's
        record of ``records[j]`` bytes (its payload first) back to back in ``buf``, in one
        codec call over the segments in flat order (the records' parts are cut by segment and,
        for the chunked kernels, joined into one payload: bytes are reordered, no FP32
        values). Returns the finite flag (:meth:`decode_shards`); ``poison``: the vector is
        all NaN unless it is set, through the scales (:meth:`Codec.decode_into`), and
        ``None`` is returned."""
        flat_shards, _, seg_bytes = self._by_segment
        k = len(seg_bytes[0]) if seg_bytes else 0
        sizes, where = self._record_cuts(tuple(records))
        pieces = buf[: sum(records)].split(sizes)
        if self.batched(buf.device):
            return self.codec.decode_shards(out, [pieces[i] for i in where], flat_shards, check,
                                            poison)
        payload = torch.cat([pieces[where[f * k + p]] for p in range(k)
                             for f in range(len(flat_shards))])
        finite = self.codec.decode_into(out, payload, self._flat_run[0], poison)
        return finite if check else None

    def encode_into(self, out: torch.Tensor, values: torch.Tensor, shard: int,
                    seed: int | None, overwrite: bool = False) -> None:
        """Shard ``shard``'s payload from its FP32 ``values`` straight into the uint8 ``out``
        (its first :meth:`shard_bytes` bytes), run by run through :meth:`Codec.encode_into`:
        the same bytes as :meth:`encode_shards`. ``overwrite``: ``values`` is a temporary
        the codecs may work in (see :meth:`Codec.encode_into`)."""
        _check_float(values)
        for r, (codec, lo, hi, first, end, segments) in enumerate(self.runs[shard]):
            codec.encode_into(out[first:end], values[lo:hi], segments, _run_seed(seed, r),
                              overwrite)

    def encode_gathered(self, out: torch.Tensor, flat: torch.Tensor, shard: int,
                        seed: int | None) -> None:
        """Shard ``shard`` of the flat FP32 vector encoded into ``out`` (:meth:`encode_into`):
        a shard of several segments is gathered into a temporary, which the codecs then work
        in (``overwrite``); one segment is read in place, as a view of ``flat``."""
        self.encode_into(out, self.gather(flat, shard), shard, seed,
                         overwrite=len(self.segments[shard]) > 1)

    def decode_into(self, out: torch.Tensor, payload: torch.Tensor,
                    shard: int) -> torch.Tensor:
        """Shard ``shard``'s values into the FP32 ``out`` from its payload (the first
        :meth:`shard_bytes` bytes of ``payload``), run by run; the 0-dim finite flag."""
        return _all([codec.decode_into(out[lo:hi], payload[first:end], segments)
                     for codec, lo, hi, first, end, segments in self.runs[shard]], out.device)

    def decode_scattered(self, out: torch.Tensor, payload: torch.Tensor, shard: int,
                         minus: torch.Tensor | None = None) -> torch.Tensor:
        """Shard ``shard``'s values decoded into their places in the flat FP32 ``out`` (or, with
        ``minus``, ``minus − values`` there): no shard-major copy of the whole vector, at most
        one shard's temporary. Returns the 0-dim finite flag (:meth:`decode_into`)."""
        spans = self.segments[shard]
        if len(spans) == 1:  # one segment: decode in place
            lo, hi = spans[0]
            values = out[lo:hi]
        else:
            values = out.new_empty(self.shard_numel(shard))
        finite = self.decode_into(values, payload, shard)
        if not spans or (len(spans) == 1 and minus is None):
            return finite
        places = self.segment_views(out, shard)
        pieces = values.split([hi - lo for lo, hi in spans])
        if minus is None:  # every segment to its place in one op
            torch._foreach_copy_(places, list(pieces))
        else:
            for place, piece, before in zip(places, pieces, self.segment_views(minus, shard)):
                torch.sub(before, piece, out=place)
        return finite

    def send_bytes(self, j: int) -> int:
        """Bytes every sender hands over for shard ``j``: payload plus side metadata."""
        return self.shard_bytes(j) + self.side[j]

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

    @property
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

    def gather(self, flat: torch.Tensor, j: int) -> torch.Tensor:
        """Shard ``j`` of ``flat`` as one contiguous tensor: a view of ``flat`` when the
        shard is one segment of it, else a new tensor."""
        parts = self.segment_views(flat, j)
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts) if parts else flat.new_zeros(0)

    @cached_property
    def _segment_split(self) -> tuple[list[int], tuple[tuple[int, ...], ...]]:
        """``(the lengths of all segments in flat order, per shard the flat position of each
        of its segments)``."""
        if self._order is None:
            sizes, flat_of = [hi - lo for segs in self.segments for lo, hi in segs], None
        else:
            sizes, _, flat_of, _ = self._order
        positions, m = [], 0
        for segments in self.segments:
            positions.append(tuple(flat_of[m : m + len(segments)]) if flat_of
                             else tuple(range(m, m + len(segments))))
            m += len(segments)
        return sizes, tuple(positions)

    def segment_views(self, flat: torch.Tensor, j: int) -> list[torch.Tensor]:
        """Views of shard ``j``'s segments of the flat vector ``flat``, in shard order: one
        split for all of them (a slice per segment costs an op each on the host)."""
        if len(self.segments[j]) == 1:
            lo, hi = self.segments[j][0]
            return [flat[lo:hi]]
        sizes, positions = self._segment_split
        pieces = flat[: self.numel].split(sizes)
        return [pieces[f] for f in positions[j]]

    @cached_property
    def _order(self) -> tuple[list[int], list[int], list[int], list[int]] | None:
        """The segments of all shards partition the flat vector: ``(their lengths in flat
        order, in shard-major order, the flat position of each shard-major one, the
        shard-major position of each flat one)``; ``None`` when both orders agree."""
        spans = [span for segs in self.segments for span in segs]
        by_pos = sorted(range(len(spans)), key=lambda i: spans[i][0])
        if by_pos == list(range(len(spans))):
            return None
        flat_of = [0] * len(spans)
        for f, i in enumerate(by_pos):
            flat_of[i] = f
        return ([spans[i][1] - spans[i][0] for i in by_pos], [hi - lo for lo, hi in spans],
                flat_of, by_pos)

    @property
    def shard_major_is_flat(self) -> bool:
        """Whether shard-major order is flat order (every shard one run of the vector)."""
        return self._order is None

    def shard_major(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` reordered shard after shard (shard ``j``'s segments in order): one split
        and one copy whatever the number of shards and segments (``flat`` itself when it is
        in that order already)."""
        if self._order is None:
            return flat
        sizes, _, flat_of, _ = self._order
        pieces = flat.split(sizes)
        return torch.cat([pieces[f] for f in flat_of])

    def from_shard_major(self, values: torch.Tensor,
                         out: torch.Tensor | None = None) -> torch.Tensor:
        """The inverse of :meth:`shard_major`, written into ``out`` when given (else ``values``
        itself when the orders agree)."""
        if self._order is None:
            return values if out is None else out.copy_(values)
        _, sizes, _, by_pos = self._order
        pieces = values.split(sizes)
        return torch.cat([pieces[i] for i in by_pos], out=out)

    @cached_property
    def parts(self) -> tuple[tuple[int, ...], ...]:
        """Per shard: the bytes of its payload's parts (:meth:`Codec.part_bytes` of each run)."""
        return tuple(tuple(b for codec, *_, segments in runs for b in codec.part_bytes(segments))
                     for runs in self.runs)


def _run_seed(seed: int | None, run: int) -> int | None:
    """The rounding stream of run ``run`` of a shard encoded with ``seed``."""
    return seed if seed is None or run == 0 else mix_seed(seed, run)


def _check_float(values: torch.Tensor) -> None:
    if not values.is_floating_point():
        raise TypeError(f"GeoFP8 codecs take floating-point tensors, got {values.dtype}")


def _all(flags: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The 0-dim bool AND of ``flags`` (``True`` for none), on the device."""
    if not flags:
        return torch.ones((), dtype=torch.bool, device=device)
    return flags[0] if len(flags) == 1 else torch.stack(flags).all()


def fp32_allreduce_wire_bytes(numel: int, world_size: int, bytes_per_element: int = 4) -> int:
    """Bytes one rank sends in a ring all-reduce: ``2(N−1)/N · n · bytes``."""
    return (2 * (world_size - 1) * numel * bytes_per_element) // max(world_size, 1)


def tensor_wire_bytes(shape: tuple[int, ...], codec: Codec, world_size: int) -> float:
    """Bytes one rank sends for a tensor of ``shape`` alone in the exact collective, averaged
    over the ranks (:meth:`ShardLayout.wire_bytes`). In a bucket with other tensors a shard's
    bytes add up over its tensors and the all-gather's padding is at most this sum."""
    layout = ShardLayout.build([tuple(shape)], codec, world_size)
    return sum(layout.wire_bytes(r) for r in range(world_size)) / world_size
