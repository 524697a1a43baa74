"""Kernel launches and host time per bucket of the exact collective's stages, on the GPU path.

One rank's share of one bucket, as the collective runs it (:func:`rank_share`): the encode
with its rounding error written over the bucket (error feedback), the owner's
decode-and-sum of the ``N`` copies of its shard and its re-encode
(:func:`~geofp8.comm.stages.reduce_encode`), the decode of the gathered shards divided by
``N``. Everything runs on the ``meta`` device, which has no data: what is left is the
host's work, the same Python and dispatch a CUDA device sees. ``--paths``: ``torch``, the
torch-op batched path (the fallback without Triton); ``fused``, the fused Triton kernels
(:mod:`geofp8.codecs.triton_fp8` for E4M3/E5M2, :mod:`geofp8.codecs.triton_fp4` for NVFP4
and MX, taken as on CUDA), each kernel's launch replaced by a counter (no data to run it
on).

* **launches**: aten ops that are neither views nor bare allocations, counted by a dispatch
  mode (deterministic), plus the Triton launches;
* **host µs**: the wall time of the stages on ``meta`` under the counting mode, minus the
  time spent inside the meta ops and the mode's own cost per op, plus :data:`LAUNCH_US` per
  launch (what a CUDA launch costs the host thread, a Triton launch modelled the same): the
  Python of the stages plus the launches. Best of ``--repeats`` means over :data:`CALLS`
  calls each, with Python's garbage collector paused while timed (as ``timeit`` does); a
  model of the host cost, not a GPU measurement;
* **py lines**: the lines of GeoFP8's own Python the stages execute (a trace, deterministic):
  the host work per bucket counted rather than timed, so that growth with the tensors,
  ranks or groups of a bucket shows whatever the machine's load;
* **wire ms**: the bytes this rank sends for the bucket at 100 and 400 Gbit/s.

``--layouts K`` also models the host µs of ``K`` distinct layouts run one after the other
(a model with ``K`` buckets, each bucket's layout built once): a first pass over them all
(each layout's first call: its maps and plans made), then a second, against the same loop
over one layout ``K`` times (a control measured the same way: a mean over a loop, not the
best single call of the table), the second pass and the control alternated ``--repeats``
times, best of each; and the Python lines of one call of the control before the distinct
layouts ran and after. The host µs of a bucket must not grow with the number of buckets
the model has (no cache keyed by layouts that ``K`` of them overflow): the second pass ≈
the control, the same lines.

    python benchmarks/gpu_bucket.py                            # the default table
    python benchmarks/gpu_bucket.py --sizes 25 --ranks 8 --methods fp8-ef nvfp4-ef
    python benchmarks/gpu_bucket.py --sizes 1 --layouts 1000   # 1000 distinct buckets
    python benchmarks/gpu_bucket.py --paths fused --methods fp8-ef   # the Triton path
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import os
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import geofp8
from geofp8.codecs import make_codec, triton_fp4, triton_fp8
from geofp8.comm import ShardLayout
from geofp8.tools.gpu_check import stage_share as rank_share  # one rank's stages of a bucket

CALLS = 20  # calls of a bucket's stages per timed loop (a mean: timer and noise smoothed)
LAUNCH_US = 8.0  # host cost of one eager CUDA launch (torch dispatch + cudaLaunchKernel)
ALLOCATIONS = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
               torch.ops.aten.new_empty.default, torch.ops.aten.empty_like.default}
METHODS = {"fp8-ef": "e4m3", "nvfp4-ef": "nvfp4", "mxfp8-ef": "mxfp8",
           "geofp8-auto": "e4m3"}  # the codec each sends
LLAMA_LAYER = [(768, 768), (192, 768), (192, 768), (768, 768), (2048, 768), (2048, 768),
               (768, 2048), (768,), (768,)]  # q k v o gate up down, two norms: 24.8 MB


def shapes(mb: float, kind: str) -> list[tuple[int, ...]]:
    """The tensors of a bucket of about ``mb`` MB: ``equal`` 512×512 matrices (1 MiB each),
    or ``unequal`` Llama-layer tensors in order, the last one cut to fit."""
    target = int(mb * (1 << 20)) // 4
    if kind == "equal":
        return [(512, 512)] * max(1, target // (512 * 512))
    out, total = [], 0
    for shape in itertools.cycle(LLAMA_LAYER):
        numel = torch.Size(shape).numel()
        if total + numel > target:
            if target - total >= 768:
                out.append(((target - total) // 768, 768))
            return out or [(target,)]
        out.append(shape)
        total += numel


KERNELS = list(dict.fromkeys(  # every Triton kernel (``*_kernel``) of GeoFP8's modules loaded
    kernel for name, module in list(sys.modules.items())  # with the stages, once each
    if name.startswith("geofp8.") and module is not None
    for attr, kernel in vars(module).items()
    if attr.endswith("_kernel") and hasattr(kernel, "run")))


def has_fused(fmt: str) -> bool:
    """Whether the fused path has Triton kernels for the codec ``fmt``."""
    return fmt in triton_fp8.FMAX or fmt in triton_fp4.FORMATS


@contextlib.contextmanager
def fused_path(enabled: bool = True):
    """The fused Triton kernels taken on ``meta`` (as on CUDA), each launch counted on the
    active :class:`Launches` and not run (meta tensors have no data)."""
    if not enabled:
        yield
        return
    available, runs = triton_fp8.available, {}
    triton_fp8.available = lambda *tensors: True

    def launch(*args, **kwargs):
        if Launches.active is not None:
            Launches.active.triton += 1
    for fn in KERNELS:
        runs[fn], fn.run = vars(fn).get("run"), launch
    try:
        yield
    finally:
        triton_fp8.available = available
        for fn, run in runs.items():
            if run is None:
                del fn.run  # the class's own method again
            else:
                fn.run = run


class ActiveMode(TorchDispatchMode):
    """A dispatch mode that is its class's ``active`` one while entered: where the Triton
    launches, which bypass the dispatcher, are counted."""

    active: ActiveMode | None = None

    def __enter__(self):
        type(self).active = self
        return super().__enter__()

    def __exit__(self, *exc):
        type(self).active = None
        return super().__exit__(*exc)


class Launches(ActiveMode):
    """Counts launches and the seconds spent inside the ops' own dispatch."""

    def __init__(self) -> None:
        super().__init__()
        self.launches = self.views = self.triton = 0  # aten kernels, aten views, Triton
        self.inside = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.inside += time.perf_counter() - t
        if not func.is_view and func not in ALLOCATIONS:
            self.launches += 1
        else:
            self.views += 1
        return out


