"""trainer.checkpoint_events: each checkpoint event of a run becomes one metrics.jsonl record, from the
manager's callback, its counters and its replication status (a stand-in manager here: every event
on cue, no process group); and a trainer run writes them, with its run_end record, in order."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import ckpt
from ckpt.format import step_name
from trainer.checkpoint_events import CheckpointEvents


class _Manager:
    """What CheckpointEvents reads of a CheckpointManager: options, stats, replication_status()."""

    def __init__(self, *, replicas=()):
        self.options = SimpleNamespace(replicas=tuple(replicas))
        self.stats = ckpt.SaveStats()
        self.status: dict[int, dict[str, str]] = {}

    def replication_status(self):
        return {step: dict(copies) for step, copies in self.status.items()}


def _events(manager):
    records = []
    events = CheckpointEvents(manager)
    events.send_to(records.append)
    return events, records


def test_what_happens_before_the_metrics_file_is_held_until_then():
    events = CheckpointEvents(_Manager())
    events.resumed(4, listed_before=[2, 4, 6, 8], memory_note="memory step 9 unusable: resuming from storage")
    records = []
    events.send_to(records.append)
    events.committed(ckpt.CommitInfo(6, "delta", 123, 0.51234, "s3://key:secret@bucket/run/step-00000006", 1))
    assert records == [
        {"event": "memory_fell_back", "step": 4, "note": "memory step 9 unusable: resuming from storage"},
        {"event": "checkpoint_fell_back", "step": 4, "set_aside": [6, 8]},
        {"event": "checkpoint_committed", "step": 6, "kind": "delta", "bytes": 123, "seconds": 0.512,
         "path": "s3://bucket/run/step-00000006", "replicas": 1}]


def test_a_skipped_and_a_failed_save_each_get_one_record():
    manager = _Manager()
    events, records = _events(manager)
    events.saved(2)
    manager.stats.skipped += 1
    events.saved(3)
    events.saved(4)
    manager.stats.failures += 1
    events.saved(5)
    manager.stats.failures += 1
    events.observe()  # the trainer's final wait, or close
    assert records == [{"event": "checkpoint_skipped", "step": 3},
                       {"event": "checkpoint_failed", "failed_saves": 1, "noticed_at_step": 5},
                       {"event": "checkpoint_failed", "failed_saves": 2, "noticed_at_step": 5}]


def test_memory_tier_outcomes_are_recorded_by_count_when_the_counters_are_read():
    manager = _Manager()
    events, records = _events(manager)
    events.saved(1)
    manager.stats.memory_saves += 1  # step 1's, written by the writer thread meanwhile
    events.saved(2)
    events.saved(3)
    manager.stats.memory_skipped += 2  # 2's and 3's ended between two reads
    manager.stats.memory_failures += 1
    events.saved(4)
    manager.stats.memory_saves += 1
    events.observe()  # the final wait
    assert records == [{"event": "memory_outcomes", "saved": 1, "skipped": 0, "failed": 0, "noticed_at_step": 2},
                       {"event": "memory_outcomes", "saved": 0, "skipped": 2, "failed": 1, "noticed_at_step": 4},
                       {"event": "memory_outcomes", "saved": 1, "skipped": 0, "failed": 0, "noticed_at_step": 4}]


def test_a_replica_copy_is_recorded_when_it_reaches_a_final_state():
    manager = _Manager(replicas=["/mnt/a", "s3://id:secret@bucket/b"])
    events, records = _events(manager)
    manager.status = {2: {"/mnt/a": "copying", "s3://id:secret@bucket/b": "pending"}}
    events.saved(2)
    manager.status = {2: {"/mnt/a": "committed", "s3://id:secret@bucket/b": "failed"}}
    events.saved(3)
    events.saved(4)  # nothing new
    manager.status = {2: {"/mnt/a": "committed", "s3://id:secret@bucket/b": "committed"},
                      4: {"/mnt/a": "dropped", "s3://id:secret@bucket/b": "copying"}}
    events.observe()
    assert records == [
        {"event": "checkpoint_replicated", "step": 2, "replica": "/mnt/a", "state": "committed"},
        {"event": "checkpoint_replicated", "step": 2, "replica": "s3://bucket/b", "state": "failed"},
        {"event": "checkpoint_replicated", "step": 2, "replica": "s3://bucket/b", "state": "committed"},
        {"event": "checkpoint_replicated", "step": 4, "replica": "/mnt/a", "state": "dropped"}]


def _records(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_a_run_with_a_replica_records_its_commits_copies_and_end_and_a_resume_its_fall_back(tmp_path):
    from tests.support.trainer_runs import trainer_args
    from trainer.train import main

    args = dict(checkpoint__enable="true", checkpoint__interval=2, checkpoint__keep=2,
                checkpoint__replicas=tmp_path / "replica", metrics__log_freq=2)
    assert main(trainer_args(str(tmp_path / "run"), steps=4, **args)) == 0
    records = _records(tmp_path / "run")
    kinds = [r.get("event") or r["step"] for r in records]
    assert kinds[0] == "run_start" and kinds[-1] == "run_end" and [k for k in kinds if isinstance(k, int)] == [2, 4]
    committed = [r for r in records if r.get("event") == "checkpoint_committed"]
    assert [(r["step"], r["kind"], r["replicas"]) for r in committed] == [(2, "full", 1), (4, "full", 1)]
    assert all(r["bytes"] > 0 and r["path"].endswith(step_name(r["step"])) for r in committed)
    copies = [(r["step"], r["state"]) for r in records if r.get("event") == "checkpoint_replicated"]
    assert copies == [(2, "committed"), (4, "committed")]  # close waits for them
    end = records[-1]
    assert (end["status"], end["steps"], end["last_step"], end["checkpoints_written"], end["checkpoints_kept"],
            end["newest_step"]) == ("finished", 4, 4, 2, 2, 4)
    assert end["final_loss"] == [r for r in records if "loss" in r][-1]["loss"]

    step_4 = tmp_path / "run" / "checkpoints" / step_name(4)
    for root in (step_4, tmp_path / "replica" / step_name(4)):  # damaged on every mount
        data = max((p for p in root.rglob("*") if p.is_file() and p.name != "manifest.json"),
                   key=lambda p: p.stat().st_size)
        data.write_bytes(b"\0" * data.stat().st_size)
    with pytest.warns(UserWarning, match="checkpoint step 4 cannot be loaded"):
        assert main(trainer_args(str(tmp_path / "run"), steps=4, **args)) == 0
    second = _records(tmp_path / "run")[len(records):]
    assert second[0]["event"] == "run_start" and (second[0]["resumed_step"], second[0]["resumed_from"]) == (2, "storage")
    assert {"event": "checkpoint_fell_back", "step": 2, "set_aside": [4]} in [
        {k: v for k, v in r.items() if k != "time"} for r in second]
    assert second[-1]["status"] == "finished" and second[-1]["steps"] == 2
