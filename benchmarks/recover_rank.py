"""One rank of ``bench_recover.py``'s training jobs (lost work, tokens/s), started by torchrun as a
rank of one of two nodes (``recover_jobs.two_nodes``).

    torchrun ... benchmarks/recover_rank.py --mode crash --crash-at C ...   # train, die right after step C
    torchrun ... benchmarks/recover_rank.py --mode restart ...              # resume, take one step
    torchrun ... benchmarks/recover_rank.py --mode train --steps S ...      # tokens/s and stall of S steps

The trainer is ``resume_rank.trainer_argv``'s (the debug config, this job's model size, layout and
folders) with ``--trainer-args`` appended (the memory tier, its interval, the saving mode).

crash    ``Trainer.fit(stop_at=C)``, then ``os._exit(1)`` on every rank: no close, no wait, the writer
         thread killed wherever it is, as when a worker dies and torchrun tears down the job; the
         memory folders and storage stay as the run left them. The job exits non-zero.
restart  the trainer's own resume (memory tier first, then storage); records the step it resumed
         at and the bytes its load read from storage (0: from the memory tier), then takes one step.
train    ``fit`` to step ``--warmup``, then the timed window to ``--steps`` (the saves drained by
         ``manager.wait()`` inside it, so the writer's work is counted); records tokens/s of the window
         (global batch × sequence length per step) and the manager's counters: storage saves, memory
         saves and the stall (``SaveStats.stall_s``: host + device time training was blocked).

Each rank writes ``<out>/rank-<R>.json`` (``--mode crash``: before it dies).
"""

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
    p.add_argument("--crash-at", type=int, help="crash: the last step finished before the crash")
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
        trainer.fit(stop_at=args.crash_at)
        write(args, {"crashed_after": trainer.train_state.step})
        sys.stdout.flush()
        os._exit(1)  # a dead worker: nothing closed, nothing waited for
    try:
        if args.mode == "restart":
            resumed = trainer.checkpoints.resumed_step
            losses = trainer.fit(stop_at=(resumed or 0) + 1)
            write(args, {"resumed": resumed, "loss": losses[0],
                         "bytes_read": trainer.checkpoints.manager.load_stats.bytes_read})
        else:
            trainer.fit(stop_at=args.warmup)
            dist.barrier()
            t0 = time.perf_counter()
            trainer.fit(stop_at=args.steps)
            trainer.checkpoints.manager.wait()
            dist.barrier()
            seconds = time.perf_counter() - t0
            stats = trainer.checkpoints.manager.stats
            write(args, {"seconds": seconds, "tokens_per_s": (args.steps - args.warmup) * BATCH * SEQ / seconds,
                         "saves": stats.saves, "memory_saves": stats.memory_saves, "stall_s": stats.stall_s,
                         "memory_failures": stats.memory_failures, "memory_skipped": stats.memory_skipped})
    finally:
        trainer.close()  # a clean finish: the run's memory steps go
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as resume_rank.py: no interpreter finalization (torch 2.13's teardown may abort)


if __name__ == "__main__":
    sys.exit(main())
