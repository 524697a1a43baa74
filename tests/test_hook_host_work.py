"""The real DDP hook's own host work per bucket, counted rather than timed, and the bucket
records that keep it flat (:mod:`geofp8.bucket_record`).

Lines: the lines of GeoFP8's own Python that the hook's calls execute in one ordinary step
on rank 0 of 2 gloo ranks, the stages' (under :mod:`geofp8.comm.stages` or a layout's bound
stages: ``host_lines.STAGES``) left out
(``benchmarks/host_lines.py``: ``SplitLines``, as ``hook_launches.py`` counts them; here on
the torch path, whose stages differ from the fused kernels' but not the hook around them).
Deterministic: the same model and step every run.

Correctness: a bucket's record is resolved again after each selection change, refresh and
resume, and a run that keeps records gives the parameters of one that resolves every
bucket at every call, bit for bit, a skipped step included, the same on every rank."""

import os
import sys

import torch
from torch import nn

from distributed import run_ranks, train_skipping

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "benchmarks")
WIDTH, COUNTED = 64, 5  # Linear(64, 64) layers; step 5 is ordinary for every method
METHODS = ("fp8", "fp8-ef", "geofp8-auto")  # nvfp4-ef: the same hook (hook_launches counts it)
# the hook's own lines of one ordinary step with one bucket (its start and settling
# included), 2 / 8 tensors, here: before the records fp8 423 / 657, fp8-ef 484 / 802,
# geofp8-auto 506 / 824; after them (f8ae040) 308, 319 and 341 whatever the tensors; with
# the collective's arguments bound per layout, the ledger's adds without a lock and the
# bucket's figures made once (q40a) 219, 230 and 252; grown at ff7ad82 to 225, 236 and 258;
# with the kernels' availability checked without Python per tensor and no map call for a
# bucket without maps (r40a) 219, 230 and 252 again; with the step's figures summed when
# read, and a static selection without a factor source deciding nothing per step (s40c)
# 191, 202 and 235 (geofp8-auto, which decides every step, gains less); s40a (the fused
# stages' own work, not counted here: fp8-ef's 121 -> 87 lines, nvfp4-ef's 151 -> 103);
# with the bucket's residual restaged in place, no decode call nor future callback per
# bucket and a launch run as a generator (s40b alone: 212, 220 and 242); a376144 184, 192
# and 225; with the last unit's decode deciding the step (t40a: its arming checks, the
# settling of a decided step; nothing armed on this path) 189, 197 and 228; with buckets
# found by their buffer's address, the collective's hops advanced by one loop, the seed
# mixed only for stochastic rounding and leaner group and stage entries (v40a) 157, 163
# and 196; with an unmapped bucket's map back returning at once, the arming no longer
# excluding a factor source (v40c) and a step's start doing nothing until its selection or
# source may act (v40b) 149, 155 and 170; with the collective calling its bound stages itself,
# its launch's choices made once and a bucket's figures added in one call (w40c) 146, 154
# and 169 (here the torch path: on the fused path a record's bound send and the stages'
# entries skipped take 20 lines, hook_launches.py); with DDP's engine taking no lock, a
# step's start not called until due and the statistics' commit bound once (w40b) 139, 147
# and 160
MOST = 145
AUTO = 13  # geofp8-auto's factors' settling (its statistics' commit), more


def _hook_lines(method: str, tensors: int) -> int:
    """The hook's own lines in step COUNTED, ``tensors`` layers in one DDP bucket."""
    sys.path.insert(0, BENCHMARKS)
    from host_lines import SplitLines, hooked

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(tensors)])
    state, hook = hooked(model, method, None)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=tensors * WIDTH * WIDTH
                                              * 4 / (1 << 20))
    split: list[SplitLines | None] = [None]

    def counted(state, bucket):
        if split[0] is None:
            return hook(state, bucket)
        out = []
        split[0].run(lambda: out.append(hook(state, bucket)))
        return out[0]

    ddp.register_comm_hook(state, counted)
    for step in range(COUNTED + 1):
        split[0] = SplitLines() if step == COUNTED else None
        ddp(torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(step))
            ).pow(2).mean().backward()
        ddp.zero_grad()
    assert len(ddp.reducer._get_zeros_like_grad_buckets()) == 1
    return split[0].hook


