"""The real DDP hook's kernel launches: five per bucket and none per step for its verdict (the
last bucket's decode or grouped map back makes it), whatever the tensors in a bucket.

``benchmarks/hook_launches.py`` counts them on gloo ranks under Triton's interpreter (the
fused FP8 stages taken as on CUDA); the interpreter must be on before the kernels are
decorated, so the count runs in a child process. Counts are deterministic. Each test's
children are declared below (``tests/interpreted.Child``) and run on the background lane."""

import json
import os
from unittest import mock

import pytest

from interpreted import Child

BENCHMARKS = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
TESTS = os.path.dirname(os.path.abspath(__file__))
# Triton kernels of a bucket's four stages (comm.plan, comm.block_plan): two each, the
# gathered decode one (it decides its finite flag: codecs.triton_fp8's ticket)
FUSED_STAGES = 5
# the step's K-FAC statistics committed where finite: one kernel, a program per moment
# (codecs.triton_stats), every moment at once; 18 torch ops before it, 2 kernels before that
STATISTICS = 1
# the step's verdict from its buckets' flags (geofp8.verdict.StepVerdict): no kernel of its
# own, the last bucket's decode makes it (geofp8.verdict.decode_into), or with layers on a
# map its grouped map back's kernel (verdict.map_into)
DECIDED = 0


# what the measuring child counts, per method: (tensors, buckets[, ranks, mapped]) a case, and
# the figures kept of hook_launches.measure's (buckets, triton launches, torch ops, …)
CASES = {"fp8-ef": ([(8, 1), (8, 4)], 4), "nvfp4-ef": ([(8, 1), (8, 4)], 4),
         "geofp8": ([(2, 1), (8, 1), (8, 4, 2, 2)], 6), "geofp8-auto": ([(2, 1), (8, 1)], 6)}
# one child for every case: its rank server (started first, as host_syncs.on_ranks lets a
# started server be) has imported hook_launches, Triton and GeoFP8 once, not each rank
MEASURE = Child(["-c", "import json, multiprocessing, hook_launches as h\n"
                 "from multiprocessing import forkserver\n"
                 "from host_syncs import PRELOAD\n"
                 "multiprocessing.get_context('forkserver').set_forkserver_preload("
                 "[*PRELOAD, 'hook_launches'])\n"
                 "forkserver.ensure_running()\n"
                 f"print(json.dumps({{m: [h.measure(m, *case, lines=False)[:n] for case in cases]"
                 f" for m, (cases, n) in {CASES!r}.items()}}))"],
                cwd=BENCHMARKS, path=(BENCHMARKS,))
# the skip workers below, all run by the same 2 ranks one after another, each from its seed
# and with its patches undone after it (_skip_workers)
SKIP_WORKERS = ("_skip_worker", "_map_overflow_worker", "_map_overflow_buckets_worker",
                "_auto_skip_first_worker", "_auto_skip_last_worker")
# (fused, torch path) runs of them: the fused path under the interpreter, the torch batched
# path without it
SKIP = tuple(Child(["-c", "import json, test_hook_launches as t\n"
                    "from distributed import run_ranks\n"
                    "print(json.dumps(run_ranks(t._skip_workers, 2, timeout=540)))"],
                   cwd=TESTS, path=(TESTS,), interpret=interpret) for interpret in (True, False))


def _measured(method: str) -> list:
    return json.loads(MEASURE.lines()[-1])[method]


def _skip_workers(rank, world_size) -> dict:
    """Each of :data:`SKIP_WORKERS`' results on this rank, by name; the patches a worker
    started (``mock.patch.object(…).start()``) are stopped after it."""
    results = {}
    for name in SKIP_WORKERS:
        try:
            results[name] = globals()[name](rank, world_size)
        finally:
            mock.patch.stopall()
    return results


def _skipped(worker: str) -> tuple[list, list]:
    """``worker``'s results on each rank: on the fused path, on the torch path."""
    return tuple([ranks[worker] for ranks in json.loads(child.lines()[-1])] for child in SKIP)


