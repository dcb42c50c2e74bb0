"""Our side of a conversion: the model a trainer run (or its checkpoint) holds, and what rebuilds it.

Contract: :func:`model_args_of` gives the :class:`~trainer.model.ModelArgs` of the model a trainer
checkpoint holds (recorded exactly by an import, else rebuilt from the run config it records,
:func:`args_from_run_config`) and checks the stored weights' shapes against them
(:func:`shape_problems`), raising CheckpointError; :func:`trainer_model_config` /
:func:`trainer_flags` are the config section and command-line flags that make the trainer build a
given model; :func:`tokenizer_files` is a run's tokenizer as Hugging Face files; :func:`describe`
one readable line of shapes.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from ckpt import CheckpointError
from ckpt.format import Manifest
from ..config import Config, ConfigError
from ..data import HFTokenizer, tokenizer_file
from ..flavors import expert_hidden_dim
from ..model import FLAVORS, ModelArgs, Transformer, ffn_hidden_dim, model_args

PREFIX = "model."
"""The trainer's state key for the model: its weights are the checkpoint's tensors under ``model.``."""


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


def args_from_run_config(config: dict, *, vocab_size: int | None = None) -> ModelArgs:
    """The :class:`~trainer.model.ModelArgs` a trainer run built from its recorded config (the
    ``"config"`` of a checkpoint's user metadata), as :meth:`trainer.config.Config.model_args`
    builds them; ``vocab_size`` (the stored embedding's rows) stands in for the tokenizer's, which
    the run read from its file. Only the ``model`` section and ``training.seq_len`` are read, so a
    config written by another version of the trainer still works. ConfigError when they cannot."""
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise ConfigError("the recorded run config has no model section")
    subset: dict = {"model": config["model"]}
    seq_len = (config.get("training") or {}).get("seq_len")
    if seq_len is not None:
        subset["training"] = {"seq_len": seq_len}
    return Config.from_dict(subset).model_args(vocab_size)


def _numerics(args: ModelArgs) -> dict:
    """What the trainer's explicit ``model.*`` numerics keys would be to build ``args``."""
    scaling = args.rope_scaling
    return {"ffn_dim": ffn_hidden_dim(args), "norm_eps": args.norm_eps, "rope_theta": args.rope_theta,
            "rope_scaling": "default" if scaling is None else "llama3",
            "rope_factor": None if scaling is None else scaling.factor,
            "rope_low_freq_factor": None if scaling is None else scaling.low_freq_factor,
            "rope_high_freq_factor": None if scaling is None else scaling.high_freq_factor,
            "rope_original_max_positions": None if scaling is None else scaling.original_max_position_embeddings,
            "tie_embeddings": args.tie_embeddings}


def _experts(args: ModelArgs) -> dict:
    """The trainer's mixture-of-experts keys that build ``args``' experts (none for a dense model)."""
    if not args.is_moe:
        return {}
    return {"num_experts": args.num_experts, "top_k": args.top_k, "num_shared_experts": args.num_shared_experts,
            "moe_ffn_dim": expert_hidden_dim(args), "moe_aux_loss_coef": args.moe_aux_loss_coef}


def trainer_model_config(args: ModelArgs, *, tokenizer: str | None = None,
                         max_seq_len: bool = False) -> dict | None:
    """The trainer's ``model`` config section that builds a model with ``args``' weights and
    numerics: the flavor needing the fewest explicit keys, with the shapes and whichever of
    ``ffn_dim``, ``norm_eps``, ``rope_theta``, ``rope_scaling`` (+ its factors) and ``tie_embeddings``
    differ from it. With ``max_seq_len`` the context length (``model.max_seq_len``) is kept too
    when it differs from the flavor's; otherwise it is the run's own choice (``training.seq_len``).
    None when no section rebuilds them (not expected: every numeric has its key)."""
    given = dict(dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads, n_kv_heads=args.kv_heads,
                 vocab_size=args.vocab_size)
    wanted = _numerics(args)
    best = None
    for name in FLAVORS:
        have = _numerics(model_args(name, **given))
        extra = {key: value for key, value in wanted.items() if have[key] != value and value is not None}
        if "rope_scaling" not in extra and wanted["rope_scaling"] == "llama3" and \
                any(key.startswith("rope_") for key in extra):
            extra["rope_scaling"] = "llama3"
        if max_seq_len and FLAVORS[name].max_seq_len != args.max_seq_len:
            extra["max_seq_len"] = args.max_seq_len
        if best is None or len(extra) < len(best[1]):
            best = (name, extra)
    name, extra = best
    section = {"name": "llama", "flavor": name, "vocab_size": args.vocab_size, "hidden_dim": args.dim,
               "n_layers": args.n_layers, "n_heads": args.n_heads, "n_kv_heads": args.kv_heads, **extra,
               **_experts(args), "tokenizer": tokenizer}
    try:
        rebuilt = Config.from_dict({"model": {**section, "tokenizer": None},
                                    "training": {"seq_len": min(args.max_seq_len, 128)}}).model_args(args.vocab_size)
    except ConfigError:
        return None
    if _numerics(rebuilt) != wanted or (max_seq_len and rebuilt.max_seq_len != args.max_seq_len) or \
            _experts(rebuilt) != _experts(args):
        return None
    return section


def trainer_flags(section: dict) -> list[str]:
    """A ``model`` config section as trainer command-line flags (``--model.KEY VALUE``; unset keys left out)."""
    return [part for key, value in section.items() if value is not None and key != "name"
            for part in (f"--model.{key}", str(value))]


def tokenizer_files(path: str) -> tuple[dict[str, bytes], Any]:
    """The Hugging Face files of the run's tokenizer ``path`` (a tokenizer.json, or a folder holding
    one): ``tokenizer.json`` as it is and a ``tokenizer_config.json`` naming its BOS/EOS tokens, and
    the tokenizer as the trainer reads it (``bos_id``/``eos_id``). FileNotFoundError when it is gone."""
    file = tokenizer_file(path)
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
    ffn = (f"{args.num_experts} experts of ffn {expert_hidden_dim(args)}, {args.top_k} per token" if args.is_moe
           else f"ffn {ffn_hidden_dim(args)}")
    return f"dim {args.dim}, {args.n_layers} layers, {args.n_heads} heads{kv}, {ffn}, vocab {args.vocab_size}"


def model_args_of(manifest: Manifest, source: object = "the checkpoint") -> ModelArgs:
    """The :class:`ModelArgs` of the model a trainer checkpoint holds: recorded exactly by
    ``--from hf`` (user metadata ``model_args``), else rebuilt from the run's config (user metadata
    ``config``) with the vocabulary the stored embedding has; the weights' shapes are checked
    against them."""
    user = manifest.user or {}
    embedding = manifest.tensors.get(PREFIX + "tok_embeddings.weight")
    vocab = embedding.shape[0] if embedding is not None and len(embedding.shape) == 2 else None
    try:
        if isinstance(user.get("model_args"), dict):
            args = ModelArgs(**user["model_args"])
        elif isinstance(user.get("config"), dict):
            args = args_from_run_config(user["config"], vocab_size=vocab)
        else:
            raise CheckpointError(f"{source}: its manifest records no run config (user metadata 'config'), so "
                                  "the model's shapes and heads are unknown; is it a trainer checkpoint?")
    except (TypeError, ValueError) as exc:  # ConfigError, a bad ModelArgs
        raise CheckpointError(f"{source}: the run config it records cannot be used: {exc}") from None
    shapes = {key[len(PREFIX):]: tuple(e.shape) for key, e in manifest.tensors.items() if key.startswith(PREFIX)}
    problems = shape_problems(shapes, args)
    if problems:
        raise CheckpointError(f"{source}: its model weights do not match the recorded config "
                              f"({describe(args)}): {'; '.join(problems[:3])}"
                              + (f"; and {len(problems) - 3} more" if len(problems) > 3 else ""))
    return args
