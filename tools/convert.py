"""ckpt-convert: a trainer checkpoint as a Hugging Face model or plain weights files, and back.

    ckpt-convert SRC DST --to hf [--step N] [--dtype bf16|fp16|fp32] [--max-shard-size 5GB] [--force] [--quiet]
    ckpt-convert SRC DST --to torch|safetensors [--step N] [--dtype ...] [--max-shard-size SIZE] [--force] [--quiet]
    ckpt-convert SRC DST --from hf [--step N] [--dtype ...] [--force] [--quiet]
    ckpt-convert SRC DST --from dcp [--force] [--quiet]

--to: SRC is a trainer checkpoint (a directory or URL holding manifest.json) or a checkpoint root
(then --step N, default the newest committed step); its model weights (the tensors under "model.")
are read one whole tensor at a time, every chunk verified, deltas replayed. The model's shapes come
from the run config the trainer recorded in the manifest.

  hf           DST is a local directory for transformers' LlamaForCausalLM.from_pretrained: the
               weights under Hugging Face names with the rotary q/k rows permuted to its layout
               (model.safetensors, or model-0000i-of-0000n.safetensors + model.safetensors.index.json
               beyond --max-shard-size, default 5GB), config.json, generation_config.json, and the
               run's tokenizer.json (+ tokenizer_config.json) when it used one; a run on the built-in
               byte tokenizer has no tokenizer file (ids 0-255 are UTF-8 bytes, 256 BOS, 257 EOS).
  torch,       the weights under our own names (layers.0.attention.wq.weight: what
  safetensors  trainer.model.Transformer.load_state_dict takes) in one torch.save / .safetensors
               file, or with --max-shard-size a directory of shards + index.

--from hf: SRC is a local Hugging Face llama directory (config.json + model.safetensors, or shards
with model.safetensors.index.json); DST becomes a checkpoint root holding step N (default 0) with
the model weights under "model." (floats as fp32 unless --dtype: the trainer's parameters are fp32),
read and written one tensor at a time. The trainer starts from it with
--checkpoint.initial_load_path DST and the --model.* flags printed (weights only; the optimizer,
schedule and data position start fresh).

--from dcp: SRC is a plain torch.distributed.checkpoint directory (.metadata, read without
unpickling code); DST the equivalent checkpoint of this engine.

Outputs appear whole or not at all (written under a temporary name, renamed at the end); an existing
DST is refused without --force. Exit codes (tools/cli.py): 0 done, 1 a checkpoint or model could not
be read or converted, or the output not written (one line on stderr says why), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Iterator

import torch

from ckpt import CheckpointError, CheckpointExistsError, CheckpointNotFoundError, commit
from ckpt.consolidate import TensorSpec, converted_dtype, full_tensors, select_keys, tensor_specs, write_output
from ckpt.format import Chunk, Manifest, TensorEntry, data_file_name
from ckpt.read import read_manifest
from ckpt.root import CheckpointRoot
from ckpt.storage import Location, locate
from ckpt.write import Payload, tensor_bytes, write_file
from tools.cli import EXPECTED_FAILURES, fail, progress
from tools.merge import DTYPES, EXTENSIONS, parse_size, resolve_source
from trainer import hf_adapter
from trainer.config import ConfigError
from trainer.model import ModelArgs

PROG = "ckpt-convert"
PREFIX = "model."  # the trainer's state key for the model
DEFAULT_HF_SHARD = 5 * 10**9
HF_WEIGHTS, HF_INDEX = "model.safetensors", "model.safetensors.index.json"
EPILOG = """examples:
  ckpt-convert outputs/debug/checkpoints hf-out --to hf                 newest step as a Hugging Face llama
  ckpt-convert ckpts/run1 hf-out --to hf --step 1200 --dtype bf16 --max-shard-size 2GB
  ckpt-convert s3://bucket/run1 model.safetensors --to safetensors      our names, one file, read from S3
  ckpt-convert ckpts/run1/step-00001200 model.pt --to torch             Transformer.load_state_dict(torch.load(...))
  ckpt-convert hf-llama ckpts/init --from hf                            then: python -m trainer.train ... \\
                                                                          --checkpoint.initial_load_path ckpts/init
  ckpt-convert dcp-ckpt ckpts/imported/step-00000100 --from dcp         a plain DCP checkpoint into this format

