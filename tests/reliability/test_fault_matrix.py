"""The restart fault matrix: the real trainer (2 ranks; FSDP2, and PP 2) with deltas and a replica,
one fault at a time between a run and its restart; the restart finishes (exit 0 on every rank) and
the losses of the steps it trained equal an uninterrupted run's, bit for bit. A case expected to
stop the run stops with exit 2 and one line on every rank, and the start after the stated manual
step finishes as above.

FSDP2 runs every case. PP 2 runs the cases of damaged or lost checkpoint bytes
(:data:`LOAD_PATH_CASES`: on the primary, the replica or both, or the replica gone), where what the
restart reads, falls back to and copies again is the layout's own state (each rank a stage). The
other cases (a lock held by another process, a dead S3 endpoint, a replica refusing a branch's
deletions) are decided by the checkpoint root and its mounts, alike for any layout: run once,
under FSDP2.

Each layout's cases run one after another in the same 2 ranks (``run_ranks``: the trainer imported
once; ``trainer.train.main`` called for each start, so its exit codes and error lines are the
command's). Faults are made by rank 0 between two barriers. SIGKILL during a save is the crash
harness's (tests/reliability/test_crash.py: the same trainer, 2 ranks, deltas, a local replica).

    first run: steps 1-4, a checkpoint every step (full_every 3: 1 full, 2-3 deltas, 4 full), replica
               (trained once with a folder replica and copied for each case; the S3 case trains its own)
    fault:     one of CASES
    restart:   --training.steps 6 (the S3 case: with the replica's endpoint down; the branch case:
               --checkpoint.load_step 2 --checkpoint.branch true, first refused while the replica's
               deletions fail, then again once they work)
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
from pathlib import Path

import pytest

from tests.support.checkpoints import flip_byte
from tests.support.launch import barrier, by_rank0, run_ranks
from tests.support.trainer_runs import logged_losses, trainer_args

pytestmark = pytest.mark.slow

FIRST, STEPS = 4, 6
LAYOUTS = {"fsdp2": {}, "pp2": {"parallelism__pp": 2}}
CHECKPOINTS = {"checkpoint__enable": "true", "checkpoint__interval": 1, "checkpoint__full_every": 3,
               "checkpoint__keep": 10, "checkpoint__close_timeout": 120, "metrics__log_freq": 1}
DEAD_ENDPOINT = "http://127.0.0.1:9"  # discard port: nothing listens, connections are refused at once


def _damage(checkpoints: Path, step: int) -> None:
    flip_byte(checkpoints / f"step-{step:08d}", largest=True)


def _no_fault(job: Path) -> None:
    pass


CASES = {
    "damaged-primary": lambda job: _damage(job / "checkpoints", FIRST),
    "damaged-replica": lambda job: _damage(job / "replica", FIRST),
    "damaged-both": lambda job: (_damage(job / "checkpoints", FIRST), _damage(job / "replica", FIRST)),
    "replica-gone": lambda job: shutil.rmtree(job / "replica"),
    "s3-replica-down": _no_fault,  # the restart's endpoint is dead (see _start)
    "second-run": _no_fault,  # the restart finds the folder locked by another process (see _matrix)
    "branch-failing-replica": _no_fault,  # the restart branches from step 2 while the replica's deletes fail
}
BRANCH = {"checkpoint__load_step": 2, "checkpoint__branch": "true"}
LOAD_PATH_CASES = ["damaged-primary", "damaged-replica", "damaged-both", "replica-gone"]
LAYOUT_CASES = {"fsdp2": list(CASES), "pp2": LOAD_PATH_CASES}


@contextlib.contextmanager
def _failing_deletes(mount: Path):
    """Deleting a step on ``mount`` fails (a replica that refuses deletions) inside the block."""
    from ckpt.errors import StorageError
    from ckpt.root import CheckpointRoot

    original = CheckpointRoot.delete

    def delete(root, step):
        if str(root.path) == str(mount):
            raise StorageError(f"{root.path}: permission denied", path=str(root.path))
        original(root, step)

    CheckpointRoot.delete = delete
    try:
        yield
    finally:
        CheckpointRoot.delete = original


def _start(job: Path, steps: int, layout: dict, replica: str, **extra) -> tuple[int, str]:
    """One start of the trainer's command (``trainer.train.main``): its exit code and stderr."""
    from trainer.train import main

    argv = trainer_args(str(job), steps=steps, checkpoint__replicas=replica,
                        **{**CHECKPOINTS, **layout, **extra})
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue()




