"""Kernel launches of the real DDP comm hook per bucket, counted without a GPU.

Ranks of a real gloo group train ``Linear(64, 64)`` layers under DDP with a GeoFP8 method's
hook (``kernels="batched"``) on the CPU under Triton's interpreter, where the stages take
the fused kernels (:mod:`geofp8.codecs.triton_fp8`) as they do on CUDA. A dispatch mode
entered around every call of the hook (which on this path also completes the buckets'
collectives and settles the step, on the same thread) counts, on rank 0, over one ordinary
step (not step 0, which checks consistency): every Triton launch, every torch op that
launches a kernel (neither a view nor a bare allocation; the interpreter's own torch calls
inside a kernel are not counted) and, apart, the collectives (``c10d`` ops); and the lines
of GeoFP8's own Python the hook's calls execute (``py lines``, a trace as
``gpu_bucket.py``'s, the interpreted kernels' bodies left out): the host work of the
real hook per bucket, the stages' and everything around them (the pipeline's bucket
path, the error feedback's residual, the collective's launch and flush, the step's
verdict), counted rather than timed, split into the stages' (lines run under a frame of
:mod:`geofp8.comm.stages` or of a layout's bound stages: ``host_lines.STAGES``) and the hook's
own (everything else). The hook's launches and
lines must not grow with the tensors per bucket: ``--tensors`` varies them with one bucket
per step; ``--buckets`` splits the same layers into several buckets.

Host µs per bucket, modelled: each part's lines at ``host_lines.LINE_US`` (the stages' measured
cost of a line here) plus its launches at ``gpu_bucket.LAUNCH_US`` (the step's verdict
kernel is the hook's); a model of the host thread's time, not a GPU measurement.

A geometry method reaches its ordinary step first: its factors refresh every 3 steps
(the first refresh at step 3, where ``auto`` measures too, deciding at step 4), a profile
scores step 0 alone and keeps ``--mapped`` layers (all by default), and the step counted is
step 5 (no refresh, measurement nor decision), so the layers selected go through their maps
(the ``mapped`` column: layers on a map then).

    python benchmarks/hook_launches.py                       # fp8-ef, 1 bucket of 2 / 8 tensors
    python benchmarks/hook_launches.py --tensors 2 8 32 --buckets 1 4
    python benchmarks/hook_launches.py --methods fp8-ef fp8
    python benchmarks/hook_launches.py --methods geofp8 geofp8-auto --tensors 2 8 --ops
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are decorated (children inherit it)

import argparse  # noqa: E402
import collections  # noqa: E402
import datetime  # noqa: E402
import itertools  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

from fused_launches import Launches  # noqa: E402  (wraps the Triton kernels' launches)
from gpu_bucket import ALLOCATIONS, LAUNCH_US  # noqa: E402
from host_lines import LINE_US, SplitLines, hooked  # noqa: E402
from host_syncs import on_ranks  # noqa: E402

WIDTH = 64  # Linear(WIDTH, WIDTH, bias=False): 16 KiB of FP32 gradient a tensor
COUNTED = 5  # the step counted: ordinary for every method (see the module notes)


class HookLaunches(Launches):
    """:class:`fused_launches.Launches`, the collectives counted apart, every op named, and
    the launches made under a stage (``split``: the :class:`SplitLines` tracing the call)
    counted apart too (``staged``)."""

    def __init__(self) -> None:
        self.split: SplitLines | None = None
        self.staged = self._triton = 0
        super().__init__()
        self.collectives = 0
        self.ops: collections.Counter = collections.Counter()

    @property
    def triton(self) -> int:
        return self._triton

    @triton.setter
    def triton(self, value: int) -> None:  # the wrapped kernels count here (fused_launches)
        self.staged += (value - self._triton) * self._in_stages()
        self._triton = value

    def _in_stages(self) -> bool:
        return self.split is not None and self.split.in_stages

    def __enter__(self):
        Launches.active = self  # where the wrapped Triton kernels count
        return super().__enter__()

    def __exit__(self, *exc):
        Launches.active = None
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.collectives += 1
            return func(*args, **(kwargs or {}))
        if not (self.inside or func.is_view or func in ALLOCATIONS):
            self.ops[str(func)] += 1
            self.staged += self._in_stages()
        return super().__torch_dispatch__(func, types, args, kwargs)


def count(rank: int, world: int, method: str, tensors: int, buckets: int,
          mapped: int | None = None, lines: bool = True) -> tuple:
    """``(buckets, Triton, torch, collectives, ops, layers on a map, the hook's own py
    lines, the stages' py lines, launches under a stage)`` of the hook in one ordinary step
    on this rank (``tensors`` layers in ``buckets`` DDP buckets of equal size; ``lines``:
    trace the py lines (:class:`SplitLines`), else 0 — the trace sees every line the
    interpreter runs, which slows the count several times)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(tensors)])
    state, hook = hooked(model, method, mapped)
    mb = tensors // buckets * WIDTH * WIDTH * 4 / (1 << 20)  # DDP's first bucket: up to 1 MB
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=mb)
    counter: list[HookLaunches | None] = [None]

    def counted(state, bucket):
        c = counter[0]
        if c is None:
            return hook(state, bucket)
        out = []
        with c:
            if lines:
                c.split = SplitLines(paused=lambda: c.inside)
                c.split.run(lambda: out.append(hook(state, bucket)))
                c.lines[0] += c.split.hook
                c.lines[1] += c.split.stages
                c.split = None
            else:
                out.append(hook(state, bucket))
        return out[0]
    ddp.register_comm_hook(state, counted)
    for step in range(COUNTED + 1):
        counter[0] = HookLaunches() if step == COUNTED else None
        if counter[0] is not None:
            counter[0].lines = [0, 0]  # the hook's own, the stages'
        ddp(torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(step + 10 * rank))
            ).pow(2).mean().backward()
        ddp.zero_grad()
    c = counter[0]
    pipeline = getattr(getattr(state, "engine", None), "pipeline", None)
    on_map = len(pipeline.geometry_layers()) if pipeline is not None else 0
    return len(ddp.reducer._get_zeros_like_grad_buckets()), c.triton, c.torch, c.collectives, \
        c.ops, on_map, *c.lines, c.staged


