"""Expert parallel: a mixture of experts' routed experts sharded over an EP group, tokens sent to
their experts' ranks all-to-all and back.

The rule (torchtitan's without CP): **EP borrows its ranks from dp_shard.** ``parallelism.ep``
must divide ``parallelism.dp_shard`` (and ``model.num_experts``); the data-parallel ranks are cut
into ``dp_shard / ep`` groups of ``ep`` consecutive shards, the mesh ``(pp, dp_replicate,
dp_shard_mod_ep, ep, tp)`` (:func:`build_mesh`; row-major, so its ``(dp_shard_mod_ep, ep)`` is the
main mesh's ``dp_shard``, with cp 1). EP multiplies nothing: the world size stays ``dp_replicate * dp_shard *
tp * pp``; each EP rank still reads its own data. Not with tp, pp or cp above 1, nor DDP
(:func:`check`).

What :func:`apply` does to a model (before FSDP2):

* every block's ``moe.experts.w{1,2,3}`` becomes a DTensor ``Shard(0)`` over the ``ep`` mesh
  dimension: ``num_experts / ep`` experts per rank. The checkpoint stores them as such, so DCP
  reshards them onto another EP degree (or onto FSDP2's dp_shard sharding with EP 1);
* the MoE's :attr:`~trainer.moe.MoE.dispatcher` is an :class:`AllToAllDispatcher`: the token copies
  (sorted by expert) go to their experts' ranks with ``all_to_all_single_autograd`` (the backward is
  the reverse all-to-all), are run there grouped by local expert, and come back the same way;
* FSDP2 then shards everything else over the data-parallel mesh, the experts left out
  (:func:`expert_params` as ``ignored_params``). Across the ``dp_replicate * dp_shard / ep`` ranks
  that hold the same experts they are replicated (not FSDP-sharded further: what the dry-run plan
  counts); :func:`sync_grads` all-reduces their gradients there and divides by the data-parallel
  degree, as FSDP2's reduce-scatter averages the others, once per step after the last micro-step.

:func:`clip_grad_norm_` is the global-norm clipping of parameters living on two meshes (FSDP2's and
EP's), which ``torch.nn.utils.clip_grad_norm_`` cannot stack.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .moe import MoE
from .parallel import ParallelismError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "tp")


def check(ep: int, *, num_experts: int, dp_shard: int, tp: int, pp: int, zero_stage: int, cp: int = 1) -> None:
    """ParallelismError naming what does not fit when ``parallelism.ep = ep`` (see the module docstring)."""
    if ep < 1:
        raise ParallelismError(f"parallelism.ep must be >= 1, got {ep}")
    if ep == 1:
        return
    if num_experts == 0:
        raise ParallelismError(f"parallelism.ep = {ep} needs a mixture-of-experts model (model.flavor moe_debug, "
                               "moe_small, or model.num_experts > 0)")
    if num_experts % ep:
        raise ParallelismError(f"parallelism.ep = {ep} must divide model.num_experts = {num_experts}")
    if dp_shard % ep:
        raise ParallelismError(f"parallelism.ep = {ep} must divide parallelism.dp_shard = {dp_shard} "
                               "(expert parallel borrows its ranks from the data-parallel shards)")
    if tp > 1 or pp > 1 or cp > 1:
        raise ParallelismError(f"parallelism.ep = {ep} does not compose with tp = {tp} / pp = {pp} / cp = {cp} "
                               "above 1 yet")
    if zero_stage == 0:
        raise ParallelismError("parallelism.ep > 1 needs FSDP2 for the other parameters: zero_stage >= 1")


def build_mesh(device_type: str, *, pp: int, dp_replicate: int, dp_shard: int, ep: int, tp: int) -> DeviceMesh:
    """The mesh with dp_shard cut into ``(dp_shard_mod_ep, ep)`` (collective: every rank calls it)."""
    return init_device_mesh(device_type, (pp, dp_replicate, dp_shard // ep, ep, tp), mesh_dim_names=MESH_DIMS)


def moe_modules(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def expert_params(model: nn.Module) -> list[nn.Parameter]:
    """The routed experts' 3-D weights (what EP shards and FSDP2 leaves out), in module order: the
    same order on every rank, as their gradient all-reduces must be (a set's order is by id)."""
    return [p for moe in moe_modules(model) for p in moe.experts.parameters()]


def is_expert(param: torch.Tensor) -> bool:
    mesh = getattr(param, "device_mesh", None)
    return mesh is not None and mesh.mesh_dim_names == ("ep",)


class AllToAllDispatcher:
    """Runs a MoE's token copies on the ranks owning their experts (see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup, ep: int):
        self.group, self.ep = group, ep

    def __call__(self, experts: nn.Module, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        ep = self.ep
        n_local = counts.numel() // ep
        received = torch.empty_like(counts)  # [source rank, local expert]: what comes to my experts
        dist.all_to_all_single(received, counts, group=self.group)
        send = counts.view(ep, n_local).sum(1).tolist()
        recv = received.view(ep, n_local).sum(1).tolist()
        rows = all_to_all_single_autograd(routed, recv, send, self.group)
        # rows arrive by (source rank, local expert); the experts want them by (local expert, source)
        key = torch.arange(ep * n_local, device=counts.device).view(ep, n_local)
        key = (key % n_local) * ep + key // n_local
        order = torch.argsort(torch.repeat_interleave(key.reshape(-1), received.reshape(-1)), stable=True)
        out = experts(rows[order], received.view(ep, n_local).sum(0).tolist())
        back = torch.zeros_like(out).index_copy(0, order, out)
        return all_to_all_single_autograd(back, send, recv, self.group)


def apply(model: nn.Module, mesh: DeviceMesh) -> None:
    """Shard every MoE's experts over ``mesh["ep"]`` and install the all-to-all dispatcher."""
    from torch.distributed.tensor import Shard, distribute_tensor

    ep_mesh = mesh["ep"]
    for moe in moe_modules(model):
        for name, param in list(moe.experts.named_parameters()):
            # every rank holds the same initial weights: each keeps its slice, nothing is sent
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
            setattr(moe.experts, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        moe.dispatcher = AllToAllDispatcher(ep_mesh.get_group(), ep_mesh.size())


def replica_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """The ranks holding the same experts (``dp_replicate x dp_shard_mod_ep``), None when just one."""
    sub = mesh["dp_replicate", "dp_shard_mod_ep"]
    return None if sub.size() == 1 else sub._flatten("ep_replicas").get_group()


def sync_grads(params: list[torch.Tensor], group: dist.ProcessGroup | None, dp: int) -> None:
    """The experts' gradients: summed over the ranks holding the same experts, divided by ``dp``."""
    for p in params:
        if p.grad is None:
            continue
        grad = p.grad._local_tensor if hasattr(p.grad, "_local_tensor") else p.grad
        if group is not None:
            dist.all_reduce(grad, group=group)
        grad.div_(dp)


def _norm(grads: list[torch.Tensor]) -> torch.Tensor:
    if not grads:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    return (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).float().cpu()


def clip_grad_norm_(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip the gradients of ``params`` (experts on the EP mesh, the rest on FSDP2's) to a global
    norm of ``max_norm``; returns the norm before clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    experts = [g for g in grads if is_expert(g)]
    others = [g for g in grads if not is_expert(g)]
    total = (_norm(experts) ** 2 + _norm(others) ** 2).sqrt()
    coef = float(max_norm / (total + 1e-6))
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return total
