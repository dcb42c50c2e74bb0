"""The read side's checksum checks, and each one removable, to show which test depends on which.

    flip_blob(path, key)                   # one byte of the first blob of ``key`` flipped; its file's name
    with_check_removed(monkeypatch, "indirect")   # ChunkSource.tensor no longer verifies

:data:`CHECKS` names the places :mod:`ckpt.read.source` and :mod:`ckpt.read.prefetch` compare a blob with its checksum:

* ``"direct"``: ``ckpt.read.prefetch._Direct.finish``, a raw chunk a load reads straight into the live tensor
  (in parallel pieces, verified before the want is told);
* ``"direct_stream"``: :meth:`ChunkSource.read_tensors`, the same for the consolidating reader (hashed
  while the next chunk is read, verified before it is yielded);
* ``"indirect"``: :meth:`ChunkSource.tensor`, a raw chunk read into a new tensor (resharded loads,
  Shard(1) merges, dtype conversion, non-contiguous or device targets);
* ``"data_files"``: :meth:`DataFiles.read`, the stored bytes of a blob (zstd and delta chunks, a delta's
  base, ``torch.save`` values, :func:`~ckpt.read.source.verify_blobs`, replay).

:func:`with_check_removed` re-compiles that one method from its source without the line that
verifies (an assertion fails if the line moved: the proof must not silently stop proving).
"""

from __future__ import annotations

import inspect
import json
import textwrap
from pathlib import Path

import sys

from ckpt import read
from ckpt.read import prefetch

CHECKS = {  # name -> (class, method, the verifying line, what replaces it)
    "direct": (prefetch._Direct, "finish", "self.files.verify(self.blob, digest, what=self.key)", "pass"),
    "direct_stream": (read.ChunkSource, "read_tensors", "self.files.verify(blob, digest.result(), what=key)",
                      "digest.result()"),
    "indirect": (read.ChunkSource, "tensor",
                 "self.files.verify(chunk.blob, blob_digest(view, chunk.blob.block_size), what=key)", "pass"),
    "data_files": (read.DataFiles, "read", "self.verify(blob, blob_digest(buffer, blob.block_size), what=what)",
                   "pass"),
}


def with_check_removed(monkeypatch, name: str) -> None:
    """``name``'s checksum comparison (see :data:`CHECKS`) gone until the monkeypatch is undone."""
    cls, method, line, replacement = CHECKS[name]
    source = textwrap.dedent(inspect.getsource(getattr(cls, method)))
    assert source.count(line) == 1, f"{cls.__name__}.{method} no longer holds {line!r}"
    module = sys.modules[cls.__module__]
    namespace = dict(vars(module))
    exec(compile(source.replace(line, replacement), module.__file__, "exec"), namespace)
    monkeypatch.setattr(cls, method, namespace[method])


def flip_blob(checkpoint: str | Path, key: str, *, at: int = 0) -> str:
    """Flip one byte (``at`` bytes into the first blob of tensor or value ``key``; negative: from its
    end) of the checkpoint at ``checkpoint``; returns the data file's name as the manifest gives it."""
    manifest = json.loads((Path(checkpoint) / "manifest.json").read_bytes())
    record = manifest["tensors"].get(key) or manifest["values"][key]
    blob = record["chunks"][0] if "chunks" in record else record  # file, offset, length inline
    path = Path(checkpoint) / blob["file"]
    data = bytearray(path.read_bytes())
    data[blob["offset"] + (at if at >= 0 else blob["length"] + at)] ^= 0x20
    path.write_bytes(bytes(data))
    return blob["file"]
