"""A torchtitan llama3 run's checkpoint as one our trainer resumes, and back (``ckpt-convert --from/--to torchtitan``).

torchtitan 0.3.0's ``CheckpointManager`` writes a plain DCP directory ``<folder>/step-N`` holding its
model state flat at the top (:mod:`trainer.titan.names`), ``optimizer.state.<param>.<name>`` and
``optimizer.param_groups.<param>.<hyper-parameter>`` (its flat, parameter-keyed optimizer state),
``lr_scheduler.last_epoch``, ``train_state.{step,ntokens_seen}`` and ``dataloader.dp_rank_<r>``
(a pickle of its own loader).

Contract: :func:`import_torchtitan` reads such a directory (or the newest ``step-N`` of a torchtitan
checkpoint folder; or a step of ours in that layout: :mod:`trainer.titan.sources`) and writes step N
of a new checkpoint root our trainer resumes: the model under our names, AdamW's moments with the
fused ``wqkv`` split per projection, its hyper-parameters as one param group, the LR scheduler at
torchtitan's ``last_epoch`` with its base LR, the train step and tokens seen; the data position is
not carried (torchtitan's loader is not ours: the run starts its data from the beginning,
:mod:`trainer.checkpointing` says so). The model's numerics come from the torchtitan flavor named
(they are not in the checkpoint); the shapes are checked against it. :func:`export_torchtitan` is
the other way: a checkpoint of our trainer as ``DST/step-N``, a DCP directory torchtitan's own
``CheckpointManager`` resumes (model, optimizer, LR scheduler, train state; load it with
``checkpoint.exclude_from_loading = ["dataloader"]``). Both hold one checkpoint's state in host
memory while they convert it; CheckpointError names what does not fit.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import ckpt
from ckpt import CheckpointError, CheckpointExistsError, CheckpointRoot
from ckpt.root import resolve_checkpoint
from ..config.derive import flavor_key
from ..hf.run import PREFIX, describe, expected_shapes, model_args_of, shape_problems, trainer_model_config
from ..model import ModelArgs, model_args
from .names import QKV, fuse_qkv, our_name, params_of, split_qkv, titan_name, titan_param
from .sources import is_model_key, read_all, read_source, step_of, titan_step_dir

STATE, GROUPS = "optimizer.state.", "optimizer.param_groups."
OURS_STATE = "optim.state."
OURS_GROUPS = "optim.param_groups."


@dataclass
class TitanImport:
    """What an import wrote (the CLI's summary lines)."""

    path: str  # the step directory written
    step: int
    args: ModelArgs
    model_config: dict | None  # the trainer's model section that builds it
    tensors: int
    left_out: list[str]  # torchtitan's state our trainer has no place for (its data loader's)
    source: str = ""  # the torchtitan step read (a DCP step-N directory, or a checkpoint of ours)


def titan_args(flavor: str, flat: dict[str, Any]) -> ModelArgs:
    """Our :class:`ModelArgs` for a torchtitan llama3 checkpoint of ``flavor`` (torchtitan's name, or
    one of ours): the flavor's numerics, the checkpoint's dimensions."""
    try:
        key = flavor_key(type("M", (), {"name": "llama3", "flavor": flavor})())
    except ValueError as exc:
        raise CheckpointError(f"--flavor {flavor}: {exc}") from None
    embedding = flat.get("tok_embeddings.weight")
    wk = flat.get("layers.0.attention.qkv_linear.wk.weight")
    if not isinstance(embedding, torch.Tensor) or not isinstance(wk, torch.Tensor):
        raise CheckpointError("it holds no torchtitan llama3 model state (no tok_embeddings.weight or "
                              "layers.0.attention.qkv_linear.wk.weight at its top level)")
    vocab, dim = embedding.shape
    layers = 1 + max(int(m.group(1)) for k in flat if (m := re.match(r"^layers\.(\d+)\.", k)))
    base = model_args(key)
    head_dim = dim // base.n_heads
    try:
        return model_args(key, vocab_size=vocab, dim=dim, n_layers=layers, n_kv_heads=wk.shape[0] // head_dim)
    except ValueError as exc:
        raise CheckpointError(f"its shapes do not fit flavor {flavor}: {exc}") from None


def _hyper(groups: dict[str, Any], fqns: list[str]) -> dict[str, dict[str, Any]]:
    """``optimizer.param_groups.<fqn>.<key>`` values → {fqn: {key: value}} (keys of known fqns only)."""
    out: dict[str, dict[str, Any]] = {}
    for key, value in groups.items():
        rest = key[len(GROUPS):]
        fqn = max((f for f in fqns if rest.startswith(f + ".")), key=len, default=None)
        if fqn is None:
            raise CheckpointError(f"optimizer hyper-parameter {key!r} belongs to no parameter of the model")
        out.setdefault(fqn, {})[rest[len(fqn) + 1:]] = value
    return out


def to_ours(flat: dict[str, Any], args: ModelArgs) -> tuple[dict, list[str]]:
    """torchtitan's flat state → our trainer's state (``model``, ``optim``, ``lr_scheduler``,
    ``train``) and the keys left out."""
    model = _model(flat, args)
    ours_params = [k for k in expected_shapes(args) if not (args.tie_embeddings and k == "output.weight")]
    titan_params = list(dict.fromkeys(titan_param(k) for k in ours_params))
    state: dict[str, dict] = {}
    for key, value in flat.items():
        if key.startswith(STATE):
            fqn, _, name = key[len(STATE):].rpartition(".")
            targets = params_of(fqn) if fqn in titan_params else ()
            if not targets:
                raise CheckpointError(f"optimizer state {key!r} belongs to no parameter of the model")
            parts = split_qkv(value, args.n_heads, args.kv_heads) if len(targets) == 3 and value.dim() else \
                [value.clone() for _ in targets]
            for target, part in zip(targets, parts):
                state.setdefault(target, {})[name] = part
    hyper = _hyper({k: v for k, v in flat.items() if k.startswith(GROUPS)}, titan_params)
    first = hyper.get(titan_params[0], {})
    differ = [f for f in titan_params if hyper.get(f) != first]
    if differ:
        raise CheckpointError(f"its parameters have different optimizer hyper-parameters ({differ[0]}: "
                              f"{hyper.get(differ[0])} vs {first}); our trainer has one AdamW param group")
    group = {k: tuple(v) if k == "betas" else v for k, v in first.items()}
    last_epoch = int(flat.get("lr_scheduler.last_epoch", 0))
    base_lr = group.get("initial_lr", group.get("lr"))
    scheduler = _lambda_lr_state(base_lr, group.get("lr", base_lr), last_epoch)
    train = {"step": int(flat.get("train_state.step", last_epoch)),
             "tokens_seen": int(flat.get("train_state.ntokens_seen", 0))}
    left_out = sorted(k for k in flat if k.startswith("dataloader."))
    ours = {"model": model, "optim": {"state": state, "param_groups": [{**group, "params": ours_params}]},
            "lr_scheduler": _Stateful(scheduler), "train": _Stateful(train)}
    return ours, left_out


def _model(flat: dict[str, Any], args: ModelArgs) -> dict[str, torch.Tensor]:
    """torchtitan's model state in ``flat`` under our names, its shapes checked against ``args``."""
    model: dict[str, torch.Tensor] = {}
    for key, value in flat.items():
        if is_model_key(key):
            try:
                model[our_name(key)] = value
            except KeyError as exc:
                raise CheckpointError(f"{exc.args[0]}") from None
    problems = shape_problems({k: tuple(v.shape) for k, v in model.items()}, args)
    if problems:
        raise CheckpointError(f"its model state does not fit ({describe(args)}): {'; '.join(problems)}")
    return model


class _Stateful:
    """A fixed state saved as the trainer's stateful objects are (one value per key, not one dict)."""

    def __init__(self, state: dict):
        self.state = state

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:  # pragma: no cover - only saved
        self.state = state


def _lambda_lr_state(base_lr: float, lr: float, last_epoch: int) -> dict:
    """A ``LambdaLR``'s state dict at ``last_epoch`` (this torch's own keys)."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=base_lr)
    state = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0).state_dict()
    state.update(base_lrs=[base_lr], last_epoch=last_epoch, _step_count=last_epoch + 1, _last_lr=[lr])
    return state


def import_torchtitan(src: str | os.PathLike, dst: str | os.PathLike, *, flavor: str, step: int | None = None,
                      overwrite: bool = False, model_only: bool = False) -> TitanImport:
    """torchtitan's checkpoint ``src`` (a ``step-N`` DCP directory, or its checkpoint folder: the
    newest step, or ``step``) as step N of the new checkpoint root ``dst`` (see the module docstring);
    ``model_only``: its model weights alone (the rest is not read; what ``ckpt-convert --to hf``
    exports a torchtitan checkpoint through), as step N of its name. A step of ours in torchtitan's
    layout (:mod:`ckpt.integrations.torchtitan`'s) is read the same way."""
    step_dir, flat, named = read_source(src, step, model_only)
    try:
        args = titan_args(flavor, flat)
        state, left_out = ({"model": _model(flat, args)}, []) if model_only else to_ours(flat, args)
    except CheckpointError as exc:
        raise CheckpointError(f"{step_dir} cannot be converted: {exc}", path=str(step_dir)) from None
    number = (named or 0) if model_only else state["train"].state["step"]
    root = CheckpointRoot(os.fspath(dst))
    if root.path.exists() and [e for e in root.path.list() if e != ".lock"] and not overwrite:
        raise CheckpointExistsError(f"{root.path} already exists", path=str(root.path))
    section = trainer_model_config(args)
    user = {"model_args": dataclasses.asdict(args),
            "converted_from": {"format": "torchtitan", "path": step_dir, "flavor": flavor,
                               "left_out": left_out}}
    if section is not None:
        user["config"] = {"model": section}
    root.lock()
    try:
        path = root.step_path(number)
        ckpt.save(state, path, step=number, user_metadata=user, overwrite=overwrite, no_dist=True)
    finally:
        root.unlock()
    tensors = len(ckpt.read_manifest(path).tensors)
    return TitanImport(str(path), number, args, section, tensors, left_out, step_dir)


def to_titan(flat: dict[str, Any], args: ModelArgs) -> dict[str, Any]:
    """Our trainer's flat checkpoint state → torchtitan's (what its ``CheckpointManager`` loads)."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        if key.startswith(PREFIX):
            out[titan_name(key[len(PREFIX):])] = value
    moments: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in flat.items():
        if key.startswith(OURS_STATE):
            fqn, _, name = key[len(OURS_STATE):].rpartition(".")
            moments.setdefault(fqn, {})[name] = value
    for fqn, names in moments.items():
        fused = titan_param(fqn)
        if fused == titan_name(fqn):
            for name, value in names.items():
                out[f"{STATE}{fused}.{name}"] = value
        elif fqn.endswith(".wq.weight"):
            parts = [moments[fqn.replace(".wq.", f".{p}.")] for p in QKV]
            for name, value in names.items():
                out[f"{STATE}{fused}.{name}"] = fuse_qkv(*(p[name] for p in parts), args.n_heads, args.kv_heads) \
                    if value.dim() else value
    groups = flat.get("optim.param_groups") or []  # stored whole (older saves)
    for group in groups:
        for fqn in dict.fromkeys(titan_param(p) for p in group["params"]):
            for key, value in group.items():
                if key != "params":
                    out[f"{GROUPS}{fqn}.{key}"] = value
    for key, value in flat.items():  # stored per parameter: optim.param_groups.<fqn>.<hyper-parameter>
        if key.startswith(OURS_GROUPS):
            fqn, _, name = key[len(OURS_GROUPS):].rpartition(".")
            out[f"{GROUPS}{titan_param(fqn)}.{name}"] = value
    out["lr_scheduler.last_epoch"] = int(flat.get("lr_scheduler.last_epoch", flat.get("train.step", 0)))
    out["train_state.step"] = int(flat.get("train.step", 0))
    out["train_state.ntokens_seen"] = int(flat.get("train.tokens_seen", 0))
    return out


def export_torchtitan(src: str, dst: str | os.PathLike, *, step: int | None = None,
                      overwrite: bool = False) -> tuple[str, int]:
    """Our trainer's checkpoint ``src`` (a step, or a root: ``step`` or the newest) as torchtitan's
    ``DST/step-N`` DCP directory, published whole (a temporary name renamed at the end); returns
    ``(path, tensors)``."""
    source = resolve_checkpoint(src, step)
    manifest = ckpt.read_manifest(source)
    args = model_args_of(manifest, source)
    flat = to_titan(read_all(source), args)
    number = int(flat["train_state.step"]) if manifest.step is None else manifest.step
    target = Path(dst) / f"step-{number}"
    if target.exists() and not overwrite:
        raise CheckpointExistsError(f"{target} already exists", path=str(target))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        dcp.save(flat, storage_writer=dcp.FileSystemWriter(str(tmp)), no_dist=True)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return str(target), sum(isinstance(v, torch.Tensor) for v in flat.values())


__all__ = ["TitanImport", "export_torchtitan", "import_torchtitan", "titan_args",
           "to_ours", "to_titan"]
