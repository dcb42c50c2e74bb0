"""DCP plug-ins: our format behind ``torch.distributed.checkpoint``'s StorageWriter/StorageReader.

    dcp.save(state_dict, storage_writer=ckpt.dcp.Writer(path))
    dcp.load(state_dict, storage_reader=ckpt.dcp.Reader(path))

DCP does the distributed part (planning, deduplicating replicated tensors, resharding DTensors).
:class:`Writer` lives in the write room (:mod:`ckpt.write.storage_writer`), :class:`Reader` in the
read room (:mod:`ckpt.read.storage_reader`); this module is their public name.
"""

from .read.storage_reader import Reader
from .write.storage_writer import Writer

__all__ = ["Writer", "Reader"]
