"""The memory tier (issue 38) against the restart paths it could block: the real trainer on 2 gloo
ranks, each rank its own node (``LOCAL_WORLD_SIZE=1``, its own memory folder ``<job>/shm/node<rank>``:
rank 0 and rank 1 hold each other's partner copies), storage every step with deltas and a replica
beside it, a memory step every step, kept at the end (``memory_keep_on_exit``) as a crash would
leave them. Every start exits 0 on every rank unless said; the losses of every step trained, the
restarts' included, equal an uninterrupted run's bit for bit; what each restart resumed from is
read from rank 0's line and from metrics.jsonl's ``run_start`` records.

    first run: steps 1-4 (storage: 1 full, 2-3 deltas, 4 full; memory: steps 3 and 4 on each node)

* ``damaged-primary`` / ``damaged-both``: storage step 4 damaged on the primary (and the replica):
  the restart resumes from memory step 4 and trains to 6; a third start with both memory folders
  emptied resumes from storage step 6 and trains 7.
* ``replica-gone``: the replica folder removed and the primary's step 4 damaged: the restart resumes
  from memory step 4; a start at ``training.steps`` 5 then, memory steps 5 and 6 present, trains
  nothing (exit 0, one line).
* ``branch``: ``load_step 2`` without ``branch`` is refused (exit 2) and loses nothing: storage keeps
  steps 1-4 on both mounts, memory its steps 3 and 4, and a start at ``training.steps`` 4 then
  resumes from memory step 4 (exit 0, nothing to train). Then ``load_step 2 --checkpoint.branch
  true`` with another gradient clipping trains step 3; a plain restart goes on from the BRANCH's memory
  step 3, never the old history's step 4: losses equal steps 1-2 trained with the first clipping and
  3-5 with the second (``branch-reference``; step 3's loss, taken before its update, is the first run's too).
* ``layout``: a restart under PP 2 while the FSDP2 run's memory steps are there resumes from storage
  step 4, with one line saying the memory step is another layout's. FSDP2 and PP 2 do not round
  alike (step 4's loss differs in the last bits), so its losses are compared with the same two
  starts without the memory tier (``layout-reference``: FSDP2 to 4, PP 2 to 6).

All in one launch of 2 ranks (``run_ranks``: the trainer imported once, ``trainer.train.main`` called
for each start), one case after another; faults are made by rank 0 between two barriers.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from tests.support.checkpoints import flip_byte
from tests.support.launch import by_rank0, run_ranks
from tests.support.trainer_runs import logged_losses, trainer_args

pytestmark = pytest.mark.slow

FIRST, STEPS, LAST = 4, 6, 7
# The branch's history differs from the first run's by its gradient clipping (the grad norm is ~1.2):
# not by training.lr, which a resume takes from the checkpoint (the optimizer's and scheduler's state)
BRANCH_CLIP = {"training__max_norm": 0.5}
STORAGE = {"checkpoint__enable": "true", "checkpoint__interval": 1, "checkpoint__full_every": 3,
           "checkpoint__keep": 10, "checkpoint__close_timeout": 120, "metrics__log_freq": 1}
# Every step is a storage step too, whose snapshot feeds its memory save: a save waits for a free
# staging buffer (policy block), so no memory step is skipped as busy (a memory-only one would be)
MEMORY = {"checkpoint__memory_interval": 1, "checkpoint__memory_keep_on_exit": "true"}
PP2 = {"parallelism__pp": 2}
BRANCH = {"checkpoint__load_step": 2, "checkpoint__branch": "true", **BRANCH_CLIP}
NOTHING_TO_TRAIN = re.compile(r"^checkpoint step (\d+) is already (at|past) training\.steps = (\d+): nothing to train",
                              re.M)


def _damage(mount: Path, step: int = FIRST) -> None:
    flip_byte(mount / f"step-{step:08d}", largest=True)


def _start(job: Path, rank: int, steps: int, *, memory: bool = True, **extra) -> tuple[int, str]:
    """One start of the trainer's command in ``job`` (this rank's node folder, the replica): its exit
    code and what it printed (stdout and stderr)."""
    from trainer.train import main

    tier = {**MEMORY, "checkpoint__memory": str(job / "shm" / f"node{rank}")} if memory else {}
    argv = trainer_args(str(job), steps=steps, checkpoint__replicas=str(job / "replica"),
                        **{**STORAGE, **tier, **extra})
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(argv)
    return code, out.getvalue()




def _empty_memory(job: Path) -> None:
    """Both nodes' RAM file systems emptied (replaced nodes): the run folders under them gone."""
    for node in (job / "shm").iterdir():
        for run in node.iterdir():
            shutil.rmtree(run)


