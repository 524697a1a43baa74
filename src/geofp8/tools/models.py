"""Models for the analysis and training tools: Llama presets, Hugging Face directories, GGUF.

A *preset* is a randomly initialised ``transformers.LlamaForCausalLM`` (seeded; weights
``N(0, 0.02²)``, untied embeddings, FP32, SDPA attention). Non-embedding parameters:

==============  ======  =====  ======  =====  ========  =========================
preset          hidden  inter  layers  heads  kv heads  non-embedding params
==============  ======  =====  ======  =====  ========  =========================
``llama-tiny``     128    352       4      4         2  ≈ 0.7 M (CPU, seconds)
``llama-small``    256    688       8      8         4  ≈ 5.8 M (CPU, minutes)
``llama-300m``    1024   2816      24     16        16  ≈ 308 M (GPU, paper scale)
``llama-600m``    1536   4096      22     16        16  ≈ 623 M (GPU, paper scale)
==============  ======  =====  ======  =====  ========  =========================

:func:`load_model` also takes a local Hugging Face model directory (with its tokenizer when
the directory has one) or a local ``.gguf`` file, quantized or not (F32, F16, BF16, Q8_0,
Q4_0, Q4_1, K-quants, ...; needs the ``gguf`` package: ``pip install 'geofp8[gguf]'``),
dequantized to FP32 at load so that it trains. :func:`load_model_and_data` pairs a model
with the token blocks of :mod:`geofp8.tools.data` (a preset gets a BPE of its vocabulary
size).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from .errors import UsageError

__all__ = ["PRESETS", "build_preset", "check_model_spec", "load_model", "load_model_and_data",
           "preset_config"]

PRESETS: dict[str, dict[str, int]] = {
    "llama-tiny": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=1024),
    "llama-small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=8,
                        num_attention_heads=8, num_key_value_heads=4,
                        max_position_embeddings=1024),
    "llama-300m": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24,
                       num_attention_heads=16, num_key_value_heads=16,
                       max_position_embeddings=4096),
    "llama-600m": dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=22,
                       num_attention_heads=16, num_key_value_heads=16,
                       max_position_embeddings=2048),
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def preset_config(name: str, vocab_size: int):
    """The ``LlamaConfig`` of a preset with the given vocabulary size."""
    from transformers import LlamaConfig

    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    return LlamaConfig(vocab_size=vocab_size, tie_word_embeddings=False,
                       attn_implementation="sdpa", **PRESETS[name])


def build_preset(name: str, vocab_size: int, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised preset; the same ``seed`` gives the same weights."""
    from transformers import LlamaForCausalLM

    config = preset_config(name, vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.float()


def check_model_spec(spec: str | os.PathLike) -> None:
    """Raise :class:`~geofp8.tools.errors.UsageError` unless ``spec`` is a preset, a
    directory with a ``config.json`` (a Hugging Face model) or an existing ``.gguf`` file."""
    spec = str(spec)
    path = Path(spec)
    if spec not in PRESETS and path.is_dir() and not (path / "config.json").is_file():
        raise UsageError(f"--model {spec}: the directory has no config.json (a Hugging Face "
                         "model directory, as save_pretrained writes it)")
    if spec in PRESETS or path.is_dir() or (path.suffix == ".gguf" and path.is_file()):
        return
    if path.suffix == ".gguf":
        raise UsageError(f"--model {spec}: GGUF file not found")
    raise UsageError(f"--model {spec!r} is neither a preset ({', '.join(PRESETS)}), "
                     "a Hugging Face model directory nor a .gguf file")


def load_model(spec: str | os.PathLike, vocab_size: int = 2048,
               seed: int = 0) -> tuple[torch.nn.Module, Any]:
    """``(model, tokenizer or None)`` for a preset name, a Hugging Face directory or a
    ``.gguf`` file; the model in FP32. ``vocab_size`` and ``seed`` apply to presets only."""
    check_model_spec(spec)
    spec = str(spec)
    if spec in PRESETS:
        return build_preset(spec, vocab_size, seed), None
    path = Path(spec)
    if path.suffix == ".gguf":
        return _load_gguf(path)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).float()
    tokenizer = None
    if any((path / f).exists() for f in _TOKENIZER_FILES):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def _load_gguf(path: Path) -> tuple[torch.nn.Module, Any]:
    """A GGUF model and its tokenizer. Quantized tensors are dequantized into FP32 weights
    as they are read: a quantized model cannot be cast afterwards (``.float()`` raises), and
    transformers ≥ 5 would otherwise keep the blocks packed in layers that do not train."""
    try:
        import gguf  # noqa: F401
    except ImportError as e:
        raise ImportError(f"loading {path.name} needs the 'gguf' package: "
                          "pip install 'geofp8[gguf]'") from e
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = dict(gguf_file=path.name)
    options = dict(kwargs, dtype=torch.float32)
    if hasattr(transformers, "GgufConfig"):  # transformers >= 5: packed unless told
        options["quantization_config"] = transformers.GgufConfig(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(path.parent, **options)
    return model, AutoTokenizer.from_pretrained(path.parent, **kwargs)


def load_model_and_data(spec: str | os.PathLike, paths=None, seq_len: int = 128,
                        vocab_size: int = 2048, seed: int = 0):
    """``(model, TokenData)``: a preset gets a BPE tokenizer of ``vocab_size`` trained on
    the corpus (and a vocabulary to match); a loaded model keeps its own tokenizer, or
    gets a BPE no larger than its vocabulary when it has none."""
    from .data import load_token_data

    if str(spec) in PRESETS:
        data = load_token_data(paths, seq_len, vocab_size=vocab_size)
        return build_preset(str(spec), data.vocab_size, seed), data
    model, tokenizer = load_model(spec)
    limit = int(model.config.vocab_size)
    data = load_token_data(paths, seq_len, tokenizer=tokenizer,
                           vocab_size=min(vocab_size, limit))
    if int(data.train.max()) >= limit:
        raise ValueError(f"the tokenizer produces id {int(data.train.max())} but the model has "
                         f"only {limit} embeddings")
    return model, data
