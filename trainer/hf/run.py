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
    return (f"dim {args.dim}, {args.n_layers} layers, {args.n_heads} heads{kv}, ffn {ffn_hidden_dim(args)}, "
            f"vocab {args.vocab_size}")


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
                              f"({describe(args)}): {'; '.join(problems)}")
    return args
