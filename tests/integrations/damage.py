"""Helpers the integration tests share: damage a committed checkpoint, forbid unpickling."""

from __future__ import annotations

from pathlib import Path

import torch


def flip_byte(checkpoint: Path, fraction: float = 0.5) -> None:
    """Flip one byte of the checkpoint's first data file, ``fraction`` of the way in."""
    data = sorted((Path(checkpoint) / "data").iterdir())[0]
    raw = bytearray(data.read_bytes())
    raw[min(int(len(raw) * fraction), len(raw) - 1)] ^= 0xFF
    data.write_bytes(bytes(raw))


def forbid_unpickling(monkeypatch) -> None:
    """Make any ``torch.load`` fail the test: loading our checkpoints must never unpickle."""

    def no_unpickling(*args, **kwargs):
        raise AssertionError("torch.load called")

    monkeypatch.setattr(torch, "load", no_unpickling)
