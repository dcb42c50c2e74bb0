"""A local Hugging Face llama or Mixtral (:mod:`trainer.hf.mixtral`) directory as a checkpoint to start from.

Contract: :func:`open_hf` reads ``config.json`` and the safetensors headers (weights located, not
read; only ``.safetensors``, which need no unpickling) and refuses, with a CheckpointError naming
why, what our model cannot represent or what is not such a directory; :func:`import_hf` writes the
weights under ``model.<our key>`` (q/k rows permuted back to our rotary layout, floats as
``dtype``) one tensor at a time as step ``step`` of a new checkpoint root, committed by the engine's
protocol (:func:`write_step`, through :class:`ckpt.write.assemble.NewCheckpoint`), recording the model's
exact arguments and, when a flavor builds it, the trainer's ``model`` config section. A Mixtral's
per-expert weights become our 3-D expert tensors (stacked, expert 0 first), its router as it is.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from ckpt import CheckpointError, CheckpointExistsError, CheckpointNotFoundError, CheckpointRoot
from ckpt.convert import converted_dtype
from ckpt.format import Manifest
from ckpt.storage import Location
from ckpt.write import NewCheckpoint, Payload, Place, new_manifest, tensor_bytes
from .checks import MAX_INDEX_ENTRIES, HFInputError, check_plain_file, read_json, weights_file
from .config import UnsupportedHFConfig, args_from_hf_config
from .mixtral import MIXTRAL_MODEL_TYPE, args_from_mixtral_config, moe_name, our_moe_key
from .names import HF_IGNORED, our_name
from .rotary import from_hf
from .run import PREFIX, shape_problems, trainer_model_config
from ..model import ModelArgs

HF_WEIGHTS, HF_INDEX = "model.safetensors", "model.safetensors.index.json"


@dataclass
class HFModel:
    """A local Hugging Face llama directory, its weights located (not read)."""

    path: Path
    config: dict
    args: ModelArgs
    weights: dict[str, tuple[Path, torch.dtype, tuple[int, ...]]]  # our key -> (file, dtype, shape), HF order
    hf_keys: dict[str, str]  # our key -> Hugging Face key (an expert weight: expert 0's)
    tokenizer: Path | None
    experts: dict[str, list[tuple[Path, str]]] = dataclasses.field(default_factory=dict)
    # a Mixtral's 3-D expert weights: our key -> (file, Hugging Face key) of each expert, stacked on import

    def import_bytes(self, dtype: torch.dtype | None = torch.float32) -> int:
        """The tensor bytes :func:`import_hf` writes of it (floats as ``dtype``; None: as stored)."""
        return sum(converted_dtype(stored, dtype).itemsize * math.prod(shape)
                   for _, stored, shape in self.weights.values())


def open_hf(path: str | os.PathLike) -> HFModel:
    """Read ``config.json`` and the safetensors headers of a Hugging Face llama directory; refuse
    what our model cannot represent (CheckpointError naming why)."""
    directory = Path(path)
    config_file = directory / "config.json"
    if not config_file.is_file():
        ours = (directory / "manifest.json").is_file() or any(directory.glob("step-*"))
        raise CheckpointNotFoundError(f"{directory} is not a Hugging Face model directory (no config.json)"
                                      + ("; it is a checkpoint of this engine: export it with --to" if ours else ""),
                                      path=str(directory))
    try:
        config = read_json(config_file, what="config.json")
        if isinstance(config, dict) and {"model", "training", "checkpoint"} <= config.keys():
            raise CheckpointNotFoundError(f"{directory} is a trainer run's folder (its config.json is the run's), "
                                          "not a Hugging Face model directory; export its checkpoints with --to",
                                          path=str(directory))
        mixtral = isinstance(config, dict) and config.get("model_type") == MIXTRAL_MODEL_TYPE
        args = args_from_mixtral_config(config) if mixtral else args_from_hf_config(config)
    except HFInputError as exc:
        exc.path = str(directory)
        if not str(exc).startswith(str(config_file)):  # named by its key alone: name the file too
            exc.args = (f"{config_file}: {str(exc).removeprefix('config.json: ')}",)
            exc.file = str(config_file)
        raise
    except UnsupportedHFConfig as exc:
        raise CheckpointError(f"{config_file} cannot be converted: {exc}", path=str(directory)) from None
    index = directory / HF_INDEX
    if index.is_file() or index.is_symlink():
        weight_map = read_json(index, what="a safetensors index")
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not 0 < len(weight_map) <= MAX_INDEX_ENTRIES:
            raise HFInputError(f"{index} is not a safetensors index (no weight_map object of at most "
                               f"{MAX_INDEX_ENTRIES} entries)", file=str(index), field="weight_map",
                               path=str(directory))
        files = sorted({weights_file(directory, name, index) for name in weight_map.values()})
    elif (directory / HF_WEIGHTS).is_file():
        files = [directory / HF_WEIGHTS]
    else:
        torch_files = sorted(p.name for p in directory.glob("pytorch_model*.bin"))
        hint = (f" (it has {torch_files[0]}: only .safetensors weights are read, as they need no unpickling; "
                "re-save with save_pretrained(..., safe_serialization=True))") if torch_files else ""
        raise CheckpointNotFoundError(f"{directory} holds no {HF_WEIGHTS} or {HF_INDEX}{hint}", path=str(directory))
    weights, hf_keys, foreign, parts = {}, {}, [], {}
    for file in files:
        if not file.is_file() and not file.is_symlink():
            raise CheckpointNotFoundError(f"{file} (named by {HF_INDEX}) is missing", path=str(directory))
        check_plain_file(file, directory, "a weights file")
        try:
            with safe_open(str(file), framework="pt") as handle:
                for hf_key in handle.keys():
                    if HF_IGNORED.match(hf_key):
                        continue
                    key, expert = _our_key(hf_key, args)
                    if key is None:
                        foreign.append(hf_key)
                        continue
                    view = handle.get_slice(hf_key)
                    dtype = _SAFETENSORS_DTYPES.get(view.get_dtype())
                    if dtype is None:
                        raise CheckpointError(f"{file}: {hf_key} has dtype {view.get_dtype()}", path=str(directory))
                    if expert is None:
                        weights[key], hf_keys[key] = (file, dtype, tuple(view.get_shape())), hf_key
                    else:
                        parts.setdefault(key, {})[expert] = (file, hf_key, dtype, tuple(view.get_shape()))
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors reports a damaged header as its own error types
            raise CheckpointError(f"{file} cannot be read as safetensors: {exc}", path=str(directory)) from None
    experts = _stacked(parts, args, weights, hf_keys, directory)
    if args.tie_embeddings and "tok_embeddings.weight" in weights:  # one matrix: lm_head, if stored, is it
        weights["output.weight"], hf_keys["output.weight"] = weights["tok_embeddings.weight"], hf_keys["tok_embeddings.weight"]
    problems = shape_problems({k: v[2] for k, v in weights.items()}, args)
    if foreign:
        problems.insert(0, f"weights our llama has no place for: {', '.join(sorted(foreign)[:3])}"
                           + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""))
    if problems:
        raise CheckpointError(f"{directory}: the weights do not fit its config.json: {'; '.join(problems)}",
                              path=str(directory))
    tokenizer = directory / "tokenizer.json"
    return HFModel(directory, config, args, weights, hf_keys, tokenizer if tokenizer.is_file() else None, experts)


def _our_key(hf_key: str, args: ModelArgs) -> tuple[str | None, int | None]:
    """Our key for ``hf_key`` and, for one expert's weight, the expert; (None, None): no place for it."""
    moe = our_moe_key(hf_key) if args.is_moe else None
    if moe is not None:
        return moe
    try:
        return our_name(hf_key), None
    except KeyError:
        return None, None


