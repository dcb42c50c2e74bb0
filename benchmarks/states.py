"""The states the benchmarks save, each built once, and the walks over a state's tensors.

Every builder is deterministic (a seeded generator, or a pattern), so each benchmark measures the same
bytes run after run; which benchmark uses which, and why that shape:

* :func:`mixed_state` (bench_save_load): a flat dict with a realistic mix of dtypes and sizes.
* :func:`model_like_state` (bench_scaling): weights + AdamW-like optimizer state as nested dicts of
  plain tensors, exact in fp32 under ``add_(1)``, optionally one rank's row-shards.
* :func:`fp32_matrices_state` (bench_storage): four large fp32 matrices and two vectors.
* :func:`merge_state` (bench_merge): an embedding, 16 MiB matrices with vectors, an int64 tensor.
* :func:`reshard_source` (reshard_load): four fp32 matrices with rows a multiple of 4, in shared memory.

Walks: :func:`tensors` (every tensor of nested dicts, in order), :func:`state_bytes`,
:func:`zeros_like` (a live state to load into), :func:`select` (the part a template names),
:func:`model_and_optimizer_tensors` (what a checkpoint of a live model and optimizer holds).
"""

from __future__ import annotations

from typing import Any

import torch

MiB = 1 << 20


# ---------------------------------------------------------------------------------------------
# Walks
# ---------------------------------------------------------------------------------------------
def tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in tensors(v)]
    return []


def state_bytes(state: dict) -> int:
    return sum(t.nbytes for t in tensors(state))


