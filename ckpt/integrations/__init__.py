"""Plug-ins at the seams of the trainers people already run, each behind an optional extra:

    ckpt.integrations.lightning   CkptCheckpointIO (Lightning's CheckpointIO), CkptModelParallelStrategy
                                  (sharded DCP checkpoints of ModelParallelStrategy)     extra: lightning
    ckpt.integrations.hf          CkptCallback (a transformers TrainerCallback), register_accelerate_hooks
                                  (accelerate's save_state/load_state pre-hooks)       extras: hf, accelerate
    ckpt.integrations.deepspeed   CkptCheckpointEngine (DeepSpeed's CheckpointEngine), initialize,
                                  use_ckpt_engine, load_checkpoint (past a damaged tag)  extra: deepspeed
    ckpt.integrations.torchtitan  CheckpointManager (torchtitan's BaseCheckpointManager), selected by the
                                  override ckpt.integrations.torchtitan.ckpt_engine      extra: torchtitan

Nothing here is imported by ``import ckpt``; importing a module imports its framework, and a missing
one raises an ImportError naming the extra to install (:mod:`._optional`). They build on the engine's
public names only (``ckpt.save``/``load``, ``CheckpointManager``, ``SaveOptions``, ``SafeLoadPlanner``,
``dcp.Writer``, ``DoubleBufferStager``, ``read_manifest``). Shared underneath: :mod:`._tree` (a
framework's checkpoint dict as our format, read back without a template), :mod:`._store` (checkpoints
at paths a framework chooses: async, deltas, kept bases), :mod:`._titan_state` (torchtitan's state).
See docs/ADOPTING.md for each framework's lines and limits.
"""
