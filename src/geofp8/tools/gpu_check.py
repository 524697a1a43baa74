"""``make gpu-check``: GeoFP8 on one NVIDIA GPU, in a few minutes, one table, fail on error.

Run it where a CUDA build of torch is installed (no network needed)::

    PYTHONPATH=src python3 -m geofp8.tools.gpu_check

1. Codecs: every format, scaling and rounding; the round trip and the single-process
   simulation of the exact collective at ``N = 4`` (the same stage code the real collective
   runs) on the device against the CPU, bitwise (stochastic rounding too: its uniforms are
   a counter-based hash, :mod:`geofp8.codecs.uniforms`, the same numbers on every device).
   The fused Triton kernels (:mod:`geofp8.codecs.triton_fp8`, :mod:`~geofp8.codecs.triton_fp4`,
   the grouped low-rank maps of :mod:`~geofp8.codecs.triton_map`), kernel by kernel against
   the torch reference on the device, and one 25 MB bucket's
   fused stages timed for E4M3 and for NVFP4.
2. Transforms: every kind maps back (``T⁻¹(T(G)) ≈ G``) on the device.
3. Methods: every geofp8 row of :data:`geofp8.methods.METHODS`, one ordinary step simulated
   at ``N = 4`` (map, encode, all-to-all stages, FP32 sum, re-encode, decode, map back) on
   the device against the CPU: bitwise for Euclidean rows, else within a tenth of the
   step's own quantization error (GEMMs round differently on the GPU).
4. A world-size-1 NCCL training run of every method of :data:`METHODS` on a small Llama,
   with a refresh and an auto / profile decision inside it (``refresh_every=2``,
   ``profile_steps=2``), checking that the loss stays finite and GeoFP8's counters advance.
5. Throughput on the GPU: quantize + dequantize of every codec, and the low-rank transform,
   against a device-to-device copy of the same bytes (ratios, timed with CUDA events).

Every row reports its own failure and the next one runs. Exit status: 0 if every row
passed, 1 if any failed, 2 if no CUDA device is visible.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import inspect
import itertools
import os
import socket
import sys
import time
import traceback

import torch

DEVICE = torch.device("cuda")  # where the checks run (a test may put a stand-in here)
WORLD = 4  # ranks of the simulated collective
SHAPES = [(257, 1031), (64, 33), (96,)]  # a bucket: shard cuts inside rows and blocks
NO_TRITON = ("triton does not import: pip install -e '.[gpu]' in a checkout "
             "(pip install 'geofp8[gpu]' from a wheel)")
# what every method's run takes its part of (Method.takes): a refresh and an auto / profile
# decision inside six steps; the byte budget's methods need a budget (no default)
SETTINGS = {"refresh_every": 2, "profile_steps": 2, "budget": 0.85}


def _no_kernels(module) -> str:
    """Why ``module``'s fused kernels do not run on :data:`DEVICE`."""
    from ..codecs import triton_fp8

    if triton_fp8.triton is None:
        return NO_TRITON
    broken = triton_fp8._FAILED or getattr(module, "_STATE", {}).get("broken")
    failed = "; a kernel failed on it before (warned then)" if broken else ""
    return (f"{module.__name__.rsplit('.', 1)[-1]} does not run on {DEVICE} (CUDA, or the "
            f"CPU under TRITON_INTERPRET=1){failed}")
GOAL_US = {"e4m3": 100.0, "nvfp4": 150.0}  # issue 40: one 25 MB bucket's stages, one rank
BUCKET_NUMEL = 25 << 20 >> 2  # the timed bucket: 25 MiB of FP32


def cuda_seconds(fn, repeats: int = 20) -> float:
    """Median seconds of ``fn`` on the current CUDA stream (CUDA events)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def _row(rows: list, name: str, check) -> None:
    """Run ``check() -> (detail, ok)``; an exception is this row's failure, not the table's.
    ``ok``: a bool (``ok`` / ``FAIL``) or the verdict itself (``SLOW``: a goal missed)."""
    try:
        detail, ok = check()
        rows.append((name, detail, ok if isinstance(ok, str) else "ok" if ok else "FAIL"))
    except Exception:  # noqa: BLE001 - report and go on, the table fails at the end
        rows.append((name, traceback.format_exc().splitlines()[-1], "FAIL"))


def _norm(t: torch.Tensor) -> float:
    return float(t.double().cpu().norm())


def bucket(rank: int, shapes) -> torch.Tensor:
    """One rank's flat bucket: each tensor at its own magnitude (per-tensor scales differ)."""
    g = torch.Generator().manual_seed(rank)
    return torch.cat([torch.randn(s, generator=g).reshape(-1) * 10.0 ** (i - 1)
                      for i, s in enumerate(shapes)])


def _compare(got: torch.Tensor, cpu: torch.Tensor, exact: torch.Tensor,
             bitwise: bool) -> tuple[str, bool]:
    """``(detail, ok)`` of a device result against the CPU's and the exact FP32 value."""
    got = got.to("cpu")
    if bitwise:
        same = torch.equal(got.view(torch.int32), cpu.view(torch.int32))
        return ("CUDA == CPU bitwise" if same else
                f"CUDA != CPU (‖Δ‖/‖CPU‖ = {_norm(got - cpu) / _norm(cpu):.1e})"), same
    err_cpu = _norm(cpu - exact)
    diff = _norm(got - cpu) / err_cpu
    return f"‖CUDA − CPU‖ = {diff:.2f}× the step's own error", diff <= 0.1


