"""GeoFP8: geometry-aware FP8 gradient communication for PyTorch data-parallel training."""

from .formats import Codec, Packed

__all__ = ["Codec", "Packed"]
__version__ = "0.1.0"
