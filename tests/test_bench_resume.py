"""benchmarks/bench_resume.py (time to first step after resume, issue 27): its pieces on made-up
stamps, its report and plot, and (slow) a whole tiny run through torchrun on one rank — never a
timing assertion: only that every part is measured, adds up and lands in the runner's record."""

from __future__ import annotations

import json
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH_DIR = REPO / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

bench = pytest.importorskip("bench_resume")  # needs the bench extra's imports (harness: torch)

STAMPS = ("started", "imported", "built", "loaded", "stepped")


def _ranks(base: float, gaps: list[list[float]]) -> list[dict]:
    """Rank records whose stamps are ``base`` plus the running sum of each rank's gaps."""
    out = []
    for rank, rank_gaps in enumerate(gaps):
        t, stamps = base, {}
        for name, gap in zip(STAMPS, rank_gaps):
            t += gap
            stamps[name] = t
        out.append({"rank": rank, "stamps": stamps, "loss": 1.5})
    return out


def test_parts_are_gaps_between_the_latest_ranks_stamps_and_add_up():
    ranks = _ranks(100.0, [[1.0, 2.0, 0.5, 3.0, 1.0], [1.5, 1.0, 0.5, 2.0, 1.0]])
    parts = bench.parts_of(100.0, ranks)
    assert list(parts) == [p for _, p in bench.PARTS] + ["total"]
    assert parts["launcher + interpreter"] == pytest.approx(1.5)  # the later rank's first line
    assert parts["imports"] == pytest.approx(1.5)  # 3.0 (rank 0) - 1.5
    assert parts["checkpoint load"] == pytest.approx(3.0)
    assert parts["total"] == pytest.approx(7.5)
    assert sum(v for k, v in parts.items() if k != "total") == pytest.approx(parts["total"])


def _result(systems, cases, loss_of=lambda system: 1.25) -> dict:
    runs = {}
    for case in cases:
        for i, system in enumerate(systems):
            ranks = _ranks(0.0, [[1.0, 4.0, 1.0, 1.0 + i, 0.5]] * case.world)
            runs[(case.key, system)] = [{"parts": bench.parts_of(0.0, ranks), "loss": loss_of(system)}]
    saved = {2: {"params": 1234, "bytes": {s: 10_000_000 for s in systems}, "s": 3.0}}
    return {"saved": saved, "runs": runs, "contention": "load average 1.0 at start"}


def _args(**kw) -> Namespace:
    return Namespace(dim=64, layers=2, steps=2, repeats=1, **kw)


def test_report_gives_parts_ratios_to_dcp_goals_and_the_loss_check():
    cases = [bench.BY_KEY["2-2"], bench.BY_KEY["2-4"]]
    systems = ["ours", "dcp", "titan"]
    section, metrics, goals = bench.report(_result(systems, cases), cases, systems, _args(),
                                           {"machine": ["CPU: test"], "wall_s": 9.0}, "python benchmarks/bench_resume.py")
    assert section.startswith(bench.SECTION)
    assert "| FSDP 2 → FSDP 4 | DCP | 8.50 |" in section
    assert "First loss" in section and "**yes**" in section
    # ours' load 1 s vs DCP's 2 s, total 7.5 vs 8.5
    x = [m for m in metrics if m["metric"] == "ttfs_x_dcp" and m["system"] == "ours"]
    assert len(x) == 2 and x[0]["median"] == pytest.approx(7.5 / 8.5)
    assert [m["median"] for m in metrics if m["metric"] == "load_x_dcp" and m["system"] == "ours"] == [0.5, 0.5]
    assert goals[0]["measured"] == pytest.approx(2.5 / 3.5)  # build + load + first step: ours 2.5 s, DCP 3.5 s
    parts = {m["part"] for m in metrics if m["metric"] == "ttfs_part_s"}
    assert parts == {p for _, p in bench.PARTS}
    assert len(goals) == 2 and all(g["met"] for g in goals) and "same layout" in goals[0]["goal"]


def test_report_says_when_the_first_losses_differ_and_what_did_not_run():
    cases = [bench.BY_KEY["2-2"]]
    section, _, goals = bench.report(_result(["ours"], cases, loss_of=lambda s: 2.0), cases, ["ours"], _args(),
                                     {"machine": [], "wall_s": 1.0}, "cmd")
    assert "torchtitan: not run" in section
    assert goals[0]["measured"] is None and goals[0]["met"] is None  # DCP not run: not measured
    bad = _result(["ours", "dcp"], cases, loss_of=lambda s: 2.0 if s == "ours" else 2.5)
    section, _, _ = bench.report(bad, cases, ["ours", "dcp"], _args(), {"machine": [], "wall_s": 1.0}, "cmd")
    assert "**NO" in section


def test_the_runner_registers_it_and_draws_its_plot(tmp_path):
    pytest.importorskip("matplotlib")
    import plots
    import run

    assert run.BY_NAME["resume"].script == "bench_resume.py"
    cases = [bench.BY_KEY["2-2"]]
    _, metrics, _ = bench.report(_result(["ours", "dcp"], cases), cases, ["ours", "dcp"], _args(),
                                 {"machine": [], "wall_s": 1.0}, "cmd")
    assert plots.resume_parts({"resume": {"metrics": metrics}}, tmp_path / "resume.png")
    assert (tmp_path / "resume.png").read_bytes()[:4] == b"\x89PNG"
    assert not plots.resume_parts({}, tmp_path / "none.png")


def test_evict_leaves_the_files_readable(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.bin").write_bytes(b"x" * 10000)
    bench.evict(tmp_path / "d")
    bench.evict(tmp_path / "d" / "a.bin")
    assert (tmp_path / "d" / "a.bin").read_bytes() == b"x" * 10000


@pytest.mark.slow
def test_a_tiny_run_measures_every_system_through_torchrun(tmp_path):
    out = tmp_path / "resume.json"
    proc = subprocess.run([sys.executable, str(BENCH_DIR / "bench_resume.py"), "--tiny", "--json", str(out),
                           "--dir", str(tmp_path / "work")], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads(out.read_text())
    systems = {m["system"] for m in record["metrics"] if m["metric"] == "ttfs_s"}
    assert {"ours", "DCP"} <= systems and (bench.titan_available() == ("torchtitan" in systems))
    for system in systems:
        total = next(m["median"] for m in record["metrics"] if m["metric"] == "ttfs_s" and m["system"] == system)
        parts = [m["median"] for m in record["metrics"] if m["metric"] == "ttfs_part_s" and m["system"] == system]
        assert len(parts) == len(bench.PARTS) and min(parts) >= 0 and sum(parts) == pytest.approx(total)
    assert "**yes**" in record["section"]  # every system resumed the same weights and data position
    assert record["goals"][0]["measured"] is not None