def _memory_steps(job: Path) -> dict[str, list[int]]:
    """node folder -> the complete memory steps it holds."""
    return {node.name: sorted(int(step.parent.name[len("step-"):]) for step in node.glob("*/step-*/COMPLETE"))
            for node in sorted((job / "shm").iterdir())}


def _stored_steps(mount: Path) -> list[int]:
    return sorted(int(p.name[len("step-"):]) for p in mount.glob("step-*") if p.name[len("step-"):].isdigit())


def _first(job: Path, rank: int) -> tuple[int, str]:
    """The first run, steps 1-4: the faults are made to what it left, so it must have finished."""
    code, out = _start(job, rank, FIRST)
    if code != 0:
        raise AssertionError(f"the first run in {job.name} exited {code} on rank {rank}:\n{out[-3000:]}")
    return code, out


def _damaged_restart(rank: int, job: Path, fault) -> dict:
    first = _first(job, rank)
    by_rank0(rank, lambda: fault(job))
    restart = _start(job, rank, STEPS)
    by_rank0(rank, lambda: _empty_memory(job))
    return {"first": first, "restart": restart, "third": _start(job, rank, LAST)}


def _replica_gone(rank: int, job: Path) -> dict:
    first = _first(job, rank)
    by_rank0(rank, lambda: (shutil.rmtree(job / "replica"), _damage(job / "checkpoints")))
    restart = _start(job, rank, STEPS)
    return {"first": first, "restart": restart, "past": _start(job, rank, STEPS - 1)}


def _branch(rank: int, job: Path) -> dict:
    result = {"first": _first(job, rank)}
    result["refused"] = _start(job, rank, STEPS, checkpoint__load_step=2)
    kept = {}
    by_rank0(rank, lambda: kept.update(primary=_stored_steps(job / "checkpoints"), replica=_stored_steps(job / "replica"),
                                        memory=_memory_steps(job)))
    result["kept"] = kept
    result["at_end"] = _start(job, rank, FIRST)  # what the refused start left: memory step 4 still resumes
    result["branch"] = _start(job, rank, 3, **BRANCH)
    after_branch = {}
    by_rank0(rank, lambda: after_branch.update(memory=_memory_steps(job)))
    result["after_branch"] = after_branch
    result["restart"] = _start(job, rank, 5, **BRANCH_CLIP)
    return result


def _matrix(rank: int, world: int, root: str) -> dict:
    os.environ["LOCAL_WORLD_SIZE"] = "1"  # each rank its own node: the other rank is its partner
    root = Path(root)
    results = {"reference": _start(root / "reference", rank, LAST, memory=False),
               "branch-reference": (_start(root / "branch-reference", rank, 2, memory=False),
                                    _start(root / "branch-reference", rank, 5, memory=False, **BRANCH_CLIP)),
               "layout-reference": (_start(root / "layout-reference", rank, FIRST, memory=False),
                                    _start(root / "layout-reference", rank, STEPS, memory=False, **PP2))}
    results["damaged-primary"] = _damaged_restart(rank, root / "damaged-primary",
                                                  lambda job: _damage(job / "checkpoints"))
    results["damaged-both"] = _damaged_restart(rank, root / "damaged-both",
                                               lambda job: (_damage(job / "checkpoints"), _damage(job / "replica")))
    results["replica-gone"] = _replica_gone(rank, root / "replica-gone")
    results["branch"] = _branch(rank, root / "branch")
    job = root / "layout"
    results["layout"] = {"first": _start(job, rank, FIRST), "restart": _start(job, rank, STEPS, **PP2)}
    return results


