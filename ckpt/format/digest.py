"""The manifest's digest (format version 2 and later): every byte of ``manifest.json`` is covered.

A sealed manifest is compact JSON whose last field is ``"digest"``: the xxh3-64 of the same bytes
without that field (the document as it reads up to its closing brace). :func:`seal` writes it,
:func:`unseal` splits it off again for the reader to compare (:mod:`ckpt.format.validate`).
"""

from __future__ import annotations

import json
import re

from .blobs import checksum

_DIGEST_TAIL = re.compile(rb',"digest":"([0-9a-f]{16})"\}\Z')


def seal(doc: dict) -> bytes:
    """``doc`` as compact JSON bytes with one last field, ``"digest"``: the xxh3-64 of the same
    bytes without that field (the document as it reads up to its closing brace)."""
    # no cycle check: the manifest's document is built fresh, and a cycle would still end in an error
    # (RecursionError); the check's bookkeeping was a fifth of the encoding (a memory save: every step)
    body = json.dumps(doc, separators=(",", ":"), allow_nan=False, check_circular=False).encode()
    if not doc:
        raise ValueError("an empty manifest cannot be sealed")
    return body[:-1] + b',"digest":"' + checksum(body).encode() + b'"}'


def unseal(raw: bytes) -> tuple[bytes, str | None, str | None]:
    """``(body, stored digest, digest of body)``: the sealed document without its digest field,
    or ``(raw, None, None)`` when it has none (a version-1 manifest, or a damaged tail)."""
    tail = _DIGEST_TAIL.search(raw)
    if tail is None:
        return raw, None, None
    body = raw[: tail.start()] + b"}"
    return body, tail.group(1).decode(), checksum(body)
