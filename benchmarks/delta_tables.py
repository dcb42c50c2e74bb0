"""The delta benchmark's size tables, its goals and its size figures, from the measured byte counts.

Every figure is stored bytes / raw full bytes of the same state (:func:`pair_ratio`) or a peer's bytes
/ our delta's (:func:`vs`), summarized per flavor and interval as the median (and mean) over the pairs.
:func:`size_tables` gives the two size tables and the values the goals judge, :func:`plane_table` where
our delta's bytes go per byte plane, :func:`delta_goals` the goals (``report.goal`` records; a size goal
is the worst flavor/interval), :func:`goal_notes` their lines, :func:`json_sizes` the ``delta_x_raw``
metrics and the ``delta_ratio`` series.
"""

from __future__ import annotations

import statistics

from delta_sizes import BF16, GROUP_NAMES, GROUPS, KINDS, FlavorRun, PairResult, kind_width
from report import goal, goal_line, metric, table_head

GOAL_DELTA_RAW = 0.6
GOAL_VS_ZSTD = 1.15
GOAL_ENCODE_GBS = 0.4
# The JSON's systems (plot legends, table rows): analyzer key -> label, for the size metrics and series.
SIZE_SYSTEMS = {"delta": "ours (delta)", "zstd1_full": "zstd-1 (full)", "zstd3_full": "zstd-3 (full)",
                "zipnn_full": "zipnn (full)", "zipnn_xor": "zipnn (XOR delta)"}


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def fmt(x, digits=3):
    return "n/a" if x is None else f"{x:.{digits}f}"


def pair_ratio(p: PairResult, a: FlavorRun, group: str, key: str):
    """``key``'s bytes / raw full bytes for a pair (full-state measures: of the pair's current step)."""
    raw = a.analyzer.raw[group]
    value = p.sizes[group].get(key)
    if value is None and key in a.analyzer.full[p.step][group]:
        value = a.analyzer.full[p.step][group][key]
    return None if value is None else value / raw


def vs(p: PairResult, a: FlavorRun, group: str, peer: str):
    """peer bytes / our delta bytes (> 1: ours is smaller)."""
    full = a.analyzer.full[p.step][group]
    value = full[peer] if peer in full else p.sizes[group].get(peer)
    delta = p.sizes[group]["delta"]
    return None if value is None or delta == 0 else value / delta


VS_PEERS = ("zstd1_full", "zstd3_full", "zipnn_full", "zipnn_xor", "zstd1_zigzag")  # peer bytes / ours, in order


def size_tables(runs: list[FlavorRun], intervals: list[int]) -> tuple[list[str], list[str], dict]:
    """Stored / raw per system, and the peers' bytes / ours (median over the pairs of each flavor and
    interval); and per goal the (flavor/interval, value) it judges."""
    cols = [("delta", "**ours delta**"), ("zstd1_full", "zstd-1 full"), ("zstd3_full", "zstd-3 full"),
            ("planes_full", "ours planes full"), ("zipnn_full", "zipnn full"), ("zipnn_xor", "zipnn XOR delta"),
            ("zstd1_zigzag", "zstd-1 of zigzag delta (no planes)"), ("xor_planes", "XOR + our planes"),
            ("entropy0", "order-0 entropy of our delta's planes")]
    t1 = table_head(["Flavor", "Interval", "State", "Pairs", "Raw full", *(c for _, c in cols)],
                    "lrlrr" + "r" * len(cols))
    t2 = table_head(["Flavor", "Interval", "State", "delta / raw (goal ≤ 0.6)", "zstd-1 full / delta (goal ≥ 1.15)",
                     "zstd-3 full / delta", "zipnn full / delta (goal ≥ 1)", "zipnn XOR delta / delta",
                     "zstd-1 zigzag / delta (plane split gain)"], "lrl" + "r" * 6)
    goals: dict = {"delta_raw": [], "vs_zstd": [], "vs_zipnn": [], "vs_zipnn_delta": [], "entropy0": [],
                   "low_planes": []}
    for a in runs:
        for interval in intervals:
            ps = [p for p in a.analyzer.pairs if p.interval == interval]
            if not ps:
                continue
            for group in ("a", "b"):
                raw = a.analyzer.raw[group]
                cells = []
                for key, _ in cols:
                    rs = [pair_ratio(p, a, group, key) for p in ps]
                    m, mu = med(rs), mean(rs)
                    cells.append("n/a" if m is None else (f"{m:.3f} ({mu:.3f})" if len(ps) > 1 else f"{m:.3f}"))
                t1.append(f"| {a.flavor} | {interval} | {GROUP_NAMES[group]} | {len(ps)} | {raw / 1e6:.1f} MB | "
                          + " | ".join(cells) + " |")
                d = med([pair_ratio(p, a, group, "delta") for p in ps])
                v = {peer: med([vs(p, a, group, peer) for p in ps]) for peer in VS_PEERS}  # the second table
                t2.append(f"| {a.flavor} | {interval} | {GROUP_NAMES[group]} | {fmt(d)} | "
                          + " | ".join(fmt(v[peer], 2) for peer in VS_PEERS) + " |")
                if group == "a":
                    tag = f"{a.flavor}/{interval}"
                    goals["delta_raw"].append((tag, d))
                    for name, peer in (("vs_zstd", "zstd1_full"), ("vs_zipnn", "zipnn_full"),
                                       ("vs_zipnn_delta", "zipnn_xor")):
                        goals[name].append((tag, v[peer]))
                    goals["entropy0"].append((tag, med([pair_ratio(p, a, group, "entropy0") for p in ps])))
                    goals["low_planes"] += [med([p.planes[kind][k] / p.plane_len[kind] for p in ps])
                                            for kind in KINDS for k in (0, 1)]
    return t1, t2, goals


