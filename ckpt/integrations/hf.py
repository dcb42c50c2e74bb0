"""Hugging Face: the ``Trainer``'s checkpoints through the engine (``CkptCallback``), and the model
weights of ``accelerate``'s ``save_state``/``load_state`` (:func:`register_accelerate_hooks`).

    from ckpt.integrations.hf import CkptCallback
    trainer = Trainer(model, args, train_dataset=data, callbacks=[CkptCallback(full_every=4)])
    trainer.train(resume_from_checkpoint=True)      # or a checkpoint-N folder, or our root

**Saving.** At each save the ``Trainer`` decides on (``save_strategy`` "steps"/"epoch",
``save_steps``), the callback saves model, optimizer, LR scheduler, RNG (torch, Python, NumPy,
accelerator) and the ``TrainerState`` as step ``global_step`` of a :class:`ckpt.CheckpointManager`
under ``<output_dir>/ckpt`` (``root=`` elsewhere, a URL too), and tells the Trainer not to write its
own: asynchronous double-buffered snapshots, checksums, atomic commits, deltas (``full_every``),
replicas (``replicas=``), pickle-free loads. ``save_total_limit`` is the manager's ``keep``.
Beside each committed step the callback writes ``<output_dir>/checkpoint-N/trainer_state.json``
(the Trainer's own JSON), the folder the Trainer's resume looks for; retention removes it with the step.
The model's ``config.json`` (a transformers model's) is recorded in the step too (value
``model_config``): ``ckpt-convert STEP DIR --to hf`` writes a folder ``from_pretrained`` reads.

**Resuming.** ``trainer.train(resume_from_checkpoint=...)`` goes through the Trainer's own resume
path; the callback, bound to its Trainer when the Trainer is built, answers the Trainer's load calls
from our checkpoint: the model where the Trainer loads weights, optimizer and scheduler once they
exist, the RNG where the Trainer restores it (after skipping the batches already seen). The step is
read and verified whole first: a damaged newest step is passed over, with a warning, for the newest
older one that loads, and the ``trainer_state.json`` the Trainer then reads is that step's. A folder
without our checkpoint (a Trainer-written one) is loaded by the Trainer as usual.

Not supported: ``save_strategy="best"`` (decided after evaluation, where no callback can stand in
for the save), DeepSpeed/FSDP inside the Trainer (their engines save themselves), a ``GradScaler``
(mixed precision on GPUs: its state is not saved), PEFT adapters, ``push_to_hub`` of checkpoints, the
memory tier (``memory=`` is refused: the Trainer resumes from the ``checkpoint-N`` folder it finds or is
given, and the callback reads that step from storage before the optimizer exists, so a memory step,
which has no folder and is recovered into the whole live state, cannot be what it loads).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import os
import shutil
import warnings
from typing import Any

from ._optional import require

require("transformers", extra="hf", integration="ckpt.integrations.hf")

from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict  # noqa: E402
from transformers import Trainer, TrainerCallback  # noqa: E402
from transformers.trainer_callback import ExportableState  # noqa: E402

from .. import CheckpointError, CheckpointManager, CheckpointRoot, CommitInfo, RNGState, SaveOptions  # noqa: E402
from .. import save as save_checkpoint, load as load_checkpoint  # noqa: E402
from ..convert.plugins import HF_CONFIG_VALUE  # noqa: E402
from ._store import refuse_memory  # noqa: E402
from ._tree import read_tree  # noqa: E402

log = logging.getLogger(__name__)

__all__ = ["CkptCallback", "register_accelerate_hooks"]

STATE_NAME = "trainer_state.json"
PREFIX = "checkpoint-"
FALLBACK = (CheckpointError, OSError)


def _inner(optimizer: Any) -> Any:
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it


class CkptCallback(TrainerCallback):
    """A ``TrainerCallback`` checkpointing through the engine (see the module docstring).

    Args:
        root: our checkpoint root; default ``<output_dir>/ckpt``.
        options / fields: a :class:`ckpt.SaveOptions` and/or its fields (``full_every``,
            ``replicas``, ``async_mode``, ``compress``, ...). ``keep`` defaults to the Trainer's
            ``save_total_limit`` (3 when that is None); ``interval`` does not apply; ``memory`` is
            refused (:class:`ckpt.InvalidOptionError`, see the module docstring).
        storage_options: for URL roots and replicas (fsspec).
    """

    def __init__(self, root: str | os.PathLike | None = None, options: SaveOptions | None = None, *,
                 storage_options: dict | None = None, **fields: Any):
        self.root = None if root is None else os.fspath(root)
        self.options = (options or SaveOptions()).replace(**fields)
        refuse_memory(self.options, "the Hugging Face Trainer")
        self._keep_given = "keep" in fields or options is not None
        self.storage_options = storage_options
        self.manager: CheckpointManager | None = None
        self.trainer: Trainer | None = None
        self._output_dir: str | None = None
        self._pending: dict[int, str] = {}  # step -> its trainer_state.json, until committed
        self._resumed: dict | None = None  # the tree of the step a resume loaded
        self._resumed_from: str | None = None

    # -- binding to the Trainer ----------------------------------------------------------------------
    def on_init_end(self, args, state, control, **kwargs):
        # The Trainer that is calling us, from its __init__, within 11 frames. Frames are walked, not
        # taken from inspect.stack(), which reads every frame's source lines up the whole stack.
        frame = inspect.currentframe()
        for _ in range(11):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                break
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, Trainer) and self in candidate.callback_handler.callbacks:
                self.bind(candidate)
                break
        del frame  # no reference cycle through this frame
        return control

    def bind(self, trainer: Trainer) -> None:
        """Answer ``trainer``'s resume calls for our checkpoints (done by ``Trainer(callbacks=[...])``;
        call it yourself after ``trainer.add_callback``)."""
        self.trainer = trainer
        loaders = {name: getattr(trainer, name) for name in
                   ("_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_rng_state", "_load_scaler")}

        def load_model(checkpoint, model=None):
            if not self._owns(checkpoint):
                return loaders["_load_from_checkpoint"](checkpoint, model)
            self._resume(checkpoint, model if model is not None else trainer.model)

        def load_optimizer(checkpoint):
            if not self._owns(checkpoint):
                return loaders["_load_optimizer_and_scheduler"](checkpoint)
            tree = self._tree(checkpoint, trainer.model)
            set_optimizer_state_dict(trainer.model, _inner(trainer.optimizer), tree["optimizer"])
            if trainer.lr_scheduler is not None and "scheduler" in tree:
                trainer.lr_scheduler.load_state_dict(tree["scheduler"])

        def load_rng(checkpoint):
            if not self._owns(checkpoint):
                return loaders["_load_rng_state"](checkpoint)
            RNGState().load_state_dict(self._tree(checkpoint, trainer.model)["rng"])

        def load_scaler(checkpoint):
            if not self._owns(checkpoint):
                return loaders["_load_scaler"](checkpoint)

        trainer._load_from_checkpoint = load_model
        trainer._load_optimizer_and_scheduler = load_optimizer
        trainer._load_rng_state = load_rng
        trainer._load_scaler = load_scaler

    # -- saving --------------------------------------------------------------------------------------
    def on_step_end(self, args, state, control, **kwargs):
        return self._maybe_save(args, state, control, kwargs)

    def on_epoch_end(self, args, state, control, **kwargs):
        return self._maybe_save(args, state, control, kwargs)

    def on_train_end(self, args, state, control, **kwargs):
        if self.manager is not None:
            self.manager.close()
            self._retire_folders()  # retention ran after the last commit's callback
            self.manager = None
        return control

    def _maybe_save(self, args, state, control, kwargs):
        if not control.should_save:
            return control
        control.should_save = False  # ours instead of the Trainer's own
        model, optimizer = kwargs["model"], _inner(kwargs["optimizer"])
        manager = self._manager(args, optimizer, model)
        if state.is_world_process_zero:
            self._retire_folders()  # what retention deleted after the previous commit
        self._export_callbacks(state)
        trainer_state = json.loads(json.dumps(dataclasses.asdict(state)))  # what save_to_json writes
        self._pending[state.global_step] = json.dumps(trainer_state, indent=2, sort_keys=True) + "\n"
        tree = {"model": model, "optimizer": optimizer, "rng": RNGState(), "trainer_state": trainer_state}
        config = getattr(model, "config", None)
        if hasattr(config, "to_json_string"):  # what ckpt-convert --to hf writes as config.json
            tree[HF_CONFIG_VALUE] = json.loads(config.to_json_string(use_diff=False))
        if kwargs.get("lr_scheduler") is not None:
            tree["scheduler"] = kwargs["lr_scheduler"]
        manager.save(state.global_step, tree, force=True)
        return control

    def _export_callbacks(self, state) -> None:
        """What the Trainer does before writing its state: the stateful callbacks' current state."""
        if self.trainer is None:
            return
        for cb in [*self.trainer.callback_handler.callbacks, self.trainer.control]:
            if isinstance(cb, ExportableState):
                name = cb.__class__.__name__
                if isinstance(state.stateful_callbacks.get(name), list):
                    state.stateful_callbacks[name].append(cb.state())
                else:
                    state.stateful_callbacks[name] = cb.state()

    def _manager(self, args, optimizer, model) -> CheckpointManager:
        if self.manager is None:
            self._output_dir = args.output_dir
            root = self.root or os.path.join(args.output_dir, "ckpt")
            keep = self.options.keep if self._keep_given else (args.save_total_limit or self.options.keep)
            self.manager = CheckpointManager(root, self.options.replace(keep=keep, interval=1),
                                             storage_options=self.storage_options, on_commit=self._committed)
            self.manager.attach(optimizer, model=model)
        return self.manager

    def _committed(self, info: CommitInfo) -> None:
        """Rank 0, after a step committed: its Trainer folder; Trainer folders of retired steps go."""
        text = self._pending.pop(info.step, None)
        if text is not None and self._output_dir is not None:
            folder = os.path.join(self._output_dir, f"{PREFIX}{info.step}")
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, STATE_NAME), "w") as out:
                out.write(text)
        self._retire_folders()

    def _retire_folders(self) -> None:
        if self._output_dir is None or self.manager is None:
            return
        live = set(self.manager.steps())
        for name in os.listdir(self._output_dir):
            step = name[len(PREFIX):]
            folder = os.path.join(self._output_dir, name)
            if (name.startswith(PREFIX) and step.isdigit() and int(step) not in live and os.path.isdir(folder)
                    and set(os.listdir(folder)) <= {STATE_NAME}):
                shutil.rmtree(folder)

    # -- resuming ------------------------------------------------------------------------------------
    def _root_for(self, checkpoint: str) -> str:
        if self.root is not None:
            return self.root
        parent = os.path.dirname(os.path.abspath(checkpoint))
        return os.path.join(parent, "ckpt")

    def _owns(self, checkpoint: str | None) -> bool:
        """A Trainer folder we wrote (only trainer_state.json in it, our step beside)."""
        if checkpoint is None or not os.path.isdir(checkpoint):
            return False
        name = os.path.basename(os.path.normpath(checkpoint))
        return (name.startswith(PREFIX) and name[len(PREFIX):].isdigit()
                and set(os.listdir(checkpoint)) <= {STATE_NAME} and os.path.isdir(self._root_for(checkpoint)))

    def _tree(self, checkpoint: str, model) -> dict:
        if self._resumed is None or self._resumed_from != os.path.abspath(checkpoint):
            self._resume(checkpoint, model)
        return self._resumed

    def _resume(self, checkpoint: str, model) -> None:
        """Read the newest step up to the folder's that verifies, load its model, and make the
        folder's trainer_state.json that step's, for the Trainer to read next."""
        wanted = int(os.path.basename(os.path.normpath(checkpoint))[len(PREFIX):])
        root = CheckpointRoot(self._root_for(checkpoint), self.storage_options)
        mirrors = tuple(self.options.replicas)
        failure = None
        for step in sorted((s for s in root.steps() if s <= wanted), reverse=True):
            try:
                tree = read_tree(str(root.step_path(step)), mirrors=mirrors, storage_options=self.storage_options)
            except FALLBACK as exc:
                log.warning("checkpoint step %d cannot be loaded (%s); trying an older one", step, exc)
                failure = failure or exc
                continue
            if failure is not None:
                warnings.warn(f"checkpoint step {wanted} cannot be loaded ({failure}); resuming from step {step}",
                              stacklevel=3)
            set_model_state_dict(model, tree["model"])
            with open(os.path.join(checkpoint, STATE_NAME), "w") as out:
                json.dump(tree["trainer_state"], out, indent=2, sort_keys=True)
            self._resumed, self._resumed_from = tree, os.path.abspath(checkpoint)
            return
        raise failure or CheckpointError(f"no committed checkpoint up to step {wanted} under {root.path}")


def register_accelerate_hooks(accelerator, *, folder: str = "ckpt_model") -> list:
    """Make ``accelerator.save_state``/``load_state`` write and read the models' weights through
    the engine (``<output_dir>/<folder>``: checksummed, atomic, pickle-free) instead of
    ``model.safetensors``; optimizers, schedulers, RNG and dataloaders stay accelerate's files.
    Returns the hooks' handles (``handle.remove()`` undoes it)."""

    def save_models(models, weights, output_dir):
        if weights and accelerator.is_main_process:
            state = {f"model_{i}": dict(w) for i, w in enumerate(weights)}
            save_checkpoint(state, os.path.join(output_dir, folder), overwrite=True, no_dist=True)
        weights.clear()  # accelerate writes no weights file of its own

    def load_models(models, input_dir):
        path = os.path.join(input_dir, folder)
        if models and os.path.isdir(path):
            load_checkpoint({f"model_{i}": accelerator.unwrap_model(m) for i, m in enumerate(models)}, path,
                            no_dist=True)
            models.clear()  # loaded: accelerate loads no weights file

    return [accelerator.register_save_state_pre_hook(save_models),
            accelerator.register_load_state_pre_hook(load_models)]
