"""The offline converters: a checkpoint's tensors out into other formats, other formats in.

Each module states its contract; each imports only the engine below it and the rooms listed before it:

    formats        the two weights-file formats, streamed: safetensors headers, the torch.save zip
    consolidate    whole tensors from a checkpoint's chunks, one at a time (choose, read)
    export         weights files written (one file or Hugging Face shards, whole or not at all);
                   ``merge``: ckpt-merge's library call
    merged         ``ckpt.save(..., merged=True)``: the live state gathered into one .safetensors file
    replay         a delta chain's step materialised as a full checkpoint (ckpt-replay)
    plugins        a plug-in's step (DeepSpeed, Lightning, the HF Trainer) as its model's weights under the
                   names its framework's model takes; DeepSpeed's ZeRO 1/2 fp32 masters joined (ckpt-convert)
    dcp/           a plain DCP checkpoint converted chunk by chunk into ours (ckpt-convert --from dcp):
                   its ``.metadata`` by an allow-list unpickler, its data files' items with
                   ``torch.load(weights_only=True)``, both bounded (its own room)

The names callers need are importable from here (``from ckpt.convert import merge, import_dcp``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .consolidate import GROUPS, MMAP_MIN_BYTES, converted_dtype, empty_tensor, full_tensors, select_keys, tensor_specs
from .formats import FORMATS, SAFETENSORS_DTYPES, TensorSpec, TorchZipWriter, safetensors_header
from ..lazy import lazy_names

if TYPE_CHECKING:
    from .dcp import import_dcp, read_dcp_metadata, total_tensor_bytes
    from .export import HF_NAMES, merge, plan_shards, step_metadata, write_output
    from .merged import save_merged
    from .plugins import PluginStep, export_plugin_step, open_plugin_step
    from .replay import materialize

# the converters that write, or read DCP, imported on first use (ckpt.lazy): reading tensors
# (ckpt-inspect --diff) needs no DCP
__getattr__, __dir__ = lazy_names(__name__, {
    **dict.fromkeys(["import_dcp", "read_dcp_metadata", "total_tensor_bytes"], ".dcp"),
    **dict.fromkeys(["HF_NAMES", "merge", "plan_shards", "step_metadata", "write_output"], ".export"),
    "save_merged": ".merged", "materialize": ".replay",
    **dict.fromkeys(["PluginStep", "export_plugin_step", "open_plugin_step"], ".plugins"),
})

__all__ = [
    "FORMATS", "GROUPS", "HF_NAMES", "MMAP_MIN_BYTES", "PluginStep", "SAFETENSORS_DTYPES", "TensorSpec",
    "TorchZipWriter", "converted_dtype", "empty_tensor", "export_plugin_step", "full_tensors", "import_dcp",
    "materialize", "merge", "open_plugin_step", "plan_shards", "read_dcp_metadata", "safetensors_header",
    "save_merged", "select_keys", "step_metadata", "tensor_specs", "total_tensor_bytes", "write_output",
]
