#!/usr/bin/env python
"""Trainer tokens/s per parallel layout on 2 and 4 CPU ranks, against a minimal FSDP2 loop (issue 13).

    python benchmarks/bench_layouts.py --out benchmarks/RESULTS.md     # ~6-8 min on 2 cores
    python benchmarks/bench_layouts.py --quick                         # < 2 min, a smoke run
    python benchmarks/bench_layouts.py --tiny                          # the tests' run: 2-rank rows, 5 + 5 steps

For each world size (2, then 4) the script starts that many CPU ranks with ``tests/support/launch.py``'s
``run_ranks`` (forked from a fork server that imported torch and the trainer once, gloo on loopback;
``OMP_NUM_THREADS=1`` and ``torch.set_num_threads(1)`` in every rank, so 4 ranks oversubscribe the
2-vCPU box 2x) and runs, in those same processes (``layout_runs.py``), every variant of that world
size once per repeat, in an order rotated per repeat (slow drifts of the shared machine hit all
alike; process start-up is paid once):

trainer rows   ``Trainer(load_config(argv))``, ``fit()``, ``close()`` on every rank, with
               ``--config configs/debug.toml --training.steps W+N --training.device cpu
               --metrics.log_freq 5 --checkpoint.enable false --job.dump_folder <tmp>`` plus the
               layout's ``--parallelism.*`` flags: what ``torchrun --nproc_per_node N -m
               trainer.train`` runs, minus the process start. tokens/s is read back from rank 0's
               ``<dump_folder>/metrics.jsonl`` (``tokens_per_sec``, global tokens over each
               5-step logging window), skipping the records of the ``--warmup`` steps: the rate
               over the remaining steps is their tokens over the sum of their windows' seconds.
minimal loop   the debug llama (``trainer.model.build``, same args and seed), FSDP2 by hand over all
               N ranks (``fully_shard`` per block, then the root without resharding, as the
               trainer's zero_stage 3), AdamW with the trainer's hyper-parameters and LR schedule,
               the trainer's data loader, and per step: forward, ``cross_entropy``, ``backward``,
               ``clip_grad_norm_``, ``step``, ``scheduler.step``, ``zero_grad``. No checkpointing,
               no metrics, no per-step loss collective. Timed on rank 0 over the same steps.
ckpt row       the FSDP 2 trainer with ``--checkpoint.enable true --checkpoint.interval 10``
               (async double_buffer, local disk): its tokens/s against the FSDP 2 trainer's, and the
               stall per save, twice: the manager's ``stats.stall_s`` over the timed steps
               (``save()`` + the snapshot wait before the next optimizer step) and
               ``ckpt_stall_ms`` of metrics.jsonl (what the trainer logs: only ``save()``).
reference      the minimal loop unwrapped in one process (rank 0, whole batch) while the other
               rank waits in a barrier: is sharding over 2 ranks faster than 1 process at all?

"x minimal" is trainer / minimal loop on the same number of ranks, paired per repeat: for FSDP 2
that is what the trainer's layer costs; for the other layouts it is that plus what the layout
itself costs against plain FSDP over the same ranks on this box. Losses are checked too: every
trainer run's per-step losses against the minimal loop's (rank-averaged) of the same repeat; all
layouts train the same model on the same data, so they agree to float reassociation.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from harness import REPO, Load, argument_parser, git_state, machine_description, median, work_dir  # first: sys.path

from layout_runs import BASE_CONFIG, CKPT_INTERVAL, LOG_FREQ, run_plan  # noqa: E402
from report import command_line, goal, median_span, metric, provenance, publish, table_head, write_json  # noqa: E402
from tests.support.launch import run_ranks  # noqa: E402
from trainer import data as data_mod  # noqa: E402
from trainer import model as model_mod  # noqa: E402
from trainer.config import load_config  # noqa: E402

SECTION = "## Trainer layouts (issue 13)"
RANKS_HANG_SECONDS = 3 * 3600  # a guard against hung ranks, far above a full run's half hour

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)


@dataclass
class Variant:
    key: str
    name: str
    ranks: int
    flags: list[str] | None  # trainer overrides; None: a minimal loop (key "single": one process, unwrapped)
    tps: list[float] = field(default_factory=list)  # tokens/s per repeat
    stall_ms: list[float] = field(default_factory=list)  # per save, ckpt row: metrics.jsonl's ckpt_stall_ms
    manager_stall_ms: list[float] = field(default_factory=list)  # per save: manager.stats.stall_s
    setup_s: list[float] = field(default_factory=list)  # Trainer() / model build + shard
    loss_diff: list[float] = field(default_factory=list)  # max |loss - minimal's| per repeat
    idle_cpu_s: list[float] = field(default_factory=list)  # "single": CPU of the ranks waiting meanwhile


def baseline(variants: list[Variant]) -> Variant:
    """The minimal FSDP2 loop over all ranks of the group."""
    return next(v for v in variants if v.key.startswith("minimal"))


CKPT = ["--checkpoint.enable", "true", "--checkpoint.interval", str(CKPT_INTERVAL),
        "--checkpoint.async_mode", "double_buffer"]


def variants_for(ranks: int, pp_microbatches: int) -> list[Variant]:
    pp_mb = ["--parallelism.pp_microbatches", str(pp_microbatches)]
    if ranks == 2:
        rows = [
            ("minimal2", "minimal loop, FSDP2 (2 ranks)", None),
            ("single", "minimal loop, 1 process, no wrapper (reference)", None),
            ("fsdp2", "FSDP 2", []),
            ("fsdp2_ckpt", f"FSDP 2 + async ckpt every {CKPT_INTERVAL}", CKPT),
            ("tp2", "TP 2", ["--parallelism.tp", "2"]),
            ("pp2_1f1b", "PP 2, 1f1b", ["--parallelism.pp", "2", "--parallelism.pp_schedule", "1f1b", *pp_mb]),
            ("pp2_gpipe", "PP 2, gpipe", ["--parallelism.pp", "2", "--parallelism.pp_schedule", "gpipe", *pp_mb]),
        ]
    else:
        rows = [
            ("minimal4", "minimal loop, FSDP2 (4 ranks)", None),
            ("fsdp4", "FSDP 4 (reference)", []),
            ("fsdp2xtp2", "FSDP 2 × TP 2", ["--parallelism.dp_shard", "2", "--parallelism.tp", "2"]),
            ("hsdp2x2", "HSDP 2×2", ["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2"]),
            ("pp2xfsdp2", "PP 2 × FSDP 2, 1f1b",
             ["--parallelism.pp", "2", "--parallelism.dp_shard", "2", "--parallelism.pp_schedule", "1f1b"]),
        ]
    return [Variant(key, name, ranks, flags) for key, name, flags in rows]


def run_group(ranks: int, variants: list[Variant], args, work: Path) -> float:
    """All variants of one world size in one set of ranks (``run_ranks``); returns the wall seconds."""
    plan = {"work": str(work), "repeats": args.repeats, "steps": args.warmup + args.window,
            "warmup": args.warmup, "warmup_round": not args.no_warmup,
            "variants": [(v.key, v.name, v.flags) for v in variants]}
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the fork server and the ranks before they import torch
    start = time.perf_counter()
    results = run_ranks(ranks, run_plan, plan, hang_seconds=RANKS_HANG_SECONDS)[0]
    elapsed = time.perf_counter() - start
    minimal = baseline(variants)
    for v in variants:
        for r, m in zip(results[v.key], results[minimal.key]):
            v.tps.append(r["tps"])
            v.setup_s.append(r["setup_s"])
            if r.get("stall_ms_per_save") is not None:
                v.stall_ms.append(r["stall_ms_per_save"])
                v.manager_stall_ms.append(r["manager_stall_ms_per_save"])
            if "idle_rank_cpu_s" in r:
                v.idle_cpu_s.append(r["idle_rank_cpu_s"])
            v.loss_diff.append(max(abs(a - b) for a, b in zip(r["losses"], m["losses"], strict=True)))
    return elapsed


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------
def paired(a: list[float], b: list[float]) -> list[float]:
    return [x / y for x, y in zip(a, b)]


def report(groups: list[tuple[int, list[Variant], float, Load]], args, info: dict, command: str) -> str:
    cfg = load_config(["--config", str(REPO / BASE_CONFIG)])
    t = cfg.training
    params = info["params"]
    lines = [
        SECTION,
        "",
        f"The `debug` llama ({params / 1e6:.2f}M parameters), global batch {t.batch_size} × seq_len {t.seq_len} = "
        f"{t.batch_size * t.seq_len} tokens/step, fp32, on N CPU ranks (gloo on loopback) started by "
        f"the tests' `run_ranks` (forked from a fork server); **one intra-op thread per rank** "
        f"(`OMP_NUM_THREADS=1`, `torch.set_num_threads(1)`), so the 4-rank rows run 4 processes on 2 vCPUs "
        f"(oversubscribed 2×) and the 2-rank rows one per vCPU. Trainer rows: `Trainer(load_config(argv))` + "
        f"`fit()` + `close()` in the ranks with `--config {BASE_CONFIG} --training.steps {args.warmup + args.window} "
        f"--training.device cpu --metrics.log_freq {LOG_FREQ} --checkpoint.enable false --job.dump_folder <tmp>` "
        f"plus the row's flags, i.e. `torchrun --standalone --nproc_per_node N -m trainer.train` with those "
        f"arguments minus the process start; tokens/s = the rate over steps {args.warmup + 1}-"
        f"{args.warmup + args.window} from rank 0's `metrics.jsonl` (`tokens_per_sec` of each {LOG_FREQ}-step "
        f"record; the first {args.warmup} steps are skipped). Minimal loop: the same model and seed, FSDP2 by hand "
        f"over all N ranks (`fully_shard` per block + root, as zero_stage 3), AdamW with the trainer's "
        f"hyper-parameters and LR schedule, the trainer's data loader; forward, `cross_entropy`, `backward`, "
        f"`clip_grad_norm_`, `step`, `zero_grad`; no checkpointing, no metrics, no per-step loss all-reduce; timed "
        f"on rank 0 over the same steps. Per world size all rows run in the same processes, one after "
        f"another, the order rotated per repeat; median (min–max) over {args.repeats} repeat(s)"
        + (", after an untimed warm-up run (3 steps) of every row." if not args.no_warmup else "."),
        "",
        *table_head(["Ranks", "Layout", "Trainer flags (besides the common ones)", "tokens/s median (min–max)",
                     "ms/step", "× minimal, same ranks (paired per repeat: median, min–max)",
                     "× trainer FSDP, same ranks (paired)", "set-up s", "max \\|Δ loss\\| vs minimal"], "rll" + "r" * 6),
    ]
    step_tokens = t.batch_size * t.seq_len
    notes = []
    by = {}
    for ranks, variants, _elapsed, _load in groups:
        minimal = baseline(variants)
        fsdp = next((v for v in variants if v.flags == []), None)  # the trainer's FSDP over all ranks
        for v in variants:
            by[v.key] = v
            if v.key == "single":
                flags = "– (rank 0 alone, whole batch; the other rank waits)"
            elif v.flags is None:
                flags = "–"
            else:
                flags = f"`{' '.join(v.flags)}`" if v.flags else "(none: FSDP over all ranks)"
            vs_min = "1.000" if v is minimal else median_span(paired(v.tps, minimal.tps), 3)
            vs_fsdp = "–" if fsdp is None or v.flags is None else (
                "1.000" if v is fsdp else median_span(paired(v.tps, fsdp.tps), 3))
            lines.append(
                f"| {ranks} | {v.name} | {flags} | {median_span(v.tps, 0)} | {1e3 * step_tokens / median(v.tps):.1f} "
                f"| {vs_min} | {vs_fsdp} | {median(v.setup_s):.2f} "
                f"| {'–' if v is minimal else f'{max(v.loss_diff):.1g}'} |")
    lines.append("")
    if "fsdp2" in by and "minimal2" in by:
        r = paired(by["fsdp2"].tps, by["minimal2"].tps)
        notes.append(f"- The trainer's own layer (FSDP 2 against the minimal FSDP2 loop on the same 2 ranks): "
                     f"{median(r):.3f}× tokens/s ({(1 / median(r) - 1):+.1%} time per step; per repeat "
                     f"{', '.join(f'{x:.3f}' for x in r)}).")
    if "fsdp2_ckpt" in by and "fsdp2" in by:
        ck, base = by["fsdp2_ckpt"], by["fsdp2"]
        r = paired(ck.tps, base.tps)
        notes.append(f"- Checkpointing every {CKPT_INTERVAL} steps (FSDP 2, async double_buffer, local disk): "
                     f"{median(r):.3f}× the tokens/s without (paired per repeat: {', '.join(f'{x:.3f}' for x in r)}); "
                     f"stall per save {median_span(ck.manager_stall_ms, 1)} ms by the manager's count "
                     f"(`stats.stall_s`: inside `save()` + the snapshot wait in the optimizer pre-hook), "
                     f"{median_span(ck.stall_ms, 1)} ms by metrics.jsonl's `ckpt_stall_ms` (the trainer adds up "
                     f"only the `save()` calls: the pre-hook wait happens inside the next `train_step`, outside "
                     f"its bracket), against {1e3 * step_tokens / median(base.tps):.0f} ms per step.")
    if "single" in by and "minimal2" in by:
        r = paired(by["minimal2"].tps, by["single"].tps)
        notes.append(f"- Two ranks against one process: the minimal FSDP2 loop on 2 ranks runs at {median(r):.3f}× "
                     f"the tokens/s of the unwrapped model in one process on one thread (paired per repeat: "
                     f"{', '.join(f'{x:.3f}' for x in r)}). Meanwhile the waiting rank used "
                     f"{median(by['single'].idle_cpu_s):.2f} s CPU (median) in the gloo barrier, i.e. it left its "
                     f"core free.")
    if "fsdp2xtp2" in by:
        notes.append("- During FSDP 2 × TP 2 torch warns (once per rank) that redistributing a DTensor from "
                     "`(_NormPartial(2.0), _NormPartial(2.0))` to `(Replicate(), Replicate())` runs 2 sequential "
                     "all_reduces and suggests flattening the `dp_shard`, `tp` mesh dimensions: the gradient norm "
                     "of `clip_grad_norm_` over the 2-D mesh, one extra collective per step.")
    for ranks, variants, elapsed, load in groups:
        notes.append(f"- {ranks} ranks: {elapsed / 60:.1f} min (start to exit); other load during it: "
                     f"{load.describe()}.")
    lines += ["Notes:", *notes, ""]
    lines += provenance(info["machine"], command, load=info["load"], extra=[f"Code: {info['git']}"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], choices=[2, 4])
    parser.add_argument("--repeats", type=int, default=5, help="repeats per row (default 5; --quick 1)")
    parser.add_argument("--warmup", type=int, default=5,
                        help=f"steps skipped per run (a multiple of the log_freq {LOG_FREQ}; default 5)")
    parser.add_argument("--window", type=int, default=15,
                        help=f"timed steps per run (a multiple of {LOG_FREQ}; default 15: saves at steps 10 and 20 "
                             "in the checkpointing row)")
    parser.add_argument("--pp-microbatches", type=int, default=4,
                        help="parallelism.pp_microbatches of the 2-rank PP rows (default 4)")
    parser.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up run of every row")
    parser.add_argument("--quick", action="store_true", help="1 repeat, a 10-step window, no warm-up round")
    parser.add_argument("--tiny", action="store_true",
                        help="the tests' smoke run: the 2-rank rows, 1 repeat, 5 + 5 steps (the ckpt row saves at 10)")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.window, args.no_warmup = 1, 10, True
    if args.tiny:
        args.ranks, args.repeats, args.warmup, args.window, args.no_warmup = [2], 1, LOG_FREQ, LOG_FREQ, True
    for n in (args.warmup, args.window):
        if n < LOG_FREQ or n % LOG_FREQ:
            parser.error(f"--warmup and --window must be positive multiples of {LOG_FREQ}")
    os.chdir(REPO)
    command = command_line("bench_layouts.py", argv)
    groups = []
    whole = Load(processes=True)
    with work_dir(args.dir, "layouts-") as work:
        for ranks in args.ranks:
            variants = variants_for(ranks, args.pp_microbatches)
            load = Load()
            elapsed = run_group(ranks, variants, args, work)
            groups.append((ranks, variants, elapsed, load.stop()))
    whole.stop()
    args_ = model_mod.model_args("debug", vocab_size=data_mod.ByteTokenizer.vocab_size)
    with torch.device("meta"):
        params = model_mod.num_params(model_mod.Transformer(args_))
    info = {
        "params": params,
        "machine": machine_description(work, cpu_extra="; 1 intra-op thread per rank (OMP_NUM_THREADS=1)"),
        "load": whole.describe("during the run", note=" (this benchmark itself keeps 2-4 processes busy)")
                + f"; the run took {whole.elapsed / 60:.1f} min",
        "git": git_state(),
    }
    section = report(groups, args, info, command)
    publish(section, args.out)
    write_json(args.json, "layouts", section, command, metrics=layout_metrics(groups),
               goals=layout_goals(groups), params={"ranks": args.ranks, "repeats": args.repeats})
    return 0


def layout_metrics(groups) -> list[dict]:
    """tokens/s per row (one value per repeat), with the world size as ``ranks``."""
    return [metric(v.name, "tokens_per_s", "tokens/s", v.tps, ranks=ranks)
            for ranks, variants, _elapsed, _load in groups for v in variants if v.tps]


def layout_goals(groups) -> list[dict]:
    """The checkpointing row against the same layout without saves (issue 4's ≥ 0.98× tokens/s)."""
    by = {v.key: v for _ranks, variants, _e, _l in groups for v in variants}
    if "fsdp2_ckpt" not in by or "fsdp2" not in by:
        return []
    r = paired(by["fsdp2_ckpt"].tps, by["fsdp2"].tps)
    return [goal(f"FSDP 2 tokens/s with a save every {CKPT_INTERVAL} steps ≥ 0.98× without", median(r), 0.98, ">=",
                 f"paired per repeat, min–max {min(r):.3f}–{max(r):.3f}")]


if __name__ == "__main__":
    sys.exit(main())
