"""Our llama's state-dict keys ↔ Hugging Face ``LlamaForCausalLM``'s.

Contract: keys are the model's own state-dict keys (``layers.0.attention.wq.weight``), without the
trainer's ``model.`` state prefix; :func:`hf_name` and :func:`our_name` are inverse bijections on
the weights and raise KeyError for anything else; :data:`HF_IGNORED` matches the keys some Hugging
Face checkpoints carry that are not weights::

    tok_embeddings.weight                     model.embed_tokens.weight
    layers.N.attention.{wq,wk,wv,wo}.weight   model.layers.N.self_attn.{q,k,v,o}_proj.weight
    layers.N.feed_forward.{w1,w2,w3}.weight   model.layers.N.mlp.{gate,down,up}_proj.weight
    layers.N.attention_norm.weight            model.layers.N.input_layernorm.weight
    layers.N.ffn_norm.weight                  model.layers.N.post_attention_layernorm.weight
    norm.weight                               model.norm.weight
    output.weight                             lm_head.weight
"""

from __future__ import annotations

import re

# Keys of one transformer block: ours -> Hugging Face's (below "model.layers.N.").
_LAYER_KEYS = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_KEYS = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_KEYS_BACK = {hf: ours for ours, hf in _LAYER_KEYS.items()}
_TOP_KEYS_BACK = {hf: ours for ours, hf in _TOP_KEYS.items()}
OURS_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# Keys some Hugging Face checkpoints carry that are not weights (recomputed buffers).
HF_IGNORED = re.compile(r"^model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq$")


def hf_name(key: str) -> str:
    """Our state-dict key → the Hugging Face ``LlamaForCausalLM`` key (KeyError for a foreign key)."""
    if key in _TOP_KEYS:
        return _TOP_KEYS[key]
    match = OURS_LAYER.match(key)
    if match and match.group(2) in _LAYER_KEYS:
        return f"model.layers.{match.group(1)}.{_LAYER_KEYS[match.group(2)]}"
    raise KeyError(f"{key!r} is not a weight of our llama (no Hugging Face name)")


def our_name(hf_key: str) -> str:
    """The Hugging Face ``LlamaForCausalLM`` key → ours (KeyError for a key we have no weight for)."""
    if hf_key in _TOP_KEYS_BACK:
        return _TOP_KEYS_BACK[hf_key]
    match = _HF_LAYER.match(hf_key)
    if match and match.group(2) in _LAYER_KEYS_BACK:
        return f"layers.{match.group(1)}.{_LAYER_KEYS_BACK[match.group(2)]}"
    raise KeyError(f"{hf_key!r} is not a LlamaForCausalLM weight our llama has")
