"""Host syncs and aten ops per DDP bucket on an ordinary step, counted through the public API.

A ``TorchDispatchMode`` around ``backward()`` counts every aten op and every device-to-host
read (``_local_scalar_dense``: ``.item()``, ``bool(t)``, ``.tolist()``) that the comm hook
issues on the autograd thread, on ranks of a real gloo group. The model: 32 Linear(256, 256)
weights, DDP buckets of ~1 MB (8 buckets). Step 0 (consistency check) and refresh steps
are excluded: the figures are those of an ordinary step. Work done in the collective's
completion callbacks (gloo's threads) is not seen, so the op counts are a lower bound.

    python benchmarks/host_syncs.py               # 2 and 4 ranks, fp8-ef and geofp8-auto
    python benchmarks/host_syncs.py --kernels batched chunked   # both ways of running stages
    PYTHONPATH=<other checkout>/src python benchmarks/host_syncs.py   # another version

Counts are deterministic (the same on every run), so they compare versions exactly.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = ("aten._local_scalar_dense.default",)
STEPS = 4  # steps 1..3 are ordinary (refresh_every is large); step 0 is skipped


class Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def ddp_model(rank: int, world: int, port: int, method: str, bucket_mb: float = 1.0):
    """``(ddp, state)`` on a new gloo group: the benchmark's model under ``method``'s hook
    (``state`` is ``None`` for DDP's own all-reduce), DDP buckets of ``bucket_mb``; no
    refresh after step 0. ``method`` may name the stages' kernels after an ``@``
    (``fp8-ef@batched``; default ``auto``)."""
    method, _, kernels = method.partition("@")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    from geofp8.methods import METHODS

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256, bias=False) for _ in range(32)])
    spec = METHODS[method]
    settings = {"refresh_every": 1000, "kernels": kernels or "auto"}
    state, hook, _ = spec.build(model, **{k: v for k, v in settings.items()
                                          if k in spec.overrides and spec.kind == "geofp8"})
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    torch.manual_seed(1 + rank)
    return ddp, state


def _worker(rank: int, world: int, port: int, method: str, queue) -> None:
    ddp, _ = ddp_model(rank, world, port, method)
    per_step = []
    for step in range(STEPS):
        loss = ddp(torch.randn(16, 256)).pow(2).mean()
        counter = Counter()
        with counter:
            loss.backward()
        if step:
            per_step.append(counter.ops)
        ddp.zero_grad()
    buckets = len(ddp.reducer._get_zeros_like_grad_buckets())
    total = sum(per_step, collections.Counter())
    steps = len(per_step)
    queue.put((rank, buckets, sum(total.values()) / steps,
               sum(total[o] for o in SYNC_OPS) / steps))
    dist.barrier()
    dist.destroy_process_group()


# what the ranks' server imports once (as tests/distributed.py's), before a caller's own
PRELOAD = ("torch", "torch.distributed")
# the Llama of Hugging Face, for the callers whose ranks build one (not installed: skipped)
LLAMA = ("transformers.models.llama.modeling_llama",)


def _entry(worker, environ: dict, *args) -> None:
    """``worker(*args)`` in the caller's environment as it was when the ranks started (not
    the server's, from when it started)."""
    os.environ.clear()
    os.environ.update(environ)
    worker(*args)


def on_ranks(worker, world: int, method: str, *extra, fresh: bool = False,
             preload: tuple = ()) -> tuple:
    """What rank 0 of ``world`` gloo ranks puts on the queue, each running
    ``worker(rank, world, port, method, queue, *extra)`` (it puts ``(rank, *figures)``).
    The ranks are forked from a server that has imported ``PRELOAD`` and ``preload`` once
    (each starts as a clean single-threaded process; a server already started keeps its
    own); ``fresh``: spawned afresh, each importing torch itself,
    as a launcher's ranks are (their resident set then holds the pages touched only by the
    imports, which a forked rank never touches)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn" if fresh else "forkserver")
    if not fresh:
        ctx.set_forkserver_preload([*PRELOAD, *preload])
    queue = ctx.Queue()
    environ = dict(os.environ)
    procs = [ctx.Process(target=_entry,
                         args=(worker, environ, r, world, port, method, queue, *extra))
             for r in range(world)]
    for p in procs:
        p.start()
    results = dict((r, rest) for r, *rest in (queue.get(timeout=600) for _ in procs))
    for p in procs:
        p.join(timeout=60)
    return tuple(results[0])


def measure(method: str, world: int) -> tuple[int, float, float]:
    """``(buckets, aten ops per step, host syncs per step)`` on rank 0."""
    return on_ranks(_worker, world, method)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["fp8-ef", "geofp8-auto"])
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--kernels", nargs="+", default=["auto"],
                        help="the stages' kernels: auto (chunked on CPU), batched, chunked")
    args = parser.parse_args()
    print("| method | kernels | ranks | buckets | aten ops / bucket | host syncs / bucket |")
    print("|---|---|---|---|---|---|")
    for method in args.methods:
        for kernels in args.kernels:
            for world in args.ranks:
                buckets, ops, syncs = measure(f"{method}@{kernels}", world)
                print(f"| {method} | {kernels} | {world} | {buckets} | {ops / buckets:.1f} | "
                      f"{syncs / buckets:.2f} |", flush=True)


if __name__ == "__main__":
    main()
