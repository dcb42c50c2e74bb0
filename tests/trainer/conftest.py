"""Fixtures of the trainer's tests.

* ``frozen_heap`` (package, autouse): what the session holds when the trainer's tests start (the
  modules the suite imported so far and their caches: over a million objects after tests/ckpt) moves
  to the collector's permanent generation (``gc.freeze``) until they end. ``trainer.train.main()``
  ends with a full ``gc.collect()`` (trainer/exits.py) that would otherwise walk that whole heap:
  0.3 s a call in a fresh process, 0.7 s after tests/ckpt, ~2 s at the end of the quick loop, and
  the trainer's tests call it some 30 times. The garbage of earlier tests is collected first; what
  these tests create is collected as before."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from trainer.data import ByteTokenizer, TokenStream, load_documents


@pytest.fixture(scope="package", autouse=True)
def frozen_heap():
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(scope="module")
def shipped_tokens() -> np.ndarray:
    return TokenStream(load_documents("shipped"), ByteTokenizer()).tokens
