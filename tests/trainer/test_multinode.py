"""The trainer as a two-node job: two torchrun agents on this machine (one process each) meet through
c10d rendezvous on 127.0.0.1, train and checkpoint. A second two-node job resuming from a two-node
job's storage step is tests/trainer/test_memory_tier.py's (c): it resumes in a new two-agent job
(after the memory tier declined), bitwise against an uninterrupted run, and commits the next steps
from its two ranks.

Compared with a one-process run of the same 6 steps (in the test's process: cheaper than another
torchrun job), the logged losses at steps 2, 4 and 6 must agree to 1e-5 (the mean of two ranks'
losses against one loss over the same 8 sequences: reassociation only). The comparison is valid
because the data loader's order is global (``trainer.data.DataLoader``: global sample ``g`` is a
seeded permutation's entry, rank ``r`` of ``D`` takes the ``r``-th contiguous slice of each global
batch), and both runs have the same global batch (8) and the same learning rates (compared too).
c10d rendezvous ignores ``--node_rank`` and numbers the agents by sorting (advertised address,
process id), here by process id, so which agent holds rank 0 may change between jobs; the logged
loss is the mean over both ranks, which does not depend on that.

The agents get ``OMP_NUM_THREADS=1`` and ``GLOO_SOCKET_IFNAME`` = this machine's loopback interface,
and no ``MASTER_ADDR``/``MASTER_PORT``: the rendezvous supplies them. Each agent runs in its own
session with a bounded wait; when one fails or the wait runs out, both agents and their workers
are killed and the test fails with both logs.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import ckpt
from ckpt.format import step_name
from ckpt.root import CheckpointRoot
from tests.support import REPO
from tests.support.launch import descendants, free_port, job_env
TIMEOUT_S = 180  # one job (two agents): 10-26 s measured on a shared 2-core box
STEPS = 6
pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc and process groups"),
              pytest.mark.slow]  # a torchrun job of two agents


def _env() -> dict[str, str]:
    return job_env(LOGLEVEL="INFO")  # the agents log their rendezvous result (group_rank, group_world_size)


def _trainer_args(dump_folder: Path, steps: int) -> list[str]:
    return ["-m", "trainer.train", "--config", str(REPO / "configs" / "debug.toml"),
            "--job.dump_folder", str(dump_folder), "--training.steps", str(steps), "--training.seq_len", "64",
            "--checkpoint.enable", "true", "--checkpoint.interval", "2", "--metrics.log_freq", "2"]


def _kill(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each agent's process group (an agent stops its workers on it), then SIGKILL whatever
    is left: the agents' groups and every worker found under them beforehand."""
    live = [p for p in procs if p.poll() is None]
    workers = [pid for p in live for pid in descendants(p.pid)]
    for p in live:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    for p in live:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in live:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
            os.killpg(p.pid, signal.SIGKILL)
    for pid in workers:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
            os.kill(pid, signal.SIGKILL)
    for p in live:
        p.wait(timeout=10)


def _torchrun(launches: list[list[str]], logs: list[Path]) -> tuple[list[str], float]:
    """Start one agent per launch (``python -m torch.distributed.run <launch>``) at once, each in
    its own session, logging to ``logs``; wait for all with one deadline. Returns their outputs and
    the wall time. Fails the test (after killing every agent and worker) when one exits non-zero
    or the deadline passes."""
    procs, files = [], []
    started = time.monotonic()
    try:
        for launch, log in zip(launches, logs):
            files.append(log.open("wb"))
            procs.append(subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *launch], cwd=REPO,
                                          env=_env(), stdin=subprocess.DEVNULL, stdout=files[-1],
                                          stderr=subprocess.STDOUT, start_new_session=True))
        deadline = started + TIMEOUT_S
        while True:
            codes = [p.poll() for p in procs]  # every one polled: a failure ends the wait at once
            if None not in codes or any(code not in (None, 0) for code in codes) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        _kill(procs)
        for f in files:
            f.close()
    elapsed = time.monotonic() - started
    outputs = [log.read_text(errors="replace") for log in logs]
    codes = [p.returncode for p in procs]
    if codes != [0] * len(procs):
        report = "\n".join(f"--- agent {i} (exit {code}), {log}:\n{out[-6000:]}"
                           for i, (code, log, out) in enumerate(zip(codes, logs, outputs)))
        pytest.fail(f"torchrun agents exited {codes} after {elapsed:.1f} s (limit {TIMEOUT_S} s)\n{report}")
    return outputs, elapsed


