"""``make gpu-check``: GeoFP8 on one NVIDIA GPU, in a few minutes, one table, fail on error.

1. Correctness on CUDA: every codec's round trip equals the CPU one bitwise; every transform
   kind maps back (``T⁻¹(T(G)) ≈ G``) on the device; the single-process simulation of the
   exact collective matches the CPU's.
2. A world-size-1 NCCL training run of every method of :data:`geofp8.methods.METHODS` on a
   small Llama, with a refresh and an auto / profile decision inside it (``refresh_every=2``,
   ``profile_steps=2``), checking that the loss stays finite and GeoFP8's counters advance.
3. Throughput on the GPU: quantize + dequantize of every codec, and the low-rank transform,
   against a device-to-device copy of the same bytes (ratios, timed with CUDA events).

Without a GPU it prints why and exits 0 (nothing to check here).
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time
import traceback

import torch


def _timed(fn, repeats: int = 20) -> float:
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


def check_codecs(rows: list) -> None:
    from ..codecs import FORMATS, make_codec
    from ..comm import ShardLayout, simulate_exact_allreduce

    x = torch.randn(257, 1031, generator=torch.Generator().manual_seed(0)) * 3
    for fmt in FORMATS:
        for scaling in ("tensor", "row", "block"):
            codec = make_codec(fmt, scaling, 32)
            same = torch.equal(codec.round_trip(x.cuda()).cpu(), codec.round_trip(x))
            layout = ShardLayout.build([tuple(x.shape)], codec, 3)
            inputs = [x * (r + 1) for r in range(3)]
            sim = torch.equal(simulate_exact_allreduce([t.cuda() for t in inputs], layout).cpu(),
                              simulate_exact_allreduce(inputs, layout))
            rows.append((f"codec {fmt}/{scaling}", "CUDA == CPU bitwise",
                         "ok" if same and sim else "FAIL"))


def check_transforms(rows: list) -> None:
    from ..geometry.factory import TRANSFORMS, make_transform
    from ..geometry.statistics import LowRankFactor

    g = torch.Generator().manual_seed(1)
    X = torch.randn(2048, 256, generator=g) @ torch.randn(256, 256, generator=g)
    A = (X.T @ X / X.shape[0]).cuda()
    S = torch.eye(128, device="cuda") + 0.1
    G = torch.randn(128, 256, generator=g).cuda()
    for kind in TRANSFORMS:
        t = make_transform(kind, 0.1, A=A, S=S, dim=256, block=64,
                           factor=LowRankFactor.from_matrix(A, 32) if kind == "lowrank" else None)
        if kind == "hadamard":
            t.signs, t.H = t.signs.cuda(), t.H.cuda()
        err = float((t.inverse(t.forward(G)) - G).norm() / G.norm())
        rows.append((f"transform {kind}", f"round trip {err:.1e}", "ok" if err < 1e-3 else "FAIL"))


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
        state, hook, _ = spec.build(model, **spec.takes(refresh_every=2, profile_steps=2))
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
            losses.append(float(loss))
        stats = state.stats() if hasattr(state, "stats") else {}
        return {"losses": losses, "step": stats.get("step"),
                "geometry": len(stats.get("geometry_layers", []))}
    finally:
        end_process_group(completed=False)  # one rank: nothing to wait for


def check_training(rows: list) -> None:
    from ..methods import METHODS

    for method in METHODS:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            out = _train_worker(method, port)
            finite = all(torch.isfinite(torch.tensor(out["losses"])))
            counted = out["step"] in (None, 6)
            rows.append((f"train {method}", f"loss {out['losses'][0]:.3f} → "
                         f"{out['losses'][-1]:.3f}, geometry layers {out['geometry']}",
                         "ok" if finite and counted else "FAIL"))
        except Exception:  # noqa: BLE001 - report and go on, the table fails at the end
            rows.append((f"train {method}", traceback.format_exc().splitlines()[-1], "FAIL"))


def check_throughput(rows: list) -> None:
    from ..codecs import FORMATS, make_codec
    from ..geometry.statistics import LowRankFactor
    from ..geometry.transforms import LowRankInput

    x = torch.randn(64 << 20 >> 2, device="cuda")  # 64 MiB of FP32
    copy = _timed(lambda: x.clone())
    for fmt in FORMATS:
        codec = make_codec(fmt)
        t = _timed(lambda codec=codec: codec.round_trip(x))
        rows.append((f"q+d {fmt} (64 MiB)", f"{copy / t:.2f}× D2D copy", "ok"))
    G = torch.randn(4096, 4096, device="cuda")
    A = torch.randn(4096, 64, device="cuda")
    T = LowRankInput(LowRankFactor.from_matrix((A @ A.T).double(), 32), 0.1)
    T.U, T.d_fwd = T.U.float().cuda(), T.d_fwd.float().cuda()
    t = _timed(lambda: T.forward(G))
    rows.append(("lowrank-32 map 4096²", f"{_timed(lambda: G.clone()) / t:.2f}× D2D copy", "ok"))


def main() -> int:
    if not torch.cuda.is_available():
        print("geofp8 gpu-check: skipped — no CUDA device is visible to PyTorch "
              f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}).")
        return 0
    t0 = time.perf_counter()
    rows: list[tuple[str, str, str]] = []
    for check in (check_codecs, check_transforms, check_training, check_throughput):
        try:
            check(rows)
        except Exception:  # noqa: BLE001
            rows.append((check.__name__, traceback.format_exc().splitlines()[-1], "FAIL"))
    width = max(len(r[0]) for r in rows)
    print(f"GeoFP8 gpu-check on {torch.cuda.get_device_name(0)} "
          f"({time.perf_counter() - t0:.0f} s)\n")
    for name, detail, verdict in rows:
        print(f"{name:<{width}}  {verdict:<4}  {detail}")
    failed = [r for r in rows if r[2] != "ok"]
    print(f"\n{len(rows) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
