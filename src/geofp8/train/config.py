"""Settings of ``geofp8 train`` and the one table that maps ``--method`` to a DDP hook.

Every method name the trainer, ``compare`` and the demo accept is a key of :data:`METHODS`;
nothing else in the package decides what a method communicates.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ..config import FP8Config, GeoFP8Config


@dataclass
class TrainConfig:
    """One training run. The defaults are the paper's recipe where it has one (optimizer,
    learning rate, GeoFP8's ``k``/refresh/profile); sizes default to a CPU-sized run."""

    # model and data
    model: str = "llama-tiny"
    data: list[str] = field(default_factory=list)  # local text files; empty: default corpus
    dataset: str | None = None  # Hugging Face `datasets` name or saved path
    dataset_split: str = "train"
    text_column: str = "text"
    dataset_max_chars: int = 50_000_000
    vocab_size: int = 2048
    seq_len: int = 128
    batch_size: int = 8  # sequences per rank and step
    val_fraction: float = 0.05
    # schedule
    steps: int = 200
    stop_after: int | None = None  # end early (as if interrupted) but keep the schedule
    optimizer: str = "muon"
    lr: float = 5e-4
    lr_min: float = 5e-5
    warmup: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    # communication
    method: str = "fp32"
    format: str = "e4m3"
    refresh_every: int = 50
    profile_steps: int = 100
    rank: int = 32
    # measurement and output
    eval_every: int = 50
    eval_batches: int = 16
    shadow_every: int = 0
    log_every: int = 1
    checkpoint_every: int = 0
    out: str = "runs/train"
    resume: bool = False
    seed: int = 0
    threads: int = 0  # per rank; 0: cores / local ranks
    timeout_s: float = 300.0
    quiet: bool = False

    def __post_init__(self) -> None:
        checks = [
            (self.method in METHODS, f"method must be one of {list(METHODS)}"),
            (self.optimizer in ("muon", "adamw"), "optimizer must be 'muon' or 'adamw'"),
            (self.steps >= 1 and self.seq_len >= 1 and self.batch_size >= 1,
             "steps, seq_len and batch_size must be >= 1"),
            (self.warmup >= 0, "warmup must be >= 0"),
            (0 < self.lr_min <= self.lr, "need 0 < lr_min <= lr"),
            (self.eval_every >= 0 and self.shadow_every >= 0 and self.checkpoint_every >= 0,
             "eval/shadow/checkpoint intervals must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"TrainConfig: {message}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


# -- the method table -----------------------------------------------------------------------


@dataclass(frozen=True)
class Method:
    """What a ``--method`` sends. ``kind``: ``"allreduce"`` (DDP's own, FP32), ``"bf16"``
    (PyTorch's bf16 compress hook, 2 bytes/element), ``"fp8"`` / ``"hadamard"`` /
    ``"geofp8"`` (the GeoFP8 machinery with the config that :meth:`config` builds)."""

    kind: str
    description: str
    fp8: dict[str, Any] = field(default_factory=dict)  # FP8Config fields
    geo: dict[str, Any] = field(default_factory=dict)  # GeoFP8Config fields

    def config(self, cfg: TrainConfig) -> FP8Config | GeoFP8Config | None:
        if self.kind in ("fp8", "hadamard"):
            return FP8Config(format=cfg.format, **self.fp8)
        if self.kind == "geofp8":
            geo = dict(format=cfg.format, rank=cfg.rank, refresh_every=cfg.refresh_every,
                       profile_steps=cfg.profile_steps, seed=cfg.seed)
            return GeoFP8Config(**{**geo, **self.geo})
        return None


METHODS: dict[str, Method] = {
    "fp32": Method("allreduce", "FP32 ring all-reduce (DDP default)"),
    "bf16": Method("bf16", "PyTorch bf16_compress_hook"),
    "fp8": Method("fp8", "FP8, per-tensor scales", fp8=dict(error_feedback=False)),
    "fp8-ef": Method("fp8", "FP8 + error feedback", fp8=dict(error_feedback=True)),
    "fp8-block": Method("fp8", "FP8, a scale per 128 elements",
                        fp8=dict(scaling="block", block_size=128, error_feedback=False)),
    "hadamard": Method("hadamard", "FP8 + EF after a fixed block Hadamard rotation",
                       fp8=dict(error_feedback=True)),
    "geofp8": Method("geofp8", "the paper: profile-selected layers, low-rank k, EF",
                     geo=dict(layers="profile", transform="lowrank", error_feedback=True)),
    "geofp8-auto": Method("geofp8", "ours: layers switched by measured round-trip error, EF",
                          geo=dict(layers="auto", transform="lowrank", error_feedback=True)),
    "geofp8-fresh": Method("geofp8", "ours with this step's factor (all-reduced sketch), "
                           "auto selection, EF",
                           geo=dict(layers="auto", transform="lowrank", factor_source="fresh",
                                    error_feedback=True)),
    "geofp8-local": Method("geofp8", "each rank's own factor, decoded per sender, on every "
                           "layer, EF",
                           geo=dict(layers="all", transform="lowrank", factor_source="local",
                                    error_feedback=True)),
    "kfac": Method("geofp8", "two-sided (K-FAC) geometry on every layer, EF",
                   geo=dict(layers="all", transform="kfac", error_feedback=True)),
}


def make_comm_hook(method: str, model, cfg: TrainConfig):
    """``(state, hook, bytes_per_element)`` to register on DDP for ``method``.

    ``state`` is a :class:`~geofp8.hook.GeoFP8State` (whose ``stats()`` count the bytes)
    or ``None``; ``bytes_per_element`` is the width of a plain all-reduce (FP32: 4,
    bf16: 2) for methods without a state, else ``None``.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from ..hook import FP8State, GeoFP8State, HadamardFP8State, geofp8_hook

    spec = METHODS[method]
    if spec.kind == "allreduce":
        return None, default_hooks.allreduce_hook, 4
    if spec.kind == "bf16":
        return None, default_hooks.bf16_compress_hook, 2
    state_cls = {"fp8": FP8State, "hadamard": HadamardFP8State, "geofp8": GeoFP8State}[spec.kind]
    return state_cls(model, spec.config(cfg)), geofp8_hook, None
