"""ckpt.dcp: our Writer/Reader behind unchanged dcp.save/dcp.load calls, and replicated tensors
written once (DCP deduplicates them across ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckpt
from tests.support import models
from tests.support.launch import run_ranks


def test_dcp_plugins_unchanged_dcp_calls(tmp_path):
    """Code that already calls DCP switches by passing our writer/reader (default planners)."""
    sd = {"w": torch.randn(33, 17), "step": 4, "cfg": {"a": [1, 2]}}
    dcp.save(sd, storage_writer=ckpt.dcp.Writer(tmp_path / "a"), no_dist=True)
    dcp.save(sd, checkpoint_id=tmp_path / "b", storage_writer=ckpt.dcp.Writer(), no_dist=True)
    for name in ("a", "b"):
        out = {"w": torch.zeros(33, 17), "step": 0, "cfg": {"a": None}}
        dcp.load(out, storage_reader=ckpt.dcp.Reader(tmp_path / name), no_dist=True)
        models.assert_same(out, sd)


def _save_replicated(rank: int, world: int, out: str):
    torch.manual_seed(0)  # identical on every rank: a pure data-parallel replica
    state = {"w": torch.randn(256, 256), "b": torch.randn(1000), "step": 5}
    ckpt.save(state, out)
    manifest = ckpt.read_manifest(out)
    return sum(manifest.files.values()), sum(t.numel() * t.element_size() for t in (state["w"], state["b"]))


@pytest.mark.slow
def test_replicated_tensors_written_once(tmp_path):
    results = run_ranks(2, _save_replicated, str(tmp_path / "dp"))
    written, state_bytes = results[0]
    assert state_bytes <= written < 1.05 * state_bytes  # ~1x the state, not 2x


def test_writer_refuses_an_inconsistent_configuration(tmp_path):
    """Caught at construction, before anything is written: a delta without a base could never be
    read, a delta on itself loops, a base outside the root is refused, bad options are named."""
    base = ckpt.DeltaBase(1, "step-00000001", {"w": torch.zeros(4)})
    with pytest.raises(ckpt.InvalidOptionError, match="exactly when base"):
        ckpt.dcp.Writer(tmp_path / "a", kind="delta")
    with pytest.raises(ValueError, match="exactly when base"):
        ckpt.dcp.Writer(tmp_path / "a", kind="full", base=base)
    with pytest.raises(ValueError, match="its own base"):
        ckpt.dcp.Writer(tmp_path / "step-00000001", step=2, base=base)
    with pytest.raises(ValueError, match="its own base"):
        ckpt.dcp.Writer(tmp_path / "step-00000002", step=1, base=base)
    with pytest.raises(TypeError):
        ckpt.dcp.Writer(tmp_path / "a", base={"w": torch.zeros(4)})
    for name in ("../elsewhere", "a/b", "", ".hidden"):
        with pytest.raises(ValueError, match="sibling directory"):
            ckpt.DeltaBase(1, name, {})
    with pytest.raises(ValueError, match="compress='lz4' is invalid"):
        ckpt.dcp.Writer(tmp_path / "a", compress="lz4")
    with pytest.raises(ValueError, match="files_per_rank"):
        ckpt.dcp.Writer(tmp_path / "a", files_per_rank=0)
    assert not any(tmp_path.iterdir())


def test_writer_delta_against_an_explicit_base_round_trips(tmp_path):
    """The DCP plug-in writes a delta when handed a DeltaBase, and it loads back bitwise."""
    first = {"w": torch.randn(256, 64), "step": 1}
    dcp.save(first, storage_writer=ckpt.dcp.Writer(tmp_path / "step-00000001", step=1), no_dist=True)
    second = {"w": first["w"] + torch.randn(256, 64) * 1e-3, "step": 2}
    base = ckpt.DeltaBase(1, "step-00000001", {"w": first["w"], "step": 1})
    dcp.save(second, storage_writer=ckpt.dcp.Writer(tmp_path / "step-00000002", step=2, base=base), no_dist=True)
    manifest = ckpt.read_manifest(tmp_path / "step-00000002")
    assert (manifest.kind, manifest.base, manifest.base_step) == ("delta", "step-00000001", 1)
    assert {c.blob.codec for c in manifest.tensors["w"].chunks} == {"delta"}
    out = {"w": torch.zeros(256, 64), "step": 0}
    ckpt.load(out, tmp_path / "step-00000002")
    assert torch.equal(out["w"].view(torch.int32), second["w"].view(torch.int32)) and out["step"] == 2
