"""torchtitan: its checkpoints through the engine, at torchtitan's own seam, ``BaseCheckpointManager``.

Selected by configuration alone, with torchtitan's override mechanism (no code of the job changes)::

    torchrun ... -m torchtitan.train --module llama3 --config llama3_8b \\
        --checkpoint.enable --checkpoint.async_mode async_with_pinned_mem \\
        --override.imports ckpt.integrations.torchtitan.ckpt_engine

or, with engine options (JSON after ``=``, one shell token)::

    --override.imports 'ckpt.integrations.torchtitan.ckpt_engine={"full_every": 4, "replicas": ["s3://b/run"]}'

or in a ``config_registry`` function: ``checkpoint=CheckpointManager.Config(enable=True, ...)``, or
``override=OverrideConfig(imports=["ckpt.integrations.torchtitan.ckpt_engine"])``. The override
replaces the job's ``checkpoint`` config (torchtitan's ``CheckpointManager.Config``) by ours,
copying every field, so ``--checkpoint.*`` flags keep working.

What torchtitan's options mean here (``folder`` = ``dump_folder/checkpoint.folder``, the root):

* ``interval``, ``enable_first_step_checkpoint``, ``load_only``, ``load_step``: as torchtitan's;
  ``keep_latest_k`` is our ``keep`` (0 keeps every step), ``keep_every`` keeps multiples besides.
* ``async_mode``: ``disabled`` writes inside ``save``; ``async`` and ``async_with_pinned_mem`` are
  our double-buffered staging (pinned host buffers where the device has them), written by a
  background thread on its own gloo group; ``maybe_wait_for_staging`` (torchtitan calls it before
  ``optimizers.step()``) waits for the snapshot only.
* ``exclude_from_loading``: those states are not loaded (the load is then not strict).
* ``initial_load_path`` (used while the root holds no step): our checkpoint, torchtitan's own DCP
  directory (read pickle-free, its ``.metadata`` too) or, with ``initial_load_in_hf``, safetensors
  through the model's state-dict adapter; ``initial_load_model_only`` (torchtitan's default) loads
  the model alone from any step, full or not: every model key must be there, the rest is not read.
* ``last_save_model_only`` / ``export_dtype``: the last step saved as the model alone, cast;
  ``last_save_in_hf`` writes it as safetensors to ``step-<N>-hf`` beside the steps instead.
  A model-only step (also ``create_seed_checkpoint``'s step 0) loads into the model alone.

The memory tier (``memory="/dev/shm/ckpt"``, with ``memory_interval``, ``memory_keep``,
``memory_replicas``, ``memory_keep_on_exit``; docs/STORAGE.md "The memory tier"): every
``memory_interval``-th step goes to each node's RAM (and a partner node's) between torchtitan's
``interval`` saves, through the same ``save`` call; ``load()`` of the newest step resumes from a memory
step newer than storage's (also when storage holds none yet). ``close()`` after a clean run removes the
run's memory steps; torchtitan's ``train.py`` also calls it when training raised (inside its ``except``),
and then they stay for the restart, as they do after a killed process. A model-only newest step (a
seed checkpoint, a final export) is loaded as before unless a memory step newer than it holds the whole
state (a run begun from a seed that crashed before its first storage save); a final model-only export
is never put in memory.

The engine brings deltas (``full_every``), replicas/S3 (``replicas``), checksummed chunks verified on
load, a pickle-free load (torchtitan's dataloader still unpickles its own position blob), atomic
steps and damaged-step fallback. Not supported: torchtitan's fault-tolerant (torchft) manager,
``initial_load_in_hf_quantized`` beyond what the adapter's reader does, HF export to a URL.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Literal

from ._optional import require

require("torchtitan.components.checkpointer", extra="torchtitan", integration="ckpt.integrations.torchtitan",
        package="torchtitan")

import torch  # noqa: E402
from torchtitan.components.checkpointer import BaseCheckpointManager, ModelWrapper  # noqa: E402
from torchtitan.components.checkpointer import CheckpointManager as TitanCheckpointManager  # noqa: E402
from torchtitan.config import TORCH_DTYPE_MAP, derive, override  # noqa: E402

from .. import CheckpointManager as EngineManager, SaveOptions, load as load_checkpoint, read_manifest  # noqa: E402
from ..format import MANIFEST_NAME, step_name  # noqa: E402
from ..storage import is_url  # noqa: E402
from . import _titan_state as titan_state  # noqa: E402
from ._titan_state import DATALOADER, MODEL  # noqa: E402

log = logging.getLogger(__name__)

__all__ = ["CheckpointManager", "ckpt_engine"]

_ASYNC = {"disabled": "sync", "async": "double_buffer", "async_with_pinned_mem": "double_buffer"}
_KEEP_ALL = 2**31 - 1


class CheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpoint manager over our engine (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "async_with_pinned_mem"
        """disabled: write in save(); async / async_with_pinned_mem: double-buffered background writes."""
        full_every: int = 1
        """K > 1: a full checkpoint, then up to K-1 deltas against the previous snapshot."""
        keep_every: int | None = None
        """Also keep every step that is a multiple of this (besides keep_latest_k)."""
        replicas: list[str] = field(default_factory=list)
        """Directories or URLs (s3://...) every committed step is copied to in the background."""
        compress: Literal["none", "zstd"] = "none"
        """Full checkpoints as zstd byte planes (deltas always are)."""
        files_per_rank: int = 1
        """Data files each rank writes in parallel."""
        policy: Literal["block", "skip"] = "block"
        """When both staging buffer sets are still being written: wait, or skip the save."""
        on_error: Literal["stop", "continue"] = "stop"
        """A failed background save: raise it at the next save, or warn and retry next interval."""
        replica_read_back: bool = False
        """Read every copied blob back from the replica and verify it."""
        catalog: str | None = None
        """The LMDB catalog directory; None: <folder>/.catalog for a local folder; "" turns it off."""
        memory: str | None = None
        """The memory tier: a directory on each node's RAM file system (e.g. /dev/shm/ckpt); None: off."""
        memory_interval: int = 1
        """Keep every this many steps in memory (between the interval's saves to storage)."""
        memory_keep: int = 2
        """Memory steps kept on each node (the newest)."""
        memory_replicas: int = 1
        """1: a copy of each rank's memory step on a partner node; 0: none."""
        memory_keep_on_exit: bool = False
        """Keep the run's memory steps after a clean finish (they always stay after a failure)."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            self.async_mode = self.async_mode.lower()
            if self.async_mode not in _ASYNC:
                raise ValueError(f"Invalid async_mode: {self.async_mode}")

        def save_options(self) -> SaveOptions:
            """The engine's options for this config."""
            return SaveOptions(
                interval=self.interval, keep=self.keep_latest_k or _KEEP_ALL, keep_every=self.keep_every,
                async_mode=_ASYNC[self.async_mode], full_every=self.full_every, compress=self.compress,
                files_per_rank=self.files_per_rank, policy=self.policy, on_error=self.on_error,
                replicas=tuple(self.replicas), replica_read_back=self.replica_read_back, catalog=self.catalog,
                memory=self.memory, memory_interval=self.memory_interval, memory_keep=self.memory_keep,
                memory_replicas=self.memory_replicas, memory_keep_on_exit=self.memory_keep_on_exit)

    def __init__(self, config: Config, *, dataloader: Any, model_parts: list[torch.nn.Module], optimizers: Any,
                 lr_schedulers: Any, states: dict[str, Any], sd_adapter: Any = None, base_folder: str = "",
                 storage_options: dict | None = None) -> None:
        self.enable = config.enable
        self.save_future = None  # saves are tracked by the engine; maybe_wait_for_saving is a no-op
        if not self.enable:
            return
        self.config = config
        self.folder = os.path.join(base_folder, config.folder) if not is_url(config.folder) else config.folder
        self.states = states
        self.states.update({MODEL: ModelWrapper(model_parts), "optimizer": optimizers, DATALOADER: dataloader,
                            "lr_scheduler": lr_schedulers})
        self.sd_adapter = sd_adapter
        if config.last_save_in_hf and sd_adapter is None:
            raise ValueError("checkpoint.last_save_in_hf is True, but sd_adapter is not provided.")
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self.engine = EngineManager(self.folder, config.save_options(), storage_options=storage_options)
        for optimizer in getattr(optimizers, "optimizers", ()):  # also waits if a loop skips the call
            self.engine.attach(optimizer)
        log.info("Checkpointing through ckpt's engine: steps under %s", self.folder)

    # -- BaseCheckpointManager hooks -------------------------------------------------------------
    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        config = self.config
        if config.load_only:
            return False
        if not last_step:
            # torchtitan's _should_save decides the storage save; the memory tier adds its own steps
            stored = curr_step % config.interval == 0 or (curr_step == 1 and config.enable_first_step_checkpoint)
            memory = config.memory is not None and curr_step % config.memory_interval == 0
            if not (stored or memory):
                return False
            return self.engine.save(curr_step, titan_state.training_tree(self.states), force=stored)
        if config.last_save_in_hf:  # a final export, not a step: torchtitan writes nothing else then
            self.engine.wait()
            titan_state.save_hf(self.states, self.sd_adapter, os.path.join(self.folder, f"step-{curr_step}-hf"),
                                self.export_dtype)
            return True
        model_only = config.last_save_model_only
        tree = titan_state.training_tree(self.states, model_only=model_only,
                                         dtype=self.export_dtype if model_only else None)
        started = self.engine.save(curr_step, tree, force=True, memory=False if model_only else None)
        self.engine.wait()
        return started

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        config = self.config
        steps = self.engine.steps()
        if step != -1:
            if step not in steps:
                raise FileNotFoundError(f"--checkpoint.load_step={step} not found in {self.folder} "
                                        f"(committed steps: {steps})")
            return self._load_step(step)
        if steps:
            return self._load_step(None, newest=steps[-1])
        if config.memory is not None and self._load_step(None):  # a memory step, storage still empty
            return True
        if not config.initial_load_path and not config.initial_load_in_hf:
            log.info("No checkpoint was provided, this is a fresh start.")
            return False
        self._initial_load()
        return True

    def _maybe_wait_for_staging(self) -> None:
        self.engine.before_step()

    def _wait_for_saving(self) -> None:
        self.engine.wait()

    def _close(self) -> None:
        # torchtitan's train.py closes in its ``except`` too: a failing run keeps its memory steps
        self.engine.close(finished=sys.exc_info()[0] is None)

    def __del__(self):
        try:
            if getattr(self, "enable", False):  # never closed: not a clean finish
                self.engine.close(finished=False)
        except Exception:  # interpreter shutdown: the engine's own finalisers remain
            pass

    # -- internals ---------------------------------------------------------------------------------
    def _load_step(self, step: int | None, newest: int | None = None) -> bool:
        """Load ``step`` (None: the newest that loads, a memory step newer than ``newest`` included);
        a model-only step into the model alone. False: nothing to load (no step, no memory step)."""
        probe = step if step is not None else newest
        dtypes = None if probe is None else titan_state.model_only_dtypes(self.engine.root / step_name(probe),
                                                                          self.states)
        model_only = dtypes is not None
        exclude = tuple(self.config.exclude_from_loading)
        for name in exclude:
            if name not in self.states:
                raise ValueError(f"{name} not found in state_dict.")
        tree = titan_state.training_tree(self.states, model_only=model_only, exclude=exclude, dtype=dtypes)
        if model_only and step is None:
            # a memory step newer than the model-only one (a run begun from a seed checkpoint): the whole state
            full = titan_state.training_tree(self.states, exclude=exclude)
            recovered = self.engine.recover_memory(full, strict=not exclude)
            if recovered is not None:
                titan_state.restore(self.states, full)
                log.info("Loaded step %s from the memory tier", recovered)
                return True
            step = newest  # a model-only step is what the run ended with: load it, not an older full one
        loaded = self.engine.load(tree, step, strict=not exclude)
        if loaded is None:
            return False
        titan_state.restore(self.states, tree)
        log.info("Loaded step %s from %s%s", loaded, self.folder, " (model only)" if model_only else "")
        return True

    def _initial_load(self) -> None:
        config = self.config
        path = config.initial_load_path
        if config.initial_load_in_hf:
            path = path or getattr(self.sd_adapter, "hf_assets_path", None)
            if self.sd_adapter is None or not path:
                raise ValueError("initial_load_in_hf needs a state-dict adapter and initial_load_path "
                                 "(or model.hf_assets_path)")
            titan_state.load_hf(self.states, self.sd_adapter, path, quantized=config.initial_load_in_hf_quantized)
            return
        model_only = config.initial_load_model_only  # the model's keys, any step's other states unread
        strict = not config.exclude_from_loading and not model_only
        if os.path.isfile(os.path.join(path, MANIFEST_NAME)) or is_url(path):
            manifest = read_manifest(path)
            dtypes = {key: entry.dtype for key, entry in manifest.tensors.items()} if model_only else None
            tree = titan_state.training_tree(self.states, model_only=model_only, dtype=dtypes,
                                             exclude=tuple(config.exclude_from_loading))
            if model_only:
                titan_state.require_keys(tree, {**manifest.tensors, **manifest.values}, path)
            load_checkpoint(tree, path, strict=strict)
        elif os.path.isfile(os.path.join(path, ".metadata")):
            tree = titan_state.training_tree(self.states, model_only=model_only,
                                             exclude=tuple(config.exclude_from_loading))
            titan_state.load_foreign_dcp(tree, path, strict=strict, model_only=model_only)
        else:
            raise ValueError(f"checkpoint.initial_load_path {path} holds neither a checkpoint of ours "
                             f"({MANIFEST_NAME}) nor a DCP checkpoint (.metadata)")
        titan_state.restore(self.states, tree)
        log.info("Loaded the initial checkpoint %s%s", path, " (model only)" if config.initial_load_model_only else "")


@override(target=TitanCheckpointManager.Config, description="checkpoints through ckpt's engine")
def ckpt_engine(config: TitanCheckpointManager.Config, **options: Any) -> CheckpointManager.Config:
    """torchtitan override: the job's checkpoint config as ours, every field copied, ``options``
    (our extra fields: full_every, keep_every, replicas, ...) on top."""
    unknown = set(options) - {f.name for f in dataclasses.fields(CheckpointManager.Config)}
    if unknown:
        raise ValueError(f"ckpt_engine: unknown options {sorted(unknown)}")
    return derive(config, CheckpointManager.Config, **options)
