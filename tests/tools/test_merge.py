"""The ckpt-merge CLI (tools/merge.py): whole tensors from any layout, bitwise.

* An FSDP2 x TP checkpoint of 4 CPU ranks (uneven shards; the one of tests/ckpt/test_reshard.py) merges
  into .safetensors and torch.save files equal to the gathered state, bitwise; --dtype, --only, sharded
  output with its index.
* A delta step merges to the state it replays to.
* Errors: one stderr line and exit 1 (missing step, corrupt chunk naming file and tensor, a directory
  that is no checkpoint, an existing DST), exit 2 for bad usage; nothing partial left behind.

The library underneath (select, read, write; a merge's peak memory) is tested in tests/ckpt/convert/.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckpt
from tests.support import REPO, models
from tests.support.launch import run_ranks
from tests.support.parallel import save_parallel
from tools.merge import main


@pytest.fixture(scope="module")
def fsdp_tp(tmp_path_factory):
    """(checkpoint dir, expected flat {key: full tensor}) of a 4-rank FSDP2 x TP save (2x2 mesh)."""
    out = tmp_path_factory.mktemp("fsdp_tp")
    run_ranks(4, save_parallel, "fsdp_tp", str(out), None, None)
    expected = models.flat_tensors(torch.load(out / "expected.pt"))
    return out / "ckpt", expected


def _no_leftovers(directory: Path) -> None:
    assert not [p.name for p in directory.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


# -- bitwise equality --------------------------------------------------------------------------
@pytest.mark.slow
def test_merge_fsdp_tp_bitwise_safetensors_and_torch(fsdp_tp, tmp_path, capsys):
    import safetensors
    import safetensors.torch

    source, expected = fsdp_tp
    manifest = ckpt.read_manifest(source)
    assert manifest.world_size == 4 and any(len(e.chunks) > 1 for e in manifest.tensors.values())
    assert set(manifest.tensors) == set(expected)

    assert main([str(source), str(tmp_path / "all.safetensors"), "--quiet"]) == 0
    models.assert_same(safetensors.torch.load_file(tmp_path / "all.safetensors"), expected)
    with safetensors.safe_open(tmp_path / "all.safetensors", "pt") as f:
        metadata = f.metadata()
    assert metadata["format"] == "pt" and metadata["ckpt.kind"] == "full"
    assert metadata.get("ckpt.step") == (None if manifest.step is None else str(manifest.step))

    assert main([str(source), str(tmp_path / "all.pt")]) == 0
    out = capsys.readouterr().out
    assert "plain value" in out and "as torch" in out
    loaded = torch.load(tmp_path / "all.pt", weights_only=True)
    assert list(loaded) == sorted(expected)
    models.assert_same(loaded, expected)
    models.assert_same(torch.load(tmp_path / "all.pt", weights_only=True, mmap=True), expected)
    _no_leftovers(tmp_path)


@pytest.mark.slow
def test_merge_dtype_only_and_shards(fsdp_tp, tmp_path):
    import safetensors.torch

    source, expected = fsdp_tp
    model = {k: v for k, v in expected.items() if k.startswith("model.")}
    assert main([str(source), str(tmp_path / "m.safetensors"), "--only", "model", "--dtype", "bf16", "--quiet"]) == 0
    merged = safetensors.torch.load_file(tmp_path / "m.safetensors")
    models.assert_same(merged, {k: v.to(torch.bfloat16) for k, v in model.items()})

    # --dtype converts floats only: the optimizer's integer step counters (if stored as ints) and
    # any int/bool tensor keep their dtype; floats become bf16.
    assert main([str(source), str(tmp_path / "o.pt"), "--only", "optim", "--dtype", "fp16", "--quiet"]) == 0
    optim = torch.load(tmp_path / "o.pt", weights_only=True)
    assert set(optim) == {k for k in expected if k.startswith("optim.")}
    for key, tensor in optim.items():
        want = expected[key].to(torch.float16) if expected[key].is_floating_point() else expected[key]
        models.assert_same(tensor, want, key)

    # Sharded: every shard within the limit (the limit is smaller than the biggest tensor's share
    # of several, so there are many shards), every key in exactly one, total_size right.
    biggest = max(v.numel() * v.element_size() for v in expected.values())
    limit = biggest + 2000
    for fmt, index_name, load in (("safetensors", "model.safetensors.index.json", safetensors.torch.load_file),
                                  ("torch", "pytorch_model.bin.index.json",
                                   lambda p: torch.load(p, weights_only=True))):
        dst = tmp_path / f"hf-{fmt}"
        assert main([str(source), str(dst), "--max-shard-size", str(limit), "--format", fmt, "--quiet"]) == 0
        index = json.loads((dst / index_name).read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) > 2 and sorted(p.name for p in dst.iterdir()) == sorted([*shards, index_name])
        assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in expected.values())
        seen = {}
        for shard in shards:
            assert (dst / shard).stat().st_size <= limit, shard
            for key, tensor in load(dst / shard).items():
                assert key not in seen and index["weight_map"][key] == shard
                seen[key] = tensor
        models.assert_same(seen, expected)
    _no_leftovers(tmp_path)


def test_merge_delta_step(tmp_path):
    import safetensors.torch

    root = tmp_path / "root"
    torch.manual_seed(0)
    state = {"w": torch.randn(64, 32), "b": torch.randn(32), "n": torch.arange(7)}
    with ckpt.CheckpointManager(root, interval=1, full_every=3) as manager:
        manager.save(1, {"model": state})
        state["w"][::3] += 0.5
        state["b"].mul_(1.001)
        manager.save(2, {"model": state})
    assert ckpt.read_manifest(root / "step-00000002").kind == "delta"
    # SRC a root: the newest committed step by default
    assert main([str(root), str(tmp_path / "d.safetensors"), "--quiet"]) == 0
    expected = {f"model.{k}": v for k, v in state.items()}
    models.assert_same(safetensors.torch.load_file(tmp_path / "d.safetensors"), expected)
    assert main([str(root), str(tmp_path / "d.pt"), "--step", "2", "--quiet"]) == 0
    models.assert_same(torch.load(tmp_path / "d.pt", weights_only=True), expected)


def test_merge_json_report(tmp_path, capsys):
    import json

    ckpt.save({"model": {"w": torch.ones(8, 4)}, "step": 3}, tmp_path / "src")
    assert main([str(tmp_path / "src"), str(tmp_path / "w.safetensors"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tensors"] == 1 and report["bytes"] == 128 and report["format"] == "safetensors"
    assert report["written"] == [str(tmp_path / "w.safetensors")] and report["values_left_out"] == 1


# -- errors ------------------------------------------------------------------------------------
def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.merge", *map(str, args)], capture_output=True, text=True,
                          timeout=120, cwd=REPO)


@pytest.mark.slow
def test_merge_errors(fsdp_tp, tmp_path, capsys):
    source, _ = fsdp_tp
    root = tmp_path / "root"
    root.mkdir()
    shutil.copytree(source, root / "step-00000002")

    def one_line(code: int, *needles: str) -> str:
        err = capsys.readouterr().err
        assert code == 1 and err.count("\n") == 1 and err.startswith("ckpt-merge: error:"), err
        for needle in needles:
            assert needle in err, err
        return err

    one_line(main([str(root), str(tmp_path / "a.safetensors"), "--step", "7", "--quiet"]), "no committed step 7")
    one_line(main([str(tmp_path / "nothing"), str(tmp_path / "a.safetensors"), "--quiet"]), "no checkpoint")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("x")
    one_line(main([str(tmp_path / "plain"), str(tmp_path / "a.safetensors"), "--quiet"]), "neither a checkpoint")
    one_line(main([str(root), str(tmp_path / "a.safetensors"), "--only", "model.nope", "--quiet"]), "model.nope")

    # DST exists: refused without --force, replaced with it
    (tmp_path / "a.safetensors").write_bytes(b"old")
    one_line(main([str(root), str(tmp_path / "a.safetensors"), "--quiet"]), "--force")
    assert (tmp_path / "a.safetensors").read_bytes() == b"old"
    assert main([str(root), str(tmp_path / "a.safetensors"), "--force", "--quiet"]) == 0
    (tmp_path / "hf").mkdir()
    one_line(main([str(root), str(tmp_path / "hf"), "--max-shard-size", "1MB", "--quiet"]), "--force")

    # a corrupt chunk: one byte flipped in a data file -> the file and the tensor are named, nothing left
    step = root / "step-00000002"
    manifest = ckpt.read_manifest(step)
    key, entry = next((k, e) for k, e in sorted(manifest.tensors.items()) if k.startswith("model.") and e.chunks)
    blob = entry.chunks[-1].blob
    data = bytearray((step / blob.file).read_bytes())
    data[blob.offset + blob.length // 2] ^= 0xFF
    (step / blob.file).write_bytes(bytes(data))
    for dst, extra in (("bad.safetensors", []), ("bad.pt", []), ("bad-hf", ["--max-shard-size", "100kB"])):
        one_line(main([str(root), str(tmp_path / dst), "--quiet", *extra]), blob.file, key)
        assert not (tmp_path / dst).exists()
    _no_leftovers(tmp_path)

    # usage errors: exit 2
    for argv in ([str(root), str(tmp_path / "out")],  # no extension, no --format / --max-shard-size
                 [str(root), str(tmp_path / "x.safetensors"), "--format", "torch"],
                 [str(root), str(tmp_path / "x.pt"), "--max-shard-size", "1GB"],
                 [str(root), str(tmp_path / "x.pt"), "--max-shard-size", "lots"],
                 [str(root), str(tmp_path / "x.pt"), "--dtype", "int8"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2, argv
    capsys.readouterr()

    # as a process: one line on stderr, nothing on stdout, exit 1
    result = _run(root, tmp_path / "a.safetensors")
    assert result.returncode == 1 and result.stderr.count("\n") == 1 and "--force" in result.stderr
    assert result.stdout == ""
