"""Every ```bash block of README.md and docs/*.md runs as written in a fresh shell, so the docs cannot
drift; every page with commands says how to activate the environment, once, where they start.

The convention (stated in docs/TOOLS.md): a ```bash block holds commands a reader runs, in order,
from the repository root; a plain ``` block is a synopsis with placeholders (ROOT, SRC DST) or an
illustration over paths the reader has, and is not run. ``scripts/setup.sh`` ends by printing the
activation line (:data:`ACTIVATE`); a page with commands states it once, before its first command.

How they run: each page in one shell, as a reader's terminal (its blocks in order; a backslash
continues a line; comments are dropped; ``set -e``), in a scratch directory set up like a checkout
(the repository's entries linked, ``.venv`` linked to this interpreter's environment, outputs written
in the scratch directory). The shell has only what the docs say: a new terminal's environment (PATH
without this environment's ``bin``, no VIRTUAL_ENV, no PYTHONPATH), then :data:`ACTIVATE` when the
page states it, nothing else. The one addition is ``OMP_NUM_THREADS=1``, the suite's one-thread rule
(tests/conftest.py: the box is shared), which changes no command's outcome. Three lists decide what
differs from "as written", each keyed by the exact command, so a command changed in the docs without
its entry fails loudly here ("no entry" / "stale entry"):

* SETUP: ``bash scripts/setup.sh && CMD`` runs CMD alone (the set-up installs packages from the
  package index; the tests already run in the environment it made).
* SMALL: long training commands mapped to a small variant of the same command (fewer steps, shorter
  sequences, an interval that keeps the documented sequence of resumes and branches meaningful; a
  free port for ``{port}``, a scratch folder for an absolute one; fewer ranks for LAUNCHING.md's one
  node of 8, whose configuration a test plans at the 8 ranks it documents).
* SKIPPED: commands not run, each with why (a cluster, an accelerator, the network, hours).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO
from tests.support.launch import free_port

ACTIVATE = "source .venv/bin/activate"
PAGES = ("README.md", *sorted(f"docs/{page.name}" for page in (REPO / "docs").glob("*.md")))
SETUP = "bash scripts/setup.sh && "
ENV_BIN = ".venv/bin/"  # a command the docs write as .venv/bin/python and as python (activated) is one entry
TRAIN = "python -m trainer.train --config configs/debug.toml"
TORCHRUN = "torchrun --standalone --nproc_per_node 2 -m trainer.train --config configs/debug.toml"
QUICK = "--checkpoint.interval 2 --training.seq_len 32"  # 2-step intervals keep keep=3's history meaningful
# the README's commands after its activation line: the same, found on PATH
ACTIVE_TRAIN = TRAIN.removeprefix(".venv/bin/")
ACTIVE_TORCHRUN = TORCHRUN.removeprefix(".venv/bin/")
TWO_NODES = ("torchrun --nnodes 2 --nproc_per_node 1 --rdzv_backend c10d --rdzv_endpoint 127.0.0.1:{port} "
             "--rdzv_id try-1 --local_addr 127.0.0.1 -m trainer.train --config configs/debug.toml --job.dump_folder "
             "{folder} --training.steps 4 --training.seq_len 64 --checkpoint.interval 2 --metrics.log_freq 2 &")

ONE_NODE = "torchrun --standalone --nproc_per_node 8 -m trainer.train --config configs/debug.toml"  # LAUNCHING.md

# README's main job and its resume trio (300 / 400 / 450 steps, checkpoints every 50, a branch from
# 400 that replaces 450) as 6 / 8 / 10 steps with checkpoints every 2 and a branch from 8.
SMALL = {
    TORCHRUN: f"{TORCHRUN} --training.steps 6 {QUICK}",
    f"{ACTIVE_TORCHRUN} --training.steps 400": f"{ACTIVE_TORCHRUN} --training.steps 8 {QUICK}",
    f"{ACTIVE_TRAIN} --training.steps 450": f"{ACTIVE_TRAIN} --training.steps 10 {QUICK}",
    f"{ACTIVE_TRAIN} --training.steps 450 --checkpoint.load_step 400 --checkpoint.branch true":
        f"{ACTIVE_TRAIN} --training.steps 10 {QUICK} --checkpoint.load_step 8 --checkpoint.branch true",
    # TOOLS.md's walk-through keeps its steps (10, 20: the later commands name them), fewer tokens
    f"{TRAIN} --job.dump_folder outputs/tools-demo --training.steps 20 --checkpoint.interval 10 "
    "--training.seq_len 64":
        f"{TRAIN} --job.dump_folder outputs/tools-demo --training.steps 20 --checkpoint.interval 10 "
        "--training.seq_len 16 --training.batch_size 2",
    # LAUNCHING.md's two agents on one machine: a free port and a scratch folder (tests run side by side);
    # the reader's bare `wait` returns 0 whatever the agents did, so each agent's code is waited for
    TWO_NODES.format(port=29400, folder="/tmp/two-nodes"): TWO_NODES.format(port="{port}", folder="two-nodes"),
    "done; wait": "done; for agent in $(jobs -p); do wait $agent; done",
    # LAUNCHING.md's one node of 8 as one node of 2, 2 steps: a rank's start-up is its cost (~3.5 s of CPU:
    # torch and the trainer's imports), so 8 CPU ranks cost ~33 s of CPU and 2 ~11 s; what 8 adds, its
    # config at that world size (the batch, the degrees), test_the_one_node_command_plans_its_world checks
    ONE_NODE: ONE_NODE.replace("--nproc_per_node 8", "--nproc_per_node 2") +
        " --training.steps 2 --training.seq_len 16 --checkpoint.interval 2",
}
CLUSTER = "a cluster (several nodes, a shared folder or a scheduler)"
SKIPPED = {
    "python -m pytest -q -n auto": "the whole suite, which this test is part of",
    **{f'pip install -e {extra}': "installs from the package index (the network)"
       for extra in (".", '".[s3]"', '".[tensorboard]"', '".[plot]"', '".[torchtitan]"', '".[lightning]"',
                     '".[dev]"', '".[bench]"')},
    # docs/ADOPTING.md
    "torchrun --nproc_per_node 8 -m torchtitan.train --module llama3 --config llama3_8b --checkpoint.enable "
    "--checkpoint.async_mode async_with_pinned_mem --override.imports ckpt.integrations.torchtitan.ckpt_engine":
        "torchtitan's llama3 8B on 8 GPUs (an accelerator)",
    "--override.imports 'ckpt.integrations.torchtitan.ckpt_engine={\"full_every\": 4, \"keep_every\": 1000, "
    "\"replicas\": [\"s3://bucket/run\"]}'": "not a command: the option of the command above, with arguments",
    # docs/LAUNCHING.md
    "torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint node0.example.com:29400 "
    "--rdzv_id llama-run-17 -m trainer.train --config configs/debug.toml --job.dump_folder /shared/runs/llama-run-17":
        CLUSTER,
    'export RDZV_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)': CLUSTER,
    "export OMP_NUM_THREADS=8": "the SLURM script's (a cluster)",
    'srun --kill-on-bad-exit=1 torchrun --nnodes "$SLURM_NNODES" --nproc_per_node 8 --rdzv_backend c10d '
    '--rdzv_endpoint "$RDZV_HOST:29400" --rdzv_id "$SLURM_JOB_ID" -m trainer.train --config configs/debug.toml '
    "--job.dump_folder /shared/runs/$SLURM_JOB_ID": CLUSTER,
    "source /usr/local/Ascend/ascend-toolkit/set_env.sh": "Ascend's toolkit (an accelerator)",
    "export HCCL_CONNECT_TIMEOUT=1200": "the Ascend cluster's (a cluster)",
    "torchrun --nnodes 8 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint node0.example.com:29400 "
    "--rdzv_id llama70b-001 -m trainer.train --config configs/seed_70b.yaml --training.device npu ...": CLUSTER,
    'torchrun --nnodes 8 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint "$RDZV_HOST:29400" '
    '--rdzv_id "$JOB_ID" -m trainer.train --config configs/seed_70b.yaml --training.device npu '
    "--training.micro_batch_size 8 --job.dump_folder /shared/runs/llama70b --checkpoint.enable true "
    "--checkpoint.folder s3://ckpt-bucket/llama70b --checkpoint.interval 500": CLUSTER,
    "torchrun --nproc_per_node 8 -m trainer.train --config configs/debug.toml --model.flavor moe_small "
    "--parallelism.ep 4 --training.device cuda": "8 CUDA GPUs (an accelerator)",
    # docs/RELIABILITY.md
    "python scripts/crash_harness.py --trials 200 --seed 1 --aim mixed --workdir /tmp/chw/c200 "
    "--out /tmp/chw/c200.json": "the 26-minute campaign (tests/reliability/test_crash.py runs the harness)",
}
# A line that runs a program (a page with one has commands); one that needs the environment active.
COMMAND_LINE = re.compile(r"^[ \t]*(\.venv/bin/)?(python|torchrun|pip|srun|bash|ckpt(-[a-z]+)?)(?=[ \t]+[-\w./\"'$])", re.M)
NEEDS_ENV = re.compile(r"^[ \t]*(python|torchrun|srun|ckpt(-[a-z]+)?)(?=[ \t]+[-\w./\"'$])", re.M)


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


def entry(command: str) -> str:
    """``command``'s key in SMALL and SKIPPED: without the set-up before it and ``.venv/bin/``."""
    return command.removeprefix(SETUP).removeprefix(ENV_BIN)


