"""AdamW with memory-lean precision: bf16 moments and/or bf16 master weights (stochastic rounding).

Contract: :func:`build` returns ``torch.optim.AdamW`` (foreach) when parameters and moments are
fp32, the trainer's historical optimizer, and otherwise :class:`LeanAdamW`, a subclass of it whose
step runs one tensor at a time (its temporaries are a few fp32 copies of the largest local shard,
not of the whole model as foreach AdamW's are):

* ``state_dtype = bfloat16``: exp_avg and exp_avg_sq are stored in bf16 (2 + 2 bytes a parameter
  instead of 4 + 4); each step upcasts them, updates in fp32 exactly as torch's single-tensor
  AdamW does, and rounds them back to nearest (their per-step change, (1 - beta) of the value, is
  far above bf16's resolution of 2^-8, so nothing is lost to rounding).
* bf16 parameters (``optimization.master_dtype = bf16``: the model is cast before it is wrapped):
  the fp32 update ``p + delta`` is written back with **stochastic rounding** (round up with the
  probability of the remainder: add 16 random bits below bf16's mantissa, truncate), which is
  unbiased, so the many updates smaller than half a bf16 ulp still move the weights on average
  (round-to-nearest would drop them). The random bits come from a generator seeded by (seed,
  rank, step): reproducible, and a resumed run rounds as the uninterrupted one did.

Checkpoints: the moments keep their dtype through ``load_state_dict`` (torch casts optimizer state
to its parameter's dtype; the hooks here put the loaded tensors back as they were saved), so a
save/load round trip is bitwise and resharding works as for any tensor. With fp32 parameters and
moments the update is torch's single-tensor AdamW, bit for bit (tests/trainer/test_optim.py).

The learning-rate schedule lives here too (:func:`lr_lambda`: linear warmup, then cosine decay).
"""

from __future__ import annotations

import math

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def stochastic_round_(target: torch.Tensor, value: torch.Tensor, generator: torch.Generator | None) -> None:
    """Write fp32 ``value`` into bf16 ``target``, rounding up with the probability of the dropped
    remainder (exact where ``value`` is representable)."""
    bits = value.view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device, generator=generator)
    target.copy_((bits + noise).bitwise_and_(-65536).view(torch.float32))


class LeanAdamW(torch.optim.AdamW):
    """torch's AdamW with moments in ``state_dtype`` and bf16 parameters stochastically rounded."""

    def __init__(self, params, *, state_dtype: torch.dtype = torch.float32, seed: int = 0, rank: int = 0, **kwargs):
        kwargs.update(foreach=False, fused=False)
        super().__init__(params, **kwargs)
        self.state_dtype, self.seed, self.rank = state_dtype, seed, rank
        self._saved_moments: dict = {}
        self.register_load_state_dict_pre_hook(LeanAdamW._keep_moments)
        self.register_load_state_dict_post_hook(LeanAdamW._restore_moments)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    for key in MOMENTS:
                        state[key] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format)
                state["step"] += 1
                step = int(state["step"].item()) if not _fake(state["step"]) else 1
                self._update(_local(p), _local(p.grad), _local(state["exp_avg"]), _local(state["exp_avg_sq"]),
                             step, lr, wd, eps, beta1, beta2)
        return loss

    def _update(self, p, grad, exp_avg, exp_avg_sq, step, lr, wd, eps, beta1, beta2) -> None:
        """torch's single-tensor AdamW on fp32 copies, written back in each tensor's dtype."""
        g = grad.float()
        p32 = p.float() if p.dtype != torch.float32 else p
        m = exp_avg.float() if exp_avg.dtype != torch.float32 else exp_avg
        v = exp_avg_sq.float() if exp_avg_sq.dtype != torch.float32 else exp_avg_sq
        p32.mul_(1 - lr * wd)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
        p32.addcdiv_(m, denom, value=-lr / (1 - beta1 ** step))
        for stored, value in ((exp_avg, m), (exp_avg_sq, v)):
            if stored is not value:
                stored.copy_(value)
        if p is not p32:
            stochastic_round_(p, p32, self._generator(p32, step))

    def _generator(self, like: torch.Tensor, step: int) -> torch.Generator | None:
        if like.device.type == "meta" or _fake(like):  # a measured dry run: no numbers to draw
            return None
        if getattr(self, "_gen_step", None) != step:  # one stream per step: reproducible across a resume
            self._gen = torch.Generator(device=like.device)
            self._gen.manual_seed(hash((self.seed, self.rank, step)) & 0x7FFF_FFFF_FFFF_FFFF)
            self._gen_step = step
        return self._gen

    @staticmethod
    def _keep_moments(optimizer: "LeanAdamW", state_dict: dict) -> None:
        optimizer._saved_moments = {pid: {k: v for k, v in s.items() if k in MOMENTS}
                                    for pid, s in state_dict.get("state", {}).items()}
        optimizer._saved_ids = [pid for g in state_dict.get("param_groups", []) for pid in g["params"]]

    @staticmethod
    def _restore_moments(optimizer: "LeanAdamW") -> None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        for pid, param in zip(optimizer._saved_ids, params):
            for key, value in optimizer._saved_moments.get(pid, {}).items():
                optimizer.state[param][key] = value.to(device=_local(param).device)
        optimizer._saved_moments, optimizer._saved_ids = {}, []


def _fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def build(params, *, lr: float, weight_decay: float, state_dtype: str = "fp32", param_dtype: torch.dtype = torch.float32,
          seed: int = 0, rank: int = 0) -> torch.optim.Optimizer:
    """The run's AdamW (betas 0.9, 0.95): torch's foreach AdamW for fp32 parameters and moments,
    else :class:`LeanAdamW`."""
    if state_dtype == "fp32" and param_dtype == torch.float32:
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    return LeanAdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay, seed=seed, rank=rank,
                     state_dtype=torch.bfloat16 if state_dtype == "bf16" else torch.float32)


def lr_lambda(warmup_steps: int, total_steps: int, min_ratio: float):
    """Linear warmup to 1, then cosine decay to ``min_ratio`` at ``total_steps``."""

    def factor(step: int) -> float:  # ``step`` = optimizer steps taken so far
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
