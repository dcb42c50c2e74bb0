"""Fixtures of the trainer's tests."""

from __future__ import annotations

import numpy as np
import pytest

from trainer.data import ByteTokenizer, TokenStream, load_documents


@pytest.fixture(scope="module")
def shipped_tokens() -> np.ndarray:
    return TokenStream(load_documents("shipped"), ByteTokenizer()).tokens
