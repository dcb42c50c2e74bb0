"""Our llama (:mod:`trainer.model`) ↔ Hugging Face ``LlamaForCausalLM``: the mapping and the conversions.

Everything model-specific a conversion needs lives here, beside the model; ``ckpt-convert``
(:mod:`tools.convert`) parses arguments, shows progress and calls one function of this package per
direction. The rooms, each with its contract in its docstring (each imports only rooms listed
before it):

* :mod:`~trainer.hf.checks`: a foreign directory's JSON and weights files bounded and type-checked
  (:class:`HFInputError`, naming the file and the field);
* :mod:`~trainer.hf.names`: our state-dict keys ↔ Hugging Face's;
* :mod:`~trainer.hf.rotary`: the q/k row permutation, per-tensor :func:`to_hf` / :func:`from_hf`;
* :mod:`~trainer.hf.config`: ``config.json`` / ``generation_config.json`` written, and read back
  (:class:`UnsupportedHFConfig` for what our model cannot represent);
* :mod:`~trainer.hf.run`: the model a trainer checkpoint holds, the config section and flags that
  rebuild it, its tokenizer as Hugging Face files;
* :mod:`~trainer.hf.export`: a checkpoint's model as a Hugging Face directory (:func:`export_hf`)
  or plain weights files (:func:`export_weights`);
* :mod:`~trainer.hf.importer`: a Hugging Face directory as a checkpoint (:func:`open_hf`,
  :func:`import_hf`).
"""

from __future__ import annotations

from .config import (
    HF_ARCHITECTURE,
    HF_MODEL_TYPE,
    UnsupportedHFConfig,
    args_from_hf_config,
    dtype_name,
    generation_config,
    hf_config,
)
from .export import DEFAULT_HF_SHARD, Export, export_bytes, export_hf, export_weights
from .importer import HFModel, Import, import_hf, open_hf, write_step
from .names import HF_IGNORED, hf_name, our_name
from .rotary import from_hf, permute_from_hf, permute_to_hf, to_hf
from .run import (
    PREFIX,
    args_from_run_config,
    describe,
    expected_shapes,
    model_args_of,
    shape_problems,
    tokenizer_files,
    trainer_flags,
    trainer_model_config,
)

__all__ = [
    "DEFAULT_HF_SHARD", "Export", "HFModel", "HF_ARCHITECTURE", "HF_IGNORED", "HF_MODEL_TYPE", "Import",
    "PREFIX", "UnsupportedHFConfig", "args_from_hf_config", "args_from_run_config", "describe", "dtype_name",
    "expected_shapes", "export_bytes", "export_hf", "export_weights", "from_hf", "generation_config",
    "hf_config", "hf_name", "import_hf", "model_args_of", "open_hf", "our_name", "permute_from_hf",
    "permute_to_hf", "shape_problems", "to_hf", "tokenizer_files", "trainer_flags", "trainer_model_config",
    "write_step",
]
