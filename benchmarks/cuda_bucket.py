"""One bucket's exact-collective stages timed on a CUDA device, with CUDA events.

:mod:`gpu_bucket` counts the launches and models the host time on ``meta``; this script runs
the same share of a bucket on the GPU (:func:`geofp8.tools.gpu_check.stage_share`: a
sender's encode with its rounding error written over the bucket, the owner's decode-and-sum
of the ``N`` copies of its shard and its re-encode, the decode of the gathered shards
divided by ``N``) and measures, per bucket:

* **Triton**: how many distinct fused kernels one share launched (0: the torch path ran);
* **device µs**: CUDA events around one share, median of ``--repeats`` (the GPU's time,
  or the host's where it cannot enqueue fast enough);
* **host µs**: the wall time of enqueueing one share with the GPU idle, median (the
  Python and the launches on the autograd thread);
* **copy µs**: a device-to-device copy of the bucket's FP32 bytes (the HBM's reach);
* **goal**: issue 40's ≤ 100 µs (E4M3) and ≤ 150 µs (NVFP4) for a 25 MB bucket.

``--paths``: ``fused``, the Triton kernels (what CUDA runs); ``torch``, the torch-op
fallback (where Triton is absent: the kernels made unavailable inside). ``--device cpu`` is
a smoke run of the same code timed with the wall clock (under ``TRITON_INTERPRET=1`` the
fused path runs interpreted): its figures mean nothing.

    python benchmarks/cuda_bucket.py                              # 25 MB, N = 2 and 8
    python benchmarks/cuda_bucket.py --sizes 1 25 100 --ranks 2 8 64 --kinds equal unequal
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import time
from unittest import mock

import torch

from geofp8.codecs import make_codec, triton_fp8
from geofp8.comm import ShardLayout
from geofp8.tools.gpu_check import GOAL_US, cuda_seconds, kernel_census, stage_share
from gpu_bucket import METHODS, shapes


def seconds(run, device: torch.device, repeats: int) -> float:
    """Median seconds of ``run()`` on ``device``: CUDA events there, else the wall clock."""
    if device.type == "cuda":
        return cuda_seconds(run, repeats)
    run()  # as cuda_seconds: a first call, untimed
    return host_seconds(run, device, repeats)


def host_seconds(run, device: torch.device, repeats: int) -> float:
    """Median wall seconds of enqueueing ``run()`` with the device idle before each call."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return sorted(times)[len(times) // 2]


def torch_path(enabled: bool):
    """Inside: the fused kernels unavailable (the torch fallback runs), when ``enabled``."""
    if not enabled:
        return contextlib.nullcontext()
    return mock.patch.object(triton_fp8, "available", lambda *tensors: False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["fp8-ef", "nvfp4-ef"],
                        choices=list(METHODS))
    parser.add_argument("--sizes", nargs="+", type=float, default=[25], help="MB")
    parser.add_argument("--kinds", nargs="+", default=["equal"], choices=["equal", "unequal"])
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 8])
    parser.add_argument("--paths", nargs="+", default=["fused", "torch"],
                        choices=["fused", "torch"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("cuda_bucket: no CUDA device is visible (--device cpu: a smoke run)")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (wall clock)"
    print(f"{name}, torch {torch.__version__}\n")
    print("| path | method | bucket MB | tensors | ranks | Triton | device µs | host µs | "
          "copy µs | goal µs |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for path, method, mb, kind, n in itertools.product(args.paths, args.methods, args.sizes,
                                                        args.kinds, args.ranks):
        fmt = METHODS[method]
        layout = ShardLayout.build(shapes(mb, kind), make_codec(fmt), n, kernels="batched")
        x = torch.randn(layout.numel, device=device)
        with torch_path(path == "torch"):
            run = stage_share(layout, x)
            with kernel_census() as launched:
                run()
            t = seconds(run, device, args.repeats)
            host = host_seconds(run, device, args.repeats)
        copy = seconds(x.clone, device, args.repeats)
        goal = GOAL_US.get(fmt) if mb == 25 else None
        verdict = "" if goal is None else f"{goal:.0f} ({'met' if 1e6 * t <= goal else 'not met'})"
        print(f"| {path} | {method} | {mb:g} | {kind} | {n} | {len(launched)} | {1e6 * t:.0f} | "
              f"{1e6 * host:.0f} | {1e6 * copy:.0f} | {verdict} |", flush=True)


if __name__ == "__main__":
    main()
