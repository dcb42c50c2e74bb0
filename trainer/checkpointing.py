"""A training run's checkpoints: the manager, what the run resumes from, the weights it starts from,
the seed checkpoint, and the lines the run prints about them.

Contract: :class:`RunCheckpoints` is built by :class:`trainer.train.Trainer` before anything is
written. With ``checkpoint.enable`` (or ``create_seed_checkpoint``) it opens the
:class:`ckpt.CheckpointManager` of ``checkpoint.folder`` (relative to ``job.dump_folder`` unless
absolute or a URL) first, so a second run on the folder is refused before it writes, and attaches
the optimizer. :meth:`RunCheckpoints.start` then resumes from ``checkpoint.load_step`` or the newest
committed step, or, when nothing was resumed, loads the model's weights only from
``checkpoint.initial_load_path`` (:func:`initial_checkpoint`: :func:`ckpt.root.resolve_checkpoint`). Errors become the run's exits
(:mod:`trainer.exits`): what cannot be used as asked is :class:`~trainer.exits.Refused` (exit 2),
a checkpoint that cannot be loaded :class:`~trainer.exits.Failed` (exit 1). Rank 0 prints one line
per committed checkpoint (:func:`commit_line`) and, on a resume, the step and where it came from
(``checkpoint.memory``'s memory tier or the folder), after the tier's line saying why a memory step
was not used, when it has one; ``events`` (:mod:`trainer.checkpoint_events`) records what happens to
the checkpoints in metrics.jsonl.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict

import ckpt
from ckpt.format import step_name
from ckpt.read import looks_like_dcp
from ckpt.root import resolve_checkpoint
from ckpt.storage import is_url, locate
from ckpt.units import binary_bytes
from . import exits
from .checkpoint_events import CheckpointEvents
from .config import Config


def checkpoint_folder(cfg: Config) -> str:
    """``checkpoint.folder``, under ``job.dump_folder`` unless absolute or a URL."""
    folder = cfg.checkpoint.folder
    return folder if is_url(folder) or os.path.isabs(folder) else str(Path(cfg.job.dump_folder) / folder)


def commit_line(info: ckpt.CommitInfo) -> str:
    """The line a run prints when a checkpoint is committed."""
    copies = f"; copying to {info.replicas} replica{'s' * (info.replicas > 1)}" if info.replicas else ""
    return (f"checkpoint step {info.step} committed: {info.kind}, {binary_bytes(info.bytes)} in "
            f"{info.seconds:.2f} s, {info.path}{copies}")


_FOREIGN_STEP = re.compile(r"^step-(\d+)$")
_OUR_KEY = re.compile(r"^model\.((tok_embeddings|norm|output)\.weight|layers\.\d+\.(attention\.w[qkvo]|"
                      r"feed_forward\.w[123]|attention_norm|ffn_norm)\.weight)$")


def convert_hint(path: str) -> str:
    """How to convert ``path`` when it is a checkpoint another trainer wrote: a DCP directory, or a
    folder of torchtitan's ``step-N`` DCP directories ("" otherwise)."""
    if is_url(path) or not os.path.isdir(path):
        return ""
    location = locate(path)
    if looks_like_dcp(location):
        return (f"; it is a plain DCP checkpoint (torchtitan's step-N directories are): convert it with "
                f"ckpt-convert {path} <new folder> --from torchtitan --flavor <its flavor> (a torchtitan run), "
                f"or --from dcp")
    steps = sorted(name for name in os.listdir(path) if _FOREIGN_STEP.match(name)
                   and looks_like_dcp(location / name))
    if steps:
        return (f"; it holds another trainer's DCP checkpoints ({', '.join(steps[-3:])}: torchtitan's layout): convert "
                f"one with ckpt-convert {path} <new folder> --from torchtitan --flavor <its flavor>")
    return ""


def initial_checkpoint(source: str):
    """The checkpoint ``source`` names: itself when committed, else the newest step of the root
    ``source`` that can load (:func:`ckpt.root.resolve_checkpoint`); CheckpointNotFoundError when
    there is none."""
    return resolve_checkpoint(source)


