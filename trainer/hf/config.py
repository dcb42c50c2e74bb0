"""A Hugging Face llama's ``config.json`` / ``generation_config.json``: written for our model, read back into it.

Contract: :func:`hf_config` / :func:`generation_config` are the files of an export (a
``LlamaForCausalLM`` computing exactly what our model computes); :func:`args_from_hf_config` reads a
``config.json`` back into our :class:`~trainer.model.ModelArgs` and refuses, with an
:class:`UnsupportedHFConfig` naming the key, what this model cannot represent (rope scaling,
biases, tied embeddings, other activations or head sizes).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..data import ByteTokenizer
from .checks import check_config
from ..model import FLAVORS, ModelArgs, ffn_hidden_dim

HF_ARCHITECTURE = "LlamaForCausalLM"
HF_MODEL_TYPE = "llama"


class UnsupportedHFConfig(ValueError):
    """A Hugging Face config (or checkpoint) that our llama cannot represent exactly."""


def _special_ids(tokenizer: Any) -> tuple[int | None, int | None]:
    if tokenizer is None:
        tokenizer = ByteTokenizer()
    return getattr(tokenizer, "bos_id", None), getattr(tokenizer, "eos_id", None)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def hf_config(args: ModelArgs, dtype: torch.dtype, *, tokenizer: Any = None) -> dict:
    """The ``config.json`` of a ``LlamaForCausalLM`` computing exactly what our model computes.

    ``dtype`` is the exported weights' dtype; ``tokenizer`` (anything with ``bos_id``/``eos_id``,
    default our byte tokenizer) gives the special token ids. The rotary base is written both the
    transformers 4.x way (``rope_theta``) and the 5.x way (``rope_parameters``), the dtype as
    ``torch_dtype`` (4.x) and ``dtype`` (5.x)."""
    bos, eos = _special_ids(tokenizer)
    return {
        "architectures": [HF_ARCHITECTURE],
        "model_type": HF_MODEL_TYPE,
        "hidden_size": args.dim,
        "intermediate_size": ffn_hidden_dim(args),
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "rope_scaling": None,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": dtype_name(dtype),
        "dtype": dtype_name(dtype),
    }


def generation_config(args: ModelArgs, *, tokenizer: Any = None) -> dict:
    """The ``generation_config.json`` of an export: the special token ids and the context length."""
    bos, eos = _special_ids(tokenizer)
    return {"bos_token_id": bos, "eos_token_id": eos, "max_length": args.max_seq_len}


def _require(config: dict, key: str, kind=int) -> Any:
    if key not in config:
        raise UnsupportedHFConfig(f"config.json has no {key!r}")
    value = config[key]
    if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise UnsupportedHFConfig(f"config.json: {key}={value!r} must be a positive integer")
    return value


def _refuse_unless(condition: bool, message: str) -> None:
    if not condition:
        raise UnsupportedHFConfig(message)


def _rope_kind(params: Any, key: str) -> None:
    """Refuse rotary scaling of any kind in ``config[key]`` (a dict, or null)."""
    if params in (None, {}):
        return
    _refuse_unless(isinstance(params, dict), f"config.json: {key}={params!r} must be an object")
    rope_type = params.get("rope_type", params.get("type", "default"))
    _refuse_unless(rope_type == "default", f"config.json: {key} rope_type={rope_type!r} is not supported "
                   "(our rotary embedding has no scaling)")
    _refuse_unless(float(params.get("partial_rotary_factor", 1.0)) == 1.0,
                   f"config.json: {key} partial_rotary_factor is not supported (every head dimension is rotated)")


def _rope_theta(config: dict) -> float:
    """The rotary base: 4.x's ``rope_theta`` or 5.x's ``rope_parameters.rope_theta`` (default 10000);
    any scaling (``rope_scaling``, a ``rope_parameters`` type other than default) is refused."""
    for key in ("rope_scaling", "rope_parameters"):
        _rope_kind(config.get(key), key)
    _refuse_unless(float(config.get("partial_rotary_factor", 1.0)) == 1.0,
                   "config.json: partial_rotary_factor is not supported (every head dimension is rotated)")
    theta = config.get("rope_theta")
    inner = (config.get("rope_parameters") or {}).get("rope_theta")
    if inner is not None:
        _refuse_unless(theta is None or float(theta) == float(inner),
                       f"config.json: rope_theta={theta} and rope_parameters.rope_theta={inner} disagree")
        theta = inner
    return 10000.0 if theta is None else float(theta)


def _ffn_args(dim: int, intermediate: int) -> tuple[int, float | None]:
    """``(multiple_of, ffn_dim_multiplier)`` with ``ffn_hidden_dim == intermediate``: a flavor's
    rounding when one gives it, else ``intermediate`` itself as the rounding unit."""
    for flavor in FLAVORS.values():
        args = dataclasses.replace(flavor, dim=dim, n_heads=1, n_kv_heads=None)
        if ffn_hidden_dim(args) == intermediate:
            return flavor.multiple_of, flavor.ffn_dim_multiplier
    base = int(2 * (4 * dim) / 3)
    if base <= intermediate:
        return intermediate, None
    return intermediate, intermediate / base  # int(multiplier * base) lands in (0, intermediate]


def args_from_hf_config(config: dict) -> ModelArgs:
    """Our :class:`~trainer.model.ModelArgs` for a Hugging Face llama ``config.json`` (a dict);
    :class:`UnsupportedHFConfig` naming the key for anything our model would compute differently."""
    if not isinstance(config, dict):
        raise UnsupportedHFConfig("config.json does not hold an object")
    check_config(config)  # types and ranges first (HFInputError naming the field)
    model_type = config.get("model_type")
    architectures = config.get("architectures") or [HF_ARCHITECTURE]
    _refuse_unless(model_type == HF_MODEL_TYPE and HF_ARCHITECTURE in architectures,
                   f"config.json describes model_type={model_type!r}, architectures={architectures!r}; "
                   f"only {HF_MODEL_TYPE!r} / {HF_ARCHITECTURE} converts to our llama")
    dim = _require(config, "hidden_size")
    n_layers = _require(config, "num_hidden_layers")
    n_heads = _require(config, "num_attention_heads")
    n_kv_heads = config.get("num_key_value_heads") or n_heads
    vocab_size = _require(config, "vocab_size")
    intermediate = _require(config, "intermediate_size")
    act = config.get("hidden_act", "silu")
    _refuse_unless(act == "silu", f"config.json: hidden_act={act!r} is not supported (our feed-forward is SwiGLU)")
    for key in ("attention_bias", "mlp_bias"):
        _refuse_unless(not config.get(key, False),
                       f"config.json: {key}=true is not supported (our linears have no bias)")
    _refuse_unless(not config.get("tie_word_embeddings", False),
                   "config.json: tie_word_embeddings=true is not supported (our model keeps the output "
                   "projection apart from the embedding)")
    head_dim = config.get("head_dim")
    _refuse_unless(head_dim in (None, dim // n_heads) and dim % n_heads == 0,
                   f"config.json: head_dim={head_dim} with hidden_size={dim} and num_attention_heads={n_heads} "
                   "is not supported (our head size is hidden_size / num_attention_heads)")
    multiple_of, multiplier = _ffn_args(dim, intermediate)
    try:
        args = ModelArgs(
            dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, vocab_size=vocab_size,
            multiple_of=multiple_of, ffn_dim_multiplier=multiplier,
            norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=_rope_theta(config),
            max_seq_len=int(config.get("max_position_embeddings", 2048)),
        )
    except ValueError as exc:
        raise UnsupportedHFConfig(f"config.json: {exc}") from None
    _refuse_unless(ffn_hidden_dim(args) == intermediate,
                   f"config.json: intermediate_size={intermediate} cannot be expressed")
    return args
