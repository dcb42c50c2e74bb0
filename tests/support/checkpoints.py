"""Small single-process checkpoints of plain tensors, shared by the tests that damage, refuse, overwrite
and clean up checkpoints: the state saved, a blank live state, the checks that a refused load
touched nothing, ``reseal`` (a manifest edited, then sealed again so that its digest holds), a
state of mixed dtypes for the exports (``mixed_dtype_state``), a value whose unpickling would
run code (``Booby``), one byte of a committed checkpoint flipped (``flip_byte``) and ``torch.load``
made to fail the test (``forbid_unpickling``: loading ours must never unpickle)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.format import seal, step_name

DATA_FILE = "data/rank-00000.bin"
WEIGHT, BIAS = "encoder.weight", "encoder.bias"


def make_state(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        WEIGHT: torch.randn(64, 64, generator=gen),
        BIAS: torch.randn(300, generator=gen),
        "step": 3 + seed,
    }


def blank_state() -> dict:
    """A live state of the right layout whose contents differ from any saved one."""
    return {WEIGHT: torch.full((64, 64), 7.0), BIAS: torch.full((300,), 7.0), "step": -1}


def assert_state_equal(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert actual[key].dtype == value.dtype and actual[key].shape == value.shape, key
            # bitwise: compare the raw bytes, not float values (NaN-safe, -0.0-safe)
            assert torch.equal(actual[key].view(torch.uint8), value.view(torch.uint8)), key
        else:
            assert actual[key] == value, key


def assert_untouched(live: dict) -> None:
    assert_state_equal(live, blank_state())


def assert_refused(path, error) -> None:
    """Both reading the manifest and loading fail with ``error``, and the live state is untouched."""
    with pytest.raises(error):
        ckpt.read_manifest(path)
    live = blank_state()
    with pytest.raises(error):
        ckpt.load(live, path)
    assert_untouched(live)


def save_fresh(path: Path, seed: int = 0) -> dict:
    state = make_state(seed)
    ckpt.save(state, path)
    return state


def file_fingerprint(path: Path) -> tuple[bytes, int]:
    return path.read_bytes(), path.stat().st_mtime_ns


def step_path(root, step: int) -> Path:
    """A step's checkpoint directory under a local root, as a Path (tests edit its files)."""
    return Path(root) / step_name(step)


def reseal(path, mutate) -> None:
    """Edit the manifest of the checkpoint at ``path`` with ``mutate(doc)`` and seal it again (a new
    digest): the damage is then one the digest does not catch, only validation."""
    manifest = Path(path) / "manifest.json"
    doc = json.loads(manifest.read_bytes())
    doc.pop("digest", None)
    mutate(doc)
    manifest.write_bytes(seal(doc))


def mixed_dtype_state() -> dict:
    """A model of every awkward dtype and shape an export meets (int32, uint16, float8, a scalar,
    an empty tensor), an optimizer tensor and a plain value."""
    return {"model": {"a": torch.randn(5, 3), "i": torch.arange(4, dtype=torch.int32),
                      "u": torch.arange(3).to(torch.uint16), "f8": torch.randn(4).to(torch.float8_e4m3fn),
                      "s": torch.tensor(2.5), "e": torch.empty(0, 3)},
            "optim": {"m": torch.randn(2)}, "step": 4}


class Booby:
    """Pickles as ``open(marker, "w")``: unpickling it with weights_only=False creates the marker."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def flip_byte(checkpoint: Path, fraction: float = 0.5, *, largest: bool = False) -> None:
    """Flip one byte of the checkpoint's first (``largest``: its largest) data file, ``fraction`` of the way in."""
    files = sorted((Path(checkpoint) / "data").iterdir())
    data = max(files, key=lambda p: p.stat().st_size) if largest else files[0]
    raw = bytearray(data.read_bytes())
    raw[min(int(len(raw) * fraction), len(raw) - 1)] ^= 0xFF
    data.write_bytes(bytes(raw))


def forbid_unpickling(monkeypatch) -> None:
    """Make any ``torch.load`` fail the test: loading our checkpoints must never unpickle."""

    def no_unpickling(*args, **kwargs):
        raise AssertionError("torch.load called")

    monkeypatch.setattr(torch, "load", no_unpickling)
