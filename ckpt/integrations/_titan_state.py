"""torchtitan's checkpoint state as a tree for the engine, and back (used by :mod:`.torchtitan`).

torchtitan's own manager saves one flat dict: the model's keys at the top (``ModelWrapper``), then
``optimizer``, ``lr_scheduler``, ``dataloader`` and the caller's ``states`` (``train_state``) under
their names. :func:`training_tree` keeps that layout, so a step of ours holds the names torchtitan's
DCP checkpoints hold, with one change: the dataloader's state is put under one key per entry
(``dataloader.dp_rank_<r>``, ``dataloader.world_size``). Each data-parallel rank saves only its
own ``dp_rank_<r>``; as one tensor-free value per rank under a single ``dataloader`` key, all but one
rank's position would be dropped (the engine writes a plain value once), while as separate keys every
rank's is written and each rank asks for its own on load (rank-local state, which the strict
:class:`~ckpt.read.planner.SafeLoadPlanner` accepts because some rank asks for every key).

A step is *model-only* (torchtitan's step 0, a seed checkpoint, a last step saved with
``last_save_model_only``) when it holds none of the non-model states: :func:`model_only_dtypes` reads
that from the manifest, and such a step loads into the model alone, as torchtitan does. A *model-only
load* (``initial_load_model_only``) of any step, full or not, takes every model key (each must be
there: :func:`require_keys`) and leaves the step's other states unread, as torchtitan's does.

A foreign (torchtitan's own) DCP step is read pickle-free: its ``.metadata`` through the allow-list
unpickler of :mod:`ckpt.convert.dcp.metadata` (DCP's reader would ``pickle.load`` it), its values
through the :class:`~ckpt.read.planner.SafeLoadPlanner`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import StorageMeta

from .. import CheckpointError, IncompatibleCheckpointError, SafeLoadPlanner, read_manifest
from ..convert import read_dcp_metadata
from ..optim_state import create_empty_state

MODEL = "model"
DATALOADER = "dataloader"


def training_tree(states: dict[str, Any], *, model_only: bool = False, exclude: tuple[str, ...] = (),
                  dtype: torch.dtype | dict[str, torch.dtype] | None = None) -> dict[str, Any]:
    """The tree to save or load: model keys at the top, the other states by name (see the module
    docstring); ``exclude`` leaves states out, ``dtype`` casts floating-point model tensors."""
    tree = dict(model_state(states, dtype))
    if model_only:
        return tree
    for name, value in states.items():
        if name == MODEL or name in exclude or value is None:
            continue
        if name == DATALOADER:
            tree.update({f"{DATALOADER}.{key}": item for key, item in value.state_dict().items()})
        else:
            parts = getattr(value, "optimizers", None) if isinstance(value, torch.optim.Optimizer) else None
            for optimizer in parts if isinstance(parts, list) else ():  # an OptimizersContainer's, one a model part
                create_empty_state(optimizer)  # else its state_dict() runs a zero-gradient step first (a resume)
            tree[name] = value
    return tree


def model_state(states: dict[str, Any], dtype: torch.dtype | dict[str, torch.dtype] | None = None) -> dict[str, Any]:
    """The ``ModelWrapper``'s flat state dict: the live tensors, or casts of its floating-point ones to
    ``dtype`` (one for all, or per key: a model-only step exported in another dtype loads into casts,
    which :func:`restore` copies into the model)."""
    model = states[MODEL].state_dict()
    if dtype is None:
        return model

    def wanted(key: str) -> torch.dtype | None:
        return dtype.get(key) if isinstance(dtype, dict) else dtype

    return {key: value.to(wanted(key)) if isinstance(value, torch.Tensor) and value.is_floating_point()
            and wanted(key) not in (None, value.dtype) else value for key, value in model.items()}


def restore(states: dict[str, Any], tree: dict[str, Any]) -> None:
    """After a load into ``tree`` (Statefuls already restored by the engine): the model, through
    ``ModelWrapper.load_state_dict`` as torchtitan's manager does (its module hooks fuse the loaded
    split tensors, e.g. ``qkv_linear.wq/wk/wv`` into ``wqkv``; keys that are not the model's are
    passed over), and the dataloader, from its per-key entries.

    ``ModelWrapper.state_dict()`` must not be called between the load and this: it refreshes its
    cached hook-made tensors, which are the ones just loaded into, from the live (not yet restored)
    parameters."""
    states[MODEL].load_state_dict({key: value for key, value in tree.items() if isinstance(value, torch.Tensor)})
    prefix = f"{DATALOADER}."
    loader = {key[len(prefix):]: value for key, value in tree.items() if key.startswith(prefix)}
    if loader and states.get(DATALOADER) is not None:
        states[DATALOADER].load_state_dict(loader)


def model_only_dtypes(path, states: dict[str, Any]) -> dict[str, torch.dtype] | None:
    """For a checkpoint of ours at ``path`` that holds none of the non-model states, the dtype of each
    of its tensors; None for a full training checkpoint, or one that cannot be read here (the engine's
    load then passes over a damaged step to the newest that loads)."""
    try:
        manifest = read_manifest(path)
    except CheckpointError:
        return None
    names = {key.split(".", 1)[0] for key in (*manifest.values, *manifest.tensors)}
    if any(name in names for name in states if name != MODEL):
        return None
    return {key: entry.dtype for key, entry in manifest.tensors.items()}


def require_keys(tree: dict[str, Any], saved: Any, path: str) -> None:
    """A model-only load (not strict about the step's other states) still needs every model key."""
    missing = [key for key in tree if key not in saved]
    if missing:
        raise IncompatibleCheckpointError(missing, path=str(path))


class _SafeReader(dcp.FileSystemReader):
    """DCP's file reader with its ``.metadata`` read by the allow-list unpickler (read once)."""

    def __init__(self, path: str):
        super().__init__(path)
        self.metadata = read_dcp_metadata(path)

    def read_metadata(self, *args: Any, **kwargs: Any):
        if self.metadata.storage_meta is None:  # as DCP's own reader fills it in
            self.metadata.storage_meta = StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata


def load_foreign_dcp(tree: dict[str, Any], path: str, *, strict: bool, model_only: bool = False) -> None:
    """Load a plain DCP checkpoint (torchtitan's own) into ``tree``, as torchtitan does but pickle-
    free (see the module docstring): Statefuls become their state dicts first and get them back
    after; ``model_only``: ``tree`` is the model's, whose keys must all be there (the rest is not read)."""
    reader = _SafeReader(path)
    if model_only:
        require_keys(tree, reader.metadata.state_dict_metadata, path)
    flat = {key: value.state_dict() if _is_stateful(value) else value for key, value in tree.items()}
    dcp.load(flat, storage_reader=reader, planner=SafeLoadPlanner(strict=strict and not model_only))
    for key, value in tree.items():
        if _is_stateful(value):
            value.load_state_dict(flat[key])
        else:
            tree[key] = flat[key]


def load_hf(states: dict[str, Any], sd_adapter, path: str, *, quantized: bool) -> None:
    """Load Hugging Face safetensors into the model through torchtitan's state-dict adapter."""
    hf_state = sd_adapter.to_hf(states[MODEL].state_dict())
    dcp.load(hf_state, storage_reader=sd_adapter.get_hf_storage_reader(path, quantized))
    states[MODEL].load_state_dict(sd_adapter.from_hf(hf_state))


def save_hf(states: dict[str, Any], sd_adapter, path: str, dtype: torch.dtype) -> None:
    """The model as Hugging Face safetensors at ``path`` through the adapter (torchtitan's
    ``last_save_in_hf``), written and consolidated the way torchtitan's own manager does."""
    import os

    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files_on_every_rank

    hf_state = sd_adapter.to_hf(model_state(states, dtype))
    mapping = sd_adapter.fqn_to_index_mapping
    target = os.path.join(path, "sharded") if mapping else path
    dcp.save(hf_state, storage_writer=HuggingFaceStorageWriter(
        path=target, save_distributed=True, fqn_to_index_mapping=mapping, enable_consolidation=not mapping))
    if mapping:
        consolidate_safetensors_files_on_every_rank(input_dir=target, output_dir=path, fqn_to_index_mapping=mapping,
                                                    num_threads=5)


def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))
