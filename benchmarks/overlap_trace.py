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
from geofp8.tools.gpu_check import triton_kernels

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
            report(args.trace)
        else:
            print("CPU (gloo): no streams to compare; run on CUDA for the overlap figures")
    dist.destroy_process_group()


def report(path: str) -> bool:
    """Print the kernels and busy µs per stream, and the µs of GeoFP8's codec kernels that
    ran on another stream while one of backward's GEMMs ran (backward's stream: the one
    with the most GEMMs); then the verdict. ``True``: codec kernels ran on a stream other
    than backward's and some of them overlapped a GEMM."""
    codec_names = {k.rsplit(".", 1)[-1] for k in triton_kernels()}

    def is_codec(name: str) -> bool:  # one of GeoFP8's fused Triton kernels, by its name
        return name in codec_names

    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"]
                  if e.get("cat") == "kernel" and "dur" in e]
    streams: dict[object, list] = {}
    for e in events:
        streams.setdefault(e.get("args", {}).get("stream", e.get("tid")), []).append(e)
    gemms = {s: [e for e in k if any(g in e["name"].lower() for g in GEMM)]
             for s, k in streams.items()}
    if not any(gemms.values()):
        print("VERDICT: no GEMM kernel in the trace: nothing to overlap with")
        return False
    main = max(gemms, key=lambda s: len(gemms[s]))
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in gemms[main]]
    print(f"{'stream':>14} {'kernels':>8} {'codec':>6} {'busy us':>9} "
          f"{'codec us under a GEMM':>22}")
    side_codec, under_total = 0, 0.0
    for s, kernels in sorted(streams.items(), key=lambda kv: str(kv[0])):
        codec = [e for e in kernels if is_codec(e["name"])]
        under = 0.0
        if s != main:
            side_codec += len(codec)
            for e in codec:
                a, b = e["ts"], e["ts"] + e["dur"]
                under += sum(max(0.0, min(b, hi) - max(a, lo)) for lo, hi in spans)
        under_total += under
        label = f"{s}{' (backward)' if s == main else ''}"
        print(f"{label:>14} {len(kernels):>8} {len(codec):>6} "
              f"{sum(e['dur'] for e in kernels):>9.1f} {under:>22.1f}")
    on_main = sum(is_codec(e["name"]) for e in streams[main])
    overlap = side_codec > 0 and under_total > 0
    print(f"VERDICT: overlap {'yes' if overlap else 'NO'}: {side_codec} codec kernels on "
          f"side streams ({on_main} on backward's), {under_total:.1f} µs of them under a "
          "backward GEMM")
    return overlap


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
