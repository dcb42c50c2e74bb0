"""Plain DCP checkpoints in (``ckpt-convert --from dcp``): foreign input, bounded before it is believed.

| module | concept |
|---|---|
| :mod:`~ckpt.convert.dcp.bounds` | limits on what foreign input may make the process do: element budgets, depth, memory |
| :mod:`~ckpt.convert.dcp.metadata` | DCP's ``.metadata`` read by an allow-list unpickler, its shape checked |
| :mod:`~ckpt.convert.dcp.items` | the items of DCP's data files read with ``torch.load(weights_only=True)``, checked |
| :mod:`~ckpt.convert.dcp.importer` | a plain DCP checkpoint converted chunk by chunk into ours |
"""

from .importer import import_dcp
from .metadata import read_dcp_metadata, total_tensor_bytes

__all__ = ["import_dcp", "read_dcp_metadata", "total_tensor_bytes"]
