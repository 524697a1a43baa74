"""torchtitan 0.3.x: GeoFP8 through a model spec's ``post_optimizer_build_fn``.

The path torchtitan's ``Trainer.__init__`` takes, on 2 gloo ranks: ``ParallelDims`` and its
meshes, the model built on the meta device, the spec's ``parallelize_fn``
(``parallelize_llama`` → ``fully_shard``), ``to_empty`` + ``init_weights``, the optimizers
from the config, then ``post_optimizer_build_fn``. The ``Trainer`` itself needs CUDA
(``torch.cuda.set_device``), so the loop is ours. CPU deviations, all set in
:func:`_trainer_config`: meshes on ``"cpu"`` (torchtitan picks ``"cuda"`` when no accelerator
is found), SDPA attention (FlexAttention has no backward on CPU), the ``partial_dtensor``
SPMD backend (``spmd_types``' ``fully_shard`` rejects the plain parameters its
``parallelize`` leaves on CPU), FP32 parameters.

torchtitan is a test dependency (``make install`` installs it): importing it must not skip.
"""

import dataclasses
import importlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

import geofp8.integrations.torchtitan as tt_geofp8
from distributed import run_ranks
from integration_setup import BATCH, CONFIG, LR, SEQ, STEPS, VOCAB, rank_batches

pytestmark = pytest.mark.distributed


def _model_config():
    """A 2-layer llama3 (dim 64, vocab 256) from torchtitan's own builders."""
    from torchtitan.models import llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention

    dim, heads = 64, 4
    layers = llama3._build_llama3_layers(
        n_layers=2, dim=dim, n_heads=heads, hidden_dim=128, attn_backend="flex",
        rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=SEQ, theta=500000,
                                scaling="llama"))
    for layer in layers:  # FlexAttention has no backward on CPU
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return llama3.Llama3Model.Config(
        dim=dim, vocab_size=VOCAB, layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim,
                                        param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB,
                              param_init=llama3._output_linear_init(dim)))


def _trainer_config():
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = tt_geofp8.wrap_config(llama3_debugmodel, CONFIG)()
    config.model_spec = dataclasses.replace(config.model_spec, model=_model_config())
    config.training.seq_len = SEQ
    config.training.local_batch_size = BATCH
    config.training.mixed_precision_param = "float32"
    config.activation_checkpoint = None
    config.parallelism.spmd_backend = "partial_dtensor"
    config.optimizer = default_adamw(lr=LR, weight_decay=0.0)
    return config


def _parallel_dims(config, world_size):
    import torchtitan.distributed.parallel_dims as pd_module
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    pd_module.device_type = "cpu"  # torchtitan falls back to "cuda" without an accelerator
    dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
    parallel_dims = ParallelDims.from_config(config.parallelism, world_size)
    parallel_dims.build_mesh()
    return parallel_dims


def _initial_weights(config):
    """The unsharded initial weights (``init_weights`` under a fixed seed)."""
    torch.manual_seed(0)
    model = config.model_spec.model.build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _load(model, weights) -> None:
    from torch.distributed.tensor import distribute_tensor

    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(distribute_tensor(weights[name], p.device_mesh, p.placements))


def _train(model, optimizers, batches, lr_schedulers=None):
    losses = []
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    for tokens in batches:
        logits = model(tokens, positions=positions)
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(),
                                           tokens[:, 1:].reshape(-1))
        # torchtitan sets FSDP's divide factor to 1 and normalises the loss by the global
        # token count: here, every rank's tokens count the same
        (loss / dist.get_world_size()).backward()
        optimizers.step()
        if lr_schedulers is not None:
            lr_schedulers.step()
        optimizers.zero_grad()
        losses.append(loss.item())
    return losses


def _full(model) -> torch.Tensor:
    return torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])


def _titan_model(config, parallel_dims, weights):
    """torchtitan's path (``Trainer.__init__``) up to the optimizers: meta build,
    ``parallelize_fn``, init, ``weights``, optimizers: (model, optimizers)."""
    spec = config.model_spec
    with torch.device("meta"):
        model = spec.model.build()
    model = spec.parallelize_fn(model, parallel_dims=parallel_dims, training=config.training,
                                parallelism=config.parallelism, compile_config=config.compile,
                                ac_config=config.activation_checkpoint, dump_folder="unused")
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # buffers (RoPE) too
    _load(model, weights)  # the same parameters as the reference
    return model, config.optimizer.build(model_parts=[model])


