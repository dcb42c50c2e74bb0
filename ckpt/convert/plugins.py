"""A plug-in's checkpoint as model weights: steps written by ``ckpt.integrations.deepspeed``,
``.lightning`` and ``.hf``, under the names that framework's model class takes (``ckpt-convert``).

Contract: :func:`open_plugin_step` says whether ``src`` is such a step and, if so, returns a
:class:`PluginStep`: the framework, the checkpoint read, its step, the weights' specs and a stream
of them (one tensor at a time, every chunk verified, deltas replayed: :mod:`.consolidate`) and,
for a transformers model, the ``config.json`` the HF plug-in recorded. None: not a plug-in's step
(our trainer's, a torchtitan one, or no checkpoint at all). Nothing is unpickled and none of the
frameworks is imported: the trees are read from their JSON structure (:mod:`ckpt.integrations._tree`).

What each framework's weights are (the keys ``model.load_state_dict`` of the same class takes):

    deepspeed  ``engine.module.state_dict()``: SRC its save_dir (the tag ``latest`` names, or
               ``global_step<N>`` with ``step``), a tag directory or its model-states checkpoint. With
               ZeRO 1/2 the parameters are the fp32 masters joined from every rank's partition, as
               DeepSpeed's ``zero_to_fp32.py`` joins them (float buffers as fp32, shared parameters
               repeated; one parameter group held at a time); without ZeRO the module as saved. ZeRO-3
               and model-parallel (mp > 1) steps are refused.
    lightning  ``checkpoint["state_dict"]`` (``LightningModule.load_state_dict``): SRC a checkpoint
               (``last.ckpt``, ``epoch=0-step=10.ckpt``; ``CkptModelParallelStrategy``'s sharded ones
               consolidated) or their folder (``last.ckpt``, or the one at ``step``).
    hf         the Trainer's ``model.state_dict()`` (``from_pretrained``): SRC our root (``<output_dir>/ckpt``,
               newest step or ``step``), one step, a ``checkpoint-N`` folder the callback wrote, or the
               output_dir; the model's ``config.json`` as the callback recorded it (value ``model_config``).
"""

from __future__ import annotations

import json
import math
import os
import re
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from ..errors import CheckpointError, CheckpointNotFoundError
from ..format import Manifest
from ..integrations._tree import STRUCTURE, decode_tree
from ..read.committed import read_manifest
from ..root import resolve_checkpoint
from ..storage import is_url
from .consolidate import converted_dtype, full_tensors, tensor_specs
from .export import step_metadata, write_output
from .formats import TensorSpec

HF_CONFIG_VALUE = "model_config"
"""The value under which ``ckpt.integrations.hf`` records the model's ``config.json`` (a dict)."""

