"""The configuration is typed and frozen: strings become enums at construction, a field that
does not apply to the chosen format or transform raises, and every method refuses an
override it does not take."""

import dataclasses
import json

import pytest
import torch

from geofp8 import GeoFP8Config
from geofp8.config import Format, FP8Config, LayerMode, Scaling, Transform
from geofp8.methods import METHODS
from geofp8.tools.errors import UsageError
from geofp8.tools.train.config import TrainConfig


def test_strings_become_enums_and_to_dict_gives_plain_strings_back():
    config = GeoFP8Config(format="e5m2", transform="kfac", layers=["a.b", "c"])
    assert config.format is Format.E5M2 and config.format == "e5m2"
    assert config.transform is Transform.KFAC and config.layers == ("a.b", "c")
    assert GeoFP8Config(layers="all").layers is LayerMode.ALL
    plain = config.to_dict()
    assert type(plain["format"]) is str and plain["layers"] == ["a.b", "c"]
    assert GeoFP8Config(**json.loads(json.dumps(plain))) == config


def test_the_config_is_frozen():
    config = GeoFP8Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.k = 8
    assert dataclasses.replace(config, k=8).k == 8


def test_fields_that_apply_take_their_defaults_and_the_others_stay_none():
    fp8 = GeoFP8Config()
    assert fp8.scaling is Scaling.TENSOR and fp8.block_size is None
    assert fp8.transform_block is None
    assert GeoFP8Config(scaling="block").block_size == 128
    assert GeoFP8Config(transform="block").transform_block == 128
    nvfp4 = GeoFP8Config(format="nvfp4")
    assert nvfp4.scaling is None and nvfp4.block_size is None


@pytest.mark.parametrize("fields,message", [
    (dict(format="nvfp4", scaling="row"), "scaling applies to the FP8 formats only"),
    (dict(format="mxfp8", block_size=32), "block_size applies to scaling='block' only"),
    (dict(block_size=64), "block_size applies to scaling='block' only"),
    (dict(transform_block=64), "transform_block applies to transform='block' only"),
    (dict(format="e3m4"), "format must be one of"),
    (dict(layers="some"), "layers"),
    (dict(rounding="stochastic"), "stochastic rounding needs a block format"),
])
def test_a_field_that_does_not_apply_or_a_bad_choice_raises(fields, message):
    with pytest.raises(ValueError, match=message):
        GeoFP8Config(**fields)


def test_fp8_config_is_checked_and_normalised_alike():
    assert FP8Config(format="e5m2").format is Format.E5M2
    assert FP8Config().to_geofp8().scaling is Scaling.TENSOR
    with pytest.raises(ValueError, match="scaling applies to the FP8 formats only"):
        FP8Config(format="nvfp4", scaling="tensor")


def test_methods_refuse_overrides_they_do_not_take():
    with pytest.raises(ValueError, match=r"does not take \['k'\]"):
        METHODS["hadamard"].config(k=8)
    assert METHODS["geofp8-auto"].config(k=8, format=None).k == 8
    assert METHODS["fp8-ef"].takes(format="e5m2", k=8) == {"format": "e5m2"}


def test_the_trainer_refuses_a_format_the_method_fixes():
    with pytest.raises(UsageError, match="fixes its own format"):
        TrainConfig(method="nvfp4-ef", format="e5m2")
    assert TrainConfig(method="fp8-ef", format="e5m2").format == "e5m2"


def test_the_default_is_fp8_with_error_feedback_and_every_method_is_importable():
    import geofp8

    assert geofp8.METHODS is METHODS and geofp8.Method is type(METHODS["fp8-ef"])
    default = GeoFP8Config()
    assert default.layers is LayerMode.NONE and default.error_feedback
    assert FP8Config().error_feedback == default.error_feedback  # the two agree
    assert FP8Config(error_feedback=False).to_geofp8() == METHODS["fp8"].config()
    assert GeoFP8Config(layers="auto") == METHODS["geofp8-auto"].config()
    assert GeoFP8Config.from_method("nvfp4-fresh8-ef", k=16) == METHODS[
        "nvfp4-fresh8-ef"].config(k=16)
    assert GeoFP8Config.from_method("budget", budget=0.7).budget == 0.7
    with pytest.raises(ValueError, match="unknown method 'fp9'"):
        GeoFP8Config.from_method("fp9")
    with pytest.raises(ValueError, match="PyTorch's own hook"):
        GeoFP8Config.from_method("bf16")
    with pytest.raises(ValueError, match="does not take"):
        GeoFP8Config.from_method("fp8-ef", k=8)
    with pytest.raises(ValueError, match="set layers='auto'"):
        GeoFP8Config(format="nvfp4", budget=0.8)


def _default_worker(rank, world_size):
    from torch import nn

    from geofp8 import FP8State, GeoFP8State, fp8_hook, geofp8_hook
    from toymodels import loss_fn, make_model

    params = []
    for make in (lambda m: (GeoFP8State(m, GeoFP8Config()), geofp8_hook),
                 lambda m: (GeoFP8State(m, METHODS["fp8-ef"].config()), geofp8_hook),
                 lambda m: (FP8State(m, FP8Config()), fp8_hook)):
        model = make_model()
        ddp = nn.parallel.DistributedDataParallel(model)
        ddp.register_comm_hook(*make(model))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):  # from step 1 on, error feedback changes what is sent
            loss_fn(ddp, step, rank).backward()
            opt.step()
            opt.zero_grad()
        params.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return params


@pytest.mark.distributed
def test_the_default_trains_bit_identically_to_the_method_fp8_ef():
    from distributed import run_ranks

    for default, fp8_ef, fp8_config in run_ranks(_default_worker, 2, timeout=120):
        assert torch.equal(default, fp8_ef) and torch.equal(default, fp8_config)
