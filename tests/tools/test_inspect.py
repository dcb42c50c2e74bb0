"""tools.inspection, the ckpt-inspect CLI: the steps x mounts table (and --json), --verify finding a
flipped byte by file and tensor, one checkpoint's summary, --rebuild-catalog, one error line and
exit 1 for bad input, exit 2 for bad usage, URLs through the AWS environment."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.root.catalog.store import Catalog, open_catalog
from ckpt.storage import locate
from tools.inspection import main
from tests.support import REPO


def _state(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"layer.weight": torch.randn(16, 16, generator=gen), "layer.bias": torch.randn(5, generator=gen),
            "step": seed}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("inspect") / "run"
    with ckpt.CheckpointManager(root, interval=1, full_every=3, catalog="") as manager:  # tests make their own
        for step in range(1, 5):
            manager.save(step, _state(step))
    return root


@pytest.fixture
def run(source, tmp_path) -> Path:
    shutil.copytree(source, tmp_path / "run")
    return tmp_path / "run"


def _out(capsys, argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_table_names_steps_and_mounts(run, tmp_path, capsys):
    replica = tmp_path / "replica"
    shutil.copytree(run, replica)
    shutil.rmtree(replica / "step-00000004")
    with open_catalog(Catalog.default_path(locate(run)), [locate(run), locate(replica)]) as catalog:
        catalog.set_state(replica, 4, "copying")
        catalog.set_state(replica, 7, "failed", detail="upload refused")  # a save that never committed
    code, out, err = _out(capsys, [run, "--mount", replica])
    assert code == 0 and err == ""
    assert f"mount 1 = {run} (primary)" in out and f"mount 2 = {replica}" in out  # ROOT, --mount
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line[:1].isdigit()}
    assert rows.keys() == {"1", "2", "3", "4", "7"}
    assert rows["2"][1:3] == ["delta", "1"] and rows["1"][1:3] == ["full", "-"]
    assert rows["4"][-2:] == ["committed", "copying"] and rows["3"][-2:] == ["committed", "committed"]
    assert rows["7"][-2:] == ["missing", "failed"]

    shutil.rmtree(run / "step-00000003")  # the mounts are the truth, not the catalog
    code, out, err = _out(capsys, [run, "--json"])
    assert json.loads(out)["mounts"] == [str(run)]  # never the catalog's mount list (issue 22, item 9)
    assert err == f"ckpt-inspect: note: the catalog also names {replica}; not read (a mount is listed only with --mount)\n"
    code, out, _ = _out(capsys, [run, "--json", "--mount", replica])
    doc = json.loads(out)
    assert code == 0 and doc["mounts"] == [str(run), str(replica)] and doc["catalog"] == str(run / ".catalog")
    assert doc["root"] == str(run)
    step3 = next(s for s in doc["steps"] if s["step"] == 3)
    assert step3["mounts"] == {str(run): "missing", str(replica): "committed"}
    assert set(step3) == {"step", "kind", "base_step", "bytes", "created", "mounts", "error"} and step3["bytes"] > 0


def test_table_without_a_catalog_and_extra_mounts(run, tmp_path, capsys):
    other = tmp_path / "other"
    ckpt.save(_state(9), other / "step-00000009")
    code, out, _ = _out(capsys, [run, "--mount", other, "--json"])
    doc = json.loads(out)
    assert code == 0 and doc["catalog"] is None and doc["mounts"] == [str(run), str(other)]
    assert [s["step"] for s in doc["steps"]] == [1, 2, 3, 4, 9]
    assert doc["steps"][-1]["mounts"] == {str(run): "missing", str(other): "committed"}


def test_verify_finds_a_flipped_byte(run, capsys):
    code, out, err = _out(capsys, [run, "--verify"])
    assert code == 0 and err == ""
    assert out.splitlines()[-1].startswith("verified 4 steps on 1 mounts,") and out.endswith(", 0 failures\n")

    manifest = ckpt.read_manifest(run / "step-00000002")
    blob = manifest.tensors["layer.weight"].chunks[0].blob
    data = run / "step-00000002" / blob.file
    raw = bytearray(data.read_bytes())
    raw[blob.offset + blob.length // 2] ^= 0x10
    data.write_bytes(raw)

    code, out, err = _out(capsys, [run, "--verify"])
    assert code == 1 and err.count("\n") == 1 and blob.file in err
    failed = [line for line in out.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1 and "step 2" in failed[0] and blob.file in failed[0] and "layer.weight" in failed[0]
    assert out.splitlines()[-1].endswith(", 1 failures")
    assert _out(capsys, [run, "--verify", "--step", "3"])[0] == 0  # a delta's own bytes are fine
    code, out, _ = _out(capsys, [run, "--verify", "--step", "2", "--json"])
    doc = json.loads(out)
    assert code == 1 and doc["ok"] is False and doc["steps"] == 1
    assert [(f["file"], f["tensor"], f["step"]) for f in doc["failures"]] == [(blob.file, "layer.weight", 2)]


def test_verify_reports_a_broken_chain(run, capsys):
    shutil.rmtree(run / "step-00000001")
    code, out, err = _out(capsys, [run, "--verify"])
    assert code == 1 and err.count("\n") == 1
    assert any("step 2" in line and "step-00000001" in line for line in out.splitlines() if line.startswith("FAILED"))


def test_summary_of_one_checkpoint(run, capsys):
    code, out, _ = _out(capsys, [run / "step-00000002"])
    assert code == 0
    assert "step 2  kind delta  base step-00000001 (step 1)  world size 1" in out and "format version 3" in out
    assert "layer.weight  float32  16x16" in out and "step   json" in out
    code, out, _ = _out(capsys, [run / "step-00000001", "--json"])
    doc = json.loads(out)
    assert code == 0 and (doc["step"], doc["kind"], doc["base"], doc["world_size"]) == (1, "full", None, 1)
    assert doc["tensors"]["layer.bias"] == {"dtype": "float32", "shape": [5], "chunks": 1, "stored_bytes": 20,
                                            "raw_bytes": 20, "codecs": ["raw"]}
    assert doc["values"] == {"step": {"encoding": "json", "preview": "1"}} and doc["totals"]["tensors"] == 2


def test_rebuild_catalog(run, tmp_path, capsys):
    path = tmp_path / "elsewhere"
    code, out, _ = _out(capsys, [run, "--rebuild-catalog", "--catalog", path])
    assert code == 0 and out.startswith(f"catalog {path} rebuilt from 1 mount(s)")
    assert [line.split()[0] for line in out.splitlines() if line[:1].isdigit()] == ["1", "2", "3", "4"]
    with Catalog(path, readonly=True) as catalog:
        assert [i.step for i in catalog.steps()] == [1, 2, 3, 4] and catalog.mounts() == [str(run)]
    (path / "data.mdb").write_bytes(b"garbage" * 100)
    assert _out(capsys, [run, "--catalog", path])[2].startswith("ckpt-inspect: note: catalog ignored")
    assert _out(capsys, [run, "--rebuild-catalog", "--catalog", path])[0] == 0


def test_bad_input_is_one_line_and_exit_1(run, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    for argv, words in (([tmp_path / "absent"], "no checkpoint root"),
                        ([tmp_path / "empty"], "not a checkpoint root"),
                        ([run / "step-00000009"], "no checkpoint at"),
                        ([run, "--verify", "--step", "9"], "no committed step 9")):
        code, out, err = _out(capsys, argv)
        assert code == 1 and out == "" and err.count("\n") == 1 and words in err, (argv, err)
    with pytest.raises(SystemExit) as exc:
        main([str(run), "--step", "2"])
    assert exc.value.code == 2


def test_urls_through_the_aws_environment(s3_bucket, aws_env, capsys):
    url = f"{s3_bucket.url}/run"
    ckpt.save(_state(1), f"{url}/step-00000001", storage_options=s3_bucket.storage_options)
    code, out, _ = _out(capsys, [url, "--verify", "--json"])
    assert code == 0 and json.loads(out)["bytes"] == (16 * 16 + 5) * 4
    code, out, _ = _out(capsys, [url])
    assert code == 0 and "full" in out and url in out
    with pytest.raises(SystemExit):  # a URL root has no default catalog place
        main([url, "--rebuild-catalog"])


@pytest.mark.slow
def test_help_in_a_subprocess():
    result = subprocess.run([sys.executable, "-m", "tools.inspection", "--help"], capture_output=True, text=True,
                            timeout=120, cwd=REPO)
    assert result.returncode == 0 and "examples:" in result.stdout and "--verify" in result.stdout


def test_verify_walks_every_link_of_a_chain(run, capsys):
    """Issue 22 item 12: step 3 is a delta on 2, a delta on 1; with step 1 deleted, step 3 cannot load
    either — --verify said "0 failures" for it (only its direct base was looked at)."""
    shutil.rmtree(run / "step-00000001")
    code, out, err = _out(capsys, [run, "--verify", "--step", "3"])
    assert code == 1 and err.count("\n") == 1
    failed = [line for line in out.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1 and "step 3" in failed[0] and "step-00000001" in failed[0]
    assert _out(capsys, [run, "--verify", "--step", "4"])[0] == 0  # a full checkpoint needs no link


def test_verify_compares_each_mounts_manifest_with_the_primarys(run, tmp_path, capsys):
    """Issue 22 item 12: a --mount holding another run's step of the same name verified clean."""
    other = tmp_path / "other"
    with ckpt.CheckpointManager(other, interval=1, catalog="") as manager:
        manager.save(4, _state(40))  # another run's step 4: its own bytes verify, but it is not run's step 4
    code, out, err = _out(capsys, [run, "--verify", "--mount", other])
    assert code == 1 and err.count("\n") == 1
    failed = [line for line in out.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1 and str(other) in failed[0] and "step 4" in failed[0]
    assert "differs from the primary's copy" in failed[0] and ckpt.read_manifest(other / "step-00000004").run in failed[0]
    shutil.rmtree(other)
    shutil.copytree(run, other)  # a true copy of every step verifies clean against the primary
    assert _out(capsys, [run, "--verify", "--mount", other])[0] == 0
