"""The fused Triton FP8 kernels (E4M3, E5M2) against the torch reference, interpreted.

``TRITON_INTERPRET=1`` must be set before the kernels are decorated, so the checks run in
a child process (this file run as a script) that sets it first; the test asserts that the
child found every case bit-identical (NaN where NaN: which NaN payload a product keeps
when both operands are NaN is the hardware's choice) and counts the kernels launched.
"""

from __future__ import annotations

import os

import pytest
import torch

from bitwise import same
from interpreted import Child

pytest.importorskip("triton")

SCALINGS = (("tensor", None), ("row", None), ("block", 128), ("block", 32))
FORMATS = ("e4m3", "e5m2")
SHAPES = ([(3, 300), (5,), (64, 40)], [(2001,)], [(7, 129), (1,)])  # odd, unequal, 1-element


def _bucket(shapes, seed: int, special: bool):
    import torch

    n = sum(torch.Size(s).numel() for s in shapes)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-3, 3, n).flip(0)
    x[n // 3 : n // 3 + 40] = 0  # a zero stretch
    x[n // 2] *= 1e-38  # a subnormal quotient
    if special:
        x[5], x[n - 2] = float("nan"), float("-inf")
        x[n // 2 + 1] = float("inf")
    return x


def check() -> list[str]:
    """Every case; returns the failures (empty: all bit-identical)."""
    import torch

    from geofp8.codecs import make_codec, triton_fp8
    from geofp8.codecs.base import GroupMap
    from geofp8.comm.stages import sender_sum

    failures = []
    cases = [(fmt, c, s, n, f) for fmt in FORMATS for c in SCALINGS for s in SHAPES
             for f in (0, 1) for n in ((1, 4, 5) if s is SHAPES[0] and fmt == "e4m3" else (3,))]
    for fmt, (scaling, block), shapes, n_senders, special in cases:
        codec = make_codec(fmt, scaling, block)
        # an owner's shard of N senders: every tensor's chunk, cut at group boundaries
        groups = GroupMap([[codec.groups(s) for s in shapes]])
        name = f"{fmt} {scaling}/{block} {shapes} N={n_senders} special={special}"
        xs = [_bucket(shapes, 10 * r + len(shapes), special and r == 1)
              for r in range(n_senders)]
        residual = torch.randn(xs[0].numel()) * 1e-2
        # (a)+(b): the error feedback add, the scales, the codes and the rounding error
        u, scales = triton_fp8.amax(xs[0], groups, residual, fmt)
        codes, error = triton_fp8.encode(u, scales, groups, error=True, fmt=fmt)
        ref_u = xs[0] + residual
        ref_scales, ref_codes, ref_value = triton_fp8.reference(ref_u, groups, fmt)
        for what, got, want in (("u", u, ref_u), ("scales", scales, ref_scales),
                                ("codes", codes, ref_codes),
                                ("error", error, ref_u - ref_value)):
            if not same(got, want):
                failures.append(f"{name}: {what}")
        # (d): the decode
        value = triton_fp8.decode(torch.empty_like(u), codes, scales, groups, fmt)
        if not same(value, ref_value):
            failures.append(f"{name}: decode")
        # (c): the owner's decode of N senders' copies and their FP32 sum in sender order
        refs = [triton_fp8.reference(x, groups, fmt) for x in xs]
        total = torch.zeros_like(xs[0])
        for _, _, v in refs:
            total += v
        got = triton_fp8.decode_sum(torch.stack([c for _, c, _ in refs]),
                                     torch.stack([s for s, _, _ in refs]), groups, n_senders,
                                     fmt)
        if not same(got, total):
            failures.append(f"{name}: decode_sum")
        if not same(got, sender_sum(torch.stack([v for _, _, v in refs]))):
            failures.append(f"{name}: decode_sum vs the stages' sender_sum")
    return failures


def check_stages() -> list[str]:
    """Each fused stage (:class:`~geofp8.comm.plan.FusedPlan`'s kernels, which the stages
    call on their own: :func:`triton_fp8.available`) against the CPU's chunked path, bit for
    bit: a sender's encode with its error written over the bucket, every owner's decode, sum
    and re-encode (and its error), the decode of the gathered shards divided by ``N``; then
    the whole collective, with NaN and ±Inf in a sender's bucket."""
    import torch

    from geofp8.codecs import make_codec
    from geofp8.comm import ShardLayout
    from geofp8.comm import stages as st
    from geofp8.comm.plan import FP8Stages

    calls = []
    send = FP8Stages.send
    FP8Stages.send = lambda *a: calls.append(1) or send(*a)
    failures = []
    cases = [("e4m3", c, 3) for c in SCALINGS[:3]] + [("e5m2", SCALINGS[2], 3)] + [
        ("e4m3", SCALINGS[1], n) for n in (1, 4, 5)]
    for fmt, (scaling, block), n in cases:
        shapes, name = [(3, 300), (5,), *SHAPES[2]], f"{fmt} {scaling}/{block} N={n}"
        outs = []
        for kernels in ("batched", "chunked"):
            layout = ShardLayout.build(shapes, make_codec(fmt, scaling, block), n,
                                       kernels=kernels)
            inputs = [_bucket(shapes, r, special=r == n - 1) for r in range(n)]
            sent = [st.encode(x, layout, sender=r) for r, x in enumerate(inputs)]
            flat = inputs[0].clone()
            sent0, error = st.encode_with_error(flat, layout, error_out=flat)
            cuts = [layout.send_bytes(j) for j in range(n)]
            records, sums, errors = [], [], []
            for j in range(n):
                received = torch.cat([s.split(cuts)[j] for s in sent])
                record, total = st.reduce_encode(received, layout, j)
                owner = total.clone()
                again = st.encode_reduced(owner, layout, j, error_out=owner)
                records.append(record)
                sums.append(total)
                errors.append(owner if torch.equal(again, record) else owner.fill_(7))
            gathered = torch.stack(records)
            outs.append([sent[0], sent0, error, *records, *sums, *errors,
                         st.decode_gathered(gathered, layout, divide=n),
                         st.decode_gathered(gathered, layout),  # (bound per divide value)
                         st.simulate_exact_allreduce(  # FP8 rounds to nearest whatever the seed
                             [_bucket(shapes, r, special=False) for r in range(n)], layout,
                             seed=11)])
        for k, (got, want) in enumerate(zip(*outs)):
            if not same(got, want):
                failures.append(f"stages {name}: output {k}")
        if not outs[0][-3].isnan().all():
            failures.append(f"stages {name}: not poisoned")
    FP8Stages.send = send
    if not calls:
        failures.append("the stages did not run the fused kernels")
    return failures


def check_feedback() -> list[str]:
    """The sender's encode with a bucket's error feedback ``(R, keep)`` folded into the fused
    kernels (``Ũ = G + where(keep, R, 0)`` read in both, the new residual written into ``R``)
    against the CPU's chunked path (one add, the encode, one copy into ``R``), bit for bit:
    BF16 and FP32 residuals, ``keep`` true, false and ``None``, NaN and ±Inf in ``G`` and in
    ``R``, a ``-0`` gradient, N = 1, 3, 4, and one layout's residual replaced twice. ``G``
    is not written by the kernels."""
    import torch

    from geofp8.codecs import make_codec
    from geofp8.comm import ShardLayout
    from geofp8.comm import stages as st
    from geofp8.comm.plan import FP8Stages

    calls, failures = [], []
    send = FP8Stages.send  # (self, flat, error, feedback, seed, sender)
    FP8Stages.send = lambda *a: calls.append(a[3]) or send(*a)
    shapes = [(3, 300), (5,), *SHAPES[2]]
    for n, dtype, keep, special in [(n, d, k, f) for n in (1, 3, 4)
                                    for d in (torch.bfloat16, torch.float32)
                                    for k in (True, False, None) for f in (0, 1)]:
        name = f"feedback N={n} {dtype} keep={keep} special={special}"
        outs = []
        for kernels in ("batched", "chunked"):
            layout = ShardLayout.build(shapes, make_codec("e4m3", "row"), n, kernels=kernels)
            g = _bucket(shapes, n, special=bool(special))
            g[7] = -0.0  # + a kept-away residual's +0: +0, as torch adds it
            r = (torch.randn(g.numel(), generator=torch.Generator().manual_seed(n)) * 1e-2)
            r = r.to(dtype)
            if special:
                r[200], r[300] = float("-inf"), float("nan")
            flat = g.clone()
            sent, error = st.encode_with_error(
                flat, layout, error_out=flat,
                feedback=(r, None if keep is None else torch.tensor(keep)))
            outs.append((sent, r, flat))
            if error is not r:
                failures.append(f"{name} {kernels}: the error is not R")
        (sent, r, flat), (want_sent, want_r, _) = outs
        if not same(sent, want_sent):
            failures.append(f"{name}: sent")
        nan = r.float().isnan()  # NaN's payload: the rounding's choice (c10 scalar 0x7FC0)
        if not (torch.equal(nan, want_r.float().isnan()) and torch.equal(
                r[~nan].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                want_r[~nan].view(torch.int16 if dtype == torch.bfloat16 else torch.int32))):
            failures.append(f"{name}: residual")
        if not same(flat, _bucket(shapes, n, special=bool(special)).index_fill_(
                0, torch.tensor([7]), -0.0)):
            failures.append(f"{name}: G written")
    # one layout whose residual is replaced (a resume, a rebucketing) by one of another
    # dtype, then by another FP32 one: each send reads and writes the R it is given
    fused, chunked = (ShardLayout.build(shapes, make_codec("e4m3", "row"), 3, kernels=k)
                      for k in ("batched", "chunked"))
    for step, dtype in enumerate((torch.float32, torch.bfloat16, torch.float32)):
        r = (torch.randn(fused.numel, generator=torch.Generator().manual_seed(step)) * 1e-2
             ).to(dtype)
        got, want = ((st.encode_with_error(_bucket(shapes, 3, special=False), lay,
                                           feedback=(residual, torch.tensor(True)))[0],
                      residual) for lay, residual in ((fused, r), (chunked, r.clone())))
        if not (same(got[0], want[0]) and same(got[1].float(), want[1].float())):
            failures.append(f"a replaced residual, {step}: {dtype}")
    FP8Stages.send = send
    if sum(c is not None for c in calls) != 39:
        failures.append(f"the fused kernels took the feedback {len(calls)} times, not 39")
    return failures


def check_verdict() -> list[str]:
    """A step's verdict from its units' flags in the slots (one kernel) as the torch path
    decides it, and the skipped-step counter; flags that are not the slots, or not in
    order, go the torch way, with the units' factors (1 or NaN) when asked for. Agreed
    (``agree``: here a second rank's flags down where ``other``): the factors, the verdict
    and the counter from one kernel, whether the flags are the slots or not."""
    import math

    import torch

    from geofp8.verdict import StepVerdict

    failures = []
    counter = torch.zeros((), dtype=torch.int64)
    verdict = StepVerdict(lambda device: counter)
    if verdict.slot("cpu") is not None:
        failures.append("verdict: a slot before the first settling (which sizes them)")
    for units, how, other in (([1, 1, 1], "plain", None), ([1], "slots", None),
                              ([1, 0, 1], "slots", None), ([1, 0, 1], "plain", None),
                              ([0, 0, 0], "slots", None), ([1, 1, 0], "reversed", None),
                              ([1, 1, 1], "slots", [0, 0, 0]), ([1, 1, 1], "slots", [0, 1, 0]),
                              ([1, 0, 1], "plain", [1, 0, 0]), ([1], "plain", [0])):
        slots = [verdict.slot("cpu") for _ in units] if how != "plain" else []
        flags = [torch.tensor(bool(u)) for u in units]
        for slot, ok in zip(slots, units):
            slot.fill_(ok)
        if how != "plain":
            flags = [slot.view(torch.bool) for slot in slots]
        for flag in reversed(flags) if how == "reversed" else flags:
            verdict.observe(flag)
        before = int(counter)
        agree = None if other is None else \
            (lambda bad, other=other: bad + torch.tensor(other, dtype=torch.float32))
        per_unit = how != "slots" or other is not None  # (the one-kernel path: not wanted)
        finite, factors, counted = verdict.settle("cpu", agree, per_unit)
        want = all(units) and not any(other or ())
        kernel = how == "slots" or other is not None
        name = f"verdict {units} {how} {other}"
        if (counted is counter) != kernel or bool(finite) != want:
            failures.append(f"{name}: {bool(finite)}, {counted}")
        if kernel and int(counter) != before + (not want):
            failures.append(f"{name}: counter {int(counter)} after {before}")
        up = [bool(u) and not o for u, o in zip(units, other or [0] * len(units))]
        if how == "reversed":
            up.reverse()
        if not per_unit:
            if factors is not None:
                failures.append(f"{name}: factors {factors}, none asked for")
        elif factors.dtype != torch.float32 or \
                [1.0 if u else "nan" for u in up] != [f if f == 1 else math.isnan(f) and "nan"
                                                      for f in factors.tolist()]:
            failures.append(f"{name}: factors {factors.tolist()} for {up}")
    if [verdict.slot("cpu") is None for _ in range(65)] != [False] * 64 + [True]:
        failures.append("verdict: slots past twice the last step's units, at least 64")
    return failures


def check_decision() -> list[str]:
    """The step's last unit's fused decode deciding it (geofp8.verdict.decode_into): for
    E4M3 and NVFP4 / MXFP8 records, a finite or poisoned last unit after finite or not
    earlier ones, the verdict and the skipped counter as the torch path has them, and no
    verdict kernel at settling; a rollback takes the count back; flags that turn out not
    to be the slots settle the torch way, the counter corrected."""
    import torch

    from geofp8.codecs import make_codec, triton_fp8
    from geofp8.comm import ShardLayout
    from geofp8.comm import stages as st
    from geofp8.verdict import StepVerdict

    failures, kernels, n = [], [], 2
    verdict_kernel = triton_fp8.verdict
    triton_fp8.verdict = lambda *a: kernels.append(1) or verdict_kernel(*a)
    counter = torch.zeros((), dtype=torch.int64)
    for codec in (make_codec("e4m3", "row"), make_codec("nvfp4"), make_codec("mxfp8")):
        layout = ShardLayout.build([(3, 300), (64, 40)], codec, n, kernels="batched")
        gathered = {}
        for bad in (False, True):
            sent = [st.encode(_bucket([(3, 300), (64, 40)], r, special=bad and r == 1), layout,
                              sender=r) for r in range(n)]
            cuts = [layout.send_bytes(j) for j in range(n)]
            received = [torch.cat([x.split(cuts)[j] for x in sent]) for j in range(n)]
            gathered[bad] = torch.stack([st.reduce_encode(received[j], layout, j)[0]
                                         for j in range(n)])
        verdict = StepVerdict(lambda device: counter)
        verdict.settle("cpu")  # sizes the slots
        for units, how in (([1], "settle"), ([0], "settle"), ([1, 1, 1], "settle"),
                           ([1, 0, 1], "settle"), ([0, 1, 0], "settle"), ([1, 0], "rollback"),
                           ([1, 1], "not slots")):
            name, before, kernels[:] = f"decision {codec!r} {units} {how}", int(counter), []
            for i, unit in enumerate(units):
                if i == len(units) - 1:  # the engine's count: units observed + outstanding
                    verdict.arm(len(verdict.flags) + 1)
                slot = verdict.slot("cpu")
                if i < len(units) - 1:
                    slot.fill_(unit)  # an earlier unit's decode
                else:
                    values, finite = st.decode_gathered_flagged(gathered[not unit], layout,
                                                                divide=n, flag=slot)
                    if finite is None or bool(finite) != bool(unit):
                        failures.append(f"{name}: the unit's flag {finite}")
                if how == "not slots" and i == len(units) - 1:
                    slot = torch.tensor(False)  # e.g. a check written elsewhere
                verdict.observe(slot.view(torch.bool) if slot.dtype == torch.uint8 else slot)
            if how == "rollback":
                verdict.rollback()
                if int(counter) != before:
                    failures.append(f"{name}: counter {int(counter)} after {before}")
                continue
            finite, ok, counted = verdict.settle("cpu")
            want = all(units) and how != "not slots"
            if counted is not counter or bool(finite) != want or \
                    int(counter) != before + (not want):
                failures.append(f"{name}: {bool(finite)}, counter {int(counter)} after {before}")
            if kernels:
                failures.append(f"{name}: the verdict kernel ran at settling")
            if ok is not None:  # (no per-unit factors asked for)
                failures.append(f"{name}: per unit {ok}")
    triton_fp8.verdict = verdict_kernel
    return failures


GATHERED = [("e4m3", "row", None), ("e5m2", "block", 32), ("nvfp4", None, None),
            ("mxfp4", None, None), ("mxfp8", None, None)]
# odd shards; a bucket of N = 4 with two empty shards (an empty unit of work for their
# owners, no scale in their records)
GATHERED_LAYOUTS = [([(3, 300), (5,), (7, 129), (1,)], n) for n in (1, 3, 4)] + [
    ([(1,), (2,)], 4)]


def check_gathered() -> list[str]:
    """The gathered decode (one kernel, its finite flag decided by its last program: the
    ticket) against the CPU's chunked path, bit for bit, divided by ``N`` and not: every
    format, N = 1, 3, 4, odd and empty shards; a non-finite scale (NaN, +Inf, -Inf) in the
    first record's first group (program 0), in the last record's last group (the last
    program), in both, and clean before and after (the ticket zeroed by each call)."""
    import torch

    from geofp8.codecs import make_codec
    from geofp8.comm import ShardLayout
    from geofp8.comm import stages as st

    failures = []
    for (fmt, scaling, block), (shapes, n) in [(c, s) for c in GATHERED
                                               for s in GATHERED_LAYOUTS]:
        codec = make_codec(fmt, scaling, block) if scaling else make_codec(fmt)
        fused, chunked = (ShardLayout.build(shapes, codec, n, kernels=k)
                          for k in ("batched", "chunked"))
        flags = []
        for first, last in ((None, None), ("nan", None), (None, "inf"), ("-inf", "nan"),
                            (None, "-inf"), (None, None)):
            name = f"gathered {fmt} {shapes} N={n} first={first} last={last}"
            inputs = [_bucket(shapes, r, special=False) for r in range(n)]
            inputs[0][0] = float(first) if first else inputs[0][0]
            inputs[-1][-1] = float(last) if last else inputs[-1][-1]
            sent = [st.encode(x, chunked, sender=r) for r, x in enumerate(inputs)]
            cuts = [chunked.send_bytes(j) for j in range(n)]
            gathered = torch.stack([
                st.reduce_encode(torch.cat([s.split(cuts)[j] for s in sent]), chunked, j)[0]
                for j in range(n)])
            for divide in (n, None):
                got, flag = st.decode_gathered_flagged(gathered, fused, divide=divide)
                want = st.decode_gathered(gathered, chunked, divide=divide)
                if flag is None or not same(got, want) or \
                        bool(flag) != bool(want.isfinite().all()):
                    failures.append(f"{name} divide={divide}: {flag}")
                flags.append(None if flag is None else int(flag))
        if flags != [1] * 2 + [0] * 8 + [1] * 2:
            failures.append(f"gathered {fmt} {shapes} N={n}: flags {flags}")
    return failures


KERNELS = ("_amax_kernel", "_scales_kernel", "_encode_kernel", "_decode_kernel",
           "_decode_sum_kernel", "_encode_placed_kernel", "_reduce_kernel",
           "_decode_placed_kernel", "_verdict_kernel")


def launches() -> list[tuple[int, int]]:
    """``(Triton kernels, torch kernels)`` one rank's four stages of a bucket launch on the
    fused path (a sender's encode with its error feedback written over the bucket, the
    owner's decode, sum and re-encode, the decode of the gathered shards divided by ``N``),
    for N = 2 and 5 and buckets of 1 and 6 tensors."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from geofp8.codecs import make_codec, triton_fp8
    from geofp8.comm import ShardLayout
    from geofp8.comm import stages as st

    counted = {"triton": 0, "aten": 0, "inside": False}
    for kernel in KERNELS:
        fn = getattr(triton_fp8, kernel)
        run = fn.run

        def counting(*args, _run=run, **kwargs):
            counted["triton"] += 1
            counted["inside"] = True  # the interpreter's own torch ops are not launches
            try:
                return _run(*args, **kwargs)
            finally:
                counted["inside"] = False
        fn.run = counting

    class Aten(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not (counted["inside"] or func.is_view or func._schema.name in (
                    "aten::empty", "aten::empty_like", "aten::empty_strided",
                    "aten::new_empty")):
                counted["aten"] += 1
            return func(*args, **(kwargs or {}))

    out = []
    for n, shapes in ((2, [(64, 300)]), (5, [(64, 300)]), (5, [(64, 30), (7,), (9, 33)] * 2)):
        layout = ShardLayout.build(shapes, make_codec("e4m3", "block", 128), n,
                                   kernels="batched")
        x = torch.randn(layout.numel)

        def stages(x=x, layout=layout, n=n):
            sent, _ = st.encode_with_error(x, layout, error_out=x)
            rank = n - 1
            mine = sent[sum(layout.send_bytes(j) for j in range(rank)):]
            shard, _ = st.reduce_encode(torch.cat([mine] * n), layout, rank)
            return torch.cat([shard] * n)

        gathered = stages()  # the first calls: the layout's maps and amax slots
        st.decode_gathered(gathered, layout, out=x, divide=n)
        counted["triton"] = counted["aten"] = 0
        with Aten():
            stages()
            st.decode_gathered(gathered, layout, out=x, divide=n)
        out.append((counted["triton"], counted["aten"] - 2))  # the stand-ins' two cats
    return out


CHILD = Child([__file__])  # this file run as a script: the checks above


@pytest.mark.child(CHILD)
def test_fused_fp8_kernels_are_bit_identical_to_the_torch_reference_under_the_interpreter():
    lines = CHILD.lines()
    assert lines[-1].startswith("launches "), "\n".join(lines)[-3000:]
    assert lines[:-1] == [], "\n".join(lines[:-1])
    # encode: amax + placed encode; owner: decode-sum-amax + placed encode; the decode with
    # its own flag; whatever N and the number of tensors, and no torch kernel around them
    assert lines[-1] == "launches [(5, 0), (5, 0), (5, 0)]"


def _reads(tiles) -> list[tuple[int, int, int]]:
    """``(element, group, its scale byte)`` of every element a placed tile map's programs
    read: element ``e`` of a tile ``(start, stop, g₀, length, run start, code₀, scale₀)`` is
    in group ``g₀ + (e − run start) // length``, whose FP32 scale (FP8) is at
    ``scale₀ + 4 (g − g₀)`` (``triton_fp8._tile``, ``_places``)."""
    return [(e, g0 + (e - run0) // size, scale0 + 4 * ((e - run0) // size))
            for start, stop, g0, size, run0, _, scale0 in tiles.tolist()
            for e in range(start, stop)]


@pytest.mark.parametrize("shapes,n", GATHERED_LAYOUTS + [([(0,), (5, 3)], 3)])
def test_the_gathered_decode_reads_every_scale_a_finite_check_would(shapes, n):
    """The fused gathered decode's flag is "every scale its programs read is finite": the
    same bits as a separate check over every scale of the records (the ``_finite_kernel``
    it replaced) because its tiles read each of them — every group has at least one
    element, padding has no scale — and its tiles' elements are the whole vector, each once
    (what its last program poisons is what a poisoned decode wrote). FP8: the scale bytes
    read are each record's first ``4 · groups``; block formats: every block's scale."""
    from geofp8.codecs import make_codec
    from geofp8.comm import ShardLayout
    from geofp8.comm.block_plan import BlockPlan

    cpu = torch.device("cpu")
    for fmt, scaling, block in GATHERED:
        codec = make_codec(fmt, scaling, block) if scaling else make_codec(fmt)
        layout = ShardLayout.build(shapes, codec, n, kernels="batched")
        if scaling:
            reads = _reads(layout.plan.tiles("gather", cpu))
            size = layout.max_shard_bytes
            assert {at for _, _, at in reads} == {
                j * size + 4 * k for j, count in enumerate(layout.plan.group_counts)
                for k in range(count)}, (fmt, shapes, n)
        else:
            placed = BlockPlan(layout).place("gather", cpu).p
            reads = _reads(placed.tiles)
            assert {g for _, g, _ in reads} == set(range(placed.n_groups)), (fmt, shapes, n)
        assert sorted(e for e, _, _ in reads) == list(range(layout.numel)), (fmt, shapes, n)


def test_a_kernel_that_fails_on_the_device_falls_back_to_torch_once_and_for_all(monkeypatch):
    import warnings

    import torch

    from geofp8.codecs import triton_fp8

    monkeypatch.setattr(triton_fp8, "_FAILED", [])
    monkeypatch.setattr(triton_fp8, "_INTERPRET", False)  # as on CUDA

    def broken():
        raise RuntimeError("PTX assembly failed")
    with pytest.warns(RuntimeWarning, match="falling back to the torch path"):
        assert triton_fp8.attempt(broken, lambda: "torch") == "torch"
    assert not triton_fp8.available(torch.zeros(1))
    tried = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once only
        assert triton_fp8.attempt(lambda: tried.append(1), lambda: "torch") == "torch"
    assert tried == []  # the kernels are not tried again


def test_a_launch_is_a_partial_of_the_kernels_run_with_no_python_of_its_own():
    import functools

    from geofp8.codecs import triton_fp8

    calls = []

    class Kernel:
        def run(self, *args, **kwargs):
            calls.append((args, kwargs))
    kernel = Kernel()
    launch = triton_fp8.Launch(kernel, (3,), maps_ptr="maps", TILE=8)
    bound = launch.bind(flat_ptr="flat")
    # functools.partial's own call (C): no frame of GeoFP8's per launch; bind flattens
    assert type(bound).__call__ is functools.partial.__call__
    assert isinstance(bound, triton_fp8.Launch) and bound.func == kernel.run
    bound("x", epoch=2)
    launch(flat_ptr="other")
    assert calls == [(("x",), {"grid": (3,), "warmup": False, "maps_ptr": "maps", "TILE": 8,
                               "flat_ptr": "flat", "epoch": 2}),
                     ((), {"grid": (3,), "warmup": False, "maps_ptr": "maps", "TILE": 8,
                           "flat_ptr": "other"})]


SCATTERED = [("e4m3", "tensor", None), ("e4m3", "row", None), ("e5m2", "block", 32),
             ("e4m3", "block", 128), ("nvfp4", None, None), ("mxfp4", None, None),
             ("mxfp8", None, None)]


def check_scatter() -> list[str]:
    """A reduce-scatter's end (``stages.reduce_scatter``: one kernel, the sum divided and
    its finite flag decided by its last program, the ticket) against the CPU's chunked
    path, bit for bit: every format (the block formats rounding to nearest and
    stochastically), N = 1 (E4M3), 3, 4, odd and empty shards; shard by shard divided by
    ``N`` into a given FP32 vector, not divided, or divided by 3 (not a power of two: IEEE,
    as a device scalar divides); a sender's non-finite input (NaN, -Inf) in the first
    group, in the last, a sum that overflows (+Inf), and clean before and after (the ticket
    zeroed by each call). The kernel runs for every shard but the block formats' empty
    ones (the torch path's)."""
    import torch

    from geofp8.codecs import make_codec
    from geofp8.comm import ShardLayout
    from geofp8.comm import stages as st
    from geofp8.comm.block_plan import BlockStages
    from geofp8.comm.plan import FP8Stages

    failures, rounds, ran = [], ("nearest", "stochastic"), []

    def counted(stage):
        def run(*args):
            done = stage(*args)
            ran.append(done is not None)
            return done
        return run
    stages = {cls: cls.reduce_scatter for cls in (FP8Stages, BlockStages)}
    for cls, stage in stages.items():
        cls.reduce_scatter = counted(stage)
    for (fmt, scaling, block), rounding, (shapes, n) in [
            (c, r, s) for c in SCATTERED for r in rounds[: 1 + (c[1] is None)]
            for s in GATHERED_LAYOUTS[0 if c == SCATTERED[0] else 1 :]]:
        codec = make_codec(fmt, scaling, block, rounding)
        fused, chunked = (ShardLayout.build(shapes, codec, n, kernels=k)
                          for k in ("batched", "chunked"))
        flags = []
        for first, last in ((None, None), ("nan", None), (None, "-inf"), ("3e38", "3e38"),
                            (None, None)):
            name = f"scatter {fmt}/{scaling}/{rounding} {shapes} N={n} {first} {last}"
            inputs = [_bucket(shapes, r, special=False) for r in range(n)]
            for x in inputs if first == last else inputs[:1]:  # (an overflow: every sender)
                x[0] = float(first) if first else x[0]
            inputs[-1][-1] = float(last) if last else inputs[-1][-1]
            sent = [st.encode(x, chunked, seed=5, sender=r) for r, x in enumerate(inputs)]
            cuts = [chunked.send_bytes(j) for j in range(n)]
            for j in range(n):
                received = torch.cat([x.split(cuts)[j] for x in sent])
                divide = (n, None, 3.0)[j % 3]
                out = torch.full((fused.shard_numel(j),), 7.0) if divide == n else None
                ran.clear()
                got, flag = st.reduce_scatter(received, fused, j, out=out, divide=divide)
                want, check = st.reduce_scatter(received, chunked, j, divide=divide)
                if ran != [fused.shard_numel(j) > 0 or fmt.startswith("e")]:
                    failures.append(f"{name} shard {j}: the kernel ran {ran}")
                if not same(got, want) or bool(flag) != bool(check) or \
                        bool(flag) != bool(want.isfinite().all()) or \
                        (out is not None and got is not out):
                    failures.append(f"{name} shard {j} divide={divide}: {bool(flag)}")
                flags.append(int(flag))
        if flags[:n] != [1] * n or flags[-n:] != [1] * n or all(flags[n:-n]):
            failures.append(f"scatter {fmt}/{scaling} {shapes} N={n}: flags {flags}")
    for cls, stage in stages.items():
        cls.reduce_scatter = stage
    return failures


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for failure in check() + check_stages() + check_feedback() + check_verdict() + \
            check_decision() + check_gathered() + check_scatter():
        print(failure)
    print(f"launches {launches()}")
