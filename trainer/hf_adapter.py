"""State-dict adapter between our llama (:mod:`trainer.model`) and Hugging Face ``LlamaForCausalLM``.

Everything model-specific that a conversion needs lives here, beside the model; the tools
(``ckpt-convert``) only stream tensors through it. Keys are the model's own state-dict keys
(``layers.0.attention.wq.weight``), without the trainer's ``model.`` state prefix::

    tok_embeddings.weight                     model.embed_tokens.weight
    layers.N.attention.{wq,wk,wv,wo}.weight   model.layers.N.self_attn.{q,k,v,o}_proj.weight
    layers.N.feed_forward.{w1,w2,w3}.weight   model.layers.N.mlp.{gate,down,up}_proj.weight
    layers.N.attention_norm.weight            model.layers.N.input_layernorm.weight
    layers.N.ffn_norm.weight                  model.layers.N.post_attention_layernorm.weight
    norm.weight                               model.norm.weight
    output.weight                             lm_head.weight

Rotary convention. Our :func:`~trainer.model.apply_rope` rotates *adjacent* pairs ``(x[2i], x[2i+1])``
of each head by angle ``i`` (Meta's interleaved, complex-number layout); Hugging Face's
``rotate_half`` rotates ``(x[i], x[i + head_dim/2])``. The two are the same function of the
weights once the output rows of ``wq`` and ``wk`` are permuted within each head: row ``2i + j``
(``j`` in 0, 1) of a head goes to row ``j * head_dim/2 + i`` (:func:`permute_to_hf`, the ``permute``
of transformers' ``convert_llama_weights_to_hf.py``; :func:`permute_from_hf` is its inverse). ``wq``
is permuted per query head, ``wk`` per key/value head (grouped-query attention); shapes are kept.

Per-tensor functions (:func:`to_hf`, :func:`from_hf`) let a conversion stream one tensor at a
time. :func:`hf_config` / :func:`generation_config` write the ``config.json`` /
``generation_config.json`` of an export; :func:`args_from_hf_config` reads one back and refuses, with
an :class:`UnsupportedHFConfig` naming the key, what this model cannot represent (rope scaling,
biases, tied embeddings, other activations or head sizes). :func:`args_from_run_config` rebuilds a
run's :class:`~trainer.model.ModelArgs` from the config a trainer checkpoint records,
:func:`trainer_model_config` / :func:`trainer_flags` the config section and command-line flags that
make the trainer build a given model, and :func:`tokenizer_files` a run's tokenizer as Hugging Face
files.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import torch

from trainer.model import FLAVORS, ModelArgs, Transformer, ffn_hidden_dim, model_args

HF_ARCHITECTURE = "LlamaForCausalLM"
HF_MODEL_TYPE = "llama"

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
_OURS_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# Keys some Hugging Face checkpoints carry that are not weights (recomputed buffers).
HF_IGNORED = re.compile(r"^model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq$")


class UnsupportedHFConfig(ValueError):
    """A Hugging Face config (or checkpoint) that our llama cannot represent exactly."""


# ---------------------------------------------------------------------------------------------------
# Names


def hf_name(key: str) -> str:
    """Our state-dict key → the Hugging Face ``LlamaForCausalLM`` key (KeyError for a foreign key)."""
    if key in _TOP_KEYS:
        return _TOP_KEYS[key]
    match = _OURS_LAYER.match(key)
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


# ---------------------------------------------------------------------------------------------------
# The rotary row permutation


def permute_to_hf(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q or k projection from our interleaved rotary layout to Hugging Face's half-split
    one: within each of ``n_heads`` heads, row ``2i + j`` moves to ``j * head_dim/2 + i``."""
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} rows do not split into {n_heads} heads of even size")
    return weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def permute_from_hf(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of :func:`permute_to_hf`."""
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} rows do not split into {n_heads} heads of even size")
    return weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _rotary_heads(key: str, args: ModelArgs) -> int | None:
    """How many heads the rows of ``key`` (ours) hold when it is a rotary projection, else None."""
    match = _OURS_LAYER.match(key)
    if not match:
        return None
    return {"attention.wq.weight": args.n_heads, "attention.wk.weight": args.kv_heads}.get(match.group(2))


def to_hf(key: str, tensor: torch.Tensor, args: ModelArgs) -> tuple[str, torch.Tensor]:
    """One of our weights → ``(Hugging Face key, tensor)``; q/k rows permuted (same shape, a new
    tensor), every other tensor returned as is."""
    name = hf_name(key)
    heads = _rotary_heads(key, args)
    return name, tensor if heads is None else permute_to_hf(tensor, heads)


def from_hf(hf_key: str, tensor: torch.Tensor, args: ModelArgs) -> tuple[str, torch.Tensor]:
    """One Hugging Face ``LlamaForCausalLM`` weight → ``(our key, tensor)``; the inverse of :func:`to_hf`."""
    key = our_name(hf_key)
    heads = _rotary_heads(key, args)
    return key, tensor if heads is None else permute_from_hf(tensor, heads)


def expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Our state-dict keys and shapes for ``args`` (built on the meta device: nothing allocated)."""
    with torch.device("meta"):
        model = Transformer(args)
    return {key: tuple(value.shape) for key, value in model.state_dict().items()}


def shape_problems(shapes: dict[str, tuple[int, ...]], args: ModelArgs) -> list[str]:
    """What keeps ``shapes`` (our keys) from being the weights of a model built from ``args``:
    missing and unexpected keys and shape mismatches, as readable phrases (empty: they fit)."""
    expected = expected_shapes(args)
    problems = []
    missing = sorted(expected.keys() - shapes.keys())
    unexpected = sorted(shapes.keys() - expected.keys())
    if missing:
        problems.append(f"missing {_some(missing)}")
    if unexpected:
        problems.append(f"unexpected {_some(unexpected)}")
    for key in sorted(expected.keys() & shapes.keys()):
        if tuple(shapes[key]) != expected[key]:
            problems.append(f"{key} has shape {list(shapes[key])}, the model {list(expected[key])}")
    return problems


def _some(keys: list[str], limit: int = 3) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


# ---------------------------------------------------------------------------------------------------
# config.json and generation_config.json


def _special_ids(tokenizer: Any) -> tuple[int | None, int | None]:
    if tokenizer is None:
        from trainer.data import ByteTokenizer

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


# ---------------------------------------------------------------------------------------------------
# Model args from a Hugging Face config, or from a trainer run's config


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


def args_from_run_config(config: dict, *, vocab_size: int | None = None) -> ModelArgs:
    """The :class:`~trainer.model.ModelArgs` a trainer run built from its recorded config (the
    ``"config"`` of a checkpoint's user metadata), as :meth:`trainer.config.Config.model_args`
    builds them; ``vocab_size`` (the stored embedding's rows) stands in for the tokenizer's, which
    the run read from its file. Only the ``model`` section and ``training.seq_len`` are read, so a
    config written by another version of the trainer still works. ConfigError when they cannot."""
    from trainer.config import Config
    from trainer.config import ConfigError

    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise ConfigError("the recorded run config has no model section")
    subset: dict = {"model": config["model"]}
    seq_len = (config.get("training") or {}).get("seq_len")
    if seq_len is not None:
        subset["training"] = {"seq_len": seq_len}
    return Config.from_dict(subset).model_args(vocab_size)


def trainer_model_config(args: ModelArgs, *, tokenizer: str | None = None) -> dict | None:
    """The trainer's ``model`` config section that builds a model with ``args``' weights and
    numerics, or None when no flavor's fixed values (SwiGLU rounding, norm epsilon, rotary base)
    reproduce them. The context length is the run's own choice (``training.seq_len``)."""
    given = dict(dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads, n_kv_heads=args.kv_heads,
                 vocab_size=args.vocab_size)
    for name in FLAVORS:
        candidate = model_args(name, **given)
        if (ffn_hidden_dim(candidate), candidate.norm_eps, candidate.rope_theta) == \
                (ffn_hidden_dim(args), args.norm_eps, args.rope_theta):
            return {"name": "llama", "flavor": name, "vocab_size": args.vocab_size, "hidden_dim": args.dim,
                    "n_layers": args.n_layers, "n_heads": args.n_heads, "n_kv_heads": args.kv_heads,
                    "tokenizer": tokenizer}
    return None


def trainer_flags(section: dict) -> list[str]:
    """A ``model`` config section as trainer command-line flags (``--model.KEY VALUE``; unset keys left out)."""
    return [part for key, value in section.items() if value is not None and key != "name"
            for part in (f"--model.{key}", str(value))]


def tokenizer_files(path: str) -> tuple[dict[str, bytes], Any]:
    """The Hugging Face files of the run's tokenizer ``path`` (a tokenizer.json, or a folder holding
    one): ``tokenizer.json`` as it is and a ``tokenizer_config.json`` naming its BOS/EOS tokens, and
    the tokenizer as the trainer reads it (``bos_id``/``eos_id``). FileNotFoundError when it is gone."""
    from trainer.data import HFTokenizer

    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer file at {file}")
    tokenizer = HFTokenizer(file)
    raw = tokenizer._tok  # the tokenizers.Tokenizer
    config = {"tokenizer_class": "PreTrainedTokenizerFast",
              "bos_token": None if tokenizer.bos_id is None else raw.id_to_token(tokenizer.bos_id),
              "eos_token": None if tokenizer.eos_id is None else raw.id_to_token(tokenizer.eos_id)}
    return {"tokenizer.json": file.read_bytes(),
            "tokenizer_config.json": (json.dumps(config, indent=2) + "\n").encode()}, tokenizer


def describe(args: ModelArgs) -> str:
    """One line: the shapes that matter to a reader."""
    kv = f", {args.kv_heads} kv heads" if args.kv_heads != args.n_heads else ""
    return (f"dim {args.dim}, {args.n_layers} layers, {args.n_heads} heads{kv}, ffn {ffn_hidden_dim(args)}, "
            f"vocab {args.vocab_size}")


__all__ = [
    "HF_ARCHITECTURE", "HF_IGNORED", "UnsupportedHFConfig", "hf_name", "our_name", "permute_to_hf",
    "permute_from_hf", "to_hf", "from_hf", "expected_shapes", "shape_problems", "hf_config",
    "generation_config", "args_from_hf_config", "args_from_run_config", "trainer_model_config", "trainer_flags",
    "tokenizer_files", "describe",
    "dtype_name",
]
