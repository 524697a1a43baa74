"""Memory the comm hook needs beyond the EF residuals, against the largest DDP bucket.

Figures per method, on rank 0 of a real gloo group (32 Linear(256, 256) weights, 8 MB of
gradients, DDP buckets of ~1 MB or ``--bucket-mb``, an ordinary step after a warm-up):

* **hook peak**: the peak, during ``backward()``, of the bytes of the tensors that GeoFP8's
  own code created and that are still alive (a dispatch mode sees every op; an output in a
  new storage, from an op called under the ``geofp8`` package, is counted until its storage
  is freed or released to zero bytes). Autograd's and DDP's own tensors are not counted;
* **staged EF at peak**: the part of that peak held by the step's new EF residuals. They are
  staged until the whole step is known finite and then replace the committed ones (a
  skipped step leaves no trace), so during backward an EF method holds two sets;
* **held**: bytes of every tensor the hook's state keeps between steps (layouts, cached
  lengths, factors, selection), found by walking the state object; the EF residuals are
  counted apart, since they are the method's memory by design.

The last ratio, (hook peak − staged EF + held) / bucket, is what the stages need.

    python benchmarks/engine_memory.py                        # fp8, fp8-ef, nvfp4-ef, geofp8-auto
    python benchmarks/engine_memory.py --methods fp8-ef --ranks 4
    python benchmarks/engine_memory.py --bucket-mb 4          # two buckets of 4 MB

Goal (issue 20): hook peak + held, beyond the EF residuals, <= 2x the largest bucket.
"""

from __future__ import annotations

import argparse
import os
import sys
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import geofp8
from host_syncs import ddp_model, on_ranks  # this folder is on sys.path when run as a script

STEPS = 3  # steps 0 (consistency check) and 1 warm up; step 2 is measured
PACKAGE = os.path.dirname(geofp8.__file__) + os.sep


class HookAllocations(TorchDispatchMode):
    """Live bytes of the storages that ops called from GeoFP8's code create: ``peak``, and
    ``staged`` (the bytes at that peak that ``staged_storages()`` names)."""

    def __init__(self, staged_storages) -> None:
        super().__init__()
        self.staged_storages = staged_storages
        self.live: dict[int, weakref.ref] = {}  # data pointer -> storage
        self.peak = self.staged = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not _called_from_package():
            return out
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in inputs or key in self.live or storage.nbytes() == 0:
                continue
            self.live[key] = weakref.ref(storage)
        sizes = self._live_sizes()
        current = sum(sizes.values())
        if current > self.peak:
            self.peak = current
            self.staged = sum(sizes.get(k, 0) for k in self.staged_storages())
        return out

    def _live_sizes(self) -> dict[int, int]:
        """Bytes of each tracked storage still alive and not released (forgetting the rest,
        so that a new storage at a freed address is counted afresh)."""
        sizes = {}
        for key, ref in list(self.live.items()):
            storage = ref()
            if storage is None or storage.nbytes() == 0:
                del self.live[key]
            else:
                sizes[key] = storage.nbytes()
        return sizes


def _called_from_package() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(PACKAGE):
            return True
        frame = frame.f_back
    return False


def _staged_storages(feedbacks):
    def storages() -> set[int]:
        return {t.untyped_storage().data_ptr() for f in feedbacks
                for t in pytree.tree_leaves(list(f._staged.values()))
                if isinstance(t, torch.Tensor)}
    return storages


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


def _worker(rank: int, world: int, port: int, method: str, queue, bucket_mb: float) -> None:
    ddp, state = ddp_model(rank, world, port, method, bucket_mb)
    for _ in range(STEPS - 1):
        ddp(torch.randn(16, 256)).pow(2).mean().backward()
        ddp.zero_grad()
    engine = getattr(state, "engine", None)
    feedbacks = [] if engine is None else [engine.pipeline.feedback, state.communicator.owner]
    feedbacks = [f for f in feedbacks if f is not None]
    loss = ddp(torch.randn(16, 256)).pow(2).mean()
    with HookAllocations(_staged_storages(feedbacks)) as mode:
        loss.backward()
    bucket = 4 * max(b.buffer().numel() for b in ddp.reducer._get_zeros_like_grad_buckets())
    residuals = sum(tensors_held(f, set()) for f in feedbacks)
    held = tensors_held(state, {id(f) for f in feedbacks}) if engine is not None else 0
    queue.put((rank, mode.peak, mode.staged, held, residuals, bucket))
    dist.barrier()
    dist.destroy_process_group()


def measure(method: str, world: int, bucket_mb: float = 1.0) -> tuple[int, int, int, int, int]:
    """``(hook peak, staged EF at peak, held, residuals, largest bucket)`` in bytes, on
    rank 0."""
    return on_ranks(_worker, world, method, bucket_mb)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+",
                        default=["fp8", "fp8-ef", "nvfp4-ef", "geofp8-auto"])
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--bucket-mb", type=float, default=1.0, help="DDP's bucket_cap_mb")
    args = parser.parse_args()
    print("| method | ranks | largest bucket MB | hook peak MB | staged EF at peak MB | held MB"
          " | EF residuals MB | (hook peak − staged EF + held) / bucket |")
    print("|---|---|---|---|---|---|---|---|")
    mb = 2**20
    for world in args.ranks:
        for method in args.methods:
            peak, staged, held, residuals, bucket = measure(method, world, args.bucket_mb)
            print(f"| {method} | {world} | {bucket / mb:.2f} | {peak / mb:.2f} | "
                  f"{staged / mb:.2f} | {held / mb:.2f} | {residuals / mb:.2f} | "
                  f"{(peak - staged + held) / bucket:.2f} |", flush=True)


if __name__ == "__main__":
    main()
