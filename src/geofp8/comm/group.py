"""The one door to ``torch.distributed``: every collective of the core goes through a
:class:`DeviceGroup`, which moves each tensor to the gradients' device first (NCCL accepts
only CUDA tensors) and charges the bytes this rank sends to a named counter.

Bytes follow each collective's standard algorithm: all-reduce ``2(N−1)/N·size`` (ring),
all-to-all the splits meant for the others, all-gather and broadcast ``(N−1)·size`` (the
broadcast charged to its source).

Every collective's ``Work`` is kept for the next :data:`KEEP` collectives. On gloo, the
worker thread that ran a collective drops its own reference to the ``Work`` just after
marking it done; when that is the last reference, the ``Work``'s tensors are freed there, and
a tensor that Python has already let go of needs the GIL to free its Python object — while
the main thread, holding the GIL, may be tearing the process group down and joining that
very thread: a hang at exit (the native stacks in ``benchmarks/exit_abort.py``). Holding the
``Work`` here makes the last reference Python's.

The buffers a kept ``Work`` holds need not stay: once a collective is done and its buffers
are read, :func:`release` frees their memory (the storage shrinks to nothing; the tensors,
and the ``Work``'s references to them, live on empty). The exact collective does so, so the
``KEEP`` kept ``Work``s cost no buffer memory.
"""

from __future__ import annotations

import collections
import json
import operator

import torch
import torch.distributed as dist

__all__ = ["KEEP", "DeviceGroup", "collective", "release"]

_EMPTIED = operator.methodcaller("resize_", 0)  # a storage shrunk to no bytes
KEEP = 4  # collectives whose Work a group keeps alive (module notes)
_BEFORE_2_12 = {"all_gather_single": "all_gather_into_tensor",  # torch < 2.12's names,
                "reduce_scatter_single": "reduce_scatter_tensor"}  # the same arguments


def collective(name: str):
    """``torch.distributed``'s ``name``, looked up at each call (a test or a byte counter may
    wrap it), or where this torch predates it (< 2.12) the same collective under its older
    name (:data:`_BEFORE_2_12`)."""
    return getattr(dist, name, None) or getattr(dist, _BEFORE_2_12[name])


# torch's all-gather into one tensor, by its name here (looked up at each call: collective)
_ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else \
    _BEFORE_2_12["all_gather_single"]


def release(*buffers: torch.Tensor) -> None:
    """Free the memory of collective buffers that are done with: each one's whole storage
    is resized to zero bytes (every view of it included). Call it only after the collective
    was waited for (on an accelerator the current stream then waits for it, and a freed block
    is reused in that order) and once nothing reads the buffers again."""
    list(map(_EMPTIED, map(torch.Tensor.untyped_storage, buffers)))  # no Python per buffer


def _waited(work) -> None:
    work.wait()