def plan(page: str) -> list[tuple[str, str | None]]:
    """``(command as documented, command to run or None when skipped)`` for each command of ``page``
    (a small variant keeps the documented ``.venv/bin/``)."""
    steps = []
    for command in commands((REPO / page).read_text()):
        key = entry(command)
        bin_dir = ENV_BIN if command.removeprefix(SETUP).startswith(ENV_BIN) else ""
        steps.append((command, None if key in SKIPPED else bin_dir + SMALL.get(key, key)))
    return steps


def script(page: str) -> tuple[str, int]:
    """The shell script of ``page`` (its activation line first when the page states it in words, else
    where its blocks have it; then its commands as :func:`plan` maps them) and how many documented
    commands it runs besides the activation line."""
    text = (REPO / page).read_text()
    lines = ["set -e", "trap 'echo \"docs: this command failed: $BASH_COMMAND\" >&2' ERR"]
    if ACTIVATE in text and ACTIVATE not in commands(text):
        lines.append(ACTIVATE)
    runs = [command for _, command in plan(page) if command is not None]
    lines += [command.replace("{port}", str(free_port())) for command in runs]
    return "\n".join(lines) + "\n", sum(command != ACTIVATE for command in runs)


def fresh_shell_env() -> dict[str, str]:
    """A new terminal's environment: the user's own variables, PATH without this environment's bin."""
    ours = Path(sys.prefix, "bin").resolve()
    path = [entry for entry in os.environ.get("PATH", os.defpath).split(os.pathsep)
            if entry and Path(entry).resolve() != ours]
    kept = {key: os.environ[key] for key in ("HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "TERM", "TMPDIR")
            if key in os.environ}
    return {**kept, "PATH": os.pathsep.join(path), "OMP_NUM_THREADS": "1"}


def test_the_lists_name_only_documented_commands():
    """A SMALL or SKIPPED entry no doc has any more is stale: the doc changed, so must the entry."""
    documented = {entry(c) for page in PAGES for c in commands((REPO / page).read_text())}
    stale = sorted((set(SMALL) | set(SKIPPED)) - documented)
    assert not stale, f"entries for commands no doc has: {stale}"
    trains = [c for c in documented if "trainer.train" in c and "--dry-run" not in c
              and c not in SMALL and c not in SKIPPED]
    assert not trains, f"a documented training command with no small variant in SMALL: {trains}"


def test_the_one_node_command_plans_its_world(monkeypatch):
    """LAUNCHING.md's one-node command runs on 2 ranks (SMALL); here its configuration is planned, in
    this process, at the world size it documents (``--nproc_per_node``): the trainer's own rules for
    the layout (ParallelismError) and the batch (a problem the trainer would refuse with exit 2)."""
    from trainer.plan import plan
    from trainer.config import load_config

    launcher, _, arguments = ONE_NODE.partition(" -m trainer.train ")
    world = int(re.search(r"--nproc_per_node (\d+)", launcher).group(1))
    monkeypatch.chdir(REPO)
    planned = plan(load_config(arguments.split()), world)
    assert planned.problems == [], planned.problems


def test_the_set_up_ends_by_printing_the_activation_line():
    lines = [line.strip() for line in (REPO / "scripts" / "setup.sh").read_text().splitlines()]
    last = [line for line in lines if line and not line.startswith("#")][-1]
    assert last == f'echo "{ACTIVATE}"', last


@pytest.mark.parametrize("page", [page for page in PAGES if COMMAND_LINE.search((REPO / page).read_text())])
def test_every_page_with_commands_states_the_activation_line_once_before_they_need_it(page):
    """Once, before the first command that needs the environment (``.venv/bin/...`` and the set-up
    itself run in any shell)."""
    text = (REPO / page).read_text()
    assert text.count(ACTIVATE) == 1, f"{page} states `{ACTIVATE}` {text.count(ACTIVATE)} times"
    first = NEEDS_ENV.search(text)
    assert first is None or text.index(ACTIVATE) < first.start(), f"{page}: `{ACTIVATE}` after `{first.group(0)}`"


def scratch_checkout(tmp_path: Path) -> Path:
    """A folder that looks like the repository's root (its entries linked, ``.venv`` this environment),
    where the docs' commands write their outputs."""
    scratch = tmp_path / "checkout"
    scratch.mkdir()
    for item in REPO.iterdir():
        if item.name not in (".git", ".venv", "outputs"):
            (scratch / item.name).symlink_to(item)
    (scratch / ".venv").symlink_to(Path(sys.prefix))
    return scratch


def test_the_fresh_shell_has_the_tools_only_once_activated(tmp_path):
    """The control: without the activation line the documented commands are not found (the docs test
    once passed only because it put the environment first on PATH itself)."""
    scratch = scratch_checkout(tmp_path)
    find = "command -v ckpt-inspect torchrun"
    bare = subprocess.run(["bash", "-c", find], cwd=scratch, env=fresh_shell_env(), capture_output=True, text=True)
    activated = subprocess.run(["bash", "-c", f"{ACTIVATE} && {find}"], cwd=scratch, env=fresh_shell_env(),
                               capture_output=True, text=True)
    assert bare.returncode != 0 and not bare.stdout, bare.stdout
    assert activated.returncode == 0 and len(activated.stdout.split()) == 2, activated


@pytest.mark.slow
@pytest.mark.parametrize("page", [page for page in PAGES if commands((REPO / page).read_text())])
def test_every_bash_block_runs_as_written_in_a_fresh_shell(page, tmp_path):
    scratch = scratch_checkout(tmp_path)
    text, runs = script(page)
    if not runs:
        pytest.skip(f"{page}: every command is skipped (SKIPPED says why)")
    result = subprocess.run(["bash", "-c", text], cwd=scratch, env=fresh_shell_env(), stdin=subprocess.DEVNULL,
                            capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, (f"{page} exited {result.returncode} running\n{text}\n"
                                    f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
