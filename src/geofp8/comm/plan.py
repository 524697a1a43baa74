"""The fused kernels' launch plan of a layout: where every code and scale goes, made once.

A :class:`FusedPlan` turns a one-codec FP8 layout (no side bytes) into the placed tile maps
of :mod:`geofp8.codecs.triton_fp8` (:func:`~geofp8.codecs.triton_fp8.placed_tiles`), so
each stage of the exact collective is one or two kernels that read the flat vector and
write the wire bytes where they travel, or the reverse, with no split, cat or reorder of
values or bytes in between:

* ``send``: the flat vector → the all-to-all's send buffer (shard ``j``'s record at
  ``Σ_{i<j} shard_bytes(i)``: its FP32 scales, then its codes, segment after segment);
* ``shard j``: a shard's values (shard order) ↔ its record (a received copy, or the
  re-encoded shard the all-gather sends, padded to ``max_shard_bytes``);
* ``gather``: the all-gather's ``N`` padded records → the flat vector.

A block-scaled layout (one NVFP4 / MX codec, :attr:`FusedPlan.blocks`) is placed by
:class:`~geofp8.comm.block_plan.BlockPlan` (its own placed maps, one or two kernels a stage).

:meth:`FusedPlan.bound`: the layout's stages bound on a device (:mod:`.bound`), made once
per device: :class:`FP8Stages`, or the block-scaled :class:`~.block_plan.BlockStages`.

The maps are int64 device tensors, a few per layout and device, built on first use and
kept as long as the layout: nothing per call is ``O(tensors)`` or ``O(groups)`` on the
host.
"""

from __future__ import annotations

import torch

from ..codecs import triton_fp4, triton_fp8
from ..codecs.triton_fp8 import TILE, Launch
from ..verdict import decode_into
from .block_plan import BlockPlan, BlockStages
from .bound import RESIDUALS, BoundStages, guarded

__all__ = ["BoundSend", "FP8Stages", "FusedPlan"]

_PLAIN = (torch.float32, torch.uint8)