def plane_table(runs: list[FlavorRun], intervals: list[int]) -> list[str]:
    lines = table_head(["Flavor", "Interval", "Tensors", "delta / raw", "plane 0 (low byte)", "plane 1", "plane 2",
                        "plane 3 (high byte)", "share of the group's delta", "planes stored raw"], "lrl" + "r" * 7)
    for a in runs:
        for interval in intervals:
            ps = [p for p in a.analyzer.pairs if p.interval == interval]
            if not ps:
                continue
            for kind in (*KINDS, BF16):
                group = "b" if kind == BF16 else "a"
                width = kind_width(kind)
                nplanes = len(ps[0].planes[kind])
                per_plane = [med([p.planes[kind][k] / p.plane_len[kind] for p in ps]) for k in range(nplanes)]
                kind_raw = ps[0].plane_len[kind] * width
                ratio = med([sum(p.planes[kind]) / kind_raw for p in ps])
                share = med([sum(p.planes[kind]) / max(1, p.sizes[group]["delta"]) for p in ps])
                cells = [fmt(x) for x in per_plane] + ["–"] * (4 - nplanes)
                raws = med([p.raw_planes[kind] for p in ps])
                total_planes = a.tensors * width
                label = "bf16 weights" if kind == BF16 else f"fp32 {kind}"
                lines.append(f"| {a.flavor} | {interval} | {label} | {fmt(ratio)} | " + " | ".join(cells)
                             + f" | {fmt(share, 2)} | {raws:g} of {total_planes} |")
    return lines


def worst_goal(name: str, items: list, target: float, direction: str, show, why_none: str, extra: str = "") -> dict:
    """A size goal over every flavor/interval (each value the median over that interval's pairs): the
    worst one is the measured value, all of them are in the detail."""
    vals = [(t, v) for t, v in items if v is not None]
    if not vals:
        return goal(name, None, target, direction, why_none)
    worst = max(v for _, v in vals) if direction == "<=" else min(v for _, v in vals)
    return goal(name, worst, target, direction,
                "the worst flavor/interval (median over its pairs): " + ", ".join(f"{t}: {show(v)}" for t, v in vals)
                + extra)


