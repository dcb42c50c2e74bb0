"""Two checkpoints compared: ``ckpt-inspect --diff A B``.

Contract: :func:`diff` reports, as a JSON-ready dict, the tensors only A or only B holds, those
whose dtype or shape changed, and for the others whether their values changed; and the plain
values added, removed or changed. A tensor's values are judged from the manifests where the
stored bytes decide it, without reading data: the same boxes, each chunk pair stored by the same
non-delta codec with the same checksum (xxh3 of the stored bytes), or B a delta on A storing them
as ``unchanged``, is unchanged; raw chunk pairs
with different checksums are changed. Every tensor not known to be the same (changed, or another
layout, a delta chain, compressed chunks whose bytes differ) is read one tensor of each side at a
time, verified as every read is, and compared: the changed elements and the largest absolute
difference (floats). ``values=False`` never reads: a tensor the manifests cannot tell is
``unknown``, a changed one has no measure.
"""

from __future__ import annotations

from typing import Iterator

import torch

from ..read.committed import read_manifest
from ..convert import full_tensors
from ..format import Manifest, TensorEntry
from ..storage import Location

_BYTE_CODECS = ("raw", "planes")  # the stored bytes are a function of the values alone


def _dtype(entry: TensorEntry) -> str:
    return str(entry.dtype).removeprefix("torch.")


def by_manifest(a: TensorEntry, b: TensorEntry, *, b_on_a: bool = False) -> str | None:
    """``"same"`` / ``"changed"`` when the stored chunks decide it, else None (read to tell).
    ``b_on_a``: B is a delta whose base is A itself, so a chunk B stores as ``unchanged`` is A's."""
    if [(c.offsets, c.sizes) for c in a.chunks] != [(c.offsets, c.sizes) for c in b.chunks]:
        return None
    pairs = [(x.blob, y.blob) for x, y in zip(a.chunks, b.chunks)]
    if b_on_a and all(y.codec == "unchanged" for _x, y in pairs):
        return "same"
    if all(x.codec == y.codec and x.codec in _BYTE_CODECS and x.checksum == y.checksum for x, y in pairs):
        return "same"
    if any(x.codec == y.codec == "raw" and x.checksum != y.checksum for x, y in pairs):
        return "changed"
    return None


def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Changed elements of two tensors of one shape and dtype (and the largest absolute difference)."""
    if a.dtype.is_floating_point or a.dtype.is_complex:
        different = ~((a == b) | (torch.isnan(a) & torch.isnan(b)))
    else:
        different = a != b
    changed = int(different.sum())
    report = {"state": "changed" if changed else "same", "changed_elements": changed, "elements": a.numel()}
    if changed and a.dtype.is_floating_point:
        delta = (a.double() - b.double()).abs()
        report["max_abs_diff"] = float(delta[different].max())
    return report


def _pairs(pa: Location, ma: Manifest, pb: Location, mb: Manifest, keys: list[str]
           ) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    for (key, a), (_key, b) in zip(full_tensors(pa, keys, manifest=ma), full_tensors(pb, keys, manifest=mb)):
        yield key, a, b


def diff(pa: Location, pb: Location, *, values: bool = True, progress=None) -> dict:
    """A against B (see the module docstring); ``progress(n)``: bytes of B read to compare."""
    ma, mb = read_manifest(pa), read_manifest(pb)
    ka, kb = set(ma.tensors), set(mb.tensors)
    b_on_a = mb.base is not None and mb.base == pa.name and str(pa.parent) == str(pb.parent) and \
        (ma.run is None or mb.run is None or ma.run == mb.run)
    tensors: dict[str, dict] = {}
    to_read = []
    for key in sorted(ka & kb):
        a, b = ma.tensors[key], mb.tensors[key]
        if _dtype(a) != _dtype(b) or tuple(a.shape) != tuple(b.shape):
            tensors[key] = {"state": "retyped", "a": {"dtype": _dtype(a), "shape": list(a.shape)},
                            "b": {"dtype": _dtype(b), "shape": list(b.shape)}}
            continue
        state = by_manifest(a, b, b_on_a=b_on_a)
        if state != "same" and values:  # read: whether it changed, or by how much
            to_read.append(key)
            continue
        tensors[key] = {"state": state or "unknown", "by": "checksums" if state else None}
    for key, a, b in _pairs(pa, ma, pb, mb, to_read):
        tensors[key] = {**compare(a, b), "by": "values"}
        if progress is not None:
            progress(b.numel() * b.element_size())
        del a, b
    counts = {state: sum(1 for t in tensors.values() if t["state"] == state)
              for state in ("same", "changed", "retyped", "unknown")}
    changed_values = sorted(k for k in set(ma.values) & set(mb.values) if _value_form(ma, k) != _value_form(mb, k))
    return {
        "a": {"path": str(pa), "step": ma.step, "kind": ma.kind}, "b": {"path": str(pb), "step": mb.step, "kind": mb.kind},
        "added": sorted(kb - ka), "removed": sorted(ka - kb),
        "tensors": dict(sorted(tensors.items())), "counts": counts,
        "changed_bytes": sum(_nbytes(mb.tensors[k]) for k, t in tensors.items() if t["state"] in ("changed", "retyped")),
        "values": {"added": sorted(set(mb.values) - set(ma.values)), "removed": sorted(set(ma.values) - set(mb.values)),
                   "changed": changed_values},
    }


def _nbytes(entry: TensorEntry) -> int:
    return sum(c.blob.decoded_length for c in entry.chunks)


def _value_form(manifest: Manifest, key: str):
    """What a value is stored as: its tagged JSON, or a torch.save stream's checksum."""
    entry = manifest.values[key]
    return ("json", entry.value) if entry.encoding == "json" else ("blob", entry.blob.checksum if entry.blob else None)
