#!/usr/bin/env python
"""Context parallel throughput: CP 2 on 2 CPU ranks against the same sequences on one rank (issue 26).

    python benchmarks/bench_cp.py --quick                 # 1 repeat, short window (~1 min)
    python benchmarks/bench_cp.py --tiny                  # the tests' run: 1 + 1 steps of 64 tokens
    python benchmarks/bench_cp.py --repeats 3             # the published figures (~4 min)

Both rows are the trainer (``Trainer(load_config(argv))``, ``configs/debug.toml``, fp32, no
checkpointing) on the same global batch of ``--batch`` sequences of ``--seq-len`` tokens:

one rank     one process (the trainer's own 1-rank group, the model unwrapped), 1 intra-op thread.
CP 2         2 spawned gloo ranks (``tests/support/launch.py`` ``run_ranks``), 1 intra-op thread
             each, ``--parallelism.cp 2``: each rank holds half of every sequence (head/tail
             chunks), all-gathers the keys/values per layer, FSDP2 over the 2 ranks.

Repeats alternate the two rows (order rotated per repeat). A run is ``--window`` warm-up steps,
then ``--window`` timed steps: tokens/s is the trainer's own ``tokens_per_sec`` of the timed
window (its metrics.jsonl record at the last step; global tokens, so the CP row counts each
sequence once). The ratio CP 2 / one rank is paired per repeat. CP 2 has twice the cores, and at
this length (the debug model is narrow, so attention dominates) less attention work in all: one
rank's causal SDPA covers about S²/2 query-key pairs, each CP rank's two chunks attend to
(2C + 1)·L² = 5S²/16 (L = S/2C), 5/8 of S²/2 over both ranks together; against that stand the
all-gather / reduce-scatter and FSDP2's traffic over loopback and the fixed costs that do not shrink
(embedding, output, optimizer). On a shared box the spread between repeats is large.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from harness import REPO, Load, argument_parser, git_state, machine_description, median, rotated  # first: sys.path

from report import command_line, goal, median_span, metric, provenance, publish, table_head, write_json  # noqa: E402
from tests.support.launch import run_ranks  # noqa: E402

SECTION = "## Context parallel (issue 26)"


def trainer_argv(dump: str, args, cp: int) -> list[str]:
    return ["--config", str(REPO / "configs" / "debug.toml"), "--job.dump_folder", dump,
            "--training.steps", str(2 * args.window), "--training.seq_len", str(args.seq_len),
            "--training.batch_size", str(args.batch), "--training.device", "cpu",
            "--metrics.log_freq", str(args.window), "--checkpoint.enable", "false", "--parallelism.cp", str(cp)]


def run(rank: int, world: int, dump: str, argv: list[str]) -> float | None:
    """One trainer run (on every rank); rank 0 returns the timed window's tokens/s."""
    from trainer.config import load_config
    from trainer.train import Trainer

    torch.set_num_threads(1)
    trainer = Trainer(load_config(argv))
    try:
        trainer.fit()
    finally:
        trainer.close()
    if rank:
        return None
    records = [json.loads(line) for line in (Path(dump) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "tokens_per_sec" in r][-1]["tokens_per_sec"]  # the last step's, not an event's


def measure(args, work: Path) -> dict[str, list[float]]:
    rows = {"one rank": [], "CP 2": []}
    for rep in range(args.repeats):
        for name in rotated(list(rows), rep):
            dump = str(work / f"{name.replace(' ', '_')}-{rep}")
            if name == "one rank":
                rows[name].append(run(0, 1, dump, trainer_argv(dump, args, 1)))
            else:
                rows[name].append(run_ranks(2, run, dump, trainer_argv(dump, args, 2))[0])
            print(f"[{rep + 1}/{args.repeats}] {name:9s} {rows[name][-1]:8.0f} tokens/s  load {os.getloadavg()[0]:.1f}",
                  flush=True)
    return rows


def report(rows: dict[str, list[float]], ratios: list[float], args, info: dict, command: str) -> str:
    one = median(rows["one rank"])
    lines = [SECTION, "",
             f"The `debug` llama, fp32, global batch {args.batch} × seq_len {args.seq_len} = "
             f"{args.batch * args.seq_len} tokens per step (one data-parallel rank in both rows); "
             f"{args.window} warm-up then {args.window} timed steps per run, {args.repeats} repeat(s), rows "
             "alternated; median (min–max) over repeats. 1 intra-op thread per rank.", "",
             *table_head(["row", "ranks", "tokens/s", "× one rank"], "lrrr")]
    lines.append(f"| one rank | 1 | {median_span(rows['one rank'], 0)} | 1.00 |")
    lines.append(f"| CP 2 (all-gather K/V, FSDP2 over cp) | 2 | {median_span(rows['CP 2'], 0)} | "
                 f"{median_span(ratios, 2)} |")
    lines += ["", f"CP 2 / one rank, paired per repeat: {median(ratios):.2f}× (one rank: {one:,.0f} tokens/s). "
              "The CP row uses twice the cores and, split head/tail, 5/8 of the one-rank row's causal attention "
              "work in all (see the script's docstring), so more than 2× is possible; the box was loaded "
              "(see the load below), so the ratio is what this box gave.", ""]
    lines += provenance(info["machine"], command, info["load"], [f"Code: {info['git']}"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--window", type=int, default=6, help="warm-up steps, and timed steps (default 6)")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="1 repeat, a 3-step window")
    parser.add_argument("--tiny", action="store_true", help="the tests' smoke run: 1 repeat, 1 + 1 steps of 64 tokens")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.window = 1, 3
    if args.tiny:
        args.repeats, args.window, args.seq_len = 1, 1, 64
    os.chdir(REPO)
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned ranks
    command = command_line("bench_cp.py", argv)
    load = Load(processes=True)
    with tempfile.TemporaryDirectory(prefix="bench-cp-") as work:
        rows = measure(args, Path(work))
    load.stop()
    ratios = [c / o for c, o in zip(rows["CP 2"], rows["one rank"])]
    info = {"machine": machine_description(cpu_extra="; 1 intra-op thread per rank (OMP_NUM_THREADS=1)"),
            "load": load.describe("during the run", note=" (this benchmark itself keeps 1-2 processes busy)"),
            "git": git_state()}
    section = report(rows, ratios, args, info, command)
    publish(section, args.out)
    write_json(args.json, "cp", section, command,
               metrics=[metric(name, "tokens_per_s", "tokens/s", values) for name, values in rows.items()],
               goals=[goal("CP 2 tokens/s on 2 ranks > one rank's on the same sequences", median(ratios), 1.0, ">=",
                           f"paired per repeat, min–max {min(ratios):.2f}–{max(ratios):.2f}")],
               params={"repeats": args.repeats, "seq_len": args.seq_len, "batch": args.batch})
    return 0


if __name__ == "__main__":
    sys.exit(main())
