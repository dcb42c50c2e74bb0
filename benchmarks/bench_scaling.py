#!/usr/bin/env python
"""Checkpoint stall as the state grows and as ranks are added: ours against its peers, one curve each.

    python benchmarks/bench_scaling.py --quick                          # ~25 s on a quiet 2-core box
    python benchmarks/bench_scaling.py --tiny                           # the tests' run: 4 and 8 MiB, 2 ranks
    python benchmarks/bench_scaling.py --out benchmarks/RESULTS.md      # ~9-10 min

The state is model-like: 8 fp32 weight matrices of 1024 columns with their biases (the parameters)
plus AdamW-like ``exp_avg``/``exp_avg_sq`` of the same shapes and a ``step`` scalar per parameter,
as nested dicts of plain tensors ({"model": ..., "optim": {"state": ...}}); no real model is
needed for the size scaling. Values are small integers and halves, so every update is exact.

The training job is emulated so that the host is free while the accelerator computes: one step =
a sleep (the compute) followed by an in-place ``add_(1)`` of every state tensor (the optimizer step:
the first moment the state changes, so a snapshot not yet taken must complete before it). The compute
lasts until the save just made is durable, and at least 0.1 s: every system's background work fits in
a step (the regime asynchronous checkpointing is for), so no save waits for the one before it. Since
that hides a system that writes from the live tensors, an untimed check per point saves once more and
updates at once, right where the system allows it, then compares what was saved (check 2).

The **stall** of a save is the time the training thread is blocked by checkpointing: the time inside
the save call plus any wait before the next in-place update. A save is made every step; each system
runs one untimed warm-up save (drained), then ``--saves`` timed ones; tables show the median and
min-max stall per save. The secondary metric, **durable**, is the time from the save call until the
save was committed (where the system tells).

bare copy          ``dst.copy_(src)`` of every tensor into buffers preallocated and faulted in at
                   set-up: the limit when the copy is not overlapped with compute. Each save copies
                   with the process's intra-op threads and with one; the faster counts.
ours               ``ckpt.CheckpointManager(dir, interval=1)`` (default: async ``double_buffer``),
                   ``save(step, state, force=True)``; ``manager.before_step()`` right before the
                   update (what ``attach(optimizer)`` calls from the optimizer's step pre-hook).
                   Durable: ``on_commit`` (rank 0, after the manifest's commit).
DCP async_save     ``dcp.async_save(state, storage_writer=FileSystemWriter(dir))``, no stager: the
 (default stager)  writer stages (a fresh copy inside the call). DCP allows one save in flight, so
                   the wait for the previous upload counts too. Durable: the upload future.
DCP async_save     the same with ``DefaultStager(StagingOptions(False, False, True, False))``
 (caching stager)  (cached staging storages, copy on a background thread) + the wait for
                   ``staging_completion`` before the update.
torch.save         ``torch.save(state, file)`` + ``fsync``, synchronous.
torchsnapshot      ``Snapshot.async_take(dir, {"state": StateDict(state)})``: it returns once every
                   tensor is cloned (staged), after which the state may change; one in flight, so
                   the wait for the previous one counts. Durable: ``PendingSnapshot.done()`` (its
                   metadata written; its file plug-in does not fsync).

Every system runs in its own fresh process per point (forked from this one after the imports, so the
state and buffers of one never share a heap with another): the size axis in one process per size, the
ranks axis as N processes on gloo over loopback (state of ``--ranks-mb`` split evenly, each rank saving
its row-shards under rank-distinct keys; stall per save = the max over ranks).

The parts live in ``scaling_systems`` (the systems and the job's state), ``scaling_points`` (one point
in fresh processes) and ``scaling_report`` (the section); this script runs the axes and reports.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings
from pathlib import Path

from harness import (  # first: sys.path
    Load, add_modes, apply_mode, argument_parser, machine_description, median, settle, work_dir,
)

import torch  # noqa: E402

from probes import meminfo  # noqa: E402
from report import command_line, goal, metric, publish, write_json  # noqa: E402
from scaling_points import MIN_STEP_S, Point, print_point, run_point, summarize  # noqa: E402
from scaling_report import ratio_over, report, size_label  # noqa: E402
from scaling_systems import SYSTEMS, torchsnapshot  # noqa: E402
from states import MiB  # noqa: E402

BENCH_NAME = "scaling"
GOAL_COPY_RATIO = 0.05
GOAL_FLAT = 2.0
TINY = {"sizes_mb": [4, 8], "ranks": [2], "ranks_mb": 8, "saves": 1}  # the tests' smoke run
QUICK = {"sizes_mb": [32, 64, 128], "ranks": [1, 2], "ranks_mb": 64, "saves": 2}
FULL = {"sizes_mb": [256, 512, 1024, 2048, 4096], "ranks": [1, 2, 4], "ranks_mb": 1024, "saves": 3}  # the defaults

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
warnings.filterwarnings("ignore", message=".*torch.distributed.*not initialized.*")
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed.checkpoint")
logging.getLogger("torchsnapshot").setLevel(logging.WARNING)


def goals(sizes: dict[str, list[Point]]) -> list[dict]:
    """Ours against bare copy at every size, and ours' stall from the smallest size to the largest."""
    out = []
    ratios = ratio_over(sizes, "ours")
    xs = [p.x for p in sizes.get("copy", [])]
    if ratios and None not in ratios:
        worst = max(ratios)
        at = xs[ratios.index(worst)]
        pairs = zip(xs, ratios, sizes["ours"], sizes["copy"])
        detail = ("median stall of ours ÷ median of bare copy, worst over sizes (at " + size_label(at) + "); per size: "
                  + ", ".join(f"{size_label(x)} {median(o.stalls) * 1e3:.1f} / {median(c.stalls) * 1e3:.1f} ms = {r:.3f}"
                              for x, r, o, c in pairs))
        out.append(goal(f"stall ≤ {GOAL_COPY_RATIO}× bare copy at every size", worst, GOAL_COPY_RATIO, "<=", detail))
    else:
        out.append(goal(f"stall ≤ {GOAL_COPY_RATIO}× bare copy at every size", None, GOAL_COPY_RATIO, "<=",
                        "not measured (ours or bare copy missing or failed)"))
    ours = [p for p in sizes.get("ours", []) if not p.error]
    name = f"ours' stall flat in state size (largest ÷ smallest ≤ {GOAL_FLAT})"
    if len(ours) >= 2 and len(ours) == len(sizes["ours"]):
        lo, hi = ours[0], ours[-1]
        flat = median(hi.stalls) / median(lo.stalls)
        copy = {p.x: p for p in sizes.get("copy", []) if not p.error}
        copy_growth = (f"; bare copy grew {median(copy[hi.x].stalls) / median(copy[lo.x].stalls):.1f}× over the same "
                       "sizes" if lo.x in copy and hi.x in copy else "")
        detail = (f"ours' median stall {median(hi.stalls) * 1e3:.1f} ms at {size_label(hi.state_bytes)} ÷ "
                  f"{median(lo.stalls) * 1e3:.1f} ms at {size_label(lo.state_bytes)}, while the state grew "
                  f"{hi.state_bytes / lo.state_bytes:.1f}×{copy_growth}")
        out.append(goal(name, flat, GOAL_FLAT, "<=", detail))
    else:
        out.append(goal(name, None, GOAL_FLAT, "<=", "not measured (fewer than two sizes, or a size failed)"))
    return out


