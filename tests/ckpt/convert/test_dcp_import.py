"""ckpt.convert.dcp.importer: a plain DCP (FileSystemWriter) checkpoint becomes one of ours — bitwise,
reshardable — and ckpt.load on a raw DCP directory says how to convert it.

The source is a real ``dcp.save`` of an FSDP2 model and its AdamW state on 2 ranks (state dicts from
``get_state_dict``, as torchtitan does). Hostile inputs: a data file path leaving the directory, an
unknown stream transform, a truncated data file (a hostile ``.metadata``: test_dcp_metadata.py; a
value that needs ``weights_only=False``: test_dcp_items.py).
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

import ckpt
from ckpt.read.committed import looks_like_dcp
from ckpt.convert import import_dcp, read_dcp_metadata, total_tensor_bytes
from ckpt.storage import locate
from tests.support import dcp_sources, models
from tests.support.launch import run_ranks

EXTRA = {"a": [1, 2]}


def _save_dcp_import_and_resume(rank: int, world: int, root: str):
    """Train a step under FSDP2, save with plain DCP; rank 0 imports; both ranks resume from the import
    into a fresh FSDP2 model and optimizer and must hold the saved state bitwise."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = models.parallelize(models.build(), "fsdp")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    models.train_step(model, optim)
    expected = models.full_state(model, optim)
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd, "step": 7, "extra": {"a": [1, 2]}},
             checkpoint_id=f"{root}/dcp")
    if rank == 0:
        import_dcp(f"{root}/dcp", f"{root}/run/step-00000007")
    dist.barrier()

    model = models.parallelize(models.build(seed=5), "fsdp")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"model": model, "optim": optim, "step": 0, "extra": {"a": None}}
    ckpt.load(state, f"{root}/run/step-00000007")
    models.assert_same(models.full_state(model, optim), expected)
    return (expected if rank == 0 else None), state["step"], state["extra"]


@pytest.fixture(scope="module")
def fsdp_dcp(tmp_path_factory) -> tuple[Path, dict]:
    """(root, expected full state): ``root/dcp`` written by DCP on 2 ranks, ``root/run/step-00000007``
    its import (both ranks already resumed from it and checked it bitwise)."""
    root = tmp_path_factory.mktemp("fsdp")
    results = run_ranks(2, _save_dcp_import_and_resume, str(root))
    assert [r[1:] for r in results] == [(7, EXTRA)] * 2
    return root, results[0][0]


# -- the import ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_fsdp2_adamw_dcp_checkpoint_imports_bitwise_and_reshards(fsdp_dcp):
    root, expected = fsdp_dcp
    source, imported = root / "dcp", root / "run" / "step-00000007"
    metadata = read_dcp_metadata(source)
    manifest = ckpt.read_manifest(imported)
    assert manifest.step == 7 and manifest.kind == "full" and manifest.world_size == 2
    assert sorted(manifest.files) == ["data/rank-00000.bin", "data/rank-00001.bin"]
    # DCP's chunk boxes are kept (FSDP2 shards of vocab 13: 7 + 6 rows), and its flatten mapping
    emb = manifest.tensors["model.emb.weight"]
    assert [(c.offsets, c.sizes) for c in emb.chunks] == [((0, 0), (7, 16)), ((7, 0), (6, 16))]
    assert manifest.paths == {k: tuple(v) for k, v in metadata.planner_data.items()}
    assert manifest.total_tensor_bytes() == total_tensor_bytes(metadata)
    assert manifest.values["extra.a"].value == [1, 2] and manifest.values["step"].value == 7

    # 2 ranks (FSDP2) resumed from it in the fixture; here one process, a plain model + AdamW
    model = models.build(seed=9)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"model": model, "optim": optim, "step": 0, "extra": {"a": None}}
    ckpt.load(state, imported, no_dist=True)
    models.assert_same(models.full_state(model, optim), expected)
    assert state["step"] == 7 and state["extra"] == EXTRA


@pytest.mark.slow
def test_load_of_a_raw_dcp_directory_names_the_conversion(fsdp_dcp, tmp_path):
    source = fsdp_dcp[0] / "dcp"
    assert looks_like_dcp(locate(source)) and not looks_like_dcp(locate(fsdp_dcp[0] / "run" / "step-00000007"))
    model = models.build()
    for call in (lambda: ckpt.load({"model": model}, source, no_dist=True), lambda: ckpt.read_manifest(source)):
        with pytest.raises(ckpt.CheckpointNotFoundError) as info:
            call()
        message = str(info.value)
        assert "torch.distributed.checkpoint (DCP)" in message
        assert f"ckpt-convert {source} <dst> --from dcp" in message
    (tmp_path / "empty").mkdir()
    with pytest.raises(ckpt.CheckpointNotFoundError, match="no manifest.json"):
        ckpt.read_manifest(tmp_path / "empty")


