"""A tiny model with awkward shapes (vocab 13: uneven over 2 or 4 shards) and its parallel layouts; states
compared bitwise, and flattened as an export writes them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class TinyNet(nn.Module):
    def __init__(self, vocab: int = 13, dim: int = 16, hidden: int = 24):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h + self.w2(F.silu(self.w1(h)))
        return self.out(self.norm(h))


def build(seed: int = 0) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet()


def batch(seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 13, (4, 9), generator=g)


def train_step(model: nn.Module, optim: torch.optim.Optimizer, seed: int = 1) -> None:
    ids = batch(seed)
    logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))
    loss.backward()
    optim.step()
    optim.zero_grad()


def parallelize(model: TinyNet, layout: str) -> TinyNet:
    """``fsdp`` (1-D over all ranks), ``fsdp_tp`` (2x2 mesh dp x tp) or ``plain``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if layout == "plain":
        return model
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
        for sub in (model.emb, model.w1, model.w2, model.out):
            fully_shard(sub, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    if layout == "fsdp_tp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {
            "w1": ColwiseParallel(),
            "w2": RowwiseParallel(),
            "out": ColwiseParallel(output_layouts=Replicate()),
        })
        for sub in (model.emb, model.w1, model.w2, model.out):
            fully_shard(sub, mesh=mesh["dp"])
        return fully_shard(model, mesh=mesh["dp"])
    raise ValueError(layout)


def full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict:
    """Model and optimizer state as full (unsharded) CPU tensors keyed by canonical names."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    def full(node):
        if isinstance(node, dict):
            return {k: full(v) for k, v in node.items()}
        if isinstance(node, list):
            return [full(v) for v in node]
        if isinstance(node, DTensor):
            return node.full_tensor().detach().clone()
        if isinstance(node, torch.Tensor):
            return node.detach().clone()
        return node

    return {"model": full(get_model_state_dict(model)), "optim": full(get_optimizer_state_dict(model, optim))}


def flat_tensors(nested: dict) -> dict[str, torch.Tensor]:
    """The tensors of a nested state under their flat keys (``model.w``), as an export writes them."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(nested)
    return {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}


def assert_same(actual, expected, where: str = "", *, tensors_same=None) -> None:
    """Bitwise equality of nested dicts/lists of tensors and values; ``tensors_same(a, e)``, when
    given, decides for tensors instead (e.g. DTensors: placements, mesh and local bytes)."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), (where, set(actual) ^ set(expected))
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}.{key}", tensors_same=tensors_same)
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{where}[{i}]", tensors_same=tensors_same)
    elif isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), where
        if tensors_same is not None:
            assert tensors_same(actual, expected), where
            return
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert torch.equal(_bits(actual), _bits(expected)), where
    elif isinstance(expected, float) and expected != expected:
        assert actual != actual, where
    else:
        assert actual == expected and type(actual) is type(expected), (where, actual, expected)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes, so NaN payloads and signed zeros compare exactly."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)
