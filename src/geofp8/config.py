"""Configuration of the GeoFP8 communication hooks (small dataclasses, validated on creation)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .codecs import FORMATS, ROUNDINGS, SCALINGS
from .comm import COLLECTIVES

TRANSFORMS = ("lowrank", "full", "diag", "block", "output", "kfac", "hadamard", "rht",
              "euclidean")
LAYER_MODES = ("auto", "profile", "all", "none")


@dataclass
class GeoFP8Config:
    """Everything that decides what goes on the wire. Must be identical on every rank.

    Codec
        format: ``"e4m3"`` (default: 2⁻⁴ relative error, enough range for amax-scaled
            gradients), ``"e5m2"`` (2⁻³, wider range), or a block format with its own
            scales: ``"nvfp4"``, ``"mxfp4"``, ``"mxfp8"`` (see :mod:`geofp8.codecs`).
        rounding: ``"nearest"`` (default) or ``"stochastic"`` (block formats; unbiased, its
            stream seeded from ``seed``, the step and the bucket, the same on every rank).
        scaling: ``"tensor"`` (one FP32 scale per parameter and shard, default), ``"row"``
            or ``"block"`` (``block_size`` elements per scale).
        collective: ``"exact"`` (all-to-all + FP32 sum + all-gather; default) or
            ``"allgather"`` (one rounding, ``N−1`` payloads per rank).
    Geometry
        transform: input-side ``"lowrank"`` (default, DESIGN §1), ``"full"``, ``"diag"``,
            ``"block"``, output-side ``"output"``, two-sided ``"kfac"``, data-independent
            ``"hadamard"`` (largest power-of-two block ≤ 256) and ``"rht"`` (random signs and
            a Hadamard at the codec's scale block: 16 for NVFP4, 32 for MX), or
            ``"euclidean"``.
        rank: ``k`` of the low-rank factor (default 32, the paper's choice).
        damping: ``λ = damping · tr(A)/d_in`` (default 0.1: our pre-code measurements).
        transform_block: block width for ``transform="block"``.
        factor_source: ``"refresh"`` (default; the paper: statistics accumulated over
            ``refresh_every`` steps, reduced, factored on an owner rank and broadcast) or
            ``"fresh"`` (this step's factor: each layer's forward sketches ``Σ x xᵀ Ω``,
            ``d_in·(k+p)`` floats, and all-reduces it asynchronously; low-rank only) or
            ``"local"`` (each rank's own factor of this step, shipped with its payload —
            ``d_in·k`` floats per shard — and applied by the receiver to that sender's rows
            before the FP32 sum; the reduced shard travels on in Euclidean FP8).
        refresh_every: steps between factor refreshes (default 50, the paper's K); with
            fresh factors, steps between ``auto`` measurements.
        statistics: ``"exact"`` (``d_in²`` floats), ``"sketch"`` (``d_in·(k+p)``) or ``"auto"``
            (sketch when ``d_in > sketch_above``; only the low-rank transform can use a sketch).
        oversample: ``p`` of the sketch.
    Selection (which Linear weights take the geometry branch)
        layers: ``"auto"`` (default: measured at each refresh, a layer switches to geometry
            only when its round-trip error is below ``(1 − auto_margin)`` × Euclidean and
            back when it is above Euclidean), ``"profile"`` (the paper: share of FP8 codes
            saturated or flushed to zero over ``profile_steps``, top ``profile_top``, fixed),
            ``"all"``, ``"none"``, or a list of module names.
        min_dim: Linear layers with ``min(d_in, d_out) < min_dim`` always go Euclidean.
    Error feedback and warm-up
        error_feedback: keep ``R ← Ũ − deq(Q(Ũ))`` per parameter in communication coordinates.
        warmup_steps: steps communicated in FP32 before FP8 starts.
        seed: seed of the sketch's test matrix (shared by all ranks).
    """

    format: str = "e4m3"
    scaling: str = "tensor"
    block_size: int = 128
    rounding: str = "nearest"
    collective: str = "exact"
    transform: str = "lowrank"
    rank: int = 32
    damping: float = 0.1
    transform_block: int = 128
    factor_source: str = "refresh"
    refresh_every: int = 50
    statistics: str = "auto"
    sketch_above: int = 1024
    oversample: int = 8
    layers: str | list[str] = "auto"
    auto_margin: float = 0.1
    profile_steps: int = 100
    profile_top: int | None = None
    min_dim: int = 16
    error_feedback: bool = True
    warmup_steps: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        checks = [
            (self.format in FORMATS, f"format must be one of {list(FORMATS)}"),
            (self.scaling in SCALINGS, f"scaling must be one of {SCALINGS}"),
            (self.rounding in ROUNDINGS, f"rounding must be one of {ROUNDINGS}"),
            (self.rounding == "nearest" or self.format not in ("e4m3", "e5m2"),
             "stochastic rounding needs a block format (nvfp4, mxfp4, mxfp8)"),
            (self.collective in COLLECTIVES, f"collective must be one of {COLLECTIVES}"),
            (self.transform in TRANSFORMS, f"transform must be one of {TRANSFORMS}"),
            (self.statistics in ("auto", "exact", "sketch"),
             "statistics must be 'auto', 'exact' or 'sketch'"),
            (isinstance(self.layers, (list, tuple)) or self.layers in LAYER_MODES,
             f"layers must be one of {LAYER_MODES} or a list of module names"),
            (self.rank >= 1, "rank must be >= 1"),
            (self.damping >= 0, "damping must be >= 0"),
            (self.refresh_every >= 1, "refresh_every must be >= 1"),
            (self.block_size >= 1 and self.transform_block >= 1, "block sizes must be >= 1"),
            (self.warmup_steps >= 0 and self.profile_steps >= 1, "step counts must be >= 0"),
            (0 <= self.auto_margin < 1, "auto_margin must be in [0, 1)"),
        ]
        if self.collective == "native":
            raise ValueError("collective='native' (summing FP8 codes inside the backend) is not "
                             "offered: no backend available to this project sums FP8 with "
                             "per-rank scales exactly; use 'exact' or 'allgather'")
        for ok, message in checks:
            if not ok:
                raise ValueError(f"GeoFP8Config: {message}")
        if self.factor_source not in ("refresh", "fresh", "local"):
            raise ValueError("GeoFP8Config: factor_source must be 'refresh', 'fresh' or 'local'")
        if self.factor_source != "refresh" and self.transform != "lowrank":
            raise ValueError(f"GeoFP8Config: factor_source={self.factor_source!r} needs "
                             "transform='lowrank'")
        if self.factor_source == "local" and self.collective != "exact":
            raise ValueError("GeoFP8Config: factor_source='local' needs collective='exact'")
        if self.statistics == "sketch" and self.transform != "lowrank":
            raise ValueError("GeoFP8Config: statistics='sketch' only supports transform='lowrank'")

    def to_dict(self) -> dict:
        d = asdict(self)
        if isinstance(d["layers"], tuple):
            d["layers"] = list(d["layers"])
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

    def to_geofp8(self, transform: str = "euclidean", layers: str = "none") -> GeoFP8Config:
        return GeoFP8Config(format=self.format, scaling=self.scaling, block_size=self.block_size,
                            collective=self.collective, error_feedback=self.error_feedback,
                            warmup_steps=self.warmup_steps, transform=transform, layers=layers)
