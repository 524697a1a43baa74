"""PyTorch Lightning: a DDP strategy that communicates gradients with GeoFP8.

One line::

    trainer = L.Trainer(strategy=GeoFP8DDPStrategy(config=GeoFP8Config()), devices=2)

or, after importing this module, ``strategy="geofp8_ddp"`` (default config).

Lightning's own ``DDPStrategy(ddp_comm_hook=...)`` registers a hook only when the device is
CUDA; on any other device it trains with FP32 all-reduce without a word. This strategy
registers GeoFP8 on every device (CPU/gloo included) and fails loudly when it cannot. Each
optimizer step logs :func:`geofp8.integrations.metrics` (``geofp8/bytes_per_element``, ...)
through ``LightningModule.log``, so every Lightning logger receives them; the live state is
``strategy.geofp8_state``.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

from .. import GeoFP8Config, GeoFP8State
from . import install, metrics

STRATEGY_NAME = "geofp8_ddp"


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

    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.log_stats and self.geofp8_state is not None:
            figures = metrics(self.geofp8_state, self._totals)
            self.lightning_module.log_dict(figures, on_step=True, on_epoch=False, batch_size=1)
        return output

    def teardown(self) -> None:
        if self.geofp8_state is not None:
            self.geofp8_state.remove_hooks()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        if STRATEGY_NAME not in strategy_registry:
            strategy_registry.register(STRATEGY_NAME, cls,
                                       description="DDP with GeoFP8 gradient communication")


GeoFP8DDPStrategy.register_strategies(StrategyRegistry)

__all__ = ["STRATEGY_NAME", "GeoFP8DDPStrategy"]
