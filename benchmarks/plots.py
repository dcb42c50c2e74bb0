"""The report's PNG plots, drawn with matplotlib from the stored benchmark results.

Every plot reads only the records ``run.py`` keeps in ``benchmarks/results/`` (the metrics each
``bench_*.py`` writes with ``report.metric``: a median and the min–max over repeats per system),
so a plot never shows a number the report's tables do not. Error bars are the min–max span. A plot
whose benchmark has no (successful) stored result is skipped.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on a build machine
import matplotlib.pyplot as plt  # noqa: E402

OURS_STYLE = {"linewidth": 2.6, "zorder": 5}


def _metrics(record: dict | None, name: str, **match) -> list[dict]:
    if not record or record.get("failed"):
        return []
    return [m for m in record.get("metrics", []) if m.get("metric") == name and m.get("median") is not None
            and all(m.get(k) == v for k, v in match.items())]


def _span(m: dict) -> tuple[float, float]:
    """(below, above) the median, for an error bar."""
    lo = m["min"] if m.get("min") is not None else m["median"]
    hi = m["max"] if m.get("max") is not None else m["median"]
    return max(0.0, m["median"] - lo), max(0.0, hi - m["median"])


def _is_ours(system: str) -> bool:
    return system.lower().startswith("ours")


def _curves(ax, metrics: list[dict], x_scale: float = 1.0) -> None:
    """One line per system through its (x, median) points, with min–max error bars."""
    by_system: dict[str, list[dict]] = defaultdict(list)
    for m in metrics:
        if m.get("x") is not None:
            by_system[m["system"]].append(m)
    for system, points in by_system.items():
        points.sort(key=lambda m: m["x"])
        xs = [m["x"] / x_scale for m in points]
        ys = [m["median"] for m in points]
        err = list(zip(*[_span(m) for m in points]))
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=system,
                    **(OURS_STYLE if _is_ours(system) else {"linewidth": 1.2}))
        bad = [(x, y) for x, y, m in zip(xs, ys, points) if m.get("consistent") is False]
        if bad:  # the benchmark found this save did not hold the state at the call: not a real snapshot
            ax.scatter(*zip(*bad), marker="x", s=90, color="red", zorder=6,
                       label=f"{system}: inconsistent (saved state changed after the call)")


def _size_ticks(ax, metrics: list[dict]) -> None:
    """Ticks at the measured sizes, labelled in MB/GB (the curves' x is GB)."""
    sizes = sorted({m["x"] for m in metrics if m.get("x") is not None})
    ax.set_xticks([x / 1e9 for x in sizes])
    ax.set_xticklabels([f"{x / 1e9:.3g} GB" if x >= 1e9 else f"{x / 1e6:.0f} MB" for x in sizes], fontsize=8)
    ax.minorticks_off()


def _bars(ax, groups: dict[str, list[dict]], ylabel: str) -> None:
    """Grouped bars: one group per key of ``groups`` (e.g. save, load), one bar per system."""
    systems: list[str] = []
    for ms in groups.values():
        for m in ms:
            if m["system"] not in systems:
                systems.append(m["system"])
    width = 0.8 / max(1, len(groups))
    for i, (group, ms) in enumerate(groups.items()):
        by = {m["system"]: m for m in ms}
        xs = [j + i * width for j, s in enumerate(systems) if s in by]
        ys = [by[s]["median"] for s in systems if s in by]
        err = list(zip(*[_span(by[s]) for s in systems if s in by])) or None
        ax.bar(xs, ys, width, yerr=err, capsize=3, label=group)
    ax.set_xticks([j + width * (len(groups) - 1) / 2 for j in range(len(systems))])
    ax.set_xticklabels(systems, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    if len(groups) > 1:
        ax.legend(fontsize=8)


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _stall_curves(records: dict, path: Path, axis: str) -> bool:
    """Stall per save against the scaling benchmark's ``axis`` ("size" or "ranks"), a line per system."""
    ms = _metrics(records.get("scaling"), "stall_s", axis=axis)
    if not ms:
        return False
    fig, ax = plt.subplots(figsize=(9.5, 4.5))
    if axis == "size":
        _curves(ax, ms, x_scale=1e9)
        ax.set_xscale("log", base=2)
        _size_ticks(ax, ms)
        ax.set_xlabel("state size (model + optimizer)")
        ax.set_ylabel("stall per save (s, log)")
        ax.set_title("Training-thread stall per save vs state size")
    else:
        _curves(ax, ms)
        ax.set_xticks(sorted({m["x"] for m in ms}))
        ax.set_xlabel("ranks (fixed total state, sharded)")
        ax.set_ylabel("stall per save, slowest rank (s, log)")
        ax.set_title("Stall per save vs number of ranks")
    ax.set_yscale("log")
    # beside the axes, not on them: the curves span the whole plot area at one size or another
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    ax.grid(True, which="both", alpha=0.3)
    _save(fig, path)
    return True


def stall_vs_size(records: dict, path: Path) -> bool:
    return _stall_curves(records, path, "size")


def stall_vs_ranks(records: dict, path: Path) -> bool:
    return _stall_curves(records, path, "ranks")


def throughput(records: dict, path: Path) -> bool:
    """Each system's save and load speed as a multiple of the raw write+fsync / read of the same bytes:
    the median of the per-repeat paired ratios (raw s / its s), what the goals table quotes. Not the
    median GB/s of each system: medians of throughputs taken apart from their pairing disagree with
    the paired ratio on a machine whose speed drifts between repeats (ours 1.34 vs raw 1.39 GB/s,
    while ours/raw paired is 1.19)."""
    rec = records.get("save_load")
    save, load = _metrics(rec, "save_x_raw"), _metrics(rec, "load_x_raw")
    if not save and not load:
        return False
    fig, ax = plt.subplots(figsize=(8, 4.5))
    _bars(ax, {"save": save, "load": load}, "× raw (raw s / its s; higher is better)")
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--", label="raw write+fsync / read = 1")
    ax.legend(fontsize=8)
    ax.set_title("Save and load against raw write/read of the same bytes:\n"
                 "median of the paired per-repeat ratios, min–max bars", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    _save(fig, path)
    return True


def delta_over_training(records: dict, path: Path) -> bool:
    rec = records.get("delta")
    panels = ((rec or {}).get("series") or {}).get("delta_ratio") if rec and not rec.get("failed") else None
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, (panel, systems) in zip(axes[0], panels.items()):
        for system, points in systems.items():
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker=".", label=system, **(OURS_STYLE if _is_ours(system) else {"linewidth": 1.2}))
        ax.set_title(panel, fontsize=9)
        ax.set_xlabel("training step of the save")
        ax.set_ylabel("stored bytes / raw bytes")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Checkpoint size over training: delta vs full-state codecs")
    _save(fig, path)
    return True


def merge_memory(records: dict, path: Path) -> bool:
    rec = records.get("merge")
    peak, secs = _metrics(rec, "peak_growth_mib"), _metrics(rec, "merge_s")
    if not peak:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    _curves(axes[0], peak, x_scale=1e9)
    _size_ticks(axes[0], peak)
    axes[0].set_xlabel("checkpoint size")
    axes[0].set_ylabel("peak memory growth (MiB)")
    axes[0].set_title("Merge peak memory vs model size")
    if secs:
        _curves(axes[1], secs, x_scale=1e9)
        _size_ticks(axes[1], secs)
        axes[1].set_xlabel("checkpoint size")
        axes[1].set_ylabel("merge time (s)")
        axes[1].set_title("Merge time vs model size")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    _save(fig, path)
    return True


def _bar_panels(ms: list[dict], panel_of, ylabel: str, title: str, path: Path, width: float = 4.5) -> bool:
    """One bar chart per panel (``panel_of(metric)`` names it), side by side, one bar per system."""
    if not ms:
        return False
    panels: dict[str, list[dict]] = defaultdict(list)
    for m in ms:
        panels[panel_of(m)].append(m)
    fig, axes = plt.subplots(1, len(panels), figsize=(width * len(panels), 4.2), squeeze=False)
    for ax, (panel, group) in zip(axes[0], panels.items()):
        _bars(ax, {panel: group}, ylabel)
        ax.set_title(panel)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(title)
    _save(fig, path)
    return True


def storage(records: dict, path: Path) -> bool:
    return _bar_panels(_metrics(records.get("storage"), "mibps"), lambda m: m.get("op", ""),
                       "MiB/s (higher is better)", "Object store (S3 protocol, loopback server)", path)


def trainer(records: dict, path: Path) -> bool:
    return _bar_panels(_metrics(records.get("trainer"), "tokens_per_s"),
                       lambda m: f"{m.get('flavor', '')}, {m.get('threads', '?')} threads",
                       "tokens/s (higher is better)", "Trainer throughput with and without checkpointing", path, 5)


def _stacked_parts(ms: list[dict], label_of, xlabel: str, title: str, path: Path) -> bool:
    """One stacked horizontal bar per label (``label_of(metric)``), a segment per ``part`` (medians)."""
    if not ms:
        return False
    bars: dict[str, dict[str, float]] = defaultdict(dict)
    parts: list[str] = []
    for m in ms:
        bars[label_of(m)][m.get("part", "")] = m["median"]
        if m.get("part", "") not in parts:
            parts.append(m.get("part", ""))
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(bars) + 2.2))
    left = [0.0] * len(bars)
    for part in parts:
        widths = [b.get(part, 0.0) for b in bars.values()]
        ax.barh(range(len(bars)), widths, left=left, label=part)
        left = [a + w for a, w in zip(left, widths)]
    ax.set_yticks(range(len(bars)))
    ax.set_yticklabels(list(bars), fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))  # beside: below, it covered the x label
    ax.grid(True, axis="x", alpha=0.3)
    _save(fig, path)
    return True


