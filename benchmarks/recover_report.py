"""The section, metrics and goals of ``bench_recover.py``: the recoveries by part, lost work, tokens/s.

:func:`report` takes the run's result (``bench_recover.run``), the rows run, the arguments and the
machine; returns the Markdown section, the metrics (``recover_s``, ``recover_part_s`` per part,
``recover_load_s``, ``load_x_s3``, ``load_x_disk``, ``lost_steps``, ``tokens_per_s``,
``tokens_x_none``, ``stall_per_save_s``) and the goals of issue 38. A memory-tier row whose ranks read
anything from storage did not recover from memory (the tier fell back, and said why in its log):
its goals are then not measured, and the notes say so.
"""

from __future__ import annotations

from harness import median
from report import goal, metric, provenance, ratio_span, table_head
from resume_jobs import PARTS

SECTION = "## Time to recover after a crash or a lost node (issue 38)"
GOAL_X_S3, GOAL_X_DISK, GOAL_LOST, GOAL_TOKENS, GOAL_STALL = 0.2, 0.5, 1, 0.97, 1.0
GOAL_STATE = 1 << 30  # the goals are stated for a state of at least 1 GiB
VARIANT_LABELS = {"none": "no save", "memory": "memory save every step", "storage": "storage save every step"}


def _ratios(num: list[float], den: list[float]) -> list[float]:
    return [a / b for a, b in zip(num, den)]


def _load(run: dict) -> float:
    return run["parts"]["checkpoint load"]


def _from_memory(runs: list[dict]) -> bool:
    return all(r["bytes_read"] == 0 for r in runs)


def recovery_table(result: dict, rows) -> tuple[list[str], list[dict], dict]:
    """The recovery rows, their metrics, and the memory rows' load / each storage row's, per repeat."""
    parts = [part for _, part in PARTS]
    lines = table_head(["System", "Scenario", "Total s", *[f"{p} s" for p in parts], "Read from storage MB",
                        "Load × S3 / × disk", "First loss"], "ll" + "r" * (len(parts) + 3) + "l")
    metrics, vs = [], {}
    runs = result["runs"]
    for row in rows:
        rs = runs[row.key]
        cells = [f"{median([r['parts'][p] for r in rs]):.2f}" for p in parts]
        tags = {"scenario": row.scenario}
        metrics.append(metric(row.label, "recover_s", "s", [r["parts"]["total"] for r in rs], **tags))
        metrics.append(metric(row.label, "recover_load_s", "s", [_load(r) for r in rs], **tags))
        for p in parts:
            metrics.append(metric(row.label, "recover_part_s", "s", [r["parts"][p] for r in rs], part=p, **tags))
        x = "–"
        if row.memory and "s3" in runs and "disk" in runs:
            xs = {k: _ratios([_load(r) for r in rs], [_load(r) for r in runs[k]]) for k in ("s3", "disk")}
            metrics.append(metric(row.label, "load_x_s3", "×", xs["s3"], **tags))
            metrics.append(metric(row.label, "load_x_disk", "×", xs["disk"], **tags))
            x = f"{ratio_span(xs['s3'], '×')} / {ratio_span(xs['disk'], '×')}"
            vs[row.memory] = xs
        read = [r["bytes_read"] for r in rs]
        shown = "–" if None in read else f"{median(read) / 1e6:.1f}"
        losses = ", ".join(sorted({f"{r['loss']:.6f}" for r in rs}))
        lines.append(f"| {row.label} | {row.scenario} | {ratio_span([r['parts']['total'] for r in rs])} | "
                     + " | ".join(cells) + f" | {shown} | {x} | {losses} |")
    return lines, metrics, vs


