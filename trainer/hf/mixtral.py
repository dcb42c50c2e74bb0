"""A mixture-of-experts checkpoint in Hugging Face's Mixtral layout (``MixtralForCausalLM``).

Why Mixtral: its block is ours without a shared expert (a top-k router with softmax scores
renormalised over the chosen k, SwiGLU experts, llama attention without biases), so a MoE
flavour exports exactly; Qwen2-MoE would need a sigmoid gate on the shared expert and q/k/v biases
we do not have. A model with ``num_shared_experts > 0`` is refused (Mixtral has no place for it).

Names, on disk as every Mixtral checkpoint stores them (transformers 5 fuses the experts into
``gate_up_proj`` / ``down_proj`` when it loads them; 4.x loads them as they are)::

    layers.N.moe.router.gate.weight   model.layers.N.block_sparse_moe.gate.weight
    layers.N.moe.experts.wK [E, ...]  model.layers.N.block_sparse_moe.experts.{0..E-1}.wK.weight

Everything else is :mod:`trainer.hf.names`' llama mapping. Contract: :func:`expert_parts` says
how one of our keys splits (one Hugging Face key per expert), :func:`mixtral_config` adds the MoE
fields to a llama ``config.json``; both raise CheckpointError for what Mixtral cannot hold.
"""

from __future__ import annotations

import re

from ckpt import CheckpointError
from ..flavors import ModelArgs, expert_hidden_dim

_EXPERTS = re.compile(r"^layers\.(\d+)\.moe\.experts\.(w[123])$")
_GATE = re.compile(r"^layers\.(\d+)\.moe\.router\.gate\.weight$")


def check(args: ModelArgs) -> None:
    if args.num_shared_experts:
        raise CheckpointError(f"the model has {args.num_shared_experts} shared expert(s): Hugging Face's Mixtral "
                              "layout (what --to hf writes for a mixture of experts) has none; train with "
                              "model.num_shared_experts = 0, or export our own names (--to safetensors)")


def moe_name(key: str) -> str | None:
    """The Hugging Face key of our router key, or the per-expert stem of an experts key (None:
    not a MoE key)."""
    if match := _GATE.match(key):
        return f"model.layers.{match.group(1)}.block_sparse_moe.gate.weight"
    if match := _EXPERTS.match(key):
        return f"model.layers.{match.group(1)}.block_sparse_moe.experts.{{}}.{match.group(2)}.weight"
    return None


def expert_parts(key: str, num_experts: int) -> list[str] | None:
    """The Hugging Face keys, expert by expert, of one of our 3-D expert weights (None: not one)."""
    if not _EXPERTS.match(key):
        return None
    stem = moe_name(key)
    return [stem.format(e) for e in range(num_experts)]


def mixtral_config(llama: dict, args: ModelArgs) -> dict:
    """A llama ``config.json`` (:func:`trainer.hf.config.hf_config`) made Mixtral's."""
    check(args)
    config = {**llama, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
              "intermediate_size": expert_hidden_dim(args), "num_local_experts": args.num_experts,
              "num_experts_per_tok": args.top_k, "router_aux_loss_coef": args.moe_aux_loss_coef,
              "output_router_logits": False, "router_jitter_noise": 0.0, "sliding_window": None}
    for key in ("mlp_bias", "pretraining_tp"):
        config.pop(key, None)
    return config
