"""ckpt.convert.dcp.items: the items of DCP's data files are loaded with ``torch.load(weights_only=True)``
only — a value that needs ``weights_only=False`` is refused, naming it, and nothing of it runs."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckpt
from ckpt.convert import import_dcp
from tests.support import dcp_sources
from tests.support.checkpoints import Booby


def test_value_needing_weights_only_false_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    source = tmp_path / "dcp"
    dcp.save({"w": torch.ones(4), "obj": Booby(marker)}, checkpoint_id=source, no_dist=True)
    stream = io.BytesIO()
    torch.save(Booby(marker), stream)
    torch.load(io.BytesIO(stream.getvalue()), weights_only=False)  # the payload is real
    assert marker.exists()
    marker.unlink()
    with pytest.raises(ckpt.UnsafeCheckpointError, match="'obj'") as info:
        import_dcp(source, tmp_path / "out")
    assert info.value.tensor == "obj" and "weights_only" in str(info.value)
    assert not marker.exists()
    dcp_sources.leaves_nothing(tmp_path / "out")
