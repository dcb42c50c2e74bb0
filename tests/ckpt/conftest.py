"""Fixtures of the engine's tests: a run directory and a small checkpoint saved in it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.checkpoints import save_fresh


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """Checkpoints live in ``tmp_path/run``; hostile names aim at files in ``tmp_path`` and ``run``."""
    path = tmp_path / "run"
    path.mkdir()
    return path


@pytest.fixture
def saved(run_dir: Path) -> tuple[Path, dict]:
    path = run_dir / "step-1"
    return path, save_fresh(path)
