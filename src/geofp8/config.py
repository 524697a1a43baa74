"""Configuration of GeoFP8: string enums for every choice, two small frozen dataclasses.

Every field decides what goes on the wire, so the configuration must be identical on every
rank (checked at the first step). Choices may be given as plain strings
(``format="e4m3"``); they are normalised to the enums below at construction, so a typo fails
there and not at the first step. A field that does not apply to the chosen format or
transform (``scaling`` of ``nvfp4``, ``transform_block`` of ``lowrank``) raises; left at
``None`` it takes the format's or transform's default.
"""

from __future__ import annotations

import enum
import warnings
from dataclasses import asdict, dataclass

from .codecs import FORMATS, ROUNDINGS, SCALINGS
from .codecs.base import mix_seed
from .comm import COLLECTIVES, KERNELS
from .feedback import STORAGES
from .geometry.factory import TRANSFORMS

__all__ = ["Candidates", "Collective", "FP8Config", "FactorSource", "Format", "GeoFP8Config",
           "Hierarchy", "Kernels", "LayerMode", "Residual", "Rounding", "Scaling", "Statistics",
           "Transform"]


def _registry_enum(name: str, values) -> type[enum.StrEnum]:
    """A string enum of a registry's names (one place adds a format or a transform)."""
    return enum.StrEnum(name, {v.upper(): v for v in values})


Format = _registry_enum("Format", FORMATS)  # E4M3, E5M2, NVFP4, MXFP4, MXFP8
Scaling = _registry_enum("Scaling", SCALINGS)  # FP8 scale groups: TENSOR, ROW, BLOCK
Rounding = _registry_enum("Rounding", ROUNDINGS)  # NEAREST, STOCHASTIC
Collective = _registry_enum("Collective", COLLECTIVES)  # EXACT, ALLGATHER
Transform = _registry_enum("Transform", TRANSFORMS)  # EUCLIDEAN, LOWRANK, KFAC, ...
Kernels = _registry_enum("Kernels", KERNELS)  # AUTO, BATCHED, CHUNKED (geofp8.comm.layout)
Residual = _registry_enum("Residual", STORAGES)  # EF storage: FP32, BF16, FP8, NVFP4
FP8_FORMATS = (Format.E4M3, Format.E5M2)


class Hierarchy(enum.StrEnum):
    """DDP's collective over the node layout (see :mod:`geofp8.hierarchy`)."""

    AUTO = "auto"  # NODE when there are >= 2 nodes of >= 2 ranks, else FLAT
    FLAT = "flat"  # one exact collective over every rank
    NODE = "node"  # FP32 inside a node, the exact collective between nodes


class LayerMode(enum.StrEnum):
    """Which candidate layers take the geometry branch (see :mod:`geofp8.selection`)."""

    AUTO = "auto"  # measured at every refresh, with error feedback, switched with hysteresis
    PROFILE = "profile"  # the paper: clipped-code profile over the first steps, then fixed
    ALL = "all"
    NONE = "none"


class Candidates(enum.StrEnum):
    """Which Linear layers may take the geometry branch at all."""

    BLOCKS = "blocks"  # Linear layers inside repeated blocks (not the LM head); the paper's set
    LINEAR = "linear"  # every Linear layer


class FactorSource(enum.StrEnum):
    """Where the geometry maps come from (see :mod:`geofp8.geometry.sources`)."""

    REFRESH = "refresh"  # the paper: statistics over refresh_every steps, reduced, broadcast
    FRESH = "fresh"  # this step's factor from an all-reduced sketch
    LOCAL = "local"  # each sender's own factor, shipped with its payload


class Statistics(enum.StrEnum):
    """How ``A = E[x xᵀ]`` is accumulated for refreshed factors."""

    AUTO = "auto"  # sketch when d_in > sketch_above (low-rank maps only), else exact
    EXACT = "exact"  # d_in² floats
    SKETCH = "sketch"  # d_in·(k+p) floats


def _choice(value, kind: type[enum.StrEnum], what: str, problems: list[str]):
    """``value`` as a member of ``kind``; a problem is recorded when it is none."""
    try:
        return kind(value.value if isinstance(value, enum.Enum) else value)
    except ValueError:
        problems.append(f"{what} must be one of {[m.value for m in kind]}, got {value!r}")
        return value


def _choice_or_names(value, kind: type[enum.StrEnum], what: str, problems: list[str]):
    """A member of ``kind``, or a tuple of module names."""
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return _choice(value, kind, f"{what} (or a list of module names)", problems)


def _default_if_applies(value, applies: bool, default, what: str, problems: list[str]):
    """``value`` (``default`` when ``None``) where it applies; ``None`` where it does not,
    and a problem when the caller set it there."""
    if applies:
        return default if value is None else value
    if value is not None:
        problems.append(what)
    return None