def check_codecs(rows: list) -> None:
    from ..codecs import FORMATS, SCALINGS, make_codec
    from ..comm import ShardLayout, simulate_exact_allreduce

    inputs = [bucket(r, SHAPES) for r in range(WORLD)]
    exact = torch.stack(inputs).sum(0)
    whole = inputs[0][: SHAPES[0][0] * SHAPES[0][1]].view(SHAPES[0])
    for fmt in FORMATS:
        fp8 = fmt in ("e4m3", "e5m2")
        for scaling in SCALINGS if fp8 else (None,):
            for rounding in ("nearest",) if fp8 else ("nearest", "stochastic"):
                codec = make_codec(fmt, scaling, 32, rounding)
                layout = ShardLayout.build(SHAPES, codec, WORLD)
                name = f"codec {fmt}/{scaling or 'block'}/{rounding}"
                stochastic = rounding == "stochastic"

                def trip(codec=codec):
                    return _compare(codec.round_trip(whole.to(DEVICE)), codec.round_trip(whole),
                                    whole, True)

                def sim(layout=layout):
                    got = simulate_exact_allreduce([x.to(DEVICE) for x in inputs], layout,
                                                   seed=7)
                    cpu = simulate_exact_allreduce(inputs, layout, seed=7)
                    return _compare(got, cpu, exact, True)

                if not stochastic:
                    _row(rows, f"{name} round trip", trip)
                _row(rows, f"{name} N={WORLD} stages", sim)


def check_transforms(rows: list) -> None:
    from ..geometry.factory import TRANSFORMS, make_transform
    from ..geometry.statistics import LowRankFactor

    g = torch.Generator().manual_seed(1)
    X = torch.randn(2048, 256, generator=g) @ torch.randn(256, 256, generator=g)
    A = (X.T @ X / X.shape[0]).to(DEVICE)
    S = torch.eye(128, device=DEVICE) + 0.1
    G = torch.randn(128, 256, generator=g).to(DEVICE)
    for kind in TRANSFORMS:
        def trip(kind=kind):
            t = make_transform(kind, 0.1, A=A, S=S, dim=256, block=64,
                               factor=LowRankFactor.from_matrix(A, 32)
                               if kind == "lowrank" else None)
            err = _norm(t.inverse(t.forward(G)) - G) / _norm(G)
            return f"round trip {err:.1e}", err < 1e-3
        _row(rows, f"transform {kind}", trip)


def method_maps(config, layers: dict, device, codec_block: int) -> dict:
    """Every layer's map under ``config``, built as its factor source builds it, on
    ``device``: the fixed rotations by the source itself, the others from statistics of
    seeded inputs (``A = E[x xᵀ]``, exact or sketched as the source keeps it; ``S``)."""
    from ..geometry.factory import make_transform, needs
    from ..geometry.sources import make_source
    from ..geometry.statistics import SecondMoment
    from ..geometry.transforms import IDENTITY

    kind = str(config.transform)
    if kind in ("hadamard", "rht"):
        source = make_source(config, layers, None, None, dict.fromkeys(layers, device),
                             codec_block)
        return {n: source.transform(n) for n in layers}
    if kind == "euclidean" or str(config.layers) == "none":
        return dict.fromkeys(layers, IDENTITY)
    mode = "exact" if str(config.factor_source) == "refresh" else "sketch"
    maps = {}
    for i, (name, layer) in enumerate(layers.items()):
        g = torch.Generator().manual_seed(100 + i)
        X = torch.randn(512, layer.d_in, generator=g) @ torch.randn(layer.d_in, layer.d_in,
                                                                     generator=g)
        A = SecondMoment(layer.d_in, mode, sketch_size=config.k + config.oversample,
                         device=device)
        A.update(X.to(device))
        S = SecondMoment(layer.d_out, "exact", device=device)
        S.update(torch.randn(512, layer.d_out, generator=g).to(device))
        maps[name] = make_transform(
            kind, config.damping, block=config.transform_block or 128,
            factor=A.factor(min(config.k, layer.d_in)) if kind == "lowrank" else None,
            A=A.mean() if "A" in needs(kind) else None,
            S=S.mean() if "S" in needs(kind) else None)
    return maps


def method_step(maps: dict, shapes, grads, layout, seed: int | None) -> list[torch.Tensor]:
    """One ordinary step of the exact collective, simulated in one process (rank ``r``
    holds ``grads[r]``; the first ``len(maps)`` tensors are the mapped layers, in order):
    ``Ĝ_p = (Σ_r deq(Q(G_{p,r} T_p)) / N) T_p⁻¹``, with the stages the real one runs."""
    from ..comm import simulate_exact_allreduce

    names = list(maps) + [None] * (len(shapes) - len(maps))
    inputs = [torch.cat([(g if n is None else maps[n].forward(g)).reshape(-1)
                         for n, g in zip(names, rank_grads)]) for rank_grads in grads]
    total = simulate_exact_allreduce(inputs, layout, seed)
    total = total.div_(total.new_full((), len(grads)))
    out, pos = [], 0
    for name, shape in zip(names, shapes):
        n = torch.Size(shape).numel()
        y = total[pos : pos + n].view(shape)
        out.append(y if name is None else maps[name].inverse(y))
        pos += n
    return out


def _moved(t, device):
    """The map ``t`` with its tensors on ``device`` (the identity is shared)."""
    from ..geometry.transforms import IDENTITY, transform_from_state

    if t is IDENTITY:
        return t
    return transform_from_state(t.name, {k: v.to(device) for k, v in t.state().items()})


