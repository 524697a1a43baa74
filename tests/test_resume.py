"""GeoFP8's state in each framework's checkpoint: a run stopped after step ``K`` and resumed from
the framework's checkpoint ends bitwise where the run that never stopped ends (the raw DDP loop
of :mod:`integration_setup`, which the framework runs match in tests/test_integrations.py).

Each test also resumes from the same checkpoint without its GeoFP8 state (a warning, and a run
that is *not* bitwise equal: the check can fail) and, where it costs one process, on another
number of ranks (refused, with both counts named)."""

import os
import warnings

import pytest
import torch

from distributed import run_ranks
from integration_setup import (
    CONFIG,
    LR,
    STEPS,
    flat_params,
    full_params,
    rank_batches,
    raw_ddp,
    tiny_llama,
)

pytestmark = pytest.mark.distributed

K = STEPS // 2  # the step after which the first run stops


def _check_resume(result):
    """The resumed run (steps K+1..STEPS) against the one that never stopped."""
    (losses, params, step), (no_state_params, no_state_step, warned), (ref_losses, ref_params,
                                                                       _) = result
    assert step == STEPS, "GeoFP8's step counter was not restored"
    assert losses == ref_losses[K:]
    assert torch.equal(params, ref_params)
    # without GeoFP8's state: a warning, fresh residuals and factors, another trajectory
    assert no_state_step == STEPS - K
    assert any("holds no GeoFP8 state" in w for w in warned), warned
    assert not torch.equal(no_state_params, ref_params)


