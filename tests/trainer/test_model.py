"""The llama model (trainer/model.py), and the debug model learning the shipped corpus: fast, single process."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trainer import model
from trainer.data import ByteTokenizer, DataLoader
from trainer.model import FLAVORS, ModelArgs, build, flops_per_token, model_args, num_params


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
# Learning


@pytest.mark.slow
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


def test_tied_embeddings_are_one_parameter_and_counted_once():
    import dataclasses

    args = dataclasses.replace(model_args("debug"), tie_embeddings=True)
    torch.manual_seed(0)
    tied = build(args)
    assert tied.output.weight is tied.tok_embeddings.weight
    assert num_params(tied) == num_params(build(model_args("debug"))) - args.vocab_size * args.dim
    assert model._non_embedding_params(args) == num_params(tied, exclude_embedding=True)
    with torch.device("meta"):  # meta first, then to_empty + init_weights: still tied
        late = model.Transformer(args)
    late.to_empty(device="cpu")
    late.init_weights()
    assert late.output.weight is late.tok_embeddings.weight


def test_llama3_rope_scaling_keeps_high_slows_low_and_smooths_between():
    from trainer.rope import RopeScaling, rope_frequencies

    plain = rope_frequencies(16, 500000.0)
    scaled = rope_frequencies(16, 500000.0, RopeScaling(8.0, 1.0, 4.0, 128))
    wavelen = 2 * torch.pi / plain
    high, low = wavelen < 128 / 4, wavelen > 128 / 1
    assert high.any() and low.any() and (~high & ~low).any()  # all three bands present
    assert torch.equal(scaled[high], plain[high]) and torch.allclose(scaled[low], plain[low] / 8)
    mid = ~high & ~low
    assert ((scaled[mid] < plain[mid]) & (scaled[mid] > plain[mid] / 8)).all()