def _stacked(parts: dict, args: ModelArgs, weights: dict, hf_keys: dict, directory: Path) -> dict:
    """Each 3-D expert weight of ours located from its experts' tensors (every expert there, one
    dtype and shape), entered in ``weights``; returns our key -> (file, key) per expert."""
    experts = {}
    for key, found in parts.items():
        if sorted(found) != list(range(args.num_experts)):
            missing = sorted(set(range(args.num_experts)) - set(found))
            raise CheckpointError(f"{directory}: {key} has experts {sorted(found)[:8]}, not 0..{args.num_experts - 1}"
                                  f" (missing {missing[:8]})", path=str(directory))
        kinds = {(dtype, shape) for _, _, dtype, shape in found.values()}
        if len(kinds) != 1:
            raise CheckpointError(f"{directory}: the experts of {key} differ in dtype or shape", path=str(directory))
        (dtype, shape), = kinds
        weights[key] = (found[0][0], dtype, (args.num_experts, *shape))
        hf_keys[key] = found[0][1]
        experts[key] = [found[e][:2] for e in range(args.num_experts)]
    return experts


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


@dataclass
class Import:
    """What an import wrote (the CLI's summary lines)."""

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
    section = trainer_model_config(model.args, tokenizer=tokenizer, max_seq_len=True)
    user = {"model_args": dataclasses.asdict(model.args),
            "converted_from": {"format": "hf", "path": str(model.path.resolve()), "config": model.config}}
    if section is not None:
        user["config"] = {"model": section}
    specs = [(PREFIX + key, converted_dtype(stored, dtype), shape) for key, (_, stored, shape) in model.weights.items()]
    handles: dict[Path, object] = {}

    def tensor_of(file: Path, hf_key: str) -> torch.Tensor:
        if file not in handles:
            handles[file] = safe_open(str(file), framework="pt")
        return handles[file].get_tensor(hf_key)

    def produce(key: str, file: Path, out_dtype: torch.dtype):
        def read() -> torch.Tensor:
            if key in model.experts:  # a Mixtral's experts, one tensor each: our 3-D weight
                tensor = torch.stack([tensor_of(f, hf_key) for f, hf_key in model.experts[key]])
            elif moe_name(key) is not None:  # the router: as it is
                tensor = tensor_of(file, model.hf_keys[key])
            else:
                _, tensor = from_hf(model.hf_keys[key], tensor_of(file, model.hf_keys[key]), model.args)
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
    nbytes = sum(e.dtype.itemsize * math.prod(e.shape) for e in manifest.tensors.values())
    return Import(str(path), model, section, len(specs), nbytes)


