#!/usr/bin/env python
"""Mixture of experts (issue 26): trainer tokens/s of EP 2 against EP 1 on 2 CPU ranks, and a MoE
checkpoint's delta ratio beside the dense model's.

    python benchmarks/bench_moe.py --out benchmarks/RESULTS.md     # ~4 min on 2 cores
    python benchmarks/bench_moe.py --quick                         # ~2 min, a smoke run
    python benchmarks/bench_moe.py --tiny                          # the tests' run: 5 steps, a delta at step 4

Throughput: 2 gloo CPU ranks (``tests/support/launch.py``'s ``run_ranks``), in the same processes
the ``moe_debug`` trainer with ``--parallelism.ep 1`` (FSDP2 shards the experts like everything
else) and ``--parallelism.ep 2`` (4 experts a rank, tokens all-to-all), once per repeat in an
order rotated per repeat; tokens/s from rank 0's ``metrics.jsonl`` over the steps after the warmup.
The ratio EP 2 / EP 1 is paired per repeat. On a CPU box the all-to-all is a gloo copy and the
experts' matmuls are tiny: what it shows is EP's overhead (or gain) on the same ranks, not a GPU's.

Delta: one process each for ``debug`` and ``moe_debug``, 20 steps, a checkpoint every 10 with
``checkpoint.full_every 2``: step 10 full, step 20 a delta against it; the ratio is the delta's
bytes over the full's (smaller is better). Experts few tokens reached change little, so the MoE's
ratio is expected at or below the dense one's.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from harness import REPO, Load, argument_parser, machine_description, median, rotated, work_dir  # noqa: F401

from report import goal, median_span, metric, provenance, publish, write_json  # noqa: E402
from tests.support.launch import run_ranks  # noqa: E402

SECTION = "## Mixture of experts: EP 2 vs EP 1 tokens/s, MoE delta ratio (issue 26)"
LOG_FREQ = 5


def _argv(dump: Path, steps: int, *flags: str) -> list[str]:
    return ["--config", str(REPO / "configs" / "debug.toml"), "--training.steps", str(steps),
            "--training.device", "cpu", "--metrics.log_freq", str(LOG_FREQ), "--job.dump_folder", str(dump),
            "--training.seq_len", "128", "--training.batch_size", "8", *flags]


def _tps(dump: Path, warmup: int, step_tokens: int) -> float:
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if r.get("step", 0) > warmup and "tokens_per_sec" in r]
    prev = [warmup] + [r["step"] for r in timed[:-1]]
    tokens = [(r["step"] - p) * step_tokens for r, p in zip(timed, prev)]
    return sum(tokens) / sum(n / r["tokens_per_sec"] for n, r in zip(tokens, timed))


def _ranks(rank: int, world: int, root: str, repeats: int, warmup: int, window: int) -> dict:
    import torch

    from trainer.config import load_config
    from trainer.train import Trainer

    torch.set_num_threads(1)
    out: dict[str, list[float]] = {"ep1": [], "ep2": []}
    for rep in range(repeats):
        for ep in rotated(["1", "2"], rep):
            dump = Path(root) / f"ep{ep}-{rep}"
            trainer = Trainer(load_config(_argv(dump, warmup + window, "--model.flavor", "moe_debug",
                                                "--checkpoint.enable", "false", "--parallelism.ep", ep)))
            try:
                trainer.fit()
            finally:
                trainer.close()
            if rank == 0:
                out[f"ep{ep}"].append(_tps(dump, warmup, 8 * 128))
    return out


def _delta_ratio(root: Path, flavor: str, every: int = 10) -> float:
    from trainer.config import load_config
    from trainer.train import Trainer

    dump = root / f"delta-{flavor}"
    trainer = Trainer(load_config(_argv(dump, 2 * every, "--model.flavor", flavor, "--checkpoint.enable", "true",
                                        "--checkpoint.interval", str(every), "--checkpoint.full_every", "2")))
    try:
        trainer.fit()
    finally:
        trainer.close()

    def size(step: int) -> int:
        return sum(p.stat().st_size for p in (dump / "checkpoints" / f"step-{step:08d}").rglob("*") if p.is_file())

    return size(2 * every) / size(every)


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="the tests' smoke run: 5 steps, a delta at step 4")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    repeats, warmup, window = (1, 0, LOG_FREQ) if args.tiny else (1, 5, 10) if args.quick else (args.repeats, 5, 20)
    every = 2 if args.tiny else 10  # the delta: step 2 x every against the full step every
    load = Load(processes=True)
    with work_dir(args.dir, "moe") as root:
        t0 = time.monotonic()
        tps = run_ranks(2, _ranks, str(root), repeats, warmup, window)[0]
        ratios = [b / a for a, b in zip(tps["ep1"], tps["ep2"])]
        dense, moe = _delta_ratio(root, "debug", every), _delta_ratio(root, "moe_debug", every)
        elapsed = time.monotonic() - t0
    load.stop()
    command = "python benchmarks/bench_moe.py" + (" --tiny" if args.tiny else " --quick" if args.quick
                                                  else f" --repeats {repeats}")
    lines = [SECTION, "",
             f"moe_debug (8 experts, top 2, ~1.8M parameters), 2 gloo CPU ranks, 1 thread each, seq 128, global batch "
             f"8, {warmup} warmup + {window} timed steps, {repeats} repeat(s) rotated; {elapsed:.0f} s in all.", "",
             "| run | tokens/s (median, min-max) |", "|---|---|",
             f"| EP 1 (experts FSDP-sharded) | {median_span(tps['ep1'], 0)} |",
             f"| EP 2 (4 experts a rank, all-to-all) | {median_span(tps['ep2'], 0)} |",
             f"| **EP 2 / EP 1** | **{median_span(ratios)}x** |", "",
             f"Delta checkpoint (step {2 * every} against the full step {every}, full_every 2), bytes over the full's:", "",
             "| model | delta / full |", "|---|---|",
             f"| debug (dense) | {dense:.3f} |", f"| moe_debug | {moe:.3f} |",
             f"| **MoE / dense** | **{moe / dense:.3f}** |", "",
             "The box was shared with other agents' jobs (2 cores): the ratios, paired within one run, are what "
             "to read, not the absolute rates.", "",
             *provenance(machine_description(), command, load.describe())]
    section = "\n".join(lines)
    publish(section, args.out)
    write_json(args.json, "moe", section, command,
               metrics=[metric("EP 1", "tokens_per_s", "tok/s", tps["ep1"]),
                        metric("EP 2", "tokens_per_s", "tok/s", tps["ep2"]),
                        metric("EP 2 / EP 1", "ratio", "x", ratios)],
               goals=[goal("MoE delta ratio no larger than the dense one's", moe / dense, 1.0, "<=",
                           f"moe_debug {moe:.3f}, debug {dense:.3f}")],
               params={"repeats": repeats, "warmup": warmup, "window": window})
    return 0


if __name__ == "__main__":
    sys.exit(main())
