"""Llama presets, Hugging Face directories and GGUF files."""

import sys

import pytest
import torch

from geofp8.tools import data, models
from geofp8.tools.errors import UsageError


def test_preset_is_seeded_and_runs():
    a = models.build_preset("llama-tiny", vocab_size=300, seed=3)
    b = models.build_preset("llama-tiny", vocab_size=300, seed=3)
    c = models.build_preset("llama-tiny", vocab_size=300, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["lm_head.weight"], sc["lm_head.weight"])
    logits = a(input_ids=torch.randint(0, 300, (2, 16))).logits
    assert logits.shape == (2, 16, 300) and logits.dtype == torch.float32
    assert a.config.hidden_size == 128 and a.config.num_key_value_heads == 2


@pytest.mark.parametrize("name, lo, hi", [
    ("llama-tiny", 0.5e6, 1e6), ("llama-small", 4e6, 8e6),
    ("llama-300m", 250e6, 350e6), ("llama-600m", 550e6, 700e6)])
def test_preset_sizes(name, lo, hi):
    from transformers import LlamaForCausalLM

    with torch.device("meta"):  # shapes only, no memory
        model = LlamaForCausalLM(models.preset_config(name, vocab_size=1000))
    embeddings = 2 * 1000 * model.config.hidden_size
    assert lo < sum(p.numel() for p in model.parameters()) - embeddings < hi


def test_unknown_spec_names_the_choices(tmp_path):
    with pytest.raises(UsageError, match="llama-tiny"):
        models.load_model(str(tmp_path / "nothing-here"))
    with pytest.raises(ValueError, match="unknown preset"):
        models.preset_config("llama-huge", 100)


def test_hugging_face_directory_round_trip(tmp_path, monkeypatch):
    from transformers import PreTrainedTokenizerFast

    monkeypatch.setenv("GEOFP8_CACHE", str(tmp_path / "cache"))
    model = models.build_preset("llama-tiny", vocab_size=300, seed=1)
    model.save_pretrained(tmp_path / "m")
    loaded, tokenizer = models.load_model(tmp_path / "m")
    assert tokenizer is None
    ref = model.state_dict()
    assert all(torch.equal(ref[k], v) for k, v in loaded.state_dict().items())
    ids = torch.randint(0, 300, (1, 12))
    assert torch.allclose(loaded(input_ids=ids).logits, model(input_ids=ids).logits)

    bpe = data.bpe_tokenizer(data.default_text()[:20_000], 300)
    PreTrainedTokenizerFast(tokenizer_object=bpe).save_pretrained(tmp_path / "m")
    _, tokenizer = models.load_model(tmp_path / "m")
    assert tokenizer("def f(): pass")["input_ids"] == bpe.encode("def f(): pass").ids

    # Without a tokenizer of its own, the model gets a BPE within its vocabulary.
    (tmp_path / "m" / "tokenizer.json").unlink()
    (tmp_path / "m" / "tokenizer_config.json").unlink()
    model2, td = models.load_model_and_data(tmp_path / "m", seq_len=32, vocab_size=4096)
    assert td.vocab_size <= model2.config.vocab_size == 300


def test_preset_with_data_matches_vocabulary(tmp_path, monkeypatch):
    monkeypatch.setenv("GEOFP8_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "c.txt"
    corpus.write_text(data.default_text()[:20_000], encoding="utf-8")
    model, td = models.load_model_and_data("llama-tiny", [corpus], seq_len=32, vocab_size=350)
    assert model.config.vocab_size == td.vocab_size == 350
    assert td.train.shape[1] == 33


def test_gguf_without_the_package_says_what_to_install(tmp_path, monkeypatch):
    path = tmp_path / "model.gguf"
    with pytest.raises(UsageError, match="model.gguf: GGUF file not found"):
        models.load_model(path)
    path.write_bytes(b"GGUF")
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf now raises ImportError
    with pytest.raises(ImportError, match=r"geofp8\[gguf\]"):
        models.load_model(path)
