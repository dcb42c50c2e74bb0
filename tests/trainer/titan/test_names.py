"""trainer/titan/names.py: our keys <-> torchtitan's llama3, and the fused q/k/v.

The fused layout is torchtitan's own: split_qkv equals its FusedQKVLinear save hook and fuse_qkv its
load hook (bitwise, grouped-query attention), checked against torchtitan when it is installed; the
names are the keys of torchtitan's own debugmodel and our logits equal its logits on the same weights."""

from __future__ import annotations

import pytest
import torch

from tests.support import titan_llama3
from trainer.hf import expected_shapes
from trainer.model import Transformer
from trainer.titan import fuse_qkv, our_name, params_of, split_qkv, titan_args, titan_name, titan_param


def test_names_are_a_bijection_and_the_fused_parameter_covers_three():
    from trainer.model import model_args

    ours = list(expected_shapes(model_args("debugmodel")))
    titan = [titan_name(k) for k in ours]
    assert len(set(titan)) == len(ours) and [our_name(k) for k in titan] == ours
    assert "lm_head.weight" in titan and "layers.3.attention.qkv_linear.wk.weight" in titan
    assert titan_param("layers.2.attention.wv.weight") == "layers.2.attention.qkv_linear.wqkv.weight"
    assert params_of("layers.2.attention.qkv_linear.wqkv.weight") == tuple(
        f"layers.2.attention.{p}.weight" for p in ("wq", "wk", "wv"))
    for bad in ("layers.0.attention.qkv_linear.wqkv.weight", "layers.0.attention.q_norm.weight", "freqs_cis"):
        with pytest.raises(KeyError):
            our_name(bad)


@pytest.mark.parametrize("n_heads, n_kv_heads", [(8, 2), (4, 4), (6, 1)])
def test_split_and_fuse_are_inverse_and_group_per_kv_head(n_heads, n_kv_heads):
    head_dim, dim = 4, 8
    fused = torch.arange((n_heads + 2 * n_kv_heads) * head_dim * dim, dtype=torch.float32).reshape(-1, dim)
    q, k, v = split_qkv(fused, n_heads, n_kv_heads)
    assert q.shape == (n_heads * head_dim, dim) and k.shape == v.shape == (n_kv_heads * head_dim, dim)
    group = n_heads // n_kv_heads + 2  # rows of one kv group: its query heads, then k, then v
    assert torch.equal(k[:head_dim], fused[(group - 2) * head_dim:(group - 1) * head_dim])
    assert torch.equal(fuse_qkv(q, k, v, n_heads, n_kv_heads), fused)


def test_the_fused_layout_and_the_logits_are_torchtitans():
    model = titan_llama3.build()  # skips without torchtitan
    attention = model.layers["0"].attention.qkv_linear
    fused = attention.wqkv.weight.detach()
    saved = model.state_dict()  # torchtitan's save hook splits
    args = titan_args("debugmodel", saved)
    q, k, v = split_qkv(fused, args.n_heads, args.kv_heads)
    assert torch.equal(q, saved["layers.0.attention.qkv_linear.wq.weight"])
    assert torch.equal(k, saved["layers.0.attention.qkv_linear.wk.weight"])
    assert torch.equal(v, saved["layers.0.attention.qkv_linear.wv.weight"])
    ours = Transformer(args)
    ours.init_weights()
    ours.load_state_dict({our_name(key): value for key, value in saved.items()}, strict=True)
    tokens = torch.randint(0, args.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(64).expand(2, 64)
    with torch.no_grad():
        theirs = model.eval()(tokens, positions, attention_masks=model.get_attention_masks(positions))
        diff = (ours.eval()(tokens) - theirs).abs().max().item()
    print(f"max |logits diff| ours vs torchtitan's llama3 debugmodel (rope theta 5e5, llama scaling): {diff:.3g}")
    assert diff < 1e-5
