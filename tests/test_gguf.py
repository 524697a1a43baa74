"""GGUF files as llama.cpp writes them (quantized tensors, BPE vocabulary in the metadata),
loaded, measured with ``geofp8 fidelity`` and trained with ``geofp8 train``.

The files are written here with the ``gguf`` package's writer and quantizers from a tiny
random Llama, the way ``convert_hf_to_gguf.py`` converts one: llama.* hyperparameters,
tokenizer.ggml.* (a "gpt2" byte-level BPE), Q/K rows permuted to llama.cpp's rotary layout,
norms in F32.
"""

import json
import math

import numpy as np
import pytest
import torch

from geofp8.tools import cli, data, models
from geofp8.tools.train.report import read_log

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
VOCAB = 320
RUN_TIMEOUT = 120

# HF parameter suffix -> GGUF tensor name (per block), as llama.cpp names them
BLOCK = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
         "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
# a mixed file like a real "Q4_1" conversion: norms F32, embeddings F16, the rest quantized
MIXED = {"token_embd": Q.F16, "attn_q": Q.Q4_0, "attn_k": Q.Q4_0, "attn_v": Q.Q4_1,
         "attn_output": Q.Q8_0, "ffn_gate": Q.Q4_1, "ffn_up": Q.Q4_1, "ffn_down": Q.Q8_0,
         "output": Q.Q8_0}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order: halves of each head's rotary pairs interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def _tensors(model) -> dict[str, tuple[str, np.ndarray]]:
    """GGUF name -> (HF name, weight as llama.cpp stores it)."""
    cfg = model.config
    out = {"token_embd.weight": ("model.embed_tokens.weight", None),
           "output_norm.weight": ("model.norm.weight", None),
           "output.weight": ("lm_head.weight", None)}
    for i in range(cfg.num_hidden_layers):
        for hf, name in BLOCK.items():
            out[f"blk.{i}.{name}.weight"] = (f"model.layers.{i}.{hf}.weight", None)
    state = model.state_dict()
    for key, (hf, _) in out.items():
        w = state[hf].numpy()
        if ".attn_q." in key:
            w = _permute(w, cfg.num_attention_heads)
        elif ".attn_k." in key:
            w = _permute(w, cfg.num_key_value_heads)
        out[key] = (hf, w)
    return out


def _kind(gguf_name: str) -> str:
    return gguf_name.split(".")[-2]


def _encode(weight: np.ndarray, qtype) -> tuple[np.ndarray, np.ndarray]:
    """(what the file stores, what it decodes to in FP32)."""
    weight = weight.astype(np.float32)
    if qtype == Q.F32:
        return weight, weight
    if qtype == Q.F16:
        return weight.astype(np.float16), weight.astype(np.float16).astype(np.float32)
    stored = gguf.quants.quantize(weight, qtype)
    return stored, gguf.quants.dequantize(stored, qtype).astype(np.float32)