def memory_goals(result: dict, vs: dict, state: int) -> list[dict]:
    size = (f"state {state / 2**20:.1f} MiB on disk (the goals are stated for ≥ 1 GiB"
            + (")" if state >= GOAL_STATE else "; at this size the verdict is what it is)"))
    runs = result["runs"]
    used = "mem-loss" in runs and _from_memory(runs["mem-loss"])
    goals = []
    for key, target, name in (("s3", GOAL_X_S3, "ours from S3"),
                              ("disk", GOAL_X_DISK, "ours from local disk, pages evicted")):
        xs = vs.get("loss", {}).get(key)
        crash = vs.get("crash", {}).get(key)
        after_crash = f"after a worker crash {ratio_span(crash, '×')}; " if crash else ""
        detail = (f"load part, memory tier after a node loss / {name}, paired per repeat ({len(xs)}); {after_crash}"
                  f"{size}" if xs and used else
                  "not measured: the memory-tier recovery read from storage (the tier fell back; see the notes)")
        goals.append(goal(f"recover: memory-tier load after a node loss (partner fetch included) ≤ {target}× {name}",
                          median(xs) if xs and used else None, target, "<=", detail))
    return goals


def lost_lines(result: dict) -> tuple[list[str], list[dict], list[dict]]:
    """The lost-work table (storage alone, the memory tier, after the same crash), its metrics and goal."""
    lost = result["lost"]
    lines = table_head(["Restart from", "Steps finished at the crash", "Resumed at", "Steps redone"], "lrrr")
    metrics = []
    for label, resumed in ((f"storage alone, interval {lost['interval']} (the newest storage step)", lost["stored"]),
                           (f"memory tier, memory_interval 1 (read from {lost['from']})", lost["resumed"])):
        redone = lost["finished"] - (resumed or 0)
        lines.append(f"| {label} | {lost['finished']} | {resumed} | {redone} |")
        metrics.append(metric(label.split(" (")[0], "lost_steps", "steps", [redone]))
    ok = lost["from"] == "memory tier"
    goals = [goal(f"recover: lost work at memory_interval 1 ≤ {GOAL_LOST} step",
                  lost["finished"] - (lost["resumed"] or 0) if ok else None, GOAL_LOST, "<=",
                  f"steps redone after every rank died {lost['frac']:g} of a step into step {lost['finished'] + 1} "
                  f"(step {lost['finished']}'s memory save {'started' if lost['last_started'] else 'skipped by the gate'})"
                  f"; storage alone at interval {lost['interval']}: {lost['finished'] - lost['stored']} (a crash at a "
                  f"uniformly random step redoes {(lost['interval'] - 1) / 2:.1f} on average)" if ok else
                  "not measured: the restart with the memory tier read from storage (the tier fell back)")]
    return lines, metrics, goals


def crash_line(lost: dict) -> str:
    """What the crash of the lost-work run hit: where in the step, and the memory gate's record."""
    skipped = lost["finished"] - lost["started"]
    return (f"The crash: {lost['delay_s'] * 1e3:.0f} ms ({lost['frac']:g} of a step's time) into step "
            f"{lost['finished'] + 1}, every rank at once; by then saves had started at {lost['started']} of the "
            f"{lost['finished']} finished steps ({skipped} skipped by the memory gate: the writer still busy with "
            f"earlier saves), step {lost['finished']}'s {'included' if lost['last_started'] else 'not'}, and "
            f"{lost['committed']} memory steps were committed. A crash right after a step's save call, before its "
            f"memory save commits, redoes that step too (one more); a step the gate skipped is redone like any step "
            f"after the newest memory step.")


CPU_PARTS = ("training", "gloo", "other")  # recover_rank.cpu_seconds's split of a rank's CPU


def _cpu(runs: list[dict], part: str) -> float:
    """Median over repeats of one part's CPU ms per rank-step."""
    return median([r["cpu_ms_per_rank_step"][part] for r in runs])