def _lines_worker(rank, world):
    return {f"{m} {t}": _hook_lines(m, t) for m in METHODS for t in (2, 8)}


def test_the_hooks_own_lines_per_bucket_do_not_grow_with_its_tensors():
    """fp8, fp8-ef and geofp8-auto (no layer on a map at its ordinary step): the same
    lines for 2 and 8 tensors in the bucket, and no more than the records and the bound
    launch brought them to (each method's names, offsets, routes, residual slot and layout
    resolved once; the collective's arguments once per layout)."""
    lines = run_ranks(_lines_worker, 2, timeout=240)[0]
    for method in METHODS:
        few, many = lines[f"{method} 2"], lines[f"{method} 8"]
        assert few == many, (method, lines)
        assert 0 < many <= MOST + (AUTO if method == "geofp8-auto" else 0), (method, lines)


STEPS, BAD, RESUME = 9, 7, 5  # rank 1's NaN at step 7; a checkpoint round trip after step 5
# per hook call (DDP's bucket of layers 3, 2 first, then of 1, 0, both kept by the profile):
# (step, whether it followed the bucket's record); step 0 has one bucket (DDP's first)
CALLS = [(0, False), (1, False), (1, False), (2, True), (2, False), (3, False), (3, False),
         (4, True), (4, False), (5, True), (5, True), (6, False), (6, False), (7, True),
         (7, False), (8, True), (8, True)]


def _train(rank: int, keep: bool):
    """geofp8 (profile at step 0, 2 of 4 layers kept, refreshes every 3 steps) in 2 DDP
    buckets: the parameters, and per hook call ``(step, whether it followed a record)``."""
    sys.path.insert(0, BENCHMARKS)
    from host_lines import hooked

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32, bias=False) for _ in range(4)])
    state, hook = hooked(model, "geofp8", 2)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=2 * 32 * 32 * 4 / (1 << 20))
    ddp.register_comm_hook(state, hook)
    pipeline, calls = state.engine.pipeline, []
    follow = pipeline._encode_recorded

    def encode_recorded(record, flat, seed):
        calls[-1] = (pipeline.ledger.step, True)
        return follow(record, flat, seed)

    pipeline._encode_recorded = encode_recorded
    if not keep:  # every call resolves its bucket: the per-tensor decisions each time
        pipeline.recordable = lambda: False
    encode = pipeline.encode

    def counted_encode(*args, **kwargs):
        calls.append((pipeline.ledger.step, False))
        return encode(*args, **kwargs)

    def resume(step):
        if step == RESUME:
            state.load_state_dict(state.state_dict())

    pipeline.encode = counted_encode
    train_skipping(ddp, model, rank, STEPS, BAD, 32, after_step=resume)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"params": params.view(torch.int32).tolist(), "calls": calls,
            "mapped": len(pipeline.geometry_layers()),
            "skipped": state.stats()["skipped_steps"],
            # the hook's buckets kept, by buffer address: (index, whether it is their buffer's)
            "buckets": sorted((b.index, address == b.buffer.data_ptr())
                              for address, b in state._buckets.items())}


def _records_worker(rank, world):
    return _train(rank, keep=True), _train(rank, keep=False)


