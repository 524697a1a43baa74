"""GeoFP8 inside real frameworks (Lightning, Accelerate, the transformers Trainer): each one
trains a tiny Llama on 2 gloo ranks, and must match the raw DDP (or FSDP2) loop with the same
batches."""

import os

import pytest
import torch

from distributed import run_ranks
from integration_setup import (
    CONFIG,
    LR,
    STEPS,
    WrappedLlama,
    accelerate_fsdp2,
    flat_params,
    full_params,
    rank_batches,
    raw_ddp,
    raw_fsdp,
    shard_llama,
    tiny_llama,
)

pytestmark = pytest.mark.distributed


def _check_run(results, metric_rows):
    """Both ranks: GeoFP8 active, parameters identical to each other and to raw DDP."""
    (losses0, params0, stats0, ref0), (losses1, params1, stats1, _) = results
    ref_losses, ref_params, ref_stats = ref0
    assert stats0["step"] == STEPS and stats1["step"] == STEPS
    assert stats0["bytes_sent"] > 0 and stats0["bytes_per_element"] < 2.0  # FP32 ring: 4.0
    assert stats0["geometry_layers"], "no layer took the geometry branch"
    assert torch.equal(params0, params1), "ranks diverged"
    assert losses0[-1] < losses0[0]
    assert losses0 == ref_losses and torch.equal(params0, ref_params)
    assert stats0["bytes_sent"] == ref_stats["bytes_sent"]
    assert [r["geofp8/step"] for r in metric_rows] == [float(s) for s in range(1, STEPS + 1)]
    # refresh steps also carry factors; the others are FP8 payload + scales: ≈ 2(N−1)/N bytes
    per_element = [r["geofp8/bytes_per_element"] for r in metric_rows]
    assert 1.0 < min(per_element) < 1.1, per_element
    assert metric_rows[-1]["geofp8/bytes_per_step"] == stats0["bytes_sent"]
    assert min(per_element) < metric_rows[-1]["geofp8/run_bytes_per_element"] < max(per_element)


# -- PyTorch Lightning -----------------------------------------------------------------------

def _lightning_worker(rank, world_size):
    os.environ["LOCAL_RANK"] = str(rank)  # Lightning: processes launched externally
    import lightning as L
    from lightning.pytorch.loggers import Logger

    from geofp8.integrations.lightning import GeoFP8DDPStrategy

    class LitLM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_llama()
            self.losses = []

        def training_step(self, tokens, batch_idx):
            loss = self.model(input_ids=tokens, labels=tokens).loss
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.0)

    class Rows(Logger):  # an in-memory Lightning logger (rank 0 only, like all of them)
        name, version, rows = "rows", 0, []

        def log_metrics(self, metrics, step=None):
            if any(k.startswith("geofp8/") for k in metrics):
                self.rows.append(metrics)

        def log_hyperparams(self, *args, **kwargs):
            pass

    lit, rows = LitLM(), Rows()
    strategy = GeoFP8DDPStrategy(config=CONFIG)
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy,
                        max_steps=STEPS, logger=rows, log_every_n_steps=1,
                        use_distributed_sampler=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    loader = torch.utils.data.DataLoader(rank_batches(rank, world_size), batch_size=None)
    trainer.fit(lit, loader)
    stats = strategy.geofp8_state.stats()
    return (lit.losses, flat_params(lit.model), stats,
            raw_ddp(rank, world_size) + (rows.rows if rank == 0 else None,))


def test_lightning_strategy_trains_with_geofp8_on_cpu():
    results = run_ranks(_lightning_worker, world_size=2, timeout=180)
    rows = results[0][3][3]
    results[0] = (*results[0][:3], results[0][3][:3])
    _check_run(results, rows)


