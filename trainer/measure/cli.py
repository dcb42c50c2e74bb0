"""The measured dry run: the plan, then every rank role's measured peak beside its planned one.

    python -m trainer.train --dry-run --measure --config FILE [plan flags] [--section.key value ...]
    python -m trainer.measure --config FILE [plan flags] [--section.key value ...]

Takes the plan's flags (``--world-size``, ``--device-memory``, ``--storage-gbps``, ``--storage-shared``,
``--json``; :mod:`trainer.plan.cli`) and prints the plan's report followed by a ``Measured`` table:
for each rank role of the report (every rank; or the first, fullest middle and last pipeline
stage) one real training step of the layout at the full world size (:func:`trainer.measure.measure`:
a fake process group, FakeTensorMode, torch's MemTracker), its peak and the plan's, and what was
alive at the measured peak. With ``--json`` the plan's JSON gains ``measured``. A pipeline's roles
are measured one after another, each in a fresh process (DTensor keeps state from one fake world to
the next). Exit codes: those of the plan (2 with one error line for what cannot work, including a
batch the trainer would refuse); time: seconds for the debug model, about a minute per 80 layers'
worth of layer passes at 70B on a CPU core.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

from .. import exits
from ..config import load_config
from .run import Measured, measure
from ..plan.build import plan
from ..plan.cli import plan_options, source_of, split_flags, world_size
from ..plan.report import format_plan

GIB = 2**30


def measure_roles(cfg, world: int, stages: list[int]) -> list[Measured]:
    """The measured step of each of ``stages``: in this process for one role, else each in a fresh one."""
    if len(stages) == 1:
        return [measure(cfg, world, stages[0])]
    out = []
    for stage in stages:
        with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
            out.append(pool.submit(measure, cfg, world, stage).result())
    return out


def comparison(result, measured: list[Measured]) -> list[dict]:
    """One row per rank role: planned and measured peaks (bytes) and their ratio."""
    rows = []
    for role, m in zip(result.roles, measured):
        planned = result.stages[role["stage"]].peak
        rows.append({"role": role["name"], "stage": m.stage, "rank": m.rank, "planned_bytes": planned,
                     "measured_bytes": m.peak, "ratio": m.peak / planned if planned else None,
                     "breakdown": m.breakdown, "seconds": round(m.seconds, 1)})
    return rows


def format_measured(rows: list[dict], world: int) -> str:
    unit, scale = ("GiB", GIB) if max(r["planned_bytes"] for r in rows) >= GIB else ("MiB", 2**20)
    lines = [f"Measured   one training step of this layout on a fake process group of {world} ranks, in one process",
             "           (FakeTensorMode, torch.distributed._tools' MemTracker: every tensor alive, no allocator)",
             f"           {'role':<28}{'planned':>12}{'measured':>12}{'measured/planned':>18}{'time':>8}"]
    for r in rows:
        lines.append(f"           {r['role']:<28}{r['planned_bytes'] / scale:>8.2f} {unit}{r['measured_bytes'] / scale:>8.2f} {unit}"
                     f"{r['ratio']:>18.3f}{r['seconds']:>7.1f}s")
        alive = ", ".join(f"{k.lower()} {v / scale:.2f}" for k, v in r["breakdown"].items() if v)
        lines.append(f"           {'':<28}at the peak ({unit}): {alive}")
    return "\n".join(lines)


def _run(argv: list[str]) -> None:
    own, rest = split_flags(argv)
    cfg = load_config(rest)
    notes: list[str] = []
    world = world_size(cfg, own, notes)
    result = plan(cfg, world, **plan_options(own), source=source_of(rest))
    result.notes[:0] = notes
    cfg.resolve_batch(result.layout["dp_replicate"] * result.layout["dp_shard"])  # what the trainer refuses
    rows = comparison(result, measure_roles(cfg, world, [r["stage"] for r in result.roles]))
    if own.get("--json"):
        print(json.dumps(dict(result.to_dict(), measured=rows), indent=2), flush=True)
    else:
        print(format_plan(result) + "\n\n" + format_measured(rows, world), flush=True)


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit code (0 with the plan and the measurement, 2 for what cannot work)."""
    argv = sys.argv[1:] if argv is None else [a for a in argv if a != "--measure"]
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return exits.DONE
    return exits.run(lambda: _run(argv))
