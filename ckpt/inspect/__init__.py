"""The inspect room: what ``ckpt-inspect`` reports, as data (nothing here prints).

| module | concept |
|---|---|
| :mod:`~ckpt.inspect.report` | a run's steps across its mounts, one checkpoint's summary, every stored byte verified |
| :mod:`~ckpt.inspect.step` | one checkpoint beyond its tensor table: values previewed, the run config, sizes per prefix |
| :mod:`~ckpt.inspect.diff` | two checkpoints compared (``ckpt-inspect --diff A B``) |
| :mod:`~ckpt.inspect.memory` | the memory tier's steps of a run on this machine (node, own ranks, partner copies, bytes) |
| :mod:`~ckpt.inspect.weights` | weights that are not a checkpoint of ours: a ``.safetensors`` file, a Hugging Face folder |
"""

from .diff import diff
from .memory import memory_listing
from .report import (
    compare_mounts,
    mount_list,
    open_manifests,
    set_aside_steps,
    step_rows,
    stored_bytes,
    summarize,
    survey,
    verify_one,
)
from .step import config_lines, prefix_sizes, preview, run_config
from .weights import hf_summary, is_hf_directory, is_weights_file, safetensors_summary

__all__ = ["survey", "summarize", "step_rows", "set_aside_steps", "stored_bytes", "open_manifests", "verify_one",
           "compare_mounts", "mount_list", "memory_listing", "diff", "config_lines", "run_config", "preview",
           "prefix_sizes", "hf_summary", "is_hf_directory", "is_weights_file", "safetensors_summary"]