def _check_fsdp_run(results, metric_rows=None):
    """Both ranks: GeoFP8's FP8 reduce-scatter active, all-gathered parameters identical to
    each other and to the raw FSDP2 loop."""
    (losses0, params0, stats0, ref0), (losses1, params1, stats1, _) = results
    ref_losses, ref_params, ref_stats = ref0
    assert stats0["step"] == STEPS and stats1["step"] == STEPS
    # FSDP's FP32 reduce-scatter: 4(N−1)/N = 2 bytes per element; FP8: ≈ (N−1)/N
    assert stats0["bytes_sent"] > 0 and 0.5 <= stats0["bytes_per_element"] < 0.6
    assert stats0["geometry_layers"], "no layer took the geometry branch"
    assert torch.equal(params0, params1), "ranks diverged"
    assert losses0[-1] < losses0[0] and losses1[-1] < losses1[0]
    assert losses0 == ref_losses and torch.equal(params0, ref_params)
    assert stats0["bytes_sent"] == ref_stats["bytes_sent"]
    if metric_rows is not None:
        assert [r["geofp8/step"] for r in metric_rows] == [float(s) for s in range(1, STEPS + 1)]
        assert metric_rows[-1]["geofp8/bytes_per_step"] == stats0["bytes_sent"]


def _lightning_fsdp_worker(rank, world_size):
    os.environ["LOCAL_RANK"] = str(rank)
    import lightning as L
    from lightning.pytorch.loggers import Logger
    from lightning.pytorch.strategies import ModelParallelStrategy

    from geofp8.integrations.lightning import enable_fsdp

    errors = {}

    class LitLM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_llama()
            self.losses = []

        def configure_model(self):
            try:
                enable_fsdp(self, CONFIG)
            except ValueError as e:
                errors["unsharded"] = str(e)
            shard_llama(self.model, self.device_mesh["data_parallel"])
            enable_fsdp(self, CONFIG)
            try:
                enable_fsdp(self, CONFIG)
            except RuntimeError as e:
                errors["twice"] = str(e)

        def training_step(self, tokens, batch_idx):
            loss = self.model(input_ids=tokens, labels=tokens).loss
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.0)

    class Rows(Logger):
        name, version, rows = "rows", 0, []

        def log_metrics(self, metrics, step=None):
            if any(k.startswith("geofp8/") for k in metrics):
                self.rows.append(metrics)

        def log_hyperparams(self, *args, **kwargs):
            pass

    lit, rows = LitLM(), Rows()
    trainer = L.Trainer(accelerator="cpu", devices=world_size, max_steps=STEPS, logger=rows,
                        strategy=ModelParallelStrategy(data_parallel_size=world_size,
                                                       tensor_parallel_size=1),
                        log_every_n_steps=1, use_distributed_sampler=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    loader = torch.utils.data.DataLoader(rank_batches(rank, world_size), batch_size=None)
    trainer.fit(lit, loader)
    return (lit.losses, full_params(lit.model), lit.geofp8_state.stats(),
            raw_fsdp(rank, world_size) + ((rows.rows, errors) if rank == 0 else None,))


def test_lightning_model_parallel_enable_fsdp_trains_with_geofp8():
    """``ModelParallelStrategy`` runs on CPU/gloo: ``enable_fsdp`` in ``configure_model``."""
    results = run_ranks(_lightning_fsdp_worker, world_size=2, timeout=180)
    rows, errors = results[0][3][3]
    results[0] = (*results[0][:3], results[0][3][:3])
    _check_fsdp_run(results, rows)
    assert "found 0" in errors["unsharded"]
    assert "already enabled" in errors["twice"]


# -- Hugging Face Accelerate -----------------------------------------------------------------

def _accelerate_worker(rank, world_size):
    os.environ["LOCAL_RANK"] = str(rank)
    from accelerate import Accelerator
    from accelerate.tracking import GeneralTracker
    from torch.nn.parallel import DistributedDataParallel as DDP

    from geofp8.integrations import accelerate as geo
    from geofp8.integrations import install

    class Rows(GeneralTracker):  # an in-memory tracker (main process only, like all of them)
        name, requires_logging_directory, main_process_only = "rows", False, True

        def __init__(self):
            super().__init__()
            self.rows = []

        @property
        def tracker(self):
            return self.rows

        def store_init_configuration(self, values):
            pass

        def log(self, values, step=None, **kwargs):
            self.rows.append(values)

    rows = Rows()
    accelerator = Accelerator(cpu=True, log_with=[rows])
    accelerator.init_trackers("geofp8-test")
    model = tiny_llama()
    errors = {}
    try:
        geo.enable(accelerator, model, CONFIG)
    except TypeError as e:
        errors["unprepared"] = str(e)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    state = geo.enable(accelerator, model, CONFIG)
    try:
        geo.enable(accelerator, model, CONFIG)
    except RuntimeError as e:
        errors["twice"] = str(e)
    try:
        geo.enable(accelerator, model, CONFIG, residual="bf16")
    except TypeError as e:
        errors["fsdp_kwargs"] = str(e)
    # a process group whose backend GeoFP8 does not support
    from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401 ("fake")

    fake = torch.distributed.new_group(backend="fake")
    try:
        install(DDP(torch.nn.Linear(4, 4), process_group=fake), CONFIG)
    except ValueError as e:
        errors["backend"] = str(e)
    losses, totals = [], {}
    for step, tokens in enumerate(rank_batches(rank, world_size)):
        loss = model(input_ids=tokens, labels=tokens).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        geo.log(accelerator, state, step=step, totals=totals)
    unwrapped = accelerator.unwrap_model(model)
    return (losses, flat_params(unwrapped), state.stats(),
            raw_ddp(rank, world_size) + ((rows.rows, errors) if rank == 0 else None,))


def test_accelerate_enable_trains_with_geofp8_and_refuses_misuse():
    results = run_ranks(_accelerate_worker, world_size=2, timeout=180)
    rows, errors = results[0][3][3]
    results[0] = (*results[0][:3], results[0][3][:3])
    _check_run(results, rows)
    assert "accelerator.prepare(model)" in errors["unprepared"]
    assert "already has the communication hook 'geofp8_hook'" in errors["twice"]
    assert "supports the ('gloo', 'nccl') backends, got 'fake'" in errors["backend"]
    assert "['residual'] apply to FSDP2 only" in errors["fsdp_kwargs"]


def _accelerate_fsdp_worker(rank, world_size):
    os.environ["LOCAL_RANK"] = str(rank)
    from geofp8.integrations import accelerate as geo

    # Accelerate's own fsdp2_prepare_model runs here on CPU/gloo
    accelerator, built = accelerate_fsdp2()
    plugin = accelerator.state.fsdp_plugin
    model = WrappedLlama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    plugin.fsdp_version = 1  # what an FSDP1 accelerator reports
    try:
        geo.enable(accelerator, model, CONFIG)
    except RuntimeError as e:
        fsdp1 = str(e)
    plugin.fsdp_version = 2
    state = geo.enable(accelerator, model, CONFIG)
    losses, totals, rows = [], {}, []
    for step, tokens in enumerate(rank_batches(rank, world_size)):
        loss = model(input_ids=tokens, labels=tokens).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        rows.append(geo.log(accelerator, state, step=step, totals=totals))
    return (losses, full_params(model), state.stats(),
            raw_fsdp(rank, world_size) + ((rows, str(built), fsdp1) if rank == 0 else None,))


def test_accelerate_fsdp2_enable_installs_the_fp8_reduce_scatter():
    results = run_ranks(_accelerate_fsdp_worker, world_size=2, timeout=180)
    rows, built, fsdp1 = results[0][3][3]
    results[0] = (*results[0][:3], results[0][3][:3])
    assert built == "DistributedType.MULTI_CPU"  # if Accelerate learns FSDP on CPU: unforce
    _check_fsdp_run(results, rows)
    assert "built an FSDP1 model" in fsdp1


# -- the transformers Trainer ----------------------------------------------------------------

def _trainer_worker(rank, world_size, out_dir):
    os.environ["LOCAL_RANK"] = str(rank)
    from transformers import Trainer, TrainingArguments

    from geofp8.integrations.transformers import enable

    fed = []  # the batches the Trainer's own sampler fed this rank, for the reference run

    def collate(examples):
        tokens = torch.stack([e["input_ids"] for e in examples])
        fed.append(tokens)
        return {"input_ids": tokens, "labels": tokens}

    losses = []

    class Losses(Trainer):  # only records each step's loss
        def compute_loss(self, model, inputs, *args, **kwargs):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            losses.append(loss.item())
            return loss

    dataset = [{"input_ids": t} for b in rank_batches(0, 1, STEPS * world_size) for t in b]
    args = TrainingArguments(
        output_dir=out_dir, use_cpu=True, per_device_train_batch_size=4, max_steps=STEPS,
        learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0,
        average_tokens_across_devices=False, logging_steps=1, save_strategy="no",
        report_to=[], disable_tqdm=True, dataloader_num_workers=0, optim="adamw_torch")
    trainer = Losses(model=tiny_llama(), args=args, train_dataset=dataset,
                     data_collator=collate)
    callback = enable(trainer, CONFIG)
    errors = {}
    try:  # what happens if the hook were installed before train() wraps the model
        callback.on_train_begin(args, trainer.state, trainer.control)
    except TypeError as e:
        errors["unwrapped"] = str(e)
    trainer.train()
    stats = callback.state.stats()
    rows = [r for r in trainer.state.log_history if "geofp8/step" in r]
    assert [r["step"] for r in trainer.state.log_history if "loss" in r] == list(
        range(1, STEPS + 1)), "the Trainer's own loss logs went missing"
    return (losses, flat_params(trainer.model), stats,
            raw_ddp(rank, world_size, fed) + ((rows, errors) if rank == 0 else None,))


def test_transformers_trainer_callback_trains_with_geofp8(tmp_path):
    results = run_ranks(_trainer_worker, world_size=2, args=(str(tmp_path),), timeout=180)
    rows, errors = results[0][3][3]
    results[0] = (*results[0][:3], results[0][3][:3])
    _check_run(results, rows)
    assert "Trainer.train() has wrapped the model" in errors["unwrapped"]


# -- misuse that needs no second process -----------------------------------------------------

def test_lightning_strategy_is_registered_and_refuses_another_hook():
    from lightning.pytorch.strategies import StrategyRegistry

    from geofp8.integrations.lightning import GeoFP8DDPStrategy, enable_fsdp

    assert StrategyRegistry["geofp8_ddp"]["strategy"] is GeoFP8DDPStrategy
    with pytest.raises(TypeError, match="DDP accepts only one"):
        GeoFP8DDPStrategy(config=CONFIG, ddp_comm_hook=lambda state, bucket: None)
    with pytest.raises(TypeError, match="takes the LightningModule"):
        enable_fsdp(torch.nn.Linear(2, 2), CONFIG)


def test_single_process_accelerator_and_trainer_are_refused(tmp_path):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainingArguments

    from geofp8.integrations import accelerate, transformers

    try:
        with pytest.raises(RuntimeError, match="does no data-parallel training"):
            accelerate.enable(Accelerator(cpu=True), tiny_llama(), CONFIG)
        trainer = Trainer(model=tiny_llama(), args=TrainingArguments(
            output_dir=str(tmp_path), use_cpu=True, report_to=[]))
        with pytest.raises(RuntimeError, match="does no DDP training"):
            transformers.enable(trainer, CONFIG)
    finally:  # Accelerate keeps its state in process-wide singletons
        AcceleratorState._reset_state(reset_partial_state=True)
