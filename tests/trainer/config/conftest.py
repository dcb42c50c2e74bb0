"""Fixtures of the configuration's tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def write():
    """``write(tmp_path, name, text)``: a file of ``text`` under ``tmp_path``, its path as a string."""

    def write(tmp_path: Path, name: str, text: str) -> str:
        p = tmp_path / name
        p.write_text(text)
        return str(p)

    return write
