"""PyTorch Lightning: checkpoints through the engine at Lightning's own seam, its ``CheckpointIO``.

    from ckpt.integrations.lightning import CkptCheckpointIO
    trainer = lightning.Trainer(plugins=[CkptCheckpointIO(full_every=4)], callbacks=[ModelCheckpoint(...)])
    trainer.fit(model, ckpt_path="last")

Every path Lightning saves to (``epoch=0-step=10.ckpt``, ``last.ckpt``) becomes one committed
checkpoint directory of ours: tensors as checksummed chunks, everything else pickle-free
(:mod:`ckpt.integrations._tree`), written atomically. ``ModelCheckpoint`` still decides what exists
(``save_top_k``, ``every_n_train_steps``, ``save_last``) and calls ``remove_checkpoint``. By default
a save returns once the state is snapshotted into reusable host buffers and is written in the
background (:mod:`ckpt.integrations._store`, through the manager's own :class:`ckpt.write.SavePipeline`),
which is why Lightning's ``AsyncCheckpointIO`` (a thread around ``torch.save`` that clones every
tensor per save) is not needed; ``teardown`` (end of ``fit``) waits for the writes. ``full_every=K``
writes deltas.

Which checkpoint stands in for a damaged one: every save records the run that wrote it (the manifest's
``run``; a fit that resumed from a checkpoint continues that checkpoint's run, any other fit starts a
new one). When Lightning's ``last`` checkpoint (``ckpt_path="last"``) fails verification, the newest
sibling of the same run at no newer step that loads is used, with a warning (``fallback=False``
raises instead); another run's checkpoints left in the folder, and newer ones, never are. Any other
path was asked for explicitly and is never replaced: its failure raises, naming the checkpoint that
would stand in for it, as does a ``last`` whose run cannot be told (its manifest is unreadable).

Sharded checkpoints (``ModelParallelStrategy`` with FSDP2/TP on a DeviceMesh, the DCP-based path,
which bypasses ``CheckpointIO``): :class:`CkptModelParallelStrategy` saves them collectively
through our DCP writer and loads them resharded into the current layout.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

from ._optional import require

require("lightning.pytorch", extra="lightning", integration="ckpt.integrations.lightning", package="lightning")

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402

from .. import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, Manifest  # noqa: E402
from .. import SaveOptions, SaveStats  # noqa: E402
from .. import read_manifest  # noqa: E402
from .. import load as load_checkpoint  # noqa: E402
from .. import save as save_checkpoint  # noqa: E402
from ._store import PathStore, refuse_memory  # noqa: E402
from ..root.claim import new_run_id  # noqa: E402
from ._tree import decode_tree, encode_tree, manifest_template  # noqa: E402

log = logging.getLogger(__name__)

__all__ = ["CkptCheckpointIO", "CkptModelParallelStrategy"]


def _is_last(path: str) -> bool:
    return os.path.basename(path).startswith(ModelCheckpoint.CHECKPOINT_NAME_LAST)


class CkptCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` writing our format (see the module docstring).

    Args:
        options / fields: a :class:`ckpt.SaveOptions` and/or its fields (``async_mode``,
            ``full_every``, ``compress``, ``files_per_rank``, ``policy``, ...); ``interval``,
            ``keep`` and ``replicas`` do not apply (``ModelCheckpoint`` decides what is kept); ``memory``
            is refused (:class:`ckpt.InvalidOptionError`: Lightning loads the path it names).
        fallback: on loading a damaged ``last`` checkpoint, use the newest sibling of its run that loads.
    """

    def __init__(self, options: SaveOptions | None = None, *, fallback: bool = True, **fields: Any):
        self.options = (options or SaveOptions()).replace(**fields)
        refuse_memory(self.options, "Lightning")
        self.fallback = fallback
        self.run: str | None = None  # recorded in every save: the loaded checkpoint's run, else a new one
        self._stats = SaveStats()  # kept across the stores of successive fits
        self._store: PathStore | None = None

    @property
    def stats(self) -> SaveStats:
        """``saves``, ``deltas``, ``skipped``, ``failures``; ``stall_s``: time training was blocked by saves
        (in ``save`` and waiting for a snapshot copy before the next step)."""
        return self._stats if self._store is None else self._store.stats

    @property
    def store(self) -> PathStore:
        if self._store is None:  # made at first use, closed at teardown
            self._store = PathStore(self.options, base_ok=lambda path: not _is_last(path), stats=self._stats)
        return self._store

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("CkptCheckpointIO.save_checkpoint takes no storage_options (configure SaveOptions instead)")
        if self.run is None:
            self.run = new_run_id()
        self.store.save(checkpoint, path, step=checkpoint.get("global_step"), run=self.run)

    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        asked = os.path.abspath(os.fspath(path))
        path = os.path.realpath(asked)  # save_last="link" makes last.ckpt a symlink
        try:
            tree = self.store.load(path)
        except (CorruptCheckpointError, FileNotFoundError) as exc:  # not there, or does not verify
            tree, path = self._stand_in(asked, path, exc)
        self.run = _run_of(path) or self.run  # a resumed fit continues the run it resumed
        return tree

    def _stand_in(self, asked: str, path: str, exc: BaseException) -> tuple[dict[str, Any], str]:
        """The tree of the checkpoint that may replace the unloadable ``path``, or raise naming both."""
        try:
            manifest = read_manifest(path)
        except CheckpointError:
            manifest = None
        if manifest is not None and (manifest.run is None or manifest.step is None):
            manifest = None  # its run or step cannot be told (written before runs were recorded)
        for candidate in _siblings(path, manifest):
            try:
                tree = self.store.load(candidate)
            except CheckpointError as other:
                log.warning("checkpoint %s cannot be loaded either (%s)", candidate, other)
                continue
            if self.fallback and _is_last(asked) and manifest is not None:
                warnings.warn(f"checkpoint {asked} cannot be loaded ({exc}); loaded {candidate} instead, the newest "
                              "checkpoint of the same run at no newer step", stacklevel=3)
                return tree, candidate
            why = ("was asked for by name" if not _is_last(asked) else
                   "cannot be told from another run's (no run and step can be read)" if manifest is None else
                   "may not be replaced (fallback=False)")
            raise _like(exc, f"checkpoint {asked} cannot be loaded ({exc}); it {why}, so {candidate} is not loaded "
                        f"in its place: pass ckpt_path={candidate!r} to resume from that one", asked) from exc
        kind = "of the same run at no newer step" if manifest is not None else "beside it"
        message = f"checkpoint {asked} cannot be loaded ({exc}); no other checkpoint {kind} loads"
        raise _like(exc, message, asked) from exc

    def remove_checkpoint(self, path) -> None:
        self.store.remove(path)

    def teardown(self) -> None:
        """End of fit/validate/test: wait for every write, free the staging buffers."""
        if self._store is not None:
            store, self._store = self._store, None
            store.close()


