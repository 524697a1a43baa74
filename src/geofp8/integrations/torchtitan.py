"""torchtitan 0.3.x: GeoFP8's exact FP8 reduce-scatter on the FSDP2 model torchtitan builds.

One line, on the command line (this module is a torchtitan ``--module``: its config
functions are torchtitan's own with GeoFP8 switched on)::

    torchrun --nproc_per_node 8 -m torchtitan.train \\
        --module geofp8.integrations.torchtitan --config llama3_8b

(with torch 2.13, add ``--parallelism.spmd_backend partial_dtensor``: torchtitan's default
``spmd_types`` backend fails in that torch's ``fully_shard``), or in Python, on any model spec::

    config.model_spec = with_geofp8(config.model_spec, GeoFP8Config())

torchtitan applies ``fully_shard`` in the model's ``parallelize_fn`` and then, in
``Trainer.__init__``, builds the optimizers and calls the spec's ``post_optimizer_build_fn``
before the first step. :func:`post_optimizer_build_fn` calls :func:`geofp8.fsdp.enable` on
every model part there, then the spec's own function (MoE load balancing, ...). Supported:
FSDP (``parallelism.data_parallel_shard_degree`` > 1) with no replicate, tensor, pipeline,
context or expert parallelism, SPMD backend ``partial_dtensor`` (tested) or ``spmd_types``
(not ``full_dtensor``); anything else is refused with a ``RuntimeError``. The states
are ``part.geofp8`` on every model part; :func:`log` sends their figures to torchtitan's
logger (``log_every=`` does it from an optimizer step hook).

Checkpoints: :func:`wrap_config` (the ``--module`` path) also switches torchtitan's
``CheckpointManager`` to :class:`CheckpointManager`, which keeps every rank's GeoFP8 state in
torchtitan's DCP checkpoint as one more state (key ``"geofp8"``, sharded per rank:
:mod:`geofp8.integrations.dcp`), so ``--checkpoint.enable`` resumes bit-identically. In
Python: ``config.checkpoint = checkpoint_config(config.checkpoint)``.

Installing: torchtitan 0.3.0's pins would downgrade ``datasets`` and ``huggingface_hub``;
``pip install --no-deps torchtitan==0.3.0`` plus the modules it imports (the Makefile's
``TORCHTITAN_PACKAGES``; ``triton`` included: torchtitan's model package imports it even on CPU).
torchtitan's ``Trainer`` needs CUDA (it calls ``torch.cuda.set_device``); on CPU the model
path (``parallelize_fn`` + ``post_optimizer_build_fn``) runs, see tests/test_torchtitan.py.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

import torchtitan
from torch import nn
from torch.distributed.fsdp import FSDPModule

from .. import FP8Config, GeoFP8Config, fsdp
from . import metrics, unwrap_compiled
from .dcp import KEY, DCPState

SUPPORTED = "0.3."
CONFIG = GeoFP8Config()  # what the config functions below switch on


def _check_version(version: str) -> None:
    if not str(version).startswith(SUPPORTED):
        raise ImportError(
            f"geofp8.integrations.torchtitan targets torchtitan {SUPPORTED}x, found "
            f"{version}: install torchtitan==0.3.0 (e.g. `make install`), or use "
            "geofp8.fsdp.enable(model, config) directly after fully_shard")


_check_version(torchtitan.__version__)

from torchtitan.components.checkpointer import dcp as titan_dcp  # noqa: E402 (after the check)


def _check_parallelism(parallel_dims) -> None:
    others = {name: getattr(parallel_dims, name) for name in ("dp_replicate", "tp", "pp", "cp",
                                                                "ep")}
    on = {k: v for k, v in others.items() if v > 1}
    if on:
        raise RuntimeError(
            "GeoFP8 on torchtitan supports FSDP (data_parallel_shard_degree > 1) only; this job "
            f"also has {', '.join(f'{k}={v}' for k, v in on.items())}: torchtitan shards HSDP "
            "natively on a 2-D mesh (GeoFP8's HSDP needs the 1-D shard mesh), and TP/PP/CP/EP "
            "are not supported")
    if getattr(parallel_dims, "spmd_backend", None) == "full_dtensor":
        raise RuntimeError(
            "GeoFP8 on torchtitan: the full_dtensor SPMD backend makes activations DTensors, "
            "which GeoFP8's input statistics do not take; use --parallelism.spmd_backend "
            "partial_dtensor (tested) or spmd_types")
    if parallel_dims.dp_shard <= 1:
        raise RuntimeError(
            f"GeoFP8: this torchtitan job does not shard over data-parallel ranks (dp_shard="
            f"{parallel_dims.dp_shard}, world size {parallel_dims.world_size}): there is no "
            "gradient reduce-scatter to compress; launch ≥ 2 ranks with "
            "data_parallel_shard_degree -1 or > 1")


def post_optimizer_build_fn(config: GeoFP8Config | FP8Config | None = None,
                            then: Callable | None = None, *, residual: str | None = None,
                            log_every: int = 0) -> Callable:
    """A ``ModelSpec.post_optimizer_build_fn`` that switches GeoFP8 on.

    The returned ``fn(optimizers, model_parts, parallel_dims)`` checks the parallelism
    (FSDP only, see the module doc), calls :func:`geofp8.fsdp.enable(part, config,
    residual=residual) <geofp8.fsdp.enable>` on every model part, keeps each state as
    ``part.geofp8`` and returns the list of states, after calling ``then`` (the spec's own
    function) with the same arguments. ``log_every`` > 0: :func:`log` every that many
    optimizer steps (a step post-hook on ``optimizers``).

    Raises ``RuntimeError`` for an unsupported parallelism, or a model part with no
    ``fully_shard``-ed module.
    """

    def fn(optimizers, model_parts: list[nn.Module], parallel_dims):
        _check_parallelism(parallel_dims)
        states = []
        for i, part in enumerate(model_parts):
            module = unwrap_compiled(part)
            if not any(isinstance(m, FSDPModule) for m in module.modules()):
                raise RuntimeError(
                    f"GeoFP8: torchtitan model part {i} ({type(module).__name__}) has no "
                    "fully_shard-ed module: GeoFP8 installs on FSDP2; call this after the "
                    "spec's parallelize_fn (torchtitan's Trainer does)")
            state = fsdp.enable(module, config, residual=residual)
            part.geofp8 = state
            states.append(state)
        if log_every > 0:
            totals: dict = {}

            def hook(opt, args, kwargs) -> None:
                step = states[0].ledger.step + 1
                if step % log_every == 0:
                    log(model_parts, step, totals)

            optimizers.register_step_post_hook(hook)
        if then is not None:
            then(optimizers, model_parts, parallel_dims)
        return states

    fn.geofp8_config = config
    return fn


def with_geofp8(model_spec, config: GeoFP8Config | FP8Config | None = None, **kwargs):
    """``model_spec`` with GeoFP8 switched on (``dataclasses.replace``); its own
    ``post_optimizer_build_fn`` still runs, after GeoFP8's. ``kwargs``: see
    :func:`post_optimizer_build_fn`."""
    if hasattr(model_spec.post_optimizer_build_fn, "geofp8_config"):
        raise ValueError(f"GeoFP8 is already on for the model spec {model_spec.name!r}")
    return dataclasses.replace(
        model_spec, post_optimizer_build_fn=post_optimizer_build_fn(
            config, model_spec.post_optimizer_build_fn, **kwargs))


def states(model_parts: list[nn.Module]) -> list[fsdp.GeoFP8FSDP]:
    """The GeoFP8 states installed on ``model_parts`` (``[]`` when none)."""
    return [p.geofp8 for p in model_parts if isinstance(getattr(p, "geofp8", None),
                                                         fsdp.GeoFP8FSDP)]


def log(model_parts: list[nn.Module], step: int | None = None,
        totals: dict | None = None) -> dict[str, float]:
    """:func:`geofp8.integrations.metrics` of the (first) model part's state, logged with
    torchtitan's logger; returns them. Pass the same ``totals`` dict every step for the
    run's bytes per element."""
    from torchtitan.tools.logging import logger

    found = states(model_parts)
    if not found:
        raise RuntimeError("GeoFP8 is not installed on these model parts")
    values = metrics(found[0], totals)
    logger.info("GeoFP8 step %s: %s", step if step is not None else "-",
                ", ".join(f"{k.removeprefix('geofp8/')} {v:.4g}" for k, v in values.items()))
    return values


