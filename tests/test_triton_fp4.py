"""The fused Triton kernels of NVFP4, MXFP4 and MXFP8 against the torch reference, interpreted.

As ``test_triton_fp8.py``: ``TRITON_INTERPRET=1`` must be set before the kernels are
decorated, so the checks run in a child process (this file run as a script). The child
compares every output bitwise (NaN where NaN) with the codecs' torch path
(:func:`triton_fp4.torch_only`) and prints the failures; the test asserts there are none
and counts the kernels launched.
"""

from __future__ import annotations

import math
import os

import pytest

from bitwise import same
from interpreted import Child

pytest.importorskip("triton")

FORMATS = ("nvfp4", "mxfp4", "mxfp8")
# odd and unequal tensors (blocks cut short, segments of odd length), one element
SHAPES = ([(3, 37), (5,), (16, 4)], [(7, 9), (1,), (40,)])


def _bucket(n: int, seed: int, special: bool):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-30, 30, n).flip(0)
    x[n // 3 : n // 3 + 40] = 0  # zero blocks
    x[n // 2] = 1e-40  # a subnormal
    x[n // 4 : n // 4 + 8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.0])
    if special:
        x[5], x[n - 2], x[n // 2 + 1] = float("nan"), float("-inf"), float("inf")
    return x


def _shards(codec, shapes, n_shards: int):
    """Every tensor cut into ``n_shards`` chunks at block boundaries, chunk ``j`` of every
    tensor in shard ``j`` (odd chunks: the last one short)."""
    from geofp8.codecs.base import GroupMap

    shards = [[] for _ in range(n_shards)]
    for shape in shapes:
        blocks = codec.groups(shape)
        per = -(-len(blocks) // n_shards)
        for j in range(n_shards):
            shards[j].append(blocks[j * per : (j + 1) * per])
    return GroupMap(shards)


def check() -> list[str]:
    import torch

    from geofp8.codecs import make_codec, triton_fp4

    failures = []
    for fmt, rounding in ((f, r) for f in FORMATS for r in ("nearest", "stochastic")):
        codec = make_codec(fmt, rounding=rounding)
        for shapes, n_shards in ((SHAPES[0], 1), (SHAPES[1], 3)):
            if rounding == "stochastic" and n_shards == 1:
                continue
            groups = _shards(codec, shapes, n_shards)
            numel = sum(groups.numels)
            for special in (False, True):
                name = f"{fmt}/{rounding} {shapes} shards={n_shards} special={special}"
                x = _bucket(numel, numel + n_shards, special)
                # (a)+(b) through the codec: scales, codes, the sender's rounding error
                if rounding == "stochastic":  # the seeded draw (the error is nearest's)
                    seeds = [7, None, 2**62 + 5][:n_shards]
                    parts = codec.encode_shards(x, groups, seeds)
                    with triton_fp4.torch_only():
                        want = codec.encode_shards(x, groups, seeds)
                else:
                    parts, error = codec.encode_shards_with_error(x, groups)
                    with triton_fp4.torch_only():
                        want, want_error = codec.encode_shards_with_error(x, groups)
                    if not same(error, want_error):
                        failures.append(f"{name}: error")
                if not all(same(a, b) for a, b in zip(parts, want, strict=True)):
                    failures.append(f"{name}: payload")
                # (d): decode, its finite flag, poison (the same kernels for either rounding)
                for poison in () if rounding == "stochastic" else (False, True)[: 1 + special]:
                    out = torch.empty(numel)
                    flag = codec.decode_shards(out, parts, groups, poison=poison)
                    with triton_fp4.torch_only():
                        ref = torch.empty(numel)
                        want_flag = codec.decode_shards(ref, want, groups, poison=poison)
                    if not (same(out, ref) and (flag is None) == (want_flag is None)
                            and (flag is None or bool(flag) == bool(want_flag) != special)):
                        failures.append(f"{name}: decode poison={poison}")
        if rounding == "stochastic":
            continue
        # the error feedback add in the amax pass, the rounding error in the encoding pass
        r = torch.randn(numel) * 1e-3
        enc = triton_fp4.encode(x, groups, fmt, residual=r, error=True)
        with triton_fp4.torch_only():
            want, want_error = codec.encode_shards_with_error(x + r, groups)
        k = len(want) // len(groups)  # parts per shard: the codes are the last
        if not (same(enc.u, x + r) and same(enc.error, want_error)
                and same(enc.codes, torch.cat(want[k - 1 :: k]))):
            failures.append(f"{fmt}: encode with the residual")
        failures += _check_sum(codec, groups, fmt, f"{fmt} {shapes} shards={n_shards}")
    return failures


def _check_sum(codec, groups, fmt, name) -> list[str]:
    """(c): ``N`` senders' payloads of one shard map decoded and summed (one with NaN and
    ±Inf)."""
    import torch

    from geofp8.codecs import triton_fp4

    failures = []
    numel = sum(groups.numels)
    for n_senders in (1, 3, 4):
        xs = [_bucket(numel, 7 * r + 1, special=r == 2) for r in range(n_senders)]
        with triton_fp4.torch_only():
            payloads = [codec.encode_shards(x, groups, [None] * len(groups)) for x in xs]
        k = 3 if fmt == "nvfp4" else 2
        rows = [torch.stack([torch.cat(p[i::k]) for p in payloads]) for i in range(k)]
        if k == 3:
            rows[0] = rows[0].view(torch.float32)
        else:
            rows.insert(0, None)
        got = triton_fp4.decode_sum(groups, fmt, rows[1], rows[2], rows[0])
        want = torch.zeros(numel)
        with triton_fp4.torch_only():
            for p in payloads:  # the torch path's decode, then the sum in sender order
                values = torch.empty(numel)
                codec.decode_shards(values, p, groups, check=False)
                want += values
        if not same(got, want):
            failures.append(f"{name}: decode_sum N={n_senders}")
    return failures


# (format, rounding, N, NaN and ±Inf on the last sender: every value NaN then)
COLLECTIVES = (("nvfp4", "nearest", 4, False), ("nvfp4", "stochastic", 3, True),
               ("mxfp4", "nearest", 3, True), ("mxfp4", "stochastic", 1, False),
               ("mxfp8", "stochastic", 3, False), ("mxfp8", "nearest", 4, True))


def _counted(module, names: tuple[str, ...]) -> dict[str, int]:
    """Calls of ``module``'s (or a class's) functions ``names`` counted from now on (a
    wrapper each)."""
    calls = dict.fromkeys(names, 0)

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper
    for name in names:
        setattr(module, name, counting(name, getattr(module, name)))
    return calls


def check_codecs() -> list[str]:
    """The exact collective of a block-scaled layout on the batched path (the placed stages
    of :class:`geofp8.comm.block_plan.BlockStages`: sender, owner, gathered decode) against
    the CPU's chunked path, both roundings (a seeded step), N = 1, 3, 4, odd shards, a NaN
    and ±Inf on one sender (every value NaN then) for each format."""
    from geofp8.codecs import make_codec
    from geofp8.comm import ShardLayout, block_plan
    from geofp8.comm.stages import simulate_exact_allreduce

    calls = _counted(block_plan.BlockStages, ("send", "reduce_encode", "decode_gathered"))
    failures = []
    shapes = SHAPES[1]
    numel = sum(math.prod(s) for s in shapes)
    for fmt, rounding, n, special in COLLECTIVES:
        codec = make_codec(fmt, rounding=rounding)
        inputs = [_bucket(numel, r, special=special and r == n - 1) for r in range(n)]
        results = [simulate_exact_allreduce(inputs, ShardLayout.build(
            shapes, codec, n, kernels=kernels), seed=11) for kernels in ("batched", "chunked")]
        if not same(*results):
            failures.append(f"collective {fmt}/{rounding} N={n} special={special}")
    runs = sum(n for _, _, n, _ in COLLECTIVES)
    if list(calls.values()) != [runs, runs, len(COLLECTIVES)]:
        failures.append(f"the placed stages ran {calls}")
    return failures


def check_feedback() -> list[str]:
    """The sender's stage with error feedback ``(R, keep)`` (:func:`stages.encode_with_error`
    on a batched layout: the placed kernels) against the torch path: the send buffer, the
    new residual in R's dtype (BF16 to nearest even or FP32), the bucket not written, for
    keep true, false and ``None``, with NaN and ±Inf in the bucket; and the gathered
    decode with ``/ N`` and without, its flag and the poison."""
    import torch

    from geofp8.codecs import make_codec
    from geofp8.comm import ShardLayout
    from geofp8.comm.stages import decode_gathered_flagged, encode_with_error

    failures, shapes = [], SHAPES[0]
    numel = sum(math.prod(s) for s in shapes)
    for fmt, n in (("nvfp4", 3), ("mxfp4", 4), ("mxfp8", 3)):
        fused, chunked = (ShardLayout.build(shapes, make_codec(fmt), n, kernels=k)
                          for k in ("batched", "chunked"))
        sents = []
        for dtype, keep, special in ((torch.bfloat16, True, False), (torch.float32, False, True),
                                     (torch.bfloat16, None, True)):
            x = _bucket(numel, 3, special)
            r = (torch.randn(numel) * 1e-2).to(dtype)
            flag = None if keep is None else torch.tensor(keep)
            got_x, got_r = x.clone(), r.clone()
            sent, error = encode_with_error(got_x, fused, feedback=(got_r, flag))
            sents.append(sent)
            want_x = x + (r if keep is not False else torch.zeros_like(r))
            want_sent, want_error = encode_with_error(want_x.clone(), chunked)
            if not (same(sent, want_sent) and error is got_r and same(got_x, x)
                    and same(got_r.float(), want_error.to(dtype).float())):
                failures.append(f"feedback {fmt} R={dtype} keep={keep} special={special}")
        for sent in sents:  # N padded records (a send buffer's bytes: any will do), clean or not
            gathered = torch.zeros(n, fused.max_shard_bytes, dtype=torch.uint8)
            for j in range(n):
                gathered[j, : fused.shard_bytes(j)] = sent[: fused.shard_bytes(j)]
            for divide in (n, None, n):  # the same bound stages, each divisor bound once
                (got, finite), (want, _) = (decode_gathered_flagged(gathered, lay,
                                                                    divide=divide)
                                            for lay in (fused, chunked))
                if not (same(got, want) and bool(finite) == bool(torch.isfinite(want).all())):
                    failures.append(f"gathered decode {fmt} N={n} divide={divide}")
    return failures


# (the collectives above run every owner too, clean or with a poisoned sum)
OWNER_CASES = (("nvfp4", "nearest", 1), ("nvfp4", "stochastic", 5), ("mxfp4", "nearest", 5))


def check_owner() -> list[str]:
    """Every owner's stages 3 and 4 record to record (``BlockStages.reduce_encode``, taken
    by :func:`stages.reduce_encode` on a batched layout; :func:`stages.decode_sum` and
    :func:`stages.encode_reduced` with its error) against the CPU's chunked path: the
    record, the sum and the error, bitwise, odd shards, with NaN and ±Inf in one sender's
    input."""
    import torch

    from geofp8.codecs import make_codec
    from geofp8.comm import ShardLayout, block_plan
    from geofp8.comm.stages import decode_sum, encode, encode_reduced, reduce_encode

    calls = _counted(block_plan.BlockStages, ("reduce_encode", "reduce_sum", "encode_reduced"))
    failures, shapes = [], SHAPES[1]
    numel = sum(math.prod(s) for s in shapes)
    for fmt, rounding, n in OWNER_CASES:
        codec = make_codec(fmt, rounding=rounding)
        fused, chunked = (ShardLayout.build(shapes, codec, n, kernels=k)
                          for k in ("batched", "chunked"))
        sent = [encode(_bucket(numel, r, special=r == 1), chunked, seed=5, sender=r)
                for r in range(n)]
        start = 0
        for j in range(n):
            size = chunked.send_bytes(j)
            received = torch.cat([s[start : start + size] for s in sent])
            start += size
            got, want = (reduce_encode(received, lay, j, seed=5) for lay in (fused, chunked))
            if not (same(got[0], want[0]) and same(got[1], want[1])):
                failures.append(f"owner {fmt}/{rounding} N={n} shard {j}")
            # a reduce-scatter's end, and a sum re-encoded with its error over it
            sums = [decode_sum(received, lay, j) for lay in (fused, chunked)]
            records = [encode_reduced(t, lay, j, seed=5, error_out=t)
                       for t, lay in zip(sums, (fused, chunked))]
            if not (same(*records) and same(*sums)):
                failures.append(f"owner's decode_sum, encode_reduced {fmt}/{rounding} N={n}")
    shards = sum(n for *_, n in OWNER_CASES)
    if calls != {"reduce_encode": shards, "reduce_sum": shards, "encode_reduced": shards}:
        failures.append(f"the owner's record-to-record kernels ran {calls} times")
    return failures


def launches(fmt: str, rounding: str = "nearest") -> tuple[tuple[int, int], ...] | set:
    """``((Triton kernels, torch kernels) of the sender's stage with error feedback, of the
    owner's, of the gathered decode)`` of a bucket as :mod:`geofp8.comm.stages` runs them,
    counted without running them (no count depends on the data); the same for N = 3 and 5
    and buckets of 2 and 4 tensors (else the set of counts seen)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from geofp8.codecs import make_codec, triton_fp4
    from geofp8.comm import ShardLayout
    from geofp8.comm.stages import decode_gathered_flagged, encode_with_error, reduce_encode

    counted = {"triton": 0, "aten": 0}

    class Aten(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not (func.is_view or func._schema.name in (
                    "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty")):
                counted["aten"] += 1
            return func(*args, **(kwargs or {}))

    def stages(layout, x, r, keep, received, gathered) -> list[tuple[int, int]]:
        counts = []
        for stage in (lambda: encode_with_error(x, layout, seed=3, feedback=(r, keep)),
                      lambda: reduce_encode(received, layout, 0, seed=3),
                      lambda: decode_gathered_flagged(gathered, layout, divide=2)):
            counted["triton"] = counted["aten"] = 0
            with Aten():
                stage()
            counts.append((counted["triton"], counted["aten"]))
        return counts

    runs = {}
    for name in dir(triton_fp4):
        if name.endswith("_kernel"):
            kernel = getattr(triton_fp4, name)
            runs[kernel] = kernel.run
            kernel.run = lambda *a, **k: counted.__setitem__("triton", counted["triton"] + 1)
    seen = set()
    for shapes, n in (([(64, 300), (5,)], 3), ([(7, 9), (1,), (40,), (33, 3)], 5)):
        layout = ShardLayout.build(shapes, make_codec(fmt, rounding=rounding), n,
                                   kernels="batched")
        x = torch.randn(layout.numel)
        r, keep = torch.zeros(layout.numel, dtype=torch.bfloat16), torch.tensor(True)
        received = torch.zeros(n * layout.send_bytes(0), dtype=torch.uint8)
        gathered = torch.zeros(n, layout.max_shard_bytes, dtype=torch.uint8)
        stages(layout, x, r, keep, received, gathered)  # the layout's maps, made once
        seen.add(tuple(stages(layout, x, r, keep, received, gathered)))
    for kernel, run in runs.items():
        kernel.run = run
    return seen.pop() if len(seen) == 1 else seen


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for failure in (check() + check_codecs() + check_feedback() + check_owner()):
        print(failure)
    print("stochastic", *(launches(fmt, "stochastic") for fmt in FORMATS))
    print("launches", *(launches(fmt) for fmt in FORMATS))


CHILD = Child([__file__])  # this file run as a script: the checks above


@pytest.mark.child(CHILD)
def test_fused_block_kernels_are_bit_identical_to_the_torch_reference_under_the_interpreter():
    lines = CHILD.lines()
    assert lines[:-2] == [], "\n".join(lines)
    # (Triton, torch) per stage of a bucket (sender with error feedback, owner, gathered
    # decode) for every format: two kernels each, the decode one (its own finite flag),
    # five a bucket, no torch kernel, whatever the number of tensors or ranks (it was
    # 4 + 7 / 6 + 1 / 2 + ~10 NVFP4 through the codecs' parts and the record-to-record
    # owner, then 2 / 2 / 2)
    assert lines[-1] == "launches" + " ((2, 0), (2, 0), (1, 0))" * 3
    # rounding: the same, the step's seed a kernel scalar (nothing copied)
    assert lines[-2] == "stochastic" + " ((2, 0), (2, 0), (1, 0))" * 3


def test_a_kernel_failure_on_the_device_falls_back_to_torch_once_and_warns_once(monkeypatch):
    import warnings

    import torch

    from geofp8.codecs import make_codec, triton_fp4, triton_fp8

    codec = make_codec("nvfp4")
    groups = _shards(codec, SHAPES[0], 2)
    x = _bucket(sum(groups.numels), 0, special=False)
    want = codec.encode_shards(x, groups, [None, None])  # the torch path (no device here)
    tries = []

    def failing(*args, **kwargs):
        tries.append(1)
        raise RuntimeError("triton.compiler.errors.CompilationError: stand-in")

    # a CUDA device where the kernels fail to compile: its stand-in, the CPU
    monkeypatch.setattr(triton_fp8, "available", lambda *tensors: True)
    monkeypatch.setattr(triton_fp4, "_INTERPRET", False)
    monkeypatch.setattr(triton_fp4, "encode", failing)
    monkeypatch.setitem(triton_fp4._STATE, "broken", False)
    assert triton_fp4.available(x)
    with pytest.warns(RuntimeWarning, match="torch path runs from now on"):
        got = codec.encode_shards(x, groups, [None, None])
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert not triton_fp4.available(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning, no second try
        got = codec.encode_shards(x, groups, [None, None])
        out = torch.empty_like(x)
        assert codec.decode_shards(out, got, groups)
    assert tries == [1]


def test_stochastic_uniforms_are_the_same_bits_from_the_native_kernel_and_torch(monkeypatch):
    """The counter-based draw (:mod:`geofp8.codecs.uniforms`): the CPU's native kernel and
    the torch ops (what CUDA's fallback runs; the Triton kernels compute the same formula,
    checked in the interpreter run above) give the same bits, past the 2³² wrap of the
    counter; the first values are pinned, so neither can drift alone."""
    import torch

    from geofp8.codecs import native, uniforms

    keys = [(0, 0), (0xFFFFFFFF, 123), uniforms.key_halves(2**62 + 5, 7)]
    got = [uniforms.uniforms_into(torch.empty(n), k) for k in keys for n in (1, 1001, 300_001)]
    monkeypatch.setattr(native, "usable", lambda *tensors: False)
    want = [uniforms.uniforms_into(torch.empty(n), k) for k in keys for n in (1, 1001, 300_001)]
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(got, want))
    assert got[2][:3].tolist() == [0.0, 0.3474927544593811, 0.21226495504379272]
    assert got[8][:3].tolist() == [0.17684894800186157, 0.2809346318244934, 0.8421403765678406]
    u = torch.cat(got)
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0 and abs(float(u.mean()) - 0.5) < 0.01