class FusedPlan:
    """The tile maps of one layout (module notes); ``fmt``: its codec's FP8 format."""

    def __init__(self, layout) -> None:
        self.layout = layout
        self.fmt = getattr(layout.codec, "format", None)
        self._maps: dict[tuple, object] = {}
        self.group_counts = [sum(map(len, groups)) for groups in layout.groups]
        self.n_groups = sum(self.group_counts)
        self.shard_numels = [layout.shard_numel(j) for j in range(layout.world_size)]
        self.send_bytes = sum(layout.shard_bytes(j) for j in range(layout.world_size))
        plain = not layout.codecs and not any(layout.side)  # one codec, no side bytes
        self.fits = plain and self.fmt in triton_fp8.FMAX
        self.blocks = plain and self.fmt in triton_fp4.FORMATS  # NVFP4, MXFP4, MXFP8: BlockPlan
        self._stages = FP8Stages if self.fits else BlockStages if self.blocks else None
        self._bound: dict[torch.device, BoundStages | bool] = {}

    def bound(self, first: torch.Tensor, other: torch.Tensor | None = None
              ) -> BoundStages | None:
        """The layout's fused stages bound on ``first``'s device (:mod:`.bound`), made once
        per device, when they run on ``first`` and ``other`` (:meth:`runs`); else ``None``
        (the torch path). Once bound on a device: one lookup and the tensors' check."""
        found = self._bound.get(first.device)  # False: not batched on this device
        if found:
            return found if found.takes(first, other) else None
        return None if found is False else self._bind(first, other)

    def _bind(self, first: torch.Tensor, other: torch.Tensor | None) -> BoundStages | None:
        """:meth:`bound`'s first call on ``first``'s device."""
        stages, device = self._stages, first.device
        if stages is None or not stages.takes(first, other):
            return None
        found = self._bound[device] = self.layout.batched(device) and stages(
            self if self.fits else BlockPlan(self.layout), device)
        return found or None

    def runs(self, first: torch.Tensor, other: torch.Tensor | None = None) -> bool:
        """Whether the fused stages run this layout on ``first`` and ``other`` (``None``:
        not given). The layout's part is decided once (one FP8 or block-scaled codec, no
        side bytes: most layouts stop at the first test; batched kernels on the device:
        once per device), the tensors' on every call (:meth:`.BoundStages.takes`: the
        kernels available on their device, contiguous, a dtype they read)."""
        stages = self._stages
        return (stages is not None and stages.takes(first, other)
                and self.layout.batched(first.device))

    @staticmethod
    def applies(layout, first: torch.Tensor, other: torch.Tensor | None = None) -> bool:
        """Whether the fused FP8 stages run this layout on ``first`` and ``other``
        (:meth:`runs`): one FP8 codec (which rounds to nearest whatever the seed), no side
        bytes, batched kernels on their device, the Triton kernels available there, and
        every tensor contiguous, FP32 values or uint8 bytes (what the kernels' pointers
        read)."""
        return layout.plan.fits and layout.plan.runs(first, other)

    def _segments(self, shards, record_at, flat: bool):
        """Per segment of ``shards``: ``(first element, first group, its groups, first code
        byte, first scale byte)``, shard ``j``'s record at byte ``record_at(j)``; elements
        counted in the flat vector (``flat``) or in the shard, groups from the first
        shard's."""
        group = 0
        for j in shards:
            base, codes, pos, first = record_at(j), 4 * self.group_counts[j], 0, 0
            for (lo, hi), seg in zip(self.layout.segments[j], self.layout.groups[j]):
                yield lo if flat else pos, group, seg, base + codes + pos, base + 4 * first
                pos, first, group = pos + hi - lo, first + len(seg), group + len(seg)

    def tiles(self, what: str | int, device: torch.device) -> torch.Tensor:
        """The tile map of ``"send"``, ``"gather"`` or shard ``j`` (module notes)."""
        key = (what, device)  # a tensor's own device: normalised already
        if key not in self._maps:
            layout, every = self.layout, range(self.layout.world_size)
            if what == "send":
                offsets = [0]
                for j in every:
                    offsets.append(offsets[-1] + layout.shard_bytes(j))
                segments = self._segments(every, offsets.__getitem__, flat=True)
            elif what == "gather":
                segments = self._segments(every, lambda j: j * layout.max_shard_bytes,
                                          flat=True)
            else:
                segments = self._segments([what], lambda j: 0, flat=False)
            self._maps[key] = triton_fp8.placed_tiles(segments, device)
        return self._maps[key]

    def slots(self, what: str | int, device: torch.device) -> triton_fp8.AmaxSlots:
        """The persistent amax slots of ``"send"`` or shard ``j``'s groups on ``device``."""
        key = ("slots", what, device)
        if key not in self._maps:
            self._maps[key] = triton_fp8.AmaxSlots(
                self.n_groups if what == "send" else self.group_counts[what], device)
        return self._maps[key]


