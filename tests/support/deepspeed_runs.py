"""DeepSpeed runs on CPU (its CPU accelerator, gloo) for tests/integrations/test_deepspeed.py, importable
by the ranks of ``run_ranks``. DS_ACCELERATOR=cpu must be set before deepspeed is imported, and
DeepSpeed's shared-memory all-reduce op is not built (:func:`without_the_shm_op`): importing this
module does both, so a rank function that imports it before ``deepspeed.initialize`` gets them."""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402


def without_the_shm_op() -> None:
    """Tell DeepSpeed that its ``deepspeed_shm_comm`` op cannot be built in this process. On its CPU
    accelerator DeepSpeed builds that op (g++ over torch's headers: ~65 s of CPU, minutes under load)
    the first time a process sets up ``deepspeed.comm``, and again whenever its build cache
    (~/.cache/torch_extensions) was last written for another checkout's environment: a fresh clone,
    CI, two checkouts taking turns. The op serves only ``inference_all_reduce``, never ZeRO's
    training, saves or loads; without it DeepSpeed uses torch.distributed (gloo). DeepSpeed keeps the
    probed ops in one dict for edits like this one (``deepspeed.ops.__compatible_ops__``)."""
    try:
        import deepspeed.ops
    except ImportError:  # the deepspeed extra is not installed: the tests skip
        return
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


without_the_shm_op()


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4), torch.nn.Linear(4, 1))


def config(stage: int, **checkpoint) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
           "steps_per_print": 10_000}
    if checkpoint:
        cfg["checkpoint"] = checkpoint
    return cfg


def batches(rank: int, n: int):
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(2, 8, generator=g) for _ in range(n)]


def train(rank: int, world_size: int, save_dir: str, stage: int, steps: int, save_at: tuple, load: bool,
          ours: bool = True, full_every: int = 1) -> dict:
    """``steps`` steps of a tiny model under ZeRO ``stage`` (saving after the steps in ``save_at``, or,
    with ``load``, first loading the latest checkpoint in ``save_dir`` and running the steps after it);
    returns the parameters, the step and the optimizer's fp32 partition on this rank."""
    import deepspeed

    from ckpt.integrations import deepspeed as ckpt_deepspeed

    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    section = {"engine": "ckpt", "ckpt": {"full_every": full_every}} if ours else {}
    engine, _, _, _ = ckpt_deepspeed.initialize(model=net, optimizer=optimizer, config=config(stage, **section))
    assert deepspeed.comm.comm.cdb.shm_comm_op is None, "DeepSpeed built its shm op: see without_the_shm_op"
    start = 0
    if load:
        ckpt_deepspeed.load_checkpoint(engine, save_dir)
        start = engine.global_steps
    data = batches(rank, steps)
    for step in range(start, steps):
        loss = engine(data[step]).pow(2).mean()
        engine.backward(loss)
        engine.step()
        if step + 1 in save_at:
            engine.save_checkpoint(save_dir)
    engine.checkpoint_engine.cleanup()
    partition = [t.detach().clone() for t in engine.optimizer.single_partition_of_fp32_groups]
    return {"params": {k: v.detach().clone() for k, v in engine.module.state_dict().items()},
            "step": engine.global_steps, "partition": partition, "engine": type(engine.checkpoint_engine).__name__}


def scenario(rank: int, world_size: int, root: str, stage: int, steps: int, stop: int, damage: bool = False) -> dict:
    """In one process (DeepSpeed imported once): an uninterrupted run with DeepSpeed's own engine,
    a run through ours that saves every 2 steps and stops after ``stop``, and one resumed from it;
    with ``damage``, a byte of the last rank's optimizer file of the newest tag is flipped first
    (by rank 0), and the warnings of the resumed run come back too."""
    import warnings

    import torch.distributed as dist

    from tests.support.checkpoints import flip_byte

    reference = train(rank, world_size, os.path.join(root, "reference"), stage, steps, (), False, False)
    saved = train(rank, world_size, os.path.join(root, "run"), stage, stop, tuple(range(2, stop + 1, 2)), False)
    if damage:
        if rank == 0:
            newest = os.path.join(root, "run", f"global_step{stop}")
            (optim,) = [n for n in os.listdir(newest) if f"zero_pp_rank_{world_size - 1}_" in n]
            flip_byte(os.path.join(newest, optim))
        if dist.is_initialized():
            dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = train(rank, world_size, os.path.join(root, "run"), stage, steps, (), True)
    return {"reference": reference, "saved": saved, "resumed": resumed,
            "warnings": [str(w.message) for w in caught]}
