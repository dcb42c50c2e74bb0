"""trainer/hf_adapter.py: our llama <-> Hugging Face LlamaForCausalLM, tensor by tensor.

Names and the rotary q/k row permutation round-trip bitwise (GQA included); a LlamaForCausalLM
holding the converted weights computes our logits in fp32 (max abs diff < 1e-5, measured ~1e-6)
and, without the permutation, does not (diff > 1e-2 with the sharp attention of a trained model);
configs round-trip and what our model cannot represent is refused naming the key.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trainer import hf_adapter
from trainer.model import ModelArgs, build, ffn_hidden_dim, model_args

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
    hf = hf_adapter.permute_to_hf(w, heads)
    for h in range(heads):
        for i in range(head_dim // 2):
            for j in (0, 1):  # our row 2i+j of head h is HF's row j*head_dim/2 + i
                assert torch.equal(hf[h * head_dim + j * head_dim // 2 + i], w[h * head_dim + 2 * i + j])
    assert torch.equal(hf_adapter.permute_from_hf(hf, heads), w)
    with pytest.raises(ValueError):
        hf_adapter.permute_to_hf(torch.zeros(6, 2), 2)  # heads of odd size


@pytest.mark.parametrize("n_kv_heads", [2, None])  # grouped-query (debug flavor) and plain multi-head
def test_round_trip_is_bitwise(n_kv_heads):
    args = dataclasses.replace(model_args("debug"), n_kv_heads=n_kv_heads)
    _, state = _state(args)
    converted = dict(hf_adapter.to_hf(k, v, args) for k, v in state.items())
    assert len(converted) == len(state) and "lm_head.weight" in converted and "model.embed_tokens.weight" in converted
    assert converted["model.layers.0.self_attn.k_proj.weight"].shape == (args.kv_heads * args.head_dim, args.dim)
    back = dict(hf_adapter.from_hf(k, v, args) for k, v in converted.items())
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) and back[k].dtype == state[k].dtype for k in state)
    # q and k really are permuted (so the test above could fail), v and the rest are not
    assert not torch.equal(converted["model.layers.1.self_attn.q_proj.weight"], state["layers.1.attention.wq.weight"])
    assert not torch.equal(converted["model.layers.1.self_attn.k_proj.weight"], state["layers.1.attention.wk.weight"])
    assert converted["model.layers.1.self_attn.v_proj.weight"] is state["layers.1.attention.wv.weight"]


def test_unknown_keys_are_refused():
    with pytest.raises(KeyError):
        hf_adapter.hf_name("layers.0.attention.wq.bias")
    with pytest.raises(KeyError):
        hf_adapter.our_name("model.layers.0.self_attn.rotary_emb.inv_freq")
    assert hf_adapter.HF_IGNORED.match("model.layers.0.self_attn.rotary_emb.inv_freq")


def _hf_logits(args: ModelArgs, hf_state: dict, tokens: torch.Tensor) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**hf_adapter.hf_config(args, torch.float32))
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
    permuted = dict(hf_adapter.to_hf(k, v, args) for k, v in state.items())
    plain = {hf_adapter.hf_name(k): v for k, v in state.items()}
    with_permutation = (_hf_logits(args, permuted, tokens) - ours).abs().max().item()
    without = (_hf_logits(args, plain, tokens) - ours).abs().max().item()
    print(f"max |logits diff|: with the permutation {with_permutation:.3g}, without {without:.3g}")
    assert with_permutation < TOLERANCE
    assert without > 1e-2 and without > 1000 * with_permutation


@pytest.mark.parametrize("flavor", ["debug", "small", "7b", "70b"])
def test_config_round_trip(flavor):
    args = model_args(flavor)
    config = hf_adapter.hf_config(args, torch.bfloat16)
    assert config["intermediate_size"] == ffn_hidden_dim(args) and config["torch_dtype"] == "bfloat16"
    assert config["num_key_value_heads"] == args.kv_heads and config["tie_word_embeddings"] is False
    back = hf_adapter.args_from_hf_config(config)
    assert ffn_hidden_dim(back) == ffn_hidden_dim(args)
    assert dataclasses.replace(back, multiple_of=0, ffn_dim_multiplier=None) == \
        dataclasses.replace(args, n_kv_heads=args.kv_heads, multiple_of=0, ffn_dim_multiplier=None)
    section = hf_adapter.trainer_model_config(back)  # the trainer can build it again (from some flavor)
    flags = hf_adapter.trainer_flags(section)
    assert flags[:2] == ["--model.flavor", section["flavor"]] and "--model.tokenizer" not in flags
    rebuilt = model_args(section["flavor"], dim=section["hidden_dim"], n_layers=section["n_layers"],
                         n_heads=section["n_heads"], n_kv_heads=section["n_kv_heads"], vocab_size=section["vocab_size"])
    assert hf_adapter.expected_shapes(rebuilt) == hf_adapter.expected_shapes(args)
    assert (rebuilt.norm_eps, rebuilt.rope_theta) == (args.norm_eps, args.rope_theta)


def test_configs_written_by_transformers_4_and_5_parse():
    base = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 2048,
            "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
            "num_key_value_heads": 4, "vocab_size": 32000, "rms_norm_eps": 1e-5, "max_position_embeddings": 2048}
    v4 = hf_adapter.args_from_hf_config({**base, "rope_theta": 500000.0, "rope_scaling": None})
    v5 = hf_adapter.args_from_hf_config({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}})
    assert v4 == v5 and v4.rope_theta == 500000.0 and ffn_hidden_dim(v4) == 5632 and v4.kv_heads == 4
    narrow = hf_adapter.args_from_hf_config({**base, "hidden_size": 128, "num_attention_heads": 4,
                                             "num_key_value_heads": 4, "intermediate_size": 100})
    assert ffn_hidden_dim(narrow) == 100  # below llama's 8/3 rule: a multiplier < 1
    assert hf_adapter.trainer_model_config(narrow) is None  # no flavor builds that width
    transformers = pytest.importorskip("transformers")
    native = transformers.LlamaConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=300).to_dict()
    assert hf_adapter.args_from_hf_config(native).kv_heads == 2


@pytest.mark.parametrize("change, words", [
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, "rope_parameters"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"head_dim": 64}, "head_dim"),
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, "model_type"),
    ({"num_key_value_heads": 3}, "n_kv_heads"),
    ({"hidden_size": None}, "hidden_size"),
])
def test_unrepresentable_configs_are_refused_naming_the_key(change, words):
    config = {**hf_adapter.hf_config(model_args("debug"), torch.float32), **change}
    with pytest.raises(hf_adapter.UnsupportedHFConfig, match=words):
        hf_adapter.args_from_hf_config(config)


def test_args_from_a_run_config():
    from trainer.config import Config

    cfg = Config()
    cfg.model.n_layers, cfg.training.seq_len = 2, 4096
    d = cfg.to_dict()
    d["checkpoint"]["a_key_of_another_trainer_version"] = 1  # only model and training.seq_len are read
    args = hf_adapter.args_from_run_config(d, vocab_size=300)
    assert (args.n_layers, args.vocab_size, args.max_seq_len, args.dim) == (2, 300, 4096, 128)