class FP8Stages(BoundStages):
    """A one-codec FP8 layout's stages bound on one device (:mod:`.bound`): the send map's
    two launches and the gathered decode's one (with its ticket) made at once, each owner
    shard's on its first call; the send's two with a residual's constexprs, per residual
    dtype."""

    kernels = triton_fp8
    dtypes = _PLAIN

    def __init__(self, plan: FusedPlan, device: torch.device) -> None:
        layout = plan.layout
        self.plan, self.device, self.send_bytes = plan, device, plan.send_bytes
        self.numel, self.record_bytes = layout.numel, layout.max_shard_bytes
        self.fmt = {"E5M2": plan.fmt == "e5m2", "TILE": TILE}
        self._send = self._encoder("send", (0, 0))
        gather, self.ticket = plan.tiles("gather", device), triton_fp8.ticket(device)
        self._decode = Launch(triton_fp8._decode_placed_kernel, (gather.shape[0],),
                              ticket_ptr=self.ticket, tiles_ptr=gather, **self.fmt,
                              **triton_fp8._NO_FUSION)
        self._decodes: dict[int | None, tuple] = {}
        self._owners: dict[int, tuple] = {}
        self._feedback = {dtype: self._with_residual(dtype) for dtype in RESIDUALS}

    def _encoder(self, what, pad: tuple[int, int]) -> tuple:
        """``(slots, amax launch, encode launch)`` of ``what``'s tile map, slots and padding
        fixed."""
        tiles, slots = self.plan.tiles(what, self.device), self.plan.slots(what, self.device)
        grid = (tiles.shape[0],)
        return (slots, Launch(triton_fp8._amax_kernel, grid, tiles_ptr=tiles,
                              bits_ptr=slots.buffer, STORE_U=False, TILE=TILE),
                Launch(triton_fp8._encode_placed_kernel, grid, bits_ptr=slots.buffer,
                       tiles_ptr=tiles, pad_lo=pad[0], pad_hi=pad[1],
                       FMAX=triton_fp8.FMAX[self.plan.fmt], **self.fmt,
                       **triton_fp8._NO_FUSION))

    def _owner(self, shard: int) -> tuple:
        """Shard ``shard``'s ``(slots, amax, encode, the encode of a sum (no error written),
        reduction, values, the reduce-scatter's end)``: :meth:`_encoder` with the record's
        padding and no feedback (an owner's values are its sum); made on its first call (the
        stages look it up in ``_owners`` first)."""
        plan, layout = self.plan, self.plan.layout
        slots, amax, encode = self._encoder(shard, (layout.shard_bytes(shard),
                                                    layout.max_shard_bytes))
        tiles, encode = plan.tiles(shard, self.device), encode.bind(**triton_fp8.NO_FEEDBACK)
        reduce = Launch(triton_fp8._reduce_kernel, (tiles.shape[0],), bits_ptr=slots.buffer,
                        tiles_ptr=tiles, n_senders=layout.world_size,
                        record=layout.send_bytes(shard), **self.fmt, **triton_fp8._NO_FUSION,
                        **triton_fp8.no_scatter(tiles))
        found = self._owners[shard] = (slots, amax.bind(**triton_fp8.NO_FEEDBACK), encode,
                                       encode.bind(HAS_ERR=False), reduce,
                                       plan.shard_numels[shard],
                                       reduce.bind(SCATTER=True, ticket_ptr=self.ticket, epoch=0))
        return found

    def _with_residual(self, dtype: torch.dtype) -> tuple:
        """``(slots, amax launch, encode launch, whether R is read as int16)``: the send's
        two with the constexprs of a residual ``R`` of ``dtype`` fixed (BF16: its bits, read
        as int16, are the FP32's high half); ``R``'s pointer and the keep flag per call."""
        slots, amax, encode = self._send
        bf16 = dtype == torch.bfloat16
        flags = {"HAS_R": True, "BF16": bf16}
        return slots, amax.bind(**flags), encode.bind(HAS_ERR=True, **flags), bf16

    @guarded
    def send(self, flat, error, feedback, seed, sender):
        """The send buffer of ``flat``: its groups' amax, then the codes and scales where
        they travel and the error into ``error``; FP8 rounds to nearest whatever the seed.
        ``feedback = (R, keep)`` (:func:`~geofp8.codecs.triton_fp8.feedback_fits`): both
        read ``Ũ = flat + where(keep, R, 0)`` (``keep`` read in the kernel: no host read)
        and the encode writes its error into ``R`` in ``R``'s dtype (BF16: rounded to
        nearest even, the bits of torch's ``.to(torch.bfloat16)``)."""
        sent = torch.empty(self.send_bytes, dtype=torch.uint8, device=flat.device)
        if feedback is not None:
            r, keep = feedback
            slots, amax, encode, bf16 = self._feedback[r.dtype]
            ptr = r.view(torch.int16) if bf16 else r
            keep_ptr = flat if keep is None else keep.view(torch.uint8)  # any pointer without
            amax(flat, ptr, keep_ptr, flat, epoch=next(slots.epochs), HAS_KEEP=keep is not None)
            encode(flat, ptr, keep_ptr, out_ptr=sent, err_ptr=ptr, HAS_KEEP=keep is not None)
            return sent
        slots, amax, encode = self._send
        amax(flat, flat, flat, flat, epoch=next(slots.epochs), **triton_fp8.NO_FEEDBACK)
        encode(flat, flat, flat, out_ptr=sent, err_ptr=flat if error is None else error,
               HAS_ERR=error is not None, **triton_fp8.NO_FEEDBACK)
        return sent

    def sender(self, flat, residual):
        """:meth:`send` of ``flat`` for a bucket record (:meth:`.BoundStages.sender`):
        :class:`BoundSend`."""
        return BoundSend(self, flat, residual)

    @guarded
    def reduce_sum(self, received, shard):
        """``(sum, its amax slots)``: the ``N`` received records decoded and summed in FP32
        sender after sender from +0, and the sum's groups' amax; one kernel."""
        slots, _, _, _, reduce, numel, _ = self._owners.get(shard) or self._owner(shard)
        out = torch.empty(numel, dtype=torch.float32, device=received.device)
        reduce(received, out, epoch=next(slots.epochs))
        return out, slots.buffer

    @guarded
    def reduce_encode(self, received, shard, seed):
        """``(record, sum)``: the reduction of :meth:`reduce_sum` (its amax taken with it),
        then the sum's encode (:meth:`encode_reduced`'s, no error written); two kernels."""
        slots, _, _, encode, reduce, numel, _ = self._owners.get(shard) or self._owner(shard)
        total = torch.empty(numel, dtype=torch.float32, device=received.device)
        reduce(received, total, epoch=next(slots.epochs))
        record = torch.empty(self.record_bytes, dtype=torch.uint8, device=received.device)
        encode(total, total, total, out_ptr=record, err_ptr=total)
        return record, total

    @guarded
    def reduce_scatter(self, received, shard, out, divide, flag):
        """``(values, finite)``: :meth:`reduce_sum`'s sum ``/ divide`` into ``out``, and its
        flag (:meth:`.BoundStages.scattered`); one kernel."""
        owner = self._owners.get(shard) or self._owner(shard)
        return self.scattered(owner[6], owner[5], out, divide, flag, received)

    @guarded
    def encode_reduced(self, values, shard, seed, error, bits):
        """Shard ``shard``'s record, zero-padded to ``max_shard_bytes`` (the amax pass unless
        ``bits`` are given, then the encode; the error into ``error`` when given)."""
        slots, amax, encode = (self._owners.get(shard) or self._owner(shard))[:3]
        if bits is None:
            amax(values, values, values, values, epoch=next(slots.epochs))
        record = torch.empty(self.record_bytes, dtype=torch.uint8, device=values.device)
        encode(values, values, values, out_ptr=record,
               err_ptr=values if error is None else error, HAS_ERR=error is not None)
        return record

    @guarded
    def decode_gathered(self, gathered, out, divide, flag):
        """``(values, finite)`` from the ``N`` padded records: the decode (``/ divide``), all
        NaN unless every scale is finite, and that flag (into ``flag`` when given); one
        kernel (:mod:`~geofp8.codecs.triton_fp8`'s ticket)."""
        values = out if out is not None else torch.empty(self.numel, dtype=torch.float32,
                                                         device=gathered.device)
        if flag is None:
            flag = torch.empty((), dtype=torch.uint8, device=gathered.device)
        launches = self._decodes.get(divide) or self.decodes(divide)
        decode_into(launches, flag, gathered, values)
        return values, flag.view(torch.bool)


