"""Checkpoints as format version 2 wrote them, built from a version-3 one (no binary fixtures).

Version 2 differs from 3 only in the blobs longer than one block: no ``block_size``/``block_table``
fields, no block tables after the last payload, and ``checksum`` the xxh3-64 of the blob's stored
bytes. :func:`downgrade_to_v2` rewrites a committed checkpoint that way, in place (data files cut
back to their last payload, manifest resealed as version 2): byte for byte what the version-2 writer
(main before issue 27) produced for the same payloads.
"""

from __future__ import annotations

import json
from pathlib import Path

import xxhash

from ckpt.format import seal


def _blob_docs(doc: dict):
    for entry in doc["tensors"].values():
        yield from entry["chunks"]
    for entry in doc["values"].values():
        if entry["encoding"] != "json":
            yield entry


def downgrade_to_v2(path) -> int:
    """Rewrite the checkpoint at ``path`` as format version 2; returns how many blobs had blocks."""
    path = Path(path)
    doc = json.loads((path / "manifest.json").read_bytes())
    doc.pop("digest")
    assert doc["format_version"] == 3, doc["format_version"]
    ends: dict[str, int] = {}
    blocked = 0
    for blob in _blob_docs(doc):
        ends[blob["file"]] = max(ends.get(blob["file"], 0), blob["offset"] + blob["length"])
        if "block_size" in blob:
            blocked += 1
            with open(path / blob["file"], "rb") as handle:
                handle.seek(blob["offset"])
                stored = handle.read(blob["length"])
            blob["checksum"] = f"{xxhash.xxh3_64_intdigest(stored):016x}"
            del blob["block_size"], blob["block_table"]
    for name, end in ends.items():
        with open(path / name, "r+b") as handle:
            handle.truncate(end)
        doc["files"][name] = end
    doc["format_version"] = 2
    (path / "manifest.json").write_bytes(seal(doc))
    return blocked
