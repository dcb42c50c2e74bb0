"""Our llama (:mod:`trainer.model`) ↔ torchtitan 0.3.0's llama3: the mapping and the checkpoint conversions.

Like :mod:`trainer.hf`, everything model-specific lives here, beside the model; ``ckpt-convert --from
torchtitan`` / ``--to torchtitan`` (:mod:`tools.convert`) parses arguments and calls one function per
direction. The rooms (each imports only those listed before it):

* :mod:`~trainer.titan.names`: our keys ↔ torchtitan's (model state and parameter names), the fused
  ``wqkv`` split and fused back;
* :mod:`~trainer.titan.sources`: a torchtitan checkpoint's flat state read safely (torchtitan's own
  DCP steps, or steps of ours in its layout);
* :mod:`~trainer.titan.convert`: a torchtitan checkpoint as one our trainer resumes
  (:func:`import_torchtitan`), and ours as one torchtitan's ``CheckpointManager`` resumes
  (:func:`export_torchtitan`).
"""

from __future__ import annotations

from .convert import TitanImport, export_torchtitan, import_torchtitan, titan_args, to_ours, to_titan
from .names import fuse_qkv, our_name, params_of, split_qkv, titan_name, titan_param
from .sources import read_source, step_of, titan_step_dir

__all__ = ["TitanImport", "export_torchtitan", "fuse_qkv", "import_torchtitan", "our_name", "params_of", "read_source",
           "split_qkv", "step_of", "titan_args", "titan_name", "titan_param", "titan_step_dir", "to_ours", "to_titan"]
