"""trainer/plan/cli.py, the dry run's command line: what cannot work exits 2 with one error line, --json
holds the plan, the text report, and the trainer's --dry-run."""

from __future__ import annotations

import json

import pytest

from tests.support import REPO as ROOT
from trainer.plan import main

DEBUG = str(ROOT / "configs" / "debug.toml")
SEED_70B = str(ROOT / "configs" / "seed_70b.yaml")


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("argv, words", [
    (["--config", SEED_70B, "--world-size", "32"], ["32", "64"]),
    (["--config", DEBUG, "--world-size", "3", "--parallelism.dp_shard=2"], ["world size is 3"]),
    (["--config", DEBUG, "--world-size", "3", "--parallelism.tp=3"], ["n_heads = 4", "tp = 3"]),
    (["--config", DEBUG, "--world-size", "8", "--parallelism.pp=8"], ["n_layers = 4", "8 pipeline stages"]),
    (["--config", DEBUG, "--world-size", "4", "--parallelism.dp_replicate=2", "--optimization.zero_stage=0"],
     ["DDP"]),
    (["--config", DEBUG, "--world-size", "two"], ["--world-size expects an integer"]),
    (["--config", DEBUG, "--device-memory", "TPUv9"], ["TPUv9"]),
    (["--config", DEBUG, "--training.nope=1"], ["training.nope"]),
])
def test_what_cannot_work_exits_2_with_one_line(capsys, argv, words):
    assert main(argv) == 2
    captured = capsys.readouterr()
    line = one_error_line(captured.err)
    assert all(w in line for w in words), line
    assert captured.out == ""


def test_json_parses_and_holds_the_plan(capsys):
    assert main(["--config", SEED_70B, "--json", "--storage-gbps", "4", "--storage-shared"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["layout"]["world_size"] == 64  # dp_size 4 x tp 4 x pp 4, no --world-size needed
    assert data["model"]["params"] == 68_976_648_192 and data["model"]["built_on"] == "meta"
    assert len(data["stages"]) == 4 and data["peak_bytes"] == max(s["peak"] for s in data["stages"])
    assert data["checkpoint"]["storage_shared"] is True and data["checkpoint"]["storage_gbps"] == 4.0
    assert data["checkpoint"]["seconds"] == pytest.approx(data["checkpoint"]["full_bytes"] / 4e9)
    assert set(data["memory_labels"]) == set(data["stages"][0]["memory"])


def test_text_report_for_debug(capsys):
    assert main(["--config", DEBUG, "--world-size", "2", "--device-memory", "64"]) == 0
    out = capsys.readouterr().out
    assert "853,632 parameters" in out and "every rank" in out and "Per rank (MiB)" in out
    assert "64.0 GiB (--device-memory): fits" in out


def test_the_trainer_cli_dry_run_plans_the_seed_70b_file(capsys):
    from trainer.train import main

    assert main(["--config", SEED_70B, "--dry-run", "--world-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "68,976,648,192 parameters" in out and "Verdict" in out and "Checkpoint" in out
