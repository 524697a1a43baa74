"""The exact collective over ``torch.distributed``: all-to-all of encoded shards, FP32 sum,
re-encode, all-gather (see :mod:`geofp8.comm.stages`). Per rank and element that is
``2(N−1)/N`` payload bytes — the traffic of a ring all-reduce of the encoded format.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import NamedTuple

import torch
import torch.distributed as dist

from .bound import BoundStages
from .group import DeviceGroup, release
from .layout import ShardLayout
from .stages import (
    all_finite,
    decode,
    decode_gathered_flagged,
    decode_sum,
    encode,
    encode_reduced,
    poison_unless,
    reduce_encode,
    reduce_scatter,
)

__all__ = ["COLLECTIVES", "Communicator", "device_future", "exact_allreduce", "wire_bytes"]


COLLECTIVES = ("exact", "allgather")


Then = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def _same(value: torch.Tensor, finite: torch.Tensor | None = None) -> torch.Tensor:
    return value


class _Route(NamedTuple):
    """A layout's all-to-all arguments: bytes received from and sent to each rank."""

    layout: ShardLayout
    received: list[int]
    sends: list[int]
    received_total: int


def wire_bytes(layout: ShardLayout, rank: int, collective: str) -> int:
    """Bytes this rank sends for one bucket: see :meth:`ShardLayout.wire_bytes` for
    ``exact``; ``allgather`` sends its whole payload to each of the ``N − 1`` others."""
    if collective == "exact":
        return layout.wire_bytes(rank)
    total = sum(layout.send_bytes(j) for j in range(layout.world_size))
    return (layout.world_size - 1) * total