@pytest.mark.child(MEASURE)
@pytest.mark.parametrize("method", ["fp8-ef", "nvfp4-ef"])
def test_the_hook_launches_five_kernels_per_bucket_and_none_per_step(method):
    """E4M3 (comm.plan.FusedPlan) and NVFP4 (comm.block_plan) with error feedback."""
    (b8, tri8, ops8, _), (b4, tri4, ops4, _) = _measured(method)
    assert (b8, b4) == (1, 4)
    # the fused stages, the error feedback folded into them (no where, add_ nor copy_), and
    # the step's verdict and skipped-step counter in the last bucket's decode: nothing per
    # tensor, no torch op at all (exact counts: an op per tensor would add 8, one per
    # bucket 1 or 4, the verdict kernel 1)
    assert (tri8, ops8) == (FUSED_STAGES + DECIDED, 0), (tri8, ops8)
    assert (tri4, ops4) == (4 * FUSED_STAGES + DECIDED, 0), (tri4, ops4)


def _skip_worker(rank, world_size, steps=5, bad=2):
    """fp8-ef's real hook on the fused path (interpreted), 2 buckets a step; at step ``bad``
    rank 1's first layer's gradient is NaN."""
    import torch
    from torch import nn

    from geofp8.methods import METHODS

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32, bias=False) for _ in range(4)])
    state, hook, _ = METHODS["fp8-ef"].build(model, kernels="batched")  # the fused path
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=2 * 32 * 32 * 4 / (1 << 20))
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kernel, saw_bad, kept = _kernel_verdicts(state), [], []
    for step in range(steps):
        handle = model[0].weight.register_hook(lambda g: g * float("nan")) \
            if step == bad and rank == 1 else None
        saw_bad.append(_sgd_step(ddp, model, opt, step, rank))
        if handle is not None:
            handle.remove()
        kept.append(sorted({bool(f) for f in state.pipeline.feedback.finite.values()}))
    stats = state.stats()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"saw_bad": saw_bad, "kernel": kernel, "skipped": stats["skipped_steps"],
            "step": stats["step"], "buckets": len(ddp.reducer._get_zeros_like_grad_buckets()),
            "params": params.view(torch.int32).tolist(), "kept": kept}


def _kernel_verdicts(state) -> list[str]:
    """Per settled step of ``state``, what settled it: ``"decode"`` (the last bucket's fused
    decode made the verdict), ``"kernel"`` (the one verdict kernel) or ``"torch"`` ops."""
    from geofp8.codecs import triton_fp8

    kernel, settle, verdict, launched = [], state.engine.verdict.settle, triton_fp8.verdict, []
    mock.patch.object(triton_fp8, "verdict",
                      lambda *a: launched.append(1) or verdict(*a)).start()

    def settling(*args, **kwargs):
        launched.clear()
        out = settle(*args, **kwargs)
        kernel.append("torch" if out[2] is None else "kernel" if launched else "decode")
        return out
    state.engine.verdict.settle = settling
    return kernel


def _sgd_step(ddp, model, opt, step, rank) -> bool:
    """One step of the skip workers' data; whether the gradient DDP gave was not finite
    (then no optimizer step, as GradScaler does)."""
    import torch

    opt.zero_grad()
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step + 10 * rank))
    ddp(x).pow(2).mean().backward()
    finite = all(bool(p.grad.isfinite().all()) for p in model.parameters())
    if finite:
        opt.step()
    return not finite


@pytest.mark.child(SKIP[0])
@pytest.mark.child(SKIP[1])
def test_a_nan_bucket_skips_the_step_on_every_rank_through_the_decodes_verdict():
    """The fused path (interpreted: EF in the kernels, the verdict in the last decode) against the
    torch batched path of the same run, bit for bit, a NaN step included."""
    fused, torch_path = _skipped("_skip_worker")
    for out, ref in zip(fused, torch_path):
        assert out["buckets"] == 2
        assert out["saw_bad"] == [False, False, True, False, False]  # every rank, that step
        assert (out["step"], out["skipped"]) == (4, 1)
        # step 0 sizes the slots; from then on the last bucket's decode makes the verdict
        # and counts the skipped step, the NaN step too (no verdict kernel)
        assert out["kernel"] == ["torch"] + ["decode"] * 4
        assert ref["kernel"] == ["torch"] * 5  # no Triton here: torch ops settle
        # the skipped step's residuals read as zero, the others' are kept
        assert out["kept"] == [[True], [True], [False], [True], [True]]
        for key in ("saw_bad", "step", "skipped", "kept", "params"):
            assert out[key] == ref[key], key  # the torch path's, bit for bit
    assert fused[0]["params"] == fused[1]["params"]  # bit-identical parameters on both ranks


