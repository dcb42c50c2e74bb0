"""Dynamic loss scaling for fp16 training, sharding-aware and checkpointed.

fp16 gradients underflow without scaling: the loss is multiplied by ``scale`` before backward and the
gradients divided by it before the optimizer step. Each rank holds only its shards (FSDP2 DTensors,
TP slices, pipeline stages), so whether any gradient overflowed is agreed over the whole world with
one all-reduce; then every rank skips the same steps. The scale halves after an overflow and doubles
after ``growth_interval`` clean steps (the policy of ``torch.amp.GradScaler``). Its state
(``scale``, ``growth_tracker``) is saved with the checkpoint, so a resumed run scales exactly as the
interrupted one would have.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class ShardedGradScaler:
    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.growth_tracker = 0

    def unscale_(self, parameters) -> bool:
        """Divide every local gradient by the scale; True when any rank found an inf or NaN."""
        grads = [_local(p.grad) for p in parameters if p.grad is not None]
        found = torch.zeros(())
        if grads:
            norms = torch._foreach_norm(grads, float("inf"))
            found = (~torch.isfinite(torch.stack([n.float() for n in norms]))).any().float().cpu()
            torch._foreach_mul_(grads, 1.0 / self.scale)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return bool(found.item())

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker >= self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.growth_tracker = float(state["scale"]), int(state["growth_tracker"])
