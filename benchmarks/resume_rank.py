"""One rank of a ``bench_resume.py`` job, started by torchrun: save a trained state, or resume it and take one step.

    torchrun --standalone --nproc_per_node N benchmarks/resume_rank.py --mode save   --root DIR --out DIR ...
    torchrun --standalone --nproc_per_node N benchmarks/resume_rank.py --mode resume --system ours|dcp|titan ...

The first line takes the wall clock (``time.time()``: one clock for the launcher and every rank of
the machine) before anything is imported; each rank then stamps the boundaries of its start and
writes them to ``<out>/rank-<R>.json``, which ``bench_resume.py`` turns into parts:

    started    the interpreter runs this file's first line (launcher + interpreter start before it)
    imported   torch, the trainer and ckpt imported (and torchtitan's components for ``titan``)
    built      ``Trainer(config)`` up to the checkpoint load: process group, mesh, model, FSDP/TP,
               optimizer, data loader (for ``ours`` the stamp is taken where the trainer calls its resume),
               then a barrier of all ranks, for every system: ranks finish building at different
               times, and without it a system whose build ends in a collective (ours: the run's
               checkpoint root is agreed on) would have that skew counted in its load, the others in
               their build
    loaded     the checkpoint loaded into the live state
    stepped    the first optimizer step of the resumed run done (``Trainer.fit(stop_at=step + 1)``)

Systems (the same trainer, the same saved state, loaded three ways):

ours    ``Trainer`` with ``checkpoint.enable``: ``RunCheckpoints.resume`` -> ``CheckpointManager.load``
        (the trainer's own resume; timed by wrapping that one method, nothing of the trainer changed).
dcp     ``Trainer`` without checkpointing, then plain DCP as a DCP user writes it: the state dict
        ``{model: get_model_state_dict, optim: get_optimizer_state_dict, lr_scheduler, dataloader,
        train}``, ``dcp.load(sd, storage_reader=FileSystemReader(dir))`` in place (``peers.dcp_load``),
        then ``set_model_state_dict`` / ``set_optimizer_state_dict`` / ``load_state_dict`` of the rest.
titan   ``Trainer`` without checkpointing, torchtitan's ``OptimizersContainer`` (AdamW) and
        ``LRSchedulersContainer`` in place of the trainer's optimizer and schedule, and torchtitan's own
        ``CheckpointManager`` (``async_mode="disabled"``) ``.load(step)`` of a folder it saved.

``--mode save`` (untimed) trains ``--steps`` steps with ours checkpointing the last one, then writes
the same state with ``dcp.save`` (``peers.dcp_save``) and, when torchtitan is installed, with
torchtitan's manager (its AdamW state copied from the trained optimizer by ``set_optimizer_state_dict``).
"""

import time

STARTED = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [p for p in (str(REPO), str(HERE)) if p not in sys.path]
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)

SYSTEMS = ("ours", "dcp", "titan")
CONFIG = REPO / "configs" / "debug.toml"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("save", "resume"), required=True)
    p.add_argument("--system", choices=SYSTEMS, default="ours")
    p.add_argument("--root", required=True, help="the saved checkpoints: ROOT/ours, ROOT/dcp/step-N, ROOT/titan")
    p.add_argument("--out", required=True, help="where each rank writes rank-<R>.json")
    p.add_argument("--dump", required=True, help="the trainer's job.dump_folder for this job")
    p.add_argument("--steps", type=int, default=2, help="steps trained before the save (the step resumed)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--titan", action="store_true", help="save mode: also write torchtitan's checkpoint")
    p.add_argument("--trainer-args", default="", help="more trainer options, appended (later ones win; "
                   "give it as --trainer-args='--checkpoint.memory DIR ...'): bench_recover.py's memory tier and S3")
    return p.parse_args(argv)


def trainer_argv(args: argparse.Namespace, *, checkpoint: bool, steps: int, interval: int) -> list[str]:
    """The trainer's command line: the debug config with this benchmark's model, batch and layout."""
    return ["--config", str(CONFIG), "--training.steps", str(steps), "--training.batch_size", "4",
            "--training.seq_len", "64", "--training.warmup_steps", "1", "--training.gc_freq", "0",
            "--model.hidden_dim", str(args.dim), "--model.n_layers", str(args.layers),
            "--parallelism.tp", str(args.tp), "--parallelism.dp_shard", "-1",
            "--metrics.log_freq", "1000", "--job.dump_folder", args.dump,
            "--checkpoint.enable", "true" if checkpoint else "false", "--checkpoint.folder", str(Path(args.root, "ours")),
            "--checkpoint.interval", str(interval), "--checkpoint.async_mode", "sync", "--checkpoint.keep", "2",
            *shlex.split(args.trainer_args)]


