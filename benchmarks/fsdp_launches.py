"""Kernel launches and host work of GeoFP8's FSDP2 reduce-scatter per unit, counted without a GPU.

The FSDP counterpart of ``hook_launches.py``: ranks of a real gloo group train ``--layers``
``Linear(64, 64)`` layers, ``fully_shard``-ed ``--per-unit`` layers to a unit (the root
too; it owns no parameter), under :func:`geofp8.fsdp.enable` (``kernels="batched"``) on the
CPU under Triton's interpreter, where the stages take the fused kernels as they do on CUDA.
Counted on rank 0 over one ordinary step (``hook_launches.COUNTED``: after warm-up, no
refresh, measurement nor decision) with ``hook_launches.HookLaunches`` and
``host_lines.SplitLines``, around every call of GeoFP8's own work on the autograd thread:
each unit's (:meth:`GeoFP8FSDP.run_unit`: the reduce-scatter, or HSDP's replica
all-reduce) and the step's settling at the end of backward, divided by the units: Triton
launches, torch ops that launch a kernel, collectives (``c10d`` ops), the lines of
GeoFP8's Python (its own and the stages') and the modelled host µs (the lines at
``host_lines.LINE_US``, the launches at ``gpu_bucket.LAUNCH_US``, as ``hook_launches``).
``--hsdp``: a 2 × 1 mesh as well (``("replicate", "shard")``: FSDP skips the one-rank
reduce-scatter; GeoFP8's replica all-reduce runs each unit's exact all-reduce).

    python benchmarks/fsdp_launches.py                        # fp8-ef, 1 layer a unit
    python benchmarks/fsdp_launches.py --methods fp8-ef nvfp4-ef geofp8-auto geofp8 \\
        --per-unit 1 4 --hsdp --ops
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are decorated (children inherit it)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import itertools  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

from hook_launches import COUNTED, WIDTH, HookLaunches, modelled_us  # noqa: E402
from host_lines import SplitLines  # noqa: E402
from host_syncs import on_ranks  # noqa: E402

MESHES = {"fsdp": None, "hsdp 2×1": (2, 1)}  # (replicate, shard) on 2 ranks


def _model(layers: int, per_unit: int, shard_mesh) -> nn.Module:
    """``layers`` linear layers in blocks of ``per_unit``, each block and the root
    ``fully_shard``-ed on ``shard_mesh`` (``None``: the world)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*[
        nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(per_unit)])
        for _ in range(layers // per_unit)])
    for module in [*model, model]:
        fully_shard(module, mesh=shard_mesh)
    return model


def _config(method: str, layers: int, mapped: int | None):
    """``method``'s config as ``host_lines.hooked`` makes it (refreshes every 3 steps, a
    profile of step 0 keeping ``mapped`` layers, all if None; the batched kernels)."""
    from geofp8.methods import METHODS

    spec = METHODS[method]
    config = spec.config(**spec.takes(refresh_every=3, profile_steps=1, kernels="batched"))
    return dataclasses.replace(config, profile_top=mapped or layers)


def count(rank: int, world: int, method: str, layers: int, per_unit: int, mesh: str,
          mapped: int | None = None, lines: bool = True) -> tuple:
    """``(units, Triton, torch, collectives, ops, layers on a map, GeoFP8's own py lines,
    the stages' py lines, launches under a stage)`` of one ordinary step on this rank, all
    its units' work and its settling together (``lines``: trace the py lines, else 0)."""
    from torch.distributed.device_mesh import init_device_mesh

    from geofp8 import fsdp

    shape = MESHES[mesh]
    device_mesh = shape and init_device_mesh("cpu", shape,
                                             mesh_dim_names=("replicate", "shard"))
    model = _model(layers, per_unit, device_mesh and device_mesh["shard"])
    state = fsdp.enable(model, _config(method, layers, mapped), mesh=device_mesh)
    counter: list[HookLaunches | None] = [None]
    units = [0]

    def counted(work, unit: bool):
        def call(*args):
            c = counter[0]
            if c is None:
                return work(*args)
            units[0] += unit
            with c:
                if not lines:
                    return work(*args)
                c.split = SplitLines(paused=lambda: c.inside)
                c.split.run(lambda: work(*args))
                c.lines[0] += c.split.hook
                c.lines[1] += c.split.stages
                c.split = None
        return call
    state.run_unit = counted(state.run_unit, True)
    state._end_of_backward = counted(state._end_of_backward, False)
    for step in range(COUNTED + 1):
        counter[0] = HookLaunches() if step == COUNTED else None
        if counter[0] is not None:
            counter[0].lines = [0, 0]  # GeoFP8's own, the stages'
        model(torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(step + 10 * rank))
              ).pow(2).mean().backward()
        model.zero_grad(set_to_none=True)
    c = counter[0]
    return units[0], c.triton, c.torch, c.collectives, c.ops, \
        len(state.pipeline.geometry_layers()), *c.lines, c.staged


def _worker(rank: int, world: int, port: int, cases: list[tuple], queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world,
                                         timeout=datetime.timedelta(seconds=300))
    queue.put((rank, [count(rank, world, *case) for case in cases]))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def measure(cases: list[tuple]) -> list[tuple]:
    """:func:`count` of each case, ``(method, layers, per_unit, mesh[, mapped[, lines]])``,
    on rank 0 of 2 spawned gloo ranks (one group for them all)."""
    return on_ranks(_worker, 2, cases)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["fp8-ef"])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--per-unit", nargs="+", type=int, default=[1])
    parser.add_argument("--hsdp", action="store_true", help="a 2 × 1 HSDP mesh as well")
    parser.add_argument("--mapped", type=int, default=None,
                        help="a profile's layers kept on a map (default: all)")
    parser.add_argument("--ops", action="store_true", help="list the torch ops counted")
    args = parser.parse_args()
    print("| mesh | method | layers a unit | units | mapped | Triton | torch | launches per "
          "unit | collectives per unit | py lines per unit: ours + stages | host µs per unit, "
          "modelled: ours + stages |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    cases = [(method, args.layers, per_unit, mesh, args.mapped) for mesh, method, per_unit
             in itertools.product(list(MESHES) if args.hsdp else ["fsdp"], args.methods,
                                  args.per_unit)]
    for method, layers, per_unit, mesh, mapped in cases:  # a group each (on_ranks' timeout)
        units, triton, ops, colls, names, on_map, ours, stages, staged = measure(
            [(method, layers, per_unit, mesh, mapped)])[0]
        launches = triton + ops
        ours_us, stages_us = modelled_us(ours, stages, launches, staged, units)
        print(f"| {mesh} | {method} | {per_unit} | {units} | {on_map} | {triton} | {ops} | "
              f"{launches / units:.1f} | {colls / units:.1f} | {ours / units:.0f} + "
              f"{stages / units:.0f} | **{ours_us:.0f}** + {stages_us:.0f} = "
              f"{ours_us + stages_us:.0f} |", flush=True)
        if args.ops:
            print("   ", dict(names.most_common()))


if __name__ == "__main__":
    main()
