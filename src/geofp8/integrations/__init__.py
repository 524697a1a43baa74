"""GeoFP8 inside training frameworks (``pip install geofp8[integrations]``).

One line per framework, each in its own module so that importing one framework never
imports another:

* PyTorch Lightning: ``Trainer(strategy=GeoFP8DDPStrategy(config=...))``
  (:mod:`geofp8.integrations.lightning`);
* Hugging Face Accelerate: ``state = enable(accelerator, model, config)`` after ``prepare``
  (:mod:`geofp8.integrations.accelerate`);
* the ``transformers`` Trainer: ``enable(trainer, config)`` before ``train()``
  (:mod:`geofp8.integrations.transformers`);
* torchtitan 0.3 (FSDP2): ``--module geofp8.integrations.torchtitan --config llama3_8b``, or
  ``with_geofp8(model_spec, config)`` (:mod:`geofp8.integrations.torchtitan`).

All of them go through :func:`install`, which checks what the framework built and refuses
loudly rather than letting a run silently communicate in FP32. GeoFP8's per-rank state goes
into each framework's checkpoint (:mod:`geofp8.integrations.checkpoint`; through
``torch.distributed.checkpoint``, sharded per rank: :mod:`geofp8.integrations.dcp`).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .. import GeoFP8Config, GeoFP8State, geofp8_hook


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The module under ``torch.compile``'s wrapper(s), or ``model`` itself."""
    while hasattr(model, "_orig_mod"):
        model = model._orig_mod
    return model


def install(model: nn.Module, config: GeoFP8Config | None = None, *,
            process_group: dist.ProcessGroup | None = None, grad_scaler=None,
            wrapped_by: str = "the framework's data-parallel wrapping") -> GeoFP8State:
    """Register :func:`geofp8_hook` on a ``DistributedDataParallel`` model; return its state.

    Args:
        model: the DDP-wrapped model (optionally under ``torch.compile``).
        config: a :class:`GeoFP8Config` (default: ``GeoFP8Config()``), identical on all ranks.
        process_group: the data-parallel group; default: the one DDP reduces over.
        grad_scaler: the ``torch.amp.GradScaler`` of a loss-scaled run, if any.
        wrapped_by: the step that wraps the model, named in the error when it is not wrapped.

    Raises:
        TypeError: ``model`` is not (yet) wrapped in DDP.
        RuntimeError: DDP already has a communication hook (it accepts only one).
        ValueError: the process group's backend is not one GeoFP8 supports.
    """
    ddp = unwrap_compiled(model)
    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(
            f"GeoFP8 installs on a DistributedDataParallel model, got {type(ddp).__name__}: "
            f"call it after {wrapped_by} (a single-process run has no gradient "
            "communication to compress)")
    if ddp._comm_hooks:  # DDP's record of register_comm_hook calls
        hook = ddp._comm_hooks[0][0]
        raise RuntimeError(
            f"this DDP model already has the communication hook "
            f"{getattr(hook, '__qualname__', hook)!r} and DDP accepts only one; remove it "
            "(e.g. the framework's comm_hook option) to use GeoFP8")
    group = process_group if process_group is not None else ddp.process_group
    state = GeoFP8State(ddp.module, config, group, grad_scaler=grad_scaler)
    try:
        ddp.register_comm_hook(state, geofp8_hook)
    except RuntimeError as e:  # e.g. a built-in (C++) hook registered before
        state.remove_hooks()
        raise RuntimeError(f"DDP refused the GeoFP8 hook: {e}") from e
    return state


def metrics(state: GeoFP8State, totals: dict | None = None,
            prefix: str = "geofp8/") -> dict[str, float]:
    """Scalar figures of the last completed step, for a framework's logger.

    ``bytes_per_step``: bytes this rank sent (payloads, scales, factors);
    ``bytes_fp32_equivalent``: a ring FP32 all-reduce of the same gradients;
    ``bytes_per_element``: ``bytes_per_step`` per gradient element (FP32 ring: ``8(N−1)/N``;
    steps that refresh factors carry their traffic too); ``geometry_layers``: how many
    layers took the geometry branch, and from the first step that routed any,
    ``geometry_since_step``; ``step``: GeoFP8's completed steps. With a ``totals``
    dict (kept by the caller, updated in place; call once per step), also
    ``run_bytes_per_element``: all bytes sent so far over all elements communicated.
    """
    s = state.stats()
    out = {f"{prefix}{k}": float(v) for k, v in (
        ("bytes_per_step", s["bytes_sent"]),
        ("bytes_fp32_equivalent", s["bytes_fp32_equivalent"]),
        ("bytes_per_element", s["bytes_per_element"]),
        ("geometry_layers", len(s["geometry_layers"])),
        ("step", s["step"]))}
    if s.get("geometry_since_step") is not None:
        out[f"{prefix}geometry_since_step"] = float(s["geometry_since_step"])
    if totals is not None:
        if s["bytes_per_element"] > 0:
            totals["bytes"] = totals.get("bytes", 0.0) + s["bytes_sent"]
            totals["elements"] = totals.get("elements", 0.0) + (s["bytes_sent"]
                                                                / s["bytes_per_element"])
        if totals.get("elements"):
            out[f"{prefix}run_bytes_per_element"] = totals["bytes"] / totals["elements"]
    return out


__all__ = ["install", "metrics", "unwrap_compiled"]