def test_a_bucket_record_is_resolved_again_after_each_change_with_the_same_bits():
    """Records kept or not, the same parameters bit for bit on both ranks, the skipped
    step's residual reset included (a record reads the flag of the step that wrote the
    residuals at each call). Which calls follow a record (CALLS), and why the others do not:
    step 0 makes the residuals; 1: the selection decided, DDP rebuilt its buckets; layers
    1 and 0 are selected but without a map until the refresh at 3, so their bucket goes
    tensor by tensor at 1 and 2; 3: a refresh (maps moved: layers 1, 0 re-based tensor by
    tensor: their flat residuals no longer live; the first, on no map, resolved with the
    new decisions); 4: the first follows (the second's re-based residuals are not its own),
    the second resolved again, joining its residuals into one vector, which leaves the
    first's record valid, so both follow at 5; 6: a checkpoint loaded after 5 and a
    refresh, as at 3; 7 as 4 (rank 1's NaN: the step is skipped, the first's record read
    with the step's flag); 8 as 5."""
    ranks = run_ranks(_records_worker, 2, timeout=240)
    for kept, fresh in ranks:
        assert kept["mapped"] == fresh["mapped"] == 2
        assert kept["skipped"] == fresh["skipped"] == 1
        assert kept["params"] == fresh["params"]
        assert fresh["calls"] == [(step, False) for step, _ in CALLS]
        assert kept["calls"] == CALLS
        # DDP's two rebuilt buckets, found by their buffers' addresses: the record of step
        # 0's one bucket (index 0, another buffer) let go when the rebuilt index 0 came
        assert kept["buckets"] == fresh["buckets"] == [(0, True), (1, True)]
    assert ranks[0][0]["params"] == ranks[1][0]["params"]  # every rank ends the same


def _geometry_check_worker(rank, world):
    """geofp8, every layer on a map (refreshes every 3 steps), one bucket, 7 steps: per step
    the lookups of a layer's map made while the step starts and settles, the steps it
    counted as sent through a map, and the same with the check asked afresh at every
    asking (uncached)."""
    return {cached: _geometry_checks(rank, cached) for cached in (True, False)}


def _geometry_checks(rank: int, cached: bool) -> dict:
    sys.path.insert(0, BENCHMARKS)
    from host_lines import hooked

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32, bias=False) for _ in range(4)])
    state, hook = hooked(model, "geofp8", None)
    ddp = nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(state, hook)
    pipeline, source, lookups = state.engine.pipeline, state.engine.pipeline.source, []
    transform, settling = source.transform, [False]
    if not cached:  # the step's answer asked afresh before each settling
        settle = pipeline.settle

        def asked(finite):
            pipeline._mapped = bool(pipeline.geometry_layers())
            settle(finite)
        pipeline.settle = asked
    source.transform = lambda name: (lookups.__setitem__(-1, lookups[-1] + settling[0]),
                                      transform(name))[1]

    def counted(boundary):
        def at_boundary(*args):
            settling[0] = True
            try:
                boundary(*args)
            finally:
                settling[0] = False
        return at_boundary

    pipeline.settle, pipeline.start_step = map(counted, (pipeline.settle, pipeline.start_step))
    for step in range(7):
        lookups.append(0)
        ddp(torch.randn(8, 32, generator=torch.Generator().manual_seed(step + 10 * rank))
            ).pow(2).mean().backward()
        ddp.zero_grad()
    return {"lookups": lookups, "steps": [s for s, _ in pipeline._geometry_steps]}


def test_the_step_asks_whether_a_layer_is_on_a_map_once_per_generation():
    """A step's settling (``geometry_since``: the steps sent through a map) reads whether a
    selected layer has a map, asked layer by layer (4 lookups) once per generation of the
    decisions, at the start that changed them (the maps from the refresh at 3, then at 6),
    none in between (the starts between refreshes are not made); the same steps as asking
    afresh before every settling."""
    for out in run_ranks(_geometry_check_worker, 2, timeout=240):
        assert out[True]["steps"] == out[False]["steps"] and out[True]["steps"], out
        assert out[True]["lookups"][3:] == [4, 0, 0, 4], out
        # asked afresh: those, and 4 more at every settling
        assert out[False]["lookups"][3:] == [8, 4, 4, 8], out