@dataclass(frozen=True)
class GeoFP8Config:
    """Everything that decides what goes on the wire. Must be identical on every rank.

    The defaults are the method ``fp8-ef``: E4M3 per-tensor scales, the exact collective,
    error feedback with BF16 residuals, no geometry (``layers="none"``) — at FP8 it was the
    best at equal bytes in every comparison we ran, and the geometry did not improve the loss
    there (BF16 residuals: within 4e-5 of FP32's loss, 2 seeds). ``layers="auto"``
    turns on low-rank-32 input-side whitening of the layers it measures to gain (the method
    ``geofp8-auto``); :meth:`from_method` gives any named method's configuration.
    """

    # -- codec
    format: Format = Format.E4M3  # e4m3: 2⁻⁴ relative error; see geofp8.codecs
    scaling: Scaling | None = None  # FP8 only: tensor (default) | row | block
    block_size: int | None = None  # FP8 scaling="block" only: elements per scale (128)
    rounding: Rounding = Rounding.NEAREST  # stochastic: block formats, seeded
    collective: Collective = Collective.EXACT  # exact: all-to-all + FP32 sum + all-gather
    hierarchy: Hierarchy = Hierarchy.AUTO  # DDP: compress only between nodes (auto|flat|node)
    node_size: int | None = None  # ranks per node (None: torchrun's LOCAL_WORLD_SIZE)
    kernels: Kernels = Kernels.AUTO  # auto: cache-sized pieces on CPU, whole-bucket kernels else
    # -- geometry
    transform: Transform = Transform.LOWRANK  # a kind of geofp8.geometry.factory.TRANSFORMS
    k: int = 32  # rank of the low-rank factor (the paper's k)
    damping: float = 0.1  # λ = damping · tr(A) / d_in
    transform_block: int | None = None  # transform="block" only: column block (128)
    factor_source: FactorSource = FactorSource.REFRESH
    refresh_every: int = 50  # steps between refreshes / auto measurements (the paper's K)
    statistics: Statistics = Statistics.AUTO
    sketch_above: int = 256  # Statistics.AUTO sketches inputs wider than this
    oversample: int = 8  # p: the sketch has k + p columns
    sketch_format: Format | None = None  # fresh: the sketch's format (None: FP32 all-reduce)
    # -- selection
    layers: LayerMode | tuple[str, ...] = LayerMode.NONE  # auto | profile | all | module names
    candidates: Candidates | tuple[str, ...] = Candidates.BLOCKS  # or module names
    auto_margin: float = 0.1  # auto switches on below (1 − margin) × Euclidean error
    profile_steps: int = 100  # profile: steps scored after the warm-up
    profile_top: int | None = None  # profile: layers kept (default: a quarter)
    min_dim: int = 16  # Linear layers with min(d_in, d_out) < min_dim stay Euclidean
    budget: float | None = None  # bytes per element per round trip: formats chosen per tensor
    # -- error feedback, warm-up, seeds
    error_feedback: bool = True  # keep R ← Ũ − deq(Q(Ũ)) in communication coordinates
    owner_feedback: bool = False  # EF on the second rounding too (the reduced shard's owner)
    residual: Residual = Residual.BF16  # the sender's EF storage (geofp8.feedback): 2 B/elem
    warmup_steps: int = 0  # steps communicated in FP32 first
    seed: int = 0  # the sketch's test matrix and the Hadamard signs (shared by all ranks)
    rank: int | None = None  # deprecated name of ``k``

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        if self.rank is not None:
            warnings.warn("GeoFP8Config(rank=...) is deprecated: the low-rank factor's rank is "
                          "now called k", DeprecationWarning, stacklevel=3)
            set_("k", self.rank)
            set_("rank", None)
        if self.collective == "native":
            raise ValueError("collective='native' (summing FP8 codes inside the backend) is not "
                             "offered: no backend available to this project sums FP8 with "
                             "per-rank scales exactly; use 'exact' or 'allgather'")
        problems: list[str] = []
        for name, kind in (("format", Format), ("rounding", Rounding),
                           ("collective", Collective), ("hierarchy", Hierarchy),
                           ("kernels", Kernels), ("residual", Residual),
                           ("transform", Transform),
                           ("factor_source", FactorSource), ("statistics", Statistics)):
            set_(name, _choice(getattr(self, name), kind, name, problems))
        if self.sketch_format is not None:
            set_("sketch_format", _choice(self.sketch_format, Format, "sketch_format",
                                          problems))
        set_("layers", _choice_or_names(self.layers, LayerMode, "layers", problems))
        set_("candidates", _choice_or_names(self.candidates, Candidates, "candidates",
                                            problems))
        fp8 = self.format in FP8_FORMATS
        set_("scaling", _default_if_applies(
            self.scaling, fp8, Scaling.TENSOR,
            f"scaling applies to the FP8 formats only; {self.format} fixes its own scales",
            problems))
        if self.scaling is not None:
            set_("scaling", _choice(self.scaling, Scaling, "scaling", problems))
        set_("block_size", _default_if_applies(
            self.block_size, self.scaling == Scaling.BLOCK, 128,
            "block_size applies to scaling='block' only", problems))
        set_("transform_block", _default_if_applies(
            self.transform_block, self.transform == Transform.BLOCK, 128,
            "transform_block applies to transform='block' only", problems))
        checks = [
            (self.rounding == "nearest" or not fp8,
             "stochastic rounding needs a block format (nvfp4, mxfp4, mxfp8)"),
            (self.k >= 1, "k must be >= 1"),
            (self.node_size is None or self.node_size >= 1, "node_size must be >= 1"),
            (self.hierarchy != "node" or self.collective == "exact",
             "hierarchy='node' needs collective='exact'"),
            (not self.owner_feedback or self.collective == "exact",
             "owner_feedback needs collective='exact' (allgather rounds once)"),
            (self.damping >= 0, "damping must be >= 0"),
            (self.refresh_every >= 1, "refresh_every must be >= 1"),
            ((self.block_size or 1) >= 1 and (self.transform_block or 1) >= 1,
             "block sizes must be >= 1"),
            (self.warmup_steps >= 0 and self.profile_steps >= 1, "step counts must be >= 0"),
            (0 <= self.auto_margin < 1, "auto_margin must be in [0, 1)"),
            (self.factor_source == "refresh" or self.transform == "lowrank",
             f"factor_source={self.factor_source!r} needs transform='lowrank'"),
            (self.factor_source != "local" or self.collective == "exact",
             "factor_source='local' needs collective='exact'"),
            (self.statistics != "sketch" or self.transform == "lowrank",
             "statistics='sketch' only supports transform='lowrank'"),
            (self.sketch_format is None or self.factor_source == "fresh",
             "sketch_format applies to factor_source='fresh' only (a refresh's statistics "
             "travel once per refresh_every steps, in FP32)"),
        ]
        if self.budget is not None:  # see geofp8.selection.BudgetSelection
            checks += [
                (self.budget > 0, "budget must be > 0 bytes per element"),
                (self.format == Format.NVFP4, "budget needs format='nvfp4' (the floor every "
                 "tensor takes unless the budget buys it e4m3)"),
                (self.transform == Transform.LOWRANK and self.factor_source == "refresh",
                 "budget needs transform='lowrank' with factor_source='refresh'"),
                (self.layers == LayerMode.AUTO, "budget chooses the layers itself: set "
                 "layers='auto' (or use GeoFP8Config.from_method('budget', budget=B))"),
                (self.collective == "exact", "budget needs collective='exact'"),
                (self.hierarchy != "node", "budget needs hierarchy='flat' or 'auto' (one "
                 "exact collective over every rank)"),
            ]
        problems += [message for ok, message in checks if not ok]
        if problems:
            raise ValueError("GeoFP8Config: " + "; ".join(problems))

    @classmethod
    def from_method(cls, name: str, **overrides) -> GeoFP8Config:
        """The configuration of the method ``name`` of :data:`geofp8.METHODS` (``"fp8-ef"``,
        ``"nvfp4-fresh8-ef"``, ...), with the ``overrides`` that method takes."""
        from .methods import METHODS

        if name not in METHODS:
            raise ValueError(f"unknown method {name!r}; the methods are {sorted(METHODS)}")
        config = METHODS[name].config(**overrides)
        if config is None:
            raise ValueError(f"method {name!r} is PyTorch's own hook "
                             f"({METHODS[name].description}), not a GeoFP8Config: register "
                             f"it with METHODS[{name!r}].build(model)")
        return config

    def rounding_seed(self, *index: int) -> int | None:
        """Stochastic rounding's seed for ``index`` (step, bucket or unit, …): the same on
        every rank; ``None`` when rounding to nearest."""
        return mix_seed(self.seed, *index) if self.rounding == "stochastic" else None

    def to_dict(self) -> dict:
        """Plain strings, numbers and lists (JSON, ``weights_only`` checkpoints)."""
        return {k: list(v) if isinstance(v, tuple) else
                v.value if isinstance(v, enum.Enum) else v for k, v in asdict(self).items()}


@dataclass(frozen=True)
class FP8Config:
    """Plain (Euclidean) FP8 communication: the control GeoFP8 must beat. Its defaults are
    ``GeoFP8Config()``'s (error feedback on); ``error_feedback=False`` is the method ``fp8``."""

    format: Format = Format.E4M3
    scaling: Scaling | None = None
    block_size: int | None = None
    collective: Collective = Collective.EXACT
    error_feedback: bool = True
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        normal = self.to_geofp8()  # validates; the fields as GeoFP8Config normalises them
        for name in ("format", "scaling", "block_size", "collective"):
            object.__setattr__(self, name, getattr(normal, name))

    def to_geofp8(self, transform: str = "euclidean", layers: str = "none",
                  candidates: str = "linear") -> GeoFP8Config:
        return GeoFP8Config(format=self.format, scaling=self.scaling, block_size=self.block_size,
                            collective=self.collective, error_feedback=self.error_feedback,
                            warmup_steps=self.warmup_steps, transform=transform, layers=layers,
                            candidates=candidates)
