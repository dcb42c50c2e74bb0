"""ckpt.convert.replay: a delta checkpoint materialised as a full one (by the ckpt-replay CLI, and in place)
equals the chain bitwise."""

from __future__ import annotations

import subprocess
import sys

import ckpt
from tests.support.checkpoints import step_path
from ckpt.convert import materialize
from tests.support import models
from tests.support.chains import load_mixed as _load
from tests.support.chains import train_with_chain as _train_with_chain


def test_replay_equals_the_chain(tmp_path):
    expected = _train_with_chain(tmp_path, steps=4, full_every=4)
    out = tmp_path / "replayed"
    result = subprocess.run([sys.executable, "-m", "tools.replay", str(tmp_path), "--step", "4", "--out", str(out),
                             "--quiet"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    manifest = ckpt.read_manifest(out)
    assert manifest.kind == "full" and manifest.base is None
    assert {c.blob.codec for e in manifest.tensors.values() for c in e.chunks} == {"raw"}
    models.assert_same(_load(out), expected[4])
    # In place: step 3 becomes a full; step 4 (a delta on 3) still loads.
    materialize(step_path(tmp_path, 3))
    assert ckpt.read_manifest(step_path(tmp_path, 3)).kind == "full"
    models.assert_same(_load(step_path(tmp_path, 3)), expected[3])
    models.assert_same(_load(step_path(tmp_path, 4)), expected[4])
