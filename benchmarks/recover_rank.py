"""One rank of ``bench_recover.py``'s training jobs (lost work, tokens/s), started by torchrun as a
rank of one of two nodes (``recover_jobs.two_nodes``).

    torchrun ... benchmarks/recover_rank.py --mode crash --crash-at C ...   # train, die right after step C
    torchrun ... benchmarks/recover_rank.py --mode restart ...              # resume, take one step
    torchrun ... benchmarks/recover_rank.py --mode train --steps S ...      # tokens/s and stall of S steps

The trainer is ``resume_rank.trainer_argv``'s (the debug config, this job's model size, layout and
folders) with ``--trainer-args`` appended (the memory tier, its interval, the saving mode).

crash    ``Trainer.fit(stop_at=C)``, then step C+1 goes on and ``--crash-frac`` of a step's time into
         it (the mean of steps C-2..C, rank 0's, broadcast: every rank dies at the same moment)
         ``os._exit(1)`` on every rank: no close, no wait, the writer thread killed wherever it is,
         as when a worker dies and torchrun tears down the job; the memory folders and storage stay
         as the run left them. The job exits non-zero. Records the steps finished at the crash, the
         steps whose save started (``CheckpointManager.save`` returned True: with memory_interval 1
         a memory save; a step missing was skipped by the memory gate, the writer still busy) and
         the memory steps committed (``SaveStats.memory_saves``) at that moment.
restart  the trainer's own resume (memory tier first, then storage); records the step it resumed
         at and the bytes its load read from storage (0: from the memory tier), then takes one step.
train    ``fit`` to step ``--warmup``, then the timed window to ``--steps`` (the saves drained by
         ``manager.wait()`` inside it, so the writer's work is counted); records tokens/s of the window
         (global batch × sequence length per step) and the manager's counters: storage saves, memory
         saves and the stall (``SaveStats.stall_s``: host + device time training was blocked), and the
         window's CPU seconds by thread (:func:`cpu_seconds`: training thread, gloo's, the rest).

Each rank writes ``<out>/rank-<R>.json`` (``--mode crash``: before it dies).
"""

import threading
import time

STARTED = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path[:0] = [p for p in (str(HERE.parent), str(HERE)) if p not in sys.path]

from resume_rank import trainer_argv  # noqa: E402

BATCH, SEQ = 4, 64  # resume_rank.trainer_argv's global batch and sequence length


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("crash", "restart", "train"), required=True)
    p.add_argument("--root", required=True, help="storage: ROOT/ours")
    p.add_argument("--out", required=True, help="where each rank writes rank-<R>.json")
    p.add_argument("--dump", required=True, help="the trainer's job.dump_folder")
    p.add_argument("--steps", type=int, required=True, help="the run's training.steps (train: the window's end)")
    p.add_argument("--crash-at", type=int, help="crash: the last step finished before the step the crash falls in")
    p.add_argument("--crash-frac", type=float, default=0.5,
                   help="crash: how far into step C+1 (a fraction of a step's time) every rank dies")
    p.add_argument("--warmup", type=int, default=3, help="train: steps before the timed window")
    p.add_argument("--interval", type=int, default=1000, help="storage checkpoint interval")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--trainer-args", default="", help="more trainer options, appended (later ones win)")
    return p.parse_args(argv)


def write(args: argparse.Namespace, record: dict) -> None:
    rank = int(os.environ.get("RANK", "0"))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "started": STARTED, **record}))


def cpu_seconds() -> dict:
    """This process's CPU seconds so far: all threads (exited ones included), the training (main)
    thread's, and gloo's threads' (by their names in /proc: ``gloo_*``, ``pt_gloo_*``); the rest is the
    checkpoint's threads (writer, partner copy, hashing) and Python's few others."""
    gloo = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # a thread that has just exited: counted in the process's total
            continue
        name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if name.startswith(("gloo", "pt_gloo")):
            gloo += int(fields[11]) + int(fields[12])  # utime + stime, in clock ticks
    return {"process": time.process_time(), "main": time.thread_time(), "gloo": gloo / os.sysconf("SC_CLK_TCK")}


def started_saves(manager) -> list[int]:
    """The steps whose ``manager.save`` started a save, from now on (the method wrapped on this instance)."""
    started, save = [], manager.save

    def counted(step, state, **kwargs):
        begun = save(step, state, **kwargs)
        if begun:
            started.append(step)
        return begun

    manager.save = counted
    return started


def crash(args: argparse.Namespace, trainer) -> None:
    """Train to step C, then die ``--crash-frac`` of a step into step C+1 (see the module docstring)."""
    import torch
    import torch.distributed as dist

    started = started_saves(trainer.checkpoints.manager)
    timed = min(3, args.crash_at - 1)
    trainer.fit(stop_at=args.crash_at - timed)
    t0 = time.perf_counter()
    trainer.fit(stop_at=args.crash_at)
    delay = torch.tensor([args.crash_frac * (time.perf_counter() - t0) / timed], dtype=torch.float64)
    dist.broadcast(delay, src=0)

    def die() -> None:
        write(args, {"finished": len(trainer.losses), "started": started, "delay_s": delay.item(),
                     "memory_committed": trainer.checkpoints.manager.stats.memory_saves})
        sys.stdout.flush()
        os._exit(1)  # a dead worker: nothing closed, nothing waited for

    threading.Timer(delay.item(), die).start()
    try:
        trainer.fit(stop_at=args.crash_at + 1)
    except BaseException:  # a peer died first: this rank dies by its own timer all the same
        pass
    threading.Event().wait()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from trainer.config import load_config
    from trainer.train import Trainer

    # training.steps one past the end: no forced save of the last step in any variant
    trainer = Trainer(load_config(trainer_argv(args, checkpoint=True, steps=args.steps + 1, interval=args.interval)))
    if args.mode == "crash":
        crash(args, trainer)
    try:
        if args.mode == "restart":
            resumed = trainer.checkpoints.resumed_step
            losses = trainer.fit(stop_at=(resumed or 0) + 1)
            write(args, {"resumed": resumed, "loss": losses[0],
                         "bytes_read": trainer.checkpoints.manager.load_stats.bytes_read})
        else:
            trainer.fit(stop_at=args.warmup)
            dist.barrier()
            t0, cpu0 = time.perf_counter(), cpu_seconds()
            trainer.fit(stop_at=args.steps)
            trainer.checkpoints.manager.wait()
            cpu = {k: v - cpu0[k] for k, v in cpu_seconds().items()}  # before the barrier: its wait is not the window's
            dist.barrier()
            seconds = time.perf_counter() - t0
            stats = trainer.checkpoints.manager.stats
            write(args, {"seconds": seconds, "tokens_per_s": (args.steps - args.warmup) * BATCH * SEQ / seconds,
                         "saves": stats.saves, "memory_saves": stats.memory_saves, "stall_s": stats.stall_s,
                         "memory_failures": stats.memory_failures, "memory_skipped": stats.memory_skipped,
                         "cpu_s": cpu})
    finally:
        trainer.close()  # a clean finish: the run's memory steps go
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as resume_rank.py: no interpreter finalization (torch 2.13's teardown may abort)


if __name__ == "__main__":
    sys.exit(main())
