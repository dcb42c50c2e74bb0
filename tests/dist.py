"""Run a function on N CPU ranks (gloo, loopback) in fresh spawned processes and collect results."""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, out_dir: str, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    import torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        Path(out_dir, f"rank-{rank}.pkl").write_bytes(pickle.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(world_size: int, fn, *args) -> list:
    """``fn(rank, world_size, *args)`` on every rank (fn must be importable at module level)."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_entry, args=(world_size, free_port(), out_dir, fn, args),
                           nprocs=world_size, start_method="spawn")
        return [pickle.loads(Path(out_dir, f"rank-{r}.pkl").read_bytes()) for r in range(world_size)]