def _worker(rank: int, world: int, port: int, method: str, queue, tensors: int,
            buckets: int, mapped: int | None, lines: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world,
                                         timeout=datetime.timedelta(seconds=300))
    queue.put((rank, *count(rank, world, method, tensors, buckets, mapped, lines)))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def measure(method: str, tensors: int, buckets: int, ranks: int = 2,
            mapped: int | None = None, lines: bool = True) -> tuple:
    """:func:`count` of one ordinary step on rank 0 of ``ranks`` spawned gloo ranks."""
    return on_ranks(_worker, ranks, method, tensors, buckets, mapped, lines)


def modelled_us(ours: int, stages: int, launches: int, staged: int, per: int
                ) -> tuple[float, float]:
    """Modelled host µs of GeoFP8's own work and of the stages', each per one of ``per``
    buckets (or units): their traced lines at ``LINE_US``, their launches (``staged`` of
    the ``launches`` the stages') at ``LAUNCH_US``."""
    return ((ours * LINE_US + (launches - staged) * LAUNCH_US) / per,
            (stages * LINE_US + staged * LAUNCH_US) / per)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["fp8-ef"])
    parser.add_argument("--tensors", nargs="+", type=int, default=[2, 8])
    parser.add_argument("--buckets", nargs="+", type=int, default=[1])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--mapped", type=int, default=None,
                        help="a profile's layers kept on a map (default: all)")
    parser.add_argument("--ops", action="store_true", help="list the torch ops counted")
    args = parser.parse_args()
    print("| method | tensors | mapped | buckets | Triton | torch | launches | per bucket | "
          "collectives | py lines per bucket: hook + stages | host µs per bucket, modelled: "
          "hook + stages |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for method, tensors, buckets in itertools.product(args.methods, args.tensors, args.buckets):
        got, triton, ops, colls, names, on_map, hook, stages, staged = measure(
            method, tensors, buckets, args.ranks, args.mapped)
        launches = triton + ops
        hook_us, stages_us = modelled_us(hook, stages, launches, staged, got)
        print(f"| {method} | {tensors} | {on_map} | {got} | {triton} | {ops} | {launches} | "
              f"{launches / got:.1f} | {colls} | {hook / got:.0f} + {stages / got:.0f} | "
              f"**{hook_us:.0f}** + {stages_us:.0f} = {hook_us + stages_us:.0f} |", flush=True)
        if args.ops:
            print("   ", dict(names.most_common()))


if __name__ == "__main__":
    main()
