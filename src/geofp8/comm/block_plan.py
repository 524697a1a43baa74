"""The block-scaled fused stages of a layout (NVFP4, MXFP4, MXFP8): five kernels a bucket.

A :class:`BlockPlan` places a one-codec block-scaled layout (no side bytes) for
:mod:`geofp8.codecs.triton_fp4`'s kernels (:class:`~geofp8.codecs.block_records.Placement`),
so each stage of the exact collective is one or two kernels that read the flat vector or the
records where they lie and write where the next step reads, as :class:`.plan.FusedPlan`
does for FP8:

* ``send`` — the amax pass (every block's and segment's amax of ``Ũ = x +
  where(keep, R, 0)``), then the encoding pass (``Ũ`` made again from ``x`` and ``R``):
  scales and codes written into the all-to-all's
  send buffer (shard ``j``'s record at ``Σ_{i<j} shard_bytes(i)``), the rounding error into
  the caller's buffer (``R`` in its dtype, or the bucket);
* ``reduce_encode`` — the owner's decode-and-sum of the ``N`` received records with
  its amax (``reduce_sum``, a reduce-scatter's end), then the re-encode into the
  padded record the all-gather sends (``encode_reduced``, which also takes a sum made
  elsewhere: one amax pass more);
* ``decode_gathered`` — the decode of the gathered records into the flat vector with the
  division by ``N``, all NaN unless every scale is finite, and that flag: one kernel, whose
  last program writes the flag (:mod:`~geofp8.codecs.triton_fp8`'s ticket).

Amax slots are epoch-tagged (:class:`~geofp8.codecs.triton_fp8.AmaxSlots`): one buffer per
stage and device, zeroed once. The maps and slots are made once per layout, and bound to the
kernels once per device (:class:`BlockStages`, the protocol of :mod:`.bound`): nothing per
call is ``O(tensors)`` or ``O(groups)`` on the host (a stochastic stage without a step's
seed: one int64 per shard).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..codecs import triton_fp4
from ..codecs.block_records import ShardPlace, place
from ..codecs.triton_fp8 import AmaxSlots, Launch, ticket
from ..codecs.uniforms import StepSeed
from ..verdict import decode_into
from .bound import RESIDUALS, BoundStages, guarded

__all__ = ["BlockPlan", "BlockStages"]


class BlockPlan:
    """The placements and amax slots of one block-scaled layout (module notes)."""

    def __init__(self, layout) -> None:
        self.layout = layout
        self.fmt = layout.codec.format
        self.send_bytes = sum(layout.shard_bytes(j) for j in range(layout.world_size))
        self._maps: dict[tuple, object] = {}

    @staticmethod
    def applies(layout, first: torch.Tensor, other: torch.Tensor | None = None) -> bool:
        """Whether the block-scaled fused stages run this layout on ``first`` and ``other``
        (:meth:`.plan.FusedPlan.runs`): one NVFP4 / MX codec, no side bytes, batched kernels
        on their device, the kernels available there, every tensor contiguous (FP32 or BF16
        values, uint8 bytes)."""
        return layout.plan.blocks and layout.plan.runs(first, other)

    def _shard(self, j: int, base: int, local: bool) -> ShardPlace:
        layout, parts = self.layout, self.layout.parts[j]
        block = base + (parts[0] if len(parts) == 3 else 0)
        segments, pos = [], 0
        for (lo, hi), lengths in zip(layout.segments[j], layout.groups[j]):
            segments.append((pos if local else lo, lengths))
            pos += hi - lo
        return ShardPlace(base, block, block + parts[-2], segments)

    def place(self, what: str | int, device: torch.device) -> triton_fp4.Bound:
        """The placement of ``"send"`` (flat vector ↔ send buffer), ``"gather"`` (the
        ``N`` padded records ↔ flat vector) or shard ``j`` (its values ↔ its record), bound
        to the format (its kernels' fixed arguments made once)."""
        key = (what, device)  # a tensor's own device: normalised already
        if key not in self._maps:
            layout, every = self.layout, range(self.layout.world_size)
            if what == "send":
                bases = [sum(layout.shard_bytes(i) for i in range(j)) for j in every]
                shards = [self._shard(j, bases[j], local=False) for j in every]
            elif what == "gather":
                shards = [self._shard(j, j * layout.max_shard_bytes, local=False)
                          for j in every]
            else:
                shards = [self._shard(what, 0, local=True)]
            self._maps[key] = triton_fp4.Bound(place(
                shards, self.fmt != "mxfp8", triton_fp4.block_length(self.fmt), device),
                self.fmt)
        return self._maps[key]

    def slots(self, what: str | int, device: torch.device) -> AmaxSlots:
        """The persistent amax slots of ``"send"`` or shard ``j``."""
        key = ("slots", what, device)
        if key not in self._maps:
            p = self.place(what, device).p
            self._maps[key] = AmaxSlots(p.n_groups + p.n_segments, device)
        return self._maps[key]


class _Owner(NamedTuple):
    """An owner shard's bound launches (:meth:`BlockStages._owner`)."""

    place: triton_fp4.Bound
    slots: AmaxSlots
    amax: Launch  # no feedback
    encode: Launch  # no feedback; the error where asked
    encode_sum: Launch  # no feedback, no error: a reduction's sum
    reduce: Launch  # the N senders' records of send_bytes(shard), back to back
    numel: int
    scatter: Launch  # reduce as a reduce-scatter's end (no amax: the division and flag)


class BlockStages(BoundStages):
    """A block-scaled layout's stages bound on one device (module notes, :mod:`.bound`): the
    send map's two launches and the gathered decode's one (with its ticket) made at once,
    each owner shard's on its first call (an empty shard: the torch path); rounding to
    nearest, the encodes' seed arguments fixed with them; the send's two with a residual's
    constexprs, per residual dtype."""

    kernels = triton_fp4
    dtypes = (torch.float32, torch.bfloat16, torch.uint8)

    def __init__(self, plan: BlockPlan, device: torch.device) -> None:
        layout = self.layout = plan.layout
        self.plan, self.device, self.send_bytes = plan, device, plan.send_bytes
        self.numel, self.record_bytes = layout.numel, layout.max_shard_bytes
        self.stochastic = layout.codec.rounding == "stochastic"
        self._send = self._encoder("send", (0, 0))
        self.ticket = ticket(device)
        self._decode = plan.place("gather", device).decode.bind(ticket_ptr=self.ticket,
                                                                POISON=True)
        self._decodes: dict[int | None, tuple] = {}
        self._owners: dict[int, tuple | None] = {}  # None: an empty shard
        self._feedback = {dtype: self._with_residual(dtype) for dtype in RESIDUALS}

    def _encoder(self, what, pad: tuple[int, int]):
        """``(placement, slots, amax launch, encode launch)`` of ``what``, slots and padding
        fixed (and the seed arguments, rounding to nearest)."""
        b, slots = self.plan.place(what, self.device), self.plan.slots(what, self.device)
        encode = b.encode.bind(slots_ptr=slots.buffer, pad_lo=pad[0], pad_hi=pad[1])
        if not self.stochastic:
            encode = encode.bind(seeds_ptr=b.p.seg_start, seed0=0, prefix=0, offset=0, SEEDS=0)
        return b, slots, b.amax.bind(slots_ptr=slots.buffer), encode

    def _owner(self, shard: int) -> _Owner | None:
        """Shard ``shard``'s :class:`_Owner`: :meth:`_encoder` with the record's padding and
        no feedback (an owner's values are its sum), the reduction of the ``N`` records; or
        ``None`` (empty: the torch path, whose own work dwarfs this). Made on its first
        call (the stages look it up in ``_owners`` first)."""
        layout = self.layout
        if layout.shard_numel(shard) == 0:
            self._owners[shard] = None
            return None
        b, slots, amax, encode = self._encoder(shard, (layout.shard_bytes(shard),
                                                       layout.max_shard_bytes))
        encode, nbytes = encode.bind(HAS_R=False, KEEP=False), layout.send_bytes(shard)
        reduce = b.reduce.bind(s_stride=nbytes, blk_stride=nbytes, code_stride=nbytes,
                               n_senders=layout.world_size, slots_ptr=slots.buffer)
        found = self._owners[shard] = _Owner(
            b, slots, amax.bind(HAS_R=False, KEEP=False, STORE_U=False), encode,
            encode.bind(HAS_ERR=False, ERR_BF16=False), reduce, b.p.numel,
            reduce.bind(SCATTER=True, ticket_ptr=self.ticket, epoch=0))
        return found

    def _seeds(self, b, seed, prefix, offset, device) -> dict:
        """The stochastic encode's seed arguments: the step's seed as kernel scalars
        (:class:`~geofp8.codecs.uniforms.StepSeed`), or without one every shard's 0 (a
        table, :func:`~geofp8.codecs.triton_fp4.seed_args`)."""
        seeds = [None] * self.layout.world_size if seed is None else StepSeed(seed, prefix,
                                                                               offset)
        mode, (table, seed0, prefix, offset) = triton_fp4.seed_args(seeds, device)
        return {"seeds_ptr": b.p.seg_start if table is None else table, "seed0": seed0,
                "prefix": prefix, "offset": offset, "SEEDS": mode}

    def _with_residual(self, dtype: torch.dtype) -> tuple:
        """``(b, slots, amax launch, encode launch, whether the error is written as int16)``:
        the send's (:attr:`_send`) with the constexprs of a residual ``R`` of ``dtype`` fixed
        (read in its dtype, the error written in it: BF16's bits as int16); ``R``'s pointers
        and the keep flag per call."""
        b, slots, amax, encode = self._send
        bf16 = dtype == torch.bfloat16
        return (b, slots, amax.bind(HAS_R=True, STORE_U=False),
                encode.bind(HAS_R=True, HAS_ERR=True, ERR_BF16=bf16), bf16)

    @guarded
    def send(self, flat, error, feedback, seed, sender):
        """The send buffer of ``flat``: the amax pass of ``Ũ = flat + where(keep, R, 0)``
        (``feedback = (R, keep)``; ``flat`` without), then the encoding pass (``Ũ`` made
        again), the rounding error into ``R`` or ``error``; shard ``j`` rounded with
        ``mix_seed(seed, sender, j)`` when stochastic (to nearest: the seed arguments fixed
        at binding, none per call)."""
        sent = torch.empty(self.send_bytes, dtype=torch.uint8, device=flat.device)
        if feedback is not None:
            r, keep = feedback
            b, slots, amax, encode, bf16 = self._feedback[r.dtype]
            if self.stochastic:
                encode = encode.bind(**self._seeds(b, seed, sender, 0, flat.device))
            keep_ptr = flat if keep is None else keep.view(torch.uint8)  # any pointer without
            err = r.view(torch.int16) if bf16 else r
            amax(flat, r, keep_ptr, flat, epoch=next(slots.epochs), KEEP=keep is not None)
            encode(flat, r, keep_ptr, err, sent, sent, sent, KEEP=keep is not None)
            return sent
        b, slots, amax, encode = self._send
        if self.stochastic:
            encode = encode.bind(**self._seeds(b, seed, sender, 0, flat.device))
        amax(flat, flat, flat, flat, epoch=next(slots.epochs), HAS_R=False, KEEP=False,
             STORE_U=False)
        encode(flat, flat, flat, s_out=sent, blk_out=sent, code_out=sent, HAS_R=False,
               KEEP=False, **_error_args(error, flat))
        return sent

    @guarded
    def reduce_sum(self, received, shard):
        """``(the FP32 sum of the N senders' copies, in sender order from +0, read from their
        records back to back in received; its amax slots)``, one kernel."""
        owner, total = self._reduced(received, shard)
        return None if owner is None else (total, owner.slots.buffer)

    @guarded
    def reduce_encode(self, received, shard, seed):
        """``(record, sum)``: the reduction of :meth:`reduce_sum` (its amax taken with it),
        then the sum's encoding pass (:meth:`encode_reduced`'s, no error written); two
        kernels."""
        owner, total = self._reduced(received, shard)
        if owner is None:
            return None
        encode = owner.encode_sum
        if self.stochastic:
            encode = encode.bind(**self._seeds(owner.place, seed, None,
                                               self.layout.world_size + shard, received.device))
        record = torch.empty(self.record_bytes, dtype=torch.uint8, device=received.device)
        encode(total, total, total, total, record, record, record)
        return record, total

    @guarded
    def reduce_scatter(self, received, shard, out, divide, flag):
        """``(values, finite)``: :meth:`reduce_sum`'s sum ``/ divide`` into ``out``, and its
        flag (:meth:`.BoundStages.scattered`); one kernel (``None`` for an empty shard)."""
        owner = self._owners.get(shard) or self._owner(shard)
        return None if owner is None else self.scattered(
            owner.scatter, owner.numel, out, divide, flag, received, blk_in=received,
            code_in=received)

    def _reduced(self, received, shard) -> tuple[_Owner | None, torch.Tensor | None]:
        """``(shard's owner, the FP32 sum of the N records)``: the reduction kernel, which
        takes the sum's amax with it (both stages' first); ``(None, None)`` for an empty
        shard."""
        owner = self._owners.get(shard) or self._owner(shard)
        if owner is None:
            return None, None
        total = torch.empty(owner.numel, dtype=torch.float32, device=received.device)
        epoch = next(owner.slots.epochs)
        owner.reduce(received, blk_in=received, code_in=received, out_ptr=total, epoch=epoch)
        return owner, total

    @guarded
    def encode_reduced(self, values, shard, seed, error, bits):
        """Shard ``shard``'s record, zero-padded to ``max_shard_bytes``: the amax pass
        (unless ``bits`` of :meth:`reduce_sum` are given) and the encoding pass, re-encoded
        with ``mix_seed(seed, N + shard)`` when stochastic; ``error``: where the rounding
        error goes (FP32, may be ``values``)."""
        owner = self._owners.get(shard) or self._owner(shard)
        if owner is None:
            return None
        if bits is None:
            owner.amax(values, values, values, values, epoch=next(owner.slots.epochs))
        encode = owner.encode
        if self.stochastic:
            encode = encode.bind(**self._seeds(owner.place, seed, None,
                                               self.layout.world_size + shard, values.device))
        record = torch.empty(self.record_bytes, dtype=torch.uint8, device=values.device)
        encode(values, values, values, s_out=record, blk_out=record, code_out=record,
               **_error_args(error, values))
        return record

    @guarded
    def decode_gathered(self, gathered, out, divide, flag):
        """``(values, finite)``: the flat vector from the all-gather's ``N`` padded records
        (``/ divide`` when given), all NaN unless every scale is finite, and that flag
        (written into the 0-dim uint8 ``flag`` when given: a step's slot): one kernel
        (:mod:`~geofp8.codecs.triton_fp8`'s ticket)."""
        values = out if out is not None else torch.empty(self.numel, dtype=torch.float32,
                                                         device=gathered.device)
        if flag is None:
            flag = torch.empty((), dtype=torch.uint8, device=gathered.device)
        launches = self._decodes.get(divide) or self.decodes(divide)
        decode_into(launches, flag, gathered, gathered, gathered, values)
        return values, flag.view(torch.bool)


def _error_args(error: torch.Tensor | None, anywhere: torch.Tensor | None = None) -> dict:
    """The encoding pass's arguments for the rounding error written into ``error`` (FP32, or
    BF16 through its bits as int16), or for none (its pointer ``anywhere``)."""
    if error is None:
        return {"err_ptr": anywhere, "HAS_ERR": False, "ERR_BF16": False}
    bf16 = error.dtype == torch.bfloat16
    return {"err_ptr": error.view(torch.int16) if bf16 else error, "HAS_ERR": True,
            "ERR_BF16": bf16}
