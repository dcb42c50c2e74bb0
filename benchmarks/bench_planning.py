#!/usr/bin/env python
"""Load planning per rank against manifests of 1,024 … 8,192 ranks: ours vs DCP, and its growth (issue 27).

    python benchmarks/bench_planning.py --json /tmp/planning.json       # 1k, 2k, 4k, 8k ranks (~2 min)
    python benchmarks/bench_planning.py --quick                         # 1k and 2k ranks, one repeat
    python benchmarks/bench_planning.py --tiny                          # the tests' run: 16 and 32 ranks

No processes: one rank's load is planned against a synthetic manifest of W saving ranks
(``tests/support/big_manifest.py``): ``--tensors`` (default 8) float32 tensors, each saved by every
rank as one chunk, so the manifest holds ``tensors × W`` chunks. Two layouts: ``rows`` (FSDP: each
tensor's rows split over the ranks) and ``columns`` (a tall matrix's columns split over the ranks:
TP column shards, every saved chunk starting at row 0 — the case where DCP's sweep keeps every saved
chunk active). The planning rank is the last one (the end of any sweep), its live tensors shards
of the same layout (a same-layout resume).

What a rank does before its first read, timed per step in CPU seconds of this (single-threaded)
process (``time.process_time`` after ``gc.collect``: on a shared box the wall clock mostly measures
the other tenants; the wall-clock totals are shown beside), the median of ``--repeats``, default 5;
every repeat plans every (layout, world) once, in an order rotated per repeat, the systems too:

  ours  validate  ``ckpt.read_manifest``: the file read, its digest, every field checked
                  (ckpt.format.validate)
        metadata  ``Reader.read_metadata``: DCP's ``Metadata`` rebuilt from the manifest
        plan      ``SafeLoadPlanner``: ``set_up_planner`` + ``create_local_plan`` (the compatibility
                  report, the saved chunks indexed: ckpt/read/local_plan.py)
  DCP   metadata  the equivalent ``Metadata`` read from its ``.metadata`` file and unpickled (what
                  DCP's FileSystemReader does)
        plan      ``DefaultLoadPlanner``: ``set_up_planner`` + ``create_local_plan``

Both plans are checked to hold the same read items. Growth: time at the largest world / time at the
smallest, against the world ratio (8 for 1k → 8k: linear). Goals (``report.goal``): ours grows at
most linearly (growth ≤ 1.25 × the world ratio: a shared box's noise); ours per rank at the largest
world no slower than DCP's in the same run; and under ``--bound`` CPU seconds (default 1.5 for 8
tensors at 8,192 ranks — 65,536 saved chunks, about 23 µs each). The cyclic garbage collector is
paused while the manifest is parsed and the plan built (ckpt/read/gc_pause.py): with it on, both grow
superlinearly (each full collection walks every object built so far).
"""

from __future__ import annotations

import pickle
import time

import gc
from pathlib import Path

from harness import Load, argument_parser, machine_description, median, rotated, work_dir

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner  # noqa: E402

from ckpt import read_manifest  # noqa: E402
from ckpt.dcp import Reader  # noqa: E402
from ckpt.format import MANIFEST_NAME  # noqa: E402
from ckpt import SafeLoadPlanner  # noqa: E402
from report import command_line, goal, goal_line, metric, provenance, publish, table_head, write_json  # noqa: E402
from tests.support.big_manifest import rank_state, sharded_manifest  # noqa: E402

BENCH_NAME = "planning"
WORLDS = [1024, 2048, 4096, 8192]
LAYOUTS = ["rows", "columns"]