def _hold(folder: Path):
    """Another process (a second run) holding ``folder``'s manager until its stdin closes."""
    import subprocess
    import sys

    code = ("import sys, ckpt\n"
            f"manager = ckpt.CheckpointManager({str(folder)!r})\n"
            "print('held', flush=True)\n"
            "sys.stdin.read()\n"
            "manager.close()\n")
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")})
    assert holder.stdout.readline().strip() == "held"
    return holder


def _matrix(rank: int, world: int, root: str, layout: dict, cases: list[str], bucket_url: str) -> dict:
    root = Path(root)
    results = {"reference": _start(root / "reference", STEPS, layout, str(root / "reference" / "replica"))}
    # one first run (steps 1-4, its replica a folder beside it), copied for each case whose replica
    # is a folder: the same bytes each time, trained once (the S3 case trains its own)
    first_run = _start(root / "first-run", FIRST, layout, str(root / "first-run" / "replica"))
    for case in cases:
        job = root / case
        replica = f"{bucket_url}/{case}" if case.startswith("s3") else str(job / "replica")
        if case.startswith("s3"):
            first = _start(job, FIRST, layout, replica)
        else:
            by_rank0(rank, lambda job=job: shutil.copytree(root / "first-run", job, symlinks=True))
            first = first_run
        by_rank0(rank, lambda case=case, job=job: CASES[case](job))
        if case.startswith("s3"):
            endpoint = os.environ["AWS_ENDPOINT_URL"]
            os.environ["AWS_ENDPOINT_URL"] = DEAD_ENDPOINT
            _clear_s3fs()
        if case == "second-run":  # another process takes the folder; the restart is refused; it lets go
            holder = _hold(job / "checkpoints") if rank == 0 else None
            barrier()
            results[f"{case}:refused"] = _start(job, STEPS, layout, replica)
            barrier()
            if holder is not None:  # the manual step: the other run ends
                holder.stdin.close()
                assert holder.wait(timeout=120) == 0
            barrier()
        extra = {}
        if case.startswith("s3"):  # with the replica down, the end waits close_timeout for copies that cannot happen
            extra = {"checkpoint__close_timeout": 2}
        if case.startswith("branch"):  # refused while the replica keeps the old branch; the manual step: it is fixed
            extra = BRANCH
            with _failing_deletes(job / "replica"):
                results[f"{case}:refused"] = _start(job, STEPS, layout, replica, **extra)
            barrier()
        restart = _start(job, STEPS, layout, replica, **extra)
        if case.startswith("s3"):
            os.environ["AWS_ENDPOINT_URL"] = endpoint
            _clear_s3fs()
        results[case] = (first, restart)
        barrier()
    return results


def _clear_s3fs() -> None:
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_single_fault_restarts_to_the_uninterrupted_losses(layout, tmp_path, request):
    """See the module docstring. ``second-run``: another process holds the folder's lock when the
    restart starts (exit 2 on every rank, one line on rank 0); it lets go (the manual step), and the
    next start finishes."""
    cases, bucket_url = LAYOUT_CASES[layout], ""
    if any(case.startswith("s3") for case in cases):  # the S3 server only where a case needs it
        request.getfixturevalue("aws_env")
        bucket_url = request.getfixturevalue("s3_bucket").url
    results = run_ranks(2, _matrix, str(tmp_path), LAYOUTS[layout], cases, bucket_url, hang_seconds=1500)
    reference = logged_losses(tmp_path / "reference")
    assert results[0]["reference"][0] == 0 and sorted(reference) == list(range(1, STEPS + 1))
    for case in cases:
        for rank, result in enumerate(results):
            (first_code, first_err), (code, err) = result[case]
            assert first_code == 0, (case, rank, first_err)
            assert code == 0, (case, rank, err)
        assert logged_losses(tmp_path / case) == reference, case  # the restart's steps included, bitwise
    for rank, result in enumerate(results if "second-run" in cases else ()):
        code, err = result["second-run:refused"]  # every rank refuses alike: local rank 0 says it
        said = rank == 0
        assert code == 2 and err.count("\n") == said, (rank, err)
        assert ("error: " in err and "lock held by" in err) == said, (rank, err)
        code, err = result["branch-failing-replica:refused"]
        assert code == 2 and err.count("\n") == 1 and "step 4 not deleted" in err, (rank, err)
    damaged = [p.name for p in (tmp_path / "damaged-both" / "checkpoints").iterdir() if ".damaged-" in p.name]
    assert len(damaged) == 1 and damaged[0].startswith(f"step-{FIRST:08d}.damaged-")
