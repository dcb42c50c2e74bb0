"""trainer.run_record: each start of the trainer opens metrics.jsonl's next part with a run_start
record, and a config.json of an earlier run with another config is kept, not overwritten."""

from __future__ import annotations

import json

import pytest

from tests.support.trainer_runs import run_trainer, trainer_args


@pytest.mark.slow
def test_two_runs_in_one_folder_are_told_apart(tmp_path, capsys):
    run_trainer(trainer_args(str(tmp_path), steps=10))
    first_config = (tmp_path / "config.json").read_text()
    run_trainer(trainer_args(str(tmp_path), steps=20))  # resumes from 10 with another training.steps
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    starts = [r for r in records if r.get("event") == "run_start"]
    assert [r["resumed_step"] for r in starts] == [None, 10] and starts[0]["run_id"] != starts[1]["run_id"]
    assert starts[0]["config_digest"] != starts[1]["config_digest"]
    assert [r.get("event") or r["step"] for r in records if not r.get("event", "").startswith("checkpoint_")] == [
        "run_start", 5, 10, "run_end", "run_start", 15, 20, "run_end"]
    assert [r["resumed_from"] for r in starts] == [None, "storage"]
    kept = list(tmp_path.glob("config-*.json"))
    assert len(kept) == 1 and kept[0].read_text() == first_config
    assert json.loads((tmp_path / "config.json").read_text())["training"]["steps"] == 20
    assert f"config.json of an earlier run differs (training.steps); kept as {kept[0].name}" in capsys.readouterr().out


def test_the_same_config_again_keeps_one_file(tmp_path):
    from trainer.run_record import write_config

    lines = []
    write_config(tmp_path, {"a": {"b": 1}}, lines.append)
    write_config(tmp_path, {"a": {"b": 1}}, lines.append)
    assert lines == [] and [p.name for p in tmp_path.iterdir()] == ["config.json"]
    write_config(tmp_path, {"a": {"b": 2}, "c": {}}, lines.append)
    assert lines[0].startswith("config.json of an earlier run differs (a.b, c); kept as config-")
