"""Aten ops and wall time of the exact collective's stages per bucket, in one process.

One rank's share of a bucket (:func:`geofp8.tools.gpu_check.stage_share`, the one definition
the benchmarks share): its encode with the error feedback residual written over the bucket,
the owner's decode-and-sum of the ``N`` copies of its shard and its re-encode, the decode of
the gathered shards divided by ``N``. Ops are counted with a dispatch mode and
the peak of the bytes allocated and not yet freed (the profiler's allocation records; the
inputs, made beforehand, not counted) is taken against the bucket's FP32 bytes: both
deterministic. Times are the best of 3 on one thread, next to a memcpy of the bucket.

The batched kernels' ops are counted on the ``meta`` device (what they run on an
accelerator, where the codecs take their device paths, e.g. E4M3 decoded by torch's own
conversion rather than the CPU's table lookup), the chunked kernels' on the CPU (where the
native C kernels, :mod:`geofp8.codecs.native`, run outside the dispatcher: their passes are
in the time, not in the ops or bytes counted).

A GPU projection from the counts: every kernel (an op that is neither a view nor a bare
allocation) a launch of :data:`LAUNCH_US` plus the
bytes it reads and writes (:func:`moved_bytes`, of every kernel) at
:data:`HBM_BYTES_PER_S` (an H200), next to the time the bytes this rank sends for the bucket
take on a 100 and a 400 Gbit/s link. A model, not a measurement: launches overlap on a
stream, and small ops do not reach the HBM's bandwidth.

    python benchmarks/stage_ops.py                          # this checkout
    python benchmarks/stage_ops.py --kernels batched chunked   # the layout's two ways
    python benchmarks/stage_ops.py --kernels chunked --buckets llama-small   # a real bucket
    PYTHONPATH=<other checkout>/src python benchmarks/stage_ops.py   # another version
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from geofp8.codecs import make_codec
from geofp8.comm import ShardLayout
from geofp8.tools.gpu_check import stage_share

BUCKETS = {"1MB": [(256, 256)] * 4, "25MB": [(512, 512)] * 25}  # tensors of a bucket
MODEL_BUCKETS = ("llama-small",)  # every parameter of a model preset (4096 tokens), in one bucket


def bucket_shapes(name: str) -> list[tuple[int, ...]]:
    """The tensors of bucket ``name``: one of :data:`BUCKETS`, or a model's parameters (the
    unequal tensors of a real bucket: per-tensor scale groups of many lengths)."""
    if name in MODEL_BUCKETS:
        from geofp8.tools.models import load_model

        return [tuple(p.shape) for p in load_model(name, 4096, seed=0)[0].parameters()]
    return BUCKETS[name]
LAUNCH_US = 5.0  # one eager kernel launch on a GPU, microseconds
ALLOCATIONS = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
               torch.ops.aten.new_empty.default,
               torch.ops.aten.empty_like.default}  # ops that launch no kernel, move no byte
HBM_BYTES_PER_S = 4.8e12


def peak_allocated(prof) -> int:
    """Peak of the running sum of the CPU allocations and frees the profiler recorded."""
    records = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events()
                     if e.self_cpu_memory_usage)
    live = peak = 0
    for _, delta in records:
        live += delta
        peak = max(peak, live)
    return peak


WRITE_ONLY = {torch.ops.aten.copy_.default, torch.ops.aten.fill_.Scalar,
              torch.ops.aten.zero_.default}  # in-place ops that do not read their ``self``


def moved_bytes(func, args, kwargs, out) -> int:
    """Bytes an op reads and writes: every distinct tensor among its arguments and results
    once (an ``out=`` tensor is written, not read), at most its storage's bytes (a view of
    overlapping windows, ``unfold``, reads no byte twice from memory), and the ``self`` of
    an in-place op that reads it (``mul_``) twice."""
    tensors = {id(t): t for t in pytree.tree_leaves((args, kwargs, out))
               if isinstance(t, torch.Tensor)}
    inplace = func._schema.name.endswith("_") and func not in WRITE_ONLY
    return (sum(min(t.nbytes, t.untyped_storage().nbytes()) for t in tensors.values())
            + (args[0].nbytes if inplace else 0))


class Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = self.kernels = self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        if not func.is_view and func not in ALLOCATIONS:
            self.kernels += 1
            self.bytes += moved_bytes(func, args, kwargs, out)
        return out


def best(fn, repeats: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", nargs="+", default=["e4m3", "nvfp4"])
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 4, 8])
    parser.add_argument("--buckets", nargs="+", default=list(BUCKETS),
                        choices=[*BUCKETS, *MODEL_BUCKETS])
    parser.add_argument("--kernels", nargs="+", default=["batched", "chunked"],
                        help="ShardLayout.kernels to run (the GPU projection is the batched "
                             "row's: those are the kernels a GPU runs)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| format | kernels | bucket | ranks | aten ops | of which kernels | MB read+written | "
          "peak / bucket | CPU ms | x memcpy | GPU ms (projected) | send ms at 100 / 400 Gbit/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for fmt, kernels, name, n in itertools.product(args.formats, args.kernels, args.buckets,
                                                   args.ranks):
        layout = ShardLayout.build(bucket_shapes(name), make_codec(fmt), n, kernels=kernels)
        x = torch.randn(layout.numel, generator=torch.Generator().manual_seed(0))
        run = stage_share(layout, x)
        counted = stage_share(layout, x.to("meta")) if kernels == "batched" else run
        counted()  # first call: the codecs' tables
        counter = Counter()
        with counter:
            counted()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            run()
        peak = peak_allocated(prof) / x.nbytes
        y = torch.empty_like(x)
        t, t_copy = best(run), best(lambda: y.copy_(x))  # noqa: B023
        gpu = counter.kernels * LAUNCH_US * 1e-6 + counter.bytes / HBM_BYTES_PER_S
        send = [8 * layout.wire_bytes(0) / bits for bits in (100e9, 400e9)]
        print(f"| {fmt} | {kernels} | {name} | {n} | {counter.ops} | {counter.kernels} | "
              f"{counter.bytes / 1e6:.0f} | {peak:.2f} | {1e3 * t:.1f} | {t / t_copy:.0f} | "
              f"{1e3 * gpu:.3f} | "
              f"{1e3 * send[0]:.2f} / {1e3 * send[1]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
