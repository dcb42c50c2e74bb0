"""The data pipeline (trainer/data.py): tokenizers, documents, token streams and the loader; fast, single process."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from trainer.data import ByteTokenizer, DataLoader, TokenStream, load_documents, load_tokenizer


# ---------------------------------------------------------------------------------------------------
# Tokenizers and documents


def test_byte_tokenizer_round_trip():
    tok = load_tokenizer(None)
    text = "Grüße, 世界! tabs\tand\nnewlines"
    ids = tok.encode(text)
    assert ids[0] == 256 and ids[-1] == 257 and tok.vocab_size == 258
    assert tok.decode(ids) == text
    assert tok.encode(text, bos=False, eos=False) == list(text.encode())
    assert tok.decode([0xE4, 0xB8]) == "\ufffd"  # broken UTF-8 is replaced, not raised


def test_hf_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<s>": 0, "</s>": 1, "[UNK]": 2, "hello": 3, "world": 4}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = load_tokenizer(str(tmp_path))
    assert hf.vocab_size == 5 and hf.encode("hello world") == [0, 3, 4, 1]
    assert hf.decode(hf.encode("hello world")) == "hello world"


def test_hf_tokenizer_missing_file(tmp_path):
    pytest.importorskip("tokenizers")
    with pytest.raises(FileNotFoundError):
        load_tokenizer(str(tmp_path / "absent.json"))


def test_shipped_corpus():
    docs = load_documents("shipped")
    size = sum(len(d.encode()) for d in docs)
    assert len(docs) > 500 and 300_000 < size < 1_000_000
    assert all(d.strip() == d and d for d in docs)


def test_load_documents_txt_jsonl_and_folder(tmp_path):
    (tmp_path / "b.txt").write_text("first doc\nstill first\n\n\nsecond doc\n", encoding="utf-8")
    (tmp_path / "a.jsonl").write_text(
        json.dumps({"text": "json one"}) + "\n\n" + json.dumps({"text": "json two", "id": 7}) + "\n"
    )
    (tmp_path / "ignored.md").write_text("not data")
    assert load_documents(str(tmp_path / "b.txt")) == ["first doc\nstill first", "second doc"]
    assert load_documents(str(tmp_path)) == ["json one", "json two", "first doc\nstill first", "second doc"]
    (tmp_path / "bad.jsonl").write_text('{"title": "x"}\n')
    with pytest.raises(ValueError, match="text"):
        load_documents(str(tmp_path / "bad.jsonl"))
    with pytest.raises(FileNotFoundError):
        load_documents(str(tmp_path / "missing"))


def test_token_stream():
    stream = TokenStream(["ab", "c"], ByteTokenizer())
    assert stream.tokens.dtype == np.int32
    assert stream.tokens.tolist() == [256, 97, 98, 257, 256, 99, 257] and len(stream) == 7


# ---------------------------------------------------------------------------------------------------
# Loader


def batches(loader: DataLoader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [loader.next_batch() for _ in range(n)]


def test_loader_batch_shapes_and_labels(shipped_tokens):
    loader = DataLoader(shipped_tokens, seq_len=32, global_batch=4, dp_rank=0, dp_degree=1, seed=0)
    x, y = loader.next_batch()
    assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.long
    torch.testing.assert_close(x[:, 1:], y[:, :-1])


def test_loader_union_of_ranks_equals_single_rank(shipped_tokens):
    single = DataLoader(shipped_tokens, 16, 8, 0, 1, seed=5)
    ranks = [DataLoader(shipped_tokens, 16, 8, r, 2, seed=5) for r in range(2)]
    for _ in range(3):
        x, y = single.next_batch()
        parts = [rank.next_batch() for rank in ranks]
        assert torch.equal(torch.cat([p[0] for p in parts]), x)
        assert torch.equal(torch.cat([p[1] for p in parts]), y)


def test_loader_resume_continues_identically(shipped_tokens):
    straight = DataLoader(shipped_tokens, 16, 4, 0, 1, seed=1)
    expected = batches(straight, 6)
    first = DataLoader(shipped_tokens, 16, 4, 0, 1, seed=1)
    batches(first, 3)
    state = json.loads(json.dumps(first.state_dict()))  # plain ints, JSON-friendly
    assert state == {"position": 12, "seed": 1, "seq_len": 16, "num_tokens": len(shipped_tokens)}
    resumed = DataLoader(shipped_tokens, 16, 4, 0, 1, seed=999)  # the seed comes from the state
    resumed.load_state_dict(state)
    for (x, y), (ex, ey) in zip(batches(resumed, 3), expected[3:]):
        assert torch.equal(x, ex) and torch.equal(y, ey)


def test_loader_resume_with_other_dp_degree(shipped_tokens):
    straight = DataLoader(shipped_tokens, 16, 8, 0, 1, seed=2)
    expected = batches(straight, 5)
    ranks = [DataLoader(shipped_tokens, 16, 8, r, 2, seed=2) for r in range(2)]
    for rank in ranks:
        batches(rank, 2)
    assert ranks[0].state_dict() == ranks[1].state_dict()
    resumed = DataLoader(shipped_tokens, 16, 8, 0, 1, seed=2)
    resumed.load_state_dict(ranks[1].state_dict())
    for (x, _), (ex, _) in zip(batches(resumed, 3), expected[2:]):
        assert torch.equal(x, ex)
    # ... and 1 -> 4 ranks.
    quarter = DataLoader(shipped_tokens, 16, 8, 3, 4, seed=2)
    quarter.load_state_dict(resumed.state_dict())
    assert torch.equal(quarter.next_batch()[0], batches(straight, 1)[0][0][6:8])


def test_loader_validates(shipped_tokens):
    with pytest.raises(ValueError, match="divisible"):
        DataLoader(shipped_tokens, 16, 6, 0, 4, seed=0)
    with pytest.raises(ValueError, match="window"):
        DataLoader(np.arange(10, dtype=np.int32), 16, 2, 0, 1, seed=0)
    loader = DataLoader(shipped_tokens, 16, 4, 0, 1, seed=0)
    state = loader.state_dict()
    with pytest.raises(ValueError, match="seq_len"):
        DataLoader(shipped_tokens, 32, 4, 0, 1, seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="num_tokens"):
        DataLoader(shipped_tokens[:-1], 16, 4, 0, 1, seed=0).load_state_dict(state)


def test_loader_epochs_wrap_in_new_orders():
    tokens = np.arange(50, dtype=np.int32)  # 5 windows of 10 tokens (seq_len 9)
    loader = DataLoader(tokens, seq_len=9, global_batch=5, dp_rank=0, dp_degree=1, seed=0)
    epochs = [loader.next_batch()[0][:, 0].tolist() for _ in range(4)]
    for firsts in epochs:
        assert sorted(firsts) == [0, 10, 20, 30, 40]  # every window exactly once per epoch
    assert len({tuple(e) for e in epochs}) > 1  # each epoch has its own order
    odd = DataLoader(tokens, seq_len=9, global_batch=3, dp_rank=0, dp_degree=1, seed=0)
    firsts = [v for _ in range(5) for v in odd.next_batch()[0][:, 0].tolist()]
    assert firsts == [v for e in epochs[:3] for v in e]  # batches straddle epoch boundaries
