"""The write room: the save path, top to bottom.

    live tensors ─ staging ─▶ host buffers ─ storage_writer (DCP) ─▶ files ─▶ assemble ─▶ commit

| module | concept |
|---|---|
| :mod:`~ckpt.write.staging` | :class:`DoubleBufferStager`: the state snapshotted into reusable host buffers, off the hot path |
| :mod:`~ckpt.write.host_buffers` | one snapshot's host buffers: every tensor laid out in a few large allocations |
| :mod:`~ckpt.write.snapshot_copy` | how a snapshot's bytes move into host buffers, and when the live tensors may change again |
| :mod:`~ckpt.write.delta` | incremental saves: when a save is a delta, and what it is a delta against |
| :mod:`~ckpt.write.pipeline` | :class:`SavePipeline`: the one async save path (snapshot, write, commit; busy policy, errors) of the manager and every plug-in |
| :mod:`~ckpt.write.hooks` | :class:`SnapshotHooks`: an optimizer's step and a module's forward wait until the last snapshot no longer needs the live tensors |
| :mod:`~ckpt.write.storage_writer` | DCP's StorageWriter (:class:`ckpt.dcp.Writer`): the protocol object of a save |
| :mod:`~ckpt.write.files` | one rank's data files: encode → balance → write, checksummed as written |
| :mod:`~ckpt.write.assemble` | the one manifest builder, and a checkpoint assembled outside DCP (:class:`NewCheckpoint`) |

The commit itself (manifest last, atomically) is :mod:`ckpt.commit`'s.
"""

from .assemble import NewCheckpoint, build_manifest, new_manifest
from .delta import DeltaBase, DeltaChain, may_build_on, tensor_signature
from .files import ChunkEncoder, Payload, Place, tensor_bytes, write_file, write_rank
from .pipeline import SavePipeline, Started, Target
from .staging import DoubleBufferStager
from .storage_writer import Writer

__all__ = ["SavePipeline", "Target", "Started", "DoubleBufferStager", "DeltaBase", "DeltaChain", "may_build_on",
           "tensor_signature", "Writer", "ChunkEncoder", "Payload",
           "Place", "tensor_bytes", "write_file", "write_rank", "NewCheckpoint", "new_manifest", "build_manifest"]
