"""The fused Triton FP8 kernels (E4M3, E5M2) against the torch reference, interpreted.

``TRITON_INTERPRET=1`` must be set before the kernels are decorated, so the checks run in
a child process (this file run as a script) that sets it first; the test asserts that the
child found every case bit-identical (NaN where NaN: which NaN payload a product keeps
when both operands are NaN is the hardware's choice) and counts the kernels launched.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCALINGS = (("tensor", None), ("row", None), ("block", 128), ("block", 32))
FORMATS = ("e4m3", "e5m2")
SHAPES = ([(3, 300), (5,), (64, 40)], [(2001,)], [(7, 129), (1,)])  # odd, unequal, 1-element


def _same(a, b) -> bool:
    """Bitwise equal, any NaN where the other has a NaN."""
    import torch

    if a.dtype == torch.uint8:
        return torch.equal(a, b)
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(
        a.masked_fill(nan, 0).view(torch.int32), b.masked_fill(nan, 0).view(torch.int32))


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

    failures = []
    cases = [(fmt, c, s, n, f) for fmt in FORMATS for c in SCALINGS for s in SHAPES
             for f in (0, 1) for n in ((1, 3, 4) if s is SHAPES[0] and fmt == "e4m3" else (3,))]
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
            if not _same(got, want):
                failures.append(f"{name}: {what}")
        # (d): the decode
        value = triton_fp8.decode(torch.empty_like(u), codes, scales, groups, fmt)
        if not _same(value, ref_value):
            failures.append(f"{name}: decode")
        # (c): the owner's decode of N senders' copies and their FP32 sum in sender order
        refs = [triton_fp8.reference(x, groups, fmt) for x in xs]
        total = torch.zeros_like(xs[0])
        for _, _, v in refs:
            total += v
        got = triton_fp8.decode_sum(torch.stack([c for _, c, _ in refs]),
                                     torch.stack([s for s, _, _ in refs]), groups, n_senders,
                                     fmt)
        if not _same(got, total):
            failures.append(f"{name}: decode_sum")
        if n_senders <= 4 and not _same(got, torch.stack([v for _, _, v in refs]).sum(0)):
            failures.append(f"{name}: decode_sum vs torch's sum over senders")
    return failures


def check_collective() -> list[str]:
    """The exact collective's stages run with the fused kernels (the batched path picks them
    up on its own: :func:`triton_fp8.available`) against the CPU's chunked path."""

    from geofp8.codecs import make_codec, triton_fp8
    from geofp8.comm import ShardLayout
    from geofp8.comm.stages import encode_with_error, simulate_exact_allreduce

    calls = []
    encode = triton_fp8.encode
    triton_fp8.encode = lambda *args, **kwargs: calls.append(1) or encode(*args, **kwargs)
    failures = []
    for fmt, (scaling, block), n in ((f, c, n) for f in FORMATS for c in SCALINGS[:3]
                                     for n in ((1, 3, 4) if f == "e4m3" else (4,))):
        shapes = SHAPES[0]
        results, sent_and_error = [], []
        for kernels in ("batched", "chunked"):
            layout = ShardLayout.build(shapes, make_codec(fmt, scaling, block), n,
                                       kernels=kernels)
            inputs = [_bucket(shapes, r, special=False) for r in range(n)]
            results.append(simulate_exact_allreduce(inputs, layout))
            sent_and_error.append(encode_with_error(inputs[0], layout))  # a sender's EF
            inputs[-1][3] = float("nan")
            results.append(simulate_exact_allreduce(inputs, layout))
        if not (_same(results[0], results[2]) and _same(results[1], results[3])):
            failures.append(f"collective {fmt} {scaling}/{block} N={n}")
        (sent, error), (cpu_sent, cpu_error) = sent_and_error
        if not (_same(sent, cpu_sent) and _same(error, cpu_error)):
            failures.append(f"encode with error {fmt} {scaling}/{block} N={n}")
        if not results[1].isnan().all():
            failures.append(f"collective {fmt} {scaling}/{block} N={n}: not poisoned")
    triton_fp8.encode = encode
    if not calls:
        failures.append("the batched path did not run the fused kernels")
    return failures


def check_gpu_rows() -> list[str]:
    """``make gpu-check``'s fused-kernel rows, run on the CPU under the interpreter."""
    import torch

    from geofp8.tools import gpu_check

    gpu_check.DEVICE = torch.device("cpu")
    gpu_check.SHAPES = [(33, 65), (64, 33), (96,)]  # small: the interpreter is slow
    rows = []
    gpu_check.check_fused(rows)
    failures = [f"gpu-check {name}: {detail}" for name, detail, verdict in rows if verdict != "ok"]
    return failures + ([] if len(rows) == 12 else [f"gpu-check: {len(rows)} fused rows"])


def launches() -> tuple[int, int]:
    """``(Triton kernels, torch kernels)`` the fused path launches for the four stages of a
    bucket: a sender's encode with error feedback, the owner's decode-and-sum and
    re-encode, the decode of the gathered shards."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from geofp8.codecs import make_codec, triton_fp8
    from geofp8.codecs.base import GroupMap

    counted = {"triton": 0, "aten": 0, "inside": False}
    for kernel in ("_amax_kernel", "_scales_kernel", "_encode_kernel", "_decode_kernel",
                   "_decode_sum_kernel"):
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
                    "aten::empty", "aten::empty_like", "aten::empty_strided")):
                counted["aten"] += 1
            return func(*args, **(kwargs or {}))

    codec = make_codec("e4m3", "block", 128)
    groups = GroupMap([[codec.groups((64, 300))]])
    x, residual = torch.randn(64 * 300), torch.zeros(64 * 300)
    triton_fp8.tiles(groups, x.device)  # the map, made once per layout
    received = triton_fp8.encode(*triton_fp8.amax(x, groups), groups)[0]
    received, scales = torch.stack([received] * 3), torch.stack([x.new_ones(150)] * 3)
    counted["triton"] = 0
    with Aten():  # all four stages (one map for brevity: the kernels do not care)
        u, s = triton_fp8.amax(x, groups, residual)  # the sender: EF add, scales
        triton_fp8.encode(u, s, groups, error=True)  # its codes and rounding error
        total = triton_fp8.decode_sum(received, scales, groups, 3)  # the owner
        total, s = triton_fp8.amax(total, groups)
        codes, _ = triton_fp8.encode(total, s, groups)
        triton_fp8.decode(total, codes, s, groups)  # every rank, the gathered shards
    return counted["triton"], counted["aten"]


def test_fused_fp8_kernels_are_bit_identical_to_the_torch_reference_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[-1].startswith("launches "), done.stdout[-3000:]
    assert lines[:-1] == [], "\n".join(lines[:-1])
    # twice (amax + scales + encode, a zeroed [G] buffer), decode-and-sum, decode
    assert lines[-1] == "launches triton 8 aten 2"


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for failure in check() + check_collective() + check_gpu_rows():
        print(failure)
    print(f"launches triton {launches()[0]} aten {launches()[1]}")
