"""DeepSpeed: its pluggable ``CheckpointEngine`` (``deepspeed.runtime.checkpoint_engine``) writing
through our engine.

    from ckpt.integrations import deepspeed as ckpt_deepspeed
    config["checkpoint"] = {"engine": "ckpt", "ckpt": {"full_every": 4}}    # in the DeepSpeed config
    engine, optimizer, _, _ = ckpt_deepspeed.initialize(model=model, optimizer=opt, config=config)
    engine.save_checkpoint(save_dir)                  # as before
    ckpt_deepspeed.load_checkpoint(engine, save_dir)  # engine.load_checkpoint(save_dir), past a damaged newest tag

DeepSpeed builds its checkpoint engine itself, from a fixed list; :func:`initialize` is
``deepspeed.initialize`` plus, when the config's ``checkpoint.engine`` is ``"ckpt"``, ours in its place
(:func:`use_ckpt_engine` does the same for an engine already built). Every file DeepSpeed writes
(``mp_rank_00_model_states.pt``, each rank's ``zero_pp_rank_N_mp_rank_00_optim_states.pt``) becomes
one committed checkpoint directory of ours under that name, written by that rank alone: tensors as
checksummed chunks, the rest pickle-free (DeepSpeed's loss scalers and fragment addresses are
allow-listed classes, rebuilt from their attributes, never unpickled). Saves snapshot into reusable
host buffers and write in the background; the engine is *decoupled*: DeepSpeed commits the tag
(writes ``latest``) at its next optimizer step, and the commit waits for what is left of the writes,
so ``latest`` never names a tag that is not committed; ``engine.destroy()`` at the end commits the
last one (``cleanup``). :func:`load_checkpoint` verifies a tag on all ranks before DeepSpeed loads
it and falls back from the tag ``latest`` names to the newest older tag that verifies; a tag asked
for by name is never replaced (it raises, naming the one that would be). ``engine.load_checkpoint``
works too, and raises :class:`ckpt.CorruptCheckpointError` on a damaged file.

Not supported: deltas (``full_every``): each tag is a directory of its own, and a delta's base must
be a sibling of it, so every file is written full. ``zero_to_fp32.py`` and DeepSpeed's universal checkpoints read ``torch.save`` files
(``ckpt-convert SAVE_DIR out.safetensors --to safetensors`` gives zero_to_fp32's weights: :mod:`ckpt.convert.plugins`;
load ours with :func:`ckpt.integrations._tree.read_tree`, or through the engine); ZeRO-3 and NVMe
offload were not run here (CPU, gloo).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import warnings
from typing import Any

from ._optional import require

deepspeed = require("deepspeed", extra="deepspeed", integration="ckpt.integrations.deepspeed")

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine  # noqa: E402

from .. import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, SaveOptions, read_manifest  # noqa: E402
from ._store import PathStore  # noqa: E402

log = logging.getLogger(__name__)

__all__ = ["CkptCheckpointEngine", "initialize", "load_checkpoint", "use_ckpt_engine", "ENGINE_NAME"]

ENGINE_NAME = "CkptCheckpointEngine"
CONFIG_VALUE = "ckpt"


def allowed_objects() -> dict[str, type]:
    """DeepSpeed's classes that its checkpoints hold, kept by their attributes (an allow-list)."""
    found: dict[str, type] = {}
    for module, names in (("deepspeed.runtime.fp16.loss_scaler", ("LossScaler", "DynamicLossScaler")),
                          ("deepspeed.utils.tensor_fragment", ("fragment_address",))):
        try:
            imported = __import__(module, fromlist=list(names))
        except ImportError:
            continue
        for name in names:
            if hasattr(imported, name):
                found[f"{module}.{name}"] = getattr(imported, name)
    return found


