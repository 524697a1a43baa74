"""Configuration of GeoFP8: string enums for every choice, one frozen-in-spirit dataclass.

Every field decides what goes on the wire, so the configuration must be identical on every
rank (checked at the first step). Choices are plain strings (``format="e4m3"``) validated
against the enums below; the enums are there to read and to autocomplete.
"""

from __future__ import annotations

import enum
import warnings
from dataclasses import asdict, dataclass

from .codecs import FORMATS, ROUNDINGS, SCALINGS
from .codecs.base import mix_seed
from .comm import COLLECTIVES
from .geometry.factory import TRANSFORMS

__all__ = ["Candidates", "FP8Config", "FactorSource", "GeoFP8Config", "LayerMode",
           "Statistics"]


class LayerMode(str, enum.Enum):
    """Which candidate layers take the geometry branch (see :mod:`geofp8.selection`)."""

    AUTO = "auto"  # measured at every refresh, with error feedback, switched with hysteresis
    PROFILE = "profile"  # the paper: clipped-code profile over the first steps, then fixed
    ALL = "all"
    NONE = "none"


class Candidates(str, enum.Enum):
    """Which Linear layers may take the geometry branch at all."""

    BLOCKS = "blocks"  # Linear layers inside repeated blocks (not the LM head); the paper's set
    LINEAR = "linear"  # every Linear layer


class FactorSource(str, enum.Enum):
    """Where the geometry maps come from (see :mod:`geofp8.geometry.sources`)."""

    REFRESH = "refresh"  # the paper: statistics over refresh_every steps, reduced, broadcast
    FRESH = "fresh"  # this step's factor from an all-reduced sketch
    LOCAL = "local"  # each sender's own factor, shipped with its payload


class Statistics(str, enum.Enum):
    """How ``A = E[x xᵀ]`` is accumulated for refreshed factors."""

    AUTO = "auto"  # sketch when d_in > sketch_above (low-rank maps only), else exact
    EXACT = "exact"  # d_in² floats
    SKETCH = "sketch"  # d_in·(k+p) floats


def _one_of(value, choices, what: str) -> str | None:
    values = [c.value if isinstance(c, enum.Enum) else c for c in choices]
    value = value.value if isinstance(value, enum.Enum) else value
    return None if value in values else f"{what} must be one of {values}, got {value!r}"


