"""A layout's fused stages bound on one device: what does not change between calls, resolved once.

The exact collective's stages (:mod:`.stages`) on the fused Triton kernels take two launches
each, the gathered decode one. Everything such a launch needs but the call's own tensors —
which kernels, their grids, the layout's maps, amax slots and tickets, the format's
constexprs — is resolved when a layout first runs on a device, into a :class:`BoundStages`
(:class:`.plan.FP8Stages` for E4M3 / E5M2, :class:`.block_plan.BlockStages` for NVFP4 and
MX) whose calls only allocate their outputs and launch
(:class:`~geofp8.codecs.triton_fp8.Launch`). Its protocol:

* ``send(flat, error, feedback, seed, sender)`` — the sender's encode into the send buffer,
  its rounding error written into ``error`` (``None``: not kept) or, with ``feedback = (R,
  keep)``, into ``R``;
* ``reduce_sum(received, shard)`` — ``(sum, its amax slots)`` of the ``N`` received copies;
* ``encode_reduced(values, shard, seed, error, bits)`` — the owner's padded record, the
  values' amax taken unless ``bits`` (``reduce_sum``'s) are given;
* ``reduce_encode(received, shard, seed)`` — ``(record, sum)``, the two above in one
  stage (one owner lookup, the sum's amax from the reduction);
* ``reduce_scatter(received, shard, out, divide, flag)`` — ``(values, finite)``: a
  reduce-scatter's end, the sum ``/ divide`` into ``out`` and the flag "every value is
  finite", one kernel (:meth:`BoundStages.scattered`);
* ``decode_gathered(gathered, out, divide, flag)`` — ``(values, finite)``;
* ``sender(flat, residual)`` — ``send`` bound for a bucket record (:meth:`BoundStages.sender`).

Each returns ``None`` where the torch path must run the call instead: a kernel failed (its
module's ``failed`` records it and warns, :func:`guarded`; from then on
:meth:`BoundStages.takes` is false), or, for the block kernels, an empty shard.

:meth:`BoundStages.takes` is the per-call check of the tensors (the kernels available on
their device, contiguous, a dtype their pointers read); what the layout decides (one FP8
or block-scaled codec, no side bytes, batched kernels on the device) is decided once, by
:meth:`.plan.FusedPlan.bound`. Their module's ``available`` is looked up at every call, so
what a test replaces there takes effect on a layout bound before; a kernel's ``run`` is
bound when its launch is made (:class:`~geofp8.codecs.triton_fp8.Launch`: a test or a
benchmark that wraps it does so before the layouts it counts are bound).
"""

from __future__ import annotations

import functools
import operator
from types import ModuleType

import torch

from ..codecs.triton_fp8 import decode_launches

__all__ = ["BoundStages", "guarded"]

_CONTIGUOUS, _DTYPE = torch.Tensor.is_contiguous, operator.attrgetter("dtype")
RESIDUALS = (torch.float32, torch.bfloat16)  # an error feedback residual's dtypes


def guarded(stage):
    """A stage of a :class:`BoundStages` that returns ``None`` (the torch path) once a kernel
    raised and its module's ``failed`` took note (under the interpreter it re-raises)."""
    @functools.wraps(stage)
    def run(self, *args):
        try:
            return stage(self, *args)
        except Exception as exc:  # noqa: BLE001 - any compile or launch error
            return self.kernels.failed(exc)
    return run


class BoundStages:
    """The protocol (module notes). ``kernels``: the kernels' module, whose ``available(*
    tensors)`` says whether they run on tensors now and whose ``failed(exc)`` takes note of
    a failure (or re-raises); ``dtypes``: what the kernels' pointers read."""

    kernels: ModuleType
    dtypes: tuple[torch.dtype, ...] = ()
    _decode: object  # the gathered decode's launch, its divisor not bound (its class's)
    _decodes: dict  # divide -> that launch's (plain, deciding) pair with it bound
    ticket: torch.Tensor  # the gathered decode's (triton_fp8.ticket)

    def decodes(self, divide: int | None) -> tuple:
        """The gathered decode's ``(plain, deciding)`` launches
        (:func:`~geofp8.codecs.triton_fp8.decode_launches`) dividing by ``divide`` (``None``:
        not), its divisor and constexpr bound on first use: a call passes neither."""
        found = self._decodes[divide] = decode_launches(self._decode.bind(
            divisor=float(divide or 1), DIVIDE=divide is not None), self.ticket)
        return found

    def sender(self, flat: torch.Tensor, residual: torch.Tensor | None):
        """``send(feedback, seed, sender)``: :meth:`send` of ``flat`` for a bucket record,
        which keeps ``flat`` and its residual ``residual`` (the ``R`` of every call's
        ``feedback = (R, keep)``; ``None``: no feedback, no error kept) while it is kept. Here
        the send with ``flat`` and no error of its own fixed; the FP8 stages bind their
        kernels' pointers once (:class:`.plan.BoundSend`)."""
        return functools.partial(self.send, flat, None)

    def scattered(self, launch, numel: int, out: torch.Tensor | None,
                  divide: float | None, flag: torch.Tensor | None, *args, **kwargs) -> tuple:
        """``(values, finite)`` of a reduce-scatter's end (``reduce_scatter``): ``launch``,
        a reduction bound as that end, run on the received records (``args``, ``kwargs``):
        the sum ``/ divide`` (IEEE; ``None``: not divided) written into ``out`` (FP32,
        ``numel`` elements; ``None``: a new one), and the 0-dim bool flag "every value
        written is finite" (into the 0-dim uint8 ``flag`` when given, e.g. a step's slot)."""
        values = out if out is not None else torch.empty(numel, dtype=torch.float32,
                                                         device=self.device)
        if flag is None:
            flag = torch.empty((), dtype=torch.uint8, device=self.device)
        launch(*args, out_ptr=values, flag_ptr=flag, divisor=float(divide or 1),
               DIVIDE=divide is not None, **kwargs)
        return values, flag.view(torch.bool)

    @classmethod
    def takes(cls, first: torch.Tensor, other: torch.Tensor | None = None) -> bool:
        """Whether the kernels run on ``first`` and ``other`` (``None``: not given): available
        on their device, each contiguous in one of :attr:`dtypes`."""
        tensors = (first,) if other is None else (first, other)  # (no Python per tensor)
        return cls.kernels.available(*tensors) and all(map(_CONTIGUOUS, tensors)) \
            and all(map(cls.dtypes.__contains__, map(_DTYPE, tensors)))