def metrics_of(sizes: dict[str, list[Point]], ranks: dict[str, list[Point]], ranks_bytes: int) -> list[dict]:
    """stall_s and durable_s per system and point; ``axis`` tells the curves apart, ``consistent`` is
    check 2's result (False: the save did not snapshot the state)."""
    out = []
    for axis, points in (("size", sizes), ("ranks", ranks)):
        for key, row in points.items():
            for p in row:
                if p.error:
                    continue
                extra = {"axis": axis, **({"state_bytes": p.state_bytes or ranks_bytes} if axis == "ranks" else {}),
                         **({"consistent": p.consistent} if p.consistent is not None else {})}
                x = p.state_bytes if axis == "size" else p.x
                out.append(metric(SYSTEMS[key].label, "stall_s", "s", p.stalls, x=x, **extra))
                if p.durables:
                    out.append(metric(SYSTEMS[key].label, "durable_s", "s", p.durables, x=x, **extra))
    return out


def series_of(sizes: dict[str, list[Point]], ranks: dict[str, list[Point]]) -> dict:
    """Median per point, per system: the curves of the plots."""
    out: dict[str, dict] = {}
    for axis, points, xof in (("size", sizes, lambda p: p.state_bytes), ("ranks", ranks, lambda p: p.x)):
        for name, attr in (("stall", "stalls"), ("durable", "durables")):
            curves = {SYSTEMS[k].label: [[xof(p), median(getattr(p, attr))] for p in row
                                         if not p.error and getattr(p, attr)] for k, row in points.items()}
            curves = {k: v for k, v in curves.items() if v}
            if curves:
                out[f"{name}_s_vs_{axis}"] = curves
    return out


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------
def run(args: argparse.Namespace, work: Path) -> tuple[dict, dict]:
    """Every system at every size (one process), then at every rank count: the two axes' points."""

    def point(key: str, nbytes: int, x: int, verify: bool, world: int | None, what: str) -> Point:
        t = time.perf_counter()
        measured = summarize(key, x, run_point(key, nbytes, args.saves, verify, work, world))
        print_point(measured, what, time.perf_counter() - t)
        return measured

    sizes: dict[str, list[Point]] = {k: [] for k in args.systems}
    ranks: dict[str, list[Point]] = {k: [] for k in args.systems} if args.ranks else {}
    for i, mb in enumerate(args.sizes_mb):
        nbytes = int(mb * MiB)
        for key in args.systems:
            sizes[key].append(point(key, nbytes, nbytes, i == 0, None, size_label(nbytes)))
        settle()
    for n in args.ranks:
        for key in args.systems:
            ranks[key].append(point(key, int(args.ranks_mb * MiB), n, n == max(args.ranks), n, f"{n} ranks"))
    return sizes, ranks


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__doc__, keep=True)
    add_modes(parser, TINY, QUICK, quick_note=" (~25 s on a quiet box)")
    parser.add_argument("--sizes-mb", type=float, nargs="+",
                        help="state sizes in MiB, one fresh process per size (default 256 512 1024 2048 4096)")
    parser.add_argument("--ranks", type=int, nargs="*", help="rank counts (default 1 2 4; none: skip the ranks axis)")
    parser.add_argument("--ranks-mb", type=float, help="total state in MiB on the ranks axis (default 1024)")
    parser.add_argument("--saves", type=int, help="timed saves per point (default 3)")
    parser.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS),
                        help="systems to run (default all; bare copy is the ratios' reference)")
    args = parser.parse_args(argv)
    apply_mode(args, TINY, QUICK, FULL)
    args.sizes_mb = sorted(args.sizes_mb)
    if args.saves < 1 or min(args.sizes_mb) <= 0 or any(n < 1 for n in args.ranks) or args.ranks_mb <= 0:
        parser.error("--saves, --sizes-mb, --ranks and --ranks-mb must be positive")
    if "torchsnapshot" in args.systems and torchsnapshot is None:
        print("torchsnapshot is not installed: skipped (pip install torchsnapshot)", flush=True)
        args.systems.remove("torchsnapshot")

    need = 3 * max(args.sizes_mb) * MiB  # the state + ours' two host buffer sets
    available = meminfo().get("MemAvailable")
    if available is not None and need > available:
        print(f"warning: the largest point may need {need / 2**30:.1f} GiB of memory; "
              f"{available / 2**30:.1f} GiB is available", flush=True)
    command = command_line("bench_scaling.py", argv)
    t0 = time.perf_counter()
    load = Load(processes=True)
    with work_dir(args.dir, "scaling-", keep=args.keep) as work:
        print(f"work dir: {work}", flush=True)
        machine = machine_description(work, [f"torch threads {torch.get_num_threads()}",
                                             f"torchsnapshot {getattr(torchsnapshot, '__version__', 'missing')}"])
        sizes, ranks = run(args, work)
    wall = time.perf_counter() - t0
    info = {"machine": machine, "load": load.stop().describe("during the run"),
            "ranks_bytes": int(args.ranks_mb * MiB), "extra": [f"Wall time of the run: {wall:.0f} s"]}
    goal_list = goals(sizes)
    section = report(sizes, ranks, info, args, command, goal_list)
    publish(section, args.out)
    write_json(args.json, BENCH_NAME, section, command, metrics=metrics_of(sizes, ranks, info["ranks_bytes"]),
               goals=goal_list, series=series_of(sizes, ranks),
               params={"sizes_mib": args.sizes_mb, "ranks": args.ranks, "ranks_mib": args.ranks_mb,
                       "saves": args.saves, "systems": args.systems, "compute_rule":
                       f"until the save is durable, at least {MIN_STEP_S} s", "wall_s": round(wall, 1)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
