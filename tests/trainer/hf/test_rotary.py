"""trainer/hf/rotary.py: our llama <-> Hugging Face LlamaForCausalLM, tensor by tensor.

Names and the rotary q/k row permutation round-trip bitwise (GQA included); a LlamaForCausalLM
holding the converted weights computes our logits in fp32 (max abs diff < 1e-5, measured ~1e-6)
and, without the permutation, does not (diff > 1e-2 with the sharp attention of a trained model).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trainer.hf.config import hf_config
from trainer.hf.names import hf_name
from trainer.hf.rotary import from_hf, permute_from_hf, permute_to_hf, to_hf
from trainer.model import ModelArgs, build, model_args


TOLERANCE = 1e-5  # fp32 logits, ours vs transformers' eager llama (measured ~1e-6)


def _state(args: ModelArgs, seed: int = 0, qk_scale: float = 1.0) -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(seed)
    model = build(args).eval()
    if qk_scale != 1.0:  # sharper attention, as a trained model has: the rotary layout then matters a lot
        with torch.no_grad():
            for layer in model.layers.values():
                layer.attention.wq.weight.mul_(qk_scale)
                layer.attention.wk.weight.mul_(qk_scale)
    return model, model.state_dict()


def test_permutation_moves_each_heads_pairs_to_its_halves_and_back():
    head_dim, heads, cols = 8, 3, 5
    w = torch.arange(heads * head_dim * cols, dtype=torch.float32).reshape(heads * head_dim, cols)
    hf = permute_to_hf(w, heads)
    for h in range(heads):
        for i in range(head_dim // 2):
            for j in (0, 1):  # our row 2i+j of head h is HF's row j*head_dim/2 + i
                assert torch.equal(hf[h * head_dim + j * head_dim // 2 + i], w[h * head_dim + 2 * i + j])
    assert torch.equal(permute_from_hf(hf, heads), w)
    with pytest.raises(ValueError):
        permute_to_hf(torch.zeros(6, 2), 2)  # heads of odd size


@pytest.mark.parametrize("n_kv_heads", [2, None])  # grouped-query (debug flavor) and plain multi-head
def test_round_trip_is_bitwise(n_kv_heads):
    args = dataclasses.replace(model_args("debug"), n_kv_heads=n_kv_heads)
    _, state = _state(args)
    converted = dict(to_hf(k, v, args) for k, v in state.items())
    assert len(converted) == len(state) and "lm_head.weight" in converted and "model.embed_tokens.weight" in converted
    assert converted["model.layers.0.self_attn.k_proj.weight"].shape == (args.kv_heads * args.head_dim, args.dim)
    back = dict(from_hf(k, v, args) for k, v in converted.items())
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) and back[k].dtype == state[k].dtype for k in state)
    # q and k really are permuted (so the test above could fail), v and the rest are not
    assert not torch.equal(converted["model.layers.1.self_attn.q_proj.weight"], state["layers.1.attention.wq.weight"])
    assert not torch.equal(converted["model.layers.1.self_attn.k_proj.weight"], state["layers.1.attention.wk.weight"])
    assert converted["model.layers.1.self_attn.v_proj.weight"] is state["layers.1.attention.wv.weight"]


def _hf_logits(args: ModelArgs, hf_state: dict, tokens: torch.Tensor) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**hf_config(args, torch.float32))
    config._attn_implementation = "eager"
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(config)
    result = hf.load_state_dict(hf_state, strict=True, assign=True)
    assert not result.missing_keys and not result.unexpected_keys
    hf.model.rotary_emb.inv_freq = hf.model.rotary_emb.original_inv_freq = 1.0 / (
        args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float32) / args.head_dim))
    with torch.no_grad():
        return hf.eval()(tokens).logits


def test_transformers_llama_computes_our_logits_and_not_without_the_permutation():
    args = model_args("debug")  # 4 heads, 2 kv heads: GQA
    model, state = _state(args, seed=3, qk_scale=10.0)
    tokens = torch.randint(0, args.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens)
    permuted = dict(to_hf(k, v, args) for k, v in state.items())
    plain = {hf_name(k): v for k, v in state.items()}
    with_permutation = (_hf_logits(args, permuted, tokens) - ours).abs().max().item()
    without = (_hf_logits(args, plain, tokens) - ours).abs().max().item()
    print(f"max |logits diff|: with the permutation {with_permutation:.3g}, without {without:.3g}")
    assert with_permutation < TOLERANCE
    assert without > 1e-2 and without > 1000 * with_permutation
