"""GPU correctness checked without a GPU: codecs, transforms and the exact collective's stages
of every method run on the stand-in device of ``tests/fakedevice.py``, which rejects a host
tensor meeting device data, divides by a host scalar as CUDA does, and counts host syncs.

Each case runs the same computation on the CPU and on the stand-in device: the results must
be bitwise equal, and the ordinary-step part (encode, all-to-all stages, decode, the map and
its inverse) must not sync with the host once the per-layout tables exist (first call). The
per-method step is the one ``geofp8.tools.gpu_check`` runs on a real GPU."""

import contextlib
import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fakedevice import DEVICE, FakeDevice, to_device, to_host
from geofp8.codecs import make_codec
from geofp8.comm import ShardLayout, simulate_exact_allreduce
from geofp8.comm.stages import decode_gathered, decode_sum, encode, encode_reduced, rounding_error
from geofp8.geometry.sources import Layer
from geofp8.methods import METHODS
from geofp8.tools.gpu_check import bucket, method_maps, method_step

WORLD = 3  # shard cuts fall inside rows and blocks: irregular scale groups
SHAPES = [(257, 103), (64, 33), (96,)]  # a bucket of two weights and a bias

CODECS = ([("e4m3", s, "nearest") for s in ("tensor", "row", "block")]
          + [("e5m2", s, "nearest") for s in ("tensor", "row", "block")]
          + [(f, None, r) for f in ("nvfp4", "mxfp4", "mxfp8") for r in ("nearest", "stochastic")])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN where NaN."""
    a = to_host(a)
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize(("fmt", "scaling", "rounding"), CODECS)
def test_codec_and_stages_on_the_device_match_the_cpu_without_host_syncs(fmt, scaling,
                                                                       rounding):
    codec = make_codec(fmt, scaling, 32, rounding)
    layout = ShardLayout.build(SHAPES, codec, WORLD)
    inputs = [bucket(r, SHAPES) for r in range(WORLD)]
    poisoned = [x.clone() for x in inputs]
    poisoned[1][5] = float("nan")
    whole = inputs[0][: 257 * 103].view(257, 103)
    expect = [codec.round_trip(whole), simulate_exact_allreduce(inputs, layout, seed=7),
              simulate_exact_allreduce(poisoned, layout, seed=7)]
    assert expect[2].isnan().all()
    with FakeDevice() as dev:
        on_dev = [to_device(x) for x in inputs]
        bad = [to_device(x) for x in poisoned]

        def run():
            return [codec.round_trip(on_dev[0][: 257 * 103].view(257, 103)),
                    simulate_exact_allreduce(on_dev, layout, seed=7),
                    simulate_exact_allreduce(bad, layout, seed=7)]

        run()  # first call: the codec's tables and the layout's group lengths
        with dev.strict():
            got = run()
    for name, g, e in zip(("round trip", "simulation"), got, expect):
        assert _same(g, e), f"{fmt}/{scaling}/{rounding}: {name} differs from the CPU's"
    # all NaN on both; which NaN (the payload bits) is the operand a kernel's product keeps
    # when value and scale are both NaN, and the two paths multiply in different kernels
    assert to_host(got[2]).isnan().all(), f"{fmt}/{scaling}/{rounding}: not poisoned"


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _stage_ops(shapes, fmt: str, scaling: str | None, world: int = 4) -> int:
    """Aten ops of one rank's batched stages of one bucket on the stand-in device (what an
    accelerator runs): encode and its residual, the sum of the received copies and its
    re-encoding, the decode of the gathered shards."""
    layout = ShardLayout.build(shapes, make_codec(fmt, scaling, 32), world, kernels="batched")
    with FakeDevice():
        x = to_device(bucket(0, shapes))
        received = torch.cat([encode(x, layout)[: layout.send_bytes(0)]] * world)
        gathered = [encode_reduced(x[: layout.shard_numel(j)], layout, j) for j in range(world)]

        def run() -> None:
            rounding_error(encode(x, layout), x, layout)
            encode_reduced(decode_sum(received, layout, 0), layout, 0)
            decode_gathered(gathered, layout)

        run()  # first call: the codecs' tables
        ops = _Ops()
        with ops:
            run()
    return ops.count


@pytest.mark.parametrize(("fmt", "scaling"), [("e4m3", "tensor"), ("e4m3", "block"),
                                             ("e5m2", "tensor"), ("e5m2", "block"),
                                             ("nvfp4", None), ("mxfp4", None), ("mxfp8", None)])
def test_stages_on_a_device_take_as_many_ops_for_a_bigger_bucket(fmt, scaling):
    """Off the CPU the stages run whole-bucket kernels: the same number of ops for a bucket
    of 0.25 M elements as for one of 4 M (the CPU's cache-sized pieces would be 16 times
    as many there)."""
    small = _stage_ops([(256, 256)] * 4, fmt, scaling)
    big = _stage_ops([(1024, 1024)] * 4, fmt, scaling)
    assert big == small, f"{fmt}/{scaling}: {small} ops for 0.25 M elements, {big} for 4 M"


# one codec per layout here; the byte budget's per-layer codecs are tests/test_budget.py's
GEOFP8 = [m for m, spec in METHODS.items() if spec.kind == "geofp8" and not spec.required]


@pytest.mark.parametrize("method", GEOFP8)
def test_every_method_runs_on_the_device_as_on_the_cpu_without_host_syncs(method):
    config = METHODS[method].config()
    codec = make_codec(config.format, config.scaling, config.block_size, config.rounding)
    layers = {f"{m}.weight": Layer(m, f"{m}.weight", 64, d_out)
              for m, d_out in (("a", 96), ("b", 48))}
    shapes = [(96, 64), (48, 64), (33,)]
    layout = ShardLayout.build(shapes, codec, WORLD)
    grads = [[torch.randn(s, generator=torch.Generator().manual_seed(10 * r + i))
              for i, s in enumerate(shapes)] for r in range(WORLD)]
    expect = method_step(method_maps(config, layers, "cpu", codec.block_size), shapes, grads,
                         layout, 3)
    with FakeDevice() as dev:
        maps = method_maps(config, layers, DEVICE, codec.block_size)  # a refresh: syncs allowed
        on_dev = [[to_device(g) for g in rank_grads] for rank_grads in grads]
        method_step(maps, shapes, on_dev, layout, 3)
        with dev.strict():
            got = method_step(maps, shapes, on_dev, layout, 3)
    for shape, g, e in zip(shapes, got, expect):
        assert _same(g.contiguous(), e.contiguous()), f"{method}: {shape} differs from the CPU's"


class _Rank:
    """Rank ``rank`` of ``size`` for a pipeline in a one-process simulation (no collectives:
    the methods below issue none on an ordinary step)."""

    def __init__(self, rank: int, size: int, device) -> None:
        self.rank, self.size, self.device = rank, size, torch.device(device)

    def charge(self, kind: str, nbytes: float) -> None:
        pass

    def all_gather_json(self, obj, kind: str) -> list:
        """The shared inputs' agreement (once): every simulated rank ran the same layers."""
        return [obj] * self.size


