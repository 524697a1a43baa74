"""GeoFP8's FSDP2 reduce-scatter and HSDP's replica all-reduce on the fused stages: their
launches, a fixed number of torch ops a unit and a step, and GeoFP8's own lines a unit,
whatever the parameters in a unit; and the fused path's parameters bit for bit the torch
path's, a non-finite step included.

``benchmarks/fsdp_launches.py`` counts them on 2 gloo ranks under Triton's interpreter (the
fused stages taken as on CUDA); the interpreter must be on before the kernels are decorated,
so the counts run in a child process (``tests/interpreted.Child``, on the background lane).
Deterministic: the same model and step every run."""

import json
import os

import pytest

from interpreted import Child

BENCHMARKS = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
TESTS = os.path.dirname(os.path.abspath(__file__))
# Triton kernels a unit: the reduce-scatter's fused stages (comm.plan, comm.block_plan: the
# send's two, the owner's decode-and-sum one, which divides into FSDP's output and writes
# the unit's finite flag); HSDP's replica all-reduce, the exact collective's five
# (comm.collective: the gathered decode divides and writes the flag); a step: the agreed
# flags' verdict, skipped counter and poison factors (triton_fp8.agreed)
SCATTER, REPLICA, STEP = 3, 5, 1
# and a unit with parameters on low-rank maps, whatever their number: its maps, one grouped
# launch each way (fsdp_maps.UnitMaps, the map back ANDing the unit's flag; before: 8 torch
# ops a mapped parameter, a padded temporary in and out and two GEMMs each way); a step,
# the statistics' commit
MAPS, STATISTICS = 2, 1
# torch ops a unit: the unit's gradient shards times 1 or NaN (one foreach op). Before (the
# torch path's stages, a flag byte per shard, an all_finite pass over the input and a where
# per unit): 100 in a step of 4 units (fp8-ef), 30 in one of 1 (nvfp4-ef), 42 (HSDP,
# nvfp4-ef, 1 unit); then (s9) 7: the division into FSDP's output and the output's
# all_finite (aminmax and four scalar ops) besides
PER_UNIT = 1
# torch ops a step: its settling (the FP32 "my flag is down" the ranks agree on); before
# (s9): 12 (the flags stacked, the agreement's conversions, the verdict, the counter, the
# poison factors)
PER_STEP = 1
# GeoFP8's own lines of an ordinary step, its settling included (host_lines.SplitLines, the
# stages' apart), 4 layers, 1 / 4 a unit; before (f0fa687): 748 / 328 (FSDP), 406 (HSDP
# 2 × 1, 4 a unit); with the fused stages, a unit of plain parameters without per-parameter
# Python and HSDP's replica residuals one vector a unit (s9F) 597 / 213 and 307; the
# poison's gradient shards and the replica residuals without Python per parameter (s10F1)
# 588 / 207 and 223; with a communicator per divisor (no divide argument a launch) 572 / 200
# and 219 ("mapped": geofp8, the 4 layers on maps in one unit, its map back on the fused
# end: 241, of which the maps' two grouped calls about 30; the benchmark's 8 layers, 4 a
# unit, before: 400 a unit)
LINES = {("fsdp", 1): 572, ("fsdp", 4): 200, ("hsdp 2×1", 4): 219, ("mapped", 4): 241}
CASES = [("fp8-ef", 4, 1, "fsdp"), ("nvfp4-ef", 4, 4, "fsdp"), ("nvfp4-ef", 4, 4, "hsdp 2×1"),
         ("geofp8", 4, 4, "fsdp")]
MEASURE = Child(["-c", "import json, fsdp_launches as f\n"
                 f"print(json.dumps([r[:4] + r[5:8] for r in f.measure({CASES!r})]))"],
                cwd=BENCHMARKS, path=(BENCHMARKS,))


def _bits_child(interpret: bool) -> Child:
    """A child printing ``run_ranks(_bits_worker, 2)``'s results: the fused path
    (``interpret``) or the torch batched path."""
    code = ("import json, test_fsdp_launches as t\nfrom distributed import run_ranks\n"
            "print(json.dumps(run_ranks(t._bits_worker, 2, timeout=300)))")
    return Child(["-c", code], cwd=TESTS, path=(TESTS,), interpret=interpret)


BITS = (_bits_child(True), _bits_child(False))


@pytest.mark.child(MEASURE)
def test_a_unit_launches_the_fused_stages_and_a_fixed_number_of_torch_ops():
    for (method, _, per_unit, mesh), (units, triton, ops, colls, mapped, lines, _) in zip(
            CASES, json.loads(MEASURE.lines()[-1])):
        assert units == 4 // per_unit, (method, mesh)
        assert mapped == (4 if method == "geofp8" else 0), method  # every layer on a map
        # exact: nothing per parameter (a unit of 4 would add 4 an op per parameter)
        stages = SCATTER if mesh == "fsdp" else REPLICA
        if mapped:
            stages += MAPS
        assert (triton, ops) == (stages * units + STEP + STATISTICS * bool(mapped),
                                 PER_UNIT * units + PER_STEP), (method, mesh)
        # the all-to-all (HSDP: and the all-gather), the step's agreement
        assert colls == (1 if mesh == "fsdp" else 2) * units + 1, (method, mesh)
        assert lines <= LINES["mapped" if mapped else mesh, per_unit], (method, mesh, lines)