class CkptCheckpointEngine(CheckpointEngine):
    """A DeepSpeed ``CheckpointEngine`` writing our format (see the module docstring).

    ``options`` / ``fields``: a :class:`ckpt.SaveOptions` and/or its fields (``async_mode``,
    ``full_every``, ``compress``, ...); ``memory`` is refused (:class:`ckpt.InvalidOptionError`: DeepSpeed
    loads the path it names)."""

    def __init__(self, config_params: Any = None, options: SaveOptions | None = None, **fields: Any):
        super().__init__(config_params)
        self.name = ENGINE_NAME
        self.store = PathStore(options, objects=allowed_objects(), **fields)
        self._info: CheckpointCommitInfo | None = None

    def create(self, info: CheckpointCommitInfo) -> None:
        self._info = info

    def save(self, state_dict: dict, path: str) -> None:
        self.store.save(state_dict, path, step=state_dict.get("global_steps"))

    def load(self, path: str, map_location: Any = None) -> dict:
        device = None if map_location is None or callable(map_location) or isinstance(map_location, dict) \
            else map_location
        return self.store.load(path, map_tensor=None if device is None else (lambda t: t.to(device)))

    def verify_share(self, tag_dir: str, rank: int = 0, world_size: int = 1) -> BaseException | None:
        """Read and verify this rank's share of the files in ``tag_dir`` (every ``world_size``-th
        one, from ``rank``); the first problem, or None. A tag without any file of ours is a problem."""
        names = _files(tag_dir)
        if not names:
            return CheckpointNotFoundError(f"no checkpoint of ours in {tag_dir}", path=tag_dir)
        for name in names[rank::world_size]:
            try:
                self.store.load(os.path.join(tag_dir, name))
            except (CheckpointError, OSError) as exc:
                return exc
        return None

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Every file of the tag is committed (waits for the background writes); then DeepSpeed
        writes ``latest``."""
        self.store.wait()
        if self._info == info:
            self._info = None
        return True

    def is_decoupled(self) -> bool:
        return self.store.options.async_mode.value == "double_buffer"

    def get_commit_info(self) -> CheckpointCommitInfo | None:
        return self._info

    def preserves_storage_sharing(self) -> bool:
        return False  # no clone before save: the snapshot copies into our host buffers anyway

    def cleanup(self) -> None:
        """The end (``engine.destroy()`` calls it): commit the last tag, naming it in ``latest`` as
        DeepSpeed does at its next step (rank 0), and free the staging buffers."""
        info = self._info
        if info is not None:
            self.commit(info)
            if info.save_latest and _rank() == 0:
                latest = os.path.join(info.save_dir, "latest")
                with open(latest + ".tmp", "w") as out:
                    out.write(info.tag)
                os.replace(latest + ".tmp", latest)
        self.store.close()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def load_checkpoint(engine: Any, load_dir: str | os.PathLike, tag: str | None = None, **kwargs: Any):
    """``engine.load_checkpoint(load_dir, tag, **kwargs)`` of the newest tag that verifies on every rank.

    The tag ``latest`` names is tried first, then the other tags under ``load_dir`` written by us
    with a lower step, newest first. Before DeepSpeed reads a tag, the ranks read and verify its
    files (each rank a share of them: one extra read of the tag in all) and agree, so a damaged
    newest tag is passed over, with a warning, on every rank alike, and DeepSpeed never loads half
    of one. A ``tag`` asked for by name is never replaced: when it does not verify, every rank
    raises :class:`ckpt.CorruptCheckpointError` naming it and the older tag that would stand in.
    Returns what ``engine.load_checkpoint`` returns; ``(None, None)`` when there is no tag; raises
    :class:`ckpt.CorruptCheckpointError` when there are tags but none verifies."""
    ours = engine.checkpoint_engine
    if not isinstance(ours, CkptCheckpointEngine):
        return engine.load_checkpoint(load_dir, tag, **kwargs)
    load_dir = os.fspath(load_dir)
    first = tag if tag is not None else _read_latest(load_dir)
    candidates = _tags(load_dir, first, named=tag is not None)
    failure = None
    for candidate in candidates:
        problem = ours.verify_share(os.path.join(load_dir, candidate), _rank(), _world_size())
        failure = failure or problem
        if _all_ranks(problem is None, engine):
            if candidate != first and tag is not None:
                raise CorruptCheckpointError(
                    f"checkpoint tag {tag} under {load_dir} cannot be loaded ({failure or 'on another rank'}); it was "
                    f"asked for by name, so {candidate} is not loaded in its place: pass tag={candidate!r} to load "
                    "that one", path=os.path.join(load_dir, tag))
            if candidate != first:
                warnings.warn(f"checkpoint tag {first} under {load_dir} cannot be loaded; loading {candidate} instead",
                              stacklevel=2)
            return engine.load_checkpoint(load_dir, candidate, **kwargs)
        log.warning("checkpoint tag %s under %s cannot be loaded (%s); trying an older one", candidate, load_dir,
                    problem or "on another rank")
    if candidates:
        raise CorruptCheckpointError(f"no checkpoint tag under {load_dir} verifies (tried {', '.join(candidates)})",
                                     path=load_dir)
    return None, None


def _read_latest(load_dir: str) -> str | None:
    try:
        with open(os.path.join(load_dir, "latest")) as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def _tags(load_dir: str, first: str | None, named: bool = False) -> list[str]:
    """``first``, then the tags holding checkpoints of ours with a lower step, newest first (all of
    them, newest first, without ``first``; ``first`` alone when it was ``named`` and has no step of
    ours to compare: no tag whose step is unknown may stand in for it, least of all a newer one)."""
    steps = {}
    for name in sorted(os.listdir(load_dir)) if os.path.isdir(load_dir) else ():
        tag_dir = os.path.join(load_dir, name)
        found = [s for s in (_step(os.path.join(tag_dir, f)) for f in _files(tag_dir)) if s is not None]
        if found:
            steps[name] = max(found)
    newest_first = sorted(steps, key=lambda n: steps[n], reverse=True)
    if first is None:
        return newest_first
    limit = steps.get(first)
    if limit is None and named:
        return [first]
    return [first, *(n for n in newest_first if n != first and (limit is None or steps[n] < limit))]


def _files(tag_dir: str) -> list[str]:
    """The names in ``tag_dir`` that are checkpoint directories of ours (committed or not)."""
    if not os.path.isdir(tag_dir):
        return []
    return sorted(n for n in os.listdir(tag_dir) if os.path.isfile(os.path.join(tag_dir, n, "manifest.json")))


def _step(path: str) -> int | None:
    try:
        return read_manifest(path).step
    except CheckpointError:
        return None


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _all_ranks(ok: bool, engine: Any) -> bool:
    """Whether ``ok`` holds on every rank (one all-reduce; this rank's answer alone without a group)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return ok
    flag = torch.tensor([1 if ok else 0], device=getattr(engine, "device", None) or "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def use_ckpt_engine(engine: Any, options: SaveOptions | None = None, **fields: Any) -> CkptCheckpointEngine:
    """Put a :class:`CkptCheckpointEngine` in place of ``engine``'s checkpoint engine."""
    ours = CkptCheckpointEngine(getattr(engine, "_config", None), options, **fields)
    engine.checkpoint_engine = ours
    return ours


def initialize(*args: Any, ckpt_options: SaveOptions | None = None, **kwargs: Any):
    """``deepspeed.initialize``; with ``"checkpoint": {"engine": "ckpt", "ckpt": {fields}}`` in the
    config (a dict, or a JSON file's path) the engine checkpoints through ours. Those two keys are
    taken out of (a copy of) the config before DeepSpeed reads it."""
    chosen, fields = None, {}
    config = kwargs.get("config")
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            config = json.load(f)
    if isinstance(config, dict) and isinstance(config.get("checkpoint"), dict):
        config = copy.deepcopy(config)
        chosen = config["checkpoint"].pop("engine", None)
        fields = config["checkpoint"].pop(CONFIG_VALUE, {})
        kwargs["config"] = config
    if chosen not in (None, CONFIG_VALUE):
        raise ValueError(f"checkpoint.engine {chosen!r}: ckpt.integrations.deepspeed knows only {CONFIG_VALUE!r}")
    result = deepspeed.initialize(*args, **kwargs)
    if chosen == CONFIG_VALUE:
        use_ckpt_engine(result[0], ckpt_options, **fields)
    return result