def dcp_state(trainer) -> dict:
    """The trainer's state as a plain DCP user builds it (torch's state_dict API, FQN keys, DTensors)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(trainer.model),
            "optim": get_optimizer_state_dict(trainer.model, trainer.optimizer),
            "lr_scheduler": trainer.scheduler.state_dict(), "dataloader": trainer.loader.state_dict(),
            "train": trainer.train_state.state_dict()}


def dcp_restore(trainer, sd: dict) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    set_model_state_dict(trainer.model, sd["model"])
    set_optimizer_state_dict(trainer.model, trainer.optimizer, sd["optim"])
    trainer.scheduler.load_state_dict(sd["lr_scheduler"])
    trainer.loader.load_state_dict(sd["dataloader"])
    trainer.train_state.load_state_dict(sd["train"])


def titan_parts(trainer, folder: Path, steps: int):
    """torchtitan's optimizer and schedule over the trainer's model, and its own checkpoint manager."""
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    t = trainer.cfg.training
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                       optimizer_kwargs={"lr": t.lr, "weight_decay": t.weight_decay})],
        implementation="foreach").build(model_parts=[trainer.model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=1).build(optimizers=optimizers, training_steps=steps + 10)
    manager = CheckpointManager.Config(enable=True, folder=folder.name, interval=steps, async_mode="disabled",
                                       keep_latest_k=0).build(
        dataloader=trainer.loader, model_parts=[trainer.model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": trainer.train_state}, sd_adapter=None, base_folder=str(folder.parent))
    trainer.optimizer, trainer.scheduler = optimizers, schedulers  # the trainer's step now runs torchtitan's
    return optimizers, manager


def save(args: argparse.Namespace, Trainer, load_config) -> dict:
    """Train ``steps`` steps (ours saves the last), then write the same state through DCP and torchtitan."""
    import peers
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    trainer = Trainer(load_config(trainer_argv(args, checkpoint=True, steps=args.steps, interval=args.steps)))
    try:
        losses = trainer.fit()  # ours commits the last step before fit returns
        peers.dcp_save(dcp_state(trainer), Path(args.root, "dcp", f"step-{args.steps}"), no_dist=False)
        if args.titan:
            trained = get_optimizer_state_dict(trainer.model, trainer.optimizer)
            optimizers, manager = titan_parts(trainer, Path(args.root, "titan"), args.steps)
            set_optimizer_state_dict(trainer.model, optimizers.optimizers[0], trained)
            manager.save(args.steps)
            manager.close()
    finally:
        trainer.close()  # the process group last: the saves above are collective
    stats = trainer.checkpoints.manager.stats
    return {"losses": losses, "params": sum(p.numel() for p in trainer.model.parameters()),
            "memory_saves": stats.memory_saves, "memory_failures": stats.memory_failures}


def built(stamps: dict) -> None:
    """The end of the build: every rank built (a barrier), then the stamp."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
    stamps["built"] = time.time()


def resume(args: argparse.Namespace, Trainer, load_config, stamps: dict) -> dict:
    """Build the trainer, load the checkpoint the system's way, take the first step; stamp the boundaries."""
    import peers
    from trainer.checkpointing import RunCheckpoints

    steps = args.steps + 10  # no save at the resumed run's first step
    ours = args.system == "ours"
    if ours:
        original = RunCheckpoints.resume

        def timed_resume(self, state):
            built(stamps)
            original(self, state)
            stamps["loaded"] = time.time()

        RunCheckpoints.resume = timed_resume
    trainer = Trainer(load_config(trainer_argv(args, checkpoint=ours, steps=steps, interval=1000)))
    try:
        if args.system == "dcp":
            built(stamps)
            sd = dcp_state(trainer)
            peers.dcp_load(sd, Path(args.root, "dcp", f"step-{args.steps}"), no_dist=False)
            dcp_restore(trainer, sd)
            stamps["loaded"] = time.time()
        elif args.system == "titan":
            _, manager = titan_parts(trainer, Path(args.root, "titan"), args.steps)
            built(stamps)
            if not manager.load(step=args.steps):
                raise RuntimeError("torchtitan's CheckpointManager found no checkpoint to load")
            stamps["loaded"] = time.time()
        step = trainer.train_state.step
        read = trainer.checkpoints.manager.load_stats.bytes_read if ours else None  # 0: from the memory tier
        if step != args.steps:
            raise RuntimeError(f"{args.system}: resumed at step {step}, expected {args.steps}")
        losses = trainer.fit(stop_at=step + 1)
        stamps["stepped"] = time.time()
    finally:
        trainer.close()
        if args.system == "titan" and "manager" in locals():
            manager.close()
    return {"loss": losses[0], "step": step, "bytes_read": read}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    stamps = {"started": STARTED}
    import torch

    torch.set_num_threads(1)
    import peers  # noqa: F401  (imported by every system alike: the DCP calls and harness)
    from trainer.checkpointing import RunCheckpoints  # noqa: F401
    from trainer.config import load_config
    from trainer.train import Trainer

    if args.system == "titan" or args.titan:
        import torchtitan.components.checkpointer  # noqa: F401  (torchtitan's imports count as its start)
        import torchtitan.components.optimizer  # noqa: F401
    stamps["imported"] = time.time()
    result = save(args, Trainer, load_config) if args.mode == "save" else resume(args, Trainer, load_config, stamps)
    rank = int(os.environ.get("RANK", "0"))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "stamps": stamps, **result}))
    # Done and written: leave without the interpreter's finalization, where torch 2.13's C++ teardown
    # after a DeviceMesh sometimes aborts (SIGABRT; see tests/support/launch.py), failing a job that did its work.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