def _mode_cost(mode: Launches) -> float:
    """Seconds the dispatch mode itself adds to one op outside the op (its Python)."""
    t = torch.zeros(1, device="meta")
    best = float("inf")
    for _ in range(9):
        inside, start = mode.inside, time.perf_counter()
        with mode:
            for _ in range(200):
                t.add_(1)
        best = min(best, (time.perf_counter() - start - (mode.inside - inside)) / 200)
    return best


ROOT = os.path.dirname(geofp8.__file__) + os.sep


def python_lines(run, paused=None) -> int:
    """The lines of GeoFP8's own Python that ``run()`` executes (a trace of its frames);
    ``paused()``: true while the frames begun are not counted (a kernel that Triton's
    interpreter runs as Python)."""
    count = 0

    def local(frame, event, arg):
        nonlocal count
        count += event == "line"
        return local

    def calls(frame, event, arg):
        if paused is not None and paused():
            return None
        return local if frame.f_code.co_filename.startswith(ROOT) else None

    sys.settrace(calls)
    try:
        run()
    finally:
        sys.settrace(None)
    return count


def host_us(run, repeats: int) -> tuple[int, float]:
    """``(launches, modelled host µs)`` of ``run`` (module notes): the wall time under the
    counting mode, less the time inside the ops and the mode's own cost per op; the best of
    ``repeats`` means over :data:`CALLS` calls."""
    run()  # the first call: tables, caches
    with no_gc():
        cost = _mode_cost(Launches())
        return min((loop_us([run] * CALLS, cost) for _ in range(repeats)), key=lambda r: r[1])