def _pipeline_steps(method: str, device, steps: int = 3, strict_from: int = 1):
    """``steps`` DDP-like steps of ``WORLD`` :class:`GradientPipeline` s (routes, error
    feedback, sender factors and per-sender decoding) joined by the exact collective's
    stages; rank 0's averaged gradients of the last step. On the stand-in device, steps
    from ``strict_from`` on must not sync with the host."""
    from geofp8.comm import decode_gathered, decode_sum, encode_reduced
    from geofp8.ledger import StepLedger
    from geofp8.pipeline import GradientPipeline

    spec = METHODS[method]
    config = spec.config(**spec.takes(k=8))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 48))
    shapes = [tuple(q.shape) for q in model.parameters()]
    names = [n for n, _ in model.named_parameters()]
    dev = FakeDevice() if device == DEVICE else None
    with dev or contextlib.nullcontext():
        models = [copy.deepcopy(model).to(device) for _ in range(WORLD)]
        pipes = [GradientPipeline(m, config, _Rank(r, WORLD, device), StepLedger(), "linear")
                 for r, m in enumerate(models)]
        for step in range(steps):
            grads = []
            for r, m in enumerate(models):
                g = torch.Generator().manual_seed(10 * step + r)
                m(torch.randn(32, 64, generator=g).to(device))  # the sources' statistics
                grads.append([torch.randn(s, generator=g).to(device) for s in shapes])
            strict = dev is not None and step >= strict_from
            with dev.strict() if strict else contextlib.nullcontext():
                for p in pipes:
                    p.start_step(step)
                seed = config.rounding_seed(step, 0)
                encs = [p.encode(names, g, seed) for p, g in zip(pipes, grads)]
                layout = encs[0].layout
                ends = [0]
                for j in range(WORLD):
                    ends.append(ends[-1] + layout.send_bytes(j))
                gathered = []
                for j in range(WORLD):
                    received = torch.cat([e.sent[ends[j] : ends[j + 1]] for e in encs])
                    total = decode_sum(received, layout, j, pipes[j].unmap(encs[j]))
                    gathered.append(encode_reduced(total, layout, j, seed))
                mean = decode_gathered(gathered, layout)
                pipes[0].decode(encs[0], mean)  # the mean, written over the sum
                out = [y.view(s) for y, s in zip(mean.split([q.numel() for q in grads[0]]),
                                                 shapes)]
                finite = torch.ones((), dtype=torch.bool, device=device)
                for p in pipes:
                    p.settle(finite)
    return [to_host(t).contiguous() for t in out]


# Methods whose ordinary step issues no collective outside the payload's (no refresh in 3
# steps, no per-step factor): strict. ``geofp8-local`` factors each step (host reads by
# design): compared, not strict.
PIPELINE = {"fp8-ef": 1, "fp8-block": 1, "hadamard": 1, "nvfp4-ef": 1, "nvfp4-sr-ef": 1,
            "nvfp4-rht-ef": 1, "mxfp4-rht-ef": 1, "mxfp8-ef": 1, "geofp8-local": 99}


@pytest.mark.parametrize("method", sorted(PIPELINE))
def test_pipelines_with_error_feedback_on_the_device_match_the_cpu(method):
    expect = _pipeline_steps(method, "cpu")
    got = _pipeline_steps(method, DEVICE, strict_from=PIPELINE[method])
    for g, e in zip(got, expect):
        assert _same(g, e), f"{method}: {tuple(e.shape)} differs from the CPU's"


def test_gpu_check_fails_without_a_cuda_device(monkeypatch, capsys):
    from geofp8.tools import gpu_check

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main() == 2
    assert "no CUDA device is visible" in capsys.readouterr().err
