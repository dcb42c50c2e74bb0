"""Delta chains shared by the engine's tests: a model whose fp32, bf16, fp16 and integer state changes
every step, a run that saves a chain through CheckpointManager (one checkpoint per step), and a
checkpoint loaded back as full state."""

from __future__ import annotations

import torch
from torch import nn

import ckpt
from ckpt.manager import CheckpointManager
from tests.support import models


class Mixed(nn.Module):
    """fp32 weights (AdamW) plus bf16, fp16 and integer state that changes every step."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        self.register_buffer("ema_bf16", torch.zeros(64, 256, dtype=torch.bfloat16))
        self.register_buffer("scale_fp16", torch.ones(256, dtype=torch.float16))
        self.register_buffer("counts", torch.zeros(64, dtype=torch.int64))

    def train_step(self, optim, step: int) -> None:
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))
        self.net(x).square().mean().backward()
        optim.step()
        optim.zero_grad()
        with torch.no_grad():
            self.ema_bf16.mul_(0.9).add_(self.net[0].weight.T.to(torch.bfloat16), alpha=0.1)
            self.scale_fp16.add_(0.01)
            self.counts[step % 64] += step


def expected_state(model, optim, step) -> dict:
    return {**models.full_state(model, optim), "step": step}


def load_mixed(path, step_hint=0) -> dict:
    model = Mixed()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"model": model, "optim": optim, "step": step_hint}
    ckpt.load(state, path)
    return expected_state(model, optim, state["step"])


def train_with_chain(root, steps=9, **manager_args):
    model = Mixed()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    expected = {}
    with CheckpointManager(root, interval=1, **{"keep": 100, **manager_args}) as manager:
        manager.attach(optim)
        for step in range(1, steps + 1):
            model.train_step(optim, step)
            expected[step] = expected_state(model, optim, step)
            manager.save(step, {"model": model, "optim": optim, "step": step})
    return expected
