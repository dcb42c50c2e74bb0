"""The trainer says it when the memory tier skips a save for want of room (one line, the first time;
the engine's own warning goes to ckpt's logger, which the trainer does not show) and counts the memory
tier's saves, skips and failures in its metrics; storage checkpoints go on as configured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckpt.memory.store import NodeStore
from tests.support.trainer_runs import run_trainer, trainer_args


def test_a_memory_save_without_room_is_said_once_and_counted(tmp_path, monkeypatch, capsys):
    (tmp_path / "shm").mkdir()
    monkeypatch.setattr(NodeStore, "free_bytes", lambda self: 1 << 20)  # Docker's /dev/shm is 64 MB
    job = tmp_path / "job"
    run_trainer(trainer_args(str(job), steps=10, checkpoint__enable="true", checkpoint__interval=5,
                             checkpoint__memory=str(tmp_path / "shm" / "node0"),
                             checkpoint__async_mode="sync"))  # every step reaches the tier: none skipped as busy
    said = [line for line in capsys.readouterr().out.splitlines() if "memory tier: a save skipped" in line]
    assert len(said) == 1, said
    records = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "loss" in r][-1]
    assert (last["ckpt_memory_saves"], last["ckpt_memory_skipped"], last["ckpt_memory_failed"]) == (0, 10, 0)
    memory = [r for r in records if r.get("event") == "memory_outcomes"]  # trainer.checkpoint_events
    assert memory and sum(r["skipped"] for r in memory) == last["ckpt_memory_skipped"]
    assert not any(r["saved"] or r["failed"] for r in memory)
    assert sorted(p.name for p in Path(job, "checkpoints").glob("step-*")) == ["step-00000005", "step-00000010"]


def test_a_memory_folder_that_cannot_be_made_is_refused_under_checkpoint_memory(tmp_path):
    """Its parent missing: refused (exit 2) naming checkpoint.memory, not checkpoint.folder (was)."""
    from trainer.exits import Refused

    memory = tmp_path / "no-such-mount" / "node0"
    with pytest.raises(Refused) as refused:
        run_trainer(trainer_args(str(tmp_path / "job"), steps=1, checkpoint__enable="true",
                                 checkpoint__memory=str(memory)))
    assert str(refused.value).startswith(f"checkpoint.memory={str(memory)!r}: cannot create {memory}: "), refused.value
