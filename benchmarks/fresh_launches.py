"""Fresh factors' statistics collectives per step, and their bytes.

``python benchmarks/fresh_launches.py [--blocks 2] [--ranks 2] [--sketch-format e4m3]``

A small LM (``--blocks`` blocks, 3 candidate Linear layers each) under DDP on gloo ranks with
``GeoFP8Config(layers="all", factor_source="fresh", k=8)``: the asynchronous all-reduces
GeoFP8 launches per step (the sketches and their moments: one per layer and forward when each
layer's hook launched its own, one per forward since they are launched together when the
model's forward returns) and the factor bytes rank 0 sent per step. Uses only the public API,
so the same script measures an older checkout for comparison.
"""

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Blocks(nn.Module):
    def __init__(self, blocks: int, d: int = 48) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({"mix": nn.Linear(d, d),
                                                   "up": nn.Linear(d, 2 * d),
                                                   "down": nn.Linear(2 * d, d)})
                                    for _ in range(blocks))

    def forward(self, h):
        for b in self.blocks:
            h = h + b["mix"](h)
            h = h + b["down"](torch.relu(b["up"](h)))
        return h


def _worker(rank, world, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from geofp8 import GeoFP8Config, GeoFP8State, geofp8_hook

    launches = [0]
    real = dist.all_reduce

    def counting(tensor, *a, **kw):
        launches[0] += bool(kw.get("async_op"))
        return real(tensor, *a, **kw)
    dist.all_reduce = counting
    torch.manual_seed(0)
    model = Blocks(args.blocks)
    ddp = DDP(model)
    state = GeoFP8State(model, GeoFP8Config(layers="all", factor_source="fresh", k=8,
                                            sketch_format=args.sketch_format))
    ddp.register_comm_hook(state, geofp8_hook)
    per_step = []
    for step in range(3):
        launches[0] = 0
        x = torch.randn(16, 48, generator=torch.Generator().manual_seed(10 * step + rank))
        ddp(x).pow(2).mean().backward()
        per_step.append(launches[0])
    if rank == 0:
        queue.put((per_step, state.stats()["factor_bytes_sent"], len(state.layers)))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--sketch-format", default=None)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args.ranks, port, args, queue))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    per_step, factor_bytes, layers = queue.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    print(f"{layers} candidate layers, {args.ranks} ranks, sketch_format={args.sketch_format}: "
          f"async all-reduces per step {per_step}, factor bytes sent per step {factor_bytes}")


if __name__ == "__main__":
    main()
