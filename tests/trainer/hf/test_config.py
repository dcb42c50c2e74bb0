"""trainer/hf/config.py: config.json written for our model round-trips (and the trainer can build it
again); configs of transformers 4 and 5 parse; what our model cannot represent is refused naming the key."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trainer.hf.checks import HFInputError
from trainer.hf.config import UnsupportedHFConfig, args_from_hf_config, hf_config
from trainer.hf.run import expected_shapes, trainer_flags, trainer_model_config
from trainer.model import ffn_hidden_dim, model_args


@pytest.mark.parametrize("flavor", ["debug", "small", "7b", "70b"])
def test_config_round_trip(flavor):
    args = model_args(flavor)
    config = hf_config(args, torch.bfloat16)
    assert config["intermediate_size"] == ffn_hidden_dim(args) and config["torch_dtype"] == "bfloat16"
    assert config["num_key_value_heads"] == args.kv_heads and config["tie_word_embeddings"] is False
    back = args_from_hf_config(config)
    assert ffn_hidden_dim(back) == ffn_hidden_dim(args)
    assert dataclasses.replace(back, multiple_of=0, ffn_dim_multiplier=None) == \
        dataclasses.replace(args, n_kv_heads=args.kv_heads, multiple_of=0, ffn_dim_multiplier=None)
    section = trainer_model_config(back)  # the trainer can build it again (from some flavor)
    flags = trainer_flags(section)
    assert flags[:2] == ["--model.flavor", section["flavor"]] and "--model.tokenizer" not in flags
    rebuilt = model_args(section["flavor"], dim=section["hidden_dim"], n_layers=section["n_layers"],
                         n_heads=section["n_heads"], n_kv_heads=section["n_kv_heads"], vocab_size=section["vocab_size"])
    assert expected_shapes(rebuilt) == expected_shapes(args)
    assert (rebuilt.norm_eps, rebuilt.rope_theta) == (args.norm_eps, args.rope_theta)


def test_configs_written_by_transformers_4_and_5_parse():
    base = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 2048,
            "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
            "num_key_value_heads": 4, "vocab_size": 32000, "rms_norm_eps": 1e-5, "max_position_embeddings": 2048}
    v4 = args_from_hf_config({**base, "rope_theta": 500000.0, "rope_scaling": None})
    v5 = args_from_hf_config({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}})
    assert v4 == v5 and v4.rope_theta == 500000.0 and ffn_hidden_dim(v4) == 5632 and v4.kv_heads == 4
    narrow = args_from_hf_config({**base, "hidden_size": 128, "num_attention_heads": 4,
                                             "num_key_value_heads": 4, "intermediate_size": 100})
    assert ffn_hidden_dim(narrow) == 100  # below llama's 8/3 rule: a multiplier < 1
    assert trainer_model_config(narrow)["ffn_dim"] == 100  # no flavor's rounding builds that width: ffn_dim does
    transformers = pytest.importorskip("transformers")
    native = transformers.LlamaConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=300).to_dict()
    assert args_from_hf_config(native).kv_heads == 2


@pytest.mark.parametrize("change, words", [
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, "rope_parameters"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"head_dim": 64}, "head_dim"),
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, "model_type"),
    ({"num_key_value_heads": 3}, "n_kv_heads"),
    ({"hidden_size": None}, "hidden_size"),
])
def test_unrepresentable_configs_are_refused_naming_the_key(change, words):
    config = {**hf_config(model_args("debug"), torch.float32), **change}
    with pytest.raises((UnsupportedHFConfig, HFInputError), match=words):  # a wrong type: HFInputError
        args_from_hf_config(config)
