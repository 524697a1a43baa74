"""The block-scaled fused stages of a layout (NVFP4, MXFP4, MXFP8): six kernels a bucket.

A :class:`BlockPlan` places a one-codec block-scaled layout (no side bytes) for
:mod:`geofp8.codecs.triton_fp4`'s kernels (:class:`~geofp8.codecs.block_records.Placement`),
so each stage of the exact collective is two kernels that read the flat vector or the
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
* ``decode_gathered`` — the gathered records' finite check, then the decode into the
  flat vector with the division by ``N`` and all NaN unless every scale is finite.

Amax slots are epoch-tagged (:class:`~geofp8.codecs.triton_fp8.AmaxSlots`): one buffer per
stage and device, zeroed once. The maps and slots are made once per layout, and bound to the
kernels once per device (:class:`BlockStages`, the protocol of :mod:`.bound`): nothing per
call is ``O(tensors)`` or ``O(groups)`` on the host (a stochastic stage without a step's
seed: one int64 per shard).
"""

from __future__ import annotations

import torch

from ..codecs import triton_fp4
from ..codecs.block_records import ShardPlace, place
from ..codecs.triton_fp8 import AmaxSlots
from ..codecs.uniforms import StepSeed
from .bound import BoundStages, guarded

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
        """The persistent amax slots of ``"send"``, shard ``j`` or ``"finite"`` (one)."""
        key = ("slots", what, device)
        if key not in self._maps:
            p = None if what == "finite" else self.place(what, device).p
            self._maps[key] = AmaxSlots(1 if p is None else p.n_groups + p.n_segments, device)
        return self._maps[key]


