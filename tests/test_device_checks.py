"""benchmarks/device_checks.py, the prepared run for a lent accelerator, proven on CPU: its dry run
passes every section, writes its record after each one, keeps it on SIGTERM, and refuses an
unknown section."""

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
    proc = subprocess.run(SCRIPT + ["--dry-run", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((tmp_path / "out" / "device_checks.json").read_text())
    sections = record["sections"]
    assert list(sections) == ["preflight", "pinned", "ordering", "dtensor", "overlap", "stall", "trainer"]
    assert {s["status"] for s in sections.values()} == {"ok"}
    assert sections["ordering"]["figures"]["mismatched_with_wait"] == 0
    assert sections["dtensor"]["figures"]["bytes_equal"] and sections["dtensor"]["figures"]["staged_device"] == "cpu"
    assert all(sections["overlap"]["figures"][f"{mode}_state_equal"] for mode in ("pinned", "pageable", "host-ahead"))
    assert {"ours", "dcp-default"} <= set(sections["stall"]["figures"])
    assert sections["trainer"]["figures"]["max_abs_loss_diff_after_resume"] == 0.0
    assert "| trainer | ok |" in (tmp_path / "out" / "device_checks.md").read_text()


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
