"""The section of ``bench_save_load.py``: part 1's table, goals and metrics, and part 2's (the
resharded loads measured by ``reshard_load.py``).

Part 1 takes the script's method records (``label``, ``calls``, ``note``, ``size`` and per repeat
``save_times``, ``load_times`` and ``raw_load_times``, the raw read timed next to each load); every
ratio is paired per repeat (``harness.paired``). Part 2 takes ``reshard_load.run``'s result. Each
part gives its Markdown lines, its ``report.metric`` records and its ``report.goal`` records; the
JSON keys are the runner's contract (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import os

from harness import median, paired

import reshard_load
from report import goal, goal_line, median_span, metric, provenance, ratio_span, table_head, verdict

SECTION = "## Save/load throughput (issue 2)"
GOAL_SAVE_X_RAW = 1.0  # issue 15: ours saves at least as fast as raw write+fsync
GOAL_LOAD_X_RAW = 0.95  # issue 15: ours loads at 0.95x raw read or better
GOAL_RESHARD_X_SAME = 1.15  # issue 27: a resharded load takes at most 1.15x the same-layout load


# ---------------------------------------------------------------------------------------------
# Part 1: one process, every method
# ---------------------------------------------------------------------------------------------
def load_x_raw(m, raw) -> list[float]:
    """Per repeat, the raw read timed right next to ``m``'s load / ``m``'s load (1s for raw)."""
    return paired(m.raw_load_times or raw.load_times, m.load_times)


def by_label(methods: list) -> dict:
    return {m.label: m for m in methods}


def ours_goals(methods: list) -> tuple[list[dict], list[str]]:
    """The issue-15 goals of ours and of ours as DCP plug-in (medians of paired per-repeat ratios),
    as report.goal records and as the report's note lines."""
    ms = by_label(methods)
    raw, dcp_m = ms["raw"], ms.get("DCP")
    goals, notes = [], []

    def detail(xs: list[float], what: str) -> str:
        return f"median over {len(xs)} repeat(s) of {what}, paired per repeat; min–max {min(xs):.2f}–{max(xs):.2f}"

    for label in ("ours", "ours (DCP plug-in)"):
        if label not in ms:
            continue
        m = ms[label]
        save_x, load_x = paired(raw.save_times, m.save_times), load_x_raw(m, raw)
        goals.append(goal(f"{label} save ≥ {GOAL_SAVE_X_RAW}× raw write+fsync", median(save_x), GOAL_SAVE_X_RAW, ">=",
                          detail(save_x, f"raw save s / {label} save s")))
        goals.append(goal(f"{label} load ≥ {GOAL_LOAD_X_RAW}× raw read", median(load_x), GOAL_LOAD_X_RAW, ">=",
                          detail(load_x, f"raw load s (timed next to it) / {label} load s")))
        text = [f"save ≥ {GOAL_SAVE_X_RAW}× raw write+fsync: {verdict(goals[-2]['met'])} ({ratio_span(save_x, '×')})",
                f"load ≥ {GOAL_LOAD_X_RAW}× raw read: {verdict(goals[-1]['met'])} ({ratio_span(load_x, '×')})"]
        if dcp_m is not None:
            vs_dcp = paired(dcp_m.save_times, m.save_times)
            goals.append(goal(f"{label} save not slower than DCP", median(vs_dcp), 1.0, ">=",
                              detail(vs_dcp, f"DCP save s / {label} save s")))
            load_vs_dcp = paired(dcp_m.load_times, m.load_times)
            text.insert(1, f"save not slower than DCP: {verdict(goals[-1]['met'])} "
                           f"({ratio_span(vs_dcp, '×')} DCP's speed)")
            text.append(f"(load: {ratio_span(load_vs_dcp, '×')} DCP's speed)")
        else:
            goals.append(goal(f"{label} save not slower than DCP", None, 1.0, ">=", "DCP not run (--methods)"))
        text.append(f"best repeat vs best raw: save {min(raw.save_times) / min(m.save_times):.2f}×, "
                    f"load {min(raw.load_times) / min(m.load_times):.2f}×")
        notes.append(f"- Goals, {label} (median of the per-repeat ratios to raw, min–max in brackets): "
                     + "; ".join(text) + ".")
    return goals, notes