def resume_parts(records: dict, path: Path) -> bool:
    """Time to first step after resume: one stacked bar per (layout, system), a segment per part."""
    return _stacked_parts(_metrics(records.get("resume"), "ttfs_part_s"),
                          lambda m: f"{m.get('case', '')}: {m['system']}",
                          "seconds from the launcher's clock to the first optimizer step (median)",
                          "Time to first step after resume, by part", path)


def recover_parts(records: dict, path: Path) -> bool:
    """Time to recover: one stacked bar per (system, scenario), the memory tier beside the peers."""
    return _stacked_parts(_metrics(records.get("recover"), "recover_part_s"),
                          lambda m: f"{m['system']}: {m.get('scenario', '')}",
                          "seconds from the restart to the end of the first step (median)",
                          "Time to recover after a crash or a lost node, by part", path)


PLOTS = [
    ("stall_vs_size.png", "Stall per save vs state size", stall_vs_size),
    ("stall_vs_ranks.png", "Stall per save vs ranks", stall_vs_ranks),
    ("throughput.png", "Save/load against raw write/read (median of paired ratios)", throughput),
    ("delta_ratio.png", "Delta size over training", delta_over_training),
    ("merge_memory.png", "Merge peak memory and time vs model size", merge_memory),
    ("storage.png", "Replication and object-store save/load", storage),
    ("trainer.png", "Trainer tokens/s", trainer),
    ("resume.png", "Time to first step after resume", resume_parts),
    ("recover.png", "Time to recover after a crash or a lost node", recover_parts),
]


def make_all(records: dict, plots_dir: Path) -> list[tuple[str, str]]:
    """Draw every plot whose data is stored; return (file name, title) of those drawn. Plots whose
    data is gone are removed, so the report never shows a stale picture."""
    plots_dir.mkdir(parents=True, exist_ok=True)
    drawn = []
    for name, title, draw in PLOTS:
        path = plots_dir / name
        if draw(records, path):
            drawn.append((name, title))
        else:
            path.unlink(missing_ok=True)
    return drawn