def _two_nodes(dump_folder: Path, steps: int, logs: Path) -> tuple[list[str], float]:
    """Two agents, one process each, as nodes 0 and 1 of a c10d rendezvous on 127.0.0.1."""
    endpoint, run_id = f"127.0.0.1:{free_port()}", f"multinode-{uuid.uuid4().hex[:12]}"
    launches = [["--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(node), "--rdzv_backend", "c10d",
                 "--rdzv_endpoint", endpoint, "--rdzv_id", run_id,
                 "--local_addr", "127.0.0.1",  # what the agents advertise (else this host's FQDN): loopback only
                 *_trainer_args(dump_folder, steps)]
                for node in (0, 1)]
    return _torchrun(launches, [logs / f"node{node}.log" for node in (0, 1)])


def _metrics(dump_folder: Path) -> dict[int, dict]:
    lines = (dump_folder / "metrics.jsonl").read_text().splitlines()
    return {record["step"]: record for record in map(json.loads, lines) if "event" not in record}


def _rendezvous_seconds(outputs: list[str]) -> str:
    """How long the agents waited in rendezvous, from their log lines' clock (for the timing line)."""
    def clock(output: str, message: str) -> float | None:
        m = re.search(r"^I\d{4} (\d\d):(\d\d):(\d\d\.\d+) .*" + message, output, re.M)
        return None if m is None else 3600 * int(m.group(1)) + 60 * int(m.group(2)) + float(m.group(3))

    waits = []
    for output in outputs:
        begin, end = clock(output, "Rendezvous'ing worker group"), clock(output, "Rendezvous complete")
        waits.append("?" if begin is None or end is None else f"{end - begin:.1f}")
    return "/".join(waits) + " s"


def _rendezvous(output: str) -> tuple[int, int, str]:
    """(group_rank, group_world_size, master_addr) from an agent's "Rendezvous complete" log."""
    found = [re.search(rf"\b{key}=(\S+)", output) for key in ("group_rank", "group_world_size", "master_addr")]
    assert all(found), f"no rendezvous result in the agent's log:\n{output[-3000:]}"
    rank, world, addr = (m.group(1) for m in found)
    return int(rank), int(world), addr


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("multinode")
    two, one = root / "two-nodes", root / "one-node"
    (root / "logs").mkdir()
    outputs, seconds = _two_nodes(two, STEPS, root / "logs")
    from trainer.train import (
        main,  # the reference: the same steps in this one process (no agents to start)
    )

    assert main(_trainer_args(one, STEPS)[2:]) == 0  # without "-m trainer.train"
    print(f"\nwall time (rendezvous): two-node job {seconds:.1f} s ({_rendezvous_seconds(outputs)}); logs under {root}")
    return {"outputs": outputs, "two": two, "one": one}


def test_two_agents_form_one_two_node_job_and_commit_steps_from_two_ranks(jobs):
    ranks = sorted(_rendezvous(output) for output in jobs["outputs"])
    assert ranks == [(0, 2, "127.0.0.1"), (1, 2, "127.0.0.1")]  # two nodes of one job, one process each
    assert sum("on 2 x cpu, dp=2" in output for output in jobs["outputs"]) == 1  # rank 0 logs, on one node
    assert CheckpointRoot(jobs["two"] / "checkpoints").steps() == [2, 4, 6]
    for step in (2, 4, 6):
        manifest = ckpt.read_manifest(jobs["two"] / "checkpoints" / step_name(step))
        assert manifest.step == step and manifest.world_size == 2


def test_losses_are_those_of_a_one_node_run(jobs):
    two, one = _metrics(jobs["two"]), _metrics(jobs["one"])
    assert sorted(two) == sorted(one) == [2, 4, 6]
    for step in (2, 4, 6):
        assert two[step]["loss"] == pytest.approx(one[step]["loss"], abs=1e-5), step
        assert two[step]["lr"] == pytest.approx(one[step]["lr"], rel=1e-12), step
    assert one[6]["loss"] < one[2]["loss"]  # it trains