def write_step(path: Location, specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
               producers: dict[str, Callable[[], torch.Tensor]], *, step: int, user: dict,
               overwrite: bool) -> Manifest:
    """A full checkpoint at ``path`` holding each spec's tensor (key, dtype, shape) as one chunk,
    produced one at a time while it is written (one data file), committed by the engine's protocol
    (:class:`ckpt.write.assemble.NewCheckpoint`)."""
    manifest = new_manifest(specs, step=step, world_size=1, user=user,
                            paths={key: tuple(key.split(".", 1)) for key, _dtype, _shape in specs})
    with NewCheckpoint(path, manifest, overwrite=overwrite) as new:
        payloads = [Payload(Place(key, (0,) * len(shape), tuple(shape)), _checked(key, dtype, shape, producers[key]),
                            dtype.itemsize * math.prod(shape)) for key, dtype, shape in specs]
        new.write(new.data_file(0), payloads)
    return manifest


def _checked(key: str, dtype: torch.dtype, shape: tuple, produce: Callable[[], torch.Tensor]):
    def bytes_of():
        tensor = produce()
        if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(f"{key}: read {tensor.dtype} {list(tensor.shape)}, expected {dtype} {list(shape)}",
                                  tensor=key)
        return tensor_bytes(tensor)
    return bytes_of