Sizes: 5GB, 500MB (powers of 1000), 2GiB (powers of 1024), or bytes. URLs (s3://...) take
AWS_ENDPOINT_URL etc. from the environment; --to hf and --from hf need local directories.
"""


# -- the model a trainer checkpoint holds -------------------------------------------------------
def model_args_of(manifest: Manifest, source: object = "the checkpoint") -> ModelArgs:
    """The :class:`ModelArgs` of the model a trainer checkpoint holds: recorded exactly by
    ``--from hf`` (user metadata ``model_args``), else rebuilt from the run's config (user metadata
    ``config``) with the vocabulary the stored embedding has; the weights' shapes are checked
    against them."""
    user = manifest.user or {}
    embedding = manifest.tensors.get(PREFIX + "tok_embeddings.weight")
    vocab = embedding.shape[0] if embedding is not None and len(embedding.shape) == 2 else None
    try:
        if isinstance(user.get("model_args"), dict):
            args = ModelArgs(**user["model_args"])
        elif isinstance(user.get("config"), dict):
            args = hf_adapter.args_from_run_config(user["config"], vocab_size=vocab)
        else:
            raise CheckpointError(f"{source}: its manifest records no run config (user metadata 'config'), so "
                                  "the model's shapes and heads are unknown; is it a trainer checkpoint?")
    except (TypeError, ValueError) as exc:  # ConfigError, a bad ModelArgs
        raise CheckpointError(f"{source}: the run config it records cannot be used: {exc}") from None
    shapes = {key[len(PREFIX):]: tuple(e.shape) for key, e in manifest.tensors.items() if key.startswith(PREFIX)}
    problems = hf_adapter.shape_problems(shapes, args)
    if problems:
        raise CheckpointError(f"{source}: its model weights do not match the recorded config "
                              f"({hf_adapter.describe(args)}): {'; '.join(problems)}")
    return args


def _natural(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


@dataclass
class Export:
    weight_files: list[str]  # the weights files written
    files: list[str]  # every path written
    args: ModelArgs
    tensors: int
    nbytes: int
    note: str = ""  # what the output lacks, for the summary line (e.g. no tokenizer file)


# -- --to hf -----------------------------------------------------------------------------------
def export_hf(source: str | Location, dst: str | os.PathLike, *, dtype: torch.dtype | None = None,
              max_shard_size: int = DEFAULT_HF_SHARD, overwrite: bool = False,
              progress: Callable[[int], object] | None = None, manifest: Manifest | None = None) -> Export:
    """The checkpoint ``source`` as a Hugging Face ``LlamaForCausalLM`` directory ``dst`` (local),
    written under a temporary sibling and renamed at the end."""
    source = locate(source)
    manifest = read_manifest(source) if manifest is None else manifest
    if "://" in os.fspath(dst):
        raise CheckpointError(f"{dst}: a Hugging Face export is written to a local directory")
    target = locate(os.fspath(dst))
    if target.exists() and not overwrite:
        raise CheckpointExistsError(f"{target} already exists", path=str(target))
    args = model_args_of(manifest, source)
    keys = sorted(select_keys(manifest, "model"), key=lambda k: _natural(hf_adapter.hf_name(k[len(PREFIX):])))
    specs = [TensorSpec(hf_adapter.hf_name(s.key[len(PREFIX):]), s.dtype, s.shape)
             for s in _in_order(tensor_specs(manifest, keys, dtype=dtype), keys)]
    out_dtype = next((s.dtype for s in specs if s.dtype.is_floating_point), torch.float32)

    files, note, tokenizer = _tokenizer_export(manifest)
    files["config.json"] = _json(hf_adapter.hf_config(args, out_dtype, tokenizer=tokenizer))
    files["generation_config.json"] = _json(hf_adapter.generation_config(args, tokenizer=tokenizer))

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for key, tensor in full_tensors(source, keys, dtype=dtype, manifest=manifest):
            yield hf_adapter.to_hf(key[len(PREFIX):], tensor, args)

    storage = target.storage
    storage.makedirs(target.parent.path)
    commit.collect_garbage(target)  # what dead exports to the same DST left
    tmp = target.parent / f"{target.name}{commit.TMP_MARK}{os.urandom(6).hex()}"
    try:
        written = write_output(tmp, specs, stream(), format="safetensors", max_shard_size=max_shard_size,
                               metadata=_step_metadata(manifest), progress=progress)
        for name, data in files.items():
            storage.write_bytes((tmp / name).path, data)
        storage.sync_dir(tmp.path)
        _publish(tmp, target, overwrite=overwrite)
    except BaseException:
        if tmp.exists():
            storage.remove_tree(tmp.path)
        raise
    weights = [str(target / Path(p).name) for p in written if p.endswith(".safetensors")]
    return Export(weights, [str(target / Path(p).name) for p in written] + [str(target / name) for name in files],
                  args, len(specs), sum(s.nbytes for s in specs), note)


def _in_order(specs: list[TensorSpec], keys: list[str]) -> list[TensorSpec]:
    by_key = {s.key: s for s in specs}
    return [by_key[k] for k in keys]


def _json(doc: dict) -> bytes:
    return (json.dumps(doc, indent=2) + "\n").encode()


def _step_metadata(manifest: Manifest) -> dict[str, str]:
    return {"ckpt.kind": manifest.kind, **({"ckpt.step": str(manifest.step)} if manifest.step is not None else {})}


def _tokenizer_export(manifest: Manifest) -> tuple[dict[str, bytes], str, object]:
    """(files, note, tokenizer) for the run's tokenizer: its Hugging Face files when it used a
    tokenizer.json that still exists; none (and why, in the note) otherwise."""
    from trainer.data import is_byte_tokenizer

    user = manifest.user or {}
    config = user.get("config")
    model = config.get("model") if isinstance(config, dict) else None
    path = model.get("tokenizer") if isinstance(model, dict) else None
    origin = user.get("converted_from")
    if is_byte_tokenizer(path) and isinstance(origin, dict) and isinstance(origin.get("config"), dict):
        ids = SimpleNamespace(bos_id=origin["config"].get("bos_token_id"), eos_id=origin["config"].get("eos_token_id"))
        return {}, f"no tokenizer file: {origin.get('path')}, which this was imported from, had none", ids
    if is_byte_tokenizer(path):
        return {}, ("no tokenizer file: the run used the built-in byte tokenizer (ids 0-255 are UTF-8 bytes, "
                    "256 BOS, 257 EOS)"), None
    try:
        files, tokenizer = hf_adapter.tokenizer_files(path)
    except Exception as exc:  # gone, unreadable, no `tokenizers` package, or its own parse errors
        return {}, f"no tokenizer file: the run's tokenizer {path} cannot be read here ({exc})", None
    return files, f"tokenizer {path} copied", tokenizer


def _publish(tmp: Location, target: Location, *, overwrite: bool) -> None:
    """Rename ``tmp`` to ``target``; an existing ``target`` (with ``overwrite``) is moved aside
    first and deleted once the new one is in place."""
    storage = target.storage
    old = None
    if target.exists():
        if not overwrite:
            raise CheckpointExistsError(f"{target} appeared while converting; not replaced", path=str(target))
        old = target.parent / f"{target.name}{commit.OLD_MARK}{os.urandom(6).hex()}"
        storage.rename(target.path, old.path)
    storage.rename(tmp.path, target.path)
    storage.sync_dir(target.parent.path)
    if old is not None:
        if old.is_dir():
            storage.remove_tree(old.path)
        else:
            storage.remove(old.path)


# -- --to torch / safetensors --------------------------------------------------------------------
def export_weights(source: str | Location, dst: str | os.PathLike, *, format: str, dtype: torch.dtype | None = None,
                   max_shard_size: int | None = None, overwrite: bool = False,
                   progress: Callable[[int], object] | None = None, manifest: Manifest | None = None) -> Export:
    """The model weights of checkpoint ``source`` under our own names (no ``model.`` prefix) as one
    ``format`` file (or shards + index in a directory with ``max_shard_size``)."""
    source = locate(source)
    manifest = read_manifest(source) if manifest is None else manifest
    keys = select_keys(manifest, "model")
    specs = [TensorSpec(s.key[len(PREFIX):], s.dtype, s.shape) for s in tensor_specs(manifest, keys, dtype=dtype)]
    metadata = _step_metadata(manifest)
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


# -- --from hf -----------------------------------------------------------------------------------
@dataclass
class HFModel:
    """A local Hugging Face llama directory, its weights located (not read)."""

    path: Path
    config: dict
    args: ModelArgs
    weights: dict[str, tuple[Path, torch.dtype, tuple[int, ...]]]  # our key -> (file, dtype, shape), HF order
    hf_keys: dict[str, str]  # our key -> Hugging Face key
    tokenizer: Path | None


def open_hf(path: str | os.PathLike) -> HFModel:
    """Read ``config.json`` and the safetensors headers of a Hugging Face llama directory; refuse
    what our model cannot represent (CheckpointError naming why)."""
    from safetensors import safe_open

    from trainer.hf_adapter import HF_IGNORED, UnsupportedHFConfig, args_from_hf_config, our_name, shape_problems

    directory = Path(path)
    config_file = directory / "config.json"
    if not config_file.is_file():
        ours = (directory / "manifest.json").is_file() or any(directory.glob("step-*"))
        raise CheckpointNotFoundError(f"{directory} is not a Hugging Face model directory (no config.json)"
                                      + ("; it is a checkpoint of this engine: export it with --to" if ours else ""),
                                      path=str(directory))
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
        if isinstance(config, dict) and {"model", "training", "checkpoint"} <= config.keys():
            raise CheckpointNotFoundError(f"{directory} is a trainer run's folder (its config.json is the run's), "
                                          "not a Hugging Face model directory; export its checkpoints with --to",
                                          path=str(directory))
        args = args_from_hf_config(config)
    except (ValueError, UnicodeDecodeError) as exc:  # JSON errors, UnsupportedHFConfig
        kind = "cannot be converted" if isinstance(exc, UnsupportedHFConfig) else "is not valid JSON"
        raise CheckpointError(f"{config_file} {kind}: {exc}", path=str(directory)) from None
    index = directory / HF_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = sorted({directory / name for name in weight_map.values()})
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index} is not a safetensors index ({exc})", path=str(directory)) from None
    elif (directory / HF_WEIGHTS).is_file():
        files = [directory / HF_WEIGHTS]
    else:
        torch_files = sorted(p.name for p in directory.glob("pytorch_model*.bin"))
        hint = (f" (it has {torch_files[0]}: only .safetensors weights are read, as they need no unpickling; "
                "re-save with save_pretrained(..., safe_serialization=True))") if torch_files else ""
        raise CheckpointNotFoundError(f"{directory} holds no {HF_WEIGHTS} or {HF_INDEX}{hint}", path=str(directory))
    weights, hf_keys, foreign = {}, {}, []
    for file in files:
        if not file.is_file():
            raise CheckpointNotFoundError(f"{file} (named by {HF_INDEX}) is missing", path=str(directory))
        try:
            with safe_open(str(file), framework="pt") as handle:
                for hf_key in handle.keys():
                    if HF_IGNORED.match(hf_key):
                        continue
                    try:
                        key = our_name(hf_key)
                    except KeyError:
                        foreign.append(hf_key)
                        continue
                    view = handle.get_slice(hf_key)
                    dtype = _SAFETENSORS_DTYPES.get(view.get_dtype())
                    if dtype is None:
                        raise CheckpointError(f"{file}: {hf_key} has dtype {view.get_dtype()}", path=str(directory))
                    weights[key] = (file, dtype, tuple(view.get_shape()))
                    hf_keys[key] = hf_key
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors reports a damaged header as its own error types
            raise CheckpointError(f"{file} cannot be read as safetensors: {exc}", path=str(directory)) from None
    problems = shape_problems({k: v[2] for k, v in weights.items()}, args)
    if foreign:
        problems.insert(0, f"weights our llama has no place for: {', '.join(sorted(foreign)[:3])}"
                           + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""))
    if problems:
        raise CheckpointError(f"{directory}: the weights do not fit its config.json: {'; '.join(problems)}",
                              path=str(directory))
    tokenizer = directory / "tokenizer.json"
    return HFModel(directory, config, args, weights, hf_keys, tokenizer if tokenizer.is_file() else None)


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


@dataclass
class Import:
    path: str  # the step directory written
    model: HFModel
    model_config: dict | None  # the trainer's model section that builds it (None: no flavor fits)
    tensors: int
    nbytes: int


def import_hf(src: str | os.PathLike, dst: str | os.PathLike, *, step: int = 0,
              dtype: torch.dtype | None = torch.float32, overwrite: bool = False,
              progress: Callable[[int], object] | None = None) -> Import:
    """The Hugging Face llama directory ``src`` as step ``step`` of the checkpoint root ``dst``: the
    model weights under ``model.<our key>`` (q/k rows permuted back to our rotary layout, floats as
    ``dtype``), read and written one tensor at a time and committed as one full checkpoint.

    ``dst`` must not hold anything yet; with ``overwrite`` an existing step ``step`` is replaced,
    but a root holding other steps is still refused (the trainer would start from the newest)."""
    from safetensors import safe_open

    model = open_hf(src)
    root = CheckpointRoot(os.fspath(dst))
    if root.path.exists():
        entries = [e for e in root.path.list() if e != ".lock"] if root.path.is_dir() else ["(a file)"]
        others = [s for s in root.committed() if s != step] if root.path.is_dir() else []
        if entries and not overwrite:
            raise CheckpointExistsError(f"{root.path} already exists", path=str(root.path))
        if others:
            steps = ", ".join(map(str, others[-3:]))
            raise CheckpointExistsError(f"{root.path} holds other checkpoints (steps {steps}); "
                                        "a run would start from the newest of them: choose an empty DST",
                                        path=str(root.path))
    tokenizer = None if model.tokenizer is None else str(model.tokenizer.resolve())
    section = hf_adapter.trainer_model_config(model.args, tokenizer=tokenizer)
    user = {"model_args": dataclasses.asdict(model.args),
            "converted_from": {"format": "hf", "path": str(model.path.resolve()), "config": model.config}}
    if section is not None:
        user["config"] = {"model": section}
    specs = [(PREFIX + key, converted_dtype(stored, dtype), shape) for key, (_, stored, shape) in model.weights.items()]
    handles: dict[Path, object] = {}

    def produce(key: str, file: Path, out_dtype: torch.dtype):
        def read() -> torch.Tensor:
            if file not in handles:
                handles[file] = safe_open(str(file), framework="pt")
            _, tensor = hf_adapter.from_hf(model.hf_keys[key], handles[file].get_tensor(model.hf_keys[key]), model.args)
            tensor = tensor.to(out_dtype).contiguous()
            if progress is not None:
                progress(tensor.numel() * tensor.element_size())
            return tensor
        return read

    producers = {PREFIX + key: produce(key, file, converted_dtype(stored, dtype))
                 for key, (file, stored, _) in model.weights.items()}
    root.lock()
    try:
        path = root.step_path(step)
        manifest = write_step(path, specs, producers, step=step, user=user, overwrite=overwrite)
    finally:
        root.unlock()
        handles.clear()
    nbytes = sum(e.dtype.itemsize * _numel(e.shape) for e in manifest.tensors.values())
    return Import(str(path), model, section, len(specs), nbytes)


def _numel(shape) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def write_step(path: Location, specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
               producers: dict[str, Callable[[], torch.Tensor]], *, step: int, user: dict,
               overwrite: bool) -> Manifest:
    """A full checkpoint at ``path`` holding each spec's tensor (key, dtype, shape) as one chunk,
    produced one at a time while it is written (one data file), committed by the engine's protocol."""
    attempt = commit.begin(path, overwrite=overwrite)
    try:
        manifest = Manifest(step=step, kind="full", world_size=1, created=time.time(), user=user)
        payloads = []
        for key, dtype, shape in specs:
            manifest.tensors[key] = TensorEntry(dtype, tuple(shape), [])
            manifest.paths[key] = tuple(key.split(".", 1))
            payloads.append(Payload(key, _checked(key, dtype, shape, producers[key]), dtype.itemsize * _numel(shape)))
        for key, blob in write_file(attempt.directory, data_file_name(0, 0, attempt.tag), payloads):
            shape = manifest.tensors[key].shape
            manifest.add_record(key, Chunk((0,) * len(shape), shape, blob))
        manifest.sort_chunks()
        commit.finish(attempt, manifest, overwrite=overwrite)
    except BaseException:
        commit.abort(attempt)
        raise
    return manifest