def main_table(methods: list, nbytes: int) -> list[str]:
    raw = by_label(methods)["raw"]
    lines = table_head(["Method", "Calls", "Save GB/s", "Save × raw", "Load GB/s", "Load × raw", "Save s (min–max)",
                        "Load s (min–max)", "On disk", "Notes"], "ll" + "r" * 7 + "l")
    for m in methods:
        save_x, load_x = paired(raw.save_times, m.save_times), load_x_raw(m, raw)
        lines.append(
            f"| {m.label} | `{m.calls}` | {nbytes / median(m.save_times) / 1e9:.2f} | {ratio_span(save_x)} "
            f"| {nbytes / median(m.load_times) / 1e9:.2f} | {ratio_span(load_x)} "
            f"| {median_span(m.save_times)} | {median_span(m.load_times)} | {m.size / 2**20:.1f} MiB | {m.note} |"
        )
    return lines


def main_metrics(methods: list, nbytes: int) -> list[dict]:
    raw = by_label(methods)["raw"]
    out = []
    for m in methods:
        out.append(metric(m.label, "save_gbps", "GB/s", [nbytes / t / 1e9 for t in m.save_times]))
        out.append(metric(m.label, "load_gbps", "GB/s", [nbytes / t / 1e9 for t in m.load_times]))
        if m is not raw:
            out.append(metric(m.label, "save_x_raw", "×", paired(raw.save_times, m.save_times)))
            out.append(metric(m.label, "load_x_raw", "×", load_x_raw(m, raw)))
    return out


# ---------------------------------------------------------------------------------------------
# Part 2: resharded loads
# ---------------------------------------------------------------------------------------------
def reshard_report(res: dict) -> tuple[list[str], list[dict], list[dict]]:
    """The reshard part's table, its metrics (load seconds per (system, layout), and per resharded
    layout the per-repeat ratio to the same system's load of its reference layout in that repeat)
    and its goals (ours: every resharded layout within 1.15x of its reference)."""
    systems, nbytes = reshard_load.SYSTEMS, res["nbytes"]
    layouts = [lay.name for lay in reshard_load.LAYOUTS]
    reference = {lay.name: lay.reference for lay in reshard_load.LAYOUTS}
    source = {lay.name: lay.source for lay in reshard_load.LAYOUTS}
    same = reshard_load.SAVED.name
    times = res["load_s"]
    goals = []
    metrics = [metric(s, "save_s", "s", [res["save_s"][s]], layout=same) for s in systems]
    columns = ["Load layout", *[f"{s} {what}" for s in systems
                                for what in ("load s (min–max)", "GB/s", "time × same layout")],
               "DCP s / ours s", "read by syscalls, ours / DCP (× state)", "read from disk, ours / DCP (× state)"]
    lines = table_head(columns, "l" + "r" * (len(columns) - 1))

    def read_x(system: str, layout: str, index: int) -> str:
        values = [r[index] for r in res["read"][(system, layout)]]
        return "n/a" if min(values) < 0 else f"{median(values) / nbytes:.2f}"

    for layout in layouts:
        row = f"| {layout} |"
        for s in systems:
            ts = times[(s, layout)]
            metrics.append(metric(s, "load_s", "s", ts, layout=layout))
            if reference[layout] == layout:
                vs_same = "1 (reference)"
            else:
                xs = reshard_pairs(res, s, layout)
                metrics.append(metric(s, "load_x_same_layout", "×", xs, layout=layout))
                vs_same = ratio_span(xs) + ("" if reference[layout] == same else f" vs {reference[layout]}")
                if s == "ours":
                    goals.append(goal(f"ours resharded load {layout} ≤ {GOAL_RESHARD_X_SAME}× same layout",
                                      median(xs), GOAL_RESHARD_X_SAME, "<=",
                                      f"median over {len(xs)} repeat(s) of {layout} load s / {reference[layout]} "
                                      f"load s timed next to it, per repeat; min–max {min(xs):.2f}–{max(xs):.2f}; "
                                      f"DCP's: {median(reshard_pairs(res, 'DCP', layout)):.2f}"
                                      + _against_source(times, layout, source[layout], reference[layout])))
            row += f" {median_span(ts)} | {nbytes / median(ts) / 1e9:.2f} | {vs_same} |"
        row += f" {ratio_span(paired(times[('DCP', layout)], times[('ours', layout)]))} |"
        row += " " + " / ".join(read_x(s, layout, 0) for s in systems) + " |"
        row += " " + " / ".join(read_x(s, layout, 1) for s in systems) + " |"
        lines.append(row)
    return lines, metrics, goals