def _warnings_of(fn):
    """``fn()``'s result and the messages of the warnings it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in caught]


# -- PyTorch Lightning -----------------------------------------------------------------------

def _lightning_fit(world_size, batches, max_steps, ckpt_path=None, fsdp=False):
    """A Lightning run of the tiny Llama with the GeoFP8 strategy (``fsdp``:
    ``ModelParallelStrategy`` + ``enable_fsdp``): (trainer, module, losses).

    Step ``s`` trains on ``batches[s]`` whatever the loader yields: Lightning restarts a plain
    ``DataLoader`` from its first batch on a mid-epoch resume (its own data semantics, not what
    these tests check)."""
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    from geofp8.integrations.lightning import GeoFP8DDPStrategy, enable_fsdp
    from integration_setup import shard_llama

    losses = []

    class LitLM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_llama()

        def configure_model(self):
            if fsdp:
                shard_llama(self.model, self.device_mesh["data_parallel"])
                enable_fsdp(self, CONFIG, log_stats=False)

        def training_step(self, _, batch_idx):
            tokens = batches[self.global_step]
            loss = self.model(input_ids=tokens, labels=tokens).loss
            losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.0)

    lit = LitLM()
    strategy = ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1) \
        if fsdp else GeoFP8DDPStrategy(config=CONFIG, log_stats=False)
    trainer = L.Trainer(accelerator="cpu", devices=world_size, max_steps=max_steps,
                        strategy=strategy,
                        logger=False, use_distributed_sampler=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    loader = torch.utils.data.DataLoader(range(len(batches)), batch_size=None)
    trainer.fit(lit, loader, ckpt_path=ckpt_path)
    return trainer, lit, losses


def _lightning_resume_worker(rank, world_size, directory):
    os.environ["LOCAL_RANK"] = str(rank)
    batches = rank_batches(rank, world_size)
    path, bare = os.path.join(directory, "k.ckpt"), os.path.join(directory, "bare.ckpt")
    trainer, _, _ = _lightning_fit(world_size, batches, K)
    trainer.save_checkpoint(path)
    if rank == 0:
        saved = torch.load(path, weights_only=True)
        assert len(saved["geofp8"]["ranks"]) == world_size
        del saved["geofp8"]
        torch.save(saved, bare)
    torch.distributed.barrier()
    trainer, lit, losses = _lightning_fit(world_size, batches, STEPS, path)
    resumed = (losses, flat_params(lit.model), trainer.strategy.geofp8_state.step)
    (trainer, lit, _), warned = _warnings_of(
        lambda: _lightning_fit(world_size, batches, STEPS, bare))
    no_state = (flat_params(lit.model), trainer.strategy.geofp8_state.step, warned)
    return resumed, no_state, raw_ddp(rank, world_size)


def _lightning_one_rank_worker(rank, world_size, path):
    os.environ["LOCAL_RANK"] = str(rank)
    try:
        _lightning_fit(world_size, rank_batches(0, 1), STEPS, path)
    except ValueError as e:
        return str(e)
    return None


def _lightning_fsdp_resume_worker(rank, world_size, directory):
    os.environ["LOCAL_RANK"] = str(rank)
    import shutil

    from integration_setup import full_params, raw_fsdp

    batches = rank_batches(rank, world_size)
    path, bare = os.path.join(directory, "k.ckpt"), os.path.join(directory, "bare.ckpt")
    trainer, _, _ = _lightning_fit(world_size, batches, K, fsdp=True)
    trainer.save_checkpoint(path)  # a sharded (DCP) directory; meta.pt holds "geofp8"
    if rank == 0:
        shutil.copytree(path, bare)
        meta = torch.load(os.path.join(bare, "meta.pt"), weights_only=True)
        assert len(meta.pop("geofp8")["ranks"]) == world_size
        torch.save(meta, os.path.join(bare, "meta.pt"))
    torch.distributed.barrier()
    _, lit, losses = _lightning_fit(world_size, batches, STEPS, path, fsdp=True)
    resumed = (losses, full_params(lit.model), lit.geofp8_state.step)
    (_, lit, _), warned = _warnings_of(
        lambda: _lightning_fit(world_size, batches, STEPS, bare, fsdp=True))
    no_state = (full_params(lit.model), lit.geofp8_state.step, warned)
    return resumed, no_state, raw_fsdp(rank, world_size)


def test_resume_lightning_model_parallel_checkpoint_is_bitwise(tmp_path):
    for result in run_ranks(_lightning_fsdp_resume_worker, world_size=2,
                            args=(str(tmp_path),), timeout=300):
        _check_resume(result)


def test_resume_lightning_checkpoint_is_bitwise(tmp_path):
    results = run_ranks(_lightning_resume_worker, world_size=2, args=(str(tmp_path),),
                        timeout=300)
    for result in results:
        _check_resume(result)
    refused = run_ranks(_lightning_one_rank_worker, world_size=1,
                        args=(str(tmp_path / "k.ckpt"),), timeout=120)[0]
    assert refused is not None and "written on 2 ranks, this run has 1" in refused


# -- Hugging Face Accelerate -----------------------------------------------------------------

def _accelerate_run(batches, load_from=None, save_to=None, fsdp=False):
    """Prepare the tiny Llama (``fsdp``: FSDP2, see :func:`accelerate_fsdp2`), enable GeoFP8,
    optionally ``load_state``, train on ``batches``, optionally ``save_state``: (losses,
    parameters, GeoFP8 step)."""
    from accelerate import Accelerator

    from geofp8.integrations import accelerate as geo
    from integration_setup import WrappedLlama, accelerate_fsdp2

    accelerator = accelerate_fsdp2()[0] if fsdp else Accelerator(cpu=True)
    model = WrappedLlama() if fsdp else tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    state = geo.enable(accelerator, model, CONFIG)
    if load_from is not None:
        accelerator.load_state(load_from)
    losses = []
    for tokens in batches:
        loss = model(input_ids=tokens, labels=tokens).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    if save_to is not None:
        accelerator.save_state(save_to)
    params = full_params(model) if fsdp else flat_params(accelerator.unwrap_model(model))
    return losses, params, state.step


def _accelerate_resume_worker(rank, world_size, directory, fsdp=False):
    """DDP: against the raw DDP loop; FSDP2: against Accelerate's own run that never stops."""
    os.environ["LOCAL_RANK"] = str(rank)
    import shutil

    batches = rank_batches(rank, world_size)
    path, bare = os.path.join(directory, "k"), os.path.join(directory, "bare")
    _accelerate_run(batches[:K], save_to=path, fsdp=fsdp)
    torch.distributed.barrier()
    if rank == 0:
        assert sorted(f for f in os.listdir(path) if f.startswith("geofp8")) == [
            f"geofp8-rank{r}.pt" for r in range(world_size)]
        shutil.copytree(path, bare, ignore=shutil.ignore_patterns("geofp8-*"))
    torch.distributed.barrier()
    resumed = _accelerate_run(batches[K:], load_from=path, fsdp=fsdp)
    (_, params, step), warned = _warnings_of(
        lambda: _accelerate_run(batches[K:], bare, fsdp=fsdp))
    return resumed, (params, step, warned), \
        _accelerate_run(batches, fsdp=True) if fsdp else raw_ddp(rank, world_size)


