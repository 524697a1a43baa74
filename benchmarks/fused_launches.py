"""Kernel launches per bucket on the fused path (Triton + torch), counted without a GPU.

Runs one rank's stages of a bucket as the collective runs them (``gpu_bucket.rank_share``:
the encode with its error feedback written over the bucket, the owner's decode, sum and
re-encode, the decode of the gathered shards divided by ``N``) with the codecs' batched
path on the CPU under Triton's interpreter, where the stages take the fused kernels as they
do on CUDA (:mod:`geofp8.codecs.triton_fp8`, placed by :class:`geofp8.comm.plan.FusedPlan`;
:mod:`geofp8.codecs.triton_fp4`, the owner's stages record to record). Counts every Triton
kernel launched and every torch op that launches a kernel outside them (neither a view nor
a bare allocation; the interpreter's own torch calls inside a kernel are not counted).

    python benchmarks/fused_launches.py
    python benchmarks/fused_launches.py --formats nvfp4 --sizes 3 --ranks 2 8 64
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are decorated

import argparse  # noqa: E402
import itertools  # noqa: E402

import torch  # noqa: E402

from geofp8.codecs import make_codec  # noqa: E402
from geofp8.comm import ShardLayout  # noqa: E402
from gpu_bucket import ALLOCATIONS, KERNELS, ActiveMode, rank_share, shapes  # noqa: E402


class Launches(ActiveMode):
    """Counts Triton launches (the kernels wrapped once, below) and torch kernels outside
    them."""

    def __init__(self) -> None:
        super().__init__()
        self.triton = self.torch = 0
        self.inside = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not (self.inside or func.is_view or func in ALLOCATIONS):
            self.torch += 1
        return func(*args, **(kwargs or {}))


def _counting(run):
    def counted(*args, **kwargs):
        counter = Launches.active
        if counter is None:
            return run(*args, **kwargs)
        counter.triton += 1
        counter.inside = True  # the interpreter's own torch calls are not launches
        try:
            return run(*args, **kwargs)
        finally:
            counter.inside = False
    return counted


for _kernel in KERNELS:
    _kernel.run = _counting(_kernel.run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", nargs="+", default=["e4m3", "e5m2", "nvfp4", "mxfp4",
                                                         "mxfp8"])
    parser.add_argument("--sizes", nargs="+", type=float, default=[3], help="MB")
    parser.add_argument("--kinds", nargs="+", default=["equal", "unequal"])
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 8])
    args = parser.parse_args()
    print("| format | bucket MB | tensors | ranks | Triton | torch | launches |")
    print("|---|---|---|---|---|---|---|")
    for fmt, mb, kind, n in itertools.product(args.formats, args.sizes, args.kinds, args.ranks):
        layout = ShardLayout.build(shapes(mb, kind), make_codec(fmt), n, kernels="batched")
        run = rank_share(layout, torch.randn(layout.numel))
        run()  # the first call: the layout's maps
        counter = Launches()
        with counter:
            run()
        print(f"| {fmt} | {mb:g} | {kind} | {n} | {counter.triton} | {counter.torch} | "
              f"{counter.triton + counter.torch} |", flush=True)


if __name__ == "__main__":
    main()
