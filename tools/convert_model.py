"""The model a checkpoint holds, when its manifest does not say: ``ckpt-convert --to ... --config``
or ``--model-args``.

A trainer checkpoint records its run config (manifest user metadata ``config``) and an import
from Hugging Face or torchtitan records the model's exact arguments (``model_args``); a plain
torch.distributed.checkpoint imported with ``--from dcp`` records neither, so an export needs to
be told. :func:`with_model_config` returns the manifest with the user's answer put where
:func:`trainer.hf.model_args_of` reads it, so the export checks the weights' shapes against it
exactly as for a trainer checkpoint (a mismatch is one error line naming the tensors):

  --config FILE       a trainer config (.toml / .yaml as given to trainer.train, or a run's
                      config.json): its ``model`` section and ``training.seq_len``
  --model-args JSON   trainer.model.ModelArgs fields, as a JSON object or the path of a .json file
                      holding one (``{"dim": 256, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2}``)

Both files are foreign input: at most :data:`MAX_FILE_BYTES`, parsed by the trainer's own readers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from ckpt import CheckpointError
from ckpt.format import Manifest

if __package__ == "ckpt_tools":  # installed from a wheel, beside ckpt_trainer (setup.py says why)
    from ckpt_trainer import config
    from ckpt_trainer.model import ModelArgs
else:
    from trainer import config
    from trainer.model import ModelArgs

MODEL_OPTIONS = "--config and --model-args"
MAX_FILE_BYTES = 1 << 20  # a trainer config is a few KiB


def add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="--to with a checkpoint that records no run config (one "
                   "imported --from dcp): the trainer config (.toml/.yaml, or a run's config.json) of its model")
    p.add_argument("--model-args", metavar="JSON", help="... or the model's trainer.model.ModelArgs as a JSON "
                   "object (inline, or a .json file)")


def _bounded_text(path: Path, what: str) -> str:
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise CheckpointError(f"{path} is {size} bytes; {what} is never above {MAX_FILE_BYTES}")
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise CheckpointError(f"{path} is not UTF-8 text ({what})") from None


def _json_object(text: str, where: str) -> dict:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{where} is not valid JSON: {' '.join(str(exc).split())[:200]}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{where} does not hold a JSON object")
    return value


def run_config(path: str) -> dict:
    """The run config record (``Config.to_record()``) of a trainer config file or a run's config.json."""
    file = Path(path)
    if not file.is_file():
        raise CheckpointError(f"--config {path}: no such file")
    if file.suffix.lower() == ".json":
        data = _json_object(_bounded_text(file, "a run's config.json"), str(file))
        return config.Config.from_dict(data).to_record()
    _bounded_text(file, "a trainer config")  # the size bound before the trainer's reader parses it
    return config.load_config(["--config", str(file)]).to_record()


def model_args(text: str) -> dict:
    """``--model-args``: a JSON object inline, or the path of a file holding one; its keys must be
    ModelArgs fields (checked here, so the error names the unknown ones)."""
    stripped = text.strip()
    if stripped.startswith("{"):
        data = _json_object(stripped, "--model-args")
    else:
        data = _json_object(_bounded_text(Path(text), "a model-args file"), text)
    fields = {f.name for f in dataclasses.fields(ModelArgs)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise CheckpointError(f"--model-args: {', '.join(unknown)} not ModelArgs fields (known: {', '.join(sorted(fields))})")
    return data


def with_model_config(manifest: Manifest, args) -> Manifest:
    """``manifest`` with the model the user named (``args.config`` / ``args.model_args``) as its
    user metadata, replacing what it recorded; ``manifest`` itself when neither is given."""
    if not (getattr(args, "config", None) or getattr(args, "model_args", None)):
        return manifest
    user = dict(manifest.user or {})
    user.pop("config", None), user.pop("model_args", None)
    if args.config:
        user["config"] = run_config(args.config)
    else:
        user["model_args"] = model_args(args.model_args)
    return dataclasses.replace(manifest, user=user)