def names_problem(live: set[str], saved: set[str], stored: set[str]) -> str:
    """Why the checkpoint's ``model.`` tensors ``saved`` (of all its tensors ``stored``) are not the
    model's ``live`` ones: other names (another trainer's layout) or another shape of the model."""
    missing, unexpected = sorted(live - saved), sorted(saved - live)
    listed = (f"{len(missing)} missing: {', '.join(missing[:3]) or '-'}; "
              f"{len(unexpected)} unexpected: {', '.join(unexpected[:3]) or '-'}")
    foreign = sorted(stored - saved) if not saved else [k for k in unexpected if not _OUR_KEY.match(k)]
    if foreign:
        return (f"its model weights do not fit this model: its tensors are not named as this trainer's model "
                f"({listed}; e.g. {', '.join(foreign[:2])}): "
                "it was written by another trainer or model; a torchtitan checkpoint converts with ckpt-convert "
                "SRC DST --from torchtitan --flavor <its flavor>, a Hugging Face model with --from hf")
    return (f"its model weights do not fit this model: named as this trainer's, but another model's ({listed}); set model.* "
            "(n_layers, tie_embeddings, ...) to the shapes it was written with")


class RunCheckpoints:
    """The checkpoints of one run (see the module docstring); ``manager`` is None without them."""

    def __init__(self, cfg: Config, *, device_type: str, optimizer: torch.optim.Optimizer,
                 model: torch.nn.Module, log: Callable[[str], None]):
        self.cfg, self.log = cfg, log
        self.manager: ckpt.CheckpointManager | None = None
        self.events: CheckpointEvents | None = None
        self.written = 0  # checkpoints committed by this run
        self.resumed_step: int | None = None
        self.last_saved: int | None = None  # the last step this run started a save of
        self._memory_told: set[str] = set()  # memory-tier troubles already said once
        c = cfg.checkpoint
        if not (c.enable or c.create_seed_checkpoint):
            return
        folder = checkpoint_folder(cfg)
        options = c.save_options(device_type=device_type, user_metadata={"config": cfg.to_record()})
        if c.create_seed_checkpoint:  # the run exists to write it
            options = options.replace(on_error=ckpt.FailurePolicy.STOP)
        hint = convert_hint(folder)
        if hint:  # another trainer's steps: neither trained over nor ignored
            raise exits.Refused(f"checkpoint.folder={str(folder)!r} is not this trainer's{hint}, and point "
                                "checkpoint.folder at the result")
        # the lock is rank 0's, its refusal agreed: every rank raises it, local rank 0 says it
        try:
            with exits.refusing_together(f"checkpoint.folder={str(folder)!r}", alike=(ckpt.CheckpointLockedError,)):
                self.manager = ckpt.CheckpointManager(folder, options, on_commit=self._committed)
        except exits.Refused as refused:  # another key's value (checkpoint.memory's folder): named as that key
            option = refused.__cause__
            if not isinstance(option, ckpt.InvalidOptionError):
                raise
            raise exits.Refused(f"checkpoint.{option.option}={option.value!r}: {option.requirement}") from option
        self.manager.attach(optimizer, model=model)  # and forwards that change persistent buffers
        self.events = CheckpointEvents(self.manager)

    def _committed(self, info: ckpt.CommitInfo) -> None:
        """One line and one record per committed checkpoint (the manager calls this on rank 0, from its writer)."""
        self.log(commit_line(info))
        self.written += 1
        self.events.committed(info)

    def start(self, state: dict, model: torch.nn.Module) -> None:
        """Resume (unless the run writes the seed checkpoint), else take checkpoint.initial_load_path's weights."""
        c = self.cfg.checkpoint
        if self.manager is not None and not c.create_seed_checkpoint:
            self.resume(state)
        if c.initial_load_path and self.resumed_step is None:
            self.load_initial_weights(model, c.initial_load_path)

    def resume(self, state: dict) -> None:
        """Load checkpoint.load_step, or the newest committed step if any."""
        load_step = self.cfg.checkpoint.load_step
        listed = self.manager.steps()
        state, note = self._without_foreign_data(state, load_step, listed)
        try:
            step = self.manager.load(state, step=load_step)
        except ckpt.CheckpointError as exc:
            if load_step is not None and isinstance(exc, ckpt.CheckpointNotFoundError):
                raise exits.Refused(f"checkpoint.load_step={load_step}: {exc}") from exc
            raise exits.Failed(f"the checkpoint to resume from cannot be loaded: {exc}") from exc
        memory_note = self.manager.memory_note if self.manager.loaded_from != "memory" else None
        if memory_note:  # why a memory step was not used
            self.log(memory_note)
        if step is not None:
            self._branch_if_asked(step)  # before the resume line: a refused start prints none
            self.events.resumed(step, listed_before=listed if load_step is None else [], memory_note=memory_note)
            self.resumed_step = step
            if self.manager.loaded_from == "memory":
                newest = self.newest()
                self.log(f"resumed from checkpoint step {step} (from memory: {self.cfg.checkpoint.memory}; newest "
                         f"in {self.manager.root}: {'none' if newest is None else f'step {newest}'}){note}")
                return
            self.log(f"resumed from checkpoint step {step} ({self.manager.root}){note}; "
                     f"{self.manager.load_stats.summary()} on this rank")

    def _branch_if_asked(self, step: int) -> None:
        """A load_step older than the newest committed step: refused unless checkpoint.branch, which
        deletes the later steps (on every mount) so that the run leaves one history. Every rank
        decides alike (rank 0's listing). Without load_step the newest step that loads was resumed
        (damaged later ones were set aside): a later one still there could not be read now."""
        later = [s for s in self.manager.steps(agreed=True) if s > step]
        shown = ", ".join(map(str, later[:8])) + (f" and {len(later) - 8} more" if len(later) > 8 else "")
        if later and self.cfg.checkpoint.load_step is None:
            raise exits.Failed(
                f"resumed from checkpoint step {step}, but the committed steps {shown} are newer and could not be "
                f"loaded now (not damaged: a mount could not be read, see the warnings above); training on would "
                f"replace them. Start again when the mount is back, or pass --checkpoint.load_step {step} "
                f"--checkpoint.branch true to give them up")
        if later and not self.cfg.checkpoint.branch:
            raise exits.Refused(
                f"checkpoint.load_step={step}: the committed steps {shown} are newer; training on from step {step} "
                f"would replace them one by one and mix two histories. Pass --checkpoint.branch true to delete them "
                f"and branch from step {step}, or drop load_step to resume from step {later[-1]}")
        if not self.cfg.checkpoint.branch:
            return
        # Every rank joins, even one that lists no later step: rank 0 may have deleted them already.
        with exits.refusing(f"checkpoint.branch: deleting the steps after {step}"):
            deleted = self.manager.discard_after(step)
        if deleted or later:
            self.log(f"branching from step {step}: deleted the later steps {', '.join(map(str, deleted)) or shown}")

    def _without_foreign_data(self, state: dict, load_step: int | None, steps: list[int]) -> tuple[dict, str]:
        """``state`` without the data loader when the step to resume was converted from another
        trainer's checkpoint, which holds no position of our loader (``ckpt-convert --from
        torchtitan``), and the note for the resume line; else ``state`` as it is. ``steps``: the committed ones."""
        step = load_step if load_step is not None else (steps[-1] if steps else None)
        if step not in steps or "dataloader" not in state:
            return state, ""
        try:
            manifest = self.manager.manifest(step)
        except ckpt.CheckpointError:
            return state, ""  # the load itself reports (or falls back past) a damaged step
        origin = (manifest.user or {}).get("converted_from")
        if not isinstance(origin, dict) or any(key.startswith("dataloader.") for key in manifest.values):
            return state, ""
        return ({k: v for k, v in state.items() if k != "dataloader"},
                f"; converted from {origin.get('format')}: its data position is not this trainer's, "
                "so the data starts from the beginning")

    def load_initial_weights(self, model: torch.nn.Module, source: str) -> None:
        """checkpoint.initial_load_path: the model's weights only, from a checkpoint directory or the
        newest committed step of a root. Refused (exit 2) when it holds no checkpoint or its
        ``model.`` tensors are not exactly the model's; a damaged checkpoint fails (exit 1)."""
        what = f"checkpoint.initial_load_path={source!r}"
        try:
            path = initial_checkpoint(source)
            manifest = ckpt.read_manifest(path)
        except (ckpt.CheckpointError, OSError) as exc:
            raise exits.Refused(f"{what}: {exc}{convert_hint(source)}") from exc
        live = {f"model.{key}" for key in get_model_state_dict(model)}
        saved = {key for key in manifest.tensors if key.startswith("model.")}
        if live != saved:
            raise exits.Refused(f"{what}: {names_problem(live, saved, set(manifest.tensors))}")
        try:  # non-strict: whatever else it holds (an optimizer, a data position) is left out
            ckpt.load({"model": model}, path, strict=False)
        except ckpt.IncompatibleCheckpointError as exc:
            raise exits.Refused(f"{what}: its model weights do not fit this model: {exc}") from exc
        except ckpt.CheckpointError as exc:
            raise exits.Failed(f"{what} cannot be loaded: {exc}") from exc
        step = "" if manifest.step is None else f" (step {manifest.step})"
        self.log(f"model weights loaded from {path}{step}; optimizer, schedule and data start fresh")

    @property
    def stall_s(self) -> float:
        """Seconds training has waited for checkpoints so far (0 without them)."""
        return 0.0 if self.manager is None else self.manager.stats.stall_s

    @property
    def failures(self) -> int:
        """Saves that failed under on_error=continue so far."""
        return 0 if self.manager is None else self.manager.stats.failures

    @property
    def memory_counts(self) -> dict:
        """The memory tier's counters for the metrics (empty without the tier)."""
        if self.manager is None or self.cfg.checkpoint.memory is None:
            return {}
        stats = self.manager.stats
        return {"ckpt_memory_saves": stats.memory_saves, "ckpt_memory_skipped": stats.memory_skipped,
                "ckpt_memory_failed": stats.memory_failures}

    def save(self, step: int, state: dict, *, force: bool) -> ckpt.CheckpointError | None:
        """``manager.save`` (nothing without checkpoints); the error of a failed save, to be agreed
        on by all ranks, or None."""
        if self.manager is None:
            return None
        try:
            if self.manager.save(step, state, force=force):
                self.last_saved = step
        except ckpt.CheckpointError as exc:
            return exc
        self.events.saved(step)
        self._tell_memory_trouble()
        return None

    def _tell_memory_trouble(self) -> None:
        """One line the first time the memory tier skips a save (no room) and the first time one
        fails: the engine's own warnings go to its logger, which the trainer does not show."""
        if self.cfg.checkpoint.memory is None or len(self._memory_told) == 2:  # every step: nothing to look at
            return
        stats = self.manager.stats
        for count, what, seen in ((stats.memory_skipped, "skipped: no room in", "skipped"),
                                  (stats.memory_failures, "failed in", "failed")):
            if count and seen not in self._memory_told:
                self._memory_told.add(seen)
                self.log(f"memory tier: a save {what} {self.cfg.checkpoint.memory} (ckpt_memory_{seen} in the "
                         "metrics counts them); storage checkpoints go on as configured")

    def finish(self) -> ckpt.CheckpointError | None:
        """Wait for every save in flight (after the final save, before its metrics record): a failure
        is counted with a warning under on_error=continue, so the last record's ``ckpt_failures``
        holds it, or returned under on_error=stop, to be agreed on by all ranks like a save's."""
        if self.manager is None:
            return None
        try:
            self.manager.wait()
        except ckpt.CheckpointError as exc:
            return exc
        self.events.observe()
        return None

    def write_seed(self, state: dict) -> None:
        """checkpoint.create_seed_checkpoint: ``state`` as step 0, waited for, the folder released."""
        self.manager.save(0, state, force=True)
        self.close()
        self.log(f"seed checkpoint written to {self.manager.root / step_name(0)}")

    def close(self, *, finished: bool = True) -> None:
        """Wait for the last saves and release the folder; a failed save raises exits.Failed (on_error
        stop) or, under on_error continue, is reported with the count of failed saves. ``finished``:
        the run ended well (its memory-tier steps go); otherwise they stay for the restart."""
        try:
            self.manager.close(finished=finished)
        except ckpt.CheckpointError as exc:
            raise exits.save_failed(self.manager, exc) from exc
        finally:
            self.events.observe()  # the last saves' outcomes, the replicas' final states
        failures = self.manager.stats.failures
        if failures:
            steps = self.manager.steps()
            self.log(f"{failures} checkpoint save{'s' if failures > 1 else ''} failed (checkpoint.on_error=continue); "
                     f"newest committed step: {steps[-1] if steps else 'none'}")

    def newest(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.manager.steps()
        return steps[-1] if steps else None

    def totals(self) -> dict:
        """For the run_end record: checkpoints this run wrote, how many the folder keeps, the newest."""
        steps = self.manager.steps()
        return {"checkpoints_written": self.written, "checkpoints_kept": len(steps),
                "newest_step": steps[-1] if steps else None}

    def summary(self, totals: dict) -> str:
        """The run's last line's checkpoint part (``totals``: :meth:`totals`'s): checkpoints written,
        kept, the newest step and where."""
        newest = totals["newest_step"]
        where = f"newest step {newest} at {self.manager.root / step_name(newest)}" if newest is not None else "none committed"
        return f"; {totals['checkpoints_written']} checkpoints written, {totals['checkpoints_kept']} kept, {where}"
