"""A save killed with SIGKILL in the middle of writing leaves no checkpoint behind, only a tmp dir
that the next save removes; earlier checkpoints stay loadable bit for bit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt import commit

REPO = Path(__file__).resolve().parents[2]

# ~384 MB of float32 in three tensors: takes the child well over a second to write and fsync.
CHILD = textwrap.dedent(
    """
    import sys
    import torch
    import ckpt

    n = 32 * 2**20
    state = {f"layer{i}.weight": torch.arange(n, dtype=torch.float32) + i for i in range(3)}
    state["step"] = 2
    print("saving", flush=True)
    ckpt.save(state, sys.argv[1])
    print("saved", flush=True)
    """
)

POLL_S = 0.01
MAX_POLLS = 6000  # 60 s at most, including the child's torch import


def small_state(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(128, 64, generator=gen), "b": torch.randn(257, generator=gen), "step": seed}


def blank() -> dict:
    return {"w": torch.zeros(128, 64), "b": torch.zeros(257), "step": -1}


def assert_bitwise(live: dict, expected: dict) -> None:
    assert live["step"] == expected["step"]
    for key in ("w", "b"):
        assert torch.equal(live[key].view(torch.uint8), expected[key].view(torch.uint8)), key


def partial_data_file(root: Path, name: str) -> Path | None:
    for data in root.glob(f"{name}{commit.TMP_MARK}*/data/rank-00000.bin"):
        try:
            if data.stat().st_size > 0:
                return data
        except FileNotFoundError:  # renamed away by a commit between glob and stat
            continue
    return None


def test_sigkill_mid_save(tmp_path: Path):
    step1, step2 = tmp_path / "step-1", tmp_path / "step-2"
    state1 = small_state(1)
    ckpt.save(state1, step1)

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    stderr_path = tmp_path / "child.stderr"
    with open(stderr_path, "wb") as stderr:
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(step2)], cwd=REPO, env=env,
                                 stdout=subprocess.PIPE, stderr=stderr)
    try:
        hit = None
        for _ in range(MAX_POLLS):
            hit = partial_data_file(tmp_path, "step-2")
            if hit is not None or child.poll() is not None:
                break
            time.sleep(POLL_S)
        if hit is not None:
            child.send_signal(signal.SIGKILL)
    finally:
        if child.poll() is None and hit is None:
            child.kill()
        child.wait()
    stdout = child.stdout.read().decode()
    child.stdout.close()

    assert hit is not None, f"never saw a partial data file; child rc={child.returncode} " \
                            f"stdout={stdout!r} stderr={stderr_path.read_text()[-2000:]!r}"
    assert child.returncode == -signal.SIGKILL, "the child finished before it was killed"
    assert stdout.splitlines() == ["saving"]

    # nothing half-written became visible
    assert not step2.exists()
    stale = sorted(p.name for p in tmp_path.glob(f"step-2{commit.TMP_MARK}*"))
    assert len(stale) == 1
    assert not (tmp_path / stale[0] / "manifest.json").exists()
    with pytest.raises(ckpt.CheckpointNotFoundError):
        ckpt.load(blank(), step2)

    # the earlier checkpoint is intact
    live = blank()
    ckpt.load(live, step1)
    assert_bitwise(live, state1)

    # the next save of the same target cleans up and commits
    state2 = small_state(2)
    ckpt.save(state2, step2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["step-1", "step-2"]
    live = blank()
    ckpt.load(live, step2)
    assert_bitwise(live, state2)