def _torchtitan_vs_direct(rank, world_size):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torchtitan.distributed.fsdp import disable_fsdp_gradient_division

    from geofp8 import fsdp

    config = _trainer_config()
    spec = config.model_spec
    parallel_dims = _parallel_dims(config, world_size)
    weights = _initial_weights(config)
    spec.model.update_from_config(config=config)
    model, optimizers = _titan_model(config, parallel_dims, weights)
    called = []
    fn = tt_geofp8.post_optimizer_build_fn(
        CONFIG, then=lambda *args: called.append(len(args)), log_every=4)
    states = fn(optimizers, [model], parallel_dims)
    assert called == [3] and states == tt_geofp8.states([model]) and model.geofp8 is states[0]
    assert spec.post_optimizer_build_fn.geofp8_config is CONFIG  # wrap_config's
    with pytest.raises(ValueError, match="already on"):
        tt_geofp8.with_geofp8(spec, CONFIG)
    losses = _train(model, optimizers, rank_batches(rank, world_size))
    stats = states[0].stats()
    logged = tt_geofp8.log([model], STEPS, {})
    titan = (losses, _full(model), stats, logged)

    # the reference: the same units sharded by hand, geofp8.fsdp.enable right after
    model = spec.model.build()
    kw = {"mesh": parallel_dims.get_mesh("fsdp"),
          "mp_policy": MixedPrecisionPolicy(param_dtype=torch.float32,
                                            reduce_dtype=torch.float32,
                                            cast_forward_inputs=False)}
    fully_shard(model.tok_embeddings, **kw)
    fully_shard([model.norm, model.lm_head], **kw, reshard_after_forward=False)
    for block in model.layers.values():
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    disable_fsdp_gradient_division(model)  # what torchtitan's apply_fsdp_to_decoder does
    _load(model, weights)
    state = fsdp.enable(model, CONFIG)
    optimizers = config.optimizer.build(model_parts=[model])
    losses = _train(model, optimizers, rank_batches(rank, world_size))
    direct = (losses, _full(model), state.stats())
    return titan, direct


def test_torchtitan_parallelize_and_post_optimizer_build_fn():
    results = run_ranks(_torchtitan_vs_direct, 2, timeout=300)
    for titan, direct in results:
        losses, params, stats, logged = titan
        assert stats["step"] == STEPS and stats["skipped_steps"] == 0
        assert stats["bytes_sent"] > 0 and 0 < stats["bytes_per_element"] < 2.0  # FP32: 2
        assert logged["geofp8/step"] == STEPS
        assert stats["geometry_layers"], "the geometry branch never ran"
        assert sum(losses[-2:]) / 2 < losses[0] - 0.2, losses
        # torchtitan's path is exactly fully_shard + geofp8.fsdp.enable
        assert losses == direct[0]
        assert torch.equal(params, direct[1])
        assert stats["bytes_sent"] == direct[2]["bytes_sent"]
    assert torch.equal(results[0][0][1], results[1][0][1])


def _titan_run(config, parallel_dims, weights, batches, directory, load=None, save=()):
    """torchtitan's path with GeoFP8 and its checkpointers (built from a checkpoint config
    as ``Trainer.__init__`` builds one, in ``directory``): ``load()`` the latest checkpoint of
    the config ``load`` (if any), train on ``batches`` (schedulers stepped), then save the
    step with each config of ``save``: (losses, all parameters, GeoFP8 step)."""
    model, optimizers = _titan_model(config, parallel_dims, weights)
    (state,) = config.model_spec.post_optimizer_build_fn(optimizers, [model], parallel_dims)
    lr_schedulers = config.lr_scheduler.build(optimizers=optimizers, training_steps=STEPS)

    def checkpointer(checkpoint_config):
        return checkpoint_config.build(dataloader=None, model_parts=[model],
                                       optimizers=optimizers, lr_schedulers=lr_schedulers,
                                       states={}, sd_adapter=None, base_folder=directory)

    if load is not None:
        manager = checkpointer(load)
        assert manager.load()
        manager.close()
    losses = _train(model, optimizers, batches, lr_schedulers)
    for checkpoint_config in save:
        manager = checkpointer(checkpoint_config)
        assert manager.save(state.step)
        manager.close()
    return losses, _full(model), state.step