@contextlib.contextmanager
def no_gc():
    """Python's garbage collector paused inside (a collection is no cost of the stages)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def loop_us(runs: list, cost: float) -> tuple[int, float]:
    """``(launches, modelled host µs)`` per call of ``run()`` for ``run`` in ``runs``, one
    loop under the counting mode (a mean over the loop; ``cost``: the mode's own per op)."""
    mode = Launches()
    start = time.perf_counter()
    with mode:
        for run in runs:
            run()
    host = time.perf_counter() - start - mode.inside - (mode.launches + mode.views) * cost
    launches = (mode.launches + mode.triton) // len(runs)
    return launches, (1e6 * host + LAUNCH_US * (mode.launches + mode.triton)) / len(runs)


def many_layouts(fmt: str, mb: float, kind: str, n: int, count: int,
                 repeats: int, feedback: bool = False) -> tuple[float, float, float, int, int]:
    """``(first pass, second pass, control)``: modelled host µs per bucket over ``count``
    distinct layouts, and over one more layout run ``count`` times (module notes); then the
    Python lines of one call of that control layout before the distinct layouts ran and
    after their passes (equal: nothing per call grows with the layouts a process has)."""
    base = shapes(mb, kind)

    def share(k: int):
        layout = ShardLayout.build([*base, (k + 1,)], make_codec(fmt), n, kernels="batched")
        return rank_share(layout, torch.zeros(layout.numel, device="meta"), feedback)
    control = share(0)
    control()
    lines = python_lines(control)
    runs = [share(k) for k in range(count)]
    with no_gc():
        cost = _mode_cost(Launches())
        first, second, alone = loop_us(runs, cost)[1], float("inf"), float("inf")
        for _ in range(repeats):
            second = min(second, loop_us(runs, cost)[1])
            alone = min(alone, loop_us([control] * count, cost)[1])
    return first, second, alone, lines, python_lines(control)


def _feedback(method: str, how: str) -> bool:
    """Whether ``method``'s encode takes the bucket's residual (``--feedback bucket``)."""
    return how == "bucket" and method.endswith("-ef")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--sizes", nargs="+", type=float, default=[1, 25, 100], help="MB")
    parser.add_argument("--kinds", nargs="+", default=["equal", "unequal"])
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 8, 64])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--paths", nargs="+", default=["torch", "fused"],
                        choices=["torch", "fused"], help="module notes")
    parser.add_argument("--layouts", type=int, default=0,
                        help="also time this many distinct layouts (module notes)")
    parser.add_argument("--feedback", choices=["bucket", "error"], default="bucket",
                        help="the *-ef methods' encode: the bucket's BF16 residual read and "
                        "rewritten in the kernels, as the DDP hook runs it (bucket), or the "
                        "rounding error written over the bucket (error)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| path | method | bucket MB | tensors | ranks | launches | host µs | py lines | "
          "wire ms at 100 / 400 Gbit/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    cases = list(itertools.product(args.paths, args.methods, args.sizes, args.kinds,
                                   args.ranks))
    for path, method, mb, kind, n in cases:
        if path == "fused" and not has_fused(METHODS[method]):
            continue  # no fused kernels for this codec: it runs the torch path
        layout = ShardLayout.build(shapes(mb, kind), make_codec(METHODS[method]), n,
                                   kernels="batched")
        x = torch.zeros(layout.numel, device="meta")
        with fused_path(path == "fused"):
            run = rank_share(layout, x, _feedback(method, args.feedback))
            launches, us = host_us(run, args.repeats)
            lines = python_lines(run)
        wire = [8 * layout.wire_bytes(0) / bits * 1e3 for bits in (100e9, 400e9)]
        print(f"| {path} | {method} | {mb:g} | {kind} | {n} | {launches} | {us:.0f} | "
              f"{lines} | {wire[0]:.2f} / {wire[1]:.2f} |", flush=True)
    if args.layouts:
        print(f"\n{args.layouts} distinct layouts, modelled host µs per bucket: first pass "
              f"/ second pass / one layout {args.layouts}× (the control); py lines of a "
              "control bucket before / after the distinct layouts ran")
        for path, method, mb, kind, n in cases:
            if path == "fused" and not has_fused(METHODS[method]):
                continue
            with fused_path(path == "fused"):
                first, second, alone, lines, alone_lines = many_layouts(
                    METHODS[method], mb, kind, n, args.layouts, args.repeats,
                    _feedback(method, args.feedback))
            print(f"{path} {method} {mb:g} MB {kind} N={n}: {first:.0f} / {second:.0f} / "
                  f"{alone:.0f} µs; {lines} / {alone_lines} lines", flush=True)


if __name__ == "__main__":
    main()
