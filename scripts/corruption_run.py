"""The corruption campaign's run (scripts/corruption_campaign.py): a small replicated run, saved once.

A :class:`ckpt.CheckpointManager` (:data:`MANAGER_OPTIONS`: ``interval=1``, ``keep=5``,
``full_every=3``) saves :data:`STEPS` 1..5 (full, delta, delta, full, delta) of :func:`make_state`
(four tensors, one of them bf16, one of 80 KiB so that a full checkpoint's data file has alignment
padding, a ``torch.save`` value and JSON values) to ``primary`` with one local ``replica`` and the
LMDB catalog on, and waits until every step is committed on both (:func:`build_run`). A load fills
:func:`blank_state`, whose contents match no saved step; :func:`catalog_listing` is what a catalog
says, without the times a rebuild would change.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

import ckpt
from ckpt.root import Catalog

STEPS = (1, 2, 3, 4, 5)
KEEP = 5
FULL_EVERY = 3
MANAGER_OPTIONS = dict(interval=1, keep=KEEP, full_every=FULL_EVERY, replica_retry_initial=0.05,
                       replica_retry_max=0.2, close_timeout=1.0)
SHAPES = {"w": (96, 256),  # 96 KiB: starts at a 4096 boundary
          "b": (300,),
          "h": (64, 64),  # bf16
          "z": (64, 320)}  # 80 KiB after packed blobs: padding before it


def make_state(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    model = {key: torch.randn(*shape, generator=gen) for key, shape in SHAPES.items()}
    model["h"] = model["h"].to(torch.bfloat16)
    return {"model": model,
            "seen": {1, 2, 3},  # no JSON form: a torch.save value blob
            "lr": 0.1,
            "step": 0}


def blank_state() -> dict:
    """The live state a load fills: same layout, contents that match no saved step."""
    model = {key: torch.full(shape, 7.0, dtype=torch.bfloat16 if key == "h" else torch.float32)
             for key, shape in SHAPES.items()}
    return {"model": model, "seen": None, "lr": -1.0, "step": -1}


def clone(state):
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: clone(v) for k, v in state.items()}
    if isinstance(state, set):
        return set(state)
    return state


def build_run(work: Path) -> dict[int, dict]:
    """Save steps 1..5 under ``work/primary`` with ``work/replica``; the states saved, by step."""
    state, saved = make_state(), {}
    with ckpt.CheckpointManager(work / "primary", replicas=[str(work / "replica")], **MANAGER_OPTIONS) as manager:
        for step in STEPS:
            manager.before_step()  # the previous snapshot no longer needs the live tensors
            model = state["model"]
            model["w"][step] += 1.0
            model["h"][step] -= 1
            if step % 2 == 0:
                model["z"][step] *= 2.0
            state["seen"] = {1, 2, 3, 10 + step}
            state["step"] = step
            manager.save(step, state)
            saved[step] = clone(state)
        manager.wait()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status = manager.replication_status()
            if all(set(status.get(s, {}).values()) == {"committed"} for s in STEPS):
                break
            time.sleep(0.02)
        else:
            raise RuntimeError(f"replication did not finish: {manager.replication_status()}")
    return saved


def catalog_listing(path: str | os.PathLike) -> list:
    """What the catalog at ``path`` says, without the times of state changes (a rebuild takes them
    from the manifests)."""
    with Catalog(path, readonly=True) as catalog:
        return listing_of(catalog)


def listing_of(catalog: Catalog) -> list:
    return [[i.step, i.kind, i.base_step, i.bytes, i.raw_bytes, i.tensors, i.created,
             sorted((m, s.state) for m, s in i.mounts.items())] for i in catalog.steps()]
