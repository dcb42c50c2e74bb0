"""tools.copy, ckpt-copy: every loadable step (or the chosen ones with their delta chains) copied
to another root, verified as it streams, manifest last; bitwise loadable there, also on S3."""

from __future__ import annotations

import json
import os

import pytest

import ckpt
from tests.support.chains import load_mixed, train_with_chain
from tests.support.checkpoints import step_path
from tests.support.models import assert_same as assert_state_equal


def test_copy_every_step_loads_bitwise_on_the_target(tmp_path, capsys):
    from tools.copy import main

    expected = train_with_chain(tmp_path / "src", steps=4, full_every=2)
    assert main([str(tmp_path / "src"), str(tmp_path / "dst"), "--json", "--quiet"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["copied"] == [1, 2, 3, 4] and report["bytes"] > 0
    assert ckpt.CheckpointRoot(tmp_path / "dst").steps() == [1, 2, 3, 4]
    for step in (2, 4):  # deltas: their bases came along
        assert_state_equal(load_mixed(step_path(tmp_path / "dst", step)), expected[step])
    assert main([str(tmp_path / "src"), str(tmp_path / "dst"), "--quiet"]) == 0  # again: nothing to do
    assert capsys.readouterr().out.strip().endswith("copied 0 step(s) (0 B) to " + str(tmp_path / "dst") + "; 4 already there")


def test_copy_one_step_brings_its_delta_chain(tmp_path, capsys):
    from tools.copy import main

    expected = train_with_chain(tmp_path / "src", steps=6, full_every=3)  # 1 full, 2-3 deltas, 4 full, ...
    assert main([str(tmp_path / "src"), str(tmp_path / "dst"), "--step", "3", "--json", "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["copied"] == [1, 2, 3]
    assert_state_equal(load_mixed(step_path(tmp_path / "dst", 3)), expected[3])


def test_copy_refuses_a_missing_step_and_a_locked_target(tmp_path, capsys):
    from tools.copy import main

    train_with_chain(tmp_path / "src", steps=2)
    assert main([str(tmp_path / "src"), str(tmp_path / "dst"), "--step", "7", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no loadable step 7" in err and "committed: 1, 2" in err
    with ckpt.CheckpointManager(tmp_path / "dst"):  # a running trainer's root
        assert main([str(tmp_path / "src"), str(tmp_path / "dst"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lock" in err.lower()
    assert not os.path.exists(tmp_path / "dst" / "step-00000001")


def test_a_corrupt_source_step_is_never_committed_on_the_target(tmp_path, capsys):
    from tools.copy import main

    train_with_chain(tmp_path / "src", steps=1)
    data = max((p for p in step_path(tmp_path / "src", 1).rglob("*") if p.is_file() and p.name != "manifest.json"),
               key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert main([str(tmp_path / "src"), str(tmp_path / "dst"), "--quiet"]) == 1
    assert "checksum" in capsys.readouterr().err.lower()
    assert ckpt.CheckpointRoot(tmp_path / "dst").committed() == []


@pytest.mark.slow
def test_copy_to_s3_and_back(tmp_path, s3_bucket, aws_env, capsys):
    from tools.copy import main

    expected = train_with_chain(tmp_path / "src", steps=3, full_every=2)
    url = f"{s3_bucket.url}/run"
    assert main([str(tmp_path / "src"), url, "--read-back", "--quiet"]) == 0
    assert main([url, str(tmp_path / "back"), "--quiet"]) == 0
    assert_state_equal(load_mixed(step_path(tmp_path / "back", 3)), expected[3])


def test_copy_refuses_a_target_claimed_by_another_run_and_a_copy_resumes_as_the_same_run(tmp_path, capsys):
    from tools.copy import main

    expected = train_with_chain(tmp_path / "a", steps=2)
    train_with_chain(tmp_path / "b", steps=1)  # another run's root
    assert main([str(tmp_path / "a"), str(tmp_path / "b"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "belongs to another run" in err
    assert ckpt.CheckpointRoot(tmp_path / "b").steps() == [1]  # nothing copied
    assert main([str(tmp_path / "a"), str(tmp_path / "restored"), "--quiet"]) == 0
    run = ckpt.read_manifest(step_path(tmp_path / "a", 2)).run
    with ckpt.CheckpointManager(tmp_path / "restored") as manager:  # the copy resumes as run a
        assert manager.run == run
        assert manager.steps() == [1, 2]
    assert_state_equal(load_mixed(step_path(tmp_path / "restored", 2)), expected[2])


def test_copy_refuses_a_step_the_target_holds_from_another_history(tmp_path, capsys):
    """Issue 36 item 5: a DST step committed with another manifest is not "already there"."""
    import torch

    from tools.copy import main

    train_with_chain(tmp_path / "src", steps=2)
    assert main([str(tmp_path / "src"), str(tmp_path / "dst"), "--quiet"]) == 0
    capsys.readouterr()
    stale = (step_path(tmp_path / "dst", 2) / "manifest.json").read_bytes()
    ckpt.CheckpointRoot(tmp_path / "src").delete(2)
    with ckpt.CheckpointManager(tmp_path / "src", interval=1) as manager:  # a branch from step 1 on SRC
        manager.save(2, {"w": torch.full((8,), 7.0)})
    assert main([str(tmp_path / "src"), str(tmp_path / "dst"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "step-00000002 is committed with another manifest" in err and "digest" in err
    assert (step_path(tmp_path / "dst", 2) / "manifest.json").read_bytes() == stale  # left as it was



_PAUSED_COPY = """
import os, sys
import ckpt.root.copy as copy
real = copy.copy_file

def paused(*args, **kwargs):  # the first data file written into the attempt, then wait for the signal
    written = real(*args, **kwargs)
    print("paused", flush=True)
    os.read(0, 1)  # stdin: never written; the signal interrupts this read
    return written

copy.copy_file = paused
from tools.copy import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("signum", ["SIGINT", "SIGTERM"])
def test_an_interrupted_copy_leaves_nothing_half_written(tmp_path, signum):
    """Issue 36 item 10c: a copy interrupted half way left step-N.tmp-* on DST until the next copy.
    A real ckpt-copy process, paused inside the copy of step 1 (one data file written into the
    attempt), gets Ctrl-C or SIGTERM: it exits 130 / 143 with one line and DST holds nothing of it."""
    import signal
    import subprocess
    import sys

    from tests.support import REPO

    train_with_chain(tmp_path / "src", steps=2)
    process = subprocess.Popen([sys.executable, "-c", _PAUSED_COPY, str(tmp_path / "src"), str(tmp_path / "dst"),
                                "--quiet"], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert process.stdout.readline() == "paused\n"
        assert [p.name for p in (tmp_path / "dst").iterdir() if ".tmp-" in p.name]  # the attempt, half done
        process.send_signal(getattr(signal, signum))
        _, err = process.communicate(timeout=120)
    finally:
        process.kill()
    code = 128 + getattr(signal, signum)
    assert process.returncode == code and err == f"ckpt-copy: {'interrupted' if code == 130 else 'terminated'}\n"
    assert sorted(p.name for p in (tmp_path / "dst").iterdir()) == [".lock"]  # nothing of step 1 stays
    assert ckpt.CheckpointRoot(tmp_path / "dst").steps() == []


def test_a_data_file_with_trailing_bytes_is_refused_by_verify_and_by_copy(tmp_path, capsys):
    """Issue 36 item 10d: one rule for both — a data file longer than its manifest's `files` size is
    damage; `ckpt inspect --verify` passed it while `ckpt copy` refused it."""
    from tools.copy import main as copy_main
    from tools.inspection import main as inspect_main

    train_with_chain(tmp_path / "src", steps=1)
    data = next((step_path(tmp_path / "src", 1) / "data").iterdir())
    size = data.stat().st_size
    with open(data, "ab") as file:
        file.write(b"\0" * 24)
    said = f"data/{data.name} holds {size + 24} bytes, its manifest says {size}"
    assert inspect_main([str(tmp_path / "src"), "--verify", "--quiet"]) == 1
    out, err = capsys.readouterr()
    failed = [line for line in out.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1 and said in failed[0] and "step 1" in failed[0] and err.count("\n") == 1
    assert copy_main([str(tmp_path / "src"), str(tmp_path / "dst"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err
    assert ckpt.CheckpointRoot(tmp_path / "dst").steps() == []


class _Bar:
    """tools.cli.progress's bar as the copy uses it: its total, every update, the count so far."""

    def __init__(self, total: int, description: str, *, quiet: bool, unit: str = "B"):
        self.total, self.unit, self.updates, self.n = total, unit, [], 0

    def update(self, n: int) -> None:
        self.updates.append(n)
        self.n += n

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_the_progress_bar_counts_bytes_as_they_are_copied(tmp_path, monkeypatch, capsys):
    """Issue 40 item 7: the bar's total is the steps' data bytes and it moves inside a step, slice by
    slice (it counted steps: one large step sat at 0/1); a step already there counts as done."""
    import ckpt.root.copy
    import tools.copy
    from tools.copy import main

    train_with_chain(tmp_path / "src", steps=3, full_every=3)
    bars = []
    monkeypatch.setattr(tools.copy, "progress", lambda *a, **k: bars.append(_Bar(*a, **k)) or bars[-1])
    monkeypatch.setattr(ckpt.root.copy, "SLICE", 1024)
    assert main([str(tmp_path / "src"), str(tmp_path / "dst"), "--step", "1", "--json", "--quiet"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert main([str(tmp_path / "src"), str(tmp_path / "dst"), "--json", "--quiet"]) == 0
    second = json.loads(capsys.readouterr().out)
    source = ckpt.CheckpointRoot(tmp_path / "src")
    size = {step: sum(ckpt.read_manifest(source.step_path(step)).files.values()) for step in (1, 2, 3)}
    assert (bars[0].unit, bars[0].total, bars[0].n) == ("B", size[1], size[1]) == ("B", first["bytes"], first["bytes"])
    assert bars[0].updates[:-1] and max(bars[0].updates) <= 1024  # slice by slice (the last update tops up 0)
    assert (bars[1].total, bars[1].n, second["already_there"]) == (sum(size.values()), sum(size.values()), [1])
    assert bars[1].updates[0] == size[1] and second["bytes"] == size[2] + size[3]
