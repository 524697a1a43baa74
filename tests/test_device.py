"""GPU correctness checked without a GPU: codecs, transforms and the exact collective's stages
of every method run on the stand-in device of ``tests/fakedevice.py``, which rejects a host
tensor meeting device data, divides by a host scalar as CUDA does, and counts host syncs.

Each case runs the same computation on the CPU and on the stand-in device: the results must
be bitwise equal, and the ordinary-step part (encode, all-to-all stages, decode, the map and
its inverse) must not sync with the host once the per-layout tables exist (first call)."""

import pytest
import torch

from fakedevice import DEVICE, FakeDevice, to_device, to_host
from geofp8.codecs import make_codec
from geofp8.comm import ShardLayout, simulate_exact_allreduce
from geofp8.geometry.factory import make_transform, needs
from geofp8.geometry.sources import Layer, make_source
from geofp8.geometry.statistics import SecondMoment
from geofp8.geometry.transforms import IDENTITY
from geofp8.methods import METHODS

WORLD = 3  # shard cuts fall inside rows and blocks: irregular scale groups
SHAPES = [(257, 103), (64, 33), (96,)]  # a bucket of two weights and a bias

CODECS = ([("e4m3", s, "nearest") for s in ("tensor", "row", "block")]
          + [("e5m2", s, "nearest") for s in ("tensor", "row", "block")]
          + [(f, None, r) for f in ("nvfp4", "mxfp4", "mxfp8") for r in ("nearest", "stochastic")])


def _bucket(rank: int, shapes) -> torch.Tensor:
    """One rank's flat bucket: each tensor at its own magnitude (per-tensor scales differ)."""
    g = torch.Generator().manual_seed(rank)
    parts = [torch.randn(s, generator=g).reshape(-1) * 10.0 ** (i - 1)
             for i, s in enumerate(shapes)]
    return torch.cat(parts)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN where NaN."""
    a = to_host(a)
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize(("fmt", "scaling", "rounding"), CODECS)
def test_codec_and_stages_on_the_device_match_the_cpu_without_host_syncs(fmt, scaling,
                                                                       rounding):
    codec = make_codec(fmt, scaling, 32, rounding)
    layout = ShardLayout.build(SHAPES, codec, WORLD)
    inputs = [_bucket(r, SHAPES) for r in range(WORLD)]
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
    for name, g, e in zip(("round trip", "simulation", "poisoned simulation"), got, expect):
        assert _same(g, e), f"{fmt}/{scaling}/{rounding}: {name} differs from the CPU's"


def _maps(config, layers, device, codec_block):
    """Every layer's map of ``config``, built as its factor source builds it, on ``device``:
    the fixed rotations by the source itself, the others from statistics on ``device``."""
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
        D = torch.randn(512, layer.d_out, generator=g)
        A = SecondMoment(layer.d_in, mode, sketch_size=config.k + config.oversample,
                         device=device)
        A.update(X.to(device))
        S = SecondMoment(layer.d_out, "exact", device=device)
        S.update(D.to(device))
        maps[name] = make_transform(
            kind, config.damping, block=config.transform_block or 128,
            factor=A.factor(min(config.k, layer.d_in)) if kind == "lowrank" else None,
            A=A.mean() if "A" in needs(kind) else None,
            S=S.mean() if "S" in needs(kind) else None)
    return maps


def _step(maps, shapes, grads, layout, seed):
    """One ordinary step of the exact collective: ``Ĝ_p = (Σ_r G_{p,r} T_p / N) T_p⁻¹``."""
    names = list(maps) + [None] * (len(shapes) - len(maps))
    inputs = []
    for rank_grads in grads:
        parts = [g if name is None else maps[name].forward(g)
                 for name, g in zip(names, rank_grads)]
        inputs.append(torch.cat([p.reshape(-1) for p in parts]))
    total = simulate_exact_allreduce(inputs, layout, seed)
    total = total.div_(total.new_full((), WORLD))
    out, pos = [], 0
    for name, shape in zip(names, shapes):
        n = torch.Size(shape).numel()
        y = total[pos : pos + n].view(shape)
        out.append(y if name is None else maps[name].inverse(y))
        pos += n
    return out


GEOFP8 = [m for m, spec in METHODS.items() if spec.kind == "geofp8"]


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
    expect = _step(_maps(config, layers, "cpu", codec.block_size), shapes, grads, layout, 3)
    with FakeDevice() as dev:
        maps = _maps(config, layers, DEVICE, codec.block_size)  # a refresh: syncs allowed
        on_dev = [[to_device(g) for g in rank_grads] for rank_grads in grads]
        _step(maps, shapes, on_dev, layout, 3)
        with dev.strict():
            got = _step(maps, shapes, on_dev, layout, 3)
    for shape, g, e in zip(shapes, got, expect):
        assert _same(g.contiguous(), e.contiguous()), f"{method}: {shape} differs from the CPU's"
