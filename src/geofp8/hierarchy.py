"""Hierarchical exact all-reduce for DDP: compress only the link between nodes.

Ranks ``r = node · R + local`` (``R`` ranks per node, ``M`` nodes, ``N = M·R``). For a DDP
bucket holding gradients ``G_p``:

1. **inside the node**, FP32: a reduce-scatter over the node's ``R`` ranks, by dim-0 rows of
   every tensor (FSDP's layout: ``⌈rows/R⌉`` rows per rank, the last padded with zeros), so
   local rank ``l`` holds rows chunk ``l`` of the node sum ``S_p = Σ_node G_p``;
2. **between nodes**, the exact collective (:class:`~geofp8.comm.collective.Communicator`)
   of that chunk among the ``M`` ranks with the same local rank, through the engine's
   pipeline: ``Ũ = S T + R_ef`` encoded (error feedback kept per rank for its chunk),
   all-to-all, FP32 sum, re-encoded, all-gathered, mapped back ``Y T⁻¹`` and divided by
   ``N``. Input-side maps act on columns, so a row chunk is routed like the whole matrix;
3. **inside the node**, FP32: an all-gather of the chunks into the bucket.

The hops of a bucket run asynchronously, like the flat collective's
(:class:`~geofp8.comm.lagged.Lagged`): each DDP hook advances every bucket in flight by one
stage — reduce-scatter issued; chunk encoded and its all-to-all issued; its all-gather
issued; the inter-node sum decoded, mapped back and the node all-gather issued; the chunks
copied into the bucket — so bucket ``i``'s stage ``s`` is issued at hook ``i + s`` on every
rank (the same order everywhere), and the last bucket's hook finishes them all. Every stage
runs on the DDP hook's side stream (:mod:`geofp8.comm.streams`).

Per element and rank that is ``2(M−1)/M`` encoded bytes on the link between nodes (against
``2(N−1)/N`` of them for the flat collective, each node's link carrying ``R`` ranks'
share), and ``2·4(R−1)/R`` FP32 bytes inside the node. ``stats()`` counts both
(``bytes_inter_node``, ``bytes_intra_node``). Factors and selections stay on the whole
world (:class:`~geofp8.engine.SyncEngine`'s group), identical on every rank.

The node layout: ``GeoFP8Config(node_size=R)``, else torchrun's ``LOCAL_WORLD_SIZE``;
``hierarchy="auto"`` uses this path when there are at least two nodes of at least two
ranks (and the collective is ``exact``), ``"node"`` always, ``"flat"`` never.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from .codecs.base import exact_div
from .comm.collective import Communicator
from .comm.group import release
from .comm.lagged import Lagged
from .comm.layout import ShardLayout
from .comm.stages import encode, encode_with_error

__all__ = ["HierarchicalAllReduce", "node_size", "row_chunks"]


def node_size(config, world: int) -> int | None:
    """Ranks per node when the hierarchical path applies, else ``None``."""
    size = config.node_size or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if config.hierarchy == "flat" or config.collective != "exact":
        return None
    if world % size:
        raise ValueError(f"GeoFP8: {world} ranks do not make whole nodes of {size} "
                         "(set GeoFP8Config(node_size=...) or LOCAL_WORLD_SIZE)")
    several = size >= 2 and world // size >= 2
    return size if config.hierarchy == "node" or several else None


def row_chunks(shapes: list[tuple[int, ...]], parts: int) -> list[tuple[int, int, int]]:
    """Per tensor ``(offset in a chunk, rows per chunk, elements per dim-0 row)`` when every
    tensor's rows are cut into ``parts`` chunks of ``⌈rows/parts⌉``."""
    out, pos = [], 0
    for shape in shapes:
        rows = -(-shape[0] // parts) if shape else 1
        width = torch.Size(shape[1:]).numel()
        out.append((pos, rows, width))
        pos += rows * width
    return out


def _node_groups(size: int, device, engine):
    """``(intra, inter)`` device groups of this rank: its node, and the ranks of every node
    with its local rank (every rank creates every group, in the same order)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    intra = inter = None
    for node in range(world // size):
        group = dist.new_group(list(range(node * size, (node + 1) * size)))
        intra = group if rank // size == node else intra
    for local in range(size):
        group = dist.new_group(list(range(local, world, size)))
        inter = group if rank % size == local else inter
    return (engine.device_group(intra, device, link="intra_node"),
            engine.device_group(inter, device, link="inter_node"))


class HierarchicalAllReduce:
    """The three hops above for DDP's buckets, several in flight (module notes)."""

    def __init__(self, engine, size: int, device, stream=None) -> None:
        if dist.get_world_size(engine.group.group) != dist.get_world_size():
            raise ValueError("GeoFP8's hierarchical collective runs on the default (world) "
                             "process group")
        if engine.config.factor_source == "local":
            raise ValueError("GeoFP8: factor_source='local' is not offered with the "
                             "hierarchical collective; use hierarchy='flat'")
        self.engine, self.size = engine, size
        self.intra, self.inter = _node_groups(size, device, engine)
        self.communicator = Communicator("exact", self.inter)  # (run under `runs`' stream)
        self.runs = Lagged(stream)
        self._layouts: dict[tuple, ShardLayout] = {}

    def launch(self, names: list[str], grads: list[torch.Tensor], buffer: torch.Tensor,
               offsets: list[int], seed: int | None, last: bool,
               then) -> torch.futures.Future:
        """Start averaging ``grads`` (views of ``buffer`` at ``offsets``) over every rank
        into ``buffer``; the future's value is ``then(buffer)``. ``last`` finishes every
        bucket in flight."""
        return self.runs.start(self._run(names, grads, buffer, offsets, seed),
                               buffer.device, last, then)

    def reset(self) -> None:
        """Drop the buckets in flight (after a failed step)."""
        self.runs.reset()
        self.communicator.reset()

    def _run(self, names, grads, buffer, offsets, seed):
        """One bucket's stages (a :class:`Lagged` run: each ``yield`` waits for a hook)."""
        shapes = [tuple(g.shape) for g in grads]
        chunks = row_chunks(shapes, self.size)
        span = sum(rows * width for _, rows, width in chunks)
        rows2d = torch.zeros(self.size, span, dtype=torch.float32, device=buffer.device)
        for g, (pos, rows, width) in zip(grads, chunks):  # rows of chunk l at row l, padded
            block = rows2d[:, pos : pos + rows * width].view(self.size, rows, width)
            x = g.detach().reshape(-1, width)
            whole, rest = divmod(x.shape[0], rows)
            block[:whole].copy_(x[: whole * rows].view(whole, rows, width))
            if rest:
                block[whole, :rest].copy_(x[whole * rows :])
        mine = torch.empty(span, dtype=torch.float32, device=buffer.device)
        work = self.intra.reduce_scatter(mine, rows2d.view(-1), dist.ReduceOp.SUM, "payload",
                                         async_op=True)
        yield
        work.wait()
        release(rows2d)
        reduced = yield from self._between_nodes(names, shapes, chunks, mine, seed)
        full, work = self.intra.all_gather(reduced, "payload", async_op=True)
        yield
        work.wait()
        for off, g, (pos, rows, width) in zip(offsets, grads, chunks):
            block = full[:, pos : pos + rows * width].reshape(self.size * rows, width)
            buffer[off : off + g.numel()].copy_(block[: g.numel() // width].reshape(-1))
        return buffer

    def _between_nodes(self, names, shapes, chunks, mine: torch.Tensor, seed):
        """The exact collective of this rank's node-sum chunk among the nodes; ``Σ/N``
        (stages of a run: all-to-all, then all-gather, then the sum)."""
        engine, pipeline = self.engine, self.engine.pipeline
        t0 = time.perf_counter()
        chunk_shapes = [(rows, *shape[1:]) if shape else (1,)
                        for shape, (_, rows, _) in zip(shapes, chunks)]
        routes = []  # Ũ written over the node sum (each chunk read before it is written)
        for name, shape, (pos, rows, width) in zip(names, chunk_shapes, chunks):
            chunk = mine[pos : pos + rows * width].view(shape)
            routes.append(pipeline.prepare_into(name, chunk, chunk, in_place=True))
        layout = self._layout(chunk_shapes)
        if engine.config.error_feedback:
            sent, residual = encode_with_error(mine, layout, seed=seed, sender=self.inter.rank)
            for name, shape, (pos, rows, width), route in zip(names, chunk_shapes, chunks,
                                                               routes):
                pipeline.feedback.stage(name, residual[pos : pos + rows * width].view(shape),
                                        route)
        else:
            sent = encode(mine, layout, seed=seed, sender=self.inter.rank)
        engine.ledger.add("codec_s", time.perf_counter() - t0)
        future = self.communicator.launch(sent, layout, last=False, seed=seed, out=mine)
        yield
        self.communicator.flush()  # this bucket's all-gather (the next launch comes later)
        yield
        self.communicator.complete(block=True)
        total = future.value()
        t1 = time.perf_counter()
        for shape, (pos, rows, width), route in zip(chunk_shapes, chunks, routes):
            y = total[pos : pos + rows * width].view(shape)
            y.copy_(pipeline.map_back(route, y))
        engine.ledger.add("transform_s", time.perf_counter() - t1)
        return exact_div(total, engine.group.size)  # exact on CUDA too

    def _layout(self, shapes: list[tuple[int, ...]]) -> ShardLayout:
        key = tuple(shapes)
        if key not in self._layouts:
            self._layouts[key] = ShardLayout.build(shapes, self.engine.pipeline.codec,
                                                   self.inter.size,
                                                   kernels=self.engine.config.kernels)
        return self._layouts[key]