def write_llama_gguf(path, model, bpe, types: dict) -> dict[str, torch.Tensor]:
    """Write ``model`` (a preset Llama) and ``bpe`` as a llama.cpp GGUF with ``types``
    (tensor kind -> GGML type; norms are F32); return the weights a reader must get back
    (HF name -> dequantized tensor, in HF layout)."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("geofp8 test llama")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_vocab_size(cfg.vocab_size)
    vocab = bpe.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = [" ".join(m) if isinstance(m, list) else m
              for m in json.loads(bpe.to_str())["model"]["merges"]]
    special = set(data.SPECIAL_TOKENS)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL
                       for t in tokens])
    w.add_token_merges(merges)
    eos = vocab[data.SPECIAL_TOKENS[0]]
    w.add_bos_token_id(eos)
    w.add_eos_token_id(eos)
    expected, state = {}, model.state_dict()
    for name, (hf, weight) in _tensors(model).items():
        qtype = types.get(_kind(name), Q.F32) if weight.ndim == 2 else Q.F32
        stored, _ = _encode(weight, qtype)
        w.add_tensor(name, stored, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
        # quantization blocks run along rows, so the Q/K row permutation commutes with it:
        # the reader, undoing the permutation, must return this
        expected[hf] = torch.from_numpy(_encode(state[hf].numpy(), qtype)[1])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text(data.default_text()[:40_000], encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tiny(corpus, tmp_path_factory):
    """A preset Llama and a BPE of its vocabulary, trained on the test corpus."""
    bpe = data._train_bpe(corpus.read_text(encoding="utf-8"), VOCAB)
    return models.build_preset("llama-tiny", vocab_size=bpe.get_vocab_size(), seed=5), bpe


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_quantized_gguf_loads_dequantized_in_fp32(tiny, tmp_path, qtype):
    model, bpe = tiny
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    expected = write_llama_gguf(path, model, bpe, {k: qtype for k in MIXED})
    loaded, tokenizer = models.load_model(path)
    state = loaded.state_dict()
    assert set(state) == set(expected)
    for name, want in expected.items():
        assert state[name].dtype == torch.float32, name
        assert torch.equal(state[name], want), name
    q = "model.layers.0.self_attn.q_proj.weight"  # undone permutation, quantization error only
    ref = model.state_dict()[q]
    err = float((state[q] - ref).norm() / ref.norm())
    assert err < {Q.F16: 1e-3, Q.Q8_0: 1e-2, Q.Q4_0: 0.2, Q.Q4_1: 0.2}[qtype]
    assert all(p.requires_grad for p in loaded.parameters())
    ids = torch.tensor([tokenizer("def f(x): return x")["input_ids"]])
    assert ids.tolist()[0] == bpe.encode("def f(x): return x").ids
    logits = loaded(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()
    loaded(input_ids=ids).logits.sum().backward()
    assert loaded.model.layers[0].mlp.down_proj.weight.grad is not None


@pytest.fixture(scope="module")
def mixed_file(tiny, tmp_path_factory):
    model, bpe = tiny
    path = tmp_path_factory.mktemp("gguf") / "tiny-q4_1.gguf"
    write_llama_gguf(path, model, bpe, MIXED)
    return path


def test_fidelity_command_on_a_quantized_gguf(mixed_file, corpus, tmp_path, capsys):
    out = tmp_path / "fid.json"
    assert cli.main(["fidelity", "--model", str(mixed_file), "--data", str(corpus),
                     "--seq-len", "32", "--batch-size", "4", "--formats", "e4m3",
                     "--transforms", "euclidean,lowrank", "--ranks-k", "8",
                     "--table", "summary", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    layers = report["layers"]
    assert any("down_proj" in n for n in layers) and len(layers) == 4 * 7 + 1  # + lm_head
    for stats in report["summary"].values():
        assert 0 < stats["rel_l2_mean"] < 1


@pytest.mark.distributed
@pytest.mark.slow
def test_train_command_on_a_quantized_gguf(mixed_file, corpus, tmp_path):
    out = tmp_path / "run"
    assert cli.main(["train", "--nproc", "2", "--model", str(mixed_file), "--data",
                     str(corpus), "--seq-len", "32", "--batch-size", "2", "--steps", "3",
                     "--warmup", "1", "--eval-every", "3", "--eval-batches", "1",
                     "--method", "fp8-ef", "--timeout-s", str(RUN_TIMEOUT), "--quiet",
                     "--out", str(out)]) == 0
    records = read_log(out / "log.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(math.isfinite(r["loss"]) for r in records)
    # random weights on the file's own vocabulary: about chance, ln(vocabulary)
    assert abs(records[0]["loss"] - math.log(VOCAB)) < 1 and math.isfinite(records[-1]["val_loss"])
    info = json.loads((out / "run.json").read_text())
    assert info["config"]["model"] == str(mixed_file) and info["world_size"] == 2
