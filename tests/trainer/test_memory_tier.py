"""The memory tier under torchrun (issue 38): the trainer as two nodes of 2 ranks each (two agents on
this machine, :class:`tests.support.agents.TwoNodes`), each node its own memory directory
(``<tmp>/shm/node0`` and ``node1``: one machine plays two nodes), the checkpoint folder shared; 10
steps of the debug model, a storage step every 4 (and the last), a memory step every step.

* a worker SIGKILLed after step 7 is logged: torchrun restarts the group, which resumes from a memory
  step newer than storage's step 4;
* a whole node killed and its memory directory wiped, the job taken down: both agents launched
  again, the lost node's ranks take their files from the partner node and the run resumes from memory;
* both copies of one rank's files gone: the run says why, once, and resumes from storage's newest;
* another run's memory folder beside ours is untouched after our clean finish, ours removed.

Every loss logged, before and after the resume, equals an uninterrupted run's bit for bit. The jobs
save inline (``checkpoint.async_mode sync``): with staging, a memory step whose writer is still busy is
skipped (the memory gate, tests/ckpt/memory/test_gate.py), so which steps are kept would depend on
timing; inline, a step logged means every rank's memory save of the step before it was complete, so
a kill after step 7 leaves memory step 6 or newer (the restart may find a newer one: whatever was
complete when the kill struck).
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import uuid
from pathlib import Path

import pytest

from ckpt.root import CheckpointRoot
from tests.support import REPO
from tests.support.agents import TwoNodes
from tests.support.trainer_runs import logged_losses

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc and process groups"),
              pytest.mark.slow]  # torchrun jobs of two agents, 4 ranks

STEPS, INTERVAL, KILL_AFTER = 10, 4, 7
MEMORY_LINE = re.compile(r"resumed from checkpoint step (\d+) \(from memory: (\S+); newest in \S+: (?:step (\d+)|none)\)")


def _argv(job: Path, node: int) -> list[str]:
    return ["--config", str(REPO / "configs" / "debug.toml"), "--job.dump_folder", str(job / "run"),
            "--training.steps", str(STEPS), "--training.seq_len", "32", "--training.batch_size", "8",
            "--checkpoint.interval", str(INTERVAL), "--metrics.log_freq", "1",
            "--checkpoint.memory", str(job / "shm" / f"node{node}"), "--checkpoint.memory_interval", "1",
            "--checkpoint.async_mode", "sync"]


def _job(tmp: Path, *, max_restarts: int = 0) -> TwoNodes:
    (tmp / "shm").mkdir(exist_ok=True)  # the RAM file system's mount point; each node's folder made by its ranks
    return TwoNodes(tmp, lambda node: _argv(tmp, node), max_restarts=max_restarts)


def _memory_resume(outputs: list[str]) -> tuple[int, int | None]:
    """(the memory step resumed from, storage's newest then) from the one resume line of rank 0."""
    found = [m for output in outputs for m in MEMORY_LINE.finditer(output)]
    assert len(found) == 1, "no (or more than one) resume from memory:\n" + "\n".join(o[-4000:] for o in outputs)
    step, newest = int(found[0].group(1)), found[0].group(3)
    return step, None if newest is None else int(newest)


def _resumed_steps(job: Path) -> list[int | None]:
    """Each launch's (and restart's) run_start record: the step it resumed from."""
    records = map(json.loads, (job / "run" / "metrics.jsonl").read_text().splitlines())
    return [r["resumed_step"] for r in records if r.get("event") == "run_start"]


def _run_dirs(job: Path) -> list[Path]:
    return sorted(run for node in (job / "shm").iterdir() for run in node.iterdir())


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() if p.is_file() else b"<dir>" for p in sorted(path.rglob("*"))}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    """The reference: the same job, never stopped, with another run's memory folder on node 0."""
    job = tmp_path_factory.mktemp("uninterrupted")
    other = job / "shm" / "node0" / uuid.uuid4().hex / "step-00000003"
    (other / "rank-00000" / "data").mkdir(parents=True)
    (other / "rank-00000" / "data" / "rank-00000.bin").write_bytes(b"another run's bytes")
    (other / "rank-00000" / "manifest.json").write_text("{}")
    (other / "COMPLETE").write_text('{"run": "%s", "step": 3, "node": 0, "ranks": [0]}' % other.parent.name)
    other_before = _tree(other.parent)
    nodes = _job(job).start()
    nodes.wait_for_step(KILL_AFTER)
    runs_during = _run_dirs(job)  # ours beside the other run's, while it trains
    nodes.wait()
    return {"losses": logged_losses(job / "run"), "other": other.parent, "other_before": other_before,
            "runs_during": runs_during, "runs_after": _run_dirs(job), "outputs": nodes.outputs()}


