"""trainer/hf/names.py: our state-dict keys <-> Hugging Face LlamaForCausalLM's; foreign keys refused."""

from __future__ import annotations

import pytest

from trainer.hf.names import HF_IGNORED, hf_name, our_name


def test_unknown_keys_are_refused():
    with pytest.raises(KeyError):
        hf_name("layers.0.attention.wq.bias")
    with pytest.raises(KeyError):
        our_name("model.layers.0.self_attn.rotary_emb.inv_freq")
    assert HF_IGNORED.match("model.layers.0.self_attn.rotary_emb.inv_freq")
