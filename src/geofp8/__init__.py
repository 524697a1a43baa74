"""GeoFP8: geometry-aware FP8 gradient communication for PyTorch data-parallel training.

Two lines in a DDP script::

    state = GeoFP8State(model, GeoFP8Config())  # FP8 + error feedback (the method "fp8-ef")
    ddp_model.register_comm_hook(state, geofp8_hook)

Every named method (``METHODS``): ``GeoFP8Config.from_method("nvfp4-fresh8-ef")``.
"""

from .codecs import Codec, FP8Codec, Packed, make_codec
from .config import FP8Config, GeoFP8Config
from .ddp import (
    FP8State,
    GeoFP8State,
    HadamardFP8State,
    fp8_hook,
    geofp8_hook,
    hadamard_fp8_hook,
)
from .methods import METHODS, Method

__all__ = [
    "Codec",
    "FP8Codec",
    "FP8Config",
    "FP8State",
    "GeoFP8Config",
    "GeoFP8State",
    "HadamardFP8State",
    "METHODS",
    "Method",
    "Packed",
    "fp8_hook",
    "geofp8_hook",
    "hadamard_fp8_hook",
    "make_codec",
]
__version__ = "0.1.0"