class BlockStages(BoundStages):
    """A block-scaled layout's stages bound on one device (module notes, :mod:`.bound`): the
    send map's two launches and the gathered decode's two made at once, each owner shard's
    on its first call (an empty shard: the torch path)."""

    kernels = triton_fp4
    dtypes = (torch.float32, torch.bfloat16, torch.uint8)

    def __init__(self, plan: BlockPlan, device: torch.device) -> None:
        layout = self.layout = plan.layout
        self.plan, self.device, self.send_bytes = plan, device, plan.send_bytes
        self.stochastic = layout.codec.rounding == "stochastic"
        self._send = self._encoder("send", (0, 0))
        self.gather, self.finite_slot = plan.place("gather", device), plan.slots("finite", device)
        self._owners: dict[int, tuple | None] = {}

    def _encoder(self, what, pad: tuple[int, int]):
        """``(placement, slots, amax launch, encode launch)`` of ``what``, slots and padding
        fixed."""
        b, slots = self.plan.place(what, self.device), self.plan.slots(what, self.device)
        return (b, slots, b.amax.bind(slots_ptr=slots.buffer),
                b.encode.bind(slots_ptr=slots.buffer, pad_lo=pad[0], pad_hi=pad[1]))

    def _owner(self, shard: int):
        """Shard ``shard``'s :meth:`_encoder` with the record's padding, and the bytes every
        sender hands over for it; or ``None`` (empty: the torch path)."""
        found = self._owners.get(shard, ())
        if found == ():
            layout = self.layout
            found = self._owners[shard] = None if layout.shard_numel(shard) == 0 else (
                *self._encoder(shard, (layout.shard_bytes(shard), layout.max_shard_bytes)),
                layout.send_bytes(shard))
        return found

    def _encode(self, stage, u, error, feedback, seed, prefix, offset, out) -> None:
        """The encoding pass of ``stage`` (:meth:`_encoder`) into the uint8 ``out``: the
        amax slots' scales, the codes, the error into ``error`` or ``R`` (module notes);
        rounded to nearest, or stochastically with the step's seed as kernel scalars
        (:class:`~geofp8.codecs.uniforms.StepSeed`; without a seed every shard's is 0: a
        table, :func:`~geofp8.codecs.triton_fp4.seed_args`)."""
        b, encode = stage[0], stage[3]
        r, keep = feedback or (None, None)
        error = error if r is None else r
        seeds = None if not self.stochastic else [None] * self.layout.world_size \
            if seed is None else StepSeed(seed, prefix, offset)
        mode, (table, *scalars) = triton_fp4.seed_args(seeds, u.device)
        bf16 = error is not None and error.dtype == torch.bfloat16
        encode(u, u if r is None else r, triton_fp4.keep_arg(u, keep),
               u if error is None else error.view(torch.int16) if bf16 else error,
               out, out, out, seeds_ptr=b.p.seg_start if table is None else table,
               seed0=scalars[0], prefix=scalars[1], offset=scalars[2], HAS_R=r is not None,
               KEEP=keep is not None, HAS_ERR=error is not None, ERR_BF16=bf16, SEEDS=mode)

    @guarded
    def send(self, flat, error, feedback, seed, sender):
        """The send buffer of ``flat``: the amax pass of ``Ũ``, then the encoding pass; shard
        ``j`` rounded with ``mix_seed(seed, sender, j)`` when stochastic."""
        b, slots, amax, _ = self._send
        r, keep = feedback or (None, None)
        amax(flat, flat if r is None else r, triton_fp4.keep_arg(flat, keep), flat,
             epoch=slots.next()[1], HAS_R=r is not None, KEEP=keep is not None, STORE_U=False)
        sent = torch.empty(self.send_bytes, dtype=torch.uint8, device=flat.device)
        self._encode(self._send, flat, error, feedback, seed, sender, 0, sent)
        return sent

    @guarded
    def reduce_sum(self, received, shard):
        """``(the FP32 sum of the N senders' copies, in sender order from +0, read from their
        records back to back in received; its amax slots)``, one kernel."""
        owner = self._owner(shard)
        if owner is None:
            return None
        b, slots, nbytes = owner[0], owner[1], owner[4]
        out = torch.empty(b.p.numel, dtype=torch.float32, device=received.device)
        # the first N records, rows of nbytes: each part's pointer and row stride
        b.reduce(received, nbytes, received, nbytes, received, nbytes, self.layout.world_size,
                 out, slots_ptr=slots.buffer, epoch=slots.next()[1])
        return out, slots.buffer

    @guarded
    def encode_reduced(self, values, shard, seed, error, bits):
        """Shard ``shard``'s record, zero-padded to ``max_shard_bytes``: the amax pass
        (unless ``bits`` of :meth:`reduce_sum` are given) and the encoding pass, re-encoded
        with ``mix_seed(seed, N + shard)`` when stochastic; ``error``: where the rounding
        error goes (FP32, may be ``values``)."""
        owner = self._owner(shard)
        if owner is None:
            return None
        if bits is None:
            owner[2](values, values, values, values, epoch=owner[1].next()[1], HAS_R=False,
                     KEEP=False, STORE_U=False)
        record = torch.empty(self.layout.max_shard_bytes, dtype=torch.uint8,
                             device=values.device)
        self._encode(owner, values, error, None, seed, None, self.layout.world_size + shard,
                     record)
        return record

    @guarded
    def decode_gathered(self, gathered, out, divide, flag):
        """``(values, finite)``: the flat vector from the all-gather's ``N`` padded records
        (``/ divide`` when given), all NaN unless every scale is finite, and that flag
        (written into the 0-dim uint8 ``flag`` when given: a step's slot): two kernels."""
        values = out if out is not None else torch.empty(self.layout.numel, dtype=torch.float32,
                                                         device=gathered.device)
        if flag is None:
            flag = torch.empty((), dtype=torch.uint8, device=gathered.device)
        slot, epoch = self.finite_slot.next()
        b = self.gather
        b.finite(gathered, gathered, slot_ptr=slot, epoch=epoch)
        b.decode(gathered, gathered, gathered, values, slot_ptr=slot, epoch=epoch,
                 flag_ptr=flag, divisor=float(divide or 1), DIVIDE=divide is not None,
                 POISON=True)
        return values, flag.view(torch.bool)
