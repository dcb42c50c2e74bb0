"""tools.replay, the ckpt-replay CLI: exit code 1 and one error line for a missing step, 2 for bad usage.
(``python -m tools.replay`` as a process of its own: tests/ckpt/convert/test_replay.py.)"""

from __future__ import annotations

import pytest

from tests.support.checkpoints import reseal


def test_replay_cli_errors(tmp_path, capsys):
    from tools.replay import main

    assert main([str(tmp_path), "--step", "9"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no checkpoint" in err
    with pytest.raises(SystemExit) as usage:
        main([str(tmp_path)])
    assert usage.value.code == 2 and "--step" in capsys.readouterr().err


def _compressed_checkpoint(tmp_path):
    import torch

    import ckpt

    with ckpt.CheckpointManager(tmp_path / "root", compress="zstd") as manager:
        manager.save(1, {"w": torch.zeros(64, 64)})
    return tmp_path / "root" / "step-00000001"


def test_replay_bounds_allocations_by_the_bytes_present(tmp_path, capsys):
    """A consistent manifest claiming a 64 TiB tensor (its zstd planes are 64 KiB) is refused with
    one line; it used to end in a MemoryError traceback."""
    from tools.replay import main

    path = _compressed_checkpoint(tmp_path)

    def claim_64_tib(doc):
        entry = doc["tensors"]["w"]
        entry["shape"] = [2**22, 2**22]
        entry["chunks"][0].update(sizes=[2**22, 2**22], raw_length=2**46)

    reseal(path, claim_64_tib)
    assert main([str(tmp_path / "root"), "--step", "1", "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "byte plane" in err and "expected" in err
    assert not (tmp_path / "out").exists()


def test_replay_errors_speak_cli(tmp_path, capsys):
    """One line, no progress output before it, and the CLI's own words (--force, not overwrite=True)."""
    from tools.replay import main

    path = _compressed_checkpoint(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "manifest.json").write_text("{}")
    assert main([str(tmp_path / "root"), "--step", "1", "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--force" in err and "overwrite=True" not in err
    (path / "manifest.json").write_bytes(b"[" * 100_000)  # malformed: in the hierarchy, no traceback
    assert main([str(tmp_path / "root"), "--step", "1", "--out", str(tmp_path / "out2")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not valid JSON" in err


def test_replay_a_delta_chain_on_s3_in_place(s3_bucket, aws_env, capsys):
    """ckpt-replay takes a URL root (credentials from the environment) and writes the full checkpoint
    there with the object-store protocol; it loads bitwise."""
    import torch

    import ckpt
    from tools.replay import main

    root = f"{s3_bucket.url}/run"
    state = {"w": torch.arange(4096, dtype=torch.float32)}
    with ckpt.CheckpointManager(root, interval=1, full_every=3) as manager:
        for step in (1, 2):
            manager.before_step()
            state["w"][step] += 1
            manager.save(step, state)
    assert ckpt.read_manifest(f"{root}/step-00000002").kind == "delta"
    assert main([root, "--step", "2", "--quiet"]) == 0
    assert "written as a full checkpoint" in capsys.readouterr().out
    assert ckpt.read_manifest(f"{root}/step-00000002").kind == "full"
    live = {"w": torch.zeros(4096)}
    ckpt.load(live, f"{root}/step-00000002")
    assert torch.equal(live["w"], state["w"])


def _chain_root(tmp_path):
    import torch

    import ckpt

    root = tmp_path / "root"
    with ckpt.CheckpointManager(root, interval=1, full_every=4) as manager:  # with its .catalog
        for step in (1, 2, 3):
            manager.before_step()
            manager.save(step, {"w": torch.full((256,), float(step)), "step": step})
    return root


def test_replay_in_place_keeps_the_catalog_true(tmp_path, capsys):
    """issue 22, item 14: the catalog described the old delta after an in-place replay."""
    from ckpt.root import Catalog
    from tools.replay import main

    import ckpt

    root = _chain_root(tmp_path)
    run = ckpt.read_manifest(root / "step-00000002").run
    with Catalog(root / ".catalog", readonly=True) as catalog:
        assert catalog.step(2).kind == "delta" and catalog.step(2).base_step == 1
    assert main([str(root), "--step", "2", "--quiet"]) == 0
    assert run is not None and ckpt.read_manifest(root / "step-00000002").run == run  # still this run's step
    assert f"written as a full checkpoint to {root / 'step-00000002'}" in capsys.readouterr().out
    with Catalog(root / ".catalog", readonly=True) as catalog:
        info = catalog.step(2)
        assert (info.kind, info.base_step, info.mounts[str(root)].state) == ("full", None, "committed")
        assert catalog.step(3).kind == "delta"  # untouched


def test_replay_never_stores_a_step_under_another_steps_name(tmp_path, capsys):
    """issue 22, item 14: ``--out ROOT/step-00000001 --force`` stored step 3 under step 1's name."""
    import ckpt
    from ckpt.root import CheckpointRoot
    from tools.replay import main

    root = _chain_root(tmp_path)
    before = (root / "step-00000001" / "manifest.json").read_bytes()
    assert main([str(root), "--step", "3", "--out", str(root / "step-00000001"), "--force", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "step-00000001" in err and "step 3" in err
    assert (root / "step-00000001" / "manifest.json").read_bytes() == before
    assert ckpt.read_manifest(root / "step-00000001").step == 1 and CheckpointRoot(root).steps() == [1, 2, 3]
    # the step's own name, in another root, is fine
    assert main([str(root), "--step", "3", "--out", str(tmp_path / "copy" / "step-00000003"), "--quiet"]) == 0
    assert ckpt.read_manifest(tmp_path / "copy" / "step-00000003").kind == "full"


def test_replay_names_the_committed_steps_and_reports_json(tmp_path, capsys):
    """A step the root does not hold: one line listing the committed steps (the newest 20);
    --json: one object on stdout."""
    import json

    import torch

    import ckpt
    from tools.replay import main

    with ckpt.CheckpointManager(tmp_path / "root", interval=1, full_every=30, catalog="") as manager:
        for step in range(1, 26):
            manager.before_step()
            manager.save(step, {"w": torch.full((8,), float(step))})
    assert main([str(tmp_path / "root"), "--step", "99"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no checkpoint of step 99" in err
    assert "committed steps (the newest 20 of 25): 6, 7," in err and err.rstrip().endswith("24, 25")
    assert main([str(tmp_path / "root"), "--step", "3", "--out", str(tmp_path / "out"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["step"], report["kind_before"], report["kind"], report["in_place"]) == (3, "delta", "full", False)
    assert report["written"] == str(tmp_path / "out") and report["tensors"] == 1 and report["bytes"] == 32
    assert ckpt.read_manifest(tmp_path / "out").kind == "full"
