"""Every benchmark keeps running (issue 36, item 11): each ``benchmarks/bench_*.py`` is run by the
runner and has a ``--tiny`` mode that goes through every part of it on a tiny state (the ``slow``
tier runs each one as its own process, as ``benchmarks/run.py`` does), and the benchmarks reach the
engine through public names only, so a refactor of the engine's insides cannot break them unseen
(the stall benchmark died on ``manager._inflight`` after the manager was split up).

No timing is asserted: only that each run exits 0 and leaves a record with its section and figures.
Cost (pytest --durations on the 2-core box, nearly idle: load average 1-2): 115 s for the 12 runs
here (save_load 16, layouts 15, moe 14, trainer 11, stall 11, storage 9, integrations 8, scaling 7,
cp 7, delta 7, merge 5, planning 5), plus recover's (9 jobs of two torchrun agents and 2 ranks: 91-104 s of
CPU, about a minute on a quiet 2-core box; 197 s at load average 12; it was 14 jobs of 2 agents + 4 ranks,
235 s of CPU) and 22 s for bench_resume's own tiny test.
"""

from __future__ import annotations

import ast
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH_DIR = REPO / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

run = pytest.importorskip("run")  # benchmarks/run.py (the report needs matplotlib, from the bench extra)

# Benchmarks whose tiny run a test of their own makes (with checks of its own).
TINY_TESTED_ELSEWHERE = {"resume": "tests/test_bench_resume.py::test_a_tiny_run_measures_every_system_through_torchrun"}

# Private names of other packages that a benchmark has to reach, each with its reason. Nothing of
# ours (ckpt, trainer, tools) may be on this list.
THIRD_PARTY_PRIVATE = {
    ("peers.py", "serialization._tensor_as_memoryview_via_untyped_storage"):
        "torchsnapshot 0.1.0's bf16 byte view, replaced by a correct one (see peers.fix_torchsnapshot_bf16)",
    ("device_checks.py", "os._exit"): "the standard library's exit without clean-up, on SIGTERM",
    ("recover_rank.py", "os._exit"): "the standard library's exit without clean-up: a dead worker (--mode crash), "
                                     "and past the written results (torch 2.13's teardown may abort)",
    ("resume_rank.py", "os._exit"): "the standard library's exit without clean-up past the written results "
                                    "(torch 2.13's teardown may abort)",
    ("bench_integrations.py", "'_save_checkpoint'"): "the HF Trainer's own save, timed for the default variant",
}
OURS = ("ckpt", "trainer", "tools")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(path: Path) -> list[str]:
    """``file:line: what`` for each reach into a private name in one benchmark file: an import of a
    private module or name of ours, an attribute ``x._y`` of anything but ``self``/``cls``, and a
    private name handed as a string to getattr/setattr/hasattr or a timing wrapper (``wrap``)."""
    found = []
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        what = None
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in OURS:
            if any(_private(part) for part in node.module.split(".")) or any(_private(a.name) for a in node.names):
                what = f"from {node.module} import {', '.join(a.name for a in node.names)}"
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.split(".")[0] in OURS
                     and any(_private(part) for part in a.name.split("."))]
            what = f"import {', '.join(names)}" if names else None
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                what = ast.unparse(node)
        elif isinstance(node, ast.Call):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if func in ("getattr", "setattr", "hasattr", "delattr", "wrap"):
                strings = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
                what = next((repr(s) for s in strings if _private(s)), None)
        if what is not None and (path.name, what) not in THIRD_PARTY_PRIVATE:
            found.append((node.lineno, f"{path.name}:{node.lineno}: {what}"))
    return [line for _, line in sorted(found)]


def test_benchmarks_reach_the_engine_through_public_names_only():
    found = [use for path in sorted(BENCH_DIR.glob("*.py")) for use in private_uses(path)]
    assert not found, "benchmarks reach private names:\n" + "\n".join(found)


def test_the_check_finds_each_kind_of_private_reach(tmp_path):
    sample = tmp_path / "bench_sample.py"
    sample.write_text("import ckpt._snapshot_copy\nfrom ckpt.staging import _capture\nfrom ckpt import prefetch\n"
                      "future = manager._inflight.get(3)\ntimers.wrap(stager, '_ensure_buffers', 'x')\n"
                      "self._ok = 1\nx.__class__\ngetattr(manager, 'stats')\n")
    assert private_uses(sample) == [
        "bench_sample.py:1: import ckpt._snapshot_copy", "bench_sample.py:2: from ckpt.staging import _capture",
        "bench_sample.py:4: manager._inflight", "bench_sample.py:5: '_ensure_buffers'"]


def test_every_benchmark_script_is_run_by_the_runner():
    scripts = {p.name for p in BENCH_DIR.glob("bench_*.py")}
    assert scripts == {b.script for b in run.BENCHES}


TINY = [b.name for b in run.BENCHES if b.name not in TINY_TESTED_ELSEWHERE]


@pytest.mark.slow
@pytest.mark.parametrize("name", TINY)
def test_tiny_mode_runs_every_part(name, tmp_path):
    bench = run.BY_NAME[name]
    out = tmp_path / f"{name}.json"
    proc = subprocess.run([sys.executable, str(BENCH_DIR / bench.script), "--tiny", "--json", str(out),
                           "--dir", str(tmp_path / "work")], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    record = json.loads(out.read_text())
    assert record["bench"] == name and record["section"].startswith("## ")
    assert record["metrics"], "a tiny run measured nothing"
    for m in record["metrics"]:
        assert m["n"] >= 1 and math.isfinite(m["median"]), m
    for g in record.get("goals", []):
        assert g["measured"] is None or math.isfinite(g["measured"]), g
    if name == "stall":  # every system ran; ours' durable time came from the public on_commit
        systems = {m["system"] for m in record["metrics"] if m["metric"] == "stall_s"}
        assert {"ours", "ours (sync)", "bare copy", "torch.save"} <= systems
        assert any(m["system"] == "ours" and m["metric"] == "durable_s" for m in record["metrics"])
        assert all(g["measured"] is not None for g in record["goals"])
    if name == "recover":  # every part measured: a memory row or the restart that fell back to storage leaves a goal None
        assert all(g["measured"] is not None for g in record["goals"]), record["goals"]
        measured = {(m["system"], m["metric"]) for m in record["metrics"]}
        assert {("memory tier", "load_x_s3"), ("memory tier", "load_x_disk"), ("ours, S3 (moto)", "recover_s"),
                ("ours, local disk (evicted)", "recover_s"), ("memory tier, memory_interval 1", "lost_steps"),
                ("storage alone, interval 4", "lost_steps"), ("memory save every step", "stall_per_save_s"),
                ("storage save every step", "tokens_x_none")} <= measured, measured
    if name == "integrations":  # ours' save calls were found through the plug-ins' public hooks
        timed = {m["system"] for m in record["metrics"] if m["metric"] == "save_call_s"}
        assert {"lightning ours", "hf ours"} <= timed
