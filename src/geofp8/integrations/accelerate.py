"""Hugging Face Accelerate: switch GeoFP8 on for the model ``Accelerator.prepare`` wrapped.

One line, after ``prepare``::

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    state = enable(accelerator, model, GeoFP8Config())

and ``log(accelerator, state, step, totals)`` sends GeoFP8's figures to Accelerate's trackers.
(``DistributedDataParallelKwargs(comm_hook=...)`` accepts only Accelerate's built-in hooks.)
DDP or FSDP2, whichever ``prepare`` built: with ``FullyShardedDataParallelPlugin(fsdp_version=2)``
(``accelerator.is_fsdp2``) GeoFP8's exact FP8 reduce-scatter is installed on every
``fully_shard`` unit (:func:`geofp8.fsdp.enable`). FSDP1 and DeepSpeed are refused.

``accelerator.save_state(dir)`` also writes every rank's GeoFP8 state (``dir/geofp8-rank<r>.pt``)
and ``accelerator.load_state(dir)`` restores it, so a resumed run is bit-identical to one that
never stopped (:mod:`geofp8.integrations.checkpoint`; a checkpoint without it resumes with a
warning, one from another number of ranks is refused). Accelerate's
``register_for_checkpointing`` is not used: it saves the main process's state only and loads
with ``weights_only=False``; ``enable`` registers save/load pre-hooks instead.
"""

from __future__ import annotations

from torch import nn

from .. import GeoFP8Config, GeoFP8State, fsdp
from . import install, metrics, unwrap_compiled
from .checkpoint import load_files, save_files


def enable(accelerator, model: nn.Module, config: GeoFP8Config | None = None,
           **fsdp_kwargs) -> GeoFP8State | fsdp.GeoFP8FSDP:
    """Register GeoFP8 on ``model`` (as returned by ``accelerator.prepare``); return its state.

    DDP: :func:`geofp8.integrations.install`. FSDP2: :func:`geofp8.fsdp.enable` on the
    prepared model, with ``fsdp_kwargs`` (``residual=``, ``mesh=`` for HSDP). Registers the
    ``save_state`` / ``load_state`` pre-hooks that keep GeoFP8's state in the checkpoint.

    Raises ``RuntimeError`` for a single-process, FSDP1 or DeepSpeed accelerator, and what
    :func:`geofp8.integrations.install` or :func:`geofp8.fsdp.enable` raise (model not
    prepared, a comm hook already registered, an unsupported backend).
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
        if not accelerator.is_fsdp2:
            raise RuntimeError("GeoFP8: Accelerate built an FSDP1 model; GeoFP8 supports FSDP2 "
                               "(FullyShardedDataParallelPlugin(fsdp_version=2)) and DDP")
        state = fsdp.enable(unwrap_compiled(model), config, **fsdp_kwargs)
    elif fsdp_kwargs:
        raise TypeError(f"{sorted(fsdp_kwargs)} apply to FSDP2 only; Accelerate built {kind}")
    elif kind not in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
        raise RuntimeError(f"GeoFP8 supports Accelerate's DDP (MULTI_CPU, MULTI_GPU), "
                           f"not {kind}")
    else:
        state = install(model, config, grad_scaler=accelerator.scaler,
                        wrapped_by="accelerator.prepare(model) (pass the model it returns)")
    accelerator.register_save_state_pre_hook(
        lambda models, weights, output_dir: save_files(state, output_dir))
    accelerator.register_load_state_pre_hook(lambda models, input_dir: load_files(state, input_dir))
    return state


def log(accelerator, state: GeoFP8State | fsdp.GeoFP8FSDP, step: int | None = None,
        totals: dict | None = None) -> dict[str, float]:
    """Send :func:`geofp8.integrations.metrics` to the accelerator's trackers; return them.
    Call once per step; pass the same ``totals`` dict every time for the run's figures."""
    values = metrics(state, totals)
    accelerator.log(values, step=step)
    return values


__all__ = ["enable", "log"]
