"""Bitwise equality of checkpoint contents, for the campaign scripts' checks (crash harness,
corruption campaign): what was loaded against what was saved or what an uninterrupted run wrote.

Tensors are equal when their dtypes, shapes and bytes are (so NaN equals the same NaN and -0.0 is
not 0.0); dicts, lists and tuples when their items are, keys and types included; floats when they
are equal or both NaN; anything else when its type and value are.
"""

from __future__ import annotations

import math

import torch


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def equal(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(tensor_bytes(a), tensor_bytes(b)))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(equal, a, b))
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return type(a) is type(b) and a == b
