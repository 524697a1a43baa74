"""The configuration is typed and frozen: strings become enums at construction, a field that
does not apply to the chosen format or transform raises, and every method refuses an
override it does not take."""

import dataclasses
import json

import pytest

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
