"""What the three framework examples share: a small Llama built locally (no download) and
byte-level blocks of local English text (the Python language reference that ships with
the interpreter)."""

import torch

from geofp8 import GeoFP8Config
from geofp8.tools.data import default_text

SEQ = 128
# refresh (and re-select geometry layers) every 10 steps, so a short run shows it working
CONFIG = GeoFP8Config(layers="auto", refresh_every=10)


def tiny_llama(seed: int = 0):
    """≈ 1 M parameters: 4 layers, width 128, MLP 384, byte vocabulary (256)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=384,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=SEQ, tie_word_embeddings=False)
    torch.manual_seed(seed)  # the same initial weights on every rank
    return LlamaForCausalLM(config)


def text_blocks(seq: int = SEQ) -> torch.Tensor:
    """The corpus as UTF-8 bytes, cut into ``(n, seq)`` blocks of token ids."""
    data = torch.frombuffer(bytearray(default_text().encode()), dtype=torch.uint8).long()
    return data[: len(data) // seq * seq].view(-1, seq)
