"""Save a sharded model through the engine, then load it into another layout, bitwise.

    torchrun --standalone --nproc_per_node 2 examples/sharded_save_load.py [--out outputs/example]

Every rank holds an FSDP2 shard of a small llama-like block stack and its AdamW state. The run
trains a few steps, saves with ``ckpt.save``, reloads the checkpoint into a freshly initialised
FSDP2 model (and, on rank 0, into a plain single-process model) and checks every byte.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import ckpt
from ckpt.format import step_name


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        return x + self.down(F.silu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, vocab: int = 257, dim: int = 128, layers: int = 4):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def sharded(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def full(node):
    if isinstance(node, dict):
        return {k: full(v) for k, v in node.items()}
    if isinstance(node, DTensor):
        return node.full_tensor()
    return node


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/example")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)

    model, optim = sharded(seed=0)
    data = torch.randint(0, 257, (8, 65), generator=torch.Generator().manual_seed(1))
    for step in range(1, args.steps + 1):
        logits = model(data[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 257), data[:, 1:].reshape(-1))
        loss.backward()
        optim.step()
        optim.zero_grad()
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)

    path = os.path.join(args.out, step_name(args.steps))
    start = time.perf_counter()
    ckpt.save({"model": model, "optim": optim, "step": args.steps}, path, overwrite=True, step=args.steps)
    saved_s = time.perf_counter() - start
    manifest = ckpt.read_manifest(path)
    if rank == 0:
        print(f"saved {path}: {manifest.total_tensor_bytes() / 2**20:.1f} MiB in "
              f"{len(manifest.files)} files, {saved_s * 1e3:.0f} ms", flush=True)

    reference = full({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)})
    fresh, fresh_optim = sharded(seed=123)
    state = {"model": fresh, "optim": fresh_optim, "step": 0}
    ckpt.load(state, path)
    loaded = full({"model": get_model_state_dict(fresh), "optim": get_optimizer_state_dict(fresh, fresh_optim)})
    same = all(torch.equal(a, b) for a, b in zip(_tensors(loaded), _tensors(reference)))
    if rank == 0:
        plain = Net()
        plain_optim = torch.optim.AdamW(plain.parameters(), lr=1e-3)
        ckpt.load({"model": plain, "optim": plain_optim, "step": 0}, path, no_dist=True)  # 1 process
        same = same and all(
            torch.equal(a, b) for a, b in zip(_tensors(plain.state_dict()), _tensors(reference["model"]))
        )
        print(f"reloaded into FSDP2 x{dist.get_world_size()} and into one process: "
              f"{'bitwise identical' if same else 'MISMATCH'}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if not same:
        raise SystemExit(1)


def _tensors(node):
    if isinstance(node, dict):
        for key in sorted(node, key=str):
            yield from _tensors(node[key])
    elif isinstance(node, torch.Tensor):
        yield node


if __name__ == "__main__":
    main()