class BoundSend:
    """:meth:`FP8Stages.send` of one bucket's vector ``flat`` with its residual ``R`` (or
    none: no error kept) fixed, a bucket record's (:meth:`.BoundStages.sender`): the two
    launches with their pointers and constexprs bound once, so a call passes the keep flag,
    the epoch and the send buffer alone. ``R``'s keep flag is read from each call's
    ``feedback = (R, keep)`` (``R``: this one); FP8 rounds to nearest whatever the seed."""

    __slots__ = ("amax", "encode", "epochs", "flat", "nbytes")
    kernels = triton_fp8  # (guarded's)

    def __init__(self, stages: FP8Stages, flat: torch.Tensor,
                 residual: torch.Tensor | None) -> None:
        if residual is None:
            slots, amax, encode = stages._send
            ptr, flags = flat, {"HAS_R": False, "BF16": False}
            encode = encode.bind(HAS_ERR=False, **flags)
            amax = amax.bind(**flags)
        else:
            slots, amax, encode, bf16 = stages._feedback[residual.dtype]
            ptr = residual.view(torch.int16) if bf16 else residual
        self.amax = amax.bind(x_ptr=flat, r_ptr=ptr, u_ptr=flat)
        self.encode = encode.bind(u_ptr=flat, r_ptr=ptr, err_ptr=ptr)
        self.epochs, self.flat, self.nbytes = slots.epochs, flat, stages.send_bytes

    @guarded
    def __call__(self, feedback, seed, sender):
        """The send buffer (:meth:`FP8Stages.send`'s bytes; ``None``: a kernel failed)."""
        sent = torch.empty(self.nbytes, dtype=torch.uint8, device=self.flat.device)
        keep = feedback and feedback[1]  # (None: R kept as it is, or no feedback)
        keep_ptr = self.flat if keep is None else keep.view(torch.uint8)  # any pointer without
        self.amax(keep_ptr=keep_ptr, epoch=next(self.epochs), HAS_KEEP=keep is not None)
        self.encode(keep_ptr=keep_ptr, out_ptr=sent, HAS_KEEP=keep is not None)
        return sent
