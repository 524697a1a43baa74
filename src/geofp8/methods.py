"""The one table of gradient-communication methods, by name.

The trainer, the benchmarks, the demo and the tests all read :data:`METHODS`; nothing else
decides what a method name communicates. A :class:`Method` builds the DDP comm hook::

    >>> state, hook, width = METHODS["geofp8-auto"].build(model, format="e4m3")
    >>> ddp_model.register_comm_hook(state, hook)

``kind``: ``"allreduce"`` (DDP's own FP32 all-reduce), ``"bf16"`` (PyTorch's bf16 compress
hook), ``"powersgd"`` (PyTorch's PowerSGD hook, the low-rank peer) or ``"geofp8"`` (this
library, with the :class:`~geofp8.config.GeoFP8Config` that :meth:`Method.config` builds).
PyTorch's int8 ``quantization_pertensor_hook`` is not offered: on gloo in torch 2.13 its
callback fails (``IndexError: invalid index of a 0-dim tensor``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .config import GeoFP8Config

__all__ = ["METHODS", "Method"]

# Settings a caller may override on the geometry methods (the low-rank k, K, profile window,
# and the seed of the sketches). The Euclidean and Hadamard controls take only ``format``.
# Every GeoFP8 method also takes the node layout of DDP's collective (geofp8.hierarchy),
# the kernels its stages run (geofp8.comm.layout: the same bits either way) and the storage
# of its error-feedback residuals (geofp8.feedback).
LAYOUT_OVERRIDES = ("hierarchy", "node_size", "kernels", "residual")
GEOMETRY_OVERRIDES = ("format", "k", "refresh_every", "profile_steps", "seed",
                      *LAYOUT_OVERRIDES)
CONTROL_OVERRIDES = ("format", *LAYOUT_OVERRIDES)
# The block-format methods name their format: a caller's ``format`` does not replace it.
BLOCK_OVERRIDES = tuple(k for k in GEOMETRY_OVERRIDES if k != "format")
# The byte budget chooses formats itself; its budget has no default (the caller's to state).
BUDGET_OVERRIDES = ("budget", "k", "refresh_every", "seed", *LAYOUT_OVERRIDES)


@dataclass(frozen=True)
class Method:
    """What one method name sends: ``kind`` and the fixed settings of its config."""

    kind: str
    description: str
    settings: dict[str, Any] = field(default_factory=dict)  # GeoFP8Config fields / PowerSGD rank
    overrides: tuple[str, ...] = GEOMETRY_OVERRIDES  # caller settings it takes (see config)
    # PyTorch's PowerSGD hook issues collectives from completion callbacks; with
    # several buckets in flight those reach the ranks in different orders (gloo, 4 ranks:
    # "collective mismatch"). Register them on a DDP with one bucket.
    one_bucket: bool = False
    required: tuple[str, ...] = ()  # overrides the caller must give (no default)

    def config(self, **overrides) -> GeoFP8Config | None:
        """The :class:`GeoFP8Config` of a ``geofp8`` method (``None`` for PyTorch's hooks),
        with the caller's ``overrides`` (a ``None`` value keeps the method's own). An
        override the method does not take raises: ``format`` for ``nvfp4-ef``, which names
        its format, or ``k`` for ``fp8-ef``, which has no factor."""
        chosen = {k: v for k, v in overrides.items() if v is not None}
        refused = sorted(set(chosen) - set(self.overrides))
        if refused:
            raise ValueError(f"method {self.description!r} does not take {refused}; it takes "
                             f"{list(self.overrides)}")
        missing = [k for k in self.required if k not in chosen]
        if missing:
            raise ValueError(f"method {self.description!r} needs {missing}")
        if self.kind != "geofp8":
            return None
        return GeoFP8Config(**{**chosen, **self.settings})

    def takes(self, **settings) -> dict:
        """The part of run-wide ``settings`` (one sweep over many methods) this method
        takes; pass the result to :meth:`build` or :meth:`config`."""
        return {k: v for k, v in settings.items() if k in self.overrides}

    def build(self, model, process_group=None, **overrides):
        """``(state, hook, bytes_per_element)`` to register on DDP.

        ``state`` is a :class:`~geofp8.ddp.GeoFP8State` (its ``stats()`` count the bytes), a
        PowerSGD state, or ``None``; ``bytes_per_element`` is the width of a plain all-reduce
        (FP32: 4, bf16: 2) for the PyTorch hooks whose bytes nothing counts, else ``None``.
        """
        from torch.distributed.algorithms.ddp_comm_hooks import (
            default_hooks,
            powerSGD_hook,
        )

        from .ddp import GeoFP8State, geofp8_hook

        config = self.config(**overrides)  # raises on an override the method does not take
        if self.kind == "allreduce":
            return None, default_hooks.allreduce_hook, 4
        if self.kind == "bf16":
            return None, default_hooks.bf16_compress_hook, 2
        if self.kind == "powersgd":
            state = powerSGD_hook.PowerSGDState(
                process_group, matrix_approximation_rank=self.settings["rank"],
                start_powerSGD_iter=2, use_error_feedback=True)
            return state, powerSGD_hook.powerSGD_hook, None
        return GeoFP8State(model, config, process_group), geofp8_hook, None


def _control(description: str, **settings) -> Method:
    return Method("geofp8", description, {"transform": "euclidean", "layers": "none",
                                          "candidates": "linear", **settings}, CONTROL_OVERRIDES)


def _block(fmt: str, description: str, transform: str = "euclidean", **settings) -> Method:
    """A method of a block format (NVFP4 / MXFP4 / MXFP8) with error feedback unless told."""
    layers = "none" if transform == "euclidean" else "all"
    chosen = {"format": fmt, "transform": transform, "layers": layers, "error_feedback": True,
              **settings}
    return Method("geofp8", description, chosen,
                  LAYOUT_OVERRIDES if transform in ("euclidean", "rht") else BLOCK_OVERRIDES)


METHODS: dict[str, Method] = {
    "fp32": Method("allreduce", "FP32 ring all-reduce (DDP default)", overrides=()),
    "bf16": Method("bf16", "PyTorch bf16_compress_hook", overrides=()),
    "powersgd": Method("powersgd", "PyTorch PowerSGD, rank 4, error feedback", {"rank": 4},
                       (), one_bucket=True),
    "powersgd8": Method("powersgd", "PyTorch PowerSGD, rank 8, error feedback", {"rank": 8},
                        (), one_bucket=True),
    "fp8": _control("FP8, per-tensor scales", error_feedback=False),
    "fp8-ef": _control("FP8 + error feedback", error_feedback=True),
    "fp8-block": _control("FP8, a scale per 128 elements", scaling="block", block_size=128,
                          error_feedback=False),
    "hadamard": Method("geofp8", "FP8 + EF after a fixed block Hadamard rotation",
                       {"transform": "hadamard", "layers": "all", "candidates": "linear",
                        "error_feedback": True},
                       CONTROL_OVERRIDES),
    "geofp8": Method("geofp8", "the paper: profile-selected layers, low-rank k, EF",
                     {"layers": "profile", "transform": "lowrank", "error_feedback": True}),
    "geofp8-auto": Method("geofp8", "ours: layers switched by measured round-trip error, EF",
                          {"layers": "auto", "transform": "lowrank", "error_feedback": True}),
    "geofp8-all": Method("geofp8", "the paper's refreshed factor on every layer, EF",
                         {"layers": "all", "transform": "lowrank", "error_feedback": True}),
    "geofp8-fresh": Method("geofp8", "ours with this step's factor (all-reduced sketch), "
                           "auto selection, EF",
                           {"layers": "auto", "transform": "lowrank", "factor_source": "fresh",
                            "error_feedback": True}),
    "geofp8-fresh-all": Method("geofp8", "this step's factor on every layer, EF",
                               {"layers": "all", "transform": "lowrank",
                                "factor_source": "fresh", "error_feedback": True}),
    "geofp8-local": Method("geofp8", "each rank's own factor, decoded per sender, on every "
                           "layer, EF",
                           {"layers": "all", "transform": "lowrank", "factor_source": "local",
                            "error_feedback": True}),
    "kfac": Method("geofp8", "two-sided (K-FAC) geometry on every layer, EF",
                   {"layers": "all", "transform": "kfac", "error_feedback": True}),
    "mxfp8-ef": _block("mxfp8", "MXFP8 (E4M3, an E8M0 scale per 32) + EF"),
    "nvfp4": _block("nvfp4", "NVFP4 (E2M1, E4M3 scale per 16, FP32 per tensor chunk)",
                    error_feedback=False),
    "nvfp4-ef": _block("nvfp4", "NVFP4 + EF"),
    "nvfp4-ef2": _block("nvfp4", "NVFP4 + EF on both roundings (each sender's and each "
                        "reduced shard's owner's)", owner_feedback=True),
    "nvfp4-sr-ef": _block("nvfp4", "NVFP4 + EF, stochastic rounding (seeded per step, "
                          "bucket and sender)", rounding="stochastic"),
    "nvfp4-rht-ef": _block("nvfp4", "NVFP4 + EF after a random Hadamard over each 16-block",
                           "rht"),
    "nvfp4-geo-ef": _block("nvfp4", "NVFP4 + EF, the refreshed low-rank factor on every layer",
                           "lowrank"),
    "nvfp4-fresh-ef": _block("nvfp4", "NVFP4 + EF, this step's factor on every layer",
                             "lowrank", factor_source="fresh"),
    "nvfp4-fresh8-ef": _block("nvfp4", "NVFP4 + EF, this step's factor on every layer, its "
                              "sketch sent in E4M3", "lowrank", factor_source="fresh",
                              sketch_format="e4m3"),
    "nvfp4-fresh4-ef": _block("nvfp4", "NVFP4 + EF, this step's factor on every layer, its "
                              "sketch sent in NVFP4", "lowrank", factor_source="fresh",
                              sketch_format="nvfp4"),
    "nvfp4-auto-ef": _block("nvfp4", "NVFP4 + EF, layers switched by measured round-trip "
                            "error (refreshed factor)", "lowrank", layers="auto"),
    "budget": Method("geofp8", "NVFP4, NVFP4 + refreshed low-rank factor or E4M3 per tensor, "
                     "chosen at the first step and each refresh by measured error within a "
                     "byte budget, EF",
                     {"format": "nvfp4", "transform": "lowrank", "layers": "auto",
                      "error_feedback": True}, BUDGET_OVERRIDES, required=("budget",)),
    "budget-ef2": Method("geofp8", "budget + EF on both roundings (each reduced shard's "
                         "owner's too, for tensors sent without a map; handed over to the "
                         "send when a tensor takes the factor)",
                         {"format": "nvfp4", "transform": "lowrank", "layers": "auto",
                          "error_feedback": True, "owner_feedback": True}, BUDGET_OVERRIDES,
                         required=("budget",)),
    "mxfp4-ef": _block("mxfp4", "MXFP4 (E2M1, an E8M0 scale per 32) + EF"),
    "mxfp4-rht-ef": _block("mxfp4", "MXFP4 + EF after a random Hadamard over each 32-block",
                           "rht"),
    "mxfp4-geo-ef": _block("mxfp4", "MXFP4 + EF, the refreshed low-rank factor on every layer",
                           "lowrank"),
}
