"""trainer.plot: a real run's metrics.jsonl, resumed once, drawn as one PNG with a segment per run."""

from __future__ import annotations

import json

import pytest

from tests.support.trainer_runs import run_trainer, trainer_args


@pytest.mark.slow
def test_a_resumed_runs_metrics_plot_as_two_segments(tmp_path, capsys):
    from trainer.plot import main, read_segments

    run_trainer(trainer_args(str(tmp_path), steps=20))
    run_trainer(trainer_args(str(tmp_path), steps=20, checkpoint__load_step=10))  # goes back to step 10
    metrics = tmp_path / "metrics.jsonl"
    with open(metrics, "a") as extra:  # a record of another kind, and a blank line: skipped
        extra.write(json.dumps({"event": "something else"}) + "\n\n")
    capsys.readouterr()
    segments = read_segments(metrics)
    assert [[r["step"] for r in s] for s in segments] == [[5, 10, 15, 20], [15, 20]]
    assert main([str(metrics)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'metrics.png'} (6 steps in 2 segment(s))"
    assert (tmp_path / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main([str(metrics), "-o", str(tmp_path / "last.png"), "--last-run"]) == 0
    assert "2 steps in 1 segment(s)" in capsys.readouterr().out


def test_a_file_without_steps_is_one_line_and_exit_1(tmp_path, capsys):
    from trainer.plot import main

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    assert main([str(tmp_path / "metrics.jsonl")]) == 1
    assert capsys.readouterr().err == f"trainer.plot: error: {tmp_path / 'metrics.jsonl'} holds no logged step\n"
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    assert main([str(tmp_path / "bad.jsonl")]) == 1
    assert capsys.readouterr().err.startswith(f"trainer.plot: error: {tmp_path / 'bad.jsonl'}:1: not a JSON line")
