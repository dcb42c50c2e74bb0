"""Every ```bash block of README.md and docs/TOOLS.md runs as written, so the docs cannot drift.

The convention (stated in docs/TOOLS.md): a ```bash block holds commands a reader runs, in order,
from the repository root; a plain ``` block is a synopsis with placeholders (ROOT, SRC DST) or an
illustration over paths the reader has, and is not run.

How they run: each file's blocks in order, one shell per command (a backslash continues a line;
comments are dropped), in a scratch directory set up like a checkout (configs/ linked, .venv linked
to this interpreter's environment, the repository on PYTHONPATH, the environment's bin first on
PATH for the ``ckpt-*`` commands). Each must exit 0. Three lists decide what differs from "as
written", each keyed by the exact command, so a command changed in the docs without its entry
failing loudly here ("no entry" / "stale entry"):

* SETUP: ``bash scripts/setup.sh && CMD`` runs CMD alone (the set-up installs packages from the
  package index; the tests already run in the environment it made).
* SMALL: long training commands mapped to a small variant of the same command (fewer steps, shorter
  sequences, an interval that keeps the documented sequence of resumes and branches meaningful).
* SKIPPED: commands not run, each with why (the network; the suite this test is part of).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO
from tests.support.launch import job_env

DOCS = ("README.md", "docs/TOOLS.md")
SETUP = "bash scripts/setup.sh && "
TRAIN = ".venv/bin/python -m trainer.train --config configs/debug.toml"
TORCHRUN = ".venv/bin/torchrun --standalone --nproc_per_node 2 -m trainer.train --config configs/debug.toml"
QUICK = "--checkpoint.interval 2 --training.seq_len 32"  # 2-step intervals keep keep=3's history meaningful
# the README's commands after its activation line: the same, found on PATH
ACTIVE_TRAIN = TRAIN.removeprefix(".venv/bin/")
ACTIVE_TORCHRUN = TORCHRUN.removeprefix(".venv/bin/")
DRY_RUN_70B = "python -m trainer.train --config configs/seed_70b.yaml --dry-run --world-size 64 --training.seq_len 2048"

# README's main job and its resume trio (300 / 400 / 450 steps, checkpoints every 50, a branch from
# 400 that replaces 450) as 6 / 8 / 10 steps with checkpoints every 2 and a branch from 8.
SMALL = {
    TORCHRUN: f"{TORCHRUN} --training.steps 6 {QUICK}",
    f"{ACTIVE_TORCHRUN} --training.steps 400": f"{ACTIVE_TORCHRUN} --training.steps 8 {QUICK}",
    f"{ACTIVE_TRAIN} --training.steps 450": f"{ACTIVE_TRAIN} --training.steps 10 {QUICK}",
    f"{ACTIVE_TRAIN} --training.steps 450 --checkpoint.load_step 400 --checkpoint.branch true":
        f"{ACTIVE_TRAIN} --training.steps 10 {QUICK} --checkpoint.load_step 8 --checkpoint.branch true",
    DRY_RUN_70B: DRY_RUN_70B,  # a plan on the meta device: nothing trains, it runs as written
    # TOOLS.md's walk-through keeps its steps (10, 20: the later commands name them), fewer tokens
    f"{TRAIN} --job.dump_folder outputs/tools-demo --training.steps 20 --checkpoint.interval 10 "
    "--training.seq_len 64":
        f"{TRAIN} --job.dump_folder outputs/tools-demo --training.steps 20 --checkpoint.interval 10 "
        "--training.seq_len 16 --training.batch_size 2",
}
SKIPPED = {
    ".venv/bin/python -m pytest -q": "the whole suite, which this test is part of",
    **{f'pip install -e {extra}': "installs from the package index (the network)"
       for extra in (".", '".[s3]"', '".[tensorboard]"', '".[plot]"', '".[torchtitan]"', '".[lightning]"',
                     '".[dev]"', '".[bench]"')},
}


def commands(text: str) -> list[str]:
    """The commands of every ```bash block of ``text``, in order (continuations joined, comments
    and blank lines dropped)."""
    found = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                found.append(" ".join(line.split()))
    return found


def plan(doc: str) -> list[tuple[str, str | None]]:
    """``(command as documented, command to run or None when skipped)`` for each command of ``doc``."""
    steps = []
    for command in commands((REPO / doc).read_text()):
        documented = command
        if command.startswith(SETUP):
            command = command[len(SETUP):]
        if command in SKIPPED:
            steps.append((documented, None))
        else:
            steps.append((documented, SMALL.get(command, command)))
    return steps


def test_the_lists_name_only_documented_commands():
    """A SMALL or SKIPPED entry no doc has any more is stale: the doc changed, so must the entry."""
    documented = {c.removeprefix(SETUP) for doc in DOCS for c in commands((REPO / doc).read_text())}
    stale = sorted((set(SMALL) | set(SKIPPED)) - documented)
    assert not stale, f"entries for commands no doc has: {stale}"
    trains = [c for c in documented if "trainer.train" in c and c not in SMALL and c not in SKIPPED]
    assert not trains, f"a documented training command with no small variant in SMALL: {trains}"


@pytest.mark.slow
@pytest.mark.parametrize("doc", DOCS)
def test_every_bash_block_runs_as_written(doc, tmp_path):
    scratch = tmp_path / "checkout"
    scratch.mkdir()
    (scratch / "configs").symlink_to(REPO / "configs")
    (scratch / ".venv").symlink_to(Path(sys.prefix))
    env = job_env(PATH=os.pathsep.join([str(Path(sys.prefix) / "bin"), os.environ.get("PATH", "")]))
    ran = 0
    for documented, command in plan(doc):
        if command is None:
            continue
        result = subprocess.run(["bash", "-c", command], cwd=scratch, env=env, capture_output=True, text=True,
                                timeout=1200)
        assert result.returncode == 0, (f"{doc}: `{documented}` (run as `{command}`) exited {result.returncode}:\n"
                                        f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        ran += 1
    assert ran, f"{doc} has no command block that runs"