def _resumes(job: Path) -> list[tuple[int | None, str | None]]:
    """(resumed_step, resumed_from) of each start that trained (its run_start record), in order."""
    records = map(json.loads, (job / "metrics.jsonl").read_text().splitlines())
    return [(r["resumed_step"], r["resumed_from"]) for r in records if r.get("event") == "run_start"]


def _from_memory(job: Path, step: int, newest: int) -> str:
    """Rank 0's line for a resume from memory step ``step``, storage's newest being ``newest``."""
    return (f"resumed from checkpoint step {step} (from memory: {job / 'shm' / 'node0'}; newest in "
            f"{job / 'checkpoints'}: step {newest})")


def _from_storage(job: Path, step: int) -> str:
    return f"resumed from checkpoint step {step} ({job / 'checkpoints'})"


def _succeeded(results: list[dict], case: str, *starts: str) -> None:
    for rank, result in enumerate(results):
        for start in starts:
            code, out = result[case][start]
            assert code == 0, (case, start, rank, out[-3000:])


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("memory-matrix")
    for job in ("damaged-primary", "damaged-both", "replica-gone", "branch", "layout"):
        (root / job / "shm").mkdir(parents=True)  # each node's RAM file system; its folder made by its rank
    results = run_ranks(2, _matrix, str(root), hang_seconds=600)
    for rank, result in enumerate(results):
        for name in ("reference", *(f"{ref}-reference:{i}" for ref in ("branch", "layout") for i in (0, 1))):
            case, _, index = name.partition(":")
            code, out = result[case] if not index else result[case][int(index)]
            assert code == 0, (name, rank, out[-3000:])
    return root, results


def _reference(root: Path, last: int) -> dict[int, float]:
    losses = logged_losses(root / "reference")
    assert sorted(losses) == list(range(1, LAST + 1))
    return {step: loss for step, loss in losses.items() if step <= last}


@pytest.mark.parametrize("case", ["damaged-primary", "damaged-both"])
def test_a_damaged_newest_storage_step_resumes_from_memory_then_storage_goes_on(matrix, case):
    """Memory step 4 is used although storage's step 4 is damaged (on the primary, or on every
    mount); with the memory folders emptied, the next start resumes from storage step 6 (saved by
    the restart: a full step 5 and a delta on it, so the damaged step 4 is in no chain it loads)."""
    root, results = matrix
    job = root / case
    _succeeded(results, case, "first", "restart", "third")
    assert _from_memory(job, FIRST, FIRST) in results[0][case]["restart"][1]
    assert _from_storage(job, STEPS) in results[0][case]["third"][1]
    assert _resumes(job) == [(None, None), (FIRST, "memory"), (STEPS, "storage")]
    assert logged_losses(job) == _reference(root, LAST)  # the restarts' steps included, bitwise


def test_with_the_replica_gone_and_the_primary_damaged_memory_resumes(matrix):
    root, results = matrix
    job = root / "replica-gone"
    _succeeded(results, "replica-gone", "first", "restart", "past")
    assert _from_memory(job, FIRST, FIRST) in results[0]["replica-gone"]["restart"][1]
    assert _resumes(job) == [(None, None), (FIRST, "memory")]
    assert logged_losses(job) == _reference(root, STEPS)