def zeros_like(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    return {k: zeros_like(v) for k, v in tree.items()}


def model_and_optimizer_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor a checkpoint of (model, optimizer) holds: each parameter, then its optimizer state."""
    out = []
    for p in model.parameters():
        out.append(p.detach())
        out.extend(v for v in optimizer.state[p].values() if isinstance(v, torch.Tensor))
    return out


def select(tree: Any, template: Any) -> Any:
    """The part of ``tree`` that ``template`` names (same keys, ``tree``'s values)."""
    if not isinstance(template, dict) or not isinstance(tree, dict):
        return tree
    return {k: select(tree[k], v) for k, v in template.items() if k in tree}


# ---------------------------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------------------------
def mixed_state(gib: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """A flat state dict of about ``gib`` GiB: ~60% in 4 large fp32 matrices, ~25% in 4 bf16
    matrices, ~15% in 24 medium fp32 tensors, plus 200 small tensors (1-8 KB; fp32 and bf16)."""
    total = int(gib * (1 << 30))
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    cols = 4096

    def matrix(nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        elem = torch.empty((), dtype=dtype).element_size()
        rows = max(1, nbytes // (cols * elem))
        return torch.randn(rows, cols, generator=gen).to(dtype)

    small_bytes = 0
    for i in range(200):
        dtype = torch.bfloat16 if i % 4 == 3 else torch.float32
        numel = int(torch.randint(256, 2049, (1,), generator=gen))
        t = torch.randn(numel, generator=gen).to(dtype)
        state[f"model.layers.{i // 4}.small.{i % 4}"] = t
        small_bytes += t.nbytes
    rest = max(total - small_bytes, 0)
    for i in range(4):
        state[f"model.big_fp32.{i}.weight"] = matrix(int(rest * 0.60 / 4), torch.float32)
    for i in range(4):
        state[f"model.big_bf16.{i}.weight"] = matrix(int(rest * 0.25 / 4), torch.bfloat16)
    for i in range(24):
        numel = max(1, int(rest * 0.15 / 24) // 4)
        state[f"optim.medium.{i}"] = torch.randn(numel, generator=gen)
    return state


def describe_mixed(state: dict[str, torch.Tensor]) -> str:
    groups: dict[str, list[torch.Tensor]] = {}
    for key, t in state.items():
        kind = "large" if ".big_" in key else "medium" if key.startswith("optim.medium") else "small"
        groups.setdefault(f"{kind} {str(t.dtype).removeprefix('torch.')}", []).append(t)
    parts = []
    for name, ts in groups.items():
        size = sum(t.nbytes for t in ts)
        unit = f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.0f} KiB"
        shape = "x".join(map(str, ts[0].shape)) if len({tuple(t.shape) for t in ts}) == 1 else "various shapes"
        parts.append(f"{len(ts)} {name} ({shape}; {unit})")
    return f"{len(state)} tensors, {state_bytes(state) / 2**30:.3f} GiB: " + ", ".join(parts)


MODEL_COLS = 1024  # columns of every weight matrix of model_like_state (4 KiB rows)
MODEL_PARAMS = 8  # its weight matrices (and biases)


def model_like_state(nbytes: int, rank: int = 0, world: int = 1) -> dict:
    """Rank ``rank``'s row-shards (1/``world`` of the rows) of a model-like state of ``nbytes``:
    weights + biases, and AdamW-like exp_avg/exp_avg_sq/step per parameter, under keys that carry
    the rank (plain tensors: each rank saves its own)."""
    rows_total = max(world, round(nbytes / (3 * MODEL_PARAMS * MODEL_COLS * 4)))
    rows = rows_total // world + (1 if rank < rows_total % world else 0)
    suffix = f".shard{rank}" if world > 1 else ""
    pattern = (torch.arange(MODEL_COLS) % 251).float().mul_(0.5)  # exact in fp32, as are all the updates
    model, optim = {}, {}
    for i in range(MODEL_PARAMS):
        for name, shape in ((f"layers.{i}.weight{suffix}", (rows, MODEL_COLS)),
                            (f"layers.{i}.bias{suffix}", (MODEL_COLS,))):
            group = [torch.empty(shape) for _ in range(3)]
            for k, t in enumerate(group):  # a distinct offset per tensor and rank: a mix-up shows
                base = 3 * i + k + 32 * rank
                offset = (torch.arange(shape[0]) % 7).float().add_(base)[:, None] if len(shape) == 2 else base
                torch.add(pattern, offset, out=t)
            model[name] = group[0]
            optim[name] = {"step": torch.tensor(float(i)), "exp_avg": group[1], "exp_avg_sq": group[2]}
    return {"model": model, "optim": {"state": optim}}


def fp32_matrices_state(size_mb: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """About ``size_mb`` MiB of fp32: four matrices of 24% each and two vectors of 2% each."""
    total = int(size_mb * MiB)
    gen = torch.Generator().manual_seed(seed)
    cols = 1024
    state: dict[str, torch.Tensor] = {}
    for i in range(4):
        rows = max(1, int(total * 0.24) // (cols * 4))
        state[f"model.layers.{i}.weight"] = torch.randn(rows, cols, generator=gen)
    for i in range(2):
        state[f"optim.vector.{i}"] = torch.randn(max(1, int(total * 0.02) // 4), generator=gen)
    return state


def describe_fp32(state: dict[str, torch.Tensor]) -> str:
    shapes = ", ".join(f"{'x'.join(map(str, t.shape))}" for t in state.values())
    return f"{len(state)} fp32 tensors ({shapes}), {state_bytes(state) / MiB:.1f} MiB"


MERGE_MATRIX = (2048, 2048)  # 16 MiB of fp32: merge_state's matrices


def merge_state(size_mib: int, seed: int = 0) -> dict:
    """About ``size_mib`` MiB: an embedding of 1/8, 16 MiB matrices each with a vector, the rest in
    one smaller matrix, and an int64 tensor."""
    gen = torch.Generator().manual_seed(seed)
    rows, cols = MERGE_MATRIX
    total = size_mib * MiB
    model = {"tok_embeddings.weight": torch.randn(max(1, total // 8 // (cols * 4)), cols, generator=gen)}
    left = total - model["tok_embeddings.weight"].nbytes
    layer = 0
    while left >= cols * 4 * 2:
        n = min(rows, left // (cols * 4) - 1)
        model[f"layers.{layer}.weight"] = torch.randn(n, cols, generator=gen)
        model[f"layers.{layer}.norm"] = torch.randn(cols, generator=gen)
        left -= (n + 1) * cols * 4
        layer += 1
    model["positions"] = torch.arange(4096, dtype=torch.int64)
    return {"model": model}


def reshard_source(gib: float, seed: int = 1, cols: int = 4096) -> dict[str, torch.Tensor]:
    """Four fp32 matrices of about ``gib`` GiB together (40/30/20/10 %), ``cols`` columns, rows a
    multiple of 4 so that every layout's shards are even; random values, in shared memory."""
    gen = torch.Generator().manual_seed(seed)
    total = int(gib * (1 << 30))
    state = {}
    for i, share in enumerate((0.4, 0.3, 0.2, 0.1)):
        rows = max(4, int(total * share) // (cols * 4) // 4 * 4)
        state[f"layers.{i}.weight"] = torch.randn(rows, cols, generator=gen).share_memory_()
    return state
