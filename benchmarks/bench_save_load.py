#!/usr/bin/env python
"""Save/load throughput of the ckpt engine against its peers, and resharded loads, in one run (issues 2, 15).

    python benchmarks/bench_save_load.py --tiny                                  # the tests' run: 10 MiB states
    python benchmarks/bench_save_load.py --quick --json /tmp/save_load.json     # smoke run, < 30 s
    python benchmarks/bench_save_load.py --gib 1 --repeats 3 --reshard-gib 1 --out benchmarks/RESULTS.md

Part 1, one process. A synthetic training state of about ``--gib`` GiB (a realistic mix: a few
large fp32 matrices, a few bf16 matrices, some medium fp32 tensors and 200 tensors of a few KB,
random values) is saved and loaded back by every method below. Each repeat runs every method once
(save, then load), in an order rotated per repeat so that slow drifts of the machine hit all methods
alike; the table reports the median over repeats, and the ratios to raw are paired per repeat: a
save with raw's save of the same repeat, a load with a raw read of the same bytes (a file written
once, untimed, at the start) timed right next to it, before or after it alternating per repeat, since
this box's virtual disk swings 0.4-3 GiB/s over seconds.

What is timed (``time.perf_counter`` around the call only; deleting old output, dropping the page
cache, zeroing the destination and verifying the result are outside the timing):

raw            save: ``os.write`` of every tensor's bytes back to back into one file, then
               ``fsync`` - the physical limit of one writer. load: ``os.preadv`` of the whole file
               (64 MiB per call) into one preallocated, pre-faulted buffer.
ours           save: ``ckpt.save(state, dir)`` - everything up to and including the atomic commit
               (data fsync, manifest, rename, directory fsyncs). load: ``ckpt.load(state, dir)``
               into the live tensors in place, checksums verified.
ours (DCP plug-in)  ``dcp.save(sd, storage_writer=ckpt.dcp.Writer(dir), no_dist=True)`` and
               ``dcp.load(sd, storage_reader=ckpt.dcp.Reader(dir), no_dist=True)`` (DCP's default
               planners).
DCP            ``dcp.save(sd, storage_writer=FileSystemWriter(dir), no_dist=True)`` (defaults:
               one file per rank, ``sync_files=True`` i.e. fsync'd, one thread) and
               ``dcp.load(sd, storage_reader=FileSystemReader(dir), no_dist=True)`` in place.
torch.save     save: ``torch.save(sd, file)`` then ``fsync`` of the file (included in the time).
               load: ``torch.load(file, mmap=False, weights_only=True)`` into fresh tensors, then
               ``copy_`` into the live tensors (included).
safetensors    save: ``safetensors.torch.save_file(sd, file)`` then ``fsync`` (included).
               load: ``safetensors.torch.load_file(file)`` then ``copy_`` into the live tensors.
torchsnapshot  save: ``Snapshot.take(dir, app_state={"s": StateDict(**sd)})``, then ``fsync`` of
               every file it wrote (included: torchsnapshot itself only writes and closes its
               files, through aiofiles, and never fsyncs). load: ``Snapshot(dir).restore(app_state)``
               with a ``StateDict`` over the live tensors: torchsnapshot reads into the tensors the
               stateful's ``state_dict()`` returns, i.e. in place (the bitwise check of the live
               tensors afterwards proves it).

Part 2, four processes (``reshard_load.py``; ``--no-reshard`` skips it): a sharded state of
``--reshard-gib`` GiB (four fp32 matrices as DTensors, ``Shard(0)`` on a CPU mesh of 2 ranks, gloo
on 127.0.0.1) is saved once by ours (``ckpt.save``/``ckpt.load``) and by DCP
(``FileSystemWriter``/``FileSystemReader``), then loaded into the same layout, into 4 ranks
``Shard(0)`` and into 2 ranks ``Shard(1)``; saved on 4 ranks FSDP×TP and loaded as FSDP 2, saved by 2
pipeline stages and loaded by one process (against a one-process save); load time = the slowest rank, cold cache, each shard
verified bitwise against the full tensor. See that module's docstring.

Before every timed operation the script runs ``sync`` and, when it may (root), drops the page cache
(``echo 3 > /proc/sys/vm/drop_caches``), so writes start with no dirty pages and reads are cold;
when it may not, reads are warm and the report says so. Throughput is state bytes (tensor payload,
not file size) / seconds, in GB/s (10^9 bytes).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import safetensors
import torch
import torch.distributed.checkpoint as dcp

from harness import (  # first: puts this checkout's root on sys.path
    Load, argument_parser, drop_caches, machine_description, median, remove, rotated, timed, work_dir,
)

import ckpt  # noqa: E402
import ckpt.dcp  # noqa: E402
import peers  # noqa: E402
import reshard_load  # noqa: E402  (next to this script: the multi-process part)
from report import (  # noqa: E402
    command_line, goal, goal_line, median_span, metric, provenance, publish, ratio_span, table_head, verdict, write_json,
)
from states import describe_mixed, mixed_state, state_bytes, zeros_like  # noqa: E402

BENCH_NAME = "save_load"
SECTION = "## Save/load throughput (issue 2)"
GOAL_SAVE_X_RAW = 1.0  # issue 15: ours saves at least as fast as raw write+fsync
GOAL_LOAD_X_RAW = 0.95  # issue 15: ours loads at 0.95x raw read or better
GOAL_RESHARD_X_SAME = 1.15  # issue 27: a resharded load takes at most 1.15x the same-layout load
QUICK = {"gib": 0.25, "repeats": 1, "reshard_gib": 0.125}
TINY = {"gib": 0.01, "repeats": 1, "reshard_gib": 0.01}  # the tests' smoke run
FULL = {"gib": 1.0, "repeats": 9, "reshard_gib": 1.0}  # 9: the benchmark box's virtual disk swings 0.4-3 GiB/s over seconds

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", message="TypedStorage is deprecated")  # torchsnapshot 0.1.0, every save


# ---------------------------------------------------------------------------------------------
# Methods
# ---------------------------------------------------------------------------------------------
@dataclass
class Method:
    label: str  # the system's name in the tables, the JSON and the plots
    calls: str  # what it calls
    target: str  # file or directory name in the work dir
    save: Callable[[dict, Path], None]
    load: Callable[[dict, Path], None]
    note: str = ""
    save_times: list[float] = field(default_factory=list)
    load_times: list[float] = field(default_factory=list)
    raw_load_times: list[float] = field(default_factory=list)  # the raw read timed next to each load
    size: int = 0


def _dir_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def ckpt_save(state: dict, path: Path) -> None:
    ckpt.save(state, path)


def ckpt_load(state: dict, path: Path) -> None:
    ckpt.load(state, path)


def plugin_save(state: dict, path: Path) -> None:
    dcp.save(state, storage_writer=ckpt.dcp.Writer(path), no_dist=True)


def plugin_load(state: dict, path: Path) -> None:
    dcp.load(state, storage_reader=ckpt.dcp.Reader(path), no_dist=True)


METHOD_KEYS = ("raw", "ckpt", "plugin", "dcp", "torch", "safetensors", "torchsnapshot")


def build_methods(nbytes: int, selected: list[str] | None) -> tuple[list[Method], peers.Raw]:
    raw = peers.Raw(nbytes)
    methods = {
        "raw": Method("raw", "os.write + fsync / os.preadv", "raw.bin", raw.save, raw.load,
                      "one file; load into one pre-faulted buffer"),
        "ckpt": Method("ours", "ckpt.save / ckpt.load", "ckpt", ckpt_save, ckpt_load, "incl. commit; checksums verified"),
        "plugin": Method("ours (DCP plug-in)", "ckpt.dcp.Writer / Reader", "plugin", plugin_save, plugin_load,
                         "through dcp.save / dcp.load"),
        "dcp": Method("DCP", "FileSystemWriter / Reader", "dcp", peers.dcp_save, peers.dcp_load, "sync_files=True"),
        "torch": Method("torch.save", "torch.save / torch.load", "torch.pt", peers.torch_save, peers.torch_load_into,
                        "+fsync; load + copy_"),
        "safetensors": Method("safetensors", "save_file / load_file", "model.safetensors", peers.safetensors_save,
                              peers.safetensors_load_into,
                              "+fsync; load + copy_"),
        "torchsnapshot": Method("torchsnapshot", "Snapshot.take / restore", "snapshot", peers.snapshot_take, peers.snapshot_restore,
                                "+fsync of its files; restore in place"),
    }
    wanted = set(selected or METHOD_KEYS) | {"raw"}  # raw is always measured: it is the yardstick
    return [m for key, m in methods.items() if key in wanted], raw


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------
def verify(live: dict, reference: dict, what: str) -> None:
    for key, t in reference.items():
        if not torch.equal(live[key], t):
            raise RuntimeError(f"{what}: {key} differs after load")


def warm_up(methods: list[Method], reference: dict, work: Path) -> None:
    """Untimed: lazy imports and first-call costs of every library, then one full-size raw write."""
    small = {k: v for k, v in reference.items() if k.startswith("model.layers.")}
    small_live = {k: torch.empty_like(v) for k, v in small.items()}
    for m in methods:
        target = work / ("warmup-" + m.target)
        if m.label == "raw":
            peers.Raw.save(small, target)
        else:
            m.save(small, target)
            m.load(small_live, target)
        remove(target)
    # The first big write of a process is often several times slower than the next ones
    # here (fresh page cache); absorb it outside the timing so it does not land on one method.
    target = work / "warmup-full.bin"
    peers.Raw.save(reference, target)
    remove(target)


def run(args: argparse.Namespace, work: Path, info: dict) -> list[Method]:
    """Part 1: every method saves and loads the state once per repeat."""
    t0 = time.perf_counter()
    reference = mixed_state(args.gib, seed=0)
    live = zeros_like(reference)
    nbytes = state_bytes(reference)
    info["nbytes"] = nbytes
    info["state"] = describe_mixed(reference)
    print(f"state: {info['state']} (built in {time.perf_counter() - t0:.1f}s)", flush=True)

    methods, raw = build_methods(nbytes, args.methods)
    if not args.no_warmup:
        warm_up(methods, reference, work)
    if not args.no_reshard:  # the reshard part's forkserver, started in main(), must be idle from here on
        reshard_load.wait_forkserver()

    yardstick = work / "raw-yardstick.bin"  # read raw right next to every other method's load
    peers.Raw.save(reference, yardstick)
    load = Load()
    for rep in range(args.repeats):
        for m in rotated(methods, rep):
            target = work / m.target
            drop_caches(info["cold"])
            ts = timed(lambda: m.save(reference, target))
            m.size = _dir_size(target)
            for t in live.values():  # outside the timing: prove the load really writes
                t.zero_()
            if m.label != "raw" and rep % 2 == 1:  # which of the two goes first alternates per repeat
                m.raw_load_times.append(raw_read(raw, yardstick, info["cold"]))
            drop_caches(info["cold"])
            tl = timed(lambda: m.load(live, target))
            if not args.no_verify:
                if m.label == "raw":
                    raw.verify(reference)
                else:
                    verify(live, reference, m.label)
            if m.label != "raw" and rep % 2 == 0:
                m.raw_load_times.append(raw_read(raw, yardstick, info["cold"]))
            m.save_times.append(ts)
            m.load_times.append(tl)
            print(f"[{rep + 1}/{args.repeats}] {m.label:20s} save {ts:7.3f}s {nbytes / ts / 1e9:6.2f} GB/s"
                  f" | load {tl:7.3f}s {nbytes / tl / 1e9:6.2f} GB/s", flush=True)
        # Outputs are deleted once a repeat is over, not between methods: on this VM's disk (ext4 with
        # online discard) a write right after a large delete ran up to ~2x slower, which used to land
        # on whichever method followed raw in the rotation (always the same one).
        for m in methods:
            remove(work / m.target)
    remove(yardstick)
    info["contention"] = load.stop().describe("during the timed rounds")
    info["part1_s"] = time.perf_counter() - t0
    return methods


def raw_read(raw: peers.Raw, path: Path, cold: bool) -> float:
    """Seconds of one raw read of ``path`` (after a cache drop when ``cold``)."""
    drop_caches(cold)
    return timed(lambda: raw.load({}, path))


def run_reshard(args: argparse.Namespace, work: Path, info: dict) -> dict:
    """Part 2: resharded loads on 2 and 4 ranks (reshard_load.py)."""
    load = Load()
    result = reshard_load.run(args.reshard_gib, args.repeats, work / "reshard", info["cold"],
                              check=not args.no_verify)
    result["contention"] = load.stop().describe("during the reshard part")
    result["cold"] = info["cold"]
    return result


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------
def ratios(numerators: list[float], denominators: list[float]) -> list[float]:
    """Per-repeat ratios of paired measurements (the same repeat of two methods)."""
    return [a / b for a, b in zip(numerators, denominators)]


def load_x_raw(m: Method, raw: Method) -> list[float]:
    """Per repeat, the raw read timed right next to ``m``'s load / ``m``'s load (1s for raw)."""
    return ratios(m.raw_load_times or raw.load_times, m.load_times)


def by_label(methods: list[Method]) -> dict[str, Method]:
    return {m.label: m for m in methods}


def ours_goals(methods: list[Method]) -> tuple[list[dict], list[str]]:
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
        save_x, load_x = ratios(raw.save_times, m.save_times), load_x_raw(m, raw)
        goals.append(goal(f"{label} save ≥ {GOAL_SAVE_X_RAW}× raw write+fsync", median(save_x), GOAL_SAVE_X_RAW, ">=",
                          detail(save_x, f"raw save s / {label} save s")))
        goals.append(goal(f"{label} load ≥ {GOAL_LOAD_X_RAW}× raw read", median(load_x), GOAL_LOAD_X_RAW, ">=",
                          detail(load_x, f"raw load s (timed next to it) / {label} load s")))
        text = [f"save ≥ {GOAL_SAVE_X_RAW}× raw write+fsync: {verdict(goals[-2]['met'])} ({ratio_span(save_x, '×')})",
                f"load ≥ {GOAL_LOAD_X_RAW}× raw read: {verdict(goals[-1]['met'])} ({ratio_span(load_x, '×')})"]
        if dcp_m is not None:
            vs_dcp = ratios(dcp_m.save_times, m.save_times)
            goals.append(goal(f"{label} save not slower than DCP", median(vs_dcp), 1.0, ">=",
                              detail(vs_dcp, f"DCP save s / {label} save s")))
            load_vs_dcp = ratios(dcp_m.load_times, m.load_times)
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


def main_table(methods: list[Method], nbytes: int) -> list[str]:
    raw = by_label(methods)["raw"]
    lines = table_head(["Method", "Calls", "Save GB/s", "Save × raw", "Load GB/s", "Load × raw", "Save s (min–max)",
                        "Load s (min–max)", "On disk", "Notes"], "ll" + "r" * 7 + "l")
    for m in methods:
        save_x, load_x = ratios(raw.save_times, m.save_times), load_x_raw(m, raw)
        lines.append(
            f"| {m.label} | `{m.calls}` | {nbytes / median(m.save_times) / 1e9:.2f} | {ratio_span(save_x)} "
            f"| {nbytes / median(m.load_times) / 1e9:.2f} | {ratio_span(load_x)} "
            f"| {median_span(m.save_times)} | {median_span(m.load_times)} | {m.size / 2**20:.1f} MiB | {m.note} |"
        )
    return lines


def main_metrics(methods: list[Method], nbytes: int) -> list[dict]:
    raw = by_label(methods)["raw"]
    out = []
    for m in methods:
        out.append(metric(m.label, "save_gbps", "GB/s", [nbytes / t / 1e9 for t in m.save_times]))
        out.append(metric(m.label, "load_gbps", "GB/s", [nbytes / t / 1e9 for t in m.load_times]))
        if m is not raw:
            out.append(metric(m.label, "save_x_raw", "×", ratios(raw.save_times, m.save_times)))
            out.append(metric(m.label, "load_x_raw", "×", load_x_raw(m, raw)))
    return out


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
                xs = paired(res, s, layout)
                metrics.append(metric(s, "load_x_same_layout", "×", xs, layout=layout))
                vs_same = ratio_span(xs) + ("" if reference[layout] == same else f" vs {reference[layout]}")
                if s == "ours":
                    goals.append(goal(f"ours resharded load {layout} ≤ {GOAL_RESHARD_X_SAME}× same layout",
                                      median(xs), GOAL_RESHARD_X_SAME, "<=",
                                      f"median over {len(xs)} repeat(s) of {layout} load s / {reference[layout]} "
                                      f"load s timed next to it, per repeat; min–max {min(xs):.2f}–{max(xs):.2f}; "
                                      f"DCP's: {median(paired(res, 'DCP', layout)):.2f}"
                                      + _against_source(times, layout, source[layout], reference[layout])))
            row += f" {median_span(ts)} | {nbytes / median(ts) / 1e9:.2f} | {vs_same} |"
        row += f" {ratio_span(ratios(times[('DCP', layout)], times[('ours', layout)]))} |"
        row += " " + " / ".join(read_x(s, layout, 0) for s in systems) + " |"
        row += " " + " / ".join(read_x(s, layout, 1) for s in systems) + " |"
        lines.append(row)
    return lines, metrics, goals


def paired(res: dict, system: str, layout: str) -> list[float]:
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


def report(methods: list[Method], info: dict, reshard: dict | None, args: argparse.Namespace,
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


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__doc__, keep=True)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run (< 30 s on 2 cores): " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items())
                        + " unless given")
    parser.add_argument("--tiny", action="store_true",
                        help="the tests' smoke run: " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in TINY.items()))
    parser.add_argument("--gib", type=float, help=f"state size in GiB (default {FULL['gib']})")
    parser.add_argument("--repeats", type=int, help=f"rounds per method and per reshard layout (default {FULL['repeats']})")
    parser.add_argument("--reshard-gib", type=float,
                        help=f"size of the sharded state of the reshard part in GiB (default {FULL['reshard_gib']})")
    parser.add_argument("--no-reshard", action="store_true", help="skip the multi-process reshard part")
    parser.add_argument("--methods", nargs="+", choices=METHOD_KEYS, help="subset of part 1 (raw is always included)")
    parser.add_argument("--warm", action="store_true", help="do not drop the page cache (warm reads)")
    parser.add_argument("--no-verify", action="store_true", help="skip the bitwise check after each load")
    parser.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up round of part 1")
    args = parser.parse_args(argv)
    for key, value in (TINY if args.tiny else QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.repeats < 1 or args.gib <= 0 or args.reshard_gib <= 0:
        parser.error("--repeats must be >= 1, --gib and --reshard-gib > 0")

    command = command_line("bench_save_load.py", argv)
    with work_dir(args.dir, "save_load-", keep=args.keep) as work:
        info: dict = {"machine": machine_description(work, [f"safetensors {safetensors.__version__}",
                                                             f"torchsnapshot {_version('torchsnapshot')}",
                                                             f"torch threads {torch.get_num_threads()}"])}
        print(f"work dir: {work}", flush=True)
        info["cold"] = drop_caches(not args.warm)
        print("reads: " + ("cold (page cache dropped before every timed operation)" if info["cold"] else
                           "warm (page cache NOT dropped: " + ("--warm given" if args.warm else "not permitted") + ")"),
              flush=True)
        if not args.no_reshard:  # it imports torch and ckpt (still in the page cache) while part 1 sets up
            reshard_load.start_forkserver()
        methods = run(args, work, info)
        reshard = None if args.no_reshard else run_reshard(args, work, info)
    section, metrics, goals = report(methods, info, reshard, args, command)
    publish(section, args.out)
    write_json(args.json, BENCH_NAME, section, command, metrics=metrics, goals=goals,
               params={"gib": args.gib, "repeats": args.repeats, "state_bytes": info["nbytes"], "cold": info["cold"],
                       "reshard_gib": None if args.no_reshard else args.reshard_gib,
                       "reshard_state_bytes": None if reshard is None else reshard["nbytes"],
                       "methods": [m.label for m in methods], "quick": args.quick})
    return 0


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


if __name__ == "__main__":
    sys.exit(main())