def timed(fn) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of ``fn()``, after a ``gc.collect()`` outside the timing."""
    gc.collect()
    cpu, wall = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - cpu, time.perf_counter() - wall


def _items(plan) -> list:
    return sorted((i.dest_index.fqn, tuple(i.storage_index.offset), tuple(i.storage_offsets), tuple(i.lengths))
                  for i in plan.items)


class Case:
    """One (layout, world): its manifest written for ours and for DCP in ``work``; :meth:`once` plans
    with both systems, in rotated order, and appends each step's (cpu, wall) to ``times``."""

    def __init__(self, world: int, layout: str, tensors: int, work: Path):
        self.world, self.layout, self.tensors, self.work = world, layout, tensors, work
        manifest = sharded_manifest(world, layout, tensors)  # not kept: the heap holds only the case at hand
        self.state = rank_state(manifest, world - 1, world, layout)  # the planning rank's live tensors
        raw = manifest.to_json()
        self.ours_dir = work / f"{layout}-{world}"
        self.ours_dir.mkdir(parents=True, exist_ok=True)
        (self.ours_dir / MANIFEST_NAME).write_bytes(raw)
        self.dcp_file = work / f"{layout}-{world}.metadata"
        self.dcp_file.write_bytes(pickle.dumps(manifest.to_dcp_metadata()))
        self.manifest_bytes = len(raw)
        self.times: dict[str, list] = {k: [] for k in ("ours validate", "ours metadata", "ours plan",
                                                       "DCP metadata", "DCP plan")}
        self.plans: dict = {}

    def once(self, rep: int) -> None:
        times, plans = self.times, self.plans

        def ours():
            box = {}
            times["ours validate"].append(timed(lambda: box.setdefault("m", read_manifest(self.ours_dir))))
            reader = Reader(self.ours_dir, manifest=box["m"])
            times["ours metadata"].append(timed(lambda: box.setdefault("md", reader.read_metadata())))
            planner, state = SafeLoadPlanner(), dict(self.state)

            def plan():
                planner.set_up_planner(state, box["md"], False)
                plans["ours"] = planner.create_local_plan()
            times["ours plan"].append(timed(plan))

        def dcp():
            box = {}
            times["DCP metadata"].append(timed(lambda: box.setdefault("md", pickle.loads(self.dcp_file.read_bytes()))))
            planner, state = DefaultLoadPlanner(), dict(self.state)

            def plan():
                planner.set_up_planner(state, box["md"], False)
                plans["DCP"] = planner.create_local_plan()
            times["DCP plan"].append(timed(plan))

        for run in rotated([ours, dcp], rep):
            run()

    def result(self) -> dict:
        if _items(self.plans["ours"]) != _items(self.plans["DCP"]):
            raise SystemExit(f"{self.layout} {self.world}: our read items differ from DCP's")
        return {"times": self.times, "chunks": self.world * self.tensors, "manifest_bytes": self.manifest_bytes,
                "items": len(self.plans["ours"].items)}


def measure_all(worlds: list[int], layouts: list[str], tensors: int, repeats: int, work: Path) -> dict:
    """{layout: {world: result}}: every repeat plans every (layout, world) once, in an order rotated
    per repeat, so that a slow spell of the shared box lands on all sizes alike rather than on all
    repeats of one size (the growth compares the largest world with the smallest)."""
    cases = [Case(world, layout, tensors, work) for layout in layouts for world in worlds]
    for rep in range(repeats):
        for case in rotated(cases, rep):
            case.once(rep)
    return {layout: {c.world: c.result() for c in cases if c.layout == layout} for layout in layouts}


def totals(result: dict, clock: int = 0) -> dict[str, float]:
    """Medians per step and per system; ``clock`` 0: CPU seconds, 1: wall seconds."""
    t = {k: median([x[clock] for x in v]) for k, v in result["times"].items()}
    return {"ours": t["ours validate"] + t["ours metadata"] + t["ours plan"], "DCP": t["DCP metadata"] + t["DCP plan"],
            **t}