def test_a_clean_finish_removes_our_memory_steps_and_leaves_another_run_s(uninterrupted):
    other = uninterrupted["other"]
    ours = [run for run in uninterrupted["runs_during"] if run != other]
    assert len(ours) == 2 and {run.name for run in ours} != {other.name}  # one folder per node, our run id
    assert uninterrupted["runs_after"] == [other]  # ours gone on both nodes
    assert _tree(other) == uninterrupted["other_before"]  # untouched, byte for byte
    assert sorted(uninterrupted["losses"]) == list(range(1, STEPS + 1))


def test_a_killed_worker_is_restarted_by_torchrun_and_resumes_from_memory(tmp_path, uninterrupted):
    nodes = _job(tmp_path, max_restarts=1).start()
    nodes.wait_for_step(KILL_AFTER)
    nodes.kill_worker(1)
    nodes.wait()  # the restarted group finished: both agents exit 0
    step, newest = _memory_resume(nodes.outputs())
    assert step >= KILL_AFTER - 2 and step > INTERVAL and (newest is None or step >= newest)
    assert _resumed_steps(tmp_path) == [None, step]
    assert logged_losses(tmp_path / "run") == uninterrupted["losses"]  # bitwise, the steps after the resume too


def test_a_lost_node_s_ranks_fetch_their_files_from_the_partner_node(tmp_path, uninterrupted):
    nodes = _job(tmp_path).start()
    nodes.wait_for_step(KILL_AFTER)
    nodes.kill_node(1)
    nodes.kill_node(0)  # the job goes down too, as its scheduler takes it down: its survivors can wait
    # in a collective with the lost ranks until the process group's timeout (30 minutes)
    shutil.rmtree(tmp_path / "shm" / "node1")  # the replacement node's RAM file system: empty
    (tmp_path / "shm" / "node1").mkdir()
    again = _job(tmp_path).start()
    again.wait()
    step, newest = _memory_resume(again.outputs())  # no rank could load it without node 1's ranks' copies
    assert step >= KILL_AFTER - 2 and step > INTERVAL and (newest is None or step >= newest)
    assert _resumed_steps(tmp_path)[-1] == step
    assert logged_losses(tmp_path / "run") == uninterrupted["losses"]


def test_both_copies_of_a_rank_lost_resume_from_storage_saying_why(tmp_path, uninterrupted):
    nodes = _job(tmp_path).start()
    nodes.wait_for_step(KILL_AFTER)
    nodes.kill_all()
    lost = [rank for run in _run_dirs(tmp_path) for rank in run.glob("step-*/rank-00001")]
    assert len(lost) >= 2  # its own node's files and the partner's copy, of each step kept
    for rank in lost:
        shutil.rmtree(rank)
    stored = CheckpointRoot(tmp_path / "run" / "checkpoints").steps()[-1]
    again = _job(tmp_path).start()
    again.wait()
    out = "".join(again.outputs())
    why = re.findall(r"^memory step (\d+) unusable \(rank 1: its files are on no node\): resuming from storage$",
                     out, re.M)
    assert len(why) == 1 and int(why[0]) >= stored, out[-4000:]
    assert f"resumed from checkpoint step {stored} ({tmp_path / 'run' / 'checkpoints'})" in out
    assert not MEMORY_LINE.search(out)
    assert _resumed_steps(tmp_path)[-1] == stored
    assert logged_losses(tmp_path / "run") == uninterrupted["losses"]
