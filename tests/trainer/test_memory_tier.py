"""The memory tier under torchrun (issue 38): the trainer as two nodes (two agents on this machine,
:class:`tests.support.agents.TwoNodes`, one rank each), each node its own memory directory
(``<job>/shm/node0`` and ``node1``: one machine plays two nodes), the checkpoint folder shared; 10
steps of the debug model, a storage step every 4 (and the last), a memory step every step.

One saving job (another run's memory folder beside ours on node 0) is held after step 7 (every worker
stops itself right before step 8 begins, tests.support.held_trainer: its files are then what a kill of
the whole job at that moment would leave, whatever the box's load) and its job folder copied twice; then

* (a) one of its workers is SIGKILLed: torchrun restarts the group, which resumes from a memory step
  newer than storage's step 4 and finishes; (f) its clean finish removes our memory steps on both
  nodes and leaves the other run's folder untouched, byte for byte;
* (b) in the first copy node 1 is lost (its memory directory wiped, as a replacement node's RAM file
  system is): both agents launched again, node 1's rank takes its files from the partner node and
  the run resumes from memory;
* (c) in the second copy both copies of rank 1's files are gone: the run says why, once, resumes
  from storage's newest and commits the next storage steps from its two ranks (a second two-node
  job resuming a two-node job's storage step: tests/trainer/test_multinode.py runs only one job).

Every loss logged, before and after each resume, equals an uninterrupted run's bit for bit (the
same 2 ranks forked from the tests' fork server: no torchrun needed for the reference). One rank per
node: what two ranks per node change (which rank is whose partner, from torchrun's LOCAL_WORLD_SIZE)
is proven on 4 gloo ranks as 2 nodes of 2 in tests/ckpt/memory/test_tier.py, with every recovery.
The jobs save inline (``checkpoint.async_mode sync``): with staging, a memory step whose writer is
still busy is skipped (the memory gate, tests/ckpt/memory/test_gate.py), so which steps are kept
would depend on timing; inline, step 7's memory save is complete on every rank when the ranks stop,
so the hold leaves memory steps 6 and 7 and storage's step 4.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import uuid
from pathlib import Path

import pytest

import ckpt
from ckpt.format import step_name
from ckpt.root import CheckpointRoot
from tests.support import REPO
from tests.support.agents import TwoNodes
from tests.support.launch import run_ranks
from tests.support.trainer_runs import logged_losses, run_trainer

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc and process groups"),
              pytest.mark.slow]  # three torchrun jobs of two agents and a restart

STEPS, INTERVAL, HOLD_AFTER = 10, 4, 7
MEMORY_LINE = re.compile(r"resumed from checkpoint step (\d+) \(from memory: (\S+); newest in \S+: (?:step (\d+)|none)\)")


def _argv(job: Path, node: int | None = None) -> list[str]:
    """The trainer's command line in ``job``; with ``node``, that node's memory directory."""
    memory = [] if node is None else ["--checkpoint.memory", str(job / "shm" / f"node{node}"),
                                      "--checkpoint.memory_interval", "1"]
    return ["--config", str(REPO / "configs" / "debug.toml"), "--job.dump_folder", str(job / "run"),
            "--training.steps", str(STEPS), "--training.seq_len", "32", "--training.batch_size", "8",
            "--checkpoint.interval", str(INTERVAL), "--metrics.log_freq", "1", "--checkpoint.async_mode", "sync",
            *memory]


def _job(job: Path, *, max_restarts: int = 0, hold_after: int | None = None) -> TwoNodes:
    (job / "shm").mkdir(exist_ok=True)  # the RAM file system's mount point; each node's folder made by its rank
    return TwoNodes(job, lambda node: _argv(job, node), nproc=1, max_restarts=max_restarts, hold_after=hold_after)


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


def _losses(rank: int, world: int, job: str) -> list[float]:
    return run_trainer(_argv(Path(job)))[0]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[float]:
    """The reference: the same job on the same 2 ranks (no memory tier), never stopped."""
    return run_ranks(2, _losses, str(tmp_path_factory.mktemp("uninterrupted")))[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """The saving job, held after step 7 and copied twice, then (a) a worker killed and (f) finished."""
    job, lost_node, lost_rank = (tmp_path_factory.mktemp(name) for name in ("job", "lost-node", "lost-rank"))
    other = job / "shm" / "node0" / uuid.uuid4().hex / "step-00000003"
    (other / "rank-00000" / "data").mkdir(parents=True)
    (other / "rank-00000" / "data" / "rank-00000.bin").write_bytes(b"another run's bytes")
    (other / "rank-00000" / "manifest.json").write_text("{}")
    (other / "COMPLETE").write_text('{"run": "%s", "step": 3, "node": 0, "ranks": [0]}' % other.parent.name)
    other_before = _tree(other.parent)
    nodes = _job(job, max_restarts=1, hold_after=HOLD_AFTER).start()
    with nodes.held():
        for copy in (lost_node, lost_rank):
            for folder in ("shm", "run"):
                shutil.copytree(job / folder, copy / folder, symlinks=True)
        runs_during = _run_dirs(job)  # ours beside the other run's, while it trains
        nodes.kill_worker(1)
    nodes.wait()  # the restarted group finished: both agents exit 0
    return {"job": job, "lost_node": lost_node, "lost_rank": lost_rank, "other": other.parent,
            "other_before": other_before, "runs_during": runs_during, "runs_after": _run_dirs(job),
            "outputs": nodes.outputs()}


def test_a_killed_worker_is_restarted_by_torchrun_and_resumes_from_memory(saved, uninterrupted):
    step, newest = _memory_resume(saved["outputs"])
    assert (step, newest) == (HOLD_AFTER, INTERVAL)  # the held step, newer than storage's
    assert _resumed_steps(saved["job"]) == [None, step]
    assert logged_losses(saved["job"] / "run") == dict(enumerate(uninterrupted, 1))  # bitwise, resumed steps too


def test_a_clean_finish_removes_our_memory_steps_and_leaves_another_run_s(saved):
    other = saved["other"]
    ours = [run for run in saved["runs_during"] if run != other]
    assert len(ours) == 2 and {run.name for run in ours} != {other.name}  # one folder per node, our run id
    assert saved["runs_after"] == [other]  # ours gone on both nodes
    assert _tree(other) == saved["other_before"]  # untouched, byte for byte


def test_a_lost_node_s_rank_fetches_its_files_from_the_partner_node(saved, uninterrupted):
    job = saved["lost_node"]
    shutil.rmtree(job / "shm" / "node1")  # the replacement node's RAM file system: empty
    (job / "shm" / "node1").mkdir()
    again = _job(job).start()
    again.wait()
    step, newest = _memory_resume(again.outputs())  # no rank could load it without node 1's rank's copy
    assert (step, newest) == (HOLD_AFTER, INTERVAL)  # the held step, newer than storage's
    assert _resumed_steps(job) == [None, step]
    assert logged_losses(job / "run") == dict(enumerate(uninterrupted, 1))


def test_both_copies_of_a_rank_lost_resume_from_storage_saying_why(saved, uninterrupted):
    job = saved["lost_rank"]
    lost = [rank for run in _run_dirs(job) for rank in run.glob("step-*/rank-00001")]
    assert len(lost) >= 2  # its own node's files and the partner's copy, of each step kept
    for rank in lost:
        shutil.rmtree(rank)
    stored = CheckpointRoot(job / "run" / "checkpoints").steps()[-1]
    again = _job(job).start()
    again.wait()
    out = "".join(again.outputs())
    why = re.findall(r"^memory step (\d+) unusable \(rank 1: its files are on no node\): resuming from storage$",
                     out, re.M)
    assert len(why) == 1 and int(why[0]) >= stored, out[-4000:]
    assert f"resumed from checkpoint step {stored} ({job / 'run' / 'checkpoints'})" in out
    assert not MEMORY_LINE.search(out)
    assert _resumed_steps(job) == [None, stored]
    assert logged_losses(job / "run") == dict(enumerate(uninterrupted, 1))
    checkpoints = job / "run" / "checkpoints"  # the resumed two-node job commits from its two ranks
    assert CheckpointRoot(checkpoints).steps() == [INTERVAL, 2 * INTERVAL, STEPS]
    assert ckpt.read_manifest(checkpoints / step_name(STEPS)).world_size == 2
