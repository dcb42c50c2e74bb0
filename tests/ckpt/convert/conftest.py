"""Fixtures of the converters' tests: a small plain DCP checkpoint (``tests.support.dcp_sources``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.dcp_sources import save_small


@pytest.fixture(scope="module")
def small_dcp(tmp_path_factory) -> Path:
    """A single-process DCP checkpoint of a tensor and a few values (two data files)."""
    return save_small(tmp_path_factory.mktemp("small") / "dcp")
