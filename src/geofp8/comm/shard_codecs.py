"""How a layout runs the codecs over its shards: whole-bucket calls, run by run, or shard by shard.

:class:`ShardCodecs` is the part of :class:`~geofp8.comm.layout.ShardLayout` that encodes and
decodes: the batched calls over several shards (one codec call for all of them, the maps
made once, :meth:`~geofp8.comm.layout.ShardLayout.group_map`), the segmentwise calls over
the flat vector whose bytes are then put in shard order, and the chunked calls shard by
shard. Every way gives the same bytes; which one runs is the layout's ``kernels``.
"""

from __future__ import annotations

from functools import cached_property

import torch

from ..codecs.base import GroupMap, interleave, joined, mix_seed
from .segment_parts import SegmentParts

__all__ = ["ShardCodecs"]


class ShardCodecs(SegmentParts):
    """Encoding and decoding through a layout (a mixin of
    :class:`~geofp8.comm.layout.ShardLayout`, whose metadata it reads)."""

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

    def encode_send(self, flat: torch.Tensor, seed: int | None, sender: int,
                    with_error: bool = False, error_out: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """``(every shard's payload one after the other, the rounding error or None)``: the
        send buffer of a bucket with no side bytes that the batched kernels encode in one
        call (:meth:`encode_pieces`: a segmentwise codec's parts reordered by one gather
        per kind, :meth:`PartsOrder.shard_after_shard`, or :meth:`encode_shards` of the
        shard-major vector), joined by one ``cat`` with nothing per shard in Python;
        shard ``j`` rounded with ``mix_seed(seed, sender, j)`` (sender ``sender``'s stream;
        no seed: ``None``), ``with_error`` and ``error_out`` as there. ``None`` where the stages
        join :meth:`encode_pieces`' pieces themselves (side bytes, the chunked kernels,
        a segmentwise codec's parts cut by segment)."""
        if not self.batched(flat.device) or any(self.side):
            return None
        if self._by_segment is None:
            if with_error:  # not encodes_error: encode_pieces says so
                return None
            shards = self._maps.setdefault("all shards", list(range(self.world_size)))
            seeds = ([None] * len(shards) if seed is None
                     else [mix_seed(seed, sender, j) for j in shards])
            return torch.cat(self.encode_shards(self.shard_major(flat), shards, seeds)), None
        if self._reorder is None:
            return None
        _check_float(flat)
        wholes, error = self.codec.encode_whole(flat, self._by_segment[0], with_error,
                                                error_out if with_error else None)
        if self._sends is not None:
            return self._sends.send_buffer(wholes), error
        parts = self._reorder.shard_after_shard(wholes)
        del wholes  # each kind in flat order: freed before the join
        return torch.cat(parts), error

    def decode_records(self, buf: torch.Tensor, shards: list[int], records: int | list[int],
                       out: torch.Tensor | None = None, check: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(values, finite)`` of the encoded ``shards`` laid one after the other in ``buf``,
        each in a record of ``records`` bytes (one size for all or one per shard; its payload
        first, then side bytes or padding): one ``split`` and one codec call over their
        payload parts, cut as made once per shards and records (nothing per shard in
        Python); a one-codec layout joins them kind after kind in one ``cat``
        (:meth:`Codec.decode_whole`), or, for an owner's copies of its shard, by one
        gather of rows whatever their number (:meth:`_copies_gather`). ``values``:
        ``out`` when given, else a new FP32 vector; ``finite`` as :meth:`decode_shards`
        returns it."""
        key = ("cuts", tuple(shards), records if isinstance(records, int) else tuple(records))
        if key not in self._maps:
            self._maps[key] = self._cuts(shards, records)
        nbytes, sizes, where, kinds, numel = self._maps[key]
        values = out if out is not None else torch.empty(numel, dtype=torch.float32,
                                                         device=buf.device)
        if (copies := self._copies_gather(key)) is not None:
            wholes = copies.forward(buf[:nbytes])[: sum(kinds)].split(kinds)
        elif (windows := self._windows(key, buf.device)) is not None:
            wholes = _gathered(buf, windows, kinds)
        else:
            pieces = buf[:nbytes].split(sizes)
            payload = list(map(pieces.__getitem__, where))
            if self.codecs:
                return values, self.decode_shards(values, payload, shards, check)
            wholes = joined(payload, align=4).split(kinds)  # first kind: FP32 scales or bytes
        return values, self.codec.decode_whole(values, wholes, self.group_map(shards), check)

    def encode_pieces(self, flat: torch.Tensor, seeds: list[int | None],
                      with_error: bool = False, error_out: torch.Tensor | None = None
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
        shard order (views, no copy), allocated once the codec's temporaries are freed.
        ``error_out``: an FP32 vector of ``flat``'s size, ``flat`` itself included, that the
        chunked path's encoding pass writes the error into where the codec fuses it, and
        the batched whole-bucket call where its torch ops can (:meth:`Codec.encode_whole`;
        no new vector); elsewhere it is not used and the caller copies."""
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
        if self.batched(flat.device) and self._reorder is not None:
            wholes, error = self.codec.encode_whole(flat, flat_shards, with_error,
                                                    error_out if with_error else None)
            return self._reorder.to_shards(wholes), error
        if self.batched(flat.device) and with_error:
            parts, error = self.codec.encode_shards_with_error(flat, flat_shards)
        elif self.batched(flat.device):
            parts = self.codec.encode_shards(flat, flat_shards, [None] * len(flat_shards))
        else:
            segments, part_bytes = self._flat_run
            payload = flat.new_empty(sum(part_bytes), dtype=torch.uint8)
            if with_error:
                fused = error_out is not None and self.codec.fuses_error(payload, error_out, flat)
                error = error_out if fused else torch.empty_like(flat)
                self.codec.encode_with_error(payload, error, flat, segments)
            else:
                self.codec.encode_into(payload, flat, segments)
            parts = interleave(*(part.split([b[p] for b in seg_bytes])
                                 for p, part in enumerate(payload.split(part_bytes))))
        k = len(parts) // len(flat_shards)  # parts per segment
        return [[parts[f * k + p] for p in range(k) for f in positions[j]]
                for j in range(n)], error

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
        if self.batched(buf.device) and self._reorder is not None:
            receives = self._receives(tuple(records))
            wholes = (self._reorder.from_records(buf, records) if receives is None else
                      self._reorder.kinds_of(receives.forward(buf[: sum(records)])))
            return self.codec.decode_whole(out, wholes, flat_shards, check, poison)
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


def _gathered(buf: torch.Tensor, windows: list[tuple[int, torch.Tensor]],
              kinds: list[int]) -> list[torch.Tensor]:
    """Each kind of the records in ``buf`` whole (views of one new buffer): per kind one
    ``index_select`` of its windows (``buf`` seen as its overlapping windows of the kind's
    length, ``unfold``) at the records' starts."""
    whole = buf.new_empty(sum(kinds))
    out = whole.split(kinds)
    for (length, starts), into in zip(windows, out):
        if length:
            torch.index_select(buf.unfold(0, length, 1), 0, starts, out=into.view(-1, length))
    return list(out)


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
