"""The Hugging Face ``transformers`` Trainer: GeoFP8 on the DDP model the Trainer builds.

One line, before ``train()``::

    trainer = Trainer(model=model, args=args, train_dataset=...)
    enable(trainer, GeoFP8Config())
    trainer.train()

The Trainer has no option for a communication hook and wraps the model in DDP inside
``train()`` (``trainer.model_wrapped``), before it fires ``on_train_begin``; the callback
registers GeoFP8 there, i.e. before the first backward. After each of the Trainer's
training logs it logs :func:`geofp8.integrations.metrics` (``trainer.log``), which reach
``state.log_history`` and every ``report_to`` integration. DDP only for now: FSDP and
DeepSpeed Trainers are refused.

Checkpoints: at each of the Trainer's saves (``on_save``) every rank writes its GeoFP8 state to
``<output_dir>/checkpoint-<step>/geofp8-rank<r>.pt``; ``trainer.train(resume_from_checkpoint=...)``
(a path, or ``True`` for the newest under ``output_dir``) restores it at ``on_train_begin``, so
the resumed run is bit-identical to one that never stopped (:mod:`geofp8.integrations.checkpoint`;
a checkpoint without it resumes with a warning, one from another number of ranks is refused).
:func:`enable` wraps ``trainer.train`` to learn which checkpoint it resumes from.
"""

from __future__ import annotations

import functools
import os

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
from transformers.training_args import ParallelMode

from .. import GeoFP8Config, GeoFP8State
from . import install, metrics
from .checkpoint import load_files, save_files


class GeoFP8Callback(TrainerCallback):
    """Installs GeoFP8 on ``trainer.model_wrapped`` at ``on_train_begin``; logs its figures;
    saves its state with each checkpoint and restores it from :attr:`resume_from`.

    Args:
        trainer: the ``Trainer`` it belongs to (the callback events do not carry the wrapped
            model, only the unwrapped one).
        config: the :class:`GeoFP8Config` (default ``GeoFP8Config()``).
        log_stats: log GeoFP8's figures after each of the Trainer's training logs.
    """

    def __init__(self, trainer, config: GeoFP8Config | None = None, log_stats: bool = True):
        self.trainer = trainer
        self.config = config if config is not None else GeoFP8Config()
        self.log_stats = log_stats
        self.state: GeoFP8State | None = None
        self.resume_from: str | None = None  # the checkpoint directory train() resumes from
        self._wrapped = None
        self._totals: dict = {}
        self._figures: dict | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        wrapped = self.trainer.model_wrapped
        if wrapped is not self._wrapped:  # not a second train() call on the same DDP model
            if self.state is not None:
                self.state.remove_hooks()
            self.state = install(wrapped, self.config,
                                 grad_scaler=getattr(self.trainer.accelerator, "scaler", None),
                                 wrapped_by="Trainer.train() has wrapped the model "
                                            "(GeoFP8 installs at on_train_begin)")
            self._wrapped, self._totals = wrapped, {}
        if self.resume_from is not None:
            directory, self.resume_from = self.resume_from, None
            load_files(self.state, directory)

    def on_save(self, args, state, control, **kwargs):
        if self.state is not None:  # the folder the Trainer has just written (every rank)
            save_files(self.state, os.path.join(args.output_dir,
                                                f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"))

    def on_step_end(self, args, state, control, **kwargs):
        if self.log_stats and self.state is not None:
            self._figures = metrics(self.state, self._totals)  # every step, for the totals

    def on_log(self, args, state, control, logs=None, **kwargs):
        # right after the Trainer's own training log (it has a "loss"; ours has none, so
        # this does not recurse): trainer.log reaches log_history and every report_to
        if logs is not None and "loss" in logs and self._figures is not None:
            figures, self._figures = self._figures, None
            self.trainer.log(figures)


def enable(trainer, config: GeoFP8Config | None = None, log_stats: bool = True) -> GeoFP8Callback:
    """Add a :class:`GeoFP8Callback` to ``trainer``; its ``.state`` is live once training runs.

    Raises ``RuntimeError`` when the Trainer will not train with DDP (a single process,
    FSDP or DeepSpeed).
    """
    args = trainer.args
    if args.parallel_mode != ParallelMode.DISTRIBUTED or args.world_size < 2:
        raise RuntimeError(
            f"GeoFP8: this Trainer does no DDP training (parallel_mode {args.parallel_mode}, "
            f"world_size {args.world_size}): launch ≥ 2 processes with torchrun (without a GPU "
            "also set TrainingArguments(use_cpu=True))")
    if trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled:
        raise RuntimeError("GeoFP8 supports the Trainer's DDP only, not FSDP or DeepSpeed")
    callback = GeoFP8Callback(trainer, config, log_stats)
    trainer.add_callback(callback)
    train = trainer.train

    @functools.wraps(train)
    def train_recording_resume(resume_from_checkpoint=None, *args, **kwargs):
        found = get_last_checkpoint(trainer.args.output_dir) \
            if resume_from_checkpoint is True else resume_from_checkpoint
        callback.resume_from = found or None  # False: no resume
        return train(resume_from_checkpoint, *args, **kwargs)

    trainer.train = train_recording_resume
    return callback


__all__ = ["GeoFP8Callback", "enable"]