def check_methods(rows: list) -> None:
    from ..codecs import make_codec
    from ..comm import ShardLayout
    from ..geometry.sources import Layer
    from ..geometry.transforms import IDENTITY
    from ..methods import METHODS

    layers = {f"{m}.weight": Layer(m, f"{m}.weight", 256, d_out)
              for m, d_out in (("a", 384), ("b", 192))}
    shapes = [(384, 256), (192, 256), (33,)]
    grads = [[torch.randn(s, generator=torch.Generator().manual_seed(10 * r + i))
              for i, s in enumerate(shapes)] for r in range(WORLD)]
    exact = torch.cat([sum(g[i] for g in grads).reshape(-1) / WORLD
                       for i in range(len(shapes))])
    for method, spec in METHODS.items():
        if spec.kind != "geofp8":
            continue

        def step(spec=spec):
            config = spec.config(**spec.takes(**SETTINGS))
            codec = make_codec(config.format, config.scaling, config.block_size,
                               config.rounding)
            layout = ShardLayout.build(shapes, codec, WORLD)
            maps = method_maps(config, layers, "cpu", codec.block_size)
            cpu = method_step(maps, shapes, grads, layout, 3)
            on_dev = {n: _moved(t, DEVICE) for n, t in maps.items()}
            got = method_step(on_dev, shapes, [[g.to(DEVICE) for g in r] for r in grads],
                              layout, 3)
            flat = [torch.cat([t.reshape(-1) for t in out]) for out in (got, cpu)]
            identity = all(t is IDENTITY for t in maps.values())
            return _compare(flat[0], flat[1], exact, identity)

        _row(rows, f"step {method} N={WORLD}", step)