class Communicator:
    """Launches all-reduces of :func:`encode` d payloads; several may be in flight at once.

    ``exact``: all-to-all of shards, FP32 sum, re-quantize, all-gather (two roundings,
    ``2(N−1)/N`` payloads per rank). ``allgather``: every rank gathers every payload and
    sums in FP32 itself (one rounding, ``N − 1`` payloads per rank).

    Ordering: every rank must issue collectives in the same order, but completion callbacks
    fire in different orders on different ranks. So the all-gather of launch ``i`` is issued
    from the caller's thread at launch ``i + lag`` (after waiting for all-to-all ``i``, which
    has been overlapping the caller's work since); the launch marked ``last`` waits for the
    all-to-alls in flight and issues their all-gathers, in launch order, before it returns.
    No collective is ever issued from a callback: DDP itself issues one right after the last
    bucket's hook when ``find_unused_parameters=True`` (the used-parameter map), and a
    callback's all-gather raced it into a different order on different ranks (a deadlock).

    Completion: no Python runs on the backend's threads. A launch's future is completed by
    this (the caller's) thread — at a later launch once its all-gather is done, or at the end
    of the launch marked ``last``, which waits for all of them — and the callbacks chained
    on it run here too. A completion callback on a gloo thread still running while the main
    thread tore the process group down (holding the GIL) hung ranks at exit
    (``benchmarks/exit_abort.py``).

    ``kind``: the :class:`DeviceGroup` byte counter its traffic is charged to (``payload``
    for gradients, ``factor`` for fresh factors' sketches). ``mean``: every launch's value
    is divided by ``N``, the group's size (IEEE), by the fused decode where it runs (the
    same for every launch: :attr:`divide`, ``None`` without).

    Streams: every call runs on the caller's current stream — every wait on a collective,
    every stage after it and every completion (``then`` included) — so a caller that runs
    its calls under a side stream ordered after its gradients (the DDP hook and the
    hierarchical path, :mod:`geofp8.comm.streams`) has only that stream wait for the network,
    and the futures record it.

    ``owner``: an :class:`~geofp8.feedback.ErrorFeedback` for the second rounding (``exact``):
    a launch with ``owner_keys`` (one per tensor of the layout) adds each tensor's residual
    to its piece of the reduced shard before re-encoding it and stages
    ``R ← S + R − deq(Q(S + R))`` per tensor, committed with the step. A tensor's piece
    depends on the tensor alone (:meth:`ShardLayout.build` cuts each tensor by itself), not
    on which bucket carries it: DDP's rebuilt buckets and a resumed run find their residuals.
    ``owner_route`` is the route of those residuals, the identity transform, which whoever
    sets ``owner`` hands over with it (this layer does not import the geometry above it).
    A ``None`` key leaves its tensor out (no residual added, none staged): DDP gives one to
    tensors routed through a map, whose reduced shard is not in stable coordinates.
    Nor does it depend on the tensor's codec (a chunk is cut by element count alone), so a
    budget's change of format carries the residual on as it is.

    Memory: each encoded buffer is freed (:func:`~geofp8.comm.group.release`) as soon as its
    collective is done and it is read: ``sent`` once its all-to-all (or all-gather) is
    done, the received shards once summed, the gathered shards once decoded; the senders'
    decoded copies go into the launch's ``out`` when it has room (no bucket-sized vector). The
    :class:`DeviceGroup` keeps the last collectives' ``Work`` objects alive, not their bytes.

    ``flag_slot(device)``: where the fused decode of a launch's gathered shards writes its
    finite flag (a 0-dim uint8, e.g. :meth:`geofp8.verdict.StepVerdict.slot`; ``None``:
    a new one), the flag handed to ``then``.

    ``on_failure()``: called on this thread before a launch's future is failed (a stage or
    ``then`` raised), e.g. the DDP hook's rollback of its step.
    """

    owner = None  # ErrorFeedback of the owners' re-quantization, when enabled
    flag_slot: Callable[[torch.device], torch.Tensor | None] | None = None
    owner_route = None  # the coordinates its residuals are kept in (the identity transform)
    on_failure: Callable[[], None] | None = None

    def __init__(self, collective: str, group: DeviceGroup, kind: str = "payload",
                 lag: int = 1, mean: bool = False):
        if collective not in COLLECTIVES:
            raise ValueError(f"unknown collective {collective!r}; expected one of {COLLECTIVES}")
        self.collective, self.group, self.kind = collective, group, kind
        if lag < 1:
            raise ValueError(f"lag must be >= 1, got {lag}")
        self.lag, self.rank = lag, group.rank
        self.divide = group.size if mean else None
        # (work, run, result) of the launches whose first collective's next hop is not run
        self._in_flight: list[tuple] = []
        self._pending: list = []  # (work, finish, result): results this thread completes
        self._routes: dict[int, _Route] = {}  # id(layout) -> its all-to-all's arguments
        self._run = self._exact if collective == "exact" else self._allgather  # chosen once

    def launch(self, sent: torch.Tensor, layout: ShardLayout, last: bool = True,
               unmap=None, gather: bool = True, seed: int | None = None,
               owner_keys: list[str | None] | None = None,
               out: torch.Tensor | None = None, then: Then = _same,
               bound: BoundStages | None = None,
               into: torch.Tensor | None = None) -> torch.futures.Future:
        """Start the all-reduce; the future's value is ``Σ_r`` of the ranks' decoded payloads
        (mapped back per sender by ``unmap(rows, sides)`` first, see :func:`decode_sum`).
        ``gather=False`` stops after the FP32 sum (a reduce-scatter): the value is this
        rank's reduced shard, ``layout.shard_numel(rank)`` elements. ``seed``: the one
        ``sent`` was encoded with (stochastic rounding re-encodes the reduced shard with it).
        ``owner_keys``: the tensors' names for the second rounding's residuals, ``None``
        for a tensor left out (see :attr:`owner`). ``out``: an FP32 vector of
        ``layout.numel`` elements that is the communicator's from here, e.g. the bucket that
        ``sent`` came from, not read again: the senders' decoded copies of this rank's shard
        are summed there (see :func:`decode_sum`) and, with ``gather``, the sum is decoded
        into it and it is the future's value (divided by ``N`` with ``mean``, class notes).
        ``then(value, finite)``: a function of that value whose result is the
        future's value instead, run by this thread (on its current stream) before the future
        is completed; ``finite``: the 0-dim bool device flag "every element of the value is
        finite" where the collective has it (the fused decode's; ``None``: not known).
        ``into``: where a reduce-scatter (``gather=False``) writes its shard (FP32), divided
        by :attr:`divide` (when set), with its finite flag (``flag_slot``'s) for ``then``: the
        fused kernels' one pass (without: the sum alone, no flag).
        ``sent`` is the communicator's from here: its memory is freed once it is sent.
        ``bound``: the layout's fused stages (:meth:`~geofp8.comm.plan.FusedPlan.bound`)
        bound already for ``sent`` and ``out``, e.g. when ``sent`` was encoded: handed to
        the later stages, whose other inputs this communicator allocates (contiguous uint8
        on ``sent``'s device), with no check of their own; ``None``: the torch path's
        stages, each checking."""
        if self._in_flight or self._pending:  # (nothing to advance at a step's first launch)
            self._advance(self.lag - 1, block=False)
        # the collective's first hop (the exact one's all-gather is issued `lag` launches later)
        fut = device_future(sent.device)
        run = self._run(sent, layout, unmap, gather, seed, owner_keys, out, then, bound, fut, into)
        self._in_flight.append((next(run), run, fut))  # its first collective issued
        if last:  # issue the all-gathers now, from this thread (class notes), and wait
            self._advance(0, block=True)
        return fut

    def _route(self, layout: ShardLayout) -> _Route:
        """The all-to-all's arguments for ``layout``, made at its first launch (then found in
        ``_routes`` by its id, which the route's reference to the layout keeps from being
        reused: no Python per rank at each launch)."""
        sends = [layout.send_bytes(j) for j in range(layout.world_size)]
        received = [sends[self.rank]] * len(sends)
        route = self._routes[id(layout)] = _Route(layout, received, sends, sum(received))
        return route

    def track(self, work, finish, device: torch.device) -> torch.futures.Future:
        """A future that this thread completes with ``finish()`` once ``work`` is done (see
        the class notes)."""
        result = device_future(device)
        self._pending.append((work, finish, result))
        return result

    def complete(self, block: bool) -> None:
        """Complete the tracked results whose collectives are done, in launch order (all of
        them, waiting, when ``block``)."""
        self._advance(len(self._in_flight), block)

    def reset(self) -> None:
        """Drop unfinished launches (after a failed step): their collectives' results are
        never read."""
        self._in_flight, self._pending = [], []

    def flush(self, keep: int = 0) -> None:
        """Finish the oldest all-to-alls in flight and issue their all-gathers, in launch
        order, until ``keep`` are left (and complete the results done already)."""
        self._advance(keep, block=False)

    def _advance(self, keep: int, block: bool) -> None:
        """Finish the oldest launches' first collectives in flight, in launch order, until
        ``keep`` are left: each one's next hop (the exact collective's all-gather pending,
        or, for a reduce-scatter or the ``allgather`` collective, its result set); then
        complete the tracked results whose collectives are done, in launch order (all of
        them, waiting, when ``block``)."""
        while len(self._in_flight) > keep:
            work, run, result = self._in_flight.pop(0)
            work.wait()  # (raises if the all-to-all failed)
            try:
                self._pending.append((next(run), run.__next__, result))
            except StopIteration:  # its result set: done
                pass
            except Exception as exc:  # noqa: BLE001 - hand every failure to the caller
                fail(result, exc, self.on_failure)
        while self._pending and (block or self._pending[0][0].is_completed()):
            work, finish, result = self._pending.pop(0)
            try:
                work.wait()
                result.set_result(finish())
            except Exception as exc:  # noqa: BLE001 - hand every failure to the caller
                fail(result, exc, self.on_failure)

    def _exact(self, sent: torch.Tensor, layout: ShardLayout, unmap, gather: bool,
               seed: int | None, keys: list[str | None] | None, out: torch.Tensor | None,
               then: Then, bound: BoundStages | None, result: torch.futures.Future,
               into: torch.Tensor | None) -> Generator:
        """One launch of the exact collective, run by this thread hop by hop (a generator,
        its locals the launch's state): it issues the all-to-all and yields its work; once
        that is done (:meth:`_advance`), it sums and re-encodes this rank's shard, issues the
        all-gather and yields its work (a reduce-scatter sets ``result`` instead); once that
        is done (:meth:`_advance`), it decodes the gathered shards and yields the value.
        ``bound``'s stages are called as they are (``None`` from one: a kernel failed, the
        torch path's stage instead)."""
        route = self._routes.get(id(layout)) or self._route(layout)
        recv = sent.new_empty(route.received_total, dtype=torch.uint8)
        yield self.group.all_to_all(recv, sent, route.received, route.sends, self.kind)
        release(sent)
        pieces = _pieces(layout, self.rank, keys) if keys and self.owner is not None else ()
        if gather and unmap is None and not pieces:  # the fused kernels' case
            done = bound and bound.reduce_encode(recv, self.rank, seed)
            shard = (done or reduce_encode(recv, layout, self.rank, seed, scratch=out))[0]
            release(recv)
        elif not gather and into is not None:  # the shard and its flag (launch)
            flag = self.flag_slot(recv.device) if self.flag_slot is not None else None
            reduced, finite = reduce_scatter(recv, layout, self.rank, unmap, out, into,
                                             self.divide, flag)
            release(recv)
            result.set_result(then(reduced, finite))
            return
        else:
            # `out` is not read again (see launch): the senders' copies are decoded there
            reduced = decode_sum(recv, layout, self.rank, unmap, scratch=out)
            release(recv)
            if not gather:
                result.set_result(then(reduced, None))
                return
            for key, lo, hi in pieces:
                residual = self.owner.residual_in(key, self.owner_route)
                if residual is not None:
                    reduced[lo:hi] += residual
            # the owner's rounding error, written over the sum (not read again)
            shard = encode_reduced(reduced, layout, self.rank, seed,
                                   error_out=reduced if pieces else None)
            for key, lo, hi in pieces:
                self.owner.stage(key, reduced[lo:hi], self.owner_route)
        # the N records back to back, as the decode reads them
        gathered, work = self.group.all_gather(shard, self.kind, async_op=True, flat=True)
        yield work
        # its finite flag in flag_slot's slot
        flag = self.flag_slot(shard.device) if self.flag_slot is not None else None
        done = bound and bound.decode_gathered(gathered, out, self.divide, flag)
        total, finite = done or decode_gathered_flagged(gathered, layout, out, self.divide, flag)
        release(shard, gathered)
        yield then(total, finite)

    def _allgather(self, sent: torch.Tensor, layout: ShardLayout, unmap, gather: bool,
                   seed: int | None, keys: list[str | None] | None, out: torch.Tensor | None,
                   then: Then, bound: BoundStages | None, result: torch.futures.Future,
                   into: torch.Tensor | None) -> Generator:
        """One launch of the ``allgather`` collective, run as :meth:`_exact`'s: it issues
        the all-gather of every payload and yields its work; once that is done
        (:meth:`_advance`), it sums the decoded payloads in FP32 and sets ``result``."""
        if unmap is not None or not gather:
            raise ValueError("per-sender decoding and reduce-scatter need collective='exact'")
        gathered, work = self.group.all_gather(sent, self.kind, async_op=True)
        yield work
        total = out.zero_() if out is not None else torch.zeros(
            layout.numel, dtype=torch.float32, device=sent.device)
        for buf in gathered:
            total += decode(buf, layout)
        release(sent, gathered)
        # a NaN scale decodes to NaN in its group; widen it to the bucket, as `exact` does
        finite = all_finite(total)
        poison_unless(total, finite)
        mean = total if self.divide is None else total.div_(total.new_full((), self.divide))
        result.set_result(then(mean, finite))


