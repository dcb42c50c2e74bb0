"""What the replication, copy and resume tests share: a slowly changing state saved step by step
(deltas stay small), its blank twin, fast replica retries, and a check that reads every blob."""

from __future__ import annotations

import torch

from ckpt.read.source import ChunkSource

FAST_RETRY = {"replica_retry_initial": 0.05, "replica_retry_max": 0.2}


def state(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(128, 64, generator=gen), "b": torch.randn(64, generator=gen), "step": seed}


def blank() -> dict:
    return {"w": torch.zeros(128, 64), "b": torch.zeros(64), "step": -1}


def train(manager, steps, *, seed0=0) -> dict[int, dict]:
    """Save a slowly changing state at each step (deltas stay small); the states saved, by step."""
    live, saved = state(seed0), {}
    for step in steps:
        manager.before_step()  # the last snapshot is complete before the state changes
        live["w"][step % 128] += 1.0
        live["step"] = step
        manager.save(step, live)
        saved[step] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in live.items()}
    return saved


def verify_every_blob(location) -> None:
    with ChunkSource(location) as source:
        for key, entry in source.manifest.tensors.items():
            for chunk in entry.chunks:
                source.files.read(chunk.blob, what=key)