def test_a_start_past_training_steps_with_memory_steps_trains_nothing(matrix):
    """Memory steps 5 and 6 there, training.steps 5: exit 0 on every rank, rank 0's one line after
    the resume line, nothing written (no run_start record, no loss)."""
    root, results = matrix
    job = root / "replica-gone"
    _succeeded(results, "replica-gone", "past")
    out = results[0]["replica-gone"]["past"][1]
    assert out.splitlines() == [_from_memory(job, STEPS, STEPS), NOTHING_TO_TRAIN.search(out).group(0) + _HINT]
    assert NOTHING_TO_TRAIN.search(out).groups() == (str(STEPS), "past", str(STEPS - 1))
    assert results[1]["replica-gone"]["past"][1] == ""
    assert len(_resumes(job)) == 2  # first and restart: the third start wrote nothing


_HINT = "; raise --training.steps or use another dump folder"


def test_a_refused_load_step_loses_no_step_of_either_tier(matrix):
    """load_step 2 without branch while storage steps 3-4 exist: exit 2 on every rank; every storage
    step on both mounts and every memory step on both nodes still there, and the next start (at
    training.steps 4) resumes from memory step 4."""
    root, results = matrix
    job = root / "branch"
    for rank, result in enumerate(results):
        code, out = result["branch"]["refused"]
        assert code == 2 and "checkpoint.load_step=2: the committed steps 3, 4 are newer" in out, (rank, out[-3000:])
    kept = results[0]["branch"]["kept"]
    assert kept == {"primary": [1, 2, 3, 4], "replica": [1, 2, 3, 4], "memory": {"node0": [3, 4], "node1": [3, 4]}}
    _succeeded(results, "branch", "at_end")
    out = results[0]["branch"]["at_end"][1]
    assert out.splitlines() == [_from_memory(job, FIRST, FIRST),
                                f"checkpoint step {FIRST} is already at training.steps = {FIRST}: nothing to train"
                                + _HINT]


def test_a_restart_after_a_branch_goes_on_with_the_branch_not_the_old_memory_steps(matrix):
    """The branch (from storage step 2, another gradient clipping) trains step 3 while the old history's
    memory steps 3 and 4 are there; the plain restart after it resumes from the branch's memory step
    3, and every loss is the branch's: steps 1-2 with the first clipping, 3-5 with the second."""
    root, results = matrix
    job = root / "branch"
    _succeeded(results, "branch", "first", "branch", "restart")
    branch_out = results[0]["branch"]["branch"][1]
    assert "branching from step 2: deleted the later steps 3, 4" in branch_out
    assert _from_storage(job, 2) in branch_out
    assert _from_memory(job, 3, 3) in results[0]["branch"]["restart"][1]
    assert _resumes(job) == [(None, None), (2, "storage"), (3, "memory")]
    reference = logged_losses(root / "branch-reference")
    assert sorted(reference) == list(range(1, 6))
    first = logged_losses(root / "reference")
    assert [reference[s] for s in (1, 2, 3)] == [first[s] for s in (1, 2, 3)]  # step 3's loss is before its update:
    assert reference[4] != first[4]  # the branch's history differs from the first run's from step 4's loss on
    assert logged_losses(job) == reference
    assert results[0]["branch"]["after_branch"]["memory"] == {"node0": [3], "node1": [3]}  # the old step 4 gone


def test_a_layout_change_resumes_from_storage_saying_why(matrix):
    root, results = matrix
    job = root / "layout"
    _succeeded(results, "layout", "first", "restart")
    out = results[0]["layout"]["restart"][1]
    why = re.findall(r"^memory step (\d+) unusable \(rank \d+: .*another layout.*\): resuming from storage$", out, re.M)
    assert why == [str(FIRST)], out[-3000:]
    assert _from_storage(job, FIRST) in out and "from memory" not in out
    assert _resumes(job) == [(None, None), (FIRST, "storage")]
    losses = logged_losses(job)
    assert losses == logged_losses(root / "layout-reference")  # the same starts without the memory tier
    assert {s: losses[s] for s in range(1, FIRST + 1)} == _reference(root, FIRST)
