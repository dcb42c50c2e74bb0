"""ckpt.dcp: our Writer/Reader behind unchanged dcp.save/dcp.load calls, and replicated tensors
written once (DCP deduplicates them across ranks)."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp

import ckpt
from tests import models
from tests.dist import run_ranks


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


def test_replicated_tensors_written_once(tmp_path):
    results = run_ranks(2, _save_replicated, str(tmp_path / "dp"))
    written, state_bytes = results[0]
    assert state_bytes <= written < 1.05 * state_bytes  # ~1x the state, not 2x