def reshard_pairs(res: dict, system: str, layout: str) -> list[float]:
    """Per repeat, ``layout``'s load s / the load s of its reference layout timed right next to it
    (same system, same repeat: ``reshard_load.units``)."""
    return [resharded / reference for resharded, reference in res["paired_s"][(system, layout)]]


def _against_source(times: dict, layout: str, source: str, reference: str) -> str:
    """For a load compared with another layout than the one it was saved in (2 → 4): its median
    against the source layout's own median load too (other ranks on the same cores), ours and DCP's."""
    if source == reference or ("ours", source) not in times:
        return ""
    ours, dcp = (median(times[(s, layout)]) / median(times[(s, source)]) for s in ("ours", "DCP"))
    return (f"; median against the median load of the layout it was saved in ({source}): "
            f"ours {ours:.2f}, DCP {dcp:.2f}")


def reshard_section(res: dict, args: argparse.Namespace) -> tuple[list[str], list[dict], list[dict]]:
    lines, metrics, goals = reshard_report(res)
    shapes = ", ".join("x".join(map(str, s)) for s in res["shapes"])
    saves = "; ".join(f"{s} {t:.3f} s ({res['nbytes'] / t / 1e9:.2f} GB/s)" for s, t in res["save_s"].items())
    idle = max(res["idle_cpu_s"], default=0.0)
    body = [
        "### Resharded load against same-layout load (2 → 4, Shard(0) → Shard(1), FSDP×TP 4 → FSDP 2, PP 2 → 1)",
        "",
        f"State: {len(res['shapes'])} fp32 matrices ({shapes}; {res['nbytes'] / 2**30:.3f} GiB), saved once per source "
        f"layout — as DTensors with `Shard(0)` on a CPU mesh of 2 ranks; on a 2×2 mesh (`Shard(0)` over dp, "
        f"`Shard(1)` over tp: FSDP×TP); by one process (plain tensors); by 2 pipeline stages (each rank whole tensors "
        f"of its half of the keys) — by ours (`ckpt.save(state, dir, process_group=...)`) and by DCP "
        f"(`dcp.save(state, storage_writer=FileSystemWriter(dir, sync_files=True), process_group=...)`); then loaded "
        f"in place (`ckpt.load` / `dcp.load(storage_reader=FileSystemReader(dir))`) into each layout below "
        f"(`reshard_load.py`'s docstring names each one's source and reference). "
        f"Load s = the slowest loading rank's `ckpt.load`/`dcp.load` call, after `sync` + "
        f"{'dropping the page cache (cold)' if res['cold'] else 'no cache drop (warm)'} between two barriers "
        f"of all 4 processes; median of {args.repeats} repeat(s) (of 2 × {args.repeats} for 2 ranks Shard(0) (same), "
        f"the reference of two resharded layouts). Each repeat times, per system, every resharded layout right "
        f"next to a load of its reference layout, which goes first alternating per repeat, the pairs and systems "
        f"in an order rotated per repeat; \"time × same layout\" is the ratio within those pairs. "
        f"GB/s = state bytes (10^9) / load s.",
        "",
        *lines,
        "",
        "Notes:",
        f"- Save on 2 ranks `Shard(0)` (once, slowest rank, cold start): {saves}.",
        "- \"time × same layout\" = this layout's load s / the same system's load s of its reference layout timed next "
        "to it in the same repeat (2 ranks Shard(0) (same) unless named: the same ranks in the same target layout loading a checkpoint "
        "of their own layout, so the 4-rank load is compared with a 4-rank one, not with 2 ranks on half the "
        f"processes of the box); above 1 = the resharded load is slower; goal for ours ≤ {GOAL_RESHARD_X_SAME}×. "
        "\"DCP s / ours s\" above 1 = ours is faster.",
        "- Read by syscalls / from disk: `/proc/self/io` `rchar` / `read_bytes` of the loading ranks, summed, per load. "
        "`read_bytes` counts each page once however many ranks read it (the others hit the page cache), so it stays "
        "≈ 1× when reads are cold; `rchar` shows how much each system reads to get its shards.",
        f"- One set of 4 processes (forked from a forkserver; `torch.set_num_threads(1)` each, gloo on 127.0.0.1) "
        f"runs the whole part. "
        f"The 4-rank layout runs 4 ranks on the {os.cpu_count()}-vCPU box: oversubscribed "
        f"{4 / (os.cpu_count() or 1):.0f}×, so its load times include waiting for a core. During the 2-rank loads "
        f"ranks 2-3 wait in a blocking gloo collective (at most {idle * 1000:.1f} ms of CPU per load).",
        "- Every rank's shards are verified bitwise against the same slice of the full tensors after every load "
        "(outside the timing)." if not args.no_verify else "- Loads were not verified (`--no-verify`).",
        f"- Wall time of this part: {res['wall_s']:.0f} s ("
        + ", ".join(f"{k} {v:.1f} s" for k, v in res["phases_s"].items()) + ").",
    ]
    return body, metrics, goals


