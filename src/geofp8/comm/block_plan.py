"""The block-scaled fused stages of a layout (NVFP4, MXFP4, MXFP8): six kernels a bucket.

A :class:`BlockPlan` places a one-codec block-scaled layout (no side bytes) for
:mod:`geofp8.codecs.triton_fp4`'s kernels (:class:`~geofp8.codecs.block_records.Placement`),
so each stage of the exact collective is two kernels that read the flat vector or the
records where they lie and write where the next step reads, as :class:`.plan.FusedPlan`
does for FP8:

* :func:`encode_send` — the amax pass (every block's and segment's amax of ``Ũ = x +
  where(keep, R, 0)``), then the encoding pass (``Ũ`` made again from ``x`` and ``R``):
  scales and codes written into the all-to-all's
  send buffer (shard ``j``'s record at ``Σ_{i<j} shard_bytes(i)``), the rounding error into
  the caller's buffer (``R`` in its dtype, or the bucket);
* :func:`reduce_encode` — the owner's decode-and-sum of the ``N`` received records with
  its amax (:func:`reduce_sum`, a reduce-scatter's end), then the re-encode into the
  padded record the all-gather sends (:func:`encode_reduced`, which also takes a sum made
  elsewhere: one amax pass more);
* :func:`decode_gathered` — the gathered records' finite check, then the decode into the
  flat vector with the division by ``N`` and all NaN unless every scale is finite.

Amax slots are epoch-tagged (:class:`~geofp8.codecs.triton_fp8.AmaxSlots`): one buffer per
stage and device, zeroed once. The maps and slots are made once per layout: nothing per
call is ``O(tensors)`` or ``O(groups)`` on the host (the stochastic seeds: one int64 per
shard).
"""

from __future__ import annotations

import torch

from ..codecs import triton_fp4
from ..codecs.block_records import ShardPlace, place
from ..codecs.triton_fp8 import AmaxSlots
from ..codecs.uniforms import StepSeed

__all__ = ["BlockPlan", "decode_gathered", "encode_reduced", "encode_send", "reduce_encode",
           "reduce_sum"]


class BlockPlan:
    """The placements and amax slots of one block-scaled layout (module notes)."""

    def __init__(self, layout) -> None:
        self.layout = layout
        self.fmt = layout.codec.format
        self.send_bytes = sum(layout.shard_bytes(j) for j in range(layout.world_size))
        self._maps: dict[tuple, object] = {}

    @staticmethod
    def applies(layout, *tensors: torch.Tensor | None) -> bool:
        """Whether the block-scaled fused stages run this layout on these tensors: one NVFP4
        / MX codec, no side bytes, batched kernels on their device, the kernels available
        there, every tensor contiguous (FP32 or BF16 values, uint8 bytes)."""
        if not layout.plan.blocks:  # decided once per layout: most calls stop here
            return False
        given = [t for t in tensors if t is not None]
        return (layout.batched(given[0].device) and triton_fp4.available(*given)
                and all(t.dtype in (torch.float32, torch.bfloat16, torch.uint8)
                        and t.is_contiguous() for t in given))

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


def _plan(layout) -> BlockPlan:
    plan = layout._maps.get("block plan")
    if plan is None:
        plan = layout._maps["block plan"] = BlockPlan(layout)
    return plan


def _seeds(layout, seed: int | None, prefix: int | None, offset: int):
    """The encode's seeds: ``None`` to nearest; stochastic: the step's as kernel scalars
    (:class:`~geofp8.codecs.uniforms.StepSeed`), or every shard's 0 without a seed."""
    if layout.codec.rounding != "stochastic":
        return None
    return [None] * layout.world_size if seed is None else StepSeed(seed, prefix, offset)


def encode_send(flat: torch.Tensor, layout, seed: int | None = None, sender: int = 0,
                error: torch.Tensor | None = None,
                feedback: tuple[torch.Tensor, torch.Tensor | None] | None = None
                ) -> torch.Tensor:
    """The send buffer of ``flat`` in two kernels (module notes); shard ``j`` rounded with
    ``mix_seed(seed, sender, j)`` when the codec rounds stochastically. ``error``: where the
    rounding error goes (FP32, may be ``flat``). ``feedback=(R, keep)``: ``Ũ = flat +
    where(keep, R, 0)`` encoded (made in both kernels; ``flat`` is not written) and the
    new error written into ``R`` (its dtype)."""
    plan, device = _plan(layout), flat.device
    p = plan.place("send", device)
    bits = triton_fp4.amax(flat, p, plan.slots("send", device), *(feedback or (None, None)))
    sent = flat.new_empty(plan.send_bytes, dtype=torch.uint8)
    seeds = _seeds(layout, seed, sender, 0)
    triton_fp4.encode_placed(flat, bits, p, (sent, sent, sent),
                             error if feedback is None else feedback[0], seeds,
                             feedback=feedback)
    return sent


def reduce_sum(received: torch.Tensor, layout, shard: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The owner of ``shard``: ``(the FP32 sum of the N senders' copies, in sender order from
    +0, read from their records back to back in ``received``; its amax slots)``, one
    kernel."""
    plan, device, n = _plan(layout), received.device, layout.world_size
    nbytes = layout.send_bytes(shard)
    rows = received.as_strided((n, nbytes), (nbytes, 1))  # the first N records
    return triton_fp4.reduce((rows, rows, rows), plan.place(shard, device),
                             plan.slots(shard, device))


def encode_reduced(values: torch.Tensor, layout, shard: int, seed: int | None = None,
                   error: torch.Tensor | None = None, bits: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """Shard ``shard``'s record, zero-padded to ``max_shard_bytes``, from its ``values``:
    the amax pass (unless ``bits`` of :func:`reduce_sum` are given) and the encoding pass;
    re-encoded with ``mix_seed(seed, N + shard)`` when stochastic; ``error``: where the
    rounding error goes (FP32, may be ``values``)."""
    plan, device = _plan(layout), values.device
    p = plan.place(shard, device)
    if bits is None:
        bits = triton_fp4.amax(values, p, plan.slots(shard, device))
    record = values.new_empty(layout.max_shard_bytes, dtype=torch.uint8)
    triton_fp4.encode_placed(values, bits, p, (record, record, record), error,
                             _seeds(layout, seed, None, layout.world_size + shard),
                             pad=(layout.shard_bytes(shard), layout.max_shard_bytes))
    return record


def reduce_encode(received: torch.Tensor, layout, shard: int, seed: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The owner of ``shard``: ``(its re-encoded record, zero-padded to max_shard_bytes, the
    FP32 sum it encodes)`` from the ``N`` senders' records back to back in ``received``, in
    two kernels (:func:`reduce_sum`, :func:`encode_reduced`)."""
    total, bits = reduce_sum(received, layout, shard)
    return encode_reduced(total, layout, shard, seed, bits=bits), total


def decode_gathered(gathered: torch.Tensor, layout, out: torch.Tensor | None = None,
                    divide: int | None = None, flag: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, finite)``: the flat vector from the all-gather's ``N`` padded records
    (``/ divide`` when given), all NaN unless every scale is finite, and that 0-dim bool
    flag (written into the 0-dim uint8 ``flag`` when given: a step's slot), in two
    kernels."""
    plan, device = _plan(layout), gathered.device
    values = out if out is not None else torch.empty(layout.numel, dtype=torch.float32,
                                                     device=device)
    buf = gathered.view(-1)
    finite = triton_fp4.decode_placed(values, (buf, buf, buf), plan.place("gather", device),
                                      plan.slots("finite", device), divide,
                                      poison=True, flag=flag)
    return values, finite