def _like(exc: BaseException, message: str, path: str) -> CheckpointError:
    """``exc``'s kind of CheckpointError (a missing path: CheckpointNotFoundError), with ``message``."""
    kind = type(exc) if isinstance(exc, CheckpointError) else CheckpointNotFoundError
    return kind(message, path=path)


def _run_of(path: str) -> str | None:
    try:
        return read_manifest(path).run
    except CheckpointError:
        return None


def _siblings(path: str, manifest: Manifest | None) -> list[str]:
    """Committed checkpoints beside ``path``, newest (highest step, then latest written) first: given
    ``path``'s manifest (with a run and a step), those of its run at its step or an older one; else all."""
    parent = os.path.dirname(path)
    found = []
    for entry in os.listdir(parent) if os.path.isdir(parent) else ():
        candidate = os.path.join(parent, entry)
        if candidate == path or os.path.islink(candidate) or not os.path.isdir(candidate):
            continue
        try:
            other = read_manifest(candidate)
        except CheckpointError:
            continue
        if manifest is not None and not (other.run == manifest.run and other.step is not None
                                         and other.step <= manifest.step):
            continue
        found.append(((other.step if other.step is not None else -1, other.created), candidate))
    return [c for _, c in sorted(found, reverse=True)]


class CkptModelParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` whose distributed (sharded) checkpoints are ours.

    Every rank saves its shards of the model and optimizer states collectively through
    :class:`ckpt.dcp.Writer` (one committed directory; replicated tensors written once) and the rest
    of Lightning's checkpoint pickle-free; loading reshards into the current mesh (another number
    of ranks, another FSDP/TP split). Saves are synchronous (collective). With
    ``save_distributed_checkpoint=False`` Lightning's own full-checkpoint path runs, through the
    strategy's ``checkpoint_io`` (pass a :class:`CkptCheckpointIO` to get ours there too).
    """

    def __init__(self, *args: Any, ckpt_options: SaveOptions | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.ckpt_options = ckpt_options or SaveOptions()
        refuse_memory(self.ckpt_options, "Lightning")

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options")
        path = os.fspath(self.broadcast(os.fspath(filepath)))
        rest = dict(checkpoint)
        state = {"state_dict": rest.pop("state_dict")}
        state.update({f"optimizer_{i}": o for i, o in enumerate(rest.pop("optimizer_states", []))})
        state["lightning"] = encode_tree(rest)
        save_checkpoint(state, path, overwrite=True, step=checkpoint.get("global_step"),
                        files_per_rank=self.ckpt_options.files_per_rank)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        path = os.fspath(self.broadcast(os.fspath(checkpoint_path)))
        try:
            manifest = read_manifest(path)
        except CheckpointError:
            if os.path.isfile(path):  # a full checkpoint file of Lightning's own
                return super().load_checkpoint(checkpoint_path, weights_only)
            raise
        state: dict[str, Any] = {"state_dict": self.model}
        fitting = self.lightning_module.trainer.state.fn == "fit"
        if fitting:
            state.update({f"optimizer_{i}": o for i, o in enumerate(self.optimizers)})
        state["lightning"] = manifest_template(manifest, under="lightning").get("lightning", {})
        strict = self.lightning_module.strict_loading and fitting
        load_checkpoint(state, path, strict=strict)
        return decode_tree(state["lightning"])
