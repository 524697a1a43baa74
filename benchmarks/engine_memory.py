"""Memory the comm hook needs beyond the EF residuals, against the largest DDP bucket.

Figures per method, on rank 0 of a real gloo group (32 Linear(256, 256) weights, 8 MB of
gradients, DDP buckets of ~1 MB or ``--bucket-mb``, an ordinary step after a warm-up):

* **hook peak**: the peak, during ``backward()``, of the bytes of the tensors that GeoFP8's
  own code created and that are still alive (a dispatch mode sees every op; an output in a
  new storage, from an op called under the ``geofp8`` package, is counted until its storage
  is freed or released to zero bytes). Autograd's and DDP's own tensors are not counted;
* **staged EF at peak**: the part of that peak held by the step's new EF residual storages
  (none once they exist: they are written in place, see ``benchmarks/memory.py``);
* **beyond EF**: the peak over the backward of the live bytes less the step's new EF
  residuals alive at that moment, staged or still being computed (the hook peak less the
  staged EF at it is one such moment; the stages' own peak may come at another);
* **held**: bytes of every tensor the hook's state keeps between steps (layouts, cached
  lengths, factors, selection), found by walking the state object; the EF residuals are
  counted apart, since they are the method's memory by design.

The last ratio, (beyond EF + held) / bucket, is what the stages need.

    python benchmarks/engine_memory.py                        # fp8, fp8-ef, nvfp4-ef, geofp8-auto
    python benchmarks/engine_memory.py --methods fp8-ef --ranks 4
    python benchmarks/engine_memory.py --bucket-mb 4          # two buckets of 4 MB

Goal (issue 20): hook peak + held, beyond the EF residuals, <= 2x the largest bucket.
"""

from __future__ import annotations

import argparse
import weakref

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from host_syncs import ddp_model, on_ranks  # this folder is on sys.path when run as a script
from memory import called_from_package, storages_of

STEPS = 3  # steps 0 (consistency check) and 1 warm up; step 2 is measured


class HookAllocations(TorchDispatchMode):
    """Live bytes of the storages that ops called from GeoFP8's code create, after every
    such op; :meth:`peaks` reads them against the storages staged at the end."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[weakref.ref, int]] = {}  # data pointer -> storage, serial
        self.serial = 0
        self.samples: list[tuple[int, dict]] = []  # (live bytes, {(pointer, serial): bytes})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not called_from_package():
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
            self.serial += 1
            self.live[key] = (weakref.ref(storage), self.serial)
        sizes = self._live_sizes()
        self.samples.append((sum(sizes.values()), sizes))
        return out

    def _live_sizes(self) -> dict[tuple[int, int], int]:
        """Bytes of each tracked storage still alive and not released (forgetting the rest,
        so that a new storage at a freed address is counted afresh)."""
        sizes = {}
        for key, (ref, serial) in list(self.live.items()):
            storage = ref()
            if storage is None or storage.nbytes() == 0:
                del self.live[key]
            else:
                sizes[key, serial] = storage.nbytes()
        return sizes

    def peaks(self, staged_pointers: set[int]) -> tuple[int, int, int]:
        """``(peak, staged at peak, beyond)``: the peak of the live bytes, the bytes at that
        peak of the step's new residuals (``staged_pointers``: their data pointers; they
        live from their creation to the end), and the peak of the live bytes less theirs."""
        staged_ids = {(p, self.live[p][1]) for p in staged_pointers if p in self.live}
        peak = staged = beyond = 0
        for current, sizes in self.samples:
            mine = sum(n for k, n in sizes.items() if k in staged_ids)
            beyond = max(beyond, current - mine)
            if current > peak:
                peak, staged = current, mine
        return peak, staged, beyond


def _new_residuals(feedbacks) -> set[int]:
    """Data pointers of the residuals held after the step: the ones created during the
    measured backward are the step's new storages (a residual is written in place once it
    exists, so after the first steps there are none)."""
    return {t.untyped_storage().data_ptr()
            for t in pytree.tree_leaves([f.residuals for f in feedbacks])
            if isinstance(t, torch.Tensor)}


def tensors_held(root, skip: set[int]) -> int:
    """Bytes of the distinct storages reachable from ``root`` (see
    :func:`memory.storages_of`), except through the objects whose ``id`` is in ``skip``."""
    return sum(storages_of(root, skip).values())


def _worker(rank: int, world: int, port: int, method: str, queue, bucket_mb: float) -> None:
    ddp, state = ddp_model(rank, world, port, method, bucket_mb)
    for _ in range(STEPS - 1):
        ddp(torch.randn(16, 256)).pow(2).mean().backward()
        ddp.zero_grad()
    engine = getattr(state, "engine", None)
    feedbacks = [] if engine is None else [engine.pipeline.feedback, state.communicator.owner]
    feedbacks = [f for f in feedbacks if f is not None]
    loss = ddp(torch.randn(16, 256)).pow(2).mean()
    with HookAllocations() as mode:
        loss.backward()
    peak, staged, beyond = mode.peaks(_new_residuals(feedbacks))
    bucket = 4 * max(b.buffer().numel() for b in ddp.reducer._get_zeros_like_grad_buckets())
    residuals = sum(tensors_held(f, set()) for f in feedbacks)
    held = tensors_held(state, {id(f) for f in feedbacks}) if engine is not None else 0
    queue.put((rank, peak, staged, beyond, held, residuals, bucket))
    dist.barrier()
    dist.destroy_process_group()


def measure(method: str, world: int,
            bucket_mb: float = 1.0) -> tuple[int, int, int, int, int, int]:
    """``(hook peak, staged EF at peak, beyond EF, held, residuals, largest bucket)`` in
    bytes, on rank 0."""
    return on_ranks(_worker, world, method, bucket_mb)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+",
                        default=["fp8", "fp8-ef", "nvfp4-ef", "geofp8-auto"])
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--bucket-mb", type=float, default=1.0, help="DDP's bucket_cap_mb")
    args = parser.parse_args()
    print("| method | ranks | largest bucket MB | hook peak MB | staged EF at peak MB |"
          " beyond EF MB | held MB | EF residuals MB | (beyond EF + held) / bucket |")
    print("|---|---|---|---|---|---|---|---|---|")
    mb = 2**20
    for world in args.ranks:
        for method in args.methods:
            peak, staged, beyond, held, residuals, bucket = measure(method, world,
                                                                    args.bucket_mb)
            print(f"| {method} | {world} | {bucket / mb:.2f} | {peak / mb:.2f} | "
                  f"{staged / mb:.2f} | {beyond / mb:.2f} | {held / mb:.2f} | "
                  f"{residuals / mb:.2f} | {(beyond + held) / bucket:.2f} |", flush=True)


if __name__ == "__main__":
    main()
