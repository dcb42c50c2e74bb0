"""tools.replay, the ckpt-replay CLI: exit code 1 and one error line for a missing step, 2 for bad usage."""

from __future__ import annotations

import subprocess
import sys


def test_replay_cli_errors(tmp_path):
    result = subprocess.run([sys.executable, "-m", "tools.replay", str(tmp_path), "--step", "9"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stderr.count("\n") == 1 and "no checkpoint" in result.stderr
    result = subprocess.run([sys.executable, "-m", "tools.replay", str(tmp_path)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
