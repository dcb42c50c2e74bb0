"""The scaling benchmark's section: its tables (stall and durable per system and point, ratios to the
bare copy) and its notes (the compute per step, the two checks, the peers' waits, the stall's parts,
the bare copy's two copies, peak RSS, failed points), from the measured :class:`~scaling_points.Point` s.
"""

from __future__ import annotations

import argparse
import os

from harness import median  # first: puts this checkout's root on sys.path

from report import goal_line, ms_span, provenance, table_head  # noqa: E402
from scaling_points import MIN_STEP_S, Point  # noqa: E402
from scaling_systems import SYSTEMS  # noqa: E402
from states import MiB  # noqa: E402

SECTION = "## Scaling: stall vs state size and ranks"


def size_label(nbytes: int) -> str:
    return f"{nbytes / 2**30:.3g} GiB" if nbytes >= 2**30 else f"{nbytes / MiB:.0f} MiB"


def axis_table(points: dict[str, list[Point]], columns: list[str], durable: bool = False) -> list[str]:
    """Rows systems, a 'median (min–max)' column per point, then (stall) a column per point of the
    median ÷ bare copy's median in the same run."""
    copy = points.get("copy")
    ratios = not durable and copy is not None
    names = ["System", *columns, *([f"× bare copy, {c}" for c in columns] if ratios else [])]
    lines = table_head(names, "l" + "r" * (len(names) - 1))
    for key, row in points.items():
        if durable and not SYSTEMS[key].writes:
            continue
        cells = [f"failed: {p.error}" if p.error else ms_span(p.durables if durable else p.stalls)
                 + (" **inconsistent**" if p.verified is False or p.consistent is False else "") for p in row]
        if ratios:
            cells += ["–" if r is None else f"{r:.3f}" for r in ratio_over(points, key)]
        lines.append(f"| {SYSTEMS[key].label} | " + " | ".join(cells) + " |")
    return lines


def ratio_over(points: dict[str, list[Point]], key: str) -> list[float | None]:
    """Median stall of ``key`` ÷ bare copy's, per point."""
    out = []
    for p, c in zip(points.get(key, []), points.get("copy", [])):
        ok = not p.error and not c.error and p.stalls and c.stalls
        out.append(median(p.stalls) / median(c.stalls) if ok else None)
    return out


def report(sizes: dict[str, list[Point]], ranks: dict[str, list[Point]], info: dict, args: argparse.Namespace,
           command: str, goal_list: list[dict]) -> str:
    body = [
        SECTION,
        "",
        "How the checkpoint stall grows with the state and with the ranks, one row per system, all measured in this "
        "run. State: 8 fp32 weight matrices of 1024 columns with biases, plus AdamW-like `exp_avg`/`exp_avg_sq` of "
        "the same shapes and a `step` scalar each (weights + optimizer state, plain tensors in nested dicts). "
        "**The job emulates an accelerator job whose host is free while the device computes**: one step = "
        f"a sleep (the compute) then an in-place `add_(1)` of every state tensor (the optimizer step: the "
        f"first moment the state changes, so a snapshot not yet taken must finish first, and what was saved can be "
        f"checked against the state at save time). The compute lasts until the save just made is durable (at least "
        f"{MIN_STEP_S} s): each system's background work fits in a step, so no save waits for the one before it (the "
        "regime asynchronous checkpointing is for; back-pressure is not measured here). A save every step: one untimed, "
        "drained warm-up save (first-call costs: buffers, thread pools, caches), then "
        f"{args.saves} timed ones. **Stall** = time inside the save call + time waited before the next update, on "
        "the training thread; cells are **milliseconds, median (min–max) over the saves**; *× bare copy* divides "
        "medians. Each system runs in a fresh process per point (forked after the imports).",
        "",
        "### Stall per save vs state size (1 process)",
        "",
        *axis_table(sizes, [size_label(p.state_bytes or p.x) for p in next(iter(sizes.values()), [])]),
        "",
        "Time until the save was durable/committed, ms from the save call (secondary):",
        "",
        *axis_table(sizes, [size_label(p.state_bytes or p.x) for p in next(iter(sizes.values()), [])], durable=True),
        "",
    ]
    if ranks:
        body += [
            f"### Stall per save vs ranks ({size_label(info['ranks_bytes'])} in total, sharded evenly)",
            "",
            f"N processes on one machine, gloo over loopback (`init_process_group` on 127.0.0.1), "
            f"`torch.set_num_threads(max(1, {os.cpu_count()} // N))`; each rank holds 1/N of every matrix's rows "
            "(plain tensors under rank-distinct keys) and saves them; the ranks line up with a barrier before each "
            "save (the step's all-reduce), and a save's stall is the **max over ranks** of each rank's stall (durable: "
            f"the max where known). **This machine has {os.cpu_count()} cores: 4 ranks are oversubscribed** (each "
            "rank's training thread, staging and writer threads share the cores with the others'), so the 4-rank "
            "column measures contention as much as scaling. With ≥ 2 ranks ours' `save()` holds one small collective "
            "(the ranks agree on failures, free buffers and deltas), so its stall includes waiting for the slowest rank "
            "to reach `save()`; DCP's planning collectives run in its upload thread, torch.save has none.",
            "",
            *axis_table(ranks, [f"{p.x} rank{'s' if p.x > 1 else ''}" for p in next(iter(ranks.values()), [])]),
            "",
            "Time until durable/committed, ms (secondary):",
            "",
            *axis_table(ranks, [f"{p.x} rank{'s' if p.x > 1 else ''}" for p in next(iter(ranks.values()), [])],
                        durable=True),
            "",
        ]
    body += ["Goals:", ""]
    body += [goal_line(g) for g in goal_list]
    body += ["", "Notes:", ""]
    body += [f"- *{SYSTEMS[k].label}*: {SYSTEMS[k].note}." for k in {**sizes, **ranks}]
    body += notes(sizes, ranks, info)
    body += ["", *provenance(info["machine"], command, load=info["load"], extra=info["extra"])]
    return "\n".join(body)


