"""The model a dry run plans for: its shapes, its parameters on the meta device, and what of them one rank holds.

Contract: nothing is allocated (:func:`meta_model` builds on the meta device). :func:`model_args_for`
derives the shapes as the trainer does (the tokenizer's vocabulary unless ``model.vocab_size`` is
given); :func:`rank_params` counts, per pipeline rank, the parameters after TP (the split of
:data:`trainer.parallel.TP_TOP` / :data:`~trainer.parallel.TP_BLOCK`, via :func:`tp_shape`) and
after FSDP2 sharding (:func:`shard_numel`), the fullest rank's when a split is uneven;
:func:`model_info` is the plan's ``model`` section, checked against Meta's Llama-2 counts.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from .. import model as model_mod
from ..config import Config, ConfigError
from ..config.schema import is_byte_tokenizer
from ..data import load_tokenizer
from ..model import BYTE_VOCAB_SIZE, FLAVORS, ModelArgs, ffn_hidden_dim
from ..parallel import tp_dim
from .layout import Layout

LLAMA2_PARAMS = {"7b": 6_738_415_616, "13b": 13_015_864_320, "70b": 68_976_648_192}
"""Parameters of Meta's Llama-2 checkpoints (vocabulary 32000), to check the flavors against."""


def model_args_for(cfg: Config) -> ModelArgs:
    """The model's shapes as the trainer derives them (the tokenizer's vocabulary unless given)."""
    vocab = None
    if cfg.model.vocab_size is None:
        if is_byte_tokenizer(cfg.model.tokenizer):
            vocab = BYTE_VOCAB_SIZE
        else:
            try:
                vocab = load_tokenizer(cfg.model.tokenizer).vocab_size
            except (OSError, ImportError, ValueError) as exc:
                raise ConfigError(f"model.tokenizer={cfg.model.tokenizer!r} cannot be read: {exc}") from None
    return cfg.model_args(vocab)


def meta_model(args: ModelArgs) -> model_mod.Transformer:
    """The model on the meta device: shapes, no storage."""
    with torch.device("meta"):
        return model_mod.Transformer(args)


def tp_shape(name: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """The shape one TP rank holds (the fullest one when the split is uneven)."""
    dim = tp_dim(name)
    if dim is None or tp == 1:
        return tuple(shape)
    out = list(shape)
    out[dim] = -(-out[dim] // tp)
    return tuple(out)


def shard_numel(shape: tuple[int, ...], shards: int) -> int:
    """Elements of the fullest FSDP2 shard of a tensor of ``shape`` (dim 0 split in ``shards``)."""
    if not shape:
        return 1
    return -(-shape[0] // shards) * math.prod(shape[1:])


def _owner_stage(name: str, ranges: list[range]) -> int:
    if name.startswith("layers."):
        layer = int(name.split(".")[1])
        return next(i for i, r in enumerate(ranges) if layer in r)
    return 0 if name.startswith("tok_embeddings.") else len(ranges) - 1


def rank_params(model: torch.nn.Module, lay: Layout, ranges: list[range]) -> tuple[list[dict[str, int]], int]:
    """Per pipeline rank: ``local`` (P_l, after TP/PP), ``stored`` (P, after FSDP), ``linear``
    (the Linear weights' P_l), ``root`` (P_l outside the blocks), ``head`` (P_l of the final norm
    and output), ``largest`` (the largest stored tensor) and ``tensors``; and the P_l of one layer
    (layer 0)."""
    per = [dict(local=0, stored=0, linear=0, root=0, tensors=0, largest=0, head=0) for _ in range(lay.pp)]
    layer_local = 0
    for name, p in model.named_parameters():
        rank = _owner_stage(name, ranges) % lay.pp
        shape = tp_shape(name, tuple(p.shape), lay.tp)
        experts = getattr(lay, "ep", 1) > 1 and ".moe.experts." in name
        if experts:  # expert parallel: num_experts / ep experts a rank, not FSDP-sharded further
            shape = (shape[0] // lay.ep, *shape[1:])
        local = math.prod(shape)
        d = per[rank]
        d["local"] += local
        stored = local if experts else shard_numel(shape, lay.shard)
        d["stored"] += stored
        d["largest"] = max(d["largest"], stored)
        d["tensors"] += 1
        if name.startswith(("output.", "norm.")):
            d["head"] += local
        if p.dim() == 2 and not name.startswith("tok_embeddings."):
            d["linear"] += local
        if not name.startswith("layers."):
            d["root"] += local
        elif name.startswith("layers.0."):
            layer_local += local
    return per, layer_local


def _breakdown(model: torch.nn.Module) -> dict[str, int]:
    counts = {"embedding": 0, "attention": 0, "feed_forward": 0, "norms": 0, "output": 0}
    if any(".moe." in name for name, _ in model.named_parameters()):
        counts["experts"] = counts["router_and_shared"] = 0
    for name, p in model.named_parameters():
        if name.startswith("tok_embeddings."):
            counts["embedding"] += p.numel()
        elif name.startswith("output."):
            counts["output"] += p.numel()
        elif ".attention." in name:
            counts["attention"] += p.numel()
        elif ".feed_forward." in name:
            counts["feed_forward"] += p.numel()
        elif ".moe.experts." in name:
            counts["experts"] += p.numel()
        elif ".moe." in name:
            counts["router_and_shared"] += p.numel()
        else:
            counts["norms"] += p.numel()
    return counts


def model_info(cfg: Config, args: ModelArgs, model: torch.nn.Module, total: int, notes: list[str]) -> dict[str, Any]:
    """The plan's ``model`` section; a flavor whose count is not Llama-2's gets a note saying why."""
    flavor = cfg.model.flavor.lower()
    info = {
        "name": cfg.model.name, "flavor": cfg.model.flavor, "args": dataclasses.asdict(args),
        "ffn_hidden_dim": ffn_hidden_dim(args), "head_dim": args.head_dim, "params": total,
        "params_by_module": _breakdown(model), "param_tensors": len(list(model.parameters())),
        "built_on": "meta",
    }
    reference = LLAMA2_PARAMS.get(flavor)
    if reference is not None:
        info["llama2_reference"] = reference
        if total != reference:
            why = []
            base = FLAVORS[flavor]
            for key in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads"):
                if getattr(args, key) != getattr(base, key):
                    why.append(f"{key} {getattr(args, key)} instead of {getattr(base, key)}")
            notes.append(f"{total:,} parameters, not Llama-2 {flavor.upper()}'s {reference:,} "
                         f"({total - reference:+,}): " + (", ".join(why) or "shapes differ"))
    return info
