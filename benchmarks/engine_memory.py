"""Memory the comm hook needs beyond the EF residuals, against the largest DDP bucket.

Two figures per method, on rank 0 of a real gloo group (32 Linear(256, 256) weights, DDP
buckets of ~1 MB, an ordinary step after a warm-up):

* **transient**: the peak of the bytes allocated and not yet freed during ``backward()``
  (the profiler's CPU allocation records, summed in time order), minus the same peak under
  DDP's own FP32 all-reduce: what the hook allocates on top of what DDP and autograd do;
* **held**: bytes of every tensor the hook's state keeps between steps (layouts, cached
  lengths, factors, selection), found by walking the state object; the EF residuals are
  counted apart, since they are the method's memory by design.

The transient peak holds the step's new EF residuals too: they are staged until the whole
step is known finite and then replace the committed ones (a skipped step leaves no trace),
so during backward an EF method holds two sets. The last ratio takes that staged set
(the size of the committed one) out: what the stages themselves need.

    python benchmarks/engine_memory.py                        # fp8, fp8-ef, nvfp4-ef, geofp8-auto
    python benchmarks/engine_memory.py --methods fp8-ef --ranks 4

Goal (issue 20): transient + held, beyond the EF residuals, <= 2x the largest bucket.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile

from host_syncs import ddp_model, on_ranks  # this folder is on sys.path when run as a script

STEPS = 3  # steps 0 (consistency check) and 1 warm up; step 2 is profiled


def peak_allocated(prof) -> int:
    """Peak of the running sum of the CPU allocations and frees the profiler recorded."""
    records = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events()
                     if e.self_cpu_memory_usage)
    live = peak = 0
    for _, delta in records:
        live += delta
        peak = max(peak, live)
    return peak


def tensors_held(root, skip: set[int]) -> int:
    """Bytes of the distinct storages reachable from ``root`` through attributes, dicts,
    lists and tuples, except the objects whose ``id`` is in ``skip`` (and what they hold)."""
    seen_objects, storages, stack = set(), {}, [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen_objects or id(obj) in skip:
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__") and not isinstance(obj, (type, nn.Module)):
            stack.extend(vars(obj).values())
    return sum(storages.values())


def _step(ddp) -> None:
    ddp(torch.randn(16, 256)).pow(2).mean().backward()
    ddp.zero_grad()


def _worker(rank: int, world: int, port: int, method: str, queue) -> None:
    ddp, state = ddp_model(rank, world, port, method)
    for _ in range(STEPS - 1):
        _step(ddp)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _step(ddp)
    bucket = 4 * max(b.buffer().numel() for b in ddp.reducer._get_zeros_like_grad_buckets())
    engine = getattr(state, "engine", None)
    feedbacks = [] if engine is None else [engine.pipeline.feedback, state.communicator.owner]
    skip = {id(f) for f in feedbacks if f is not None}
    residuals = sum(tensors_held(f, set()) for f in feedbacks if f is not None)
    held = tensors_held(state, skip) if engine is not None else 0
    queue.put((rank, peak_allocated(prof), held, residuals, bucket))
    dist.barrier()
    dist.destroy_process_group()


def measure(method: str, world: int) -> tuple[int, int, int, int]:
    """``(transient peak, held, residuals, largest bucket)`` in bytes, on rank 0."""
    return on_ranks(_worker, world, method)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+",
                        default=["fp8", "fp8-ef", "nvfp4-ef", "geofp8-auto"])
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    args = parser.parse_args()
    print("| method | ranks | largest bucket MB | transient MB | held MB | (transient + held)"
          " / bucket | EF residuals MB | (transient − staged EF + held) / bucket |")
    print("|---|---|---|---|---|---|---|---|")
    for world in args.ranks:
        base = measure("fp32", world)[0]
        for method in args.methods:
            peak, held, residuals, bucket = measure(method, world)
            extra = max(peak - base, 0)
            print(f"| {method} | {world} | {bucket / 2**20:.2f} | {extra / 2**20:.2f} | "
                  f"{held / 2**20:.2f} | {(extra + held) / bucket:.2f} | "
                  f"{residuals / 2**20:.2f} | {(max(extra - residuals, 0) + held) / bucket:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
