"""Settings of ``geofp8 train``; ``--method`` names a row of :data:`geofp8.methods.METHODS`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ...comm import KERNELS
from ...feedback import STORAGES
from ...methods import METHODS
from ..errors import UsageError


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
    k: int = 32  # GeoFP8 low-rank factor k
    budget: float | None = None  # method budget: bytes per element per round trip
    parallel: str = "ddp"
    shard_size: int = 0  # hsdp: ranks per shard group (0: half the ranks)
    residual: str | None = None  # error-feedback storage (None: GeoFP8Config's default)
    hierarchy: str = "auto"  # ddp: auto | flat | node (FP32 inside a node, FP8 between)
    node_size: int = 0  # ranks per node (0: torchrun's LOCAL_WORLD_SIZE)
    kernels: str = "auto"  # auto | batched | chunked (the stages' kernels; same bits)
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
            (self.method not in METHODS or self.format == "e4m3"
             or "format" in METHODS[self.method].takes(format=self.format),
             f"--format {self.format}: method {self.method!r} fixes its own format"),
            (self.method not in METHODS or "budget" not in METHODS[self.method].required
             or self.budget is not None,
             f"--method {self.method} needs --budget B (bytes per element per round trip)"),
            (self.optimizer in ("muon", "adamw"), "optimizer must be 'muon' or 'adamw'"),
            (self.parallel in ("ddp", "fsdp", "hsdp"), "parallel must be ddp, fsdp or hsdp"),
            (self.residual is None or self.residual in STORAGES,
             f"residual must be one of {STORAGES}"),
            (self.hierarchy in ("auto", "flat", "node"), "hierarchy must be auto, flat or node"),
            (self.node_size >= 0, "node_size must be >= 0"),
            (self.kernels in KERNELS, f"kernels must be one of {KERNELS}"),
            (self.parallel == "ddp" or self.optimizer == "adamw",
             "--parallel fsdp/hsdp needs --optimizer adamw (Muon needs whole matrices)"),
            (self.parallel == "ddp" or self.method not in METHODS
             or METHODS[self.method].kind in ("allreduce", "geofp8"),
             f"--parallel {self.parallel} runs the fp32 and GeoFP8 methods, not "
             f"{self.method!r} (a DDP comm hook)"),
            (self.parallel == "ddp" or self.method not in METHODS
             or "budget" not in METHODS[self.method].overrides,
             f"--method {self.method} chooses formats per layer within a byte budget, which "
             f"is DDP-only for now: use --parallel ddp, or one format (e.g. --method nvfp4-ef)"),
            (self.steps >= 1 and self.seq_len >= 1 and self.batch_size >= 1,
             "steps, seq_len and batch_size must be >= 1"),
            (self.warmup >= 0, "warmup must be >= 0"),
            (0 < self.lr_min <= self.lr, "need 0 < lr_min <= lr"),
            (self.eval_every >= 0 and self.shadow_every >= 0 and self.checkpoint_every >= 0,
             "eval/shadow/checkpoint intervals must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise UsageError(f"TrainConfig: {message}")
        try:  # the method's own settings (k, refresh period, budget ...), before any rank
            self.method_config()
        except ValueError as e:
            raise UsageError(f"--method {self.method}: {e}") from None

    def method_config(self):
        """The :class:`~geofp8.config.GeoFP8Config` of ``--method`` with this run's settings
        (``None`` for PyTorch's own hooks)."""
        spec = METHODS[self.method]
        return spec.config(**spec.takes(**self.method_settings()))

    def geometry_start(self) -> tuple[int | None, str]:
        """The first step at which ``--method`` can send a layer through a geometry map
        (``None``: it never does) and why then. :meth:`geofp8.GeoFP8State.stats` tells the
        step it did (``geometry_since_step``); an ``auto`` or budget method may start later,
        or never, when geometry measures no better than plain coordinates."""
        c = self.method_config()
        if c is None or c.transform == "euclidean" or (c.layers == "none" and c.budget is None):
            return None, "it sends every gradient in plain coordinates"
        if c.transform in ("hadamard", "rht"):
            return c.warmup_steps, "a fixed rotation, on from the first step"
        if c.factor_source == "refresh":
            ready, why = c.refresh_every, (f"the first factor comes from the first refresh, "
                                           f"after --refresh-every {c.refresh_every} steps")
        else:
            ready, why = 0, "this step's factor, built during the backward"
        if c.budget is not None or c.layers == "auto":
            return max(ready + 1, c.warmup_steps), (
                f"{why}; the paths' errors are measured on that step and a layer switches to "
                "geometry on the next one, only where geometry measured better")
        if c.layers == "profile":
            fixed = c.warmup_steps + c.profile_steps
            return max(ready, fixed), (f"{why}; the profile fixes the layers after "
                                       f"--profile-steps {c.profile_steps}")
        return max(ready, c.warmup_steps), why

    def method_settings(self) -> dict[str, Any]:
        """The run-wide settings a method may take (:meth:`geofp8.methods.Method.takes`)."""
        return dict(format=self.format, k=self.k, budget=self.budget,
                    refresh_every=self.refresh_every, profile_steps=self.profile_steps,
                    seed=self.seed, hierarchy=self.hierarchy, node_size=self.node_size or None,
                    kernels=self.kernels, residual=self.residual)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def make_comm_hook(method: str, model, cfg: TrainConfig):
    """``(state, hook, bytes_per_element)`` of ``method`` with this run's settings
    (see :meth:`geofp8.methods.Method.build`)."""
    spec = METHODS[method]
    return spec.build(model, **spec.takes(**cfg.method_settings()))