def _auto_skip_worker(rank, layer, steps=5, bad=2):
    """geofp8-auto's real hook on the fused path (interpreted), no layer on a map, 2 buckets
    a step (layers 3, 2 in the first, 1, 0 in the last); at step ``bad`` rank 1's
    ``layer``'s gradient is NaN. Its statistics' window and dropped counts are returned."""
    import torch
    from torch import nn

    from geofp8.methods import METHODS

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32, bias=False) for _ in range(4)])
    state, hook, _ = METHODS["geofp8-auto"].build(model, kernels="batched")
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=2 * 32 * 32 * 4 / (1 << 20))
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kernel, saw_bad, windows = _kernel_verdicts(state), [], []
    for step in range(steps):
        handle = model[layer].weight.register_hook(lambda g: g * float("nan")) \
            if step == bad and rank == 1 else None
        saw_bad.append(_sgd_step(ddp, model, opt, step, rank))
        if handle is not None:
            handle.remove()
        windows.append([w.flat.view(torch.int32).tolist()
                        for _, _, w, _ in state.pipeline.source._joined])
    stats = state.stats()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"saw_bad": saw_bad, "kernel": kernel, "skipped": stats["skipped_steps"],
            "step": stats["step"], "buckets": len(ddp.reducer._get_zeros_like_grad_buckets()),
            "mapped": stats["geometry_layers"], "windows": windows,
            "dropped": [d.tolist() for _, _, _, d in state.pipeline.source._joined],
            "params": params.view(torch.int32).tolist()}


def _auto_skip_first_worker(rank, world_size):
    return _auto_skip_worker(rank, 3)


def _auto_skip_last_worker(rank, world_size):
    return _auto_skip_worker(rank, 0)


@pytest.mark.child(SKIP[0])
@pytest.mark.child(SKIP[1])
@pytest.mark.parametrize("worker", ["_auto_skip_first_worker", "_auto_skip_last_worker"])
def test_a_factor_source_without_maps_settles_through_the_decodes_verdict(worker):
    """geofp8-auto with no layer on a map: the last bucket's decode decides the step (no
    verdict kernel), a NaN in the first bucket or in the last one (the deciding decode's
    own) included, and the statistics' commit takes that verdict: the skipped step's
    statistics are dropped, the others join the window, as on the torch path, bit for bit."""
    fused, torch_path = _skipped(worker)
    for out, ref in zip(fused, torch_path):
        assert out["buckets"] == 2 and out["mapped"] == []
        assert out["saw_bad"] == [False, False, True, False, False]  # every rank, that step
        assert (out["step"], out["skipped"]) == (4, 1)
        assert out["kernel"] == ["torch"] + ["decode"] * 4
        assert ref["kernel"] == ["torch"] * 5
        assert out["windows"][1] != out["windows"][0] and out["windows"][2] == out["windows"][1]
        for key in ("saw_bad", "step", "skipped", "windows", "dropped", "params"):
            assert out[key] == ref[key], key  # the torch path's, bit for bit
    assert fused[0]["params"] == fused[1]["params"]  # (the windows are each rank's own)


