"""Text data for the analysis and training tools: corpus, tokenizer, token blocks, batches.

* **Corpus.** Local text files, or by default English prose that ships with the Python
  interpreter: the language-reference topics of :mod:`pydoc_data.topics` (≈465 kB),
  concatenated in sorted key order. Nothing is downloaded.
* **Tokenizer.** A model's own (any Hugging Face tokenizer), or a byte-level BPE trained
  locally with ``tokenizers`` and cached as JSON under ``$GEOFP8_CACHE`` (default
  ``~/.cache/geofp8``), keyed by a hash of the corpus and the vocabulary size.
* **Blocks.** The token stream is cut into non-overlapping blocks of ``seq_len + 1`` tokens
  (inputs ``block[:-1]``, next-token targets ``block[1:]``); the last ``val_fraction`` of
  the blocks is the validation split.
* **Batches by step.** Step ``s`` of a run with ``world_size`` ranks and ``batch_size``
  sequences per rank reads positions ``p = (s·world_size + rank)·batch_size + i`` of an
  endless stream that visits every block once per epoch in a seeded permutation (epoch
  ``e = p // n_blocks`` uses seed ``seed + e``). A resumed run only needs its step.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import UsageError

__all__ = [
    "TokenData",
    "bpe_tokenizer",
    "cache_dir",
    "default_text",
    "encode",
    "get_batch",
    "iterate_batches",
    "load_token_data",
    "read_text",
    "vocab_size_of",
]

DEFAULT_VOCAB = 2048
SPECIAL_TOKENS = ["<|endoftext|>"]
_CHUNK_CHARS = 1 << 14  # tokenize in newline-aligned chunks (HF tokenizers warn on long inputs)


def default_text() -> str:
    """The Python language-reference topics that ship with the interpreter, in key order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key].strip() for key in sorted(topics))


def read_text(paths: Sequence[str | os.PathLike] | None = None) -> str:
    """The text of ``paths`` (UTF-8) joined by blank lines, or :func:`default_text`."""
    if not paths:
        return default_text()
    return "\n\n".join(Path(p).read_text(encoding="utf-8").strip() for p in paths)


def cache_dir() -> Path:
    """``$GEOFP8_CACHE`` or ``~/.cache/geofp8``."""
    return Path(os.environ.get("GEOFP8_CACHE") or Path.home() / ".cache" / "geofp8")


def _train_bpe(text: str, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_chunks(text), trainer=trainer)
    return tok


def bpe_tokenizer(text: str, vocab_size: int = DEFAULT_VOCAB):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``text``, loaded from the cache
    when one was trained before on the same text and vocabulary size."""
    from tokenizers import Tokenizer, __version__

    key = hashlib.sha256(f"{vocab_size}\0{__version__}\0{text}".encode()).hexdigest()[:20]
    path = cache_dir() / "tokenizers" / f"bpe-{vocab_size}-{key}.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    tok = _train_bpe(text, vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tok.save(str(tmp))
    os.replace(tmp, path)  # atomic: concurrent runs never read half a file
    return tok


def _chunks(text: str) -> list[str]:
    """``text`` cut at line ends into pieces of about ``_CHUNK_CHARS`` characters."""
    out, start = [], 0
    while start < len(text):
        end = text.find("\n", start + _CHUNK_CHARS)
        end = len(text) if end < 0 else end + 1
        out.append(text[start:end])
        start = end
    return out


def encode(tokenizer: Any, text: str) -> torch.Tensor:
    """Token ids (int64) of ``text`` with a ``tokenizers.Tokenizer`` or a Hugging Face
    tokenizer, without special tokens."""
    pieces = _chunks(text)
    if hasattr(tokenizer, "encode_batch"):  # tokenizers.Tokenizer
        ids = [e.ids for e in tokenizer.encode_batch(pieces, add_special_tokens=False)]
    else:  # transformers.PreTrainedTokenizerBase
        ids = tokenizer(pieces, add_special_tokens=False)["input_ids"]
    return torch.tensor([t for seq in ids for t in seq], dtype=torch.long)


def vocab_size_of(tokenizer: Any) -> int:
    """Number of ids the tokenizer can produce (special and added tokens included)."""
    if hasattr(tokenizer, "get_vocab_size"):
        return int(tokenizer.get_vocab_size(with_added_tokens=True))
    return len(tokenizer)


@dataclass
class TokenData:
    """Token blocks (``n × (seq_len + 1)``, int64) and the tokenizer that made them."""

    train: torch.Tensor
    val: torch.Tensor
    tokenizer: Any
    vocab_size: int

    @property
    def seq_len(self) -> int:
        return self.train.shape[1] - 1


def load_token_data(paths: Sequence[str | os.PathLike] | None = None, seq_len: int = 128,
                    tokenizer: Any = None, vocab_size: int = DEFAULT_VOCAB,
                    val_fraction: float = 0.05, text: str | None = None) -> TokenData:
    """Tokenize the corpus once and cut it into train / validation blocks.

    Without ``tokenizer`` a byte-level BPE of ``vocab_size`` is trained (or read from the
    cache). The validation split is the last ``ceil(val_fraction · n)`` blocks. ``text``,
    when given, is the corpus itself (``paths`` is then ignored).
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if text is None:
        text = read_text(paths)
    if tokenizer is None:
        tokenizer = bpe_tokenizer(text, vocab_size)
    ids = encode(tokenizer, text)
    n = ids.numel() // (seq_len + 1)
    n_val = math.ceil(val_fraction * n)
    if n - n_val < 1:
        raise UsageError(f"the corpus ({ids.numel()} tokens) is too short for one training "
                         f"block of {seq_len + 1} tokens (--seq-len {seq_len}) with a "
                         f"{val_fraction:.0%} validation split: give a longer text or a "
                         "shorter --seq-len")
    blocks = ids[: n * (seq_len + 1)].view(n, seq_len + 1)
    return TokenData(blocks[: n - n_val], blocks[n - n_val :], tokenizer,
                     vocab_size_of(tokenizer))


def get_batch(blocks: torch.Tensor, step: int, batch_size: int, rank: int = 0,
              world_size: int = 1, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)`` (each ``batch_size × seq_len``) of ``rank`` at ``step``."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size})")
    n = blocks.shape[0]
    first = (step * world_size + rank) * batch_size
    rows, perms = [], {}
    for p in range(first, first + batch_size):
        epoch, i = divmod(p, n)
        if epoch not in perms:
            gen = torch.Generator().manual_seed(seed + epoch)
            perms[epoch] = torch.randperm(n, generator=gen)
        rows.append(perms[epoch][i])
    batch = blocks[torch.stack(rows)]
    return batch[:, :-1], batch[:, 1:]


def iterate_batches(blocks: torch.Tensor, batch_size: int, start_step: int = 0, rank: int = 0,
                    world_size: int = 1, seed: int = 0,
                    ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Endless ``(step, inputs, targets)`` from ``start_step`` on (see :func:`get_batch`)."""
    step = start_step
    while True:
        yield (step, *get_batch(blocks, step, batch_size, rank, world_size, seed))
        step += 1