def delta_goals(goals: dict, methods: list | None, info: dict | None, zipnn_note: str | None) -> list[dict]:
    """The goals this run measured, as report.goal records (the notes print the same); ``methods``:
    codec_speed's, ours first; ``zipnn_note``: why zipnn was not measured, if it was not."""
    no_zipnn = f"not measured: {zipnn_note}" if zipnn_note else "not measured"
    xor = [(t, v) for t, v in goals["vs_zipnn_delta"] if v is not None]
    out = [
        worst_goal(f"ours (delta) ≤ {GOAL_DELTA_RAW}× raw (fp32 weights + AdamW)", goals["delta_raw"], GOAL_DELTA_RAW,
                   "<=", lambda v: f"{v:.3f}×", "not measured: no pair of states"),
        worst_goal(f"ours (delta) ≥ {GOAL_VS_ZSTD}× smaller than zstd-1 of the full state (fp32 weights + AdamW)",
                   goals["vs_zstd"], GOAL_VS_ZSTD, ">=", lambda v: f"{v:.2f}×", "not measured: no pair of states"),
        worst_goal("ours (delta) no larger than zipnn of the full state (fp32 weights + AdamW)", goals["vs_zipnn"],
                   1.0, ">=", lambda v: f"zipnn/ours {v:.2f}×", no_zipnn,
                   ("; for information, zipnn's own XOR delta of the same pair / ours: "
                    + ", ".join(f"{t}: {v:.2f}×" for t, v in xor)) if xor else ""),
    ]
    if methods:
        ours, n = methods[0], info["nbytes"]
        cpu = [n / t / 1e9 for t in ours.enc_cpu]
        wall = [n / t / 1e9 for t in ours.enc_wall]
        out.append(goal(f"encode_delta ≥ {GOAL_ENCODE_GBS} GB/s per core", statistics.median(cpu), GOAL_ENCODE_GBS,
                        ">=", f"one thread, {n / 1e6:.0f} MB of fp32 state, by CPU time: median of {len(cpu)} "
                        f"{statistics.median(cpu):.2f} GB/s (min–max {min(cpu):.2f}–{max(cpu):.2f}); by wall clock "
                        f"on this shared box {statistics.median(wall):.2f} GB/s ({min(wall):.2f}–{max(wall):.2f})"))
    else:
        out.append(goal(f"encode_delta ≥ {GOAL_ENCODE_GBS} GB/s per core", None, GOAL_ENCODE_GBS, ">=",
                        "not measured: the speed part did not run (--repeats 0)"))
    return out


def goal_notes(goals: dict, json_goals: list[dict]) -> list[str]:
    notes = []
    for g in json_goals:
        notes.append(goal_line(g))
        if g["goal"].startswith("ours (delta) ≤"):
            floor = [v for _, v in goals["entropy0"] if v is not None]
            if floor and goals["low_planes"]:
                notes.append(
                    f"- Why: the order-0 entropy of our delta's byte planes (last column of the first table) is "
                    f"{min(floor):.3f}–{max(floor):.3f}× raw for fp32 weights + AdamW, so no order-0 coder of the "
                    f"individual planes can go below that with this transform; planes 0 and 1 (the low 16 bits of each "
                    f"difference) store at ≥ {min(goals['low_planes']):.3f} of their size in every fp32 kind, i.e. "
                    f"they alone cost ~0.5× raw.")
    return notes


def json_sizes(runs: list[FlavorRun], intervals: list[int]) -> tuple[list[dict], dict]:
    """Stored bytes / raw per pair of the save interval (the smallest), per flavor and state kind:
    the ``delta_x_raw`` metrics (one value per pair) and the ``delta_ratio`` series (per save step).
    A full-state system's value at step s is its size for the state at s alone."""
    interval = min(intervals)
    metrics, series = [], {}
    for a in runs:
        pairs = sorted((p for p in a.analyzer.pairs if p.interval == interval), key=lambda p: p.step)
        if not pairs:
            continue
        for group in GROUPS:
            curves = {}
            for key, system in SIZE_SYSTEMS.items():
                points = [(p.step, pair_ratio(p, a, group, key)) for p in pairs]
                if any(r is None for _, r in points):  # zipnn not installed
                    continue
                metrics.append(metric(system, "delta_x_raw", "×", [r for _, r in points], flavor=a.flavor,
                                      kind=GROUP_NAMES[group], interval=interval))
                curves[system] = [[step, r] for step, r in points]
            series[f"{a.flavor} {GROUP_NAMES[group]}"] = curves
    return metrics, {"delta_ratio": series}
