"""Tiny Hugging Face llama directories (``config.json`` + safetensors weights under Hugging Face
names, written without transformers) that the import tests convert or damage."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from trainer.hf import expected_shapes, hf_config, hf_name
from trainer.model import ModelArgs

TINY = ModelArgs(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=32, multiple_of=16)


def save_tiny(path: Path, *, sharded: bool = False, **overrides) -> Path:
    """A loadable llama directory of :data:`TINY` at ``path``; ``overrides`` replace config.json
    keys. ``sharded``: two weights files and a ``model.safetensors.index.json``."""
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    weights = {hf_name(key): torch.randn(shape, generator=gen) for key, shape in expected_shapes(TINY).items()}
    config = {**hf_config(TINY, torch.float32), **overrides}
    (path / "config.json").write_text(json.dumps(config))
    if not sharded:
        save_file(weights, str(path / "model.safetensors"))
        return path
    names = sorted(weights)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in halves.items():
        save_file({k: weights[k] for k in keys}, str(path / file))
    index = {"metadata": {}, "weight_map": {k: file for file, keys in halves.items() for k in keys}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


def write_config(path: Path, text: str) -> None:
    """Replace ``config.json`` with ``text`` as it is (hostile JSON: NaN, 1e400, deep nesting)."""
    (path / "config.json").write_text(text)