_DS_MODEL = "mp_rank_00_model_states.pt"
_DS_OPTIM = re.compile(r"^(?:\w+_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
_MAX_RANKS = 1 << 16  # a dp_world_size beyond this is not a real run's


@dataclass
class PluginStep:
    """A plug-in's checkpoint, its model weights located (see the module docstring)."""

    framework: str  # "deepspeed", "lightning", "hf"
    path: str  # the checkpoint (DeepSpeed: the tag directory)
    manifest: Manifest  # the checkpoint's (DeepSpeed: the model states')
    specs: Callable[[torch.dtype | None], list[TensorSpec]]  # the weights written, floats as dtype
    tensors: Callable[[torch.dtype | None], Iterator[tuple[str, torch.Tensor]]]  # in the specs' order
    takes: str  # what loads them, for the summary line
    config: dict | None = None  # a transformers model's config.json (HF plug-in)

    @property
    def step(self) -> int | None:
        return self.manifest.step


def open_plugin_step(src: str | os.PathLike, step: int | None = None) -> PluginStep | None:
    """The plug-in step ``src`` names (``step``: which one of a folder), or None (see the module docstring)."""
    if is_url(os.fspath(src)):
        return None  # the plug-ins write local paths
    path = Path(src)
    if path.is_dir() and not (path / "manifest.json").is_file():
        tag = _deepspeed_tag(path, step)
        if tag is not None:
            return _deepspeed(tag)
        path = _lightning_in(path, step) or _hf_root(path, step) or path
    try:
        location = resolve_checkpoint(path, step)
        manifest = read_manifest(location)
    except CheckpointError:
        return None
    tree = _structure(manifest)
    if "ds_version" in tree and "module" in tree:
        return _deepspeed(Path(str(location)).parent)
    if "pytorch-lightning_version" in tree or f"lightning.{STRUCTURE}" in manifest.values:
        return _lightning(str(location), manifest, tree)
    if "trainer_state" in manifest.values and any(k.startswith("model.") for k in manifest.tensors):
        return _hf(str(location), manifest)
    return None


def export_plugin_step(plugin: PluginStep, dst: str | os.PathLike, *, format: str, dtype: torch.dtype | None = None,
                       max_shard_size: int | None = None, overwrite: bool = False,
                       progress: Callable[[int], object] | None = None) -> list[str]:
    """Write ``plugin``'s weights to ``dst``: ``format`` ``"torch"`` / ``"safetensors"`` (one file, or
    shards + index with ``max_shard_size``), or ``"hf"``: a directory ``from_pretrained`` reads (safetensors
    shards beside the recorded ``config.json``), for a transformers model only. Returns the paths written."""
    extra = None
    if format == "hf":
        if plugin.config is None:
            raise CheckpointError(_not_hf(plugin), path=plugin.path)
        config = dict(plugin.config)
        if dtype is not None:
            config["dtype"] = config["torch_dtype"] = str(dtype).removeprefix("torch.")
        extra = {"config.json": (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()}
        format, max_shard_size = "safetensors", max_shard_size or 5 * 10**9
    metadata = {**step_metadata(plugin.manifest), "ckpt.framework": plugin.framework}
    return write_output(dst, plugin.specs(dtype), plugin.tensors(dtype), format=format, max_shard_size=max_shard_size,
                        overwrite=overwrite, metadata=metadata, progress=progress, extra_files=extra)


def _not_hf(plugin: PluginStep) -> str:
    why = ("records no model config (it was written before ckpt.integrations.hf recorded one)"
           if plugin.framework == "hf" else f"holds a model of the {plugin.framework} plug-in, not a transformers "
           "model with its config")
    return (f"{plugin.path} {why}: --to hf writes our trainer's llama and mixture-of-experts checkpoints and steps of "
            "ckpt.integrations.hf (a transformers model, its config.json recorded); export the weights with --to "
            f"safetensors or --to torch ({plugin.takes} takes them)")


# -- the frameworks' trees -----------------------------------------------------------------------------
class _Refs(dict):
    """A stored leaf stands for its key (nothing is read to decode the structure)."""

    def __missing__(self, key: str) -> str:
        return key


class _AnyObject(dict):
    """An allow-listed object comes back as a namespace of its attributes (never its class)."""

    def get(self, name, default=None):
        return types.SimpleNamespace

    def __bool__(self) -> bool:  # decode_tree takes an empty mapping for none given
        return True


def _structure(manifest: Manifest, prefix: str = "") -> dict:
    """The plain tree a plug-in stored (:func:`~ckpt.integrations._tree.encode_tree`), its stored
    leaves as their keys; empty when the checkpoint holds none."""
    entry = manifest.values.get(prefix + STRUCTURE)
    if entry is None or entry.encoding != "json" or not isinstance(entry.value, str):
        return {}
    try:
        tree = decode_tree(_Refs({STRUCTURE: entry.value}), _AnyObject())
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
        raise CheckpointError(f"its tree structure cannot be read: {exc}") from None
    return tree if isinstance(tree, dict) else {}


def _named(manifest: Manifest, refs: object, what: str) -> dict[str, str]:
    """``{name: stored key}`` of a state dict in a plug-in's tree, each key a tensor of the checkpoint."""
    if not isinstance(refs, dict) or not all(isinstance(k, str) and v in manifest.tensors for k, v in refs.items()):
        raise CheckpointError(f"{what} is not a state dict of stored tensors")
    return dict(refs)


def _renamed(path: str, manifest: Manifest, names: dict[str, str], framework: str, takes: str,
             config: dict | None = None) -> PluginStep:
    """A step whose weights are stored tensors renamed (``names``: output name -> stored key)."""
    stored = {key: name for name, key in names.items()}

    def specs(dtype):
        described = tensor_specs(manifest, names.values(), dtype=dtype)
        return [TensorSpec(stored[s.key], s.dtype, s.shape) for s in described]

    def tensors(dtype):
        for key, tensor in full_tensors(path, sorted(names.values()), dtype=dtype, manifest=manifest):
            yield stored[key], tensor

    return PluginStep(framework, path, manifest, specs, tensors, takes, config)


def _lightning(path: str, manifest: Manifest, tree: dict) -> PluginStep:
    if "state_dict" in tree:  # CkptCheckpointIO: the checkpoint dict as one tree
        names = _named(manifest, tree["state_dict"], f"{path}: its state_dict")
    else:  # CkptModelParallelStrategy: the module's (sharded) state under "state_dict."
        names = {manifest.paths.get(k, (k,))[-1]: k for k in manifest.tensors if k.startswith("state_dict.")}
    return _renamed(path, manifest, names, "lightning", "LightningModule.load_state_dict")


def _lightning_in(folder: Path, step: int | None) -> Path | None:
    """In a ModelCheckpoint folder: ``last.ckpt`` (``step`` None) or the newest checkpoint at ``step``."""
    if step is None and (folder / "last.ckpt" / "manifest.json").is_file():
        return folder / "last.ckpt"
    found = []
    for child in folder.glob("*.ckpt"):
        try:
            manifest = read_manifest(str(child))
        except CheckpointError:
            continue
        if "pytorch-lightning_version" in _structure(manifest) and (step is None or manifest.step == step):
            found.append(((manifest.step or -1, manifest.created), child))
    return max(found)[1] if found else None


def _hf(path: str, manifest: Manifest) -> PluginStep:
    names = {k[len("model."):]: k for k in manifest.tensors if k.startswith("model.")}
    entry = manifest.values.get(HF_CONFIG_VALUE)
    config = entry.value if entry is not None and isinstance(entry.value, dict) else None
    return _renamed(path, manifest, names, "hf", "the model's load_state_dict / from_pretrained", config)


def _hf_root(folder: Path, step: int | None) -> Path | None:
    """The HF callback's root for its ``checkpoint-N`` folder (then step N) or its output_dir."""
    match = re.fullmatch(r"checkpoint-(\d+)", folder.name)
    if match and (folder.parent / "ckpt").is_dir():
        wanted = int(match.group(1))
        if step not in (None, wanted):
            raise CheckpointNotFoundError(f"{folder} is step {wanted}, not step {step}", path=str(folder))
        return folder.parent / "ckpt" / f"step-{wanted:08d}"
    return folder / "ckpt" if (folder / "ckpt").is_dir() else None


# -- DeepSpeed -------------------------------------------------------------------------------------------
def _deepspeed_tag(folder: Path, step: int | None) -> Path | None:
    """A DeepSpeed tag directory: ``folder`` itself, or the tag of its save_dir (``latest``, or
    ``global_step<step>``); None: neither."""
    if (folder / _DS_MODEL / "manifest.json").is_file():
        return folder
    if not (folder / "latest").is_file():
        return None
    if step is not None:
        tag = folder / f"global_step{step}"
        if not tag.is_dir():
            raise CheckpointNotFoundError(f"{folder} holds no DeepSpeed tag global_step{step}", path=str(folder))
        return tag
    name = (folder / "latest").read_text(errors="replace")[:256].strip()
    if not name or "/" in name or name in (".", ".."):
        raise CheckpointError(f"{folder / 'latest'} does not name a tag", path=str(folder))
    return folder / name


def _deepspeed(tag: Path) -> PluginStep:
    path = str(tag / _DS_MODEL)
    try:
        manifest = read_manifest(path)
    except CheckpointNotFoundError:
        raise CheckpointNotFoundError(f"{tag} holds no {_DS_MODEL} of ours (mp_rank_00)", path=str(tag)) from None
    tree = _structure(manifest)
    module = _named(manifest, tree.get("module"), f"{path}: its module")
    takes = "the engine's module.load_state_dict"
    if _int(tree.get("mp_world_size", 1), "mp_world_size") != 1:
        raise CheckpointError(f"{tag}: model-parallel DeepSpeed steps (mp_world_size > 1) are not converted", path=path)
    stage = ((tree.get("ds_config") or {}).get("zero_optimization") or {}).get("stage", 0)
    if stage == 0:
        return _renamed(path, manifest, module, "deepspeed", takes)
    if stage == 3:
        raise CheckpointError(f"{tag}: ZeRO-3 steps are not converted (the plug-in was not run with ZeRO-3 here)",
                              path=path)
    return _deepspeed_masters(tag, path, manifest, tree, module, takes)


def _int(value: object, what: str, limit: int = 1 << 62) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise CheckpointError(f"DeepSpeed's {what} is {value!r}, not a count")
    return value


def _deepspeed_masters(tag: Path, path: str, manifest: Manifest, tree: dict, module: dict[str, str],
                       takes: str) -> PluginStep:
    """ZeRO 1/2: buffers from the module, parameters from the fp32 partitions, as zero_to_fp32.py joins them."""
    ranks = _int(tree.get("dp_world_size"), "dp_world_size", _MAX_RANKS)
    optim = {int(m.group(1)): tag / name for name in os.listdir(tag) if (m := _DS_OPTIM.match(name))}
    if sorted(optim) != list(range(ranks)):
        raise CheckpointError(f"{tag}: expected the optimizer states of {ranks} ranks, found ranks {sorted(optim)}",
                              path=str(tag))
    partitions = []  # per rank: (its checkpoint, its manifest, the keys of its fp32 partition per group)
    for rank in range(ranks):
        rank_manifest = read_manifest(str(optim[rank]))
        state = _structure(rank_manifest).get("optimizer_state_dict") or {}
        groups = state.get("single_partition_of_fp32_groups")
        if not isinstance(groups, list) or not all(g in rank_manifest.tensors for g in groups):
            raise CheckpointError(f"{optim[rank]}: no fp32 partitions (single_partition_of_fp32_groups)")
        partitions.append((str(optim[rank]), rank_manifest, groups, state.get("param_alignment_paddings")))
    shapes = tree.get("param_shapes")
    if not isinstance(shapes, list) or len(shapes) != len(partitions[0][2]):
        raise CheckpointError(f"{path}: param_shapes does not match the optimizer's parameter groups")
    buffers = [n for n in tree.get("buffer_names") or () if n in module]
    frozen = _named(manifest, tree.get("frozen_param_fragments") or {}, f"{path}: its frozen parameters")
    shared = {k: v for k, v in (tree.get("shared_params") or {}).items() if isinstance(v, str)}
    groups = [{name: tuple(_int(d, "a parameter size") for d in shape) for name, shape in group.items()}
              for group in shapes]
    own = {n: module[n] for n in buffers} | frozen

    def specs(dtype):
        stored = {s.key: s for s in tensor_specs(manifest, own.values(), dtype=dtype)}
        out = [TensorSpec(n, converted_dtype(torch.float32 if stored[k].dtype.is_floating_point else stored[k].dtype,
                                             dtype), stored[k].shape) for n, k in own.items()]
        out += [TensorSpec(n, dtype or torch.float32, s) for group in groups for n, s in group.items()]
        by_name = {s.key: s for s in out}
        return out + [TensorSpec(n, by_name[s].dtype, by_name[s].shape) for n, s in shared.items() if s in by_name]

    def tensors(dtype):
        done = {}
        for (name, key), (_, tensor) in zip(own.items(), full_tensors(path, list(own.values()), manifest=manifest)):
            done[name] = tensor.to(dtype or torch.float32) if tensor.is_floating_point() else tensor
            yield name, done[name]
        for index, group in enumerate(groups):
            vector = torch.cat([next(full_tensors(p, [g[index]], manifest=m))[1] for p, m, g, _ in partitions])
            for name, tensor in _split(vector, group, partitions[0][3], index, ranks, tag):
                done[name] = tensor.to(dtype) if dtype is not None else tensor
                yield name, done[name]
            del vector
        for name, src in shared.items():
            if src in done:
                yield name, done[src]

    return PluginStep("deepspeed", str(tag), manifest, specs, tensors, takes)


def _split(vector: torch.Tensor, group: dict[str, tuple], paddings: object, index: int, ranks: int,
           tag: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """One parameter group's joined fp32 partitions cut into its parameters (zero_to_fp32.py's check:
    what is used, rounded up to 2 × ranks, is what is there)."""
    pads = paddings[index] if isinstance(paddings, list) and index < len(paddings) else None
    pads = pads if isinstance(pads, list) and len(pads) == len(group) else [0] * len(group)
    offset = 0
    for (name, shape), pad in zip(group.items(), pads):
        numel = math.prod(shape)
        if offset + numel > vector.numel():
            raise CheckpointError(f"{tag}: the ZeRO partitions hold {vector.numel()} values, too few for {name}")
        yield name, vector[offset:offset + numel].clone().view(shape)
        offset += numel + _int(pad, "a parameter padding")
    align = 2 * ranks
    if math.ceil(offset / align) != math.ceil(vector.numel() / align):
        raise CheckpointError(f"{tag}: the parameters use {offset} of the {vector.numel()} values in the ZeRO "
                              f"partitions of group {index}")
