#!/usr/bin/env python
"""Time to first step after resume: from the launcher's clock to the first optimizer step of a resumed run (issue 27).

    python benchmarks/bench_resume.py --quick          # 2 → 2, ~40 MB of state, 1 repeat (~1-2 min loaded)
    python benchmarks/bench_resume.py --repeats 2      # run.py's full run: four layouts, ~145 MB, 2 repeats

A trained state of the trainer (the debug llama widened to ``--dim`` and ``--layers``, fp32 weights
and AdamW moments) is saved once per saved layout (``resume_rank.py --mode save``: ours commits the
last step, the same state goes through ``dcp.save`` and torchtitan's ``CheckpointManager.save``). Then
every resume is a fresh job, exactly as after a failure: the benchmark takes ``time.time()``, starts
``python -m torch.distributed.run --standalone --nproc_per_node N benchmarks/resume_rank.py --mode resume
...`` (gloo CPU ranks, one intra-op thread each) and the ranks stamp the same wall clock at each
boundary (see ``resume_rank.py``). A boundary's time is the latest rank's; the parts are the gaps:

    launcher + interpreter   launcher's clock → every rank runs its script's first line (torchrun's own start)
    imports                  → torch, trainer, ckpt (+ torchtitan's components) imported
    process group + build    → process group, mesh, model, FSDP2/TP, optimizer, data loader built
    checkpoint load          → the saved state loaded into the live objects (the system's own calls)
    first step               → the first optimizer step of the resumed run done

Systems, the same trainer in each: ``ours`` (the trainer's resume: ``CheckpointManager.load``),
``DCP`` (``dcp.load`` with ``FileSystemReader`` of a ``dcp.save`` checkpoint, torch's state_dict API
around it, ``peers.dcp_load``) and ``torchtitan`` (its own ``CheckpointManager``, ``async_mode="disabled"``,
over its ``OptimizersContainer``/``LRSchedulersContainer``; CPU-capable with these, its Trainer is not).
Before every launch the files of the checkpoint about to be read are evicted from the page cache
(``fsync`` + ``posix_fadvise(DONTNEED)``), so the load reads them from storage while the libraries
stay cached (the imports do not turn into disk reads). Every resumed run's first loss must be the
same across systems (same weights, same data position); the table shows it.

Ratios to DCP are paired per repeat: of the total, of the time after the imports (build + load +
first step: the launcher and the imports run the same code for ours and DCP, so on a shared box
their spread is noise), and of the load alone. The goal, per layout: ours' time after the imports
≤ 1.0× DCP's.
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from harness import Load, argument_parser, machine_description, median, rotated, work_dir  # first

from report import command_line, goal, metric, provenance, publish, ratio_span, table_head, write_json  # noqa: E402
from resume_jobs import (  # noqa: E402
    PARTS, JobFailed, dir_bytes, evict, parts_of, rank_records, titan_available, torchrun,
)

BENCH_NAME = "resume"
SECTION = "## Time to first step after resume (issue 27)"
SYSTEMS = {"ours": "ours", "dcp": "DCP", "titan": "torchtitan"}  # key (resume_rank --system) -> label
GOAL_X_DCP = 1.0  # ours' time to first step not above DCP's, in every layout


@dataclass(frozen=True)
class Case:
    key: str
    name: str
    saved: int  # ranks (FSDP) the checkpoint was saved on
    world: int  # ranks of the resumed run
    tp: int = 1

    @property
    def same(self) -> bool:
        return self.saved == self.world and self.tp == 1


CASES = (Case("2-2", "FSDP 2 → FSDP 2 (same layout)", 2, 2), Case("2-4", "FSDP 2 → FSDP 4", 2, 4),
         Case("2-tp2", "FSDP 2 → TP 2", 2, 2, tp=2), Case("4-2", "FSDP 4 → FSDP 2", 4, 2),
         Case("1-1", "1 rank → 1 rank (tiny smoke run)", 1, 1))
BY_KEY = {c.key: c for c in CASES}
QUICK = {"dim": 256, "layers": 4, "repeats": 1, "cases": ["2-2"]}
FULL = {"dim": 512, "layers": 4, "repeats": 2, "cases": ["2-2", "2-4", "2-tp2", "4-2"]}
TINY = {"dim": 64, "layers": 2, "repeats": 1, "cases": ["1-1"]}


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------
def model_args(args) -> list[str]:
    return ["--dim", str(args.dim), "--layers", str(args.layers), "--steps", str(args.steps)]


def save_all(args, cases: list[Case], systems: list[str], work: Path) -> dict:
    """One save job per saved layout; returns per saved world its root, params and on-disk bytes."""
    saved = {}
    for world in sorted({c.saved for c in cases}):
        root = work / f"saved-{world}"
        t0 = time.monotonic()
        torchrun(world, ["--mode", "save", "--root", str(root), "--out", str(work / f"save-{world}"),
                         "--dump", str(work / f"dump-save-{world}"), *model_args(args),
                         *(["--titan"] if "titan" in systems else [])],
                 work / f"save-{world}.log", args.job_timeout)
        record = rank_records(work / f"save-{world}", world)[0]
        sizes = {s: dir_bytes(root / s) for s in systems}
        saved[world] = {"root": root, "params": record["params"], "bytes": sizes, "s": time.monotonic() - t0}
        print(f"saved on {world} ranks: {record['params']:,} params; "
              + ", ".join(f"{SYSTEMS[s]} {b / 1e6:.1f} MB" for s, b in sizes.items())
              + f" ({saved[world]['s']:.0f} s)", flush=True)
    return saved


def resume_one(args, case: Case, system: str, saved: dict, work: Path, tag: str, retries: list) -> dict:
    """One resume job; a job that fails is run once more (noted in ``retries``, shown in the report)."""
    root = saved[case.saved]["root"]
    out = work / f"resume-{tag}"
    for attempt in (1, 2):
        evict(root / system)
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(work / f"dump-{tag}", ignore_errors=True)
        try:
            launched = torchrun(case.world, ["--mode", "resume", "--system", system, "--root", str(root), "--out",
                                             str(out), "--dump", str(work / f"dump-{tag}"), "--tp", str(case.tp),
                                             *model_args(args)], work / f"resume-{tag}.log", args.job_timeout)
            break
        except JobFailed as exc:
            if attempt == 2:
                raise
            first = next((line for line in str(exc).splitlines()[1:] if line.strip()), "")
            retries.append(f"{case.name} / {SYSTEMS[system]}: {first.strip()[:160]}")
            print(f"   {tag} failed, once more: {exc}", flush=True)
    ranks = rank_records(out, case.world)
    shutil.rmtree(work / f"dump-{tag}", ignore_errors=True)
    return {"parts": parts_of(launched, ranks), "loss": ranks[0]["loss"]}


def run(args, cases: list[Case], systems: list[str], work: Path) -> dict:
    saved = save_all(args, cases, systems, work)
    runs: dict = {}  # (case key, system) -> list of {"parts", "loss"}
    retries: list[str] = []
    load = Load()
    for rep in range(args.repeats):
        for case in rotated(cases, rep):
            for system in rotated(systems, rep):
                tag = f"{case.key}-{system}-{rep}"
                result = resume_one(args, case, system, saved, work, tag, retries)
                runs.setdefault((case.key, system), []).append(result)
                p = result["parts"]
                print(f"[{rep + 1}/{args.repeats}] {case.name:32s} {SYSTEMS[system]:10s} total {p['total']:6.2f} s"
                      f" | load {p['checkpoint load']:6.2f} s | loss {result['loss']:.6f}", flush=True)
    return {"saved": saved, "runs": runs, "retries": retries, "contention": load.stop().describe("during the resumes")}


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------
def part_names() -> list[str]:
    return [part for _, part in PARTS]


def ratios(num: list[float], den: list[float]) -> list[float]:
    return [a / b for a, b in zip(num, den)]


AFTER_IMPORTS = ("process group + build", "checkpoint load", "first step")  # what differs between ours and DCP


def after_imports(run: dict) -> float:
    return sum(run["parts"][p] for p in AFTER_IMPORTS)


def case_rows(case: Case, systems: list[str], runs: dict) -> tuple[list[str], list[dict], dict]:
    """The table rows of one case, its metrics, and ours / DCP per repeat (total, after imports, load)."""
    rows, metrics, vs_dcp = [], [], {}
    dcp_runs = runs.get((case.key, "dcp"))
    measures = {"total": lambda r: r["parts"]["total"], "after": after_imports,
                "load": lambda r: r["parts"]["checkpoint load"]}
    for system in systems:
        rs = runs[(case.key, system)]
        label = SYSTEMS[system]
        metrics.append(metric(label, "ttfs_s", "s", [r["parts"]["total"] for r in rs], case=case.name))
        metrics.append(metric(label, "after_imports_s", "s", [after_imports(r) for r in rs], case=case.name))
        for part in part_names():
            metrics.append(metric(label, "ttfs_part_s", "s", [r["parts"][part] for r in rs], case=case.name, part=part))
        share = median([r["parts"]["checkpoint load"] / r["parts"]["total"] for r in rs])
        cells = [f"{median([r['parts'][part] for r in rs]):.2f}" for part in part_names()]
        x_dcp = "–"
        if dcp_runs is not None and system != "dcp":
            xs = {k: ratios([f(r) for r in rs], [f(r) for r in dcp_runs]) for k, f in measures.items()}
            for key, name in (("total", "ttfs_x_dcp"), ("after", "after_imports_x_dcp"), ("load", "load_x_dcp")):
                metrics.append(metric(label, name, "×", xs[key], case=case.name))
            x_dcp = " / ".join(ratio_span(xs[k], "×") for k in ("total", "after", "load"))
            if system == "ours":
                vs_dcp = xs
        losses = sorted({f"{r['loss']:.6f}" for r in rs})
        rows.append(f"| {case.name} | {label} | {ratio_span([r['parts']['total'] for r in rs])} | " + " | ".join(cells)
                    + f" | {ratio_span([after_imports(r) for r in rs])} | {100 * share:.0f} % | {x_dcp} "
                    f"| {', '.join(losses)} |")
    return rows, metrics, vs_dcp


def report(result: dict, cases: list[Case], systems: list[str], args, info: dict, command: str):
    head = table_head(["Resume", "System", "Total s", *[f"{p} s" for p in part_names()], "After imports s",
                       "Load share", "× DCP (total / after imports / load)", "First loss"],
                      "ll" + "r" * (len(PARTS) + 4) + "l")
    lines, metrics, goals = [*head], [], []
    name = "resume {}: time to first step past the imports, ours ≤ {}× DCP"
    for case in cases:
        rows, ms, vs_dcp = case_rows(case, systems, result["runs"])
        lines += rows
        metrics += ms
        if vs_dcp:
            xs = vs_dcp["after"]
            goals.append(goal(name.format(case.name, GOAL_X_DCP), median(xs), GOAL_X_DCP, "<=",
                              f"build + load + first step, ours s / DCP s paired per repeat, {len(xs)} repeat(s); "
                              f"from the launcher's clock {ratio_span(vs_dcp['total'], '×')}, load alone "
                              f"{ratio_span(vs_dcp['load'], '×')}"))
        elif "dcp" not in systems:
            goals.append(goal(name.format(case.name, GOAL_X_DCP), None, GOAL_X_DCP, "<=", "DCP not run (--systems)"))
    losses = {key: {f"{r['loss']:.6f}" for r in rs} for key, rs in result["runs"].items()}
    agree = all(len({v for (k, _), vals in losses.items() if k == c.key for v in vals}) == 1 for c in cases)
    saved = result["saved"]
    state = "; ".join(f"saved on {w} ranks: " + ", ".join(f"{SYSTEMS[s]} {b / 1e6:.1f} MB" for s, b in v["bytes"].items())
                      for w, v in saved.items())
    params = next(iter(saved.values()))["params"]
    missing = [] if "titan" in systems else [
        "- torchtitan: not run — " + ("its package is not installed (the dev extra)." if not titan_available()
                                      else "left out with --systems.")]
    body = [
        SECTION, "",
        f"Model: the trainer's debug llama at dim {args.dim}, {args.layers} layers ({params:,} parameters; fp32 "
        f"weights + AdamW moments), trained {args.steps} steps, then saved ({state}). Each resume is a fresh "
        f"`torchrun --standalone` job of CPU ranks (gloo, one thread each) started by this script; the time is from "
        f"the launcher's `time.time()` before the launch to the first optimizer step, the parts are the gaps between "
        f"the latest rank's stamps (`benchmarks/resume_rank.py`). Median of {args.repeats} repeat(s), the "
        f"(layout, system) runs interleaved and rotated per repeat; × DCP paired per repeat (below 1 = faster than DCP). "
        f"The checkpoint read is evicted from the page cache before each launch (`posix_fadvise(DONTNEED)`), the "
        f"libraries stay cached.", "",
        *lines, "",
        "Notes:",
        "- ours: the trainer's own resume (`checkpoint.enable`, `CheckpointManager.load` of the newest step). DCP: the "
        "same trainer without checkpointing, then `get_model_state_dict`/`get_optimizer_state_dict`, `dcp.load(sd, "
        "storage_reader=FileSystemReader(dir))` in place, `set_*_state_dict` and the schedule/loader/counters. "
        "torchtitan: its own `CheckpointManager` (`async_mode=\"disabled\"`) over its `OptimizersContainer` (AdamW) "
        "and `LRSchedulersContainer` on the same model and loader; its Trainer and models need an accelerator/triton, "
        "so the trainer's model and loop stand in for them.",
        f"- First loss: every system's first resumed step gave the same loss in each layout: "
        f"{'**yes**' if agree else '**NO — a load restored something else**'} (same weights and data position).",
        "- The launcher and the imports run the same code for ours and DCP (the same trainer; DCP is part of torch), "
        "so their spread between rows is the machine's: other agents share its 2 cores, and 4 ranks on 2 vCPUs are "
        "oversubscribed 2×. \"After imports\" (build + load + first step) is what the checkpoint system changes; the "
        "goal compares that, the totals' ratio stands beside it. Load share = checkpoint load / total.",
        *missing,
        *[f"- A job failed and was run once more (its figures are the second run's): {r}" for r in result.get("retries", [])],
        f"- Wall time: {info['wall_s']:.0f} s (saves {sum(v['s'] for v in saved.values()):.0f} s).",
        "",
        *provenance(info["machine"], command, load=result["contention"]),
    ]
    return "\n".join(body), metrics, goals


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__doc__, keep=True)
    parser.add_argument("--quick", action="store_true", help="2 → 2, ~40 MB, one repeat")
    parser.add_argument("--tiny", action="store_true", help="a smoke run for the tests: 1 rank, a tiny model")
    parser.add_argument("--dim", type=int, help=f"model dimension (default {FULL['dim']})")
    parser.add_argument("--layers", type=int, help=f"transformer blocks (default {FULL['layers']})")
    parser.add_argument("--repeats", type=int, help=f"resumes per (layout, system) (default {FULL['repeats']})")
    parser.add_argument("--cases", nargs="+", choices=list(BY_KEY), help="resume layouts: saved-resumed ranks")
    parser.add_argument("--systems", nargs="+", choices=list(SYSTEMS), help="default: all (torchtitan if installed)")
    parser.add_argument("--steps", type=int, default=2, help="steps trained before the save")
    parser.add_argument("--job-timeout", type=float, default=600, help="seconds one torchrun job may take")
    args = parser.parse_args(argv)
    for key, value in (TINY if args.tiny else QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    systems = args.systems or [s for s in SYSTEMS if s != "titan" or titan_available()]
    if "titan" in systems and not titan_available():
        parser.error("torchtitan is not installed (the dev extra)")
    cases = [BY_KEY[k] for k in args.cases]
    command = command_line("bench_resume.py", argv)
    t0 = time.monotonic()
    with work_dir(args.dir, "resume-", keep=args.keep) as work:
        info = {"machine": machine_description(work)}
        result = run(args, cases, systems, work)
        info["wall_s"] = time.monotonic() - t0
    section, metrics, goals = report(result, cases, systems, args, info, command)
    publish(section, args.out)
    write_json(args.json, BENCH_NAME, section, command, metrics=metrics, goals=goals,
               params={"dim": args.dim, "layers": args.layers, "repeats": args.repeats, "cases": args.cases,
                       "systems": systems, "quick": args.quick, "tiny": args.tiny,
                       "params": next(iter(result["saved"].values()))["params"],
                       "checkpoint_bytes": {str(w): v["bytes"] for w, v in result["saved"].items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
