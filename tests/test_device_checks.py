"""benchmarks/device_checks.py, the prepared run for a lent accelerator, proven on CPU: its dry run
passes every section with the figures each one claims (a save timed inside its window, DCP's staging
and upload apart, the three training loops, the resume), keeps pytest's output and JUnit file, writes
its record after each section, keeps it on SIGTERM, and refuses an unknown section."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = [sys.executable, str(REPO / "benchmarks" / "device_checks.py")]


@pytest.mark.slow
def test_the_dry_run_passes_every_section(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(SCRIPT + ["--dry-run", "--out", str(out), "--work", str(tmp_path / "work")],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sections = json.loads((out / "device_checks.json").read_text())["sections"]
    assert list(sections) == ["preflight", "pinned", "ordering", "dtensor", "overlap", "stall", "trainer", "resume"]
    assert {s["status"] for s in sections.values()} == {"ok"}, {k: s.get("error") for k, s in sections.items()}
    ordering = sections["ordering"]["figures"]
    # the waited snapshot never sees the later write; the unwaited control's race is recorded, but on
    # CPU its copy thread may win or lose it (a device's copy stream loses it every time)
    assert ordering["mismatched_with_wait"] == 0 and isinstance(ordering["control_shows_the_race"], bool)
    assert "skipped" in ordering["pytest_tail"] and ordering["tests"]
    assert (out / "accelerator-junit.xml").exists() and (out / "accelerator-pytest.txt").exists()
    assert sections["dtensor"]["figures"]["bytes_equal"] and sections["dtensor"]["figures"]["staged_device"] == "cpu"
    overlap = sections["overlap"]["figures"]
    for mode in ("pinned", "pageable", "host-ahead"):
        assert overlap[f"{mode}_state_equal"] and {f"{mode}_step_lost_ms", f"{mode}_copy_ms"} <= set(overlap)
    stall = sections["stall"]["figures"]
    assert all("step_lost_ms" in stall[system] for system in ("ours", "titan", "dcp-default"))
    titan = stall["titan"]
    assert {"upload_wait_ms", "staging_s", "staging_wait_ms", "upload_s", "gc_ms"} <= set(titan)
    assert "use_pinned_memory=True, use_shared_memory=True, use_async_staging=True" in titan["staging_options"]
    assert titan["staged_equal_host_ahead"] is True
    trainer = sections["trainer"]["figures"]
    assert all(trainer[loop]["tokens_per_s"] > 0 for loop in ("none", "ours", "titan"))
    assert trainer["ours"]["saves"] == trainer["titan"]["saves"] == 3 and trainer["none"]["saves"] == 0
    assert sections["resume"]["figures"]["max_abs_loss_diff_after_resume"] == 0.0
    assert "| resume | ok |" in (out / "device_checks.md").read_text()


def test_a_failed_device_test_keeps_its_message(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from device_staging import junit_outcomes
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    junit = tmp_path / "junit.xml"
    junit.write_text('<testsuites><testsuite><testcase name="a"/><testcase name="b"><failure message="assert 1 == 2">'
                     'trace</failure></testcase><testcase name="c"><skipped message="no GPU"/></testcase>'
                     '</testsuite></testsuites>')
    assert junit_outcomes(junit) == {"a": "passed", "b": "failed: assert 1 == 2", "c": "skipped"}


def test_an_unknown_section_is_refused(tmp_path):
    proc = subprocess.run(SCRIPT + ["--dry-run", "--only", "pinned,nonsense", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "nonsense" in proc.stderr
    assert not (tmp_path / "device_checks.json").exists()


def test_sigterm_keeps_the_sections_already_done(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen(SCRIPT + ["--dry-run", "--only", "trainer", "--out", str(out), "--work", str(tmp_path / "w")],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    record = out / "device_checks.json"
    deadline = time.monotonic() + 300
    while not record.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)  # preflight is written before the trainer section starts
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) in (143, 0)
    sections = json.loads(record.read_text())["sections"]
    assert sections["preflight"]["status"] == "ok"
