"""A Hugging Face llama's ``config.json`` / ``generation_config.json``: written for our model, read back into it.

Contract: :func:`hf_config` / :func:`generation_config` are the files of an export (a
``LlamaForCausalLM`` computing exactly what our model computes); :func:`args_from_hf_config` reads a
``config.json`` back into our :class:`~trainer.model.ModelArgs` (Llama-2, Llama-3.x and SmolLM
shapes: llama3 rope scaling, tied embeddings, any SwiGLU width and norm epsilon) and refuses, with
an :class:`UnsupportedHFConfig` naming the key, what this model cannot represent (other rope
scalings, biases, other activations or head sizes).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..data import ByteTokenizer
from .checks import check_config
from ..model import FLAVORS, ModelArgs, ffn_hidden_dim
from ..rope import RopeScaling

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
    scaling = None if args.rope_scaling is None else {
        "rope_type": "llama3", "factor": args.rope_scaling.factor,
        "low_freq_factor": args.rope_scaling.low_freq_factor, "high_freq_factor": args.rope_scaling.high_freq_factor,
        "original_max_position_embeddings": args.rope_scaling.original_max_position_embeddings}
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
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta} if scaling is None else
                           {**scaling, "rope_theta": args.rope_theta},
        "rope_scaling": scaling,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": args.tie_embeddings,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": dtype_name(dtype),
        "dtype": dtype_name(dtype),
    }


def generation_config(args: ModelArgs, *, tokenizer: Any = None) -> dict:
    """The ``generation_config.json`` of an export: the special token ids (no ``max_length``: the
    context is ``max_position_embeddings`` in config.json, and a ``max_length`` here would cut every
    ``generate`` call to it)."""
    bos, eos = _special_ids(tokenizer)
    return {"bos_token_id": bos, "eos_token_id": eos}


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


_LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rotates_every_dimension(factor: Any) -> bool:
    """``partial_rotary_factor`` (checked by :func:`check_config`: a positive number, or null) is 1:
    missing or null means the default, full rotary, as transformers reads a llama config."""
    return factor is None or float(factor) == 1.0


def _rope_kind(params: Any, key: str) -> RopeScaling | None:
    """The rotary scaling in ``config[key]`` (a dict, or null): None for the default, a
    :class:`RopeScaling` for llama3's; any other kind is refused."""
    if params in (None, {}):
        return None
    _refuse_unless(isinstance(params, dict), f"config.json: {key}={params!r} must be an object")
    rope_type = params.get("rope_type", params.get("type", "default"))
    _refuse_unless(rope_type in ("default", "llama3"), f"config.json: {key} rope_type={rope_type!r} is not "
                   "supported (our rotary embedding has llama3 scaling or none)")
    _refuse_unless(_rotates_every_dimension(params.get("partial_rotary_factor")),
                   f"config.json: {key} partial_rotary_factor is not supported (every head dimension is rotated)")
    if rope_type == "default":
        return None
    missing = [name for name in _LLAMA3_FIELDS if name not in params]
    _refuse_unless(not missing, f"config.json: {key} rope_type='llama3' lacks {', '.join(missing)}")
    try:
        return RopeScaling(float(params["factor"]), float(params["low_freq_factor"]),
                           float(params["high_freq_factor"]), int(params["original_max_position_embeddings"]))
    except (TypeError, ValueError) as exc:
        raise UnsupportedHFConfig(f"config.json: {key}: {exc}") from None


def _rope_scaling(config: dict) -> RopeScaling | None:
    """The rotary scaling of 4.x's ``rope_scaling`` or 5.x's ``rope_parameters`` (they must agree)."""
    found = {key: _rope_kind(config.get(key), key) for key in ("rope_scaling", "rope_parameters")}
    outer, inner = found["rope_scaling"], found["rope_parameters"]
    _refuse_unless(None in (outer, inner) or outer == inner,
                   f"config.json: rope_scaling={config.get('rope_scaling')} and rope_parameters="
                   f"{config.get('rope_parameters')} disagree")
    return outer or inner


def _rope_theta(config: dict) -> float:
    """The rotary base: 4.x's ``rope_theta`` or 5.x's ``rope_parameters.rope_theta`` (default 10000)."""
    _refuse_unless(_rotates_every_dimension(config.get("partial_rotary_factor")),
                   "config.json: partial_rotary_factor is not supported (every head dimension is rotated)")
    theta = config.get("rope_theta")
    inner = (config.get("rope_parameters") or {}).get("rope_theta")
    if inner is not None:
        _refuse_unless(theta is None or float(theta) == float(inner),
                       f"config.json: rope_theta={theta} and rope_parameters.rope_theta={inner} disagree")
        theta = inner
    return 10000.0 if theta is None else float(theta)


def _ffn_args(dim: int, intermediate: int) -> dict:
    """The ``ModelArgs`` fields with ``ffn_hidden_dim == intermediate``: a flavor's rounding
    (``multiple_of``, ``ffn_dim_multiplier``) when one gives it, else ``ffn_dim`` itself."""
    for flavor in FLAVORS.values():
        args = dataclasses.replace(flavor, dim=dim, n_heads=1, n_kv_heads=None, ffn_dim=None)
        if ffn_hidden_dim(args) == intermediate:
            return {"multiple_of": flavor.multiple_of, "ffn_dim_multiplier": flavor.ffn_dim_multiplier}
    return {"ffn_dim": intermediate}


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
    tied = config.get("tie_word_embeddings", False)
    _refuse_unless(isinstance(tied, bool), f"config.json: tie_word_embeddings={tied!r} must be true or false")
    head_dim = config.get("head_dim")
    _refuse_unless(head_dim in (None, dim // n_heads) and dim % n_heads == 0,
                   f"config.json: head_dim={head_dim} with hidden_size={dim} and num_attention_heads={n_heads} "
                   "is not supported (our head size is hidden_size / num_attention_heads)")
    try:
        args = ModelArgs(
            dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, vocab_size=vocab_size,
            **_ffn_args(dim, intermediate),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=_rope_theta(config),
            max_seq_len=int(config.get("max_position_embeddings", 2048)), rope_scaling=_rope_scaling(config),
            tie_embeddings=tied,
        )
    except ValueError as exc:
        raise UnsupportedHFConfig(f"config.json: {exc}") from None
    _refuse_unless(ffn_hidden_dim(args) == intermediate,
                   f"config.json: intermediate_size={intermediate} cannot be expressed")
    return args