def cpu_sharing(tps: dict) -> str:
    """What the tokens/s ratio measures on a CPU-bound box: the CPU a step takes with and without a
    memory save, and the ratio they predict when training and writers share saturated cores."""
    none, memory = (sum(_cpu(tps[v], part) for part in CPU_PARTS) for v in ("none", "memory"))
    training = _cpu(tps["memory"], "training") - _cpu(tps["none"], "training")
    measured = median(_ratios([r["tokens_per_s"] for r in tps["memory"]], [r["tokens_per_s"] for r in tps["none"]]))
    return (f"- What the tokens/s ratio measures here: the cores are saturated (training is CPU-bound), so tokens/s "
            f"follows CPU per step. A rank-step takes {none:.1f} ms of CPU without saves and {memory:.1f} ms with a "
            f"memory save every step (the checkpoint's threads — the RAM write, checksums, the partner copy's "
            f"sending and receiving — and gloo's copies over loopback): {none / memory:.2f}× as many steps fit in "
            f"the same CPU; tokens/s measured {measured:.2f}×. The training thread's own CPU per step changes by "
            f"{training:+.1f} ms (the stall is in it); with a core for the writer (an accelerator host's spare CPUs) "
            f"that, not the writer's CPU, is what training would pay. Measured by `/proc/self/task` and the process's CPU clock in each rank "
            f"(`recover_rank.cpu_seconds`).")


def throughput_lines(result: dict) -> tuple[list[str], list[dict], list[dict]]:
    tps = result["tps"]
    lines = table_head(["Saving", "tokens/s", "× no save", "Stall per save ms", "CPU ms per rank-step: training "
                        "thread", "gloo threads", "checkpoint threads", "all"], "lrrrrrrr")
    metrics, goals = [], []
    none = [r["tokens_per_s"] for r in tps["none"]]
    for variant, rs in tps.items():
        label = VARIANT_LABELS[variant]
        vals = [r["tokens_per_s"] for r in rs]
        metrics.append(metric(label, "tokens_per_s", "tok/s", vals))
        x = _ratios(vals, none)
        stalls = [r["stall_per_save"] for r in rs if r["stall_per_save"] is not None]
        if variant != "none":
            metrics.append(metric(label, "tokens_x_none", "×", x))
            if stalls:
                metrics.append(metric(label, "stall_per_save_s", "s", stalls))
        cpu = [_cpu(rs, part) for part in CPU_PARTS]
        lines.append(f"| {label} | {ratio_span(vals)} | {ratio_span(x, '×') if variant != 'none' else '–'} | "
                     + (f"{ratio_span([s * 1e3 for s in stalls])} |" if stalls else "– |")
                     + "".join(f" {c:.1f} |" for c in cpu) + f" {sum(cpu):.1f} |")
    x_memory = _ratios([r["tokens_per_s"] for r in tps["memory"]], none)
    failed = sum(r["memory_failures"] for r in tps["memory"])
    goals.append(goal(f"recover: tokens/s with a memory save every step ≥ {GOAL_TOKENS}× no save",
                      median(x_memory) if not failed else None, GOAL_TOKENS, ">=",
                      f"debug flavour, the ranks + their writer threads on the box's cores, paired per repeat "
                      f"({len(x_memory)})" if not failed else f"not measured: {failed} memory saves failed"))
    mem = [r["stall_per_save"] for r in tps["memory"]]
    sto = [r["stall_per_save"] for r in tps["storage"]]
    ok = None not in mem + sto and not failed
    goals.append(goal(f"recover: memory-save stall ≤ {GOAL_STALL}× a storage save's",
                      median(_ratios(mem, sto)) if ok else None, GOAL_STALL, "<=",
                      "SaveStats.stall_s per save, memory save every step / storage save every step, paired per "
                      "repeat" if ok else "not measured: a run counted no saves or its memory saves failed"))
    return lines, metrics, goals