def _checked(key: str, dtype: torch.dtype, shape: tuple, produce: Callable[[], torch.Tensor]):
    def bytes_of():
        tensor = produce()
        if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(f"{key}: read {tensor.dtype} {list(tensor.shape)}, expected {dtype} {list(shape)}",
                                  tensor=key)
        return tensor_bytes(tensor)
    return bytes_of


# -- --from dcp ----------------------------------------------------------------------------------
def _dcp_import():
    try:
        from ckpt import dcp_import
    except ImportError:
        raise CheckpointError("--from dcp needs ckpt.dcp_import, which this installation does not have") from None
    return dcp_import


def import_dcp(src: str, dst: str, *, overwrite: bool = False, quiet: bool = False) -> Manifest:
    """A plain DCP checkpoint ``src`` as the checkpoint directory ``dst`` (:func:`ckpt.dcp_import.import_dcp`)."""
    engine = _dcp_import()
    total = engine.total_tensor_bytes(engine.read_dcp_metadata(src))
    with progress(total, "import dcp", quiet=quiet) as bar:
        return engine.import_dcp(src, dst, overwrite=overwrite, progress=bar.update)


# -- the command line ----------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    paragraphs = __doc__.split("\n\n")
    p = argparse.ArgumentParser(prog=PROG, description="\n\n".join([paragraphs[0], *paragraphs[2:]]), epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="--to: a checkpoint or checkpoint root (path or URL); --from: the model to import")
    p.add_argument("dst", help="--to hf: a directory; --to torch/safetensors: a file (a directory when sharded); "
                               "--from hf: a new checkpoint root; --from dcp: a checkpoint directory")
    direction = p.add_mutually_exclusive_group(required=True)
    direction.add_argument("--to", choices=("hf", "torch", "safetensors"), help="export the model weights")
    direction.add_argument("--from", dest="from_", choices=("hf", "dcp"), help="import into this engine's format")
    p.add_argument("--step", type=int, help="--to with a root SRC: the step to export (default: the newest "
                                            "committed); --from hf: the step to write (default 0)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="convert floating-point tensors (default: --to keeps the "
                                                            "stored dtype, --from hf writes fp32)")
    p.add_argument("--max-shard-size", type=parse_size, metavar="SIZE",
                   help="--to: shard into files of at most SIZE (default for hf: 5GB; torch/safetensors: one file)")
    p.add_argument("--force", action="store_true", help="replace an existing DST")
    p.add_argument("--quiet", action="store_true", help="no progress bar, no summary lines")
    return p


def _check_arguments(p: argparse.ArgumentParser, args) -> None:
    """Usage errors (exit 2) before anything is read."""
    if args.from_ is not None and args.max_shard_size is not None:
        p.error("--max-shard-size applies to --to only")
    if args.from_ == "dcp" and (args.step is not None or args.dtype is not None):
        p.error("--from dcp takes neither --step nor --dtype (the checkpoint is imported as it is)")
    if args.step is not None and args.step < 0:
        p.error(f"--step must be >= 0, not {args.step}")
    if (args.to == "hf" or args.from_ == "hf") and "://" in (args.dst if args.to == "hf" else args.src):
        p.error(f"--{'to' if args.to else 'from'} hf needs a local directory, not {args.dst if args.to else args.src}")
    if args.to in ("torch", "safetensors"):
        name = str(args.dst).rstrip("/").rsplit("/", 1)[-1]
        suffix = ("." + name.rsplit(".", 1)[1].lower()) if "." in name else ""
        implied = EXTENSIONS.get(suffix)
        if implied is not None and implied != args.to:
            p.error(f"DST's extension {suffix} is for --to {implied}, not --to {args.to}")
        if implied is not None and args.max_shard_size is not None:
            p.error(f"--max-shard-size writes a directory; name DST without a file extension (not {suffix})")


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    _check_arguments(p, args)
    dtype = DTYPES[args.dtype] if args.dtype else None
    try:
        if args.to is not None:
            lines = _export(args, dtype)
        elif args.from_ == "hf":
            lines = _import_hf(args, dtype)
        else:
            manifest = import_dcp(args.src, args.dst, overwrite=args.force, quiet=args.quiet)
            step = "" if manifest.step is None else f"step {manifest.step}, "
            lines = [f"DCP checkpoint {args.src} -> {args.dst} ({step}{len(manifest.tensors)} tensors, "
                     f"{len(manifest.values)} values)"]
    except (*EXPECTED_FAILURES, ConfigError) as exc:
        return fail(PROG, exc)
    except RuntimeError as exc:  # torch's zip writer reports a failed write as RuntimeError
        return fail(PROG, CheckpointError(f"writing {args.dst} failed: {exc}"))
    if not args.quiet:
        print("\n".join(lines))
    return 0


def _export(args, dtype: torch.dtype | None) -> list[str]:
    try:
        source = resolve_source(args.src, args.step)
    except CheckpointNotFoundError as exc:
        if "://" not in args.src and (Path(args.src) / "config.json").is_file() and \
                any(Path(args.src).glob("*.safetensors*")):
            raise CheckpointNotFoundError(f"{exc}; it is a Hugging Face model directory: import it with --from hf",
                                          path=exc.path) from None
        raise
    manifest = read_manifest(source)
    total = sum(s.nbytes for s in tensor_specs(manifest, select_keys(manifest, "model"), dtype=dtype))
    step = "" if manifest.step is None else f"step {manifest.step} "
    with progress(total, f"convert {step}".strip(), quiet=args.quiet) as bar:
        if args.to == "hf":
            result = export_hf(source, args.dst, dtype=dtype, max_shard_size=args.max_shard_size or DEFAULT_HF_SHARD,
                               overwrite=args.force, progress=bar.update, manifest=manifest)
        else:
            result = export_weights(source, args.dst, format=args.to, dtype=dtype, max_shard_size=args.max_shard_size,
                                    overwrite=args.force, progress=bar.update, manifest=manifest)
    weights = result.weight_files
    shards = f"{len(weights)} shards + index" if len(weights) > 1 else Path(weights[0]).name
    if args.to == "hf":
        return [f"{step}({manifest.kind}) of {source} -> {args.dst}: "
                f"LlamaForCausalLM ({hf_adapter.describe(result.args)}), "
                f"{result.tensors} tensors, {result.nbytes / 1e9:.3f} GB in {shards}, config.json, "
                f"generation_config.json; {result.note}"]
    return [f"{step}({manifest.kind}) of {source}: {result.tensors} model tensors, {result.nbytes / 1e9:.3f} GB as "
            f"{args.to} -> {args.dst}" + (f" ({shards})" if len(weights) > 1 else "")]


def _import_hf(args, dtype: torch.dtype | None) -> list[str]:
    model = open_hf(args.src)
    total = sum(converted_dtype(d, dtype or torch.float32).itemsize * _numel(s) for _, d, s in model.weights.values())
    with progress(total, "import hf", quiet=args.quiet) as bar:
        result = import_hf(args.src, args.dst, step=args.step or 0, dtype=dtype or torch.float32,
                           overwrite=args.force, progress=bar.update)
    lines = [f"Hugging Face llama {args.src} ({hf_adapter.describe(result.model.args)}) -> {result.path}: "
             f"{result.tensors} tensors, {result.nbytes / 1e9:.3f} GB"]
    if result.model_config is None:
        lines.append("note: no trainer flavor has this model's SwiGLU width, norm epsilon and rotary base, so the "
                     "trainer cannot build it; trainer.model.Transformer(ModelArgs(**manifest.user['model_args'])) "
                     "loads it with ckpt.load")
    else:
        flags = hf_adapter.trainer_flags(result.model_config)
        lines.append("start training from it: python -m trainer.train --config <your config> "
                     f"{' '.join(flags)} --checkpoint.initial_load_path {os.path.abspath(args.dst)}")
        byte_model = result.model.config.get("bos_token_id") == 256 and result.model.args.vocab_size == 258
        if result.model.tokenizer is None and not byte_model:
            lines.append(f"note: {args.src} has no tokenizer.json; the trainer then uses its byte tokenizer, whose "
                         "ids are not this model's")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
