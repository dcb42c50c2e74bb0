"""A trainer checkpoint's model as a Hugging Face ``LlamaForCausalLM`` directory, or as plain weights files.

Contract: :func:`export_hf` writes the weights under Hugging Face names with the rotary q/k rows
permuted (:mod:`trainer.hf.rotary`), sharded safetensors + index beyond ``max_shard_size``,
``config.json``, ``generation_config.json`` and the run's tokenizer files when it used a
tokenizer.json; :func:`export_weights` writes them under our own names as one torch.save /
safetensors file (or shards + index). Both read one whole tensor at a time through the engine's
consolidation (:mod:`ckpt.convert`: every chunk verified, deltas replayed) and leave the output
whole or not at all; :func:`export_bytes` is what they write, for a progress bar. The model's
shapes come from the manifest (:func:`trainer.hf.run.model_args_of`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Iterator

import torch

from ckpt import CheckpointError, CheckpointExistsError, read_manifest
from ckpt.convert import TensorSpec, full_tensors, select_keys, step_metadata, tensor_specs, write_output
from ckpt.format import Manifest
from ckpt.storage import Location, is_url, locate
from ..config.schema import is_byte_tokenizer
from .config import generation_config, hf_config
from .mixtral import check as check_mixtral
from .mixtral import expert_parts, mixtral_config, moe_name
from .names import hf_name
from .rotary import to_hf
from .byte_tokenizer import byte_tokenizer_files
from .run import PREFIX, model_args_of, tokenizer_files
from ..model import ModelArgs

DEFAULT_HF_SHARD = 5 * 10**9
"""``max_shard_size`` of a Hugging Face export (transformers' own default, 5 GB)."""


def _natural(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


@dataclass
class Export:
    """What an export wrote (the CLI's summary line)."""

    weight_files: list[str]  # the weights files written
    files: list[str]  # every path written
    args: ModelArgs
    tensors: int
    nbytes: int
    note: str = ""  # what the output lacks, for the summary line (e.g. no tokenizer file)


def export_bytes(manifest: Manifest, dtype: torch.dtype | None = None) -> int:
    """The tensor bytes an export of ``manifest``'s model writes (floats as ``dtype``)."""
    return sum(s.nbytes for s in tensor_specs(manifest, select_keys(manifest, "model"), dtype=dtype))


def export_hf(source: str | Location, dst: str | os.PathLike, *, dtype: torch.dtype | None = None,
              max_shard_size: int = DEFAULT_HF_SHARD, overwrite: bool = False,
              progress: Callable[[int], object] | None = None, manifest: Manifest | None = None) -> Export:
    """The checkpoint ``source`` as a Hugging Face ``LlamaForCausalLM`` directory ``dst`` (local), a
    mixture of experts as ``MixtralForCausalLM`` (:mod:`trainer.hf.mixtral`), published whole
    (:func:`ckpt.convert.write_output` with the config files beside the shards)."""
    source = locate(source)
    manifest = read_manifest(source) if manifest is None else manifest
    if is_url(dst):
        raise CheckpointError(f"{dst}: a Hugging Face export is written to a local directory")
    target = locate(os.fspath(dst))
    if target.exists() and not overwrite:
        raise CheckpointExistsError(f"{target} already exists", path=str(target))
    args = model_args_of(manifest, source)
    if args.is_moe:
        check_mixtral(args)  # what Mixtral's layout cannot hold, before anything is written
    tied = {PREFIX + "output.weight"} if args.tie_embeddings else set()  # lm_head is embed_tokens
    keys = sorted(set(select_keys(manifest, "model")) - tied, key=lambda k: _natural(_hf_key(k[len(PREFIX):])))
    specs = [spec for s in _in_order(tensor_specs(manifest, keys, dtype=dtype), keys)
             for spec in _hf_specs(s, args)]
    out_dtype = next((s.dtype for s in specs if s.dtype.is_floating_point), torch.float32)

    files, note, tokenizer = _tokenizer_export(manifest)
    config = hf_config(args, out_dtype, tokenizer=tokenizer)
    files["config.json"] = _json(mixtral_config(config, args) if args.is_moe else config)
    files["generation_config.json"] = _json(generation_config(args, tokenizer=tokenizer))

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for key, tensor in full_tensors(source, keys, dtype=dtype, manifest=manifest):
            parts = expert_parts(key[len(PREFIX):], args.num_experts) if args.is_moe else None
            if parts is None:
                yield _to_hf(key[len(PREFIX):], tensor, args)
            else:  # a 3-D expert weight: one Hugging Face tensor per expert (trainer.hf.mixtral)
                yield from zip(parts, (part.contiguous() for part in tensor.unbind(0)))

    written = write_output(target, specs, stream(), format="safetensors", max_shard_size=max_shard_size,
                           metadata=step_metadata(manifest), progress=progress, overwrite=overwrite,
                           extra_files=files)
    weights = [p for p in written if p.endswith(".safetensors")]
    return Export(weights, written, args, len(specs), sum(s.nbytes for s in specs), note)


def _hf_key(key: str) -> str:
    """Our key's Hugging Face name (a MoE key: Mixtral's, :mod:`trainer.hf.mixtral`)."""
    return moe_name(key) or hf_name(key)


def _to_hf(key: str, tensor: torch.Tensor, args: ModelArgs) -> tuple[str, torch.Tensor]:
    name = moe_name(key)
    return (name, tensor) if name is not None else to_hf(key, tensor, args)


def _hf_specs(spec: TensorSpec, args: ModelArgs) -> list[TensorSpec]:
    """The Hugging Face tensor(s) one of our tensors becomes: itself renamed, or one per expert."""
    key = spec.key[len(PREFIX):]
    parts = expert_parts(key, args.num_experts) if args.is_moe else None
    if parts is None:
        return [TensorSpec(_hf_key(key), spec.dtype, spec.shape)]
    return [TensorSpec(name, spec.dtype, tuple(spec.shape[1:])) for name in parts]


def _in_order(specs: list[TensorSpec], keys: list[str]) -> list[TensorSpec]:
    by_key = {s.key: s for s in specs}
    return [by_key[k] for k in keys]


def _json(doc: dict) -> bytes:
    return (json.dumps(doc, indent=2) + "\n").encode()


def _tokenizer_export(manifest: Manifest) -> tuple[dict[str, bytes], str, object]:
    """(files, note, tokenizer) for the run's tokenizer: its Hugging Face files when it used a
    tokenizer.json that still exists; none (and why, in the note) otherwise."""
    user = manifest.user or {}
    config = user.get("config")
    model = config.get("model") if isinstance(config, dict) else None
    path = model.get("tokenizer") if isinstance(model, dict) else None
    origin = user.get("converted_from")
    if is_byte_tokenizer(path) and isinstance(origin, dict) and origin.get("format") == "torchtitan":
        return {}, (f"no tokenizer file: torchtitan keeps its tokenizer outside its checkpoint ({origin.get('path')}): "
                    "copy the run's hf_assets_path tokenizer files here and set the special token ids"), \
            SimpleNamespace(bos_id=None, eos_id=None)
    if is_byte_tokenizer(path) and isinstance(origin, dict) and isinstance(origin.get("config"), dict):
        ids = SimpleNamespace(bos_id=origin["config"].get("bos_token_id"), eos_id=origin["config"].get("eos_token_id"))
        return {}, f"no tokenizer file: {origin.get('path')}, which this was imported from, had none", ids
    if is_byte_tokenizer(path):
        try:
            files, ids = byte_tokenizer_files()
        except ImportError:
            return {}, ("no tokenizer file: the run used the built-in byte tokenizer (ids 0-255 are UTF-8 bytes, "
                        "256 BOS, 257 EOS) and writing it needs the `tokenizers` package"), None
        return files, "the built-in byte tokenizer written as tokenizer.json", ids
    try:
        files, tokenizer = tokenizer_files(path)
    except Exception as exc:  # gone, unreadable, no `tokenizers` package, or its own parse errors
        return {}, f"no tokenizer file: the run's tokenizer {path} cannot be read here ({exc})", None
    return files, f"tokenizer {path} copied", tokenizer


def export_weights(source: str | Location, dst: str | os.PathLike, *, format: str, dtype: torch.dtype | None = None,
                   max_shard_size: int | None = None, overwrite: bool = False,
                   progress: Callable[[int], object] | None = None, manifest: Manifest | None = None) -> Export:
    """The model weights of checkpoint ``source`` under our own names (no ``model.`` prefix) as one
    ``format`` file (or shards + index in a directory with ``max_shard_size``)."""
    source = locate(source)
    manifest = read_manifest(source) if manifest is None else manifest
    keys = select_keys(manifest, "model")
    specs = [TensorSpec(s.key[len(PREFIX):], s.dtype, s.shape) for s in tensor_specs(manifest, keys, dtype=dtype)]
    metadata = step_metadata(manifest)
    try:
        args = model_args_of(manifest, source)
        metadata["ckpt.model_args"] = json.dumps(dataclasses.asdict(args))
    except CheckpointError:
        args = None  # plain weights need no model config; the header just does not describe it

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for key, tensor in full_tensors(source, keys, dtype=dtype, manifest=manifest):
            yield key[len(PREFIX):], tensor

    written = write_output(dst, specs, stream(), format=format, max_shard_size=max_shard_size, overwrite=overwrite,
                           metadata=metadata, progress=progress)
    weights = [p for p in written if not p.endswith(".index.json")]
    return Export(weights, written, args, len(specs), sum(s.nbytes for s in specs))