# ---------------------------------------------------------------------------------------------
# The section
# ---------------------------------------------------------------------------------------------
def report(methods: list, info: dict, reshard: dict | None, args: argparse.Namespace,
           command: str) -> tuple[str, list[dict], list[dict]]:
    """The results section, its metrics and its goals."""
    nbytes = info["nbytes"]
    goals, goal_notes = ours_goals(methods)
    metrics = main_metrics(methods, nbytes)
    cache = ("cold: `sync` + `echo 3 > /proc/sys/vm/drop_caches` before every timed save and load"
             if info["cold"] else "warm: the page cache could not be dropped (or `--warm`), so reads may be served from memory")
    body = [
        SECTION,
        "",
        f"State: {info['state']}. Median of {args.repeats} repeat(s), methods interleaved (order rotated per repeat); "
        f"GB/s = state bytes (10^9) / wall seconds (`time.perf_counter` around the call only); × raw = raw s / method s "
        f"of the same repeat (loads: a raw read of the same bytes timed right next to the method's load, before or "
        f"after it alternating per repeat), median (min–max) over the repeats. "
        f"Reads were **{'cold' if info['cold'] else 'warm'}** ({cache}).",
        "",
        *main_table(methods, nbytes),
        "",
        "Notes:",
        *goal_notes,
        "- raw: `os.write` of every tensor's bytes to one file + `fsync`; load = `os.preadv` (64 MiB per call) into one "
        "preallocated, pre-faulted buffer. ckpt and DCP save times include their fsyncs (DCP `sync_files=True`) and, for "
        "ckpt, the whole atomic commit; torch.save and safetensors times include an `fsync` of the file after the call. "
        "ckpt and DCP load in place into the live tensors (ckpt also verifies xxh3 checksums); torch.load "
        "(`mmap=False, weights_only=True`) and safetensors `load_file` build fresh tensors, then `copy_` into the live ones "
        "(included).",
        "- torchsnapshot: `Snapshot.take` writes its files through aiofiles and closes them without any fsync (no "
        "durability of its own: a power loss right after `take` returns can lose the data, and its metadata file is "
        "not written atomically); the row's save time includes an `fsync` of every file it wrote, as for torch.save. "
        "`restore` reads each blob into memory and copies it into the tensors the `StateDict` holds (in place). "
        "torchsnapshot 0.1.0 cannot save a bf16 tensor of odd length with this torch (its byte view goes through a "
        "float32 tensor and drops the last 2 bytes; `take` fails its own size check): the benchmark replaces that "
        "helper by a plain uint8 view of the same bytes (no copy either way).",
        "- Loads are verified bitwise against the saved state (outside the timing)." if not args.no_verify
        else "- Loads were not verified (`--no-verify`).",
        f"- Wall time of this part (state built, warm-up, timed rounds): {info['part1_s']:.0f} s.",
    ]
    contention = f"save/load part: {info['contention']}"
    if reshard is not None:
        reshard_lines, reshard_metrics, reshard_goals = reshard_section(reshard, args)
        body += ["", *reshard_lines]
        metrics += reshard_metrics
        goals += reshard_goals
        body += [goal_line(g, 2) for g in reshard_goals]
        contention += f"; reshard part: {reshard['contention']}"
    body += ["", *provenance(info["machine"], command, load=contention)]
    return "\n".join(body), metrics, goals
