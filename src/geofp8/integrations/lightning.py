"""PyTorch Lightning: a DDP strategy that communicates gradients with GeoFP8.

One line::

    trainer = L.Trainer(strategy=GeoFP8DDPStrategy(config=GeoFP8Config()), devices=2)

or, after importing this module, ``strategy="geofp8_ddp"`` (default config).

Lightning's own ``DDPStrategy(ddp_comm_hook=...)`` registers a hook only when the device is
CUDA; on any other device it trains with FP32 all-reduce without a word. This strategy
registers GeoFP8 on every device (CPU/gloo included) and fails loudly when it cannot. Each
optimizer step logs :func:`geofp8.integrations.metrics` (``geofp8/bytes_per_element``, ...)
through ``LightningModule.log``, so every Lightning logger receives them; the live state is
``strategy.geofp8_state``. Lightning's checkpoints (``ModelCheckpoint``,
``trainer.save_checkpoint``) carry every rank's GeoFP8 state under the key ``"geofp8"``, and
``trainer.fit(..., ckpt_path=...)`` restores it: the resumed run is bit-identical to one that
never stopped (:mod:`geofp8.integrations.checkpoint`; a checkpoint without it resumes with a
warning, one from another number of ranks is refused).

FSDP2 (``ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)``): one call at
the end of ``configure_model``, after the ``fully_shard`` calls::

    def configure_model(self):
        for block in self.model.model.layers:
            fully_shard(block, mesh=self.device_mesh["data_parallel"])
        fully_shard(self.model, mesh=self.device_mesh["data_parallel"])
        enable_fsdp(self, GeoFP8Config())

It installs GeoFP8's exact FP8 reduce-scatter (:func:`geofp8.fsdp.enable`) and, unless
``log_stats=False``, logs :func:`geofp8.integrations.metrics` after every training batch.
Its checkpoints (sharded or not) carry every rank's GeoFP8 state under ``"geofp8"`` too (the
module's ``on_save_checkpoint`` gathers it; rank 0 writes it with the checkpoint's metadata),
and a ``fit(ckpt_path=...)`` restores it (``on_load_checkpoint``).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

from .. import FP8Config, GeoFP8Config, GeoFP8State
from . import install, metrics
from .checkpoint import gather, restore

STRATEGY_NAME = "geofp8_ddp"
CHECKPOINT_KEY = "geofp8"  # every rank's state, in Lightning's checkpoint dict


class GeoFP8DDPStrategy(DDPStrategy):
    """``DDPStrategy`` with :func:`geofp8_hook` registered on the wrapped model.

    Args:
        config: the :class:`GeoFP8Config` (default ``GeoFP8Config()``).
        log_stats: log GeoFP8's figures after every optimizer step (rank 0's go to loggers).
        **kwargs: everything ``DDPStrategy`` takes, except its comm-hook arguments.
    """

    strategy_name = STRATEGY_NAME

    def __init__(self, config: GeoFP8Config | None = None, *, log_stats: bool = True,
                 **kwargs: Any) -> None:
        taken = sorted({"ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper"} & set(kwargs))
        if taken:
            raise TypeError(f"GeoFP8DDPStrategy registers GeoFP8's own comm hook; DDP accepts "
                            f"only one, so {taken} cannot be given")
        super().__init__(**kwargs)
        self.geofp8_config = config if config is not None else GeoFP8Config()
        self.log_stats = log_stats
        self.geofp8_state: GeoFP8State | None = None
        self._totals: dict = {}
        self._resume: tuple[str, dict | None] | None = None  # (checkpoint path, its state)

    def configure_ddp(self) -> None:
        # The parent wraps the model and registers no hook (none was given); GeoFP8 is
        # registered here, on any device type. A 16-bit CUDA run's GradScaler is handed over.
        super().configure_ddp()
        scaler = getattr(self.precision_plugin, "scaler", None)
        if self.geofp8_state is not None:
            self.geofp8_state.remove_hooks()
        self._totals = {}
        self.geofp8_state = install(self.model, self.geofp8_config, grad_scaler=scaler,
                                    wrapped_by="DDPStrategy.configure_ddp")
        if self._resume is not None:
            (path, saved), self._resume = self._resume, None
            restore(self.geofp8_state, saved, path)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options=None) -> None:
        # called on every rank; rank 0 writes, with every rank's GeoFP8 state gathered to it
        if self.geofp8_state is not None:
            saved = gather(self.geofp8_state)
            if saved is not None:
                checkpoint = {**checkpoint, CHECKPOINT_KEY: saved}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        # before setup (DDP restores the modules first): kept until configure_ddp installs GeoFP8
        loaded = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._resume = (str(checkpoint_path), loaded.get(CHECKPOINT_KEY))
        return loaded

    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.log_stats and self.geofp8_state is not None:
            figures = metrics(self.geofp8_state, self._totals)
            self.lightning_module.log_dict(figures, on_step=True, on_epoch=False, batch_size=1)
        return output

    def teardown(self) -> None:
        if self.geofp8_state is not None:
            self.geofp8_state.remove_hooks()
        self._resume = None  # a validate/test checkpoint is not restored by a later fit
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        if STRATEGY_NAME not in strategy_registry:
            strategy_registry.register(STRATEGY_NAME, cls,
                                       description="DDP with GeoFP8 gradient communication")


GeoFP8DDPStrategy.register_strategies(StrategyRegistry)


def enable_fsdp(module: LightningModule, config: GeoFP8Config | FP8Config | None = None, *,
                log_stats: bool = True, **kwargs: Any):
    """Install GeoFP8 on a ``fully_shard``-ed ``LightningModule``; return the
    :class:`geofp8.fsdp.GeoFP8FSDP` state (also ``module.geofp8_state``).

    Call at the end of ``configure_model``. GeoFP8 goes on the outermost ``fully_shard``-ed
    module (the one ``training_step`` calls; its forward marks GeoFP8's step boundaries),
    which must be unique. ``kwargs`` go to :func:`geofp8.fsdp.enable`
    (``mesh=`` for HSDP, ``residual=``). With ``log_stats``, GeoFP8's figures of each step are
    logged through ``module.log_dict`` at the end of every training batch. The module's
    ``on_save_checkpoint`` / ``on_load_checkpoint`` (the user's run first) keep every rank's
    state in the checkpoint (:func:`~geofp8.integrations.checkpoint.gather`, a collective:
    Lightning saves on every rank) and restore it when fitting.

    Raises:
        TypeError: ``module`` is not a ``LightningModule``.
        ValueError: no ``fully_shard``-ed submodule, or several outermost ones.
        RuntimeError: GeoFP8 is already enabled on this module.
    """
    from torch.distributed.fsdp import FSDPModule

    from .. import fsdp

    if not isinstance(module, LightningModule):
        raise TypeError(f"enable_fsdp takes the LightningModule (self in configure_model), "
                        f"got {type(module).__name__}")
    if getattr(module, "geofp8_state", None) is not None:
        raise RuntimeError("GeoFP8 is already enabled on this LightningModule")
    sharded = [m for m in module.modules() if isinstance(m, FSDPModule)]
    inner = {id(sub) for m in sharded for sub in m.modules() if sub is not m}
    roots = [m for m in sharded if id(m) not in inner]
    if len(roots) != 1:
        raise ValueError(f"enable_fsdp: needs exactly one outermost fully_shard-ed module (the "
                         f"model training_step calls), found {len(roots)}; call it at the end "
                         "of configure_model, after fully_shard")
    state = fsdp.enable(roots[0], config, **kwargs)
    module.geofp8_state = state
    if log_stats:
        totals: dict = {}

        users_hook = module.on_train_batch_end

        def on_train_batch_end(outputs: Any, batch: Any, batch_idx: int) -> None:
            users_hook(outputs, batch, batch_idx)
            module.log_dict(metrics(state, totals), on_step=True, on_epoch=False, batch_size=1)

        module.on_train_batch_end = on_train_batch_end  # this instance only, wraps the user's
    _checkpoint_hooks(module, state)
    return state


def _checkpoint_hooks(module: LightningModule, state) -> None:
    """Wrap ``module``'s checkpoint hooks (this instance only) to save and restore ``state``."""
    from lightning.pytorch.trainer.states import TrainerFn

    users_save, users_load = module.on_save_checkpoint, module.on_load_checkpoint

    def on_save_checkpoint(checkpoint: dict[str, Any]) -> None:
        users_save(checkpoint)
        saved = gather(state)
        if saved is not None:
            checkpoint[CHECKPOINT_KEY] = saved

    def on_load_checkpoint(checkpoint: dict[str, Any]) -> None:
        users_load(checkpoint)
        if module.trainer.state.fn == TrainerFn.FITTING:  # not a validate/test checkpoint
            restore(state, checkpoint.get(CHECKPOINT_KEY), str(module.trainer.ckpt_path))

    module.on_save_checkpoint = on_save_checkpoint
    module.on_load_checkpoint = on_load_checkpoint


__all__ = ["STRATEGY_NAME", "GeoFP8DDPStrategy", "enable_fsdp"]