def report(results: dict, args, command: str, machine: list[str], load: Load, goals: list[dict]) -> str:
    worlds = args.worlds
    lines = ["## Load planning per rank vs world size, ours vs DCP (bench_planning.py)", "",
             f"One rank (the last) plans a same-layout load against a synthetic manifest of W saving ranks, "
             f"{args.tensors} tensors × W chunks; no processes. CPU seconds per rank, median of {args.repeats} "
             f"(wall-clock totals beside: the box is shared), every repeat planning every (layout, world) once, "
             f"in an order rotated per repeat; "
             f"both plans hold the same read items.", ""]
    for layout in args.layouts:
        lines += [f"### {layout}", ""]
        lines += table_head(["world", "chunks", "manifest MiB", "ours validate", "ours metadata", "ours plan",
                             "**ours total**", "DCP metadata", "DCP plan", "**DCP total**", "ours / DCP",
                             "wall: ours", "wall: DCP"], "l" + "r" * 12)
        for world in worlds:
            r = results[layout][world]
            t, wall = totals(r), totals(r, 1)
            lines.append(f"| {world} | {r['chunks']} | {r['manifest_bytes'] / 2**20:.1f} | {t['ours validate']:.3f} | "
                         f"{t['ours metadata']:.3f} | {t['ours plan']:.3f} | **{t['ours']:.3f}** | "
                         f"{t['DCP metadata']:.3f} | {t['DCP plan']:.3f} | **{t['DCP']:.3f}** | "
                         f"{t['ours'] / t['DCP']:.2f}× | {wall['ours']:.3f} | {wall['DCP']:.3f} |")
        first, last = totals(results[layout][worlds[0]]), totals(results[layout][worlds[-1]])
        lines += ["", f"Growth {worlds[0]} → {worlds[-1]} ranks (world ×{worlds[-1] / worlds[0]:.0f}): ours "
                  f"×{last['ours'] / first['ours']:.1f} (plan alone ×{last['ours plan'] / first['ours plan']:.1f}), "
                  f"DCP ×{last['DCP'] / first['DCP']:.1f} (plan alone ×{last['DCP plan'] / first['DCP plan']:.1f}).",
                  ""]
    lines += [goal_line(g) for g in goals] + [""]
    lines += ["Per rank the floor is the manifest itself: every rank reads and checks all W × tensors chunks, so a "
              "rank's time is linear in W at best; the plan step (matching local against saved chunks) is what can "
              "go superlinear, and ours tests one saved chunk per local chunk here (tests/ckpt/test_planning_scale.py "
              "counts them). The coordinator's global step is not timed here; its compatibility check unions "
              "per-rank reports as long as each rank's own state (no longer an intersection of lists of every "
              "rank-local key: O(W²) with torchtitan's per-rank dataloader keys).", ""]
    lines += provenance(machine, command, load.describe("during the runs"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--worlds", type=int, nargs="+", default=WORLDS)
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=LAYOUTS)
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bound", type=float, default=1.5,
                        help="goal: ours per rank at the largest world, CPU seconds")
    parser.add_argument("--quick", action="store_true", help="1,024 and 2,048 ranks, one repeat")
    parser.add_argument("--tiny", action="store_true", help="the tests' smoke run: 16 and 32 ranks, one repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.worlds, args.repeats = [1024, 2048], 1
    if args.tiny:
        args.worlds, args.repeats = [16, 32], 1
    args.worlds = sorted(args.worlds)
    command = command_line("bench_planning.py", argv)
    machine = machine_description()
    load = Load(processes=True)
    start = time.perf_counter()
    with work_dir(args.dir, "planning-") as work:
        results = measure_all(args.worlds, args.layouts, args.tensors, args.repeats, work)
    load.stop()
    ratio = args.worlds[-1] / args.worlds[0]
    growth = max(totals(results[l][args.worlds[-1]])["ours"] / totals(results[l][args.worlds[0]])["ours"]
                 for l in args.layouts)
    worst = max(totals(results[l][args.worlds[-1]])["ours"] for l in args.layouts)
    vs_dcp = max(totals(results[l][args.worlds[-1]])["ours"] / totals(results[l][args.worlds[-1]])["DCP"]
                 for l in args.layouts)
    goals = [
        goal(f"planning per rank grows at most linearly with the world size ({args.worlds[0]} → {args.worlds[-1]} "
             f"ranks: growth ≤ 1.25 × {ratio:.0f})", growth / ratio, 1.25, "<=",
             f"ours ×{growth:.1f} for a world ×{ratio:.0f}, worst layout; measured = growth / world ratio"),
        goal(f"planning per rank at {args.worlds[-1]} ranks ≤ DCP's (metadata + plan)", vs_dcp, 1.0, "<=",
             "ours / DCP, worst layout"),
        goal(f"planning per rank at {args.worlds[-1]} ranks ≤ {args.bound} CPU s ({args.tensors} tensors)", worst,
             args.bound, "<=", f"ours, worst layout; {worst / (args.worlds[-1] * args.tensors) * 1e6:.1f} µs per saved chunk"),
    ]
    metrics = []
    for layout in args.layouts:
        for world in args.worlds:
            t = totals(results[layout][world])
            for system in ("ours", "DCP"):
                metrics.append(metric(system, f"plan_cpu_per_rank_{layout}", "s", [t[system]], x=world))
    section = report(results, args, command, machine, load, goals)
    publish(section, args.out)
    write_json(args.json, BENCH_NAME, section, command, metrics=metrics, goals=goals,
               params={"worlds": args.worlds, "layouts": args.layouts, "tensors": args.tensors,
                       "repeats": args.repeats, "seconds": round(time.perf_counter() - start, 1)})


if __name__ == "__main__":
    main()