def _torchtitan_resume_worker(rank, world_size, directory):
    from torchtitan.components.checkpoint import CheckpointManager

    config = _trainer_config()  # wrap_config: GeoFP8's CheckpointManager
    assert type(config.checkpoint) is tt_geofp8.CheckpointManager.Config
    k = STEPS // 2  # the step the first run stops after, and the checkpoint interval
    config.checkpoint = dataclasses.replace(config.checkpoint, enable=True, folder="ckpt",
                                            interval=k)
    bare = CheckpointManager.Config(enable=True, folder="bare", interval=k)  # torchtitan's
    parallel_dims = _parallel_dims(config, world_size)
    weights = _initial_weights(config)
    config.model_spec.model.update_from_config(config=config)
    batches = rank_batches(rank, world_size)
    never_stopped = _titan_run(config, parallel_dims, weights, batches, directory + "/ref")
    _titan_run(config, parallel_dims, weights, batches[:k], directory,
               save=(config.checkpoint, bare))
    resumed = _titan_run(config, parallel_dims, weights, batches[k:], directory,
                         load=config.checkpoint)
    with pytest.warns(UserWarning, match="holds no GeoFP8 state"):  # torchtitan's checkpoint
        no_state = _titan_run(config, parallel_dims, weights, batches[k:], directory,
                              load=dataclasses.replace(config.checkpoint, folder="bare"))
    return never_stopped, resumed, no_state, k


def test_resume_torchtitan_checkpointer_is_bitwise(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    for never_stopped, resumed, no_state, k in run_ranks(
            _torchtitan_resume_worker, 2, args=(str(tmp_path),), timeout=300):
        assert resumed[2] == never_stopped[2] == STEPS  # GeoFP8's step restored
        assert resumed[0] == never_stopped[0][k:]
        assert torch.equal(resumed[1], never_stopped[1])
        assert no_state[2] == STEPS - k and not torch.equal(no_state[1], never_stopped[1])
    keys = FileSystemReader(str(tmp_path / "ckpt" / f"step-{STEPS // 2}")).read_metadata()
    assert {k.split("/")[0] for k in keys.state_dict_metadata if k.startswith("geofp8.")} == {
        "geofp8.rank0", "geofp8.rank1"}


class _Dims:
    """The fields of torchtitan's ``ParallelDims`` the hook reads (no meshes needed)."""

    def __init__(self, **kw):
        from torchtitan.distributed import ParallelDims

        self.__dict__.update(dataclasses.asdict(ParallelDims(**{
            "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1, "pp": 1, "ep": 1,
            "world_size": 2, **kw})))


def test_refuses_unsharded_and_unsupported_parallelism():
    fn = tt_geofp8.post_optimizer_build_fn(CONFIG)
    with pytest.raises(RuntimeError, match="has no fully_shard-ed module"):
        fn(None, [nn.Linear(4, 4)], _Dims())
    with pytest.raises(RuntimeError, match="does not shard over data-parallel ranks"):
        fn(None, [nn.Linear(4, 4)], _Dims(dp_shard=1, world_size=1))
    with pytest.raises(RuntimeError, match=r"FSDP .* only.*dp_replicate=2"):
        fn(None, [nn.Linear(4, 4)], _Dims(dp_replicate=2, world_size=4))
    with pytest.raises(RuntimeError, match="tp=2"):
        fn(None, [nn.Linear(4, 4)], _Dims(tp=2, world_size=4))
    with pytest.raises(RuntimeError, match="full_dtensor SPMD backend"):
        fn(None, [nn.Linear(4, 4)], _Dims(spmd_backend="full_dtensor"))
    with pytest.raises(RuntimeError, match="not installed"):
        tt_geofp8.log([nn.Linear(4, 4)])


def test_wrong_torchtitan_version(monkeypatch):
    import torchtitan

    monkeypatch.setattr(torchtitan, "__version__", "0.2.0")
    try:
        with pytest.raises(ImportError, match=r"targets torchtitan 0\.3\.x, found 0\.2\.0"):
            importlib.reload(tt_geofp8)
    finally:
        monkeypatch.undo()
        importlib.reload(tt_geofp8)


def test_config_manager_switches_geofp8_on():
    """``--module geofp8.integrations.torchtitan --config <fn>``, as torchtitan.train parses it."""
    from torchtitan.config import ConfigManager

    config = ConfigManager().parse_args(
        ["--module", "geofp8.integrations.torchtitan", "--config", "llama3_debugmodel",
         "--training.steps", "3", "--parallelism.spmd_backend", "partial_dtensor"])
    assert config.training.steps == 3
    assert config.parallelism.spmd_backend == "partial_dtensor"
    fn = config.model_spec.post_optimizer_build_fn
    assert fn.geofp8_config is tt_geofp8.CONFIG
    assert config.model_spec.name == "llama3" and config.model_spec.flavor == "debugmodel"
    # any config function of torchtitan's registries, through the module's __getattr__
    assert tt_geofp8.llama3_8b().model_spec.post_optimizer_build_fn.geofp8_config is not None
    with pytest.raises(AttributeError):
        tt_geofp8.llama3_no_such_config  # noqa: B018
