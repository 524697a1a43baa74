"""Hugging Face Accelerate: switch GeoFP8 on for the model ``Accelerator.prepare`` wrapped.

One line, after ``prepare``::

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    state = enable(accelerator, model, GeoFP8Config())

and ``log(accelerator, state, step, totals)`` sends GeoFP8's figures to Accelerate's trackers.
(``DistributedDataParallelKwargs(comm_hook=...)`` accepts only Accelerate's built-in hooks.)
DDP only for now: an FSDP2 model (``fully_shard``) needs GeoFP8's FSDP2 reduce-scatter,
which is not in this version and is refused with an error.
"""

from __future__ import annotations

from torch import nn

from .. import GeoFP8Config, GeoFP8State
from . import install, metrics


def enable(accelerator, model: nn.Module, config: GeoFP8Config | None = None) -> GeoFP8State:
    """Register GeoFP8 on ``model`` (as returned by ``accelerator.prepare``); return its state.

    Raises ``RuntimeError`` for a single-process, FSDP or DeepSpeed accelerator, and what
    :func:`geofp8.integrations.install` raises (model not prepared, a comm hook already
    registered, an unsupported backend).
    """
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind == DistributedType.NO or accelerator.num_processes == 1:
        raise RuntimeError(
            f"GeoFP8: this Accelerator does no data-parallel training (distributed_type "
            f"{kind}, {accelerator.num_processes} process): launch ≥ 2 processes (`accelerate "
            "launch`, `torchrun`); without a GPU, Accelerate needs `Accelerator(cpu=True)` "
            "(or `accelerate launch --cpu`) to train on several CPU processes")
    if kind == DistributedType.FSDP:
        raise RuntimeError("GeoFP8: Accelerate built an FSDP model; GeoFP8's FSDP2 "
                           "reduce-scatter is not available in this version (DDP only)")
    if kind not in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
        raise RuntimeError(f"GeoFP8 supports Accelerate's DDP (MULTI_CPU, MULTI_GPU), "
                           f"not {kind}")
    return install(model, config, grad_scaler=accelerator.scaler,
                   wrapped_by="accelerator.prepare(model) (pass the model it returns)")


def log(accelerator, state: GeoFP8State, step: int | None = None,
        totals: dict | None = None) -> dict[str, float]:
    """Send :func:`geofp8.integrations.metrics` to the accelerator's trackers; return them.
    Call once per step; pass the same ``totals`` dict every time for the run's figures."""
    values = metrics(state, totals)
    accelerator.log(values, step=step)
    return values


__all__ = ["enable", "log"]
