"""A bucket's low-rank maps in one Triton launch each way (geofp8.codecs.triton_map),
interpreted, against the torch path (``mm`` + ``addmm`` per layer).

``TRITON_INTERPRET=1`` must be set before the kernel is decorated, so the checks run in a
child process (this file run as a script). Tolerance: the kernel sums the same products in
another order (blocks of ``BLOCK_K`` columns, the BLAS's order in torch), two GEMMs each
way, so an element may differ by FP32 summation round-off,
``|Δ| ≤ 2 (d_in + rank) ε (|G| |V| |Uᵀ| + |G|)``, ``ε = 2⁻²³`` (elementwise, from the
absolute values: the standard bound on a dot product's rounding).
"""

from __future__ import annotations

import os

import pytest

from interpreted import Child

pytest.importorskip("triton")

# (rows, d_in, rank): unequal shapes, a rank past 16 (padded to 32), a rank of 0 (the
# identity), rows past one row block (64) and not a multiple of it, d_in not a multiple of
# the column block (32)
LAYERS = [(70, 40, 3), (7, 33, 0), (33, 64, 17), (5, 8, 8), (1, 16, 1)]


def _maps(seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    maps, pos = [], 3  # the first slot not at the bucket's start
    for rows, d, k in LAYERS:
        U = torch.linalg.qr(torch.randn(d, max(k, 1), generator=g))[0][:, :k]
        a_fwd, a_inv = torch.rand(k, generator=g) * 4 - 0.9, torch.rand(k, generator=g) - 0.5
        maps.append((pos, rows, d, U, U * a_fwd, U * a_inv))
        pos += rows * d + 2  # an unmapped tensor between two maps
    return maps, pos + 5


def check() -> list[str]:
    """Every case; returns the failures (empty: all within the bound)."""
    import torch

    from geofp8.codecs.triton_map import GroupedMaps, reference, round_off_bound

    failures, last = [], None
    for seed in range(3):
        maps, n = _maps(seed)
        flat = torch.randn(n, generator=torch.Generator().manual_seed(100 + seed)) * 10
        if seed == 2:  # a NaN in one layer's row, an Inf in another's
            flat[maps[0][0] + 65 * 40 + 3] = float("nan")  # the second row block
            flat[maps[2][0] + 5 * 64 + 7] = float("inf")
        # new maps in the same slots (every seed's): the last packing's table, values repacked
        grouped = GroupedMaps(maps, flat.device, last)
        if last is not None and grouped.table is not last.table:
            failures.append(f"seed {seed}: the same slots built a new table")
        if GroupedMaps(maps[1:], flat.device, grouped).table is grouped.table:
            failures.append(f"seed {seed}: other slots took the last table")
        last = grouped
        for inverse in (False, True):
            out, ref = flat.clone(), flat.clone()
            grouped(out, inverse)
            reference(ref, maps, inverse)
            for pos, rows, d, U, V_fwd, V_inv in maps:
                G, o, r = (x[pos : pos + rows * d].view(rows, d) for x in (flat, out, ref))
                finite = G.isfinite().all(dim=1)
                if not torch.equal(o.isfinite(), r.isfinite()):
                    failures.append(f"seed {seed} inverse {inverse} {rows}x{d} k={U.shape[1]}: "
                                    "non-finite elements differ")
                bound = round_off_bound(G[finite], V_inv if inverse else V_fwd, U)
                if not bool(((o[finite] - r[finite]).abs() <= bound).all()):
                    failures.append(f"seed {seed} inverse {inverse} {rows}x{d} "
                                    f"k={U.shape[1]}: past the round-off bound")
                if U.shape[1] == 0 and not torch.equal(o.view(torch.int32), G.view(torch.int32)):
                    failures.append("rank 0 changed its slot")
            gaps = torch.ones(n, dtype=torch.bool)
            for pos, rows, d, *_ in maps:
                gaps[pos : pos + rows * d] = False
            if not torch.equal(out[gaps], flat[gaps]):
                failures.append("an unmapped element changed")
    return failures + flags() + fsdp_unit()


def fsdp_unit() -> list[str]:
    """A ``fully_shard`` unit's maps over FSDP's layout (:class:`geofp8.fsdp_maps.UnitMaps`):
    2 rank chunks; 3 parameters of ``rows_total`` dim-0 rows (odd: the last chunk padded
    with zero rows), the first and the last sharing one map (packed once), a plain one
    between them; a NaN in a row. The forward over the whole input, the map back over a
    chunk, each against the torch path on the parameter's real rows within the round-off
    bound; the padding rows and the plain parameter's elements left bit for bit."""
    from types import SimpleNamespace

    import torch

    from geofp8.codecs.triton_map import round_off_bound
    from geofp8.fsdp_maps import UnitMaps

    failures, g, n = [], torch.Generator().manual_seed(7), 2
    shapes = [(75, 40), (9, 24), (3, 40)]  # (dim-0 rows, width)
    U = torch.linalg.qr(torch.randn(40, 5, generator=g))[0]
    shared = SimpleNamespace(U=U, V_fwd=U * 1.5, V_inv=U * -0.6)
    places, pos = [], 0  # (pos, chunk rows, width)
    for total, width in shapes:
        places.append((pos, -(-total // n), width))
        pos += places[-1][1] * width
    chunk, maps = pos, [(*places[0], shared), (*places[2], shared)]
    layout = torch.zeros(n, chunk)
    for (total, width), (at, rows, _) in zip(shapes, places):
        G = torch.randn(total, width, generator=g)
        padded = torch.cat([G, G.new_zeros(n * rows - total, width)])
        layout[:, at : at + rows * width] = padded.view(n, rows * width)
    layout[1, 3 * 40 + 5] = float("nan")  # row 40 of the first parameter
    unit = UnitMaps(maps, n, chunk, layout.device, None)
    if unit._forward.packed.numel() != 3 * U.numel():
        failures.append(f"fsdp: the shared map packed {unit._forward.packed.numel()} floats")
    for inverse, (out, ref) in ((False, (layout.clone().view(-1), layout.clone())),
                                (True, (layout[1].clone(), layout[1].clone()[None]))):
        (unit.back if inverse else unit.forward)(out)
        out = out.view(ref.shape)
        for (total, width), (at, rows, _) in zip(shapes, places):
            G = ref[:, at : at + rows * width].reshape(-1, width)  # (a copy: not ref's)
            o = out[:, at : at + rows * width].reshape(-1, width)
            real = total if not inverse else min(rows, total - rows)  # chunk 1's real rows
            if width == 24:  # the plain one
                if not torch.equal(o.view(torch.int32), G.view(torch.int32)):
                    failures.append(f"fsdp inverse {inverse}: the plain parameter changed")
                continue
            want = torch.addmm(G[:real], G[:real] @ (shared.V_inv if inverse else
                                                     shared.V_fwd), U.T)
            finite = G[:real].isfinite().all(dim=1)
            bound = round_off_bound(G[:real][finite], shared.V_inv if inverse
                                    else shared.V_fwd, U)
            if not torch.equal(o[:real].isfinite(), want.isfinite()) or not bool(
                    ((o[:real][finite] - want[finite]).abs() <= bound).all()):
                failures.append(f"fsdp inverse {inverse} {total}x{width}: past the bound")
            if not torch.equal(o[real:].view(torch.int32), torch.zeros_like(o[real:]).view(
                    torch.int32)):
                failures.append(f"fsdp inverse {inverse} {total}x{width}: padding not +0")
    return failures


def flags() -> list[str]:
    """The finite flag the kernel ANDs over what it writes, against the torch path's
    values checked afterwards: finite values, a NaN and an Inf in a row (seed 2), and
    finite values whose map overflows (times 2¹²⁶: past FP32's range); a cleared
    flag stays cleared; elements outside the maps (a NaN there) are not the kernel's."""
    import torch

    from geofp8.codecs.triton_map import GroupedMaps, reference

    failures, wants = [], []
    for seed, scale in ((0, 1.0), (2, 1.0), (1, 2.0 ** 126)):
        maps, n = _maps(seed)
        flat = torch.randn(n, generator=torch.Generator().manual_seed(100 + seed)) * scale
        flat[1] = float("nan")  # before the first slot: the collective's flag covers it
        if seed == 2:
            flat[maps[0][0] + 65 * 40 + 3] = float("nan")
            flat[maps[2][0] + 5 * 64 + 7] = float("inf")
        ref = flat.clone()
        reference(ref, maps, True)
        want = all(bool(ref[pos : pos + rows * d].isfinite().all())
                   for pos, rows, d, U, _, _ in maps if U.shape[1])
        for start in (1, 0):
            out, flag = flat.clone(), torch.full((), start, dtype=torch.uint8)
            done = GroupedMaps(maps, flat.device)(out, True, flag)
            if not done or flag.item() != int(want and start):
                failures.append(f"seed {seed} scale {scale} flag {start}: {flag.item()}, "
                                f"want {int(want and start)}")
        wants.append(want)
    # finite; a NaN and an Inf; an overflow of finite values
    return failures + ([] if wants == [True, False, False] else [f"cases {wants}"])


def decisions() -> list[str]:
    """The deciding variant (a record's bound maps, :class:`BoundMaps`, launched with the
    step's decision): its flag as the plain one's, the verdict ``all(earlier flags) ∧ its
    flag`` and the skipped counter advanced when false, against the torch path's values
    checked; twice in a row (the ticket zeroed by the last program each call): earlier
    flags up or one down, its own values finite, non-finite, or the sum's flag down."""
    import functools

    import torch

    from geofp8.codecs.triton_map import GroupedMaps, reference

    failures = []
    for seed, scale in ((0, 1.0), (1, 2.0 ** 126)):
        maps, n = _maps(seed)
        flat = torch.randn(n, generator=torch.Generator().manual_seed(100 + seed)) * scale
        ref = flat.clone()
        reference(ref, maps, True)
        mapped_finite = all(bool(ref[pos : pos + rows * d].isfinite().all())
                            for pos, rows, d, U, _, _ in maps if U.shape[1])
        grouped = GroupedMaps(maps, flat.device)
        for earlier, start in (([1, 1, 1], 1), ([1, 0, 1], 1), ([1, 1, 1], 0), ([], 1)):
            skipped = torch.tensor(5, dtype=torch.int64)
            for _ in range(2):
                out, flag = flat.clone(), torch.full((), start, dtype=torch.uint8)
                flags = torch.tensor(earlier + [7], dtype=torch.uint8)  # (past n: not read)
                verdict = torch.empty((), dtype=torch.uint8)
                done = grouped.bind(out).back(flag, functools.partial(
                    _deciding, flags_ptr=flags, n=len(earlier), verdict_ptr=verdict,
                    skipped_ptr=skipped))
                want = int(mapped_finite and start == 1)
                if not done or flag.item() != want or not torch.equal(out.isfinite(),
                                                                       ref.isfinite()):
                    failures.append(f"decide seed {seed} {earlier} {start}: flag {flag}")
                if verdict.item() != int(want and all(earlier)):
                    failures.append(f"decide seed {seed} {earlier} {start}: verdict {verdict}")
            if skipped.item() != 5 + 2 * (1 - int(want and all(earlier))):
                failures.append(f"decide seed {seed} {earlier} {start}: skipped {skipped}")
    return failures


def _deciding(launches, flag, **decision) -> None:
    """The deciding launch of a map back's ``(plain, deciding)`` with the step's decision
    (as :func:`geofp8.verdict.map_into` gives an armed slot's)."""
    launches[1](flag_ptr=flag, **decision)


def launches() -> tuple[int, int]:
    """Triton launches of one call each way over a bucket of every layer."""
    import torch

    from geofp8.codecs import triton_map

    maps, n = _maps(0)
    flat, count = torch.randn(n), [0]
    run = triton_map._map_kernel.run
    triton_map._map_kernel.run = lambda *a, **k: count.__setitem__(0, count[0] + 1) or run(*a, **k)
    grouped = triton_map.GroupedMaps(maps, flat.device)
    grouped(flat, False)
    forward = count[0]
    grouped(flat, True)
    return forward, count[0] - forward


def _ranks_worker(rank, world_size, source, steps=5):
    """geofp8 with layers="all" (``source``'s maps: refreshed every 2 steps, or fresh every
    step; 4 layers of unequal shapes in one bucket: 3 on a map, the last Euclidean under
    ``min_dim``) on the fused path, interpreted: the maps' grouped calls each way, the
    tables packed, and the final parameters' bits."""
    import torch
    from torch import nn

    from geofp8 import GeoFP8Config, GeoFP8State, geofp8_hook
    from geofp8.codecs import triton_map

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 40, bias=False), nn.Linear(40, 17, bias=False),
                          nn.Linear(17, 33, bias=False), nn.Linear(33, 8, bias=False))
    state = GeoFP8State(model, GeoFP8Config(layers="all", refresh_every=2, k=4,
                                            factor_source=source, kernels="batched"))
    ddp = nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(state, geofp8_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls, run, tables = [], triton_map._map_kernel.run, set()

    def counted(*args, **kwargs):  # every launch of the grouped kernel, bound or not
        calls.append(bool(kwargs["INVERSE"]))
        tables.add(id(kwargs["table_ptr"]))
        return run(*args, **kwargs)
    triton_map._map_kernel.run = counted
    for step in range(steps):
        opt.zero_grad()
        x = torch.randn(8, 24, generator=torch.Generator().manual_seed(step + 10 * rank))
        ddp(x).pow(2).mean().backward()
        opt.step()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"calls": calls, "tables": len(tables), "mapped": len(state.pipeline.transforms()),
            "params": params.view(torch.int32).tolist()}


def ranks(source: str) -> str:
    """The 2-rank gloo run: whether both ranks took the grouped maps and ended bit-identical."""
    from distributed import run_ranks

    out = run_ranks(_ranks_worker, 2, (source,), timeout=300)
    calls = [o["calls"] for o in out]
    return (f"{source}: ranks mapped {[o['mapped'] for o in out]} grouped calls equal "
            f"{calls[0] == calls[1]} ways {sorted(set(calls[0]))} tables "
            f"{[o['tables'] for o in out]} params equal {out[0]['params'] == out[1]['params']}")


CHILD = Child([__file__])  # this file run as a script: the checks above


@pytest.mark.child(CHILD)
def test_one_launch_each_way_agrees_with_the_torch_maps_within_fp32_round_off():
    lines = CHILD.lines()
    assert lines[:-3] == [], lines  # no failure (the deciding variant's included)
    assert lines[-3] == "launches (1, 1)"
    # a real 2-rank gloo group, 3 of 4 layers on a map (one bucket): the maps went through
    # the grouped kernel (refreshed maps: each way; fresh maps: back, the forward made per
    # layer as the map is built), the same calls on both ranks, one program table per set of
    # slots however often the maps in them change (refreshed: from step 2, in DDP's rebuilt
    # bucket; fresh: every step, in step 0's bucket and the rebuilt one), bit-identical
    # parameters
    assert lines[-2] == ("refresh: ranks mapped [3, 3] grouped calls equal True ways "
                         "[False, True] tables [1, 1] params equal True"), lines[-2]
    assert lines[-1] == ("fresh: ranks mapped [3, 3] grouped calls equal True ways "
                         "[True] tables [2, 2] params equal True"), lines[-1]


def test_a_cpu_bucket_without_the_interpreter_stays_on_the_torch_path():
    import torch

    from geofp8.codecs import triton_map

    maps, _ = _maps(0)
    assert not triton_map.places(torch.zeros(4), [U for _, _, _, U, _, _ in maps]) \
        or os.environ.get("TRITON_INTERPRET") == "1"
    assert not triton_map.places(torch.zeros(4, dtype=torch.float64), [])


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for failure in check() + decisions():
        print(failure)
    print(f"launches {launches()}")
    print(ranks("refresh"))
    print(ranks("fresh"))