def report(result: dict, rows, args, info: dict, command: str) -> tuple[str, list[dict], list[dict]]:
    saved = result["saved"]
    table, metrics, vs = recovery_table(result, rows)
    goals = memory_goals(result, vs, saved["bytes"]["ours"])
    lost, lost_metrics, lost_goals = lost_lines(result)
    tps, tps_metrics, tps_goals = throughput_lines(result)
    runs = result["runs"]
    fell_back = [r.scenario for r in rows if r.memory and not _from_memory(runs[r.key])]
    sizes = ", ".join(f"{k} {b / 1e6:.1f} MB" for k, b in saved["bytes"].items())
    ranks = 2 * args.per_node
    body = [
        SECTION, "",
        f"State: the trainer's debug llama at dim {args.dim}, {args.layers} layers ({saved['params']:,} parameters, "
        f"fp32 weights + AdamW moments; layout {args.layout.upper()} over {ranks} ranks), trained {args.steps} steps "
        f"and saved ({sizes}). Every job: {ranks} CPU ranks as 2 nodes of {args.per_node} (two torchrun agents, "
        f"`--nnodes 2`, gloo on "
        f"loopback, one thread each), each node's memory folder its own under /dev/shm. A recovery is a fresh job; "
        f"time from the launcher's clock to the end of the first resumed step, by part (the latest rank's stamps, "
        f"`resume_rank.py`); median of {args.repeats} repeat(s), the rows rotated per repeat; load ratios paired "
        f"per repeat.", "",
        *table, "",
        f"Lost work (debug flavour, `async_mode double_buffer`): one run with the memory tier every step and storage "
        f"every {args.lost_interval} steps dies; a fresh job resumes from the memory tier; without the tier a restart "
        f"resumes from the newest storage step (the root's listing):", "",
        *lost, "", crash_line(result["lost"]), "",
        f"Tokens/s over {args.window} steps after {result['warmup']} (debug flavour, {ranks} ranks, `async_mode "
        f"double_buffer`, the saves drained inside the window):", "",
        *tps, "",
        "Notes:",
        "- A worker crash is a fresh job over the memory folders as the crashed run left them (the saving run keeps "
        "them: `memory_keep_on_exit`), not torchrun's `--max-restarts` restart in place: the launcher + interpreter "
        "part is a fresh start's. A node loss empties node 1's folder before the job: its ranks fetch their files "
        "from node 0 (the partner copies) inside the load part. The folders are restored from a copy on disk before "
        "each memory row; that copy's cached pages are then evicted: on this VM, fresh memory past what the guest "
        "touched lately costs ~45 us a page at first touch instead of ~3 (measured: a 1 GiB touch after 14 GB of "
        "tmpfs), and with them cached the memory rows' first step took 2-3x as long (17-24 s against 6-8 s).",
        "- Storage, DCP and torchtitan read nothing from the memory folders: the same recovery after a crash or a lost "
        "node, measured once (scenario \"either\"). No row saves in its first resumed step (the memory rows run with "
        "`memory_interval 1000`), so the first step is the same work everywhere.",
        "- The goals compare the load parts. Opening an S3 root (the run's claim, the listing) happens in the "
        "manager's construction, so it falls in \"process group + build\" for the S3 row: its total shows it.",
        "- Read from storage: the bytes the ranks' `CheckpointManager.load` read from storage (`LoadStats.bytes_read`, "
        "summed); 0 means the state came from the memory tier. The first loss must be the same in every row (same "
        "weights and data position).",
        f"- Tokens/s: {ranks} ranks and their writer threads share this box's cores. The stall is "
        "`SaveStats.stall_s` per save (host + device time training was blocked); CPU per rank-step is the window's "
        "CPU of all ranks over their steps, by thread: the training (main) thread, gloo's (FSDP's collectives; "
        "the partner copy), the checkpoint's (the rest).",
        cpu_sharing(result["tps"]),
        *([f"- **The memory tier was not used** in: {', '.join(fell_back)} (the ranks read from storage). The saving "
           f"run counted {saved['memory_saves']} memory saves and {saved['memory_failures']} memory-save failures "
           f"(summed over ranks); the logs under the work dir (`--keep`) say why."] if fell_back else []),
        *([] if info.get("titan") else ["- torchtitan: not run — its package is not installed (the dev extra)."]),
        *([f"- Rows not run (`--rows`): {', '.join(info['left_out'])}."] if info.get("left_out") else []),
        f"- Wall time: {info['wall_s']:.0f} s (the save {saved['s']:.0f} s).", "",
        *provenance(info["machine"], command, load=result["contention"]),
    ]
    return "\n".join(body), metrics + lost_metrics + tps_metrics, goals + lost_goals + tps_goals
