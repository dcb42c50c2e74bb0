"""Non-tensor values as tagged JSON.

Step counters, loader positions, hyper-parameters and Python/NumPy RNG states are stored inline in
``manifest.json`` so that loading them never runs code. Plain JSON types pass through unchanged; the
few Python types JSON lacks are written as one-key-tagged objects ``{"__ckpt__": <tag>, ...}``:

    tuple      {"__ckpt__": "tuple", "items": [...]}
    dict       {"__ckpt__": "dict", "items": [[key, value], ...]}   (non-str keys, or a "__ckpt__" key)
    bytes      {"__ckpt__": "bytes", "base64": "..."}
    float      {"__ckpt__": "float", "value": "nan" | "inf" | "-inf"}
    ndarray    {"__ckpt__": "ndarray", "dtype": "<u4", "shape": [...], "base64": "..."}
    dtype      {"__ckpt__": "torch.dtype", "name": "bfloat16"}

Anything else raises :class:`NotJSONable`; the writer then falls back to a ``torch.save`` stream that
is only ever read back with ``weights_only=True``.
"""

from __future__ import annotations

import base64
import math
from typing import Any

import numpy as np
import torch

from ..errors import InvalidManifestError

TAG = "__ckpt__"


class NotJSONable(TypeError):
    """The value holds a type tagged JSON cannot represent."""


class Leaf:
    """A tensor-free subtree (config dict, list of hyper-parameters) kept whole as one value.

    DCP flattens every dict down to its leaves and turns dict keys into strings; wrapping such a
    subtree keeps it one entry, so int keys, tuples and empty containers survive, and a load
    template needs only the subtree's name, not its shape."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __repr__(self) -> str:
        return f"Leaf({self.value!r})"


def encode(value: Any) -> Any:
    """Return a JSON-serialisable form of ``value`` (see the module docstring)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, Leaf):
        return encode(value.value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return float(value)
        return {TAG: "float", "value": repr(float(value))}
    if isinstance(value, np.generic):
        return encode(value.item())
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, tuple):  # torch.Size is a tuple and comes back as one
        return {TAG: "tuple", "items": [encode(v) for v in value]}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and TAG not in value:
            return {k: encode(v) for k, v in value.items()}
        return {TAG: "dict", "items": [[encode(k), encode(v)] for k, v in value.items()]}
    if isinstance(value, (bytes, bytearray)):
        return {TAG: "bytes", "base64": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, np.ndarray) and value.dtype.kind in "biufc":
        data = np.ascontiguousarray(value)
        return {
            TAG: "ndarray",
            "dtype": data.dtype.str,
            "shape": list(data.shape),
            "base64": base64.b64encode(data.tobytes()).decode("ascii"),
        }
    if isinstance(value, torch.dtype):
        return {TAG: "torch.dtype", "name": str(value).removeprefix("torch.")}
    raise NotJSONable(f"{type(value).__module__}.{type(value).__qualname__} is not JSON-encodable")


def decode(data: Any) -> Any:
    """Invert :func:`encode`. Malformed tags raise :class:`InvalidManifestError`."""
    if isinstance(data, list):
        return [decode(v) for v in data]
    if not isinstance(data, dict):
        return data
    if TAG not in data:
        return {k: decode(v) for k, v in data.items()}
    try:
        return _decode_tagged(data)
    except InvalidManifestError:
        raise
    except Exception as exc:  # malformed payload inside a known tag
        raise InvalidManifestError(f"malformed tagged value {data.get(TAG)!r}: {exc}") from None


def _decode_tagged(data: dict) -> Any:
    tag = data[TAG]
    if tag == "tuple":
        return tuple(decode(v) for v in data["items"])
    if tag == "dict":
        return {_hashable(decode(k)): decode(v) for k, v in data["items"]}
    if tag == "bytes":
        return base64.b64decode(data["base64"], validate=True)
    if tag == "float":
        if data["value"] not in ("nan", "inf", "-inf"):
            raise InvalidManifestError(f"bad float literal {data['value']!r}")
        return float(data["value"])
    if tag == "ndarray":
        dtype = np.dtype(data["dtype"])
        if dtype.kind not in "biufc":
            raise InvalidManifestError(f"ndarray dtype {dtype} is not numeric")
        raw = base64.b64decode(data["base64"], validate=True)
        shape = tuple(int(s) for s in data["shape"])
        return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    if tag == "torch.dtype":
        dtype = getattr(torch, data["name"], None)
        if not isinstance(dtype, torch.dtype):
            raise InvalidManifestError(f"unknown torch dtype {data['name']!r}")
        return dtype
    raise InvalidManifestError(f"unknown value tag {tag!r}")


def _hashable(key: Any) -> Any:
    if isinstance(key, list):
        raise InvalidManifestError("a dict key cannot be a list")
    return key
