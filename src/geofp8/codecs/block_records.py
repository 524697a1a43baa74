"""A block-scaled shard's owner stages record to record (NVFP4, MXFP4, MXFP8 on Triton).

A record is one shard's payload as it travels (:meth:`~.base.Codec.part_bytes`: NVFP4's
FP32 segment scales, E4M3 block scales and packed E2M1 codes; MX's E8M0 block scales and
codes, one after the other), padded to the all-gather's record size. The owner of a shard
reads the ``N`` senders' records where the all-to-all left them and writes its re-encoded
record where the all-gather reads it, with :mod:`.triton_fp4`'s kernels: no part is cut,
joined or copied in between.
"""

from __future__ import annotations

import torch

from . import triton_fp4
from .groups import GroupMap

__all__ = ["reduce_record"]


def _record_parts(buf: torch.Tensor, parts: tuple[int, ...]) -> list[torch.Tensor | None]:
    """``[segment scales' bytes or None, block bytes, codes]``: views of the records (rows of
    ``buf``) whose payloads hold these parts one after the other (NVFP4's three, MX's two)."""
    views, pos = [], 0
    for size in parts:
        views.append(buf[..., pos : pos + size])
        pos += size
    return [None, *views] if len(parts) == 2 else views


def reduce_record(received: torch.Tensor, groups: GroupMap, fmt: str, parts: tuple[int, ...],
                  record_bytes: int, seeds=None) -> tuple[torch.Tensor, torch.Tensor]:
    """An owner's decode-and-sum and re-encode of one shard (``groups``), record to record:
    ``(its record, zero-padded to record_bytes, the FP32 sum it encodes)`` from the ``N``
    senders' records back to back in the uint8 ``received`` (each the payload's ``parts``).
    The sum is :func:`~.triton_fp4.decode_sum`'s, read from the received records in place;
    the re-encode (:func:`~.triton_fp4.encode`, ``seeds`` as there) writes its scales and
    codes straight into the record; one zeroed buffer holds the decode's flag and the
    re-encode's amax slots. The same bits as the codec's torch path."""
    nbytes = sum(parts)
    rows = received[: (received.numel() // nbytes) * nbytes].view(-1, nbytes)
    zeroed = torch.zeros(1 + triton_fp4.amax_slots(groups, fmt), dtype=torch.int32,
                         device=rows.device)
    s, block_bytes, codes = _record_parts(rows, parts)
    total, _ = triton_fp4.decode_sum(groups, fmt, block_bytes, codes, s, bad=zeroed[0])
    record = received.new_empty(record_bytes)
    s, block_bytes, codes = _record_parts(record, parts)
    triton_fp4.encode(total, groups, fmt, seeds=seeds, bits=zeroed[1:],
                      into=(None if s is None else s.view(torch.float32), block_bytes, codes))
    if record_bytes > nbytes:
        record[nbytes:].zero_()
    return record, total
