"""Plug-ins at the seams of the trainers people already run, each behind an optional extra:

    ckpt.integrations.lightning   CkptCheckpointIO (Lightning's CheckpointIO), CkptModelParallelStrategy
                                  (sharded DCP checkpoints of ModelParallelStrategy)     extra: lightning
    ckpt.integrations.hf          CkptCallback (a transformers TrainerCallback), register_accelerate_hooks
                                  (accelerate's save_state/load_state pre-hooks)       extras: hf, accelerate
    ckpt.integrations.deepspeed   CkptCheckpointEngine (DeepSpeed's CheckpointEngine), initialize,
                                  use_ckpt_engine, load_checkpoint (past a damaged tag)  extra: deepspeed

Nothing here is imported by ``import ckpt``; importing a module imports its framework, and a missing
one raises an ImportError naming the extra to install. They build on the engine's public names only
(``ckpt.save``/``load``, ``CheckpointManager``, ``dcp.Writer``, ``DoubleBufferStager``, ``read_manifest``).
Shared underneath: :mod:`._tree` (a framework's checkpoint dict as our format, read back without a
template) and :mod:`._store` (checkpoints at paths a framework chooses: async, deltas, kept bases).
See docs/ADOPTING.md for each framework's lines and limits.
"""
