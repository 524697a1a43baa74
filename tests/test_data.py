"""Corpus, cached BPE tokenizer, token blocks and step-indexed batches."""

import pytest
import torch

from geofp8.tools import data

TEXT_CHARS = 40_000


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GEOFP8_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def text():
    return data.default_text()[:TEXT_CHARS]


def test_default_corpus_is_deterministic_english_prose():
    a, b = data.default_text(), data.default_text()
    assert a == b
    assert len(a) > 400_000
    assert a.count(" the ") > 1000


def test_read_text_joins_files_in_order(tmp_path):
    (tmp_path / "a.txt").write_text("first file\n", encoding="utf-8")
    (tmp_path / "b.txt").write_text("second file\n", encoding="utf-8")
    joined = data.read_text([tmp_path / "a.txt", tmp_path / "b.txt"])
    assert joined == "first file\n\nsecond file"
    assert data.read_text(None) == data.default_text()


def test_bpe_is_cached_and_reused(cache, text, monkeypatch):
    tok = data.bpe_tokenizer(text, 400)
    files = list((cache / "tokenizers").glob("*.json"))
    assert len(files) == 1
    assert tok.get_vocab_size() == 400

    def no_training(*_args):
        raise AssertionError("the cached tokenizer should have been reused")

    monkeypatch.setattr(data, "_train_bpe", no_training)
    again = data.bpe_tokenizer(text, 400)
    assert again.encode(text[:2000]).ids == tok.encode(text[:2000]).ids
    with pytest.raises(AssertionError, match="reused"):
        data.bpe_tokenizer(text, 401)  # another vocabulary is another cache entry


def test_byte_level_bpe_round_trips_any_text(cache, text):
    tok = data.bpe_tokenizer(text, 300)
    sample = text[:3000] + "\nünïcödé — ✓ 漢字\n"
    ids = data.encode(tok, sample)
    assert ids.dtype == torch.long and int(ids.max()) < data.vocab_size_of(tok)
    assert tok.decode(ids.tolist()) == sample


def test_hugging_face_tokenizer_gives_the_same_ids(cache, text):
    from transformers import PreTrainedTokenizerFast

    tok = data.bpe_tokenizer(text, 300)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok)
    assert torch.equal(data.encode(hf, text[:5000]), data.encode(tok, text[:5000]))
    assert data.vocab_size_of(hf) == data.vocab_size_of(tok)


def test_blocks_cut_the_token_stream(cache, tmp_path, text):
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    td = data.load_token_data([path], seq_len=16, vocab_size=300, val_fraction=0.1)
    ids = data.encode(td.tokenizer, data.read_text([path]))
    n = ids.numel() // 17
    assert td.seq_len == 16 and td.vocab_size == 300
    assert td.train.shape[0] + td.val.shape[0] == n
    assert td.val.shape[0] == -(-n // 10)
    assert torch.equal(torch.cat([td.train, td.val]).reshape(-1), ids[: n * 17])
    with pytest.raises(ValueError, match="too short"):
        data.load_token_data([path], seq_len=len(ids), tokenizer=td.tokenizer)


def test_batches_by_step_and_rank():
    blocks = torch.arange(40 * 9).reshape(40, 9)
    x, y = data.get_batch(blocks, step=0, batch_size=4)
    assert x.shape == (4, 8) and torch.equal(x[:, 1:], y[:, :-1])
    # One epoch of 40 blocks = 5 steps × 2 ranks × 4 sequences: every block exactly once.
    seen = [data.get_batch(blocks, s, 4, rank=r, world_size=2)[0][:, 0]
            for s in range(5) for r in range(2)]
    assert sorted(torch.cat(seen).tolist()) == sorted(blocks[:, 0].tolist())
    # The next epoch is another permutation, and a run resumes from its step alone.
    assert not torch.equal(data.get_batch(blocks, 5, 4, 0, 2)[0], seen[0])
    it = data.iterate_batches(blocks, 4, start_step=3, rank=1, world_size=2)
    step, xi, _ = next(it)
    assert step == 3 and torch.equal(xi, data.get_batch(blocks, 3, 4, 1, 2)[0])
    assert not torch.equal(data.get_batch(blocks, 0, 4, seed=1)[0], x)
    with pytest.raises(ValueError):
        data.get_batch(blocks, 0, 4, rank=2, world_size=2)
