"""ckpt.convert.dcp.metadata: DCP's ``.metadata`` pickle read without running code from it — a
``.metadata`` whose unpickling would run ``os.system``/``exec`` (directly, or through
``builtins.getattr``) or monkeypatch a class is refused, and nothing runs."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata

import ckpt
from ckpt.convert import import_dcp, read_dcp_metadata
from tests.support import dcp_sources


class _Reduce:
    """Pickles as ``func(*args)``."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _getattr_system(command: str) -> bytes:
    """``getattr(__import__("os"), "system")(command)`` spelled in pickle opcodes."""
    return (b"cbuiltins\ngetattr\n(cbuiltins\n__import__\n(Vos\ntRVsystem\ntR(V" + command.encode() + b"\ntR.")


def _metadata_wrapping(payload) -> bytes:
    """A real-looking Metadata whose planner_data is ``payload`` (unpickled mid-stream)."""
    return pickle.dumps(Metadata(state_dict_metadata={}, planner_data=payload, storage_data={}, version="1.0.0"))


@pytest.mark.parametrize("how", ["os.system", "builtins.exec", "builtins.getattr"])
def test_hostile_metadata_is_refused_and_runs_nothing(small_dcp, tmp_path, how):
    marker = tmp_path / "pwned"
    if how == "os.system":
        payload = _metadata_wrapping(_Reduce(os.system, f"touch {marker}"))
    elif how == "builtins.exec":
        payload = _metadata_wrapping(_Reduce(exec, f"open({str(marker)!r}, 'w').close()"))
    else:
        payload = _getattr_system(f"touch {marker}")
    pickle.loads(payload)  # the payload is real: plain unpickling runs it
    assert marker.exists()
    marker.unlink()

    source = dcp_sources.copy(small_dcp, tmp_path / "dcp")
    (source / ".metadata").write_bytes(payload)
    for call in (lambda: read_dcp_metadata(source), lambda: import_dcp(source, tmp_path / "out")):
        with pytest.raises(ckpt.UnsafeCheckpointError, match=f"refused global {how.replace('os.', '(os|posix).')}"):
            call()
    assert not marker.exists()
    dcp_sources.leaves_nothing(tmp_path / "out")


def test_metadata_gadgets_through_allowed_classes_are_refused(small_dcp, tmp_path):
    """Admitted classes cannot be turned against the process: no BUILD on a class (it would setattr
    on Metadata itself), no call of anything but the few admitted constructors."""
    module = b"torch.distributed.checkpoint.metadata"
    build_on_class = (b"\x80\x04\x8c" + bytes([len(module)]) + module + b"\x8c\x08Metadata\x93"
                      b"N}\x8c\x04evil\x88s\x86b.")
    new_size = pickle.dumps(_Reduce(torch.Size, [1, 2]))  # fine on its own ...
    call_dtype = b"\x80\x04\x8c\x05torch\x8c\x07float32\x93)R."  # ... but a dtype is not callable
    source = dcp_sources.copy(small_dcp, tmp_path / "dcp")
    for payload, message in ((build_on_class, "refused setting the state"), (call_dtype, "refused call")):
        (source / ".metadata").write_bytes(payload)
        with pytest.raises(ckpt.UnsafeCheckpointError, match=message):
            read_dcp_metadata(source)
    assert not hasattr(Metadata, "evil")
    (source / ".metadata").write_bytes(new_size)  # allowed, but not a Metadata
    with pytest.raises(ckpt.CorruptCheckpointError, match="not DCP's Metadata"):
        read_dcp_metadata(source)
