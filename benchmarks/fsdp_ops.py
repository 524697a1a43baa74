"""Aten ops, elements written and peak bytes of GeoFP8's FSDP2 reduce-scatter, per unit.

One backward of a Llama preset (every decoder layer and the root ``fully_shard``-ed, two
warm-up steps first) on rank 0 of a real gloo group, under a dispatch mode that follows the
ops that GeoFP8's code calls (at any depth; the end-of-backward settle included):

* **ops / unit**: those ops per ``fully_shard`` unit (views included);
* **written / elem**: the elements their outputs hold (in place too; views not), per
  element of the units' unsharded gradients (the passes that write, roughly);
* **peak / param**: the most bytes of the storages GeoFP8's code created (not those it
  wrote into, nor the reduce-scatter input it allocates for FSDP) that were alive at once
  during the backward, per model parameter (FP32 weights are 4).

The native C kernels of the chunked codec run outside the dispatcher (not counted here);
what this measures is the adapter's own work around them.

    python benchmarks/fsdp_ops.py --sender-feedback on    # fp8-ef, nvfp4-ef; llama-small
    PYTHONPATH=<other checkout>/src python benchmarks/fsdp_ops.py   # another version
"""

from __future__ import annotations

import argparse
import datetime
import os
import weakref
from collections import Counter

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from host_syncs import LLAMA, on_ranks  # this folder is on sys.path when run as a script
from memory import VOCAB, called_from_package, package_function

# the reduce-scatter's input, which FSDP asks the custom reduce-scatter to allocate (its own
# default allocates the same): FSDP's buffer, not GeoFP8's
FSDP_BUFFER = "fsdp.allocate"

SEQ, BATCH = 64, 4


class OursOps(TorchDispatchMode):
    """Counts GeoFP8's ops and the elements of their new outputs; the peak of their live
    storages' bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.ops, self.written = Counter(), 0
        self.live: dict[int, weakref.ref] = {}  # data pointer -> storage
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not called_from_package():
            return out
        self.ops[func.__name__] += 1
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not func.is_view:
                self.written += t.numel()  # in place too
                key = t.untyped_storage().data_ptr()
                if key not in inputs and package_function() != FSDP_BUFFER:
                    self.live[key] = weakref.ref(t.untyped_storage())
        sizes = {k: s.nbytes() for k, ref in self.live.items() if (s := ref()) is not None}
        self.live = {k: self.live[k] for k, n in sizes.items() if n}
        self.peak = max(self.peak, sum(sizes.values()))
        return out


def _worker(rank, world, port, method, queue, residual, sender) -> None:
    from torch.distributed.fsdp import fully_shard

    from geofp8 import fsdp
    from geofp8.methods import METHODS
    from geofp8.tools.models import build_preset

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    model = build_preset("llama-small", VOCAB, seed=0)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    spec = METHODS[method]
    settings = {} if residual is None else {"residual": residual}
    state = fsdp.enable(model, spec.config(**spec.takes(**settings)), **sender)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(rank)
    mode = OursOps()
    for step in range(3):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        if step == 2:
            with mode:
                loss.backward()
        else:
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    units = len(state.units)
    elements = sum(torch.Size(s).numel() for u in state.units for s in u.shapes)
    params = sum(p.numel() for p in model.parameters())
    queue.put((rank, units, sum(mode.ops.values()) / units, mode.written / elements,
               mode.peak / params, mode.ops.most_common(8)))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["fp8-ef", "nvfp4-ef"])
    parser.add_argument("--residual", default=None, help="residual storage (default: the "
                        "method's)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--sender-feedback", choices=["default", "on", "off"],
                        default="default", help="fsdp.enable's sender_feedback (on, off; "
                        "default: leave it out, e.g. for a version without it)")
    args = parser.parse_args()
    print(f"sender_feedback: {args.sender_feedback}")
    print("| method | ranks | units | ops / unit | written / elem | peak / param | "
          "most frequent ops |")
    print("|---|---|---|---|---|---|---|")
    for method in args.methods:
        sender = {} if args.sender_feedback == "default" else {
            "sender_feedback": args.sender_feedback == "on"}
        units, ops, written, peak, common = on_ranks(_worker, args.ranks, method,
                                                     args.residual, sender, preload=LLAMA)
        top = ", ".join(f"{name} {count / units:.1f}" for name, count in common)
        print(f"| {method} | {args.ranks} | {units} | {ops:.1f} | {written:.2f} | "
              f"{peak:.2f} | {top} |", flush=True)


if __name__ == "__main__":
    main()
