"""A Hugging Face directory is foreign input: its JSON files and weights files checked before use.

Contract: :func:`read_json` reads a bounded JSON file (size, nesting depth, no NaN/Infinity
anywhere); :func:`check_config` type- and range-checks every ``config.json`` key the conversion
reads (integers as integers within :mod:`trainer.config.limits`, finite numbers in range, booleans,
strings, lists of strings) before any value is used; :func:`weights_file` admits a weights file
named by the index only as a plain file directly inside the directory (no ``..``, no absolute path,
no symbolic link, save the Hugging Face hub cache's own links into its ``blobs``). What fails raises :class:`HFInputError`, an
:class:`~ckpt.errors.InvalidManifestError` naming the file and, for a config value, the field
(``field``): the CLI prints it as one line.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ckpt.errors import InvalidManifestError
from ..config.limits import MAX_FFN_DIM, MAX_HEADS, MAX_HIDDEN_DIM, MAX_LAYERS, MAX_SEQ_LEN, MAX_VOCAB

MAX_JSON_BYTES = 16 << 20  # config.json is a few KiB; the index of a 405B model ~100 KiB
MAX_DEPTH = 32  # rope_scaling / quantization_config nest 2-3 levels
MAX_INDEX_ENTRIES = 1 << 20


class HFInputError(InvalidManifestError):
    """A Hugging Face model directory's file is malformed or hostile (``file``; ``field`` for a
    config.json value)."""

    def __init__(self, message: str, *, file: str, field: str | None = None, path: str | None = None):
        super().__init__(message, path=path, file=file)
        self.field = field


def read_json(file: Path, *, what: str) -> Any:
    """The JSON value in ``file`` (a plain file: :func:`check_plain_file`; at most :data:`MAX_JSON_BYTES`,
    :data:`MAX_DEPTH` levels, only finite numbers)."""
    check_plain_file(file, file.parent, what)
    size = file.stat().st_size
    if size > MAX_JSON_BYTES:
        raise HFInputError(f"{file} is {size} bytes; {what} is never above {MAX_JSON_BYTES}", file=str(file))
    try:
        value = json.loads(file.read_bytes().decode("utf-8"))
    except RecursionError:
        raise HFInputError(f"{file} is nested too deeply to be {what}", file=str(file)) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise HFInputError(f"{file} is not valid JSON: {exc}", file=str(file)) from None
    found = _first_problem(value, MAX_DEPTH)
    if found is not None:
        where, problem = found
        raise HFInputError(f"{file}: {where or 'the value'} {problem}", file=str(file), field=where or None)
    return value


def _first_problem(value: Any, depth: int, where: str = "") -> tuple[str, str] | None:
    """(path, what is wrong) of the first container nested below ``depth`` levels or the first
    non-finite number (JSON's NaN/Infinity extensions, 1e400), else None."""
    if isinstance(value, float) and not math.isfinite(value):
        return where, f"is {value}: only finite numbers are accepted"
    if not isinstance(value, (dict, list)):
        return None
    if depth == 0:
        return where, f"nests more than {MAX_DEPTH} levels"
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, item in items:
        inner = f"{where}[{key}]" if isinstance(value, list) else f"{where}.{key}" if where else str(key)
        found = _first_problem(item, depth - 1, inner)
        if found is not None:
            return found
    return None


def _fail(file: str, key: str, value: Any, requirement: str) -> None:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    raise HFInputError(f"{file}: {key}={shown} is invalid: {requirement}", file=file, field=key)


def _is_int(value: Any) -> bool:
    return type(value) is int


def _is_number(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


# key -> (kind, low, high, may be null); ints are inclusive ranges, numbers open below
_INTS = {"hidden_size": MAX_HIDDEN_DIM, "num_hidden_layers": MAX_LAYERS, "num_attention_heads": MAX_HEADS,
         "vocab_size": MAX_VOCAB, "intermediate_size": MAX_FFN_DIM}
_OPTIONAL_INTS = {"num_key_value_heads": MAX_HEADS, "head_dim": MAX_HIDDEN_DIM,
                  "max_position_embeddings": MAX_SEQ_LEN}
_BOOLS = ("attention_bias", "mlp_bias", "tie_word_embeddings")
_STRINGS = ("model_type", "hidden_act")


def check_config(config: Any, file: str = "config.json") -> None:
    """Every key of a llama ``config.json`` the conversion reads has a usable type and range."""
    if not isinstance(config, dict):
        raise HFInputError(f"{file} does not hold an object", file=file)
    for key, high in _INTS.items():  # missing or null: args_from_hf_config says it is required
        if config.get(key) is not None and not (_is_int(config[key]) and 1 <= config[key] <= high):
            _fail(file, key, config[key], f"must be an integer from 1 to {high}")
    for key, high in _OPTIONAL_INTS.items():
        value = config.get(key)
        if value is not None and not (_is_int(value) and 1 <= value <= high):
            _fail(file, key, value, f"must be an integer from 1 to {high}, or null")
    if "rms_norm_eps" in config and not (_is_number(config["rms_norm_eps"]) and 0 < config["rms_norm_eps"] < 1):
        _fail(file, "rms_norm_eps", config["rms_norm_eps"], "must be a number in (0, 1)")
    for key in ("rope_theta", "partial_rotary_factor"):
        value = config.get(key)
        if value is not None and not (_is_number(value) and value > 0):
            _fail(file, key, value, "must be a positive number, or null")
    for key in ("rope_scaling", "rope_parameters"):
        value = config.get(key)
        if value is not None and not isinstance(value, dict):
            _fail(file, key, value, "must be an object, or null")
        for inner, item in (value or {}).items():
            if inner in ("rope_type", "type"):
                if not isinstance(item, str):
                    _fail(file, f"{key}.{inner}", item, "must be a string")
            elif item is not None and not _is_number(item) and not isinstance(item, (str, bool, list)):
                _fail(file, f"{key}.{inner}", item, "must be a number")
            elif inner in ("rope_theta", "partial_rotary_factor", "factor") and item is not None and \
                    not (_is_number(item) and item > 0):
                _fail(file, f"{key}.{inner}", item, "must be a positive number")
    for key in _BOOLS:
        value = config.get(key)
        if value is not None and type(value) is not bool:
            _fail(file, key, value, "must be true or false")
    for key in _STRINGS:
        value = config.get(key)
        if value is not None and not isinstance(value, str):
            _fail(file, key, value, "must be a string")
    architectures = config.get("architectures")
    if architectures is not None and not (isinstance(architectures, list) and len(architectures) <= 64 and
                                          all(isinstance(a, str) for a in architectures)):
        _fail(file, "architectures", architectures, "must be a list of strings")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = config.get(key)
        ids = value if isinstance(value, list) and len(value) <= 64 else [value]
        if value is not None and not all(_is_int(i) and 0 <= i < MAX_VOCAB for i in ids):
            _fail(file, key, value, "must be a token id (or a list of them), or null")


def weights_file(directory: Path, name: Any, index: Path) -> Path:
    """The weights file ``name`` (a ``weight_map`` value of ``index``): a plain file name inside
    ``directory``; anything leaving it (``..``, an absolute path, a subdirectory) is refused."""
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", "..") or \
            "\x00" in name or len(name) > 255:
        raise HFInputError(f"{index}: weight_map names the file {str(name)[:80]!r}, which is not a file name "
                           "inside the model directory; refused", file=str(index), field="weight_map")
    return directory / name


def check_plain_file(file: Path, directory: Path, what: str) -> None:
    """``file`` (inside ``directory``) is a regular file, not a symbolic link leading elsewhere. The
    one link admitted is the Hugging Face hub cache's own layout, ``snapshots/<revision>/<file>`` ->
    ``../../blobs/<hash>``: a regular file in the ``blobs`` folder of the same cached repository."""
    if file.is_symlink():
        target = file.resolve()
        blobs = (directory.absolute().parent.parent / "blobs").resolve()
        if not (directory.absolute().parent.name == "snapshots" and target.parent == blobs and target.is_file()):
            raise HFInputError(f"{file} is a symbolic link to {target}; {what} must be a plain file inside the model "
                               "directory (copy it instead of linking it)", file=str(file))
    elif not file.is_file():
        raise HFInputError(f"{file} is not a regular file", file=str(file))
