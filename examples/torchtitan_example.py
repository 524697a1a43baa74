"""torchtitan 0.3 + GeoFP8 on CPU: the model path of torchtitan's Trainer, our own loop.

    torchrun --nproc_per_node 2 examples/torchtitan_example.py [--steps 40]

On GPUs the whole job is one command (torchtitan's Trainer, its data and tokenizer)::

    torchrun --nproc_per_node 8 -m torchtitan.train \\
        --module geofp8.integrations.torchtitan --config llama3_8b

torchtitan's Trainer needs CUDA (``torch.cuda.set_device``), so on CPU this script does what
``Trainer.__init__`` does with the model: ``ParallelDims`` meshes, the spec's
``parallelize_fn`` (``fully_shard``), ``init_weights``, the optimizers, then the spec's
``post_optimizer_build_fn`` — GeoFP8's, from ``geofp8.integrations.torchtitan.wrap_config`` — and
trains a small llama3 (4 layers, width 128, bytes as tokens) on local English text.
CPU deviations: meshes on "cpu", SDPA attention (FlexAttention has no backward on CPU), the
``partial_dtensor`` SPMD backend, FP32 parameters.
"""

import argparse
import dataclasses
import os

import torch
import torch.distributed as dist
from tiny_lm import CONFIG, text_blocks
from torch import nn

from geofp8.integrations import torchtitan as geofp8
from geofp8.tools.train.launch import end_process_group

SEQ, BATCH, LR = 128, 8, 1e-3


def small_llama3(dim: int = 128, heads: int = 4, n_layers: int = 4, vocab: int = 256):
    """A llama3 config from torchtitan's own builders, small enough for CPU."""
    from torchtitan.models import llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention

    layers = llama3._build_llama3_layers(
        n_layers=n_layers, dim=dim, n_heads=heads, hidden_dim=3 * dim, attn_backend="flex",
        rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=SEQ, theta=500000,
                                scaling="llama"))
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return llama3.Llama3Model.Config(
        dim=dim, vocab_size=vocab, layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab,
                              param_init=llama3._output_linear_init(dim)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    steps = parser.parse_args().steps
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    import torchtitan.distributed.parallel_dims as pd_module
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    # torchtitan's debug config with GeoFP8 on (what --config llama3_debugmodel of
    # geofp8.integrations.torchtitan gives, here with CONFIG: refresh every 10 steps)
    config = geofp8.wrap_config(llama3_debugmodel, CONFIG)()
    spec = config.model_spec = dataclasses.replace(config.model_spec, model=small_llama3())
    config.training.seq_len = SEQ
    config.training.mixed_precision_param = "float32"
    config.activation_checkpoint = None
    config.parallelism.spmd_backend = "partial_dtensor"
    config.optimizer = default_adamw(lr=LR, weight_decay=0.0)

    pd_module.device_type = "cpu"  # torchtitan assumes "cuda" when it finds no accelerator
    dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
    parallel_dims = ParallelDims.from_config(config.parallelism, world)
    parallel_dims.build_mesh()
    spec.model.update_from_config(config=config)
    with torch.device("meta"):
        model = spec.model.build()
    model = spec.parallelize_fn(model, parallel_dims=parallel_dims, training=config.training,
                                parallelism=config.parallelism, compile_config=config.compile,
                                ac_config=None, dump_folder=config.dump_folder)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    optimizers = config.optimizer.build(model_parts=[model])
    spec.post_optimizer_build_fn(optimizers, [model], parallel_dims)  # GeoFP8 switched on

    blocks = text_blocks(SEQ + 1)
    g = torch.Generator().manual_seed(rank)
    totals = {}
    for step in range(steps):
        tokens = blocks[torch.randint(len(blocks), (BATCH,), generator=g)]
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                           tokens[:, 1:].reshape(-1))
        (loss / world).backward()  # FSDP's division is off in torchtitan; the loss does it
        optimizers.step()
        optimizers.zero_grad()
        figures = geofp8.log([model], step, totals)  # torchtitan's logger
        if rank == 0 and (step % 10 == 0 or step == steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}  GeoFP8 "
                  f"{figures['geofp8/bytes_per_element']:.3f} B/element this step, "
                  f"{figures['geofp8/run_bytes_per_element']:.3f} over the run "
                  f"(FP32 reduce-scatter: {4 * (world - 1) / world:.1f}), "
                  f"{figures['geofp8/geometry_layers']:.0f} geometry layers", flush=True)
    end_process_group(completed=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
