"""Plug-ins at the seams of the trainers people already run, each behind an optional extra:

    ckpt.integrations.torchtitan  CheckpointManager (torchtitan's BaseCheckpointManager), selected by the
                                  override ckpt.integrations.torchtitan.ckpt_engine      extra: torchtitan

Nothing here is imported by ``import ckpt``; importing a module imports its framework, and a missing
one raises an ImportError naming the extra to install (:mod:`._optional`). They build on the engine's
public names only (``ckpt.load``, ``CheckpointManager``, ``SaveOptions``, ``SafeLoadPlanner``,
``read_manifest``). See docs/ADOPTING.md for each framework's lines and limits.
"""