def _map_overflow_worker(rank, world_size, steps=5, bad=(3,), buckets=1):
    """geofp8 with every layer on its map (refreshed every 2 steps) on the fused path,
    ``buckets`` buckets a step; at step ``bad[i]`` the map back of bucket ``i`` (in the
    order they complete: the last one is the step's last) overflows on every rank (as a
    real one would: the same sum and maps everywhere) while the collective's sum is finite."""
    import torch
    from torch import nn

    from geofp8 import GeoFP8Config, GeoFP8State, geofp8_hook
    from geofp8.codecs import triton_map
    from geofp8.geometry.transforms import LowRankInput

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32, bias=False) for _ in range(4)])
    state = GeoFP8State(model, GeoFP8Config(layers="all", refresh_every=2, k=4,
                                            kernels="batched"))
    ddp = nn.parallel.DistributedDataParallel(
        model, bucket_cap_mb=4 // buckets * 32 * 32 * 4 / (1 << 20))
    ddp.register_comm_hook(state, geofp8_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kernel, saw_bad, mapped, now, seen = _kernel_verdicts(state), [], [], [0], [0]
    overflows = {step: i for i, step in enumerate(bad)}  # step -> its bucket

    def overflowing() -> bool:  # this map back overflows (counted per step, in order)
        seen[0] += 1
        return overflows.get(now[0]) == seen[0] - 1
    inverse_over, run = LowRankInput.inverse_over, triton_map._map_kernel.run
    first_slots: dict = {}  # a map back's bucket (its sum's storage) -> its first mapped slot

    def first(Gt) -> bool:  # the first slot mapped back in its bucket (the torch path maps
        # layer by layer: a bucket's map back counts once, at its first layer)
        return first_slots.setdefault(Gt.untyped_storage().data_ptr(), Gt.data_ptr()) \
            == Gt.data_ptr()
    mock.patch.object(LowRankInput, "inverse_over", lambda self, Gt: inverse_over(self, Gt).mul_(
        float("inf") if first(Gt) and overflowing() else 1.0)).start()

    def scaled(*args, **kwargs):
        # the grouped kernel's own overflow: its maps scaled by 2¹⁰⁰, so that G V and
        # P Uᵀ overflow inside it (every layer of the bucket; its flag must catch it)
        if kwargs["INVERSE"] and overflowing():
            kwargs["maps_ptr"] = kwargs["maps_ptr"] * 2.0 ** 100
        return run(*args, **kwargs)
    mock.patch.object(triton_map._map_kernel, "run", scaled).start()
    for step in range(steps):
        now[0], seen[0] = step, 0
        mapped.append(len(state.pipeline.transforms()))
        saw_bad.append(_sgd_step(ddp, model, opt, step, rank))
    stats = state.stats()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"saw_bad": saw_bad, "kernel": kernel, "skipped": stats["skipped_steps"],
            "mapped": mapped, "buckets": len(ddp.reducer._get_zeros_like_grad_buckets()),
            "params": params.view(torch.int32).tolist()}


def _map_overflow_buckets_worker(rank, world_size):
    """:func:`_map_overflow_worker` with two buckets: the earlier bucket's map back
    overflows at step 3, the last one's at step 4, none at steps 2 and 5."""
    return _map_overflow_worker(rank, world_size, steps=6, bad=(3, 4), buckets=2)


@pytest.mark.child(SKIP[0])
@pytest.mark.child(SKIP[1])
def test_a_map_that_overflows_skips_the_step_through_the_map_kernels_verdict():
    """A bucket with layers on a map ANDs its mean's check into its slot of the step's
    verdict (geofp8.ddp), in its grouped map kernel, and as the step's last bucket that
    kernel decides the step (no verdict kernel): a map back that overflows (the collective's
    own flag up) still skips it on every rank, as the torch path does."""
    fused, torch_path = _skipped("_map_overflow_worker")
    for out, ref in zip(fused, torch_path):
        assert out["mapped"][3:] == [4, 4]  # every layer on its map by the bad step
        assert out["saw_bad"] == [False, False, False, True, False]
        assert out["skipped"] == 1
        # step 0 sizes the slots; then the last bucket's decode decides, or its map back's
        # kernel once it has maps (a refresh step's and the overflowing one's too)
        assert out["kernel"] == ["torch"] + ["decode"] * 4
        for key in ("saw_bad", "skipped", "mapped"):
            assert out[key] == ref[key], key  # the torch path's, exactly
        _assert_round_off(out["params"], ref["params"])
    assert fused[0]["params"] == fused[1]["params"]  # every rank's bits the same


@pytest.mark.child(SKIP[0])
@pytest.mark.child(SKIP[1])
def test_the_last_buckets_map_kernel_decides_whichever_bucket_overflows():
    """Two mapped buckets: an overflow in the earlier bucket's map back (its flag, read by
    the last bucket's deciding map kernel), then in the last one's (that kernel's own), then
    none: the verdicts and the skipped-step counter are the torch path's, bit for bit."""
    fused, torch_path = _skipped("_map_overflow_buckets_worker")
    for out, ref in zip(fused, torch_path):
        assert out["buckets"] == 2 and out["mapped"][3:] == [4, 4, 4]
        assert out["saw_bad"] == [False, False, False, True, True, False]
        assert out["skipped"] == 2
        assert out["kernel"] == ["torch"] + ["decode"] * 5
        for key in ("saw_bad", "skipped", "mapped"):
            assert out[key] == ref[key], key
        _assert_round_off(out["params"], ref["params"])
    assert fused[0]["params"] == fused[1]["params"]


def _assert_round_off(fused, torch_path):
    """The fused run's parameters (FP32 bits) are the torch path's up to round-off: the
    grouped map kernel sums the same products in another order than the BLAS does
    (codecs.triton_map's notes), so a bit may differ where the BLAS's order happens not to
    be the kernel's (it depends on the machine); a wrong map, verdict or skip is far off."""
    import torch

    a, b = (torch.tensor(x, dtype=torch.int32).view(torch.float32) for x in (fused, torch_path))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# launches per bucket with layers on a low-rank map, beyond the flat bucket's: the forward
# maps written over the gradients in their slots of the bucket (G + (G V) Uᵀ) and the
# inverse, written over the sum, every layer of the bucket in one grouped Triton kernel each
# way (codecs.triton_map; the torch path: mm + addmm per layer each way); no elementwise op
# (the diagonal is folded into V = U diag(a) when the map is made, its scale dropped:
# geometry.transforms.LowRankInput); the residual is the bucket's flat one (read and
# written in the fused sender's kernels)
MAPPED_BUCKET_MAPS = 2
# a bucket with a layer on a map checks its mean after the map back (a map may overflow:
# geofp8.ddp) in the grouped map kernel itself, which ANDs the bucket's slot of the step's
# verdict with "every value it writes finite" (the collective's flag covers the rest): no
# torch op (comm.stages.all_finite's five are the torch path's)
MAPPED_BUCKET = 0
ALL_FINITE = ("aten.aminmax.default", "aten.eq.Scalar_out")
# the step's settling in torch ops (stack, all, not, widen, count), replaced by that kernel
TORCH_SETTLE = ("aten.stack.default", "aten.all.default")
# the per-tensor residual's ops (widen, zero, where, add, write): none on the bucket path
PER_TENSOR_RESIDUAL = ("aten.where.self_out", "aten.new_zeros.default", "aten.add.out",
                       "aten.copy_.default")


@pytest.mark.child(MEASURE)
def test_geometry_hook_launches_do_not_grow_with_the_mapped_layers():
    """geofp8 at an ordinary step with every layer on its refreshed map: the fused stages
    and the step's settling (the statistics' finite check and window add included) do not
    grow with the layers; a bucket with maps adds its grouped map kernel each way, whatever
    its layers, and no GEMM: its residual is the bucket's flat one. 8 layers in 4 buckets,
    2 of them on a map: the unmapped layers and the buckets add nothing but their fused
    stages and the second mapped bucket's maps and check. The last bucket's map back
    decides the step (no verdict kernel)."""
    (b2, tri2, ops2, _, names2, on2), (b8, tri8, ops8, _, names8, on8), \
        (b4, tri4, ops4, _, names4, on4) = _measured("geofp8")
    assert (b2, b8, b4, on2, on8, on4) == (1, 1, 4, 2, 8, 2)  # every layer on a map; 2 of 8
    assert tri2 == tri8 == FUSED_STAGES + DECIDED + STATISTICS + MAPPED_BUCKET_MAPS, \
        (tri2, tri8)
    assert tri4 == 4 * FUSED_STAGES + DECIDED + STATISTICS + 2 * MAPPED_BUCKET_MAPS, tri4
    for names in (names2, names8, names4):  # no GEMM left in torch
        assert not any(n.startswith(("aten.mm.", "aten.addmm.")) for n in names), names
    assert ops8 == ops2, (ops2, ops8, names2, names8)
    assert ops4 == ops2 + MAPPED_BUCKET, (ops2, ops4, names2, names4)
    for names in (names2, names8, names4):
        assert not set(PER_TENSOR_RESIDUAL) & set(names), names
        assert not set(TORCH_SETTLE) & set(names), names
        assert not set(ALL_FINITE) & set(names), names


@pytest.mark.child(MEASURE)
def test_geometry_hook_launches_without_a_map_are_the_flat_buckets():
    """geofp8-auto at an ordinary step with no layer on a map: its candidates join the flat
    bucket path, so the launches do not grow with the tensors at all."""
    (b2, tri2, ops2, _, _, on2), (b8, tri8, ops8, _, _, on8) = _measured("geofp8-auto")
    assert (b2, b8, on2, on8) == (1, 1, 0, 0)
    # the last bucket's decode decides the step, the statistics' one kernel: no torch op
    assert tri2 == tri8 == FUSED_STAGES + DECIDED + STATISTICS, (tri2, tri8)
    assert ops2 == ops8 == 0, (ops2, ops8)
