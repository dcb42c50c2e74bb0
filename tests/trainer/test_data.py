"""The llama model (trainer/model.py) and the data pipeline (trainer/data.py): fast, single process."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trainer import model
from trainer.data import ByteTokenizer, DataLoader, TokenStream, load_documents, load_tokenizer
from trainer.model import FLAVORS, ModelArgs, build, flops_per_token, model_args, num_params


@pytest.fixture(scope="module")
def shipped_tokens() -> np.ndarray:
    return TokenStream(load_documents("shipped"), ByteTokenizer()).tokens


def debug_model(seed: int = 0, **overrides) -> model.Transformer:
    torch.manual_seed(seed)
    return build(model_args("debug", **overrides))


# ---------------------------------------------------------------------------------------------------
# Model


def test_debug_forward_shapes():
    m = debug_model()
    tokens = torch.randint(0, 258, (3, 17))
    assert m(tokens).shape == (3, 17, 258)
    assert m.args.vocab_size == ByteTokenizer.vocab_size


def test_causal():
    m = debug_model()
    tokens = torch.randint(0, 258, (2, 24))
    changed = tokens.clone()
    changed[:, 15] = (changed[:, 15] + 1) % 258
    a, b = m(tokens), m(changed)
    torch.testing.assert_close(a[:, :15], b[:, :15])
    assert not torch.allclose(a[:, 15:], b[:, 15:])


def test_gqa_shapes_and_repeat():
    m = debug_model(n_heads=8, n_kv_heads=2)
    attn = m.layers["0"].attention
    assert attn.wq.weight.shape == (128, 128) and attn.wk.weight.shape == (32, 128)
    assert attn.wv.weight.shape == (32, 128) and attn.n_rep == 4
    assert m(torch.randint(0, 258, (2, 9))).shape == (2, 9, 258)
    kv = torch.randn(2, 5, 2, 16)
    rep = model.repeat_kv(kv, 3)
    assert rep.shape == (2, 5, 6, 16)
    torch.testing.assert_close(rep[:, :, 3:6], kv[:, :, 1:2].expand(2, 5, 3, 16))


def test_gqa_equals_mha_with_repeated_kv_weights():
    """A GQA model computes what an MHA model does whose k/v weights repeat each kv head."""
    gqa = debug_model(n_heads=4, n_kv_heads=2)
    mha = debug_model(n_heads=4, n_kv_heads=4)
    state = gqa.state_dict()
    for key, value in state.items():
        if key.endswith(("wk.weight", "wv.weight")):
            state[key] = value.view(2, 1, 32, 128).expand(2, 2, 32, 128).reshape(128, 128)
    mha.load_state_dict(state)
    tokens = torch.randint(0, 258, (2, 11))
    torch.testing.assert_close(gqa(tokens), mha(tokens))


def test_state_dict_has_no_rope_buffers_and_torchtitan_names():
    keys = set(debug_model().state_dict())
    assert not any("rope" in k for k in keys)
    for k in ("tok_embeddings.weight", "norm.weight", "output.weight", "layers.3.attention.wo.weight",
              "layers.0.attention_norm.weight", "layers.0.feed_forward.w3.weight", "layers.0.ffn_norm.weight"):
        assert k in keys


def test_pipeline_stage_passes_hidden_states_through():
    full = debug_model()
    tokens = torch.randint(0, 258, (2, 10))
    first, last = debug_model(), debug_model()
    first.load_state_dict(full.state_dict())
    last.load_state_dict(full.state_dict())
    del first.layers["2"], first.layers["3"]
    first.norm = first.output = None
    del last.layers["0"], last.layers["1"]
    last.tok_embeddings = None
    hidden = first(tokens)
    assert hidden.shape == (2, 10, 128)
    torch.testing.assert_close(last(hidden), full(tokens))
    assert set(last.layers) == {"2", "3"}


def test_init_is_deterministic_given_rng():
    a, b = debug_model(seed=3), debug_model(seed=3)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    assert not torch.equal(a.output.weight, debug_model(seed=4).output.weight)


def test_70b_on_meta_device():
    with torch.device("meta"):
        m = build(model_args("70B"))
    assert m.output.weight.is_meta
    assert abs(num_params(m) - 69e9) / 69e9 < 0.02
    assert m.layers["0"].feed_forward.w1.weight.shape == (28672, 8192)
    assert m.layers["0"].attention.wk.weight.shape == (1024, 8192)


def test_meta_to_empty_then_init_matches_direct_build():
    with torch.device("meta"):
        m = build(model_args("debug"))
    m.to_empty(device="cpu")
    torch.manual_seed(0)
    m.init_weights()
    tokens = torch.randint(0, 258, (2, 8))
    torch.testing.assert_close(m(tokens), debug_model(seed=0)(tokens))


def test_llama2_shapes():
    assert model.ffn_hidden_dim(FLAVORS["7b"]) == 11008
    assert model.ffn_hidden_dim(FLAVORS["13b"]) == 13824
    with torch.device("meta"):
        assert abs(num_params(build(model_args("7b"))) - 6.74e9) / 6.74e9 < 0.01
        assert abs(num_params(build(model_args("13b"))) - 13.0e9) / 13.0e9 < 0.01
    small = num_params(build(model_args("small")))
    assert 20e6 <= small <= 40e6


def test_flops_per_token():
    for name in ("debug", "small", "7b", "70b"):
        args = model_args(name)
        with torch.device("meta"):
            n = num_params(build(args), exclude_embedding=True)
        f1, f2 = flops_per_token(args, 1024), flops_per_token(args, 2048)
        assert f1 > 0 and f2 > f1
        assert f1 == 6 * n + 12 * args.n_layers * args.n_heads * args.head_dim * 1024
    # The 7B at 4096 tokens: the usual ~6 * 6.6e9 + attention.
    assert 4.0e10 < flops_per_token(model_args("7b"), 4096) < 5.0e10


def test_model_args_overrides_and_errors():
    args = model_args("DEBUG", vocab_size=1000, dim=64, n_layers=2, n_heads=2, n_kv_heads=1)
    assert (args.vocab_size, args.dim, args.n_layers, args.n_heads, args.n_kv_heads) == (1000, 64, 2, 2, 1)
    assert FLAVORS["debug"].dim == 128  # the flavor table is not modified
    with pytest.raises(ValueError, match="debug"):
        model_args("nope")
    with pytest.raises(ValueError, match="n_kv_heads"):
        model_args("debug", n_heads=8, n_kv_heads=3)
    with pytest.raises(ValueError, match="n_heads"):
        ModelArgs(dim=100, n_layers=1, n_heads=3)
    m = build(model_args("debug", n_layers=1, max_seq_len=8))
    with pytest.raises(ValueError, match="max_seq_len"):
        m(torch.zeros(1, 9, dtype=torch.long))


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


# ---------------------------------------------------------------------------------------------------
# Learning


def test_debug_model_learns_the_shipped_corpus(shipped_tokens):
    m = debug_model(seed=0)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1)
    loader = DataLoader(shipped_tokens, seq_len=128, global_batch=8, dp_rank=0, dp_degree=1, seed=0)
    losses = []
    for _ in range(30):
        x, y = loader.next_batch()
        loss = F.cross_entropy(m(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    first, last = np.mean(losses[:5]), np.mean(losses[-5:])
    assert losses[0] > 4.5  # about ln(258) at the start
    assert last < first - 1.5, losses
