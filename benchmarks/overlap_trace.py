"""A profiler trace of DDP steps with the GeoFP8 hook: codec kernels on a side stream.

Runs a few steps of an MLP (several buckets) under DDP with ``fp8-ef``, profiles the last
one with ``torch.profiler`` and writes its Chrome trace. On CUDA (NCCL, one process per GPU,
``--world`` of them) it prints, per CUDA stream, the kernels launched and their busy µs, and
how many µs of kernels on streams other than backward's ran while a backward GEMM was
running: the overlap of issue 40 item 3 (see ``docs/performance.md``, "Overlap"). On a CPU
(gloo) there are no streams: it only checks that the script runs and writes the trace.

    python benchmarks/overlap_trace.py                       # CUDA if present, 1 rank a GPU
    python benchmarks/overlap_trace.py --world 2 --trace /tmp/overlap.json
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from geofp8 import FP8Config, FP8State, fp8_hook

GEMM = ("gemm", "cutlass", "sm80_", "sm90_", "ampere", "hopper")


def _step(model, x):
    model(x).pow(2).mean().backward()


def _rank(rank: int, args) -> None:
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=args.world)
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    net = net.to(device)
    state = FP8State(net, FP8Config(format="e4m3", error_feedback=True))
    model = DDP(net, bucket_cap_mb=args.bucket_mb)
    model.register_comm_hook(state, fp8_hook)
    x = torch.randn(args.tokens, args.width, device=device)
    for _ in range(3):  # buckets rebuilt, kernels compiled
        _step(model, x)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        torch.cuda.synchronize()
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        _step(model, x)
        if cuda:
            torch.cuda.synchronize()
    if rank == 0:
        prof.export_chrome_trace(args.trace)
        print(f"trace: {args.trace}")
        if cuda:
            _report(args.trace)
        else:
            print("CPU (gloo): no streams to compare; run on CUDA for the overlap figures")
    dist.destroy_process_group()


def _report(path: str) -> None:
    """Kernels and busy µs per stream; µs of other streams' kernels under backward GEMMs."""
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"]
                  if e.get("cat") == "kernel" and "dur" in e]
    streams: dict[int, list] = {}
    for e in events:
        streams.setdefault(e["args"].get("stream", e.get("tid")), []).append(e)
    gemms = {s: [e for e in k if any(g in e["name"].lower() for g in GEMM)]
             for s, k in streams.items()}
    main = max(gemms, key=lambda s: len(gemms[s]))  # backward's stream: most GEMMs
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in gemms[main]]
    print(f"{'stream':>8} {'kernels':>8} {'busy us':>9} {'us under a GEMM':>16}")
    for s, kernels in sorted(streams.items(), key=lambda kv: str(kv[0])):
        under = 0.0
        if s != main:
            for e in kernels:
                a, b = e["ts"], e["ts"] + e["dur"]
                under += sum(max(0.0, min(b, hi) - max(a, lo)) for lo, hi in spans)
        label = f"{s}{' (backward)' if s == main else ''}"
        print(f"{label:>8} {len(kernels):>8} {sum(e['dur'] for e in kernels):>9.1f} "
              f"{under:>16.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--trace", default="overlap_trace.json")
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU (smoke test)")
    args = parser.parse_args()
    if args.cpu or not torch.cuda.is_available():
        args.width, args.tokens, args.bucket_mb = min(args.width, 128), 64, 0.05
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    mp.spawn(_rank, args=(args,), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