def _pieces(layout: ShardLayout, rank: int, keys: list[str | None]
            ) -> list[tuple[str, int, int]]:
    """``(tensor name, start, end)`` of each keyed tensor's piece of ``rank``'s shard."""
    out, pos = [], 0
    for (lo, hi), index in zip(layout.segments[rank], layout.owners[rank]):
        if keys[index] is not None:
            out.append((keys[index], pos, pos + hi - lo))
        pos += hi - lo
    return out


def fail(result: torch.futures.Future, exc: Exception,
         on_failure: Callable[[], None] | None) -> None:
    """``result`` failed with ``exc``, ``on_failure()`` called first (when given)."""
    if on_failure is not None:
        on_failure()
    result.set_exception(exc)


def device_future(device: torch.device) -> torch.futures.Future:
    """A future whose value lives on ``device``: on an accelerator it records the producing
    stream, and whoever waits on it (DDP reading the bucket) is ordered after those writes."""
    return torch.futures.Future(devices=None if device.type == "cpu" else [device])


def exact_allreduce(flat: torch.Tensor, layout: ShardLayout,
                    group: dist.ProcessGroup | None = None,
                    seed: int | None = None) -> torch.Tensor:
    """Blocking exact all-reduce of ``flat`` (FP32, ``layout.numel`` elements, the same
    ``layout`` and ``seed`` on every rank): ``Σ_r flat_r`` in FP32. Collective over ``group``."""
    device_group = DeviceGroup(group, flat.device)
    return Communicator("exact", device_group).launch(
        encode(flat, layout, seed=seed, sender=device_group.rank), layout, seed=seed).wait()
