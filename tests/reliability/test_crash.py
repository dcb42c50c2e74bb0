"""The crash harness (scripts/crash_harness.py), CI-sized: a 2-rank torchrun job of 6 steps,
checkpointing every step (async double_buffer, full_every 3, a local replica, keep 3), SIGKILLed
three times — a uniform kill, one aimed at a save being written, a uniform kill — and restarted
each time until it finishes.

Asserted: after every kill, no process of the job is left, every step listed on the primary and on
the replica is a committed directory whose delta chain walks down to a full checkpoint and whose
tensors and values all load (checksums verified, deltas replayed), the newest among them is the
one the next launch resumed from; at the end, every logged loss and learning rate equals an
uninterrupted run's bit for bit and the final checkpoint's tensors (model and optimizer) and values
equal the uninterrupted run's byte for byte, on both mounts.

Cost: one uninterrupted launch and four launches of the crashed run (torchrun start-up dominates:
about 30-40 s on a quiet 2-core box, more under load). The first tests check, in one process and in
about a second, that the checks themselves catch what they are meant to catch; the last one is a
regression test for the engine bug the campaign found.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.format import step_name
from ckpt.root import CheckpointRoot
from scripts.crash_harness import AIM_TARGETS, Plan, campaign, check_mount, compare_checkpoints, kill_all

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc, SIGSTOP and sessions")

STEPS, KILLS = 6, 3


# -- the checks catch what they should (one process, no torchrun) ---------------------------------

def _chain(root: Path) -> list[int]:
    """Steps 1-4 under ``root``: full, delta, delta, full (full_every 3)."""
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    manager = ckpt.CheckpointManager(root, interval=1, full_every=3, keep=10)
    manager.attach(optimizer)
    for step in range(1, 5):
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        manager.save(step, {"model": model, "optim": optimizer})
    manager.close()
    return CheckpointRoot(root).steps()


def test_check_mount_passes_a_whole_root_and_fails_a_corrupt_base(tmp_path):
    assert _chain(tmp_path) == [1, 2, 3, 4]
    report = check_mount(tmp_path)
    assert report["problems"] == [] and report["verified"] == [1, 2, 3, 4]
    assert [report["kinds"][s] for s in (1, 2, 3, 4)] == ["full", "delta", "delta", "full"]

    data = next((tmp_path / step_name(1) / "data").iterdir())
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    data.write_bytes(bytes(blob))
    report = check_mount(tmp_path)
    broken = sorted({int(p.split("listed step ")[1].split()[0]) for p in report["problems"]})
    assert broken == [1, 2, 3]  # the base, and both deltas replayed over it
    assert report["verified"] == [4]


def test_check_mount_reports_a_listed_step_whose_data_is_gone_and_ignores_leftovers(tmp_path):
    _chain(tmp_path)
    (tmp_path / "step-00000005.tmp-0123456789ab" / "data").mkdir(parents=True)  # a killed save
    (tmp_path / step_name(6)).mkdir()  # a step directory without a manifest: not listed
    for data in (tmp_path / step_name(4) / "data").iterdir():
        data.unlink()
    report = check_mount(tmp_path)
    assert report["listed"] == [1, 2, 3, 4]
    assert report["leftovers"] == ["step-00000005.tmp-0123456789ab", step_name(6)]
    assert len(report["problems"]) == 1 and "listed step 4 does not load" in report["problems"][0]


def test_compare_checkpoints_is_exact(tmp_path):
    _chain(tmp_path)
    assert compare_checkpoints(tmp_path / step_name(3), tmp_path / step_name(3))["ok"]
    different = compare_checkpoints(tmp_path / step_name(3), tmp_path / step_name(4))
    assert not different["ok"] and any("tensors differ" in p for p in different["problems"])


# -- the campaign ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def summary(tmp_path_factory) -> dict:
    workdir = tmp_path_factory.mktemp("crash")
    lines = []
    try:
        result = campaign(workdir, trials=KILLS, seed=7, aim="mixed", plan=Plan(steps=STEPS, launch_timeout=240),
                          log=lines.append)
    finally:
        kill_all()
    print("\n" + "\n".join(lines) + f"\n({result['seconds']:.1f} s; logs under {workdir})")
    return result


@pytest.mark.slow
def test_three_kills_one_aimed_at_a_save_and_nothing_left_running(summary):
    kills = summary["kills"]
    assert len(kills) == KILLS, summary["failures"]
    assert [k["aim"] for k in kills] == ["uniform", AIM_TARGETS[0], "uniform"]
    for kill in kills:  # a kill in the first second may find the agent alone
        assert kill["kill"]["processes"] >= (3 if kill["aim"] != "uniform" else 1)  # the agent, its 2 workers
        assert kill["kill"]["all_stopped"] and kill["kill"]["all_gone"], kill


@pytest.mark.slow
def test_after_every_kill_the_listings_are_whole_chained_and_load(summary):
    assert summary["failures"] == []
    for kill in summary["kills"]:
        assert kill["ok"] and kill["problems"] == [], kill
        for mount in ("primary", "replica"):
            assert kill["verified"][mount] == kill[f"{mount}_listed"], kill  # every listed step loads
        assert kill["newest_after"] == (kill["primary_listed"][-1] if kill["primary_listed"] else None)
    launches = [launch for run in summary["runs"] for launch in run["launches"]]
    for previous, launch in zip(launches, launches[1:]):
        if launch["resumed_from"] is not None:  # the restart resumed from the newest listed step
            kill = next(k for k in summary["kills"] if k["launch"] == previous["index"])
            assert launch["resumed_from"] == kill["newest_after"]


@pytest.mark.slow
def test_the_crashed_run_equals_an_uninterrupted_run_bitwise(summary):
    assert summary["totals"]["runs_completed"] >= 1
    for run in summary["runs"]:
        assert run["ok"], run["problems"]
        assert run["steps_logged"] == STEPS and run["unparsable_lines"] == 0
        for mount in ("primary", "replica"):
            final = run["final"][mount]
            assert final["ok"] and final["model_tensors"] > 0 and final["optim_tensors"] > 0, final
        assert run["launches"][-1]["outcome"] == "exited" and run["launches"][-1]["exit_code"] == 0


# -- found by the harness -------------------------------------------------------------------------

def test_a_replica_step_a_killed_deletion_left_without_manifest_does_not_block_replication(tmp_path):
    """Found by the crash campaign, end to end (and by the corruption campaign); fixed in 48523c3.
    Before, the campaign's run 1 failed: its last launch waited close_timeout and steps 11 and 12
    never reached the replica, blocked behind step 5. The state kills leave: a kill in
    the primary's retention window keeps older steps listed there (retention runs again only at
    the next commit: never, when the run was at its last step); the replica's retention, after a
    restart's catch-up copy, deletes them there; a kill inside that deletion (``commit.delete``
    removes ``manifest.json`` first, then the tree) leaves ``replica/step-1`` without its manifest.
    Nothing removed it on a replica, and ``copy_step`` -> ``commit.begin(overwrite=False)`` refused
    the existing target ("already exists"), retried it while the primary listed the step, newer
    steps waiting behind it, and every exit waited close_timeout. Now the copy replaces it."""
    primary, replica = tmp_path / "primary", tmp_path / "replica"
    model = torch.nn.Linear(4, 4)
    manager = ckpt.CheckpointManager(primary, interval=1, keep=10, replicas=[str(replica)])
    for step in (1, 2):
        manager.save(step, {"model": model})
    manager.close()
    assert CheckpointRoot(replica).steps() == [1, 2]
    (replica / step_name(1) / "manifest.json").unlink()  # the kill, after delete()'s first operation

    manager = ckpt.CheckpointManager(primary, interval=1, keep=10, replicas=[str(replica)], close_timeout=3,
                                     replica_retry_initial=0.1, replica_retry_max=0.2)
    manager.save(3, {"model": model})
    manager.close()  # was: returned after close_timeout, steps 1 and 3 "pending"
    assert CheckpointRoot(replica).steps() == [1, 2, 3], manager.replication_status()


def test_a_replica_step_a_killed_deletion_left_without_manifest_is_collected(tmp_path):
    """The kill struck the replica's deletion of step 1 after its manifest went; the primary had
    already deleted its own step 1. Never listed, never loaded: only the bytes stayed, for good (12 of
    23 runs of the 200-kill campaign ended with 1-2 such directories), until every mount got the
    start-up clean-up the primary's lock() gives it (the replica worker cleans its mount first)."""
    primary, replica = tmp_path / "primary", tmp_path / "replica"
    model = torch.nn.Linear(4, 4)
    manager = ckpt.CheckpointManager(primary, interval=1, keep=2, replicas=[str(replica)])
    for step in (1, 2, 3):
        manager.save(step, {"model": model})
    manager.close()
    assert CheckpointRoot(primary).steps() == [2, 3] and CheckpointRoot(replica).steps() == [2, 3]
    shutil.copytree(replica / step_name(2), replica / step_name(1))  # step 1's bytes, as the kill left them:
    (replica / step_name(1) / "manifest.json").unlink()  # everything but the manifest

    manager = ckpt.CheckpointManager(primary, interval=1, keep=2, replicas=[str(replica)])
    manager.save(4, {"model": model})
    manager.close()
    assert CheckpointRoot(replica).steps() == [3, 4]
    assert not (replica / step_name(1)).exists()  # was: still there, with its data