def _train_worker(method: str, port: int) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ..methods import METHODS
    from .models import build_preset
    from .train.launch import end_process_group

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))
    try:
        torch.manual_seed(0)
        model = build_preset("llama-tiny", 256).cuda()
        spec = METHODS[method]
        ddp = DDP(model, device_ids=[0], bucket_cap_mb=1024 if spec.one_bucket else 1)
        state, hook, _ = spec.build(model, **spec.takes(**SETTINGS))
        ddp.register_comm_hook(state, hook)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(0)
        losses = []
        for _ in range(6):
            x = torch.randint(0, 256, (4, 64), generator=g).cuda()
            loss = ddp(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
        stats = state.stats() if hasattr(state, "stats") else {}
        return {"losses": losses, "step": stats.get("step"),
                "geometry": len(stats.get("geometry_layers", []))}
    finally:
        end_process_group(completed=False)  # one rank: nothing to wait for


def check_training(rows: list) -> None:
    from ..methods import METHODS

    for method in METHODS:
        def train(method=method):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            out = _train_worker(method, port)
            finite = all(torch.isfinite(torch.tensor(out["losses"])))
            counted = out["step"] in (None, 6)
            return (f"loss {out['losses'][0]:.3f} → {out['losses'][-1]:.3f}, "
                    f"geometry layers {out['geometry']}"), finite and counted
        _row(rows, f"train {method}", train)


def _bits_equal(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bitwise equal, any NaN where the other has one (which NaN a product of two keeps is
    the kernel's choice)."""
    if not got.is_floating_point():
        return torch.equal(got, want)
    bits = {2: torch.int16, 4: torch.int32}[got.element_size()]
    nan = got.isnan()
    return torch.equal(nan, want.isnan()) and torch.equal(
        got.masked_fill(nan, 0).view(bits), want.masked_fill(nan, 0).view(bits))


def check_fused(rows: list) -> None:
    """Every fused Triton kernel (:mod:`geofp8.codecs.triton_fp8`) against the torch
    reference on the device, bitwise, for E4M3 and E5M2 and each scaling; then one 25 MB
    bucket's fused stages timed against a device-to-device copy (the HBM's reach)."""
    from ..codecs import make_codec, triton_fp8
    from ..codecs.groups import GroupMap

    if not triton_fp8.available(torch.zeros(1, device=DEVICE)):
        rows.append(("fused kernels", _no_kernels(triton_fp8), "FAIL"))
        return
    inputs = [bucket(r, SHAPES).to(DEVICE) for r in range(WORLD)]
    inputs[1][5] = float("nan")  # a non-finite group on one sender
    for fmt, scaling in ((f, s) for f in ("e4m3", "e5m2") for s in ("tensor", "row", "block")):
        groups = GroupMap([[make_codec(fmt, scaling, 32).groups(s) for s in SHAPES]])
        residual = torch.randn_like(inputs[0]) * 1e-2

        def encode(groups=groups, residual=residual, fmt=fmt):
            u, scales = triton_fp8.amax(inputs[0], groups, residual, fmt)
            codes, error = triton_fp8.encode(u, scales, groups, error=True, fmt=fmt)
            ref_scales, ref_codes, ref_values = triton_fp8.reference(u, groups, fmt)
            ok = [_bits_equal(u, inputs[0] + residual), _bits_equal(scales, ref_scales),
                  _bits_equal(codes, ref_codes), _bits_equal(error, u - ref_values)]
            return f"EF add, scales, codes, error: {ok}", all(ok)

        def decode(groups=groups, fmt=fmt):
            refs = [triton_fp8.reference(x, groups, fmt) for x in inputs]
            value = triton_fp8.decode(torch.empty_like(inputs[0]), refs[0][1], refs[0][0],
                                      groups, fmt)
            total = triton_fp8.decode_sum(torch.stack([c for _, c, _ in refs]),
                                          torch.stack([s for s, _, _ in refs]), groups, WORLD,
                                          fmt)
            want = torch.zeros_like(total)
            for _, _, v in refs:
                want += v
            ok = [_bits_equal(value, refs[0][2]), _bits_equal(total, want)]
            return f"decode, decode-and-sum N={WORLD}: {ok}", all(ok)

        _row(rows, f"fused {fmt}/{scaling} encode with EF", encode)
        _row(rows, f"fused {fmt}/{scaling} decode", decode)

    def verdict():  # the step's verdict from its units' slots (geofp8.verdict.StepVerdict)
        ok = []
        for flags in ([1] * 70, [1] * 69 + [0], [0] + [1] * 5):
            slots = torch.tensor(flags + [0] * 3, dtype=torch.uint8, device=DEVICE)
            skipped = torch.full((), 7, dtype=torch.int64, device=DEVICE)
            finite = triton_fp8.verdict(slots, len(flags), skipped)
            ok.append(bool(finite) == all(flags) and int(skipped) == 7 + (not all(flags)))
        return f"all of 70 / 6 slots, skipped counter: {ok}", all(ok)

    def agreed():  # an agreed step (FSDP's): verdict, counter, the units' factors
        ok = []
        for down in ([0.0] * 130, [0.0] * 129 + [2.0], [1.0] + [0.0] * 4):
            agreed_down = torch.tensor(down, dtype=torch.float32, device=DEVICE)
            skipped = torch.full((), 7, dtype=torch.int64, device=DEVICE)
            finite, factors = triton_fp8.agreed(agreed_down, skipped)
            want = torch.where(agreed_down == 0, 1.0, float("nan"))
            ok.append(bool(finite) == (max(down) == 0) and int(skipped) == 7 + (max(down) > 0)
                      and _bits_equal(factors, want))
        return f"130 / 5 units' agreed counts, skipped counter, factors: {ok}", all(ok)

    _row(rows, "fused step verdict", verdict)
    _row(rows, "fused agreed step", agreed)
    _row(rows, "fused statistics commit", _statistics_commit)
    if DEVICE.type != "cuda":  # the interpreter's stand-in run checks the bits only
        return
    x = torch.randn(25 << 20 >> 2, device=DEVICE)  # 25 MiB of FP32
    groups = GroupMap([[make_codec("e4m3").groups(tuple(x.shape))]])
    r = torch.zeros_like(x)

    def stages():
        u, scales = triton_fp8.amax(x, groups, r)
        codes, _ = triton_fp8.encode(u, scales, groups, error=True)
        triton_fp8.decode(u, codes, scales, groups)

    # bytes: x, r read, u written; u read twice, codes, error; decode
    _bandwidth_row(rows, "fused e4m3 q+EF+d 25 MiB", stages, x, 22)


def _statistics_commit() -> tuple[str, bool]:
    """A step's statistics committed where finite in one kernel (a program per moment) and,
    :data:`~geofp8.codecs.triton_stats.ONE_PASS` set below the widest moment, in two
    (tiles) (:func:`~geofp8.codecs.triton_stats.commit`) against the torch reference,
    bitwise: a NaN in one moment, an Inf in another's second tile, a finite and a skipped
    step."""
    from ..codecs import triton_stats
    from ..geometry.statistics import JoinedMoments, SecondMoment

    ok, one_pass = [], triton_stats.ONE_PASS
    for wide, finite in itertools.product((one_pass, 1000), (True, False)):
        triton_stats.ONE_PASS = wide
        fused, ref = ([JoinedMoments([SecondMoment(d, device=DEVICE) for d in (3, 40, 33)])
                       for _ in range(2)] for _ in range(2))
        sums, window = torch.randn(fused[0].flat.numel()), torch.rand(fused[0].flat.numel())
        sums[5], sums[11 + 1100] = float("nan"), float("inf")
        for pending, into in (fused, ref):
            pending.flat.copy_(sums)
            into.flat.copy_(window)
        dropped = [torch.zeros(3, dtype=torch.int64, device=DEVICE) for _ in range(2)]
        flag = torch.tensor(finite, device=DEVICE)
        fused[0].commit_into(fused[1], flag, dropped[0])
        ref[0]._commit_reference(ref[1], flag, dropped[1])
        ok.append(fused[0]._fused is not None and torch.equal(*dropped)
                  and isinstance(fused[0]._fused, triton_stats.TiledCommit) == (wide == 1000)
                  and _bits_equal(fused[1].flat, ref[1].flat)
                  and _bits_equal(fused[0].flat, ref[0].flat))
    triton_stats.ONE_PASS = one_pass
    return (f"window, dropped counts, zeroed sums; one launch, tiles x finite, skipped step: "
            f"{ok}", all(ok))


def check_fused_blocks(rows: list) -> None:
    """The fused NVFP4 / MXFP4 / MXFP8 kernels (:mod:`geofp8.codecs.triton_fp4`) through the
    codecs' batched path against its torch path on the device, bitwise: the encode (with
    the rounding error; seeded for stochastic rounding), the decode with its finite flag and
    poison, and the decode-and-sum of ``N`` senders; then a 25 MB NVFP4 bucket timed."""
    from ..codecs import make_codec, triton_fp4
    from ..comm import ShardLayout

    if not triton_fp4.available(torch.zeros(1, device=DEVICE)):
        rows.append(("fused block kernels", _no_kernels(triton_fp4), "FAIL"))
        return
    inputs = [bucket(r, SHAPES).to(DEVICE) for r in range(WORLD)]
    inputs[1][5] = float("nan")  # a non-finite block on one sender
    for fmt, rounding in ((f, r) for f in triton_fp4.FORMATS for r in ("nearest", "stochastic")):
        codec = make_codec(fmt, rounding=rounding)
        groups = ShardLayout.build(SHAPES, codec, WORLD).group_map(list(range(WORLD)))
        seeds = [11 * j for j in range(WORLD)]

        def encode(codec=codec, groups=groups, seeds=seeds):
            got = [codec.encode_shards(x, groups, seeds) for x in inputs[:2]]
            fused = codec.encode_shards_with_error(inputs[0], groups)
            with triton_fp4.torch_only():
                want = [codec.encode_shards(x, groups, seeds) for x in inputs[:2]]
                ref = codec.encode_shards_with_error(inputs[0], groups)
            ok = [all(map(_bits_equal, g, w)) for g, w in zip(got, want)]
            ok += [all(map(_bits_equal, fused[0], ref[0])), _bits_equal(fused[1], ref[1])]
            return f"payloads (finite, NaN), the EF encode's payload and error: {ok}", all(ok)

        def decode(codec=codec, groups=groups, fmt=fmt):
            with triton_fp4.torch_only():
                payloads = [codec.encode_shards(x, groups, [None] * WORLD) for x in inputs]
            ok = []
            for parts, poison in ((payloads[0], False), (payloads[1], False),
                                  (payloads[1], True)):
                got, want = torch.empty_like(inputs[0]), torch.empty_like(inputs[0])
                flag = codec.decode_shards(got, parts, groups, poison=poison)
                with triton_fp4.torch_only():
                    want_flag = codec.decode_shards(want, parts, groups, poison=poison)
                ok.append(_bits_equal(got, want) and (flag is None) == (want_flag is None)
                          and (flag is None or bool(flag) == bool(want_flag)))
            k = len(payloads[0]) // WORLD  # parts per shard
            rows_ = [torch.stack([torch.cat(p[i::k]) for p in payloads]) for i in range(k)]
            s = rows_.pop(0).view(torch.float32) if k == 3 else None
            total = triton_fp4.decode_sum(groups, fmt, *rows_, s)
            want = torch.zeros_like(inputs[0])
            with triton_fp4.torch_only():
                for parts in payloads:
                    values = torch.empty_like(want)
                    codec.decode_shards(values, parts, groups, check=False)
                    want += values
            ok.append(_bits_equal(total, want))
            return f"decode (finite, NaN, poisoned), decode-and-sum N={WORLD}: {ok}", all(ok)

        _row(rows, f"fused {fmt}/{rounding} encode", encode)
        if rounding == "nearest":
            _row(rows, f"fused {fmt} decode", decode)
    if DEVICE.type != "cuda":  # the interpreter's stand-in run checks the bits only
        return
    x = torch.randn(25 << 20 >> 2, device=DEVICE)  # 25 MiB of FP32
    groups = ShardLayout.build([tuple(x.shape)], make_codec("nvfp4"), 1).group_map([0])
    r = torch.zeros_like(x)

    def stages():
        enc = triton_fp4.encode(x, groups, "nvfp4", residual=r, error=True)
        triton_fp4.decode(enc.u, groups, "nvfp4", enc.block_bytes, enc.codes,
                          enc.segment_scales)

    # bytes: x, r read, u written; u read, codes, error; decode
    _bandwidth_row(rows, "fused nvfp4 q+EF+d 25 MiB", stages, x, 25)


def _bandwidth_row(rows: list, name: str, stages, x: torch.Tensor, bytes_per_element: int
                   ) -> None:
    """A timed row: ``stages()`` moves ``bytes_per_element · x.numel()`` bytes; its
    bandwidth against a device-to-device copy of ``x`` (8 bytes an element: the HBM's
    practical reach). ``SLOW`` (a goal missed, not a failure) under half of it (issue 40)."""
    t, copy = cuda_seconds(stages), cuda_seconds(lambda: x.clone())
    share = bytes_per_element * x.numel() / t / (8 * x.numel() / copy)
    rows.append((name, f"{1e6 * t:.0f} µs, {bytes_per_element * x.numel() / t / 1e9:.0f} GB/s, "
                 f"{share:.0%} of a D2D copy's {8 * x.numel() / copy / 1e9:.0f} GB/s "
                 "(goal >= 50 %)", "ok" if share >= 0.5 else "SLOW"))


def _collective_matches(codec, seed: int | None = None) -> tuple[str, bool]:
    """The exact collective of ``codec`` through the public stages of
    :mod:`geofp8.comm.stages` (whatever kernels they dispatch to) on the device's batched
    path against the CPU's chunked path, bitwise: a sender's encode with its rounding error
    written over the bucket (error feedback), and where the stage takes the bucket's
    residual (``feedback=(R, keep)``: it encodes ``G + where(keep, R, 0)`` and writes the
    new residual into ``R``) with a BF16 ``R``, kept and dropped; then the whole collective,
    clean and with a NaN on one sender."""
    from ..comm import ShardLayout
    from ..comm.stages import encode_with_error, simulate_exact_allreduce

    layouts = {device: ShardLayout.build(SHAPES, codec, WORLD, kernels=kernels)
               for device, kernels in ((DEVICE, "batched"), ("cpu", "chunked"))}
    feedback = "feedback" in inspect.signature(encode_with_error).parameters
    ok = []
    for keep in (True, False) if feedback else (None,):
        got = []
        for device, layout in layouts.items():
            x = bucket(0, SHAPES).to(device)
            given = {}
            if keep is not None:
                r = (bucket(1, SHAPES) * 1e-2).to(device, torch.bfloat16)
                given["feedback"] = (r, torch.tensor(keep, device=device))
            out = list(encode_with_error(x, layout, seed=seed, error_out=x, **given))
            got.append([t.cpu() for t in out + list(given.get("feedback", ()))[:1]])
        ok.append(all(map(_bits_equal, *got)))
    for nan in (False, True):
        inputs = [bucket(r, SHAPES) for r in range(WORLD)]
        inputs[1][7] = float("nan") if nan else inputs[1][7]
        got, want = (simulate_exact_allreduce([x.to(device) for x in inputs], layout,
                                              seed=seed).cpu()
                     for device, layout in layouts.items())
        ok.append(_bits_equal(got, want))
    return (f"EF encode{' (R kept, dropped)' if feedback else ''}; collective, clean and "
            f"with a NaN: {ok}"), all(ok)


def _gathered_decode_matches(codec) -> tuple[str, bool]:
    """The fused decode of the gathered records (one kernel that decides its own finite
    flag: :mod:`geofp8.codecs.triton_fp8`'s ticket) on the device against the CPU's chunked
    path, bitwise, divided by ``N``: clean, a NaN scale in the first record (its first
    group), an Inf in the last record's last group, both, clean again (the ticket zeroed by
    each call's last program). On CUDA over a 4 Mi-element bucket (thousands of programs
    at once: the last one's NaN stores must land after every other's values, the atomic's
    ordering, which the interpreter cannot show); the flags ``[1, 0, 0, 0, 1]``."""
    from ..comm import ShardLayout
    from ..comm import stages as st

    shapes = SHAPES + [(4 << 20,)] if DEVICE.type == "cuda" else SHAPES
    fused, chunked = (ShardLayout.build(shapes, codec, WORLD, kernels=kernels)
                      for kernels in ("batched", "chunked"))
    ok, flags = [], []
    for first, last in ((False, False), (True, False), (False, True), (True, True),
                        (False, False)):
        inputs = [bucket(r, shapes) for r in range(WORLD)]
        inputs[1][0] = float("nan") if first else inputs[1][0]
        inputs[2][-1] = float("inf") if last else inputs[2][-1]
        sent = [st.encode(x, chunked, sender=r) for r, x in enumerate(inputs)]
        cuts = [chunked.send_bytes(j) for j in range(WORLD)]
        gathered = torch.stack([st.reduce_encode(torch.cat([s.split(cuts)[j] for s in sent]),
                                                 chunked, j)[0] for j in range(WORLD)])
        got, flag = st.decode_gathered_flagged(gathered.to(DEVICE), fused, divide=WORLD)
        want = st.decode_gathered(gathered, chunked, divide=WORLD)
        flags.append(None if flag is None else int(flag))
        ok.append(_bits_equal(got.cpu(), want) and flags[-1] == int(bool(want.isfinite().all())))
    ok.append(flags == [1, 0, 0, 0, 1])
    return f"clean, NaN first, Inf last, both, clean: {ok}, flags {flags}", all(ok)


def check_fused_block_stages(rows: list) -> None:
    """The exact collective on a block-scaled codec's batched path (NVFP4 both roundings,
    MXFP4; the owners' stages record to record,
    :meth:`~geofp8.comm.block_plan.BlockStages.reduce_encode`) against the CPU's chunked path,
    bitwise, clean and with a NaN on one sender; the gathered decode of NVFP4 and MXFP8
    with non-finite scales in its first and last records (:func:`_gathered_decode_matches`)."""
    from ..codecs import make_codec

    for fmt, rounding in (("nvfp4", "nearest"), ("nvfp4", "stochastic"), ("mxfp4", "nearest")):
        _row(rows, f"fused stages {fmt}/{rounding} N={WORLD}", lambda fmt=fmt, rounding=rounding:
             _collective_matches(make_codec(fmt, rounding=rounding), seed=5))
    for fmt in ("nvfp4", "mxfp8"):
        _row(rows, f"fused gathered decode {fmt} N={WORLD}",
             lambda fmt=fmt: _gathered_decode_matches(make_codec(fmt)))


def check_fused_maps(rows: list) -> None:
    """A bucket's low-rank maps in one grouped kernel each way
    (:class:`geofp8.codecs.triton_map.GroupedMaps`) against ``mm`` + ``addmm`` per layer on
    the device: within FP32 summation round-off (``triton_map.round_off_bound``), a row with
    a NaN or an Inf non-finite in both, rank 0 and unmapped elements untouched; the inverse's
    finite flag cleared exactly when a mapped-back value is not finite (the torch path's
    values checked), on these rows and on their finite ones alone, and by its deciding
    variant, which makes the step's verdict and counts a skipped step as the step's last
    unit (:func:`_deciding_map_back`)."""
    from ..codecs import triton_map

    g = torch.Generator().manual_seed(7)
    maps, at = [], 3  # (offset, rows, d_in, U, V_fwd, V_inv); a gap before and between slots
    for rows_, d, k in ((70, 40, 3), (7, 33, 0), (33, 64, 17), (130, 96, 32)):
        U = torch.linalg.qr(torch.randn(d, max(k, 1), generator=g))[0][:, :k]
        a_fwd, a_inv = torch.rand(k, generator=g) * 4 - 0.9, torch.rand(k, generator=g) - 0.5
        maps.append((at, rows_, d, *(x.to(DEVICE) for x in (U, U * a_fwd, U * a_inv))))
        at += rows_ * d + 2
    flat = (torch.randn(at + 5, generator=g) * 10).to(DEVICE)
    flat[maps[0][0] + 65 * 40 + 3], flat[maps[2][0] + 5 * 64 + 7] = float("nan"), float("inf")
    if not triton_map.places(flat, [U for *_, U, _, _ in maps]):
        rows.append(("fused low-rank maps", _no_kernels(triton_map), "FAIL"))
        return
    grouped = triton_map.GroupedMaps(maps, flat.device)
    gaps = torch.ones_like(flat, dtype=torch.bool)
    for pos, n, d, *_ in maps:
        gaps[pos : pos + n * d] = False

    def apply(inverse: bool):
        out, ref = flat.clone(), flat.clone()
        grouped(out, inverse)
        triton_map.reference(ref, maps, inverse)
        ok = [torch.equal(out[gaps], flat[gaps])]
        if inverse:  # the flag, where the values are as they are and where all are finite
            for values in (flat, flat.nan_to_num(0.0, 0.0, 0.0)):
                mapped_back, flag = values.clone(), torch.ones((), dtype=torch.uint8,
                                                               device=flat.device)
                grouped(mapped_back, True, flag)
                expected = values.clone()
                triton_map.reference(expected, maps, True)
                want = all(bool(expected[pos : pos + n * d].isfinite().all())
                           for pos, n, d, U, _, _ in maps if U.shape[1])
                ok.append(bool(flag.item()) == want)
                ok.append(_deciding_map_back(grouped, values, want))
        for pos, n, d, U, V_fwd, V_inv in maps:
            G, o, r = (x[pos : pos + n * d].view(n, d) for x in (flat, out, ref))
            finite = G.isfinite().all(dim=1)
            bound = triton_map.round_off_bound(G[finite], V_inv if inverse else V_fwd, U)
            ok += [torch.equal(o.isfinite(), r.isfinite()),
                   bool(((o[finite] - r[finite]).abs() <= bound).all())]
        return (f"unmapped, {'flags, ' if inverse else ''}then per layer non-finite rows "
                f"and round-off: {ok}", all(ok))

    _row(rows, "fused low-rank maps forward (4 layers, ranks 0-32)", lambda: apply(False))
    _row(rows, "fused low-rank maps inverse", lambda: apply(True))


def _deciding_map_back(grouped, values: torch.Tensor, want: bool) -> bool:
    """The map back's deciding variant (bound to a copy of ``values``, as a bucket's record
    binds it) as the step's last unit after two earlier ones: its flag ``want``, the
    step's verdict ``want`` with both earlier flags up and false with one down, the skipped
    counter advanced once per false verdict; twice each (the kernel's ticket zeroed by its
    last program: every program's verdict counted again)."""
    ok, skipped = [], torch.zeros((), dtype=torch.int64, device=values.device)
    for earlier in ([1, 1], [1, 0]) * 2:
        flag, verdict = (torch.ones((), dtype=torch.uint8, device=values.device),
                         torch.empty((), dtype=torch.uint8, device=values.device))
        flags = torch.tensor(earlier, dtype=torch.uint8, device=values.device)
        grouped.bind(values.clone()).back(flag, functools.partial(
            _deciding, flags_ptr=flags, n=2, verdict_ptr=verdict, skipped_ptr=skipped))
        ok.append((flag.item(), verdict.item()) == (int(want), int(want and all(earlier))))
    return all(ok) and skipped.item() == 2 * (2 - int(want))


def _deciding(launches: tuple, flag: torch.Tensor, **decision) -> None:
    """A map back's deciding launch with the step's decision (an armed slot's, as
    :func:`geofp8.verdict.map_into` gives it)."""
    launches[1](flag_ptr=flag, **decision)


def check_fused_stages(rows: list) -> None:
    """The exact collective's stages on the fused kernels (:class:`geofp8.comm.plan.FusedPlan`)
    against the CPU's chunked path, bitwise (a sender's encode with its error written over
    the bucket, the whole collective with a NaN on one sender); the gathered decode with
    non-finite scales in its first and last records (:func:`_gathered_decode_matches`)."""
    from ..codecs import make_codec

    for fmt, scaling in (("e4m3", "row"), ("e4m3", "block"), ("e5m2", "tensor")):
        _row(rows, f"fused stages {fmt}/{scaling} N={WORLD}", lambda fmt=fmt, scaling=scaling:
             _collective_matches(make_codec(fmt, scaling, 32)))
    for fmt, scaling in (("e4m3", "row"), ("e5m2", "block")):
        _row(rows, f"fused gathered decode {fmt}/{scaling} N={WORLD}",
             lambda fmt=fmt, scaling=scaling: _gathered_decode_matches(
                 make_codec(fmt, scaling, 32)))


def stage_share(layout, x: torch.Tensor, feedback: bool = False):
    """One rank's share of one bucket's exact collective, as a function of nothing: the
    sender's encode, the owner's decode-and-sum of the ``N`` copies of its shard and its
    re-encode, the decode of the gathered shards divided by ``N``
    (:mod:`geofp8.comm.stages`; the inputs of the later stages are made here, on ``x``'s
    device). The encode writes its rounding error over the bucket ``x``, or, ``feedback``,
    runs as the real DDP hook's does: the bucket's flat BF16 residual ``R`` and its 0-dim
    keep flag read in the kernels and ``R`` rewritten (``encode_with_error(...,
    feedback=(R, keep))``)."""
    from ..comm import stages as st

    n, rank = layout.world_size, layout.world_size - 1
    residual = (torch.zeros(layout.numel, dtype=torch.bfloat16, device=x.device),
                torch.ones((), dtype=torch.bool, device=x.device)) if feedback else None
    sent = st.encode(x, layout)
    received = torch.cat([sent[sum(layout.send_bytes(j) for j in range(rank)):]] * n)
    gathered = torch.cat([st.reduce_encode(received, layout, rank)[0]] * n)  # an all-gather's

    def run() -> None:
        if residual is None:
            st.encode_with_error(x, layout, error_out=x)
        else:
            st.encode_with_error(x, layout, feedback=residual)
        st.reduce_encode(received, layout, rank)
        st.decode_gathered(gathered, layout, out=x, divide=n)
    return run


def check_bucket_stages(rows: list) -> None:
    """One rank's share of a 25 MiB bucket's stages (:func:`stage_share`) timed on the
    device for E4M3 and NVFP4 at ``N`` = 2 and 8, against issue 40's goals
    (:data:`GOAL_US`): ``SLOW`` marks a goal missed (a figure, not a failure)."""
    from ..codecs import make_codec
    from ..comm import ShardLayout

    for fmt, n in ((f, n) for f in GOAL_US for n in (2, 8)):
        def timed(fmt=fmt, n=n):
            layout = ShardLayout.build([(BUCKET_NUMEL,)], make_codec(fmt), n, kernels="batched")
            with kernel_census() as launched:  # (the layout's launches bound in it)
                run = stage_share(layout, torch.randn(layout.numel, device=DEVICE))
                launched.clear()
                run()
            t = 1e6 * cuda_seconds(run)
            return (f"{t:.0f} µs (goal <= {GOAL_US[fmt]:.0f}), {len(launched)} Triton kernels",
                    "ok" if t <= GOAL_US[fmt] else "SLOW")
        _row(rows, f"stages {fmt} {BUCKET_NUMEL >> 18} MiB N={n}", timed)


def check_throughput(rows: list) -> None:
    from ..codecs import FORMATS, make_codec
    from ..geometry.statistics import LowRankFactor
    from ..geometry.transforms import LowRankInput, transform_from_state

    x = torch.randn(64 << 20 >> 2, device="cuda")  # 64 MiB of FP32
    copy = cuda_seconds(lambda: x.clone())
    for fmt in FORMATS:
        codec = make_codec(fmt)
        t = cuda_seconds(lambda codec=codec: codec.round_trip(x))
        rows.append((f"q+d {fmt} (64 MiB)", f"{copy / t:.2f}× D2D copy", "ok"))
    G = torch.randn(4096, 4096, device="cuda")
    A = torch.randn(4096, 64, device="cuda")
    T = LowRankInput(LowRankFactor.from_matrix((A @ A.T).double(), 32), 0.1)
    T = transform_from_state(T.name, {k: v.float().cuda() for k, v in T.state().items()})
    t, copy = cuda_seconds(lambda: T.forward(G)), cuda_seconds(lambda: G.clone())
    rows.append(("lowrank-32 map 4096²", f"{copy / t:.2f}× D2D copy", "ok"))


def triton_kernels() -> dict[str, object]:
    """Every Triton kernel of GeoFP8's loaded modules (a ``*_kernel`` JIT function, as
    :mod:`~geofp8.codecs.triton_fp8` and :mod:`~geofp8.codecs.triton_fp4` name them; new
    modules' kernels are found the same way), by ``module.name``, each once; none where
    Triton does not import."""
    from ..codecs import block_records, triton_fp4, triton_fp8, triton_map, triton_stats  # noqa: F401

    found: dict[int, tuple[str, object]] = {}
    for module_name, module in sorted(sys.modules.items()):
        if not module_name.startswith("geofp8.") or module is None:
            continue
        for name, fn in vars(module).items():
            if name.endswith("_kernel") and hasattr(fn, "run") and id(fn) not in found:
                found[id(fn)] = (f"{module_name.rsplit('.', 1)[-1]}.{name}", fn)
    return dict(found.values())


@contextlib.contextmanager
def kernel_census():
    """``launched``: the set of :func:`triton_kernels` launched inside by launches made
    inside (each one's ``run`` wrapped, and the one it had put back after; a
    :class:`~geofp8.codecs.triton_fp8.Launch` binds the ``run`` it finds when made;
    censuses nest)."""
    launched: set[str] = set()
    kernels = triton_kernels()
    before = {name: vars(fn).get("run") for name, fn in kernels.items()}
    for name, fn in kernels.items():
        def run(*args, _run=fn.run, _name=name, **kwargs):
            launched.add(_name)
            return _run(*args, **kwargs)
        fn.run = run
    try:
        yield launched
    finally:
        for name, fn in kernels.items():
            if before[name] is None:
                del fn.run  # the class's own method again
            else:
                fn.run = before[name]


SECTIONS = {"fused": check_fused, "fused-stages": check_fused_stages,
            "fused-maps": check_fused_maps, "fused-blocks": check_fused_blocks,
            "fused-block-stages": check_fused_block_stages,
            "bucket": check_bucket_stages, "codecs": check_codecs,
            "transforms": check_transforms, "methods": check_methods,
            "throughput": check_throughput, "training": check_training}
FUSED = ("fused", "fused-stages", "fused-maps", "fused-blocks",
         "fused-block-stages")  # every kernel's rows


def run_sections(names, rows: list) -> None:
    """The sections ``names`` in order, each row printed as it is made (a run cut short by a
    timeout still shows what it did); when every :data:`FUSED` section ran, a row saying
    whether each of :func:`triton_kernels` was launched by them."""
    with kernel_census() as launched:
        for name in names:
            first = len(rows)
            try:
                SECTIONS[name](rows)
            except Exception:  # noqa: BLE001 - a section's set-up failed: its rows so far stand
                rows.append((name, traceback.format_exc().splitlines()[-1], "FAIL"))
            if name == FUSED[-1] and set(FUSED) <= set(names):
                never = sorted(set(triton_kernels()) - launched)
                rows.append(("every Triton kernel launched", f"{len(launched)} launched"
                             + (f"; never: {', '.join(never)}" if never else ""),
                             "FAIL" if never else "ok"))
            for row in rows[first:]:
                print(f"[{name}] {row[0]}  {row[2]}  {row[1]}", flush=True)


def main(argv=()) -> int:
    parser = argparse.ArgumentParser(prog="python -m geofp8.tools.gpu_check",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS),
                        help="which checks, in this order (default: all)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("geofp8 gpu-check: FAILED — no CUDA device is visible to PyTorch "
              f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}); run it on a "
              "machine with an NVIDIA GPU and a CUDA build of torch.", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    rows: list[tuple[str, str, str]] = []
    run_sections(args.sections, rows)
    width = max(len(r[0]) for r in rows)
    print(f"\nGeoFP8 gpu-check on {torch.cuda.get_device_name(0)} "
          f"({time.perf_counter() - t0:.0f} s; torch {torch.__version__})\n")
    for name, detail, verdict in rows:
        print(f"{name:<{width}}  {verdict:<4}  {detail}")
    failed = sum(r[2] == "FAIL" for r in rows)
    slow = sum(r[2] == "SLOW" for r in rows)
    print(f"\n{len(rows) - failed - slow} passed, {failed} failed, {slow} over their goal")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
