"""Shared pieces of the framework-integration tests: a tiny Llama, byte-level text batches,
and the raw DDP loop every framework run is compared against."""

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from geofp8 import GeoFP8Config, GeoFP8State, geofp8_hook

VOCAB, SEQ, BATCH, STEPS, LR = 256, 32, 4, 8, 3e-3
# small layers take the geometry branch too, refreshed often enough to matter in 8 steps
CONFIG = GeoFP8Config(k=4, min_dim=16, refresh_every=2, layers="all")


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=SEQ, tie_word_embeddings=False,
                         attn_implementation="eager", use_cache=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float()


def rank_batches(rank: int, world_size: int, steps: int = STEPS) -> list[torch.Tensor]:
    """This rank's token batches (``BATCH × SEQ`` bytes of local English text) for each step."""
    from geofp8.tools.data import default_text

    data = torch.frombuffer(bytearray(default_text()[:200_000].encode()), dtype=torch.uint8)
    blocks = data[: (len(data) // SEQ) * SEQ].long().view(-1, SEQ)
    return [blocks[(s * world_size + rank) * BATCH:(s * world_size + rank + 1) * BATCH]
            for s in range(steps)]


def flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def raw_ddp(rank: int, world_size: int, batches: list[torch.Tensor] | None = None):
    """The reference: a plain DDP loop with the GeoFP8 hook, AdamW (no weight decay), on
    ``batches`` (default: :func:`rank_batches`)."""
    model = DDP(tiny_llama())
    state = GeoFP8State(model.module, CONFIG)
    model.register_comm_hook(state, geofp8_hook)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for tokens in batches if batches is not None else rank_batches(rank, world_size):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, flat_params(model.module), state.stats()


def shard_llama(model, mesh=None):
    """FSDP2 as the frameworks apply it here: each decoder layer, then ``model`` (the root)."""
    from torch.distributed.fsdp import fully_shard

    kw = {"mesh": mesh} if mesh is not None else {}
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def full_params(model) -> torch.Tensor:
    """All parameters of a ``fully_shard``-ed model, all-gathered (a collective)."""
    return torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])


def raw_fsdp(rank: int, world_size: int):
    """The FSDP2 reference: ``fully_shard`` + :func:`geofp8.fsdp.enable`, AdamW (no weight
    decay), on :func:`rank_batches`."""
    from geofp8 import fsdp

    model = shard_llama(tiny_llama())
    state = fsdp.enable(model, CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for tokens in rank_batches(rank, world_size):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, full_params(model), state.stats()


class WrappedLlama(torch.nn.Module):
    """The tiny Llama under a plain module: Accelerate's FSDP2 then leaves embedding, final
    norm and head in the root unit (as :func:`shard_llama`) instead of carving them out."""

    def __init__(self):
        super().__init__()
        self.llama = tiny_llama()

    def forward(self, **batch):
        return self.llama(**batch)


def accelerate_fsdp2():
    """An ``Accelerator`` that prepares FSDP2 (each ``LlamaDecoderLayer`` a unit) on CPU/gloo,
    and the distributed type Accelerate built before being forced to FSDP: Accelerate 1.16
    picks FSDP only for accelerator device types (state.py)."""
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    built = accelerator.distributed_type
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    return accelerator, built