def test_values_zstd_transform_progress_and_overwrite(small_dcp, tmp_path, monkeypatch):
    from torch.distributed.checkpoint._extension import ZStandard

    real_load = torch.load

    def only_weights(*args, **kwargs):
        assert kwargs.get("weights_only") is True
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", only_weights)
    state = {"w": torch.randn(40, 30), "step": 3, "seen": {1, 2}}
    zstd = tmp_path / "zstd"
    dcp.save(state, storage_writer=FileSystemWriter(zstd, _extensions=[ZStandard()]), no_dist=True)
    assert read_dcp_metadata(zstd).storage_data  # its items carry ["stream.zstd/1"]
    seen = []
    manifest = import_dcp(zstd, tmp_path / "out", progress=seen.append)
    assert seen == [40 * 30 * 4] and manifest.step is None
    assert manifest.values["seen"].encoding == "torch_save"  # a set: no JSON for it
    live = {"w": torch.zeros(40, 30), "step": 0, "seen": None}
    ckpt.load(live, tmp_path / "out", no_dist=True)
    models.assert_same(live, state)

    with pytest.raises(ckpt.CheckpointExistsError):
        import_dcp(small_dcp, tmp_path / "out")
    import_dcp(small_dcp, tmp_path / "out", overwrite=True)
    live = {"w": torch.zeros(8, 8), "b": torch.zeros(5, dtype=torch.bfloat16), "step": 0, "seen": None}
    ckpt.load(live, tmp_path / "out", no_dist=True)
    assert live["step"] == 1 and live["seen"] == {1, 3} and torch.equal(live["w"], torch.arange(64.0).reshape(8, 8))
    assert sorted(ckpt.read_manifest(tmp_path / "out").files) == ["data/rank-00000-p1.bin", "data/rank-00000.bin"]
    with pytest.raises(ckpt.CheckpointExistsError):
        import_dcp(small_dcp, small_dcp, overwrite=True)
    assert looks_like_dcp(locate(small_dcp))


def _rewrite_metadata(source: Path, edit) -> None:
    metadata = read_dcp_metadata(source)
    edit(metadata)
    (source / ".metadata").write_bytes(pickle.dumps(metadata))


def test_data_paths_leaving_the_directory_are_refused(small_dcp, tmp_path):
    for bad in ("../outside.distcp", "/etc/hostname", ".metadata"):
        source = dcp_sources.copy(small_dcp, tmp_path / f"dcp{len(bad)}")
        shutil.copy(source / "__0_0.distcp", tmp_path / "outside.distcp")

        def aim(metadata, bad=bad):
            next(iter(metadata.storage_data.values())).relative_path = bad

        _rewrite_metadata(source, aim)
        with pytest.raises(ckpt.InvalidManifestError, match="not a plain file name inside the checkpoint") as info:
            import_dcp(source, tmp_path / "out")
        assert bad in str(info.value)
        dcp_sources.leaves_nothing(tmp_path / "out")


def test_unknown_stream_transform_is_unsupported(small_dcp, tmp_path):
    source = dcp_sources.copy(small_dcp, tmp_path / "dcp")

    def encrypt(metadata):
        next(iter(metadata.storage_data.values())).transform_descriptors = ["stream.aes/1"]

    _rewrite_metadata(source, encrypt)
    with pytest.raises(ckpt.UnsupportedFormatError, match="stream.aes/1"):
        import_dcp(source, tmp_path / "out")
    dcp_sources.leaves_nothing(tmp_path / "out")


# -- a damaged data file -----------------------------------------------------------------------

@pytest.mark.slow
def test_truncated_data_file_is_corrupt_and_named(fsdp_dcp, tmp_path):
    source = dcp_sources.copy(fsdp_dcp[0] / "dcp", tmp_path / "dcp")
    data = source / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"__1_0\.distcp is truncated") as info:
        import_dcp(source, tmp_path / "run" / "step-00000007")
    assert info.value.file == "__1_0.distcp"
    dcp_sources.leaves_nothing(tmp_path / "run" / "step-00000007")