def _bits_worker(rank, world_size, steps=3, bad=1):
    """FSDP (fp8-ef, with sender residuals in BF16: per parameter), HSDP 2 × 1 (nvfp4-ef:
    the replica residuals one flat vector) and FSDP geofp8 (both weights on maps from the
    refresh at step 2, the second's 33 rows padded to 34) with ``kernels="batched"``; at step
    ``bad`` an infinite input on rank 1. The parameters' bits, what each step's gradients
    were, the last step's gradients and the grouped map kernel's launches (geofp8)."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from geofp8 import GeoFP8Config, fsdp
    from geofp8.codecs import triton_map
    from geofp8.methods import METHODS

    out, run, calls = {}, triton_map._map_kernel.run, []

    def counted(*args, **kwargs):
        calls.append(bool(kwargs["INVERSE"]))
        return run(*args, **kwargs)
    triton_map._map_kernel.run = counted
    for name, config, shape, extra in (
            ("fsdp", METHODS["fp8-ef"].config(kernels="batched"), None,
             {"sender_feedback": True, "residual": "bf16"}),
            ("hsdp", METHODS["nvfp4-ef"].config(kernels="batched"), (2, 1), {}),
            ("geofp8", GeoFP8Config(layers="all", refresh_every=2, k=4, kernels="batched"), None,
             {})):
        mesh = shape and init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 33))
        for module in (net[0], net[2], net):
            fully_shard(module, mesh=mesh and mesh["shard"])
        state = fsdp.enable(net, config, mesh=mesh, **extra)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        finite = []
        for step in range(steps):
            x = torch.randn(6, 48, generator=torch.Generator().manual_seed(step + 10 * rank))
            if step == bad and rank == 1:
                x[0, 0] = float("inf")
            net(x).pow(2).sum().backward()
            finite.append([bool(p.grad.to_local().isfinite().all()) for p in net.parameters()])
            if all(finite[-1]):  # (as GradScaler: a step found non-finite is skipped)
                opt.step()
            grads = torch.cat([p.grad.to_local().reshape(-1) for p in net.parameters()])
            opt.zero_grad(set_to_none=True)
        params = torch.cat([p.to_local().detach().reshape(-1) for p in net.parameters()])
        out[name] = {"finite": finite, "skipped": state.stats()["skipped_steps"],
                     "params": params.view(torch.int32).tolist()}
        if name == "geofp8":
            out[name].update(mapped=state.pipeline.geometry_layers(), calls=calls,
                             grads=grads.tolist())
    return out


@pytest.mark.child(BITS[0])
@pytest.mark.child(BITS[1])
def test_the_fused_path_gives_the_torch_paths_parameters_bit_for_bit():
    """The FSDP and HSDP units on the fused kernels (interpreted) against the torch batched
    path of the same runs; the infinite input on one rank reaches every rank's verdict."""
    fused, torch_path = (json.loads(child.lines()[-1]) for child in BITS)
    for out, ref in zip(fused, torch_path):
        for name in ("fsdp", "hsdp"):
            assert out[name]["finite"] == [[True] * 4, [False] * 4, [True] * 4]
            assert out[name]["skipped"] == 1
            assert out[name] == ref[name], name  # the torch path's, bit for bit
    assert fused[0]["hsdp"]["params"] == fused[1]["hsdp"]["params"]  # two replicas


@pytest.mark.child(BITS[0])
@pytest.mark.child(BITS[1])
def test_a_units_grouped_maps_give_the_torch_paths_gradients_within_round_off():
    """FSDP geofp8, both weights on maps at step 2: on the fused path each unit's maps in
    one launch each way (:mod:`geofp8.fsdp_maps`), on the torch path map by map; the same
    verdicts, and the mapped step's gradients the same but for FP32 round-off in the maps
    (measured: 9e-8 relative; a map left out or misplaced: past 1e-1; an FP8 code that the
    round-off moves to its neighbour: about 2e-3 each)."""
    import torch

    fused, torch_path = (json.loads(child.lines()[-1]) for child in BITS)
    for out, ref in zip(fused, torch_path):
        out, ref = out["geofp8"], ref["geofp8"]
        assert out["finite"] == ref["finite"] == [[True] * 4, [False] * 4, [True] * 4]
        assert out["skipped"] == ref["skipped"] == 1
        assert out["mapped"] == ref["mapped"] == ["0.weight", "2.weight"]
        # step 2's 2 units, forward then back each; none on the torch path
        assert (out["calls"], ref["calls"]) == ([False, True] * 2, [])
        grads, want = (torch.tensor(x["grads"]) for x in (out, ref))
        assert float((grads - want).norm() / want.norm()) <= 1e-2
