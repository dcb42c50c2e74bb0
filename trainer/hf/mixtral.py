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
fields to a llama ``config.json``; both raise CheckpointError for what Mixtral cannot hold. The
import direction (``--from hf``): :func:`our_moe_key` names the key (and expert) a Mixtral key
goes to, :func:`args_from_mixtral_config` reads a Mixtral ``config.json`` into our
:class:`~trainer.model.ModelArgs` (:class:`~trainer.hf.config.UnsupportedHFConfig` for a sliding
window, which our attention does not have).
"""

from __future__ import annotations

import re

import dataclasses

from ckpt import CheckpointError
from ..flavors import ModelArgs, expert_hidden_dim
from .checks import check_config
from .config import HF_ARCHITECTURE, HF_MODEL_TYPE, UnsupportedHFConfig, args_from_hf_config

MIXTRAL_ARCHITECTURE, MIXTRAL_MODEL_TYPE = "MixtralForCausalLM", "mixtral"

_EXPERTS = re.compile(r"^layers\.(\d+)\.moe\.experts\.(w[123])$")
_GATE = re.compile(r"^layers\.(\d+)\.moe\.router\.gate\.weight$")
_HF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
_HF_GATE = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.gate\.weight$")


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
    config = {**llama, "architectures": [MIXTRAL_ARCHITECTURE], "model_type": MIXTRAL_MODEL_TYPE,
              "intermediate_size": expert_hidden_dim(args), "num_local_experts": args.num_experts,
              "num_experts_per_tok": args.top_k, "router_aux_loss_coef": args.moe_aux_loss_coef,
              "output_router_logits": False, "router_jitter_noise": 0.0, "sliding_window": None}
    for key in ("mlp_bias", "pretraining_tp"):
        config.pop(key, None)
    return config


def our_moe_key(hf_key: str) -> tuple[str, int | None] | None:
    """Our key of a Mixtral MoE key and, for an expert's weight, its expert (a row of our 3-D
    tensor); None: not a MoE key."""
    if match := _HF_GATE.match(hf_key):
        return f"layers.{match.group(1)}.moe.router.gate.weight", None
    if match := _HF_EXPERT.match(hf_key):
        return f"layers.{match.group(1)}.moe.experts.{match.group(3)}", int(match.group(2))
    return None


def args_from_mixtral_config(config: dict) -> ModelArgs:
    """Our :class:`ModelArgs` for a Mixtral ``config.json``: the llama fields read as
    :func:`~trainer.hf.config.args_from_hf_config` reads them, the experts from Mixtral's own."""
    check_config(config)
    architectures = config.get("architectures") or [MIXTRAL_ARCHITECTURE]
    if MIXTRAL_ARCHITECTURE not in architectures:
        raise UnsupportedHFConfig(f"config.json describes model_type='mixtral', architectures={architectures!r}")
    if config.get("sliding_window") is not None:
        raise UnsupportedHFConfig(f"config.json: sliding_window={config['sliding_window']!r} is not supported "
                                  "(our attention sees the whole sequence)")
    values = {}
    for key in ("num_local_experts", "num_experts_per_tok", "intermediate_size"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise UnsupportedHFConfig(f"config.json: {key}={value!r} must be a positive integer")
        values[key] = value
    coef = config.get("router_aux_loss_coef", 0.001)
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not 0 <= coef < float("inf"):
        raise UnsupportedHFConfig(f"config.json: router_aux_loss_coef={coef!r} must be a number >= 0")
    llama = args_from_hf_config({**config, "model_type": HF_MODEL_TYPE, "architectures": [HF_ARCHITECTURE]})
    try:
        return dataclasses.replace(llama, num_experts=values["num_local_experts"], top_k=values["num_experts_per_tok"],
                                   num_shared_experts=0, moe_ffn_dim=values["intermediate_size"],
                                   moe_aux_loss_coef=float(coef))
    except ValueError as exc:  # top_k beyond the experts
        raise UnsupportedHFConfig(f"config.json: {exc}") from None