def notes(sizes: dict[str, list[Point]], ranks: dict[str, list[Point]], info: dict) -> list[str]:
    out = []
    steps = []
    for axis, points, label in (("size", sizes, lambda p: size_label(p.state_bytes or p.x)),
                                ("ranks", ranks, lambda p: f"{p.x}r")):
        for k, row in points.items():
            ok = [p for p in row if not p.error]
            if ok:
                steps.append(f"{SYSTEMS[k].label} ({axis}): " + ", ".join(
                    f"{label(p)} {median(p.compute):.2f}" for p in ok))
    out.append("- Emulated compute per step (until the save was durable, at least "
               f"{MIN_STEP_S} s), median s: " + "; ".join(steps) + ".")
    def label_of(axis: str, p: Point) -> str:
        return size_label(p.state_bytes) if axis == "size" else f"{p.x} ranks"

    every = [(axis, k, p) for axis, pts in (("size", sizes), ("ranks", ranks)) for k, row in pts.items() for p in row]
    whole = [(a, k, p) for a, k, p in every if p.verified is not None]
    bad_whole = [f"{SYSTEMS[k].label} at {label_of(a, p)}" for a, k, p in whole if not p.verified]
    out.append("- Check 1, outside the timing: the last timed save, loaded back whole (ours: `manager.load(step=, "
               "strict=False)`; DCP: `dcp.load`; torch.save: `torch.load`; torchsnapshot: `Snapshot.read_object` per "
               "entry), equals the state at save time, bit for bit, on every rank; run at the smallest size and at the "
               f"most ranks ({len(whole)} points): "
               + ("all equal." if not bad_whole else "**mismatch**: " + "; ".join(bad_whole) + "."))
    contract = [(a, k, p) for a, k, p in every if p.consistent is not None]
    bad = [f"{SYSTEMS[k].label} at {label_of(a, p)}" for a, k, p in contract if not p.consistent]
    out.append("- Check 2, the snapshot contract, at every point: one more save, untimed, of layer 0 (weight, bias and "
               "their optimizer state: 1/8 of the state, the same tensor sizes), then the update at once, right where "
               "the system allows it (after the call and its pre-step wait; no compute in between), then loaded back "
               f"and compared with the state at the call ({len(contract)} points): "
               + ("all consistent." if not bad else "**inconsistent** (cells marked so in the tables): "
                  + "; ".join(bad) + ". An inconsistent save holds values changed after its call returned: it did not "
                  "snapshot the state, so its stall leaves out the copy a consistent checkpoint needs. In the timed loop "
                  "the compute lasts until the save is durable, which hides this."))
    waits = {}
    for points in (sizes, ranks):
        for k, row in points.items():
            for p in row:
                if "wait previous" in p.parts and not p.error:
                    waits[k] = max(waits.get(k, 0.0), median(p.parts["wait previous"]))
    if waits:
        out.append("- Of the peers' stall, the wait for their previous save (one in flight; the compute rule keeps it "
                   "near 0), largest median over the points: "
                   + "; ".join(f"{SYSTEMS[k].label} {v * 1e3:.1f} ms" for k, v in waits.items()) + ".")
    split = [f"{SYSTEMS[k].label} {median(p.parts['in save']) * 1e3:.1f} + {median(p.parts['wait before update']) * 1e3:.1f}"
             for k, row in sizes.items() if row and not row[-1].error and SYSTEMS[k].writes for p in [row[-1]]]
    if split:
        out.append(f"- The stall's two parts at {size_label(sizes['ours'][-1].state_bytes) if sizes.get('ours') else 'the largest size'}, "
                   "median ms, in the save call + waited before the update: " + "; ".join(split) + ".")
    copies = [f"{size_label(p.state_bytes)} " + " / ".join(f"{median(v) * 1e3:.1f} ({name})" for name, v in p.parts.items()
                                                         if "thread" in name)
              for p in sizes.get("copy", []) if not p.error]
    if copies:
        out.append("- Bare copy, both copies of each save (median ms; the row counts the faster per save): "
                   + "; ".join(copies) + ".")
    big = [(k, row[-1]) for k, row in sizes.items() if row and not row[-1].error]
    if big:
        p0 = big[0][1]
        out.append(f"- Peak RSS growth of the process at {size_label(p0.state_bytes)} (state included), GiB: "
                   + "; ".join(f"{SYSTEMS[k].label} {p.peak_rss_growth / 2**30:.2f}" for k, p in big)
                   + (f"; ours' host buffers (`stats.host_buffer_bytes`) "
                      f"{next(p.host_buffer_bytes for k, p in big if k == 'ours') / p0.state_bytes:.2f}× the state"
                      if any(k == "ours" and p.host_buffer_bytes for k, p in big) else "") + ".")
    failed = [f"{SYSTEMS[k].label} at {p.x}: {p.error}" for pts in (sizes, ranks) for k, row in pts.items()
              for p in row if p.error]
    if failed:
        out.append("- Failed points: " + "; ".join(failed) + ".")
    out.append("- On this CPU-only box the background copy and write share the 2 cores with the `add_` update and "
               "with other processes; the sleep stands for device compute, during which a real host is idle. A sync "
               "system's stall does not depend on the step length; an async one's does only when its background "
               "work outlasts the step.")
    return out
