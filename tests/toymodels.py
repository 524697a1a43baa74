"""Small models for the hook tests: cheap to build in every spawned process."""

import torch
from torch import nn


class TinyTransformerLM(nn.Module):
    """Embedding, two pre-norm blocks (attention-free token mixing + MLP), tied-free head.

    Its MLP inputs are anisotropic (outputs of GELU on low-rank mixtures), like a real LM's.
    """

    def __init__(self, vocab: int = 64, d: int = 48, hidden: int = 96, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(nn.ModuleDict({
                "norm": nn.LayerNorm(d),
                "mix": nn.Linear(d, d),
                "up": nn.Linear(d, hidden),
                "down": nn.Linear(hidden, d, bias=False),
            }))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        for b in self.blocks:
            x = b["norm"](h)
            h = h + b["mix"](x.cumsum(1) / torch.arange(1, x.shape[1] + 1).view(1, -1, 1))
            h = h + b["down"](torch.nn.functional.gelu(b["up"](b["norm"](h))))
        return self.head(h)


def make_model(seed: int = 0, **kw) -> TinyTransformerLM:
    torch.manual_seed(seed)
    return TinyTransformerLM(**kw)


def batch(step: int, rank: int, batch_size: int = 4, seq: int = 16, vocab: int = 64):
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, vocab, (batch_size, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(model, step, rank, vocab: int = 64):
    x, y = batch(step, rank, vocab=vocab)
    logits = model(x)
    return nn.functional.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))
