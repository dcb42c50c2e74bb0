"""benchmarks/plots.py on made-up records: the save/load plot shows what the goals table says (the
median of paired ratios against raw, not medians of throughput), and a stall plot's legend sits
beside its curves, not on them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

plots = pytest.importorskip("plots")  # needs matplotlib (the bench extra)


def _metric(system: str, name: str, median: float, **extra) -> dict:
    return {"system": system, "metric": name, "median": median, "min": median * 0.5, "max": median * 2, **extra}


@pytest.fixture()
def drawn(monkeypatch):
    """The figures the plots would save, kept open for inspection."""
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: (fig.canvas.draw(), figures.append(fig)))
    yield figures
    for fig in figures:
        plots.plt.close(fig)


def test_the_save_load_plot_shows_the_paired_ratios_the_goals_quote(drawn, tmp_path):
    # a drifting machine: ours' median GB/s is below raw's while every paired repeat had ours faster
    record = {"metrics": [
        _metric("raw", "save_gbps", 1.39), _metric("ours", "save_gbps", 1.34), _metric("DCP", "save_gbps", 1.17),
        _metric("ours", "save_x_raw", 1.19), _metric("DCP", "save_x_raw", 0.71),
        _metric("ours", "load_x_raw", 1.09), _metric("DCP", "load_x_raw", 0.76),
    ]}
    assert plots.throughput({"save_load": record}, tmp_path / "throughput.png")
    ax = drawn[0].axes[0]
    heights = sorted(round(bar.get_height(), 2) for bar in ax.patches)
    assert heights == [0.71, 0.76, 1.09, 1.19]
    assert [label.get_text() for label in ax.get_xticklabels()] == ["ours", "DCP"]
    assert "paired" in ax.get_title() and "raw" in ax.get_ylabel()
    assert not plots.throughput({"save_load": {"metrics": record["metrics"][:3]}}, tmp_path / "none.png")


@pytest.mark.parametrize("axis", ["size", "ranks"])
def test_a_stall_plots_legend_does_not_cover_the_curves(drawn, tmp_path, axis):
    systems = ("ours", "bare copy", "DCP async_save (default stager)", "DCP async_save (caching stager)",
               "torch.save", "torchsnapshot")
    xs = (2.7e8, 5.4e8, 1.1e9, 2.1e9, 4.3e9) if axis == "size" else (1, 2, 4)
    metrics = [_metric(s, "stall_s", 1e-3 * 3 ** i * (1 + j), x=x, axis=axis)
               for i, s in enumerate(systems) for j, x in enumerate(xs)]
    assert plots._stall_curves({"scaling": {"metrics": metrics}}, tmp_path / "stall.png", axis)
    fig = drawn[0]
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    legend, plot_area = ax.get_legend().get_window_extent(renderer), ax.get_window_extent(renderer)
    assert not legend.overlaps(plot_area)


def test_the_recover_plot_stacks_each_rows_parts_and_its_legend_covers_nothing(drawn, tmp_path):
    parts = ("launcher + interpreter", "imports", "process group + build", "checkpoint load", "first step")
    rows = (("memory tier", "node loss (partner fetch)"), ("ours, S3 (moto)", "either"))
    metrics = [_metric(system, "recover_part_s", 1.0 + i + 10 * j, part=part, scenario=scenario)
               for j, (system, scenario) in enumerate(rows) for i, part in enumerate(parts)]
    assert plots.recover_parts({"recover": {"metrics": metrics}}, tmp_path / "recover.png")
    fig = drawn[0]
    ax = fig.axes[0]
    assert [label.get_text() for label in ax.get_yticklabels()] == ["memory tier: node loss (partner fetch)",
                                                                    "ours, S3 (moto): either"]
    ends: dict[float, float] = {}
    for bar in ax.patches:  # each bar's end: its parts summed
        ends[bar.get_y()] = max(ends.get(bar.get_y(), 0.0), bar.get_x() + bar.get_width())
    assert sorted(ends.values()) == [sum(1.0 + i for i in range(5)), sum(11.0 + i for i in range(5))]
    renderer = fig.canvas.get_renderer()
    legend = ax.get_legend().get_window_extent(renderer)
    assert not legend.overlaps(ax.get_window_extent(renderer))
    assert not legend.overlaps(ax.xaxis.label.get_window_extent(renderer))
    assert not plots.recover_parts({"recover": {"failed": "exit status 1", "metrics": metrics}}, tmp_path / "no.png")
