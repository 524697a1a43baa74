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

from ..codecs import triton_fp8
from ..codecs.base import device_scalar, mix_seed
from .layout import ShardLayout

__all__ = ["all_finite", "decode", "decode_gathered", "decode_gathered_flagged", "decode_sum",
           "encode", "encode_reduced",
           "encode_with_error", "poison_unless", "reduce_encode", "reduce_scatter",
           "rounding_error",
           "sender_sum", "simulate_exact_allreduce"]


def _shard_seed(seed: int | None, *index: int) -> int | None:
    return None if seed is None else mix_seed(seed, *index)


def encode(flat: torch.Tensor, layout: ShardLayout,
           side: list[torch.Tensor] | None = None, seed: int | None = None,
           sender: int = 0) -> torch.Tensor:
    """Stage 1: every shard quantized with its own scales (then its ``side`` bytes, if any),
    one after the other in one uint8 buffer; ``sender``: this rank (its rounding stream).
    Batched (:attr:`ShardLayout.kernels`) or segmentwise: one codec call over the bucket
    (the kernels do not grow with ``N``, :meth:`ShardLayout.encode_pieces`); else chunked:
    shard by shard straight into the buffer."""
    return _encode(flat, layout, side, seed, sender)[0]


def encode_with_error(flat: torch.Tensor, layout: ShardLayout,
                      side: list[torch.Tensor] | None = None, seed: int | None = None,
                      sender: int = 0, error_out: torch.Tensor | None = None,
                      feedback: triton_fp8.Feedback | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sent, error)``: :func:`encode` and its :func:`rounding_error` ``flat −
    decode(sent)`` (a sender's error feedback residual, FP32; the same bits), left in flat
    order by the layout's one codec call where it can (:attr:`ShardLayout.encodes_error`),
    else decoded back from ``sent`` once it is built. ``error_out``: the FP32 vector the
    error is written into, which may be ``flat`` itself (the bucket overwritten, no
    bucket-sized temporary: the fused kernels write it in their encoding pass); else a new
    one.

    ``feedback = (R, keep)``: the error feedback of a bucket, ``R`` a flat residual (FP32
    or BF16, ``flat``'s length), ``keep`` a 0-dim bool device flag or ``None`` (R valid as
    is): ``Ũ = flat + where(keep, R, 0)`` is encoded and its error ``Ũ − deq(Q(Ũ))``
    written into ``R`` (rounded to its dtype, as ``R.copy_`` rounds); the returned
    ``error`` is ``R``. The fused kernels (the layout's bound stages, FP8 or block-scaled:
    :meth:`.plan.FusedPlan.bound`) read ``R`` and ``keep`` in their two passes (``flat`` is
    not written; no host read) and write ``R`` in the encoding pass; elsewhere ``flat`` is
    made ``Ũ`` by one add (``where``'s 0 a device constant) and the error written straight
    into ``R`` where the codec's torch ops can (its ``sub`` rounds to ``R``'s dtype as
    ``R.copy_`` would; a CPU's chunked kernels with a BF16 ``R``: into ``error_out``, then
    copied): the same bits. (A bucket record calls its stages' ``send`` itself,
    :mod:`geofp8.bucket_path`.)"""
    fits = not side and triton_fp8.feedback_fits(flat, feedback)
    if fits and (fused := layout.plan.bound(flat, error_out)) is not None:
        error = feedback[0] if feedback is not None else (
            error_out if error_out is not None else torch.empty_like(flat))
        if (sent := fused.send(flat, error, feedback, seed, sender)) is not None:
            return sent, error
    if feedback is not None:
        residual, keep = feedback
        flat.add_(residual if keep is None else torch.where(
            keep, residual, device_scalar(0.0, residual.dtype, residual.device)))
        into = residual if residual.dtype == flat.dtype or layout.batched(flat.device) \
            else error_out  # (a CPU's chunked kernels write FP32 only)
        sent, error = encode_with_error(flat, layout, side, seed, sender, into)
        return sent, error if error is residual else residual.copy_(error)
    if not layout.encodes_error:
        sent = _encode(flat, layout, side, seed, sender)[0]
        error = rounding_error(sent, flat, layout)
    else:
        sent, error = _encode(flat, layout, side, seed, sender, with_error=True,
                              error_out=error_out)
    return sent, error if error_out is None or error is error_out else error_out.copy_(error)


def _encode(flat: torch.Tensor, layout: ShardLayout, side: list[torch.Tensor] | None,
            seed: int | None, sender: int, with_error: bool = False,
            error_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(sent, the rounding error when with_error, else None)``; the error is written into
    ``error_out`` where the layout's codec call can (see :meth:`ShardLayout.encode_pieces`)."""
    n = layout.world_size
    fused = None if with_error or side else layout.plan.bound(flat)
    if fused is not None and (sent := fused.send(flat, None, None, seed, sender)) is not None:
        return sent, None
    if not side and (done := layout.encode_send(flat, seed, sender, with_error,
                                                error_out)) is not None:
        return done
    seeds = [None] * n if seed is None else [mix_seed(seed, sender, j) for j in range(n)]
    if not (layout.batched(flat.device) or layout.segmentwise):
        sizes = layout.send_sizes
        sent = flat.new_empty(sum(sizes), dtype=torch.uint8)
        for j, record in enumerate(sent.split(sizes)):
            layout.encode_gathered(record, flat, j, seeds[j])
            if layout.side[j]:
                record[layout.shard_bytes(j) :].copy_(side[j])
        return sent, None
    payloads, error = layout.encode_pieces(flat, seeds, with_error, error_out)
    pieces = []
    for j, payload in enumerate(payloads):
        pieces += payload
        if layout.side[j]:
            pieces.append(side[j])
    return torch.cat(pieces), error


def _decode_records(buf: torch.Tensor, layout: ShardLayout, shards: list[int],
                    record: int | list[int], out: torch.Tensor | None = None,
                    check: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(values, finite)`` of the encoded ``shards`` laid one after the other in ``buf``,
    each in a record of ``record`` bytes (its payload first): batched, one split and one
    codec call; chunked, record by record. ``values`` (``out`` when given): the shards'
    values one after the other. ``finite`` is ``None`` without ``check`` (a NaN scale's
    group decodes to NaN either way)."""
    if layout.batched(buf.device):  # its cuts made once (ShardLayout.decode_records)
        return layout.decode_records(buf, shards, record, out, check)
    records = [record] * len(shards) if isinstance(record, int) else record
    values = out if out is not None else torch.empty(
        sum(layout.shard_numel(j) for j in shards), dtype=torch.float32, device=buf.device)
    out = values.split([layout.shard_numel(j) for j in shards])
    flags = [layout.decode_into(v, payload, j)
             for v, payload, j in zip(out, buf[: sum(records)].split(records), shards)]
    return values, torch.stack(flags).all() if check else None


def _decode_flat(buf: torch.Tensor | list[torch.Tensor], layout: ShardLayout,
                 record: int | list[int], minus: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, check: bool = True,
                 poison: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(values, finite)`` of the whole vector in flat order from every shard's record of
    ``record`` bytes (its payload first), the records back to back in ``buf`` or a list of
    them; with ``minus``, ``minus − values`` instead (no decoded copy); written into ``out``
    when given; ``finite`` is ``None`` without ``check``. A segmentwise codec: one codec
    call over the segments in flat order (:meth:`ShardLayout.decode_flat`; ``poison``: the
    values are already all NaN unless finite, through the scales, and ``finite`` is
    ``None``); else batched: one over the shards followed by the shard-major reorder;
    chunked: shard by shard into place (:meth:`ShardLayout.decode_scattered`)."""
    n = layout.world_size
    sizes = [record] * n if isinstance(record, int) else record
    if layout.segmentwise or layout.batched(_device_of(buf)):
        joined = torch.cat(buf) if isinstance(buf, list) else buf
        if layout.segmentwise:
            values = out if out is not None else torch.empty(
                layout.numel, dtype=torch.float32, device=joined.device)
            finite = layout.decode_flat(values, joined, sizes, check, poison)
        else:  # decoded in shard-major order, then reordered
            direct = out if layout.shard_major_is_flat else None
            values, finite = _decode_records(joined, layout, list(range(n)), sizes,
                                             out=direct, check=check)
            if direct is None:
                values = layout.from_shard_major(values, out=out)
        if minus is not None:
            torch.sub(minus, values, out=values)
        return values, finite
    records = buf if isinstance(buf, list) else buf[: sum(sizes)].split(sizes)
    values = out if out is not None else torch.empty(layout.numel, dtype=torch.float32,
                                                     device=records[0].device)
    flags = [layout.decode_scattered(values, r, j, minus) for j, r in enumerate(records)]
    return values, torch.stack(flags).all() if check else None


def _first(buf: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    return buf[0] if isinstance(buf, list) else buf


def _device_of(buf: torch.Tensor | list[torch.Tensor]) -> torch.device:
    return _first(buf).device


def decode_sum(received: torch.Tensor, layout: ShardLayout, shard: int,
               unmap=None, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Stage 3: dequantize the ``N`` senders' copies of ``shard`` (one batched decode: they
    share its scale groups) and sum them in FP32, sender after sender (:func:`sender_sum`;
    the fused kernels: one pass, :func:`reduce_encode`).

    ``unmap(values, side)``, when given, maps the decoded copies ``[N, shard]`` back with
    the senders' side metadata ``[N, side bytes]`` (per-sender decoding) before the sum.
    ``scratch``: an FP32 vector free to overwrite (the bucket the sum is later decoded
    into); the copies are decoded into it when it holds ``N × shard`` elements, instead of
    into a new bucket-sized vector. Same bits either way.
    """
    fused = None if unmap is not None else layout.plan.bound(received)
    if fused is not None and (done := fused.reduce_sum(received, shard)) is not None:
        return done[0]
    n, nbytes = layout.world_size, layout.send_bytes(shard)
    size = n * layout.shard_numel(shard)
    fits = scratch is not None and scratch.numel() >= size
    values, _ = _decode_records(received, layout, [shard] * n, nbytes,
                                out=scratch[:size] if fits else None, check=False)
    rows = values.view(n, -1)
    if unmap is not None:
        rows = unmap(rows, received[: n * nbytes].view(n, nbytes)[:, layout.shard_bytes(shard):])
    return sender_sum(rows)


def reduce_scatter(received: torch.Tensor, layout: ShardLayout, shard: int, unmap=None,
                   scratch: torch.Tensor | None = None, out: torch.Tensor | None = None,
                   divide: float | None = None, flag: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """A reduce-scatter's end: ``(values, finite)``, :func:`decode_sum` (``unmap``,
    ``scratch``: its own) divided by ``divide`` (IEEE, as a device scalar divides: the
    fused kernels' ``div_rn``; ``None``: not), written into ``out`` when given (FP32, the
    shard's length), and the 0-dim bool flag "every value is finite" (:func:`all_finite`;
    into the 0-dim uint8 ``flag`` when given, e.g. a step's slot). The fused kernels: one
    (the reduction, its division and its flag)."""
    direct = unmap is None and (out is None or out.dtype == torch.float32)
    fused = layout.plan.bound(received, out) if direct else None
    if fused is not None and (done := fused.reduce_scatter(received, shard, out, divide,
                                                           flag)) is not None:
        return done
    total = decode_sum(received, layout, shard, unmap, scratch)
    values = total if out is None else out
    if divide is not None:
        torch.div(total, device_scalar(divide, torch.float32, total.device), out=values)
    elif out is not None:
        out.copy_(total)
    return values, all_finite(values, None if flag is None else flag.view(torch.bool))


def sender_sum(rows: torch.Tensor) -> torch.Tensor:
    """``0 + rows[0] + rows[1] + …`` (FP32, the senders in order): the one order every path
    adds the ``N`` decoded copies in, the fused kernels' too. Off a CPU one kernel whatever
    ``N``: a segmented sum of the ``[N, shard]`` rows over one segment of ``N`` along axis
    0, whose every lane adds its ``N`` values one after the other from 0 in the rows' dtype
    (CUDA's kernel for an input of more than one dimension, as the CPU's; a 1-D input would
    take CUB's tree order). On a CPU, where that kernel is 3–6× slower than adding row by
    row: ``rows.sum(0)`` up to 4 rows (this order there, and faster), else row by row."""
    n = rows.shape[0]
    if rows.device.type != "cpu":
        return torch.segment_reduce(rows.view(n, -1), "sum", axis=0, unsafe=True,
                                    offsets=device_scalar((0, n), torch.long, rows.device))[0]
    if n <= 4:
        return rows.sum(0)
    total = rows[0] + 0.0  # -0 + 0 = +0, as a sum from zero
    for row in rows[1:]:
        total += row
    return total


def reduce_encode(received: torch.Tensor, layout: ShardLayout, shard: int,
                  seed: int | None = None, scratch: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Stages 3 and 4 of the owner of ``shard``: ``(its re-encoded record, padded to
    max_shard_bytes, the FP32 sum it encodes)``: :func:`decode_sum` then
    :func:`encode_reduced`, the same bytes; with the fused kernels two (decode, sum and
    the groups' amax; the scales and codes written into the record, its padding zeroed).
    ``scratch``: see :func:`decode_sum` (the torch path's). (A launch with the layout's
    bound stages calls them itself, :class:`~.collective.Communicator`.)"""
    fused = layout.plan.bound(received)
    if fused is not None and (done := fused.reduce_encode(received, shard, seed)) is not None:
        return done
    total = decode_sum(received, layout, shard, scratch=scratch)
    return encode_reduced(total, layout, shard, seed), total


def encode_reduced(shard_sum: torch.Tensor, layout: ShardLayout, shard: int,
                   seed: int | None = None, error_out: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """Stage 4: the reduced shard re-quantized, zero-padded to ``max_shard_bytes``.
    ``error_out``: where the owner's rounding error ``shard_sum − decode(shard)`` is written
    (FP32, may be ``shard_sum`` itself; the fused kernels write it in their encoding pass)."""
    fused = layout.plan.bound(shard_sum, error_out)
    if fused is not None and (done := fused.encode_reduced(shard_sum, shard, seed, error_out,
                                                           None)) is not None:
        return done
    nbytes = layout.shard_bytes(shard)
    if not layout.batched(shard_sum.device):
        out = shard_sum.new_empty(layout.max_shard_bytes, dtype=torch.uint8)
        layout.encode_into(out, shard_sum, shard, _shard_seed(seed, layout.world_size + shard))
        out[nbytes:].zero_()
    else:
        parts = layout.encode_shards(shard_sum, [shard],
                                     [_shard_seed(seed, layout.world_size + shard)])
        pad = layout.max_shard_bytes - nbytes
        out = torch.cat([*parts, layout.padding(shard, shard_sum.device)] if pad else parts)
    if error_out is not None:
        torch.sub(shard_sum, decode_shard(out, layout, shard), out=error_out)
    return out


def decode_shard(buf: torch.Tensor, layout: ShardLayout, shard: int) -> torch.Tensor:
    """The values of one encoded shard (its owner's view of what it re-encoded)."""
    return _decode_records(buf, layout, [shard], layout.shard_bytes(shard), check=False)[0]


def decode_gathered(gathered: torch.Tensor | list[torch.Tensor], layout: ShardLayout,
                    out: torch.Tensor | None = None, divide: int | None = None) -> torch.Tensor:
    """Stage 5: the full reduced vector (written into the FP32 ``out`` when given) from the
    ``N`` re-encoded shards (an all-gather's ``[N, max_shard_bytes]`` buffer, or a list);
    all NaN if any shard carries a non-finite scale (a segmentwise codec: through its
    scales; else a pass over the values, :func:`poison_unless`); ``divide``: divided by it
    (IEEE, e.g. by ``N`` for the mean). The fused kernels: one, its own flag."""
    return decode_gathered_flagged(gathered, layout, out, divide)[0]


def decode_gathered_flagged(gathered: torch.Tensor | list[torch.Tensor], layout: ShardLayout,
                            out: torch.Tensor | None = None, divide: int | None = None,
                            flag: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(values, finite)``: :func:`decode_gathered` and, from the fused kernels, their 0-dim
    bool flag "every scale finite" (``values`` are all NaN unless it is set, and finite
    where it is), written into the 0-dim uint8 ``flag`` when given (a step's slot,
    :class:`geofp8.verdict.StepVerdict`); ``None`` from the torch path (check the values,
    :func:`all_finite`)."""
    if isinstance(gathered, torch.Tensor) and gathered.dim() != 1:
        gathered = gathered.view(-1)
    fused = layout.plan.bound(_first(gathered), out)
    if fused is not None:
        joined = gathered if isinstance(gathered, torch.Tensor) else torch.cat(gathered)
        if (done := fused.decode_gathered(joined, out, divide, flag)) is not None:
            return done
    values, finite = _decode_flat(gathered, layout, layout.max_shard_bytes, out=out,
                                  poison=True)
    values = values if finite is None else poison_unless(values, finite)
    return (values if divide is None else values.div_(device_scalar(divide, values.dtype,
                                                                     values.device))), None


def all_finite(values: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The 0-dim bool device flag ``all(isfinite(values))`` (``True`` for none) from one
    min/max pass and four scalar ops: ``isfinite(values).all()`` makes four element-wise
    passes and builds their temporaries (an FP32 ``abs`` and three bool masks, 1.75× the
    vector's bytes). NaN propagates to both extremes; ``0·v`` is ``±0`` for a finite ``v``
    and NaN for ``±inf`` or NaN, so the sum below is 0 exactly when both are finite.
    ``out``: a 0-dim bool it is written into (e.g. a step's slot, viewed as bool)."""
    if values.numel() == 0:
        flag = torch.ones((), dtype=torch.bool, device=values.device)
        return flag if out is None else out.copy_(flag)
    lo, hi = torch.aminmax(values)
    return torch.eq(lo * 0 + hi * 0, 0, out=out)


def poison_unless(values: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """``values`` in place, all NaN unless the 0-dim bool ``finite`` (on the device: no host
    sync): multiplied by 1 (exact, every bit kept) or by NaN, a read and a write of
    ``values`` (``masked_fill_`` takes 3.5× as long on a CPU)."""
    return values.mul_(torch.where(finite, 1.0, float("nan")))


def decode(sent: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """What ``encode(flat, layout)`` decodes to (the sender's own view)."""
    return _decode_flat(sent, layout, layout.send_sizes, check=False)[0]


def rounding_error(sent: torch.Tensor, flat: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """``flat − decode(sent)``: what ``sent = encode(flat, layout)`` lost (a sender's error
    feedback residual), in flat order without a decoded copy of the whole vector."""
    return _decode_flat(sent, layout, layout.send_sizes, minus=flat, check=False)[0]


def simulate_exact_allreduce(inputs: list[torch.Tensor], layout: ShardLayout,
                             seed: int | None = None,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """What :func:`exact_allreduce` returns when rank ``r`` holds ``inputs[r]`` (one process);
    written into ``out`` when given, as a DDP bucket receives it."""
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
        gathered.append(reduce_encode(received, layout, j, seed)[0])
    return decode_gathered(gathered, layout, out)
