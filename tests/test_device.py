"""GPU correctness checked without a GPU: codecs, transforms and the exact collective's stages
of every method run on the stand-in device of ``tests/fakedevice.py``, which rejects a host
tensor meeting device data, divides by a host scalar as CUDA does, and counts host syncs.

Each case runs the same computation on the CPU and on the stand-in device: the results must
be bitwise equal, and the ordinary-step part (encode, all-to-all stages, decode, the map and
its inverse) must not sync with the host once the per-layout tables exist (first call). The
per-method step is the one ``geofp8.tools.gpu_check`` runs on a real GPU."""

import pytest
import torch

from fakedevice import DEVICE, FakeDevice, to_device, to_host
from geofp8.codecs import make_codec
from geofp8.comm import ShardLayout, simulate_exact_allreduce
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
    for name, g, e in zip(("round trip", "simulation", "poisoned simulation"), got, expect):
        assert _same(g, e), f"{fmt}/{scaling}/{rounding}: {name} differs from the CPU's"


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