class CheckpointManager(titan_dcp.CheckpointManager):
    """torchtitan's DCP ``CheckpointManager`` with the model parts' GeoFP8 states as one more
    state, ``"geofp8"`` (:class:`~geofp8.integrations.dcp.DCPState`: every rank's under its
    own keys, tensors only). Loading first allocates this rank's entries from the checkpoint's
    metadata; a checkpoint without them resumes with a warning, one written on another number
    of ranks is refused (``ValueError``). Model-only loads and saves (the initial load, the
    last step's export) carry no GeoFP8 state, as torchtitan intends."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(titan_dcp.CheckpointManager.Config):
        pass

    def __init__(self, config: Config, *, model_parts: list[nn.Module], **kwargs) -> None:
        super().__init__(config, model_parts=model_parts, **kwargs)
        found = states(model_parts)
        if self.enable and found:
            self.states[KEY] = DCPState(found)

    def dcp_load(self, state_dict, checkpoint_id: str, from_hf: bool,
                 from_quantized: bool) -> None:
        if isinstance(state_dict.get(KEY), DCPState):
            state_dict[KEY].expect(checkpoint_id)
        super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)


def checkpoint_config(config):
    """torchtitan's ``CheckpointManager.Config`` ``config`` as :class:`CheckpointManager`'s
    (the same fields); any other checkpointer's config is returned unchanged (GeoFP8's state
    is then not in its checkpoints)."""
    if type(config) is not titan_dcp.CheckpointManager.Config:
        return config
    return CheckpointManager.Config(**{f.name: getattr(config, f.name)
                                       for f in dataclasses.fields(config)})


def wrap_config(config_fn: Callable, config: GeoFP8Config | FP8Config | None = None,
                **kwargs) -> Callable:
    """A torchtitan config function (returning a ``Trainer.Config``) with GeoFP8 on, its
    checkpoints included (:func:`checkpoint_config`)."""

    def wrapped():
        trainer_config = config_fn()
        trainer_config.model_spec = with_geofp8(trainer_config.model_spec,
                                                config if config is not None else CONFIG,
                                                **kwargs)
        trainer_config.checkpoint = checkpoint_config(trainer_config.checkpoint)
        return trainer_config

    wrapped.__name__ = wrapped.__qualname__ = getattr(config_fn, "__name__", "config")
    wrapped.__doc__ = f"torchtitan's ``{wrapped.__name__}`` with GeoFP8 switched on."
    return wrapped


def _registry_function(name: str) -> Callable | None:
    """torchtitan's config function ``name`` (e.g. ``llama3_8b``, ``deepseek_v3_16b``) from
    ``torchtitan.models.<model>.config_registry``, or ``None``."""
    parts = name.split("_")
    for i in range(1, len(parts)):
        try:
            registry = importlib.import_module(
                f"torchtitan.models.{'_'.join(parts[:i])}.config_registry")
        except ImportError:
            continue
        fn = getattr(registry, name, None)
        if callable(fn):
            return fn
    return None


def llama3_debugmodel():
    """torchtitan's ``llama3_debugmodel`` with GeoFP8 (:data:`CONFIG`) switched on."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel as base

    return wrap_config(base)()


def __getattr__(name: str):
    # torchtitan's ConfigManager looks the --config function up with getattr: every config
    # function of torchtitan's model registries is available here with GeoFP8 on
    if name.startswith("_") or "_" not in name:
        raise AttributeError(name)
    fn = _registry_function(name)
    if fn is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r} (and torchtitan "
                             "has no config function of that name)")
    return wrap_config(fn)


__all__ = ["CONFIG", "CheckpointManager", "checkpoint_config", "llama3_debugmodel", "log",
           "post_optimizer_build_fn", "states", "with_geofp8", "wrap_config"]
