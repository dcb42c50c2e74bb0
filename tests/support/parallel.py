"""TinyNet checkpoints saved from a parallel layout: what the resharding and merging tests start from."""

from __future__ import annotations

from pathlib import Path

import torch

import ckpt
from tests.support import models


def save_parallel(rank: int, world: int, layout: str, out: str, merged: str | None, reference: str | None):
    """On every rank of ``layout`` (``models.parallelize``): optionally load ``reference``'s checkpoint
    first (and check it against its ``expected.pt``), train one step, save ``out/ckpt`` (and the model
    as one ``merged`` safetensors file); rank 0 writes the full state to ``out/expected.pt``. Returns
    the data files written."""
    model = models.parallelize(models.build(), layout)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if reference is not None:  # first check that a checkpoint from another layout loads exactly here
        state = {"model": model, "optim": optim, "step": 0}
        ckpt.load(state, reference + "/ckpt")
        models.assert_same(models.full_state(model, optim), torch.load(reference + "/expected.pt"))
        assert state["step"] == 1
    models.train_step(model, optim, seed=2)
    expected = models.full_state(model, optim)
    ckpt.save({"model": model, "optim": optim, "step": 2, "meta": {"layout": layout}}, out + "/ckpt")
    if merged is not None:
        ckpt.save({"model": model}, merged, merged=True)
    if rank == 0:
        torch.save(expected, out + "/expected.pt")
    return sorted(p.name for p in (Path(out) / "ckpt" / "data").iterdir())