class DeviceGroup:
    """A process group and the device its collectives run on.

    Args:
        group: the process group (``None``: the world).
        device: the gradients' device; every tensor handed over is moved there.
        link: which network its traffic crosses when that is known (``"intra_node"``,
            ``"inter_node"``), else ``None``.
    """

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device,
                 link: str | None = None) -> None:
        self.group, self.device, self.link = group, torch.device(device), link
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.bytes: dict[str, float] = collections.defaultdict(float)  # by kind
        self._works: collections.deque = collections.deque(maxlen=KEEP)

    def _keep(self, work, async_op: bool = True):
        """``work`` kept alive (module notes); waited for here unless ``async_op``."""
        self._works.append(work)
        return work if async_op else _waited(work)

    def charge(self, kind: str, nbytes: float) -> None:
        """Count ``nbytes`` under ``kind`` (also for traffic computed, not issued, here)."""
        self.bytes[kind] += nbytes

    def take_bytes(self) -> dict[str, float]:
        """The bytes charged since the last call, by kind (and reset)."""
        taken, self.bytes = self.bytes, collections.defaultdict(float)
        return taken

    def on_device(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.device == self.device else t.to(self.device)

    def global_rank(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def all_reduce(self, t: torch.Tensor, kind: str, async_op: bool = False):
        """SUM all-reduce of ``t`` (moved to the device); returns ``(tensor, work)``."""
        t = self.on_device(t)
        self.charge(kind, 2 * (self.size - 1) * t.numel() * t.element_size() // self.size)
        work = dist.all_reduce(t, group=self.group, async_op=True)
        return t, self._keep(work, async_op)

    def broadcast(self, t: torch.Tensor, src: int, kind: str) -> torch.Tensor:
        """Broadcast from group rank ``src``; returns the (device) tensor."""
        t = self.on_device(t)
        if src == self.rank:
            self.charge(kind, (self.size - 1) * t.numel() * t.element_size())
        self._keep(dist.broadcast(t, src=self.global_rank(src), group=self.group,
                                  async_op=True), async_op=False)
        return t

    def all_gather(self, t: torch.Tensor, kind: str, async_op: bool = False,
                   flat: bool = False):
        """``(every rank's t stacked as [N, *t.shape], work)``: one buffer, gathered in place
        (a list of outputs would be gathered into a buffer and copied out, one copy per rank,
        by NCCL). ``flat``: the communicator's all-gather of a 1-D ``t`` it allocated on the
        device (not moved, as :meth:`all_to_all`'s buffers), the buffer as gathered (the
        ranks' ``t`` back to back), not viewed."""
        if not flat:
            t = self.on_device(t)
        out = t.new_empty((self.size * t.shape[0], *t.shape[1:]))  # gloo: concatenated form
        self.bytes[kind] += (self.size - 1) * t.numel() * t.element_size()
        work = getattr(dist, _ALL_GATHER)(out, t, group=self.group, async_op=True)
        return out if flat else out.view(self.size, *t.shape), self._keep(work, async_op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op, kind: str,
                       async_op: bool = False):
        """``reduce_scatter_single`` (the ``N − 1`` shards for others are sent); its work
        when ``async_op``, else it is waited for here."""
        self.charge(kind, (self.size - 1) * out.numel() * out.element_size())
        return self._keep(collective("reduce_scatter_single")(
            self.on_device(out), self.on_device(inp), op=op, group=self.group, async_op=True),
            async_op)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, received: list[int],
                   sends: list[int], kind: str):
        """Asynchronous ``all_to_all_single`` of uint8 buffers on the device (the
        communicator's, allocated there: not checked), ``received[j]`` / ``sends[j]`` bytes
        from / to rank ``j``."""
        self.bytes[kind] += sum(sends) - sends[self.rank]  # to the others
        work = dist.all_to_all_single(out, inp, received, sends, group=self.group, async_op=True)
        return self._keep(work)

    # -- plain data: JSON text and named tensors as bytes (no Python objects) -----------------

    def broadcast_tensors(self, named: dict[str, torch.Tensor] | None, src: int,
                          kind: str) -> dict[str, torch.Tensor]:
        """Broadcast ``{name: tensor}`` from group rank ``src`` bit-exactly: a JSON index of
        names, dtypes and shapes, then the raw bytes of every tensor. Returns the dict (on
        the device) on every rank; ``named`` is only read on ``src``."""
        mine = src == self.rank
        index, payload = "", torch.zeros(0, dtype=torch.uint8)
        if mine:
            index = json.dumps([[k, str(t.dtype).removeprefix("torch."), list(t.shape)]
                                for k, t in named.items()])
            payload = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
                                 for t in named.values()] or [payload])
        entries = json.loads(self.broadcast_text(index, src, kind))
        sizes = [torch.Size(shape).numel() * getattr(torch, dt).itemsize
                 for _, dt, shape in entries]
        data = payload if mine else torch.empty(sum(sizes), dtype=torch.uint8)
        data = self.broadcast(data, src, kind)
        out, pos = {}, 0
        for (name, dt, shape), n in zip(entries, sizes):
            out[name] = data[pos : pos + n].clone().view(getattr(torch, dt)).view(shape)
            pos += n
        return out

    def broadcast_text(self, text: str, src: int, kind: str) -> str:
        """Broadcast a UTF-8 string from group rank ``src`` (length first, then bytes)."""
        raw = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8) if text else \
            torch.zeros(0, dtype=torch.uint8)
        length = self.broadcast(torch.tensor([raw.numel()], dtype=torch.int64), src, kind)
        data = raw if src == self.rank else torch.empty(int(length), dtype=torch.uint8)
        return bytes(self.broadcast(data, src, kind).cpu().tolist()).decode()

    def all_gather_json(self, obj, kind: str) -> list:
        """Every rank's JSON-serialisable ``obj``, in group-rank order."""
        raw = json.dumps(obj, sort_keys=True).encode()
        lengths, _ = self.all_gather(torch.tensor([len(raw)], dtype=torch.int64), kind)
        longest = max(int(n) for n in lengths)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        gathered, _ = self.all_gather(padded, kind)
        return [json.loads(bytes(g[: int(n)].cpu().tolist()).decode())
                for g, n in zip(gathered, lengths)]