@dataclass
class GeoFP8Config:
    """Everything that decides what goes on the wire. Must be identical on every rank.

    The defaults are the README's: E4M3 per-tensor, exact collective, low-rank-32 input-side
    whitening of the layers ``auto`` chooses among the blocks' Linear layers, error feedback.
    """

    # -- codec
    format: str = "e4m3"  # a name of geofp8.codecs.FORMATS; e4m3: 2⁻⁴ relative error
    scaling: str = "tensor"  # FP8 scale groups: tensor | row | block (block_size elements)
    block_size: int = 128
    rounding: str = "nearest"  # nearest (ties to even) | stochastic (block formats, seeded)
    collective: str = "exact"  # exact: all-to-all + FP32 sum + all-gather | allgather
    # -- geometry
    transform: str = "lowrank"  # a kind of geofp8.geometry.factory.TRANSFORMS
    k: int = 32  # rank of the low-rank factor (the paper's k)
    damping: float = 0.1  # λ = damping · tr(A) / d_in
    transform_block: int = 128  # column block of transform="block"
    factor_source: str = "refresh"  # FactorSource
    refresh_every: int = 50  # steps between refreshes / auto measurements (the paper's K)
    statistics: str = "auto"  # Statistics
    sketch_above: int = 256  # Statistics.AUTO sketches inputs wider than this
    oversample: int = 8  # p: the sketch has k + p columns
    # -- selection
    layers: str | list[str] = "auto"  # LayerMode, or module names
    candidates: str | list[str] = "blocks"  # Candidates, or module names
    auto_margin: float = 0.1  # auto switches on below (1 − margin) × Euclidean error
    profile_steps: int = 100  # profile: steps scored after the warm-up
    profile_top: int | None = None  # profile: layers kept (default: a quarter)
    min_dim: int = 16  # Linear layers with min(d_in, d_out) < min_dim stay Euclidean
    # -- error feedback, warm-up, seeds
    error_feedback: bool = True  # keep R ← Ũ − deq(Q(Ũ)) in communication coordinates
    warmup_steps: int = 0  # steps communicated in FP32 first
    seed: int = 0  # the sketch's test matrix and the Hadamard signs (shared by all ranks)
    rank: int | None = None  # deprecated name of ``k``

    def __post_init__(self) -> None:
        if self.rank is not None:
            warnings.warn("GeoFP8Config(rank=...) is deprecated: the low-rank factor's rank is "
                          "now called k", DeprecationWarning, stacklevel=3)
            self.k, self.rank = self.rank, None
        if self.collective == "native":
            raise ValueError("collective='native' (summing FP8 codes inside the backend) is not "
                             "offered: no backend available to this project sums FP8 with "
                             "per-rank scales exactly; use 'exact' or 'allgather'")
        problems = [
            _one_of(self.format, FORMATS, "format"),
            _one_of(self.scaling, SCALINGS, "scaling"),
            _one_of(self.rounding, ROUNDINGS, "rounding"),
            None if self.rounding == "nearest" or self.format not in ("e4m3", "e5m2") else
            "stochastic rounding needs a block format (nvfp4, mxfp4, mxfp8)",
            _one_of(self.collective, COLLECTIVES, "collective"),
            _one_of(self.transform, TRANSFORMS, "transform"),
            _one_of(self.factor_source, FactorSource, "factor_source"),
            _one_of(self.statistics, Statistics, "statistics"),
            None if isinstance(self.layers, (list, tuple)) else
            _one_of(self.layers, LayerMode, "layers (or a list of module names)"),
            None if isinstance(self.candidates, (list, tuple)) else
            _one_of(self.candidates, Candidates, "candidates (or a list of module names)"),
        ]
        checks = [
            (self.k >= 1, "k must be >= 1"),
            (self.damping >= 0, "damping must be >= 0"),
            (self.refresh_every >= 1, "refresh_every must be >= 1"),
            (self.block_size >= 1 and self.transform_block >= 1, "block sizes must be >= 1"),
            (self.warmup_steps >= 0 and self.profile_steps >= 1, "step counts must be >= 0"),
            (0 <= self.auto_margin < 1, "auto_margin must be in [0, 1)"),
            (self.factor_source == "refresh" or self.transform == "lowrank",
             f"factor_source={self.factor_source!r} needs transform='lowrank'"),
            (self.factor_source != "local" or self.collective == "exact",
             "factor_source='local' needs collective='exact'"),
            (self.statistics != "sketch" or self.transform == "lowrank",
             "statistics='sketch' only supports transform='lowrank'"),
        ]
        problems += [message for ok, message in checks if not ok]
        problems = [p for p in problems if p]
        if problems:
            raise ValueError("GeoFP8Config: " + "; ".join(problems))
        for name in ("format", "scaling", "collective", "transform", "factor_source",
                     "statistics", "layers", "candidates"):
            value = getattr(self, name)
            if isinstance(value, enum.Enum):
                setattr(self, name, value.value)

    def rounding_seed(self, *index: int) -> int | None:
        """Stochastic rounding's seed for ``index`` (step, bucket or unit, …): the same on
        every rank; ``None`` when rounding to nearest."""
        return mix_seed(self.seed, *index) if self.rounding == "stochastic" else None

    def to_dict(self) -> dict:
        d = asdict(self)
        for key in ("layers", "candidates"):
            if isinstance(d[key], tuple):
                d[key] = list(d[key])
        return d


@dataclass
class FP8Config:
    """Plain (Euclidean) FP8 communication: the control GeoFP8 must beat."""

    format: str = "e4m3"
    scaling: str = "tensor"
    block_size: int = 128
    collective: str = "exact"
    error_feedback: bool = False
    warmup_steps: int = 0

    def to_geofp8(self, transform: str = "euclidean", layers: str = "none",
                  candidates: str = "linear") -> GeoFP8Config:
        return GeoFP8Config(format=self.format, scaling=self.scaling, block_size=self.block_size,
                            collective=self.collective, error_feedback=self.error_feedback,
                            warmup_steps=self.warmup_steps, transform=transform, layers=layers,
                            candidates=candidates)
