"""The dry-run plan: memory per rank and the checkpoint a configuration needs, before anything runs.

``python -m trainer.plan`` / ``python -m trainer.train --dry-run`` (:mod:`trainer.plan.cli`; its
``--help`` gives every formula), or :func:`plan` and :func:`format_plan` from here. The rooms,
each with its contract in its docstring (each imports only rooms listed before it):

* :mod:`~trainer.plan.result`: :class:`Plan`, :class:`StagePlan`, the memory items;
* :mod:`~trainer.plan.layout`: the parallel layout, checked with the trainer's rules;
* :mod:`~trainer.plan.params`: the model on the meta device, what one rank holds after TP/PP/FSDP;
* :mod:`~trainer.plan.activations`: what a layer and the head save per microbatch;
* :mod:`~trainer.plan.checkpoint`: the checkpoint's size and write time (measured ratios);
* :mod:`~trainer.plan.memory`: one rank's memory, item by item, and its peak;
* :mod:`~trainer.plan.devices`: the known devices and the verdict;
* :mod:`~trainer.plan.report`: the readable report;
* :mod:`~trainer.plan.build`: :func:`plan`, putting them together;
* :mod:`~trainer.plan.cli`: the command line.
"""

from __future__ import annotations

from ..parallel import ParallelismError
from .activations import (
    Numerics,
    head_activation_bytes,
    korthikanti_layer_bytes,
    layer_activation_bytes,
    layer_input_bytes,
    layer_op_level_bytes,
    numerics,
)
from .build import plan
from .checkpoint import SMALL_STATE_BYTES
from .cli import main, split_flags
from .devices import GIB, KNOWN_DEVICES, known_device
from .layout import Layout, resolve_layout
from .memory import peak_bytes
from .params import LLAMA2_PARAMS, meta_model, model_args_for, shard_numel, tp_shape
from .report import format_plan
from .result import ITEMS, Plan, StagePlan

__all__ = [
    "GIB", "ITEMS", "KNOWN_DEVICES", "LLAMA2_PARAMS", "SMALL_STATE_BYTES", "Layout", "Numerics",
    "ParallelismError", "Plan", "StagePlan", "format_plan", "head_activation_bytes", "known_device",
    "korthikanti_layer_bytes", "layer_activation_bytes", "layer_input_bytes", "layer_op_level_bytes",
    "main", "meta_model", "model_args_for", "numerics", "peak_bytes", "plan", "resolve_layout",
    "shard_numel", "split_flags", "tp_shape",
]
