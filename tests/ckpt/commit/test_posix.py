"""ckpt.commit (POSIX, ckpt.commit.posix): a checkpoint is visible complete or not at all. A save killed with SIGKILL in the middle
of writing leaves no checkpoint behind, only a tmp dir that the next save removes, and earlier
checkpoints stay loadable bit for bit; a save never replaces a committed checkpoint unless asked to;
leftovers of a save that died (stale tmp dirs, a copy moved aside) are cleaned up or restored."""

from __future__ import annotations

import os
import shutil
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
from ckpt.storage import locate
from tests.support import REPO
from tests.support.checkpoints import (
    assert_state_equal,
    assert_untouched,
    blank_state,
    make_state,
    save_fresh,
)


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


@pytest.mark.slow
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


# -- overwrite ------------------------------------------------------------------------------------

def _snapshot_tree(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_save_onto_committed_checkpoint(saved):
    path, old_state = saved
    before = _snapshot_tree(path)
    new_state = make_state(seed=1)

    with pytest.raises(ckpt.CheckpointExistsError):
        ckpt.save(new_state, path)
    assert _snapshot_tree(path) == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["step-1"]
    live = blank_state()
    ckpt.load(live, path)
    assert_state_equal(live, old_state)

    ckpt.save(new_state, path, overwrite=True)
    live = blank_state()
    ckpt.load(live, path)
    assert_state_equal(live, new_state)
    assert sorted(p.name for p in path.parent.iterdir()) == ["step-1"]


# -- commit-protocol leftovers --------------------------------------------------------------------

def test_stale_tmp_dir_is_never_the_checkpoint(run_dir):
    target = run_dir / "step-5"
    # a complete-looking save that died just before its rename: it even has a manifest
    stale = run_dir / f"step-5{commit.TMP_MARK}0123456789ab"
    save_fresh(run_dir / "scratch", seed=2)
    os.rename(run_dir / "scratch", stale)
    assert (stale / "manifest.json").is_file()
    assert not commit.is_committed(stale)

    live = blank_state()
    with pytest.raises(ckpt.CheckpointNotFoundError):
        ckpt.load(live, target)
    assert_untouched(live)

    state = save_fresh(target, seed=3)
    assert not stale.exists()
    assert sorted(p.name for p in run_dir.iterdir()) == ["step-5"]
    live = blank_state()
    ckpt.load(live, target)
    assert_state_equal(live, state)


def _crash_between_renames(run_dir: Path) -> tuple[Path, dict]:
    """Leave what an overwrite of ``step-7`` leaves when it dies after moving the old copy aside."""
    target = run_dir / "step-7"
    old_state = save_fresh(target, seed=4)
    os.rename(target, run_dir / f"step-7{commit.OLD_MARK}feedfacecafe")
    save_fresh(run_dir / "scratch", seed=5)  # the new copy, complete but never renamed
    os.rename(run_dir / "scratch", run_dir / f"step-7{commit.TMP_MARK}feedfacecafe")
    return target, old_state


def test_collect_garbage_restores_moved_aside_copy(run_dir):
    target, old_state = _crash_between_renames(run_dir)
    with pytest.raises(ckpt.CheckpointNotFoundError):
        ckpt.load(blank_state(), target)

    commit.collect_garbage(locate(target))
    assert sorted(p.name for p in run_dir.iterdir()) == ["step-7"]
    live = blank_state()
    ckpt.load(live, target)
    assert_state_equal(live, old_state)


def test_next_save_restores_moved_aside_copy(run_dir):
    target, old_state = _crash_between_renames(run_dir)
    with pytest.raises(ckpt.CheckpointExistsError):  # the old copy is back, so it is not replaced
        ckpt.save(make_state(seed=6), target)
    assert sorted(p.name for p in run_dir.iterdir()) == ["step-7"]
    live = blank_state()
    ckpt.load(live, target)
    assert_state_equal(live, old_state)


def test_leftover_old_copy_beside_committed_target_is_deleted(run_dir):
    target = run_dir / "step-8"
    save_fresh(target, seed=7)
    shutil.copytree(target, run_dir / f"step-8{commit.OLD_MARK}0badc0ffee00")  # died before rmtree
    new_state = make_state(seed=8)
    ckpt.save(new_state, target, overwrite=True)
    assert sorted(p.name for p in run_dir.iterdir()) == ["step-8"]
    live = blank_state()
    ckpt.load(live, target)
    assert_state_equal(live, new_state)
