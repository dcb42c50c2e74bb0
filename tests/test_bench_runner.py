"""The benchmark runner's plumbing (benchmarks/run.py, report.py, plots.py) on made-up results.

No benchmark is timed here: a stand-in bench script writes a fixed result through the same
``report.write_json`` the real ones use, and another fails, so the test checks what the report
does with each — goals met / not met / not measured, a failure shown as a failure with its log's
tail, the README block replaced (and only it), plots drawn only where data exists.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

run = pytest.importorskip("run")  # benchmarks/run.py (needs matplotlib, from the bench extra)

GOOD = '''
import argparse, sys
sys.path.insert(0, {bench_dir!r})
import report
p = argparse.ArgumentParser(); p.add_argument("--quick", action="store_true"); p.add_argument("--json")
a = p.parse_args()
m = [report.metric(s, "stall_s", "s", [v * k, v * k * 1.5], x=k * 1e8, axis="size")
     for s, v in (("ours", 0.001), ("bare copy", 0.1)) for k in (1, 4)]
g = [report.goal("stall ≤ 0.05× bare copy", 0.01, 0.05, "<="), report.goal("save ≥ 1.0× raw", 0.9, 1.0, ">="),
     report.goal("delta ≤ zipnn", None, 1.0, "<=")]
report.write_json(a.json, "good", "## Good section\\n\\nbody line", "python good.py", metrics=m, goals=g)
'''

BAD = '''
import sys
print("about to fail")
raise SystemExit("boom: the state did not fit")
'''


@pytest.fixture()
def suite(tmp_path, monkeypatch):
    good, bad = tmp_path / "good.py", tmp_path / "bad.py"
    good.write_text(GOOD.format(bench_dir=str(BENCH_DIR)))
    bad.write_text(BAD)
    benches = [run.Bench("scaling", str(good), ["--quick"], [], "a good bench"),
               run.Bench("merge", str(bad), ["--quick"], [], "a failing bench")]
    monkeypatch.setattr(run, "BENCHES", benches)
    monkeypatch.setattr(run, "BY_NAME", {b.name: b for b in benches})
    monkeypatch.setattr(run, "RESULTS_DIR", tmp_path / "results")
    monkeypatch.setattr(run, "HERE", tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text(f"# Project\n\nbefore\n\n{run.report.README_BEGIN}\nold block\n{run.report.README_END}\n\nafter\n")
    return tmp_path, readme


def test_report_shows_goals_failures_and_plots(suite, monkeypatch):
    tmp, readme = suite
    out = tmp / "RESULTS.md"
    monkeypatch.setattr(run.report, "build", _build_with_readme(readme))
    assert run.main(["--quick", "--publish", "--out", str(out)]) == 1  # one benchmark failed

    text = out.read_text()
    assert "| stall ≤ 0.05× bare copy |" in text and "| 0.010 | ≤ 0.050 | **met** |" in text
    assert "| 0.90 | ≥ 1.00 | **not met** |" in text
    assert "| delta ≤ zipnn |" in text and "not measured" in text
    assert "**failed to run**" in text and "boom: the state did not fit" in text
    assert "## Good section" in text and "body line" in text and "quick run" in text
    assert (tmp / "plots" / "stall_vs_size.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp / "plots" / "merge_memory.png").exists()  # its benchmark failed: no stale picture
    stored = json.loads((tmp / "results" / "merge.json").read_text())
    assert stored["failed"] == "exit status 1" and "about to fail" in stored["tail"]

    readme_text = readme.read_text()
    assert readme_text.startswith("# Project\n\nbefore\n\n") and readme_text.endswith("\n\nafter\n")
    assert "old block" not in readme_text and "**not met**" in readme_text
    assert "![Stall per save vs state size](plots/stall_vs_size.png)" in readme_text

    # --only keeps the other benchmarks' stored results; the report is rebuilt the same way
    assert run.main(["--quick", "--only", "scaling", "--publish", "--out", str(out)]) == 0
    assert "**failed to run**" in out.read_text()  # merge's stored (failed) result is still reported
    block, report_text = readme.read_text(), out.read_text()
    assert run.main(["--report-only", "--out", str(out)]) == 0
    assert readme.read_text() == block  # the block depends on the stored results only
    assert out.read_text() == report_text  # nothing ran, nothing changed: not even the date line


def test_quick_and_partial_runs_never_replace_the_published_figures(suite):
    tmp, readme = suite
    published = {"results": tmp / "results", "report": tmp / "RESULTS.md"}
    published["results"].mkdir()
    (published["results"] / "scaling.json").write_text('{"bench": "scaling", "published": true}\n')
    published["report"].write_text("the published report\n")
    before = readme.read_text()
    run.main(["--quick"])
    run.main(["--quick", "--only", "scaling"])
    assert (published["results"] / "scaling.json").read_text() == '{"bench": "scaling", "published": true}\n'
    assert published["report"].read_text() == "the published report\n" and readme.read_text() == before
    scratch = tmp / "_work" / "report"
    assert "## Good section" in (scratch / "RESULTS.md").read_text()
    assert json.loads((scratch / "results" / "scaling.json").read_text())["bench"] == "good"


def _build_with_readme(readme: Path):
    original = run.report.build

    def build(records, benches, run_info, out, plots_dir, _readme):
        return original(records, benches, run_info, out, plots_dir, readme)

    return build