def _per_rank_files_one_rank_worker(rank, world_size, path):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from geofp8.integrations import install
    from geofp8.integrations.checkpoint import load_files

    try:
        load_files(install(DDP(tiny_llama()), CONFIG), path)
    except ValueError as e:
        return str(e)
    return None


def test_resume_accelerate_save_state_is_bitwise(tmp_path):
    for result in run_ranks(_accelerate_resume_worker, world_size=2, args=(str(tmp_path),),
                            timeout=300):
        _check_resume(result)
    # the per-rank files (Accelerate's and the Trainer's) on another number of ranks
    refused = run_ranks(_per_rank_files_one_rank_worker, world_size=1,
                        args=(str(tmp_path / "k"),), timeout=120)[0]
    assert refused is not None and "written on 2 ranks, this run has 1" in refused


def test_resume_accelerate_fsdp2_save_state_is_bitwise(tmp_path):
    for result in run_ranks(_accelerate_resume_worker, world_size=2,
                            args=(str(tmp_path), True), timeout=300):
        _check_resume(result)


# -- the transformers Trainer ----------------------------------------------------------------

def _trainer_run(world_size, out_dir, max_steps, resume=None):
    """A Trainer run with GeoFP8, saving every K steps: (losses, batches fed, parameters,
    GeoFP8 step)."""
    from transformers import Trainer, TrainingArguments

    from geofp8.integrations.transformers import enable

    losses, fed = [], []

    class Recording(Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            losses.append(loss.item())
            fed.append(inputs["input_ids"])
            return loss

    def collate(examples):
        tokens = torch.stack([e["input_ids"] for e in examples])
        return {"input_ids": tokens, "labels": tokens}

    dataset = [{"input_ids": t} for b in rank_batches(0, 1, STEPS * world_size) for t in b]
    args = TrainingArguments(
        output_dir=out_dir, use_cpu=True, per_device_train_batch_size=4, max_steps=max_steps,
        learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0,
        average_tokens_across_devices=False, save_strategy="steps", save_steps=K,
        report_to=[], disable_tqdm=True, dataloader_num_workers=0, optim="adamw_torch")
    trainer = Recording(model=tiny_llama(), args=args, train_dataset=dataset,
                        data_collator=collate)
    callback = enable(trainer, CONFIG, log_stats=False)
    trainer.train(resume_from_checkpoint=resume)
    return losses, fed, flat_params(trainer.model), callback.state.step


def _trainer_resume_worker(rank, world_size, directory):
    os.environ["LOCAL_RANK"] = str(rank)
    import shutil

    out = os.path.join(directory, "run")
    _, fed, _, _ = _trainer_run(world_size, out, K)
    checkpoint = os.path.join(out, f"checkpoint-{K}")
    bare = os.path.join(directory, "bare")
    torch.distributed.barrier()
    if rank == 0:
        shutil.copytree(checkpoint, bare, ignore=shutil.ignore_patterns("geofp8-*"))
    torch.distributed.barrier()
    losses, fed_after, params, step = _trainer_run(world_size, out, STEPS, resume=True)
    (_, _, bare_params, bare_step), warned = _warnings_of(
        lambda: _trainer_run(world_size, os.path.join(directory, "again"), STEPS, bare))
    # the never-stopped reference: the raw DDP loop on the batches the Trainer fed
    return ((losses, params, step), (bare_params, bare_step, warned),
            raw_ddp(rank, world_size, fed + fed_after))


def test_resume_transformers_trainer_checkpoint_is_bitwise(tmp_path):
    for result in run_ranks(_trainer_resume_worker, world_size=2, args=(str(tmp_path),),
                            timeout=300):
        _check_resume(result)


# -- FSDP2 through torch.distributed.checkpoint (sharded, per rank) ---------------------------

def _fsdp_dcp_run(batches, load_from=None, save_to=None):
    """``fully_shard`` + GeoFP8, optionally resumed from the DCP checkpoint ``load_from``
    (model, optimizer and GeoFP8 state, all sharded), trained on ``batches``, optionally saved
    to ``save_to``: (losses, all parameters, GeoFP8 step)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from geofp8 import fsdp
    from geofp8.integrations import dcp as geo_dcp
    from integration_setup import full_params, shard_llama

    model = shard_llama(tiny_llama())
    state = fsdp.enable(model, CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)

    def checkpoint():
        return {"model": get_model_state_dict(model),
                "optim": get_optimizer_state_dict(model, opt),
                geo_dcp.KEY: geo_dcp.DCPState([state])}

    if load_from is not None:
        saved = checkpoint()
        geo_dcp.load(saved, load_from)
        set_model_state_dict(model, saved["model"])
        set_optimizer_state_dict(model, opt, saved["optim"])
    losses = []
    for tokens in batches:
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if save_to is not None:
        dcp.save(checkpoint(), checkpoint_id=save_to)
        bare = checkpoint()
        del bare[geo_dcp.KEY]
        dcp.save(bare, checkpoint_id=save_to + "-bare")
    return losses, full_params(model), state.step


def _fsdp_dcp_resume_worker(rank, world_size, directory):
    from integration_setup import raw_fsdp

    batches = rank_batches(rank, world_size)
    path = os.path.join(directory, "k")
    _fsdp_dcp_run(batches[:K], save_to=path)
    resumed = _fsdp_dcp_run(batches[K:], load_from=path)
    (_, params, step), warned = _warnings_of(
        lambda: _fsdp_dcp_run(batches[K:], load_from=path + "-bare"))
    return resumed, (params, step, warned), raw_fsdp(rank, world_size)


def test_dcp_encoding_is_tensors_only_and_round_trips():
    from geofp8.integrations.dcp import decode, encode

    state = {"a": (1, 2.5, None, "x"), 3: [torch.arange(3), {"t": torch.ones(2, 2)}],
             "inf": float("inf"), "flag": True, "empty": {}}
    entries = encode(state)
    assert all(isinstance(v, torch.Tensor) for v in entries.values()) and len(entries) == 3
    back = decode(entries)
    assert back["a"] == (1, 2.5, None, "x") and back["inf"] == float("inf")
    assert back["flag"] is True and back["empty"] == {} and list(back) == list(state)
    assert torch.equal(back[3][0], state[3][0]) and torch.equal(back[3][1]["t"], state[3][1]["t"])
    with pytest.raises(TypeError, match="only tensors and plain containers"):
        encode({"x": object()})


def _dcp_one_rank_worker(rank, world_size, path):
    from geofp8.integrations.dcp import DCPState

    try:
        DCPState([]).expect(path)
    except ValueError as e:
        return str(e)
    return None


def test_resume_fsdp_dcp_sharded_is_bitwise(tmp_path):
    for result in run_ranks(_fsdp_dcp_resume_worker, world_size=2, args=(str(tmp_path),),
                            timeout=300):
        _check_resume(result)
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(tmp_path / "k")).read_metadata().state_dict_metadata
    assert {k.split("/")[0] for k in keys if k.startswith("geofp8.")} == {
        "geofp8.rank0", "geofp8.rank1"}, "each rank's GeoFP8 state under its own keys"
    refused = run_ranks(_dcp_one_rank_worker, world_size=1, args=(str(tmp_path / "k"),),
                        timeout=120)[0]
    assert refused is not None and "written on 2 ranks, this run has 1" in refused
