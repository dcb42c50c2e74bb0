"""Launching processes on this machine: free ports, the loopback interface, the environment of a rank
and of a torchrun agent, gloo ranks forked from a fork server, and a process's descendants.

Shared by the tests, the benchmarks (``benchmarks/*.py``) and the campaign scripts
(``scripts/crash_job.py``, under ``scripts/crash_harness.py``); it imports nothing of theirs and nothing but the standard library and
torch, so none of them needs a harness to start ranks. Everything stays on 127.0.0.1. torch is
imported only by :func:`run_ranks` and in the ranks: the process-level helpers serve the crash
harness, which starts torchrun jobs without importing torch itself.

* :func:`free_port`: a TCP port on 127.0.0.1 free right now (another process could still take it).
* :func:`loopback_interface`: the loopback interface's name, for ``GLOO_SOCKET_IFNAME``.
* :func:`rank_env`: the ``env://`` rendezvous variables of one rank of a local job.
* :func:`run_ranks`: ``fn(rank, world_size, *args)`` on N fresh CPU ranks (gloo), forked from a fork
  server that imported torch, ckpt and the trainer once (:data:`RANK_PRELOAD`), results collected in
  rank order; ranks that hang are killed after :data:`RANKS_HANG_SECONDS`.
* :func:`job_env`: this process's environment cleaned for a ``torchrun`` agent (no inherited rank or
  elastic variables; one intra-op thread; gloo on loopback; this checkout first on ``PYTHONPATH``).
* :func:`descendants`: every live descendant of a process, from /proc (torchrun starts its workers
  in sessions of their own: neither the agent's process group nor its session reaches them).
* :func:`start_forkserver`: multiprocessing's fork server with modules of this checkout preloaded
  (processes forked from it pay no import and share no heap with one another).
"""

from __future__ import annotations

import os
import pickle
import random
import socket
import sys
import tempfile
from pathlib import Path

from tests.support import REPO

HOST = "127.0.0.1"
# Variables a torchrun agent sets for its workers: inherited ones would mislead a new agent.
# A guard against hangs, not a speed check: far above a loaded machine's time for any test's ranks.
RANKS_HANG_SECONDS = 900.0
RANK_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                  "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE")


# What every test's ranks import, imported once in the fork server the ranks are forked from
# (torch._dynamo: FSDP's fully_shard and a trainer model's first initialisation import it, ~1 s of
# CPU a rank), then the heap frozen (tests.support.frozen_heap: a rank's full collections leave it alone).
RANK_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.tensor",
                "torch.distributed.fsdp", "torch._dynamo", "ckpt", "trainer.train", "tests.support.frozen_heap"]


def free_port() -> int:
    """A port on 127.0.0.1 free right now, below the kernel's ephemeral range: the ports it hands
    every outgoing connection (a test beside this one on another xdist worker: an S3 client, gloo)
    come from that range, so a port taken from it could be given to one of those before a rendezvous
    binds it (seen: an agent's c10d store found its port held and connected to a stranger). Another
    process could still bind the same port on purpose; a random pick over ~12,000 makes that rare."""
    low = _ephemeral_low()
    for _ in range(64):
        port = _PORTS.randrange(max(1024, low - 12_000), low)
        with socket.socket() as s:
            try:
                s.bind((HOST, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # a box with the low ports all held: the kernel's choice
        s.bind((HOST, 0))
        return s.getsockname()[1]


_PORTS = random.Random()  # its own generator: a test's random.seed() must not make two workers pick alike


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def loopback_interface() -> str:
    """The name of the loopback interface (``lo`` on Linux), for GLOO_SOCKET_IFNAME."""
    for _, name in socket.if_nameindex():
        try:
            flags = int(Path(f"/sys/class/net/{name}/flags").read_text(), 16)
        except (OSError, ValueError):
            continue
        if flags & 0x8:  # IFF_LOOPBACK
            return name
    return "lo"


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """What ``init_process_group`` reads through ``env://`` for ``rank`` of a job on this machine."""
    return {"MASTER_ADDR": HOST, "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank)}


def _entry(rank: int, world_size: int, port: int, out_dir: str, fn, args, env: dict, cwd: str) -> None:
    os.environ.clear()  # forked from the fork server: this test's environment and folder, not its
    os.environ.update(env, **rank_env(rank, world_size, port))
    os.chdir(cwd)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        Path(out_dir, f"rank-{rank}.pkl").write_bytes(pickle.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # The result is written and every rank is past the barrier: leave without the interpreter's
    # finalization, where torch 2.13's C++ teardown after a DeviceMesh sometimes aborts ("terminate
    # called without an active exception", SIGABRT; 4 of 12 runs of a script that only builds a CPU
    # mesh and destroys the process group) and would fail a rank that did all its work.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(world_size: int, fn, *args, hang_seconds: float = RANKS_HANG_SECONDS) -> list:
    """``fn(rank, world_size, *args)`` on every rank (fn must be importable at module level), each a
    fresh process forked from the fork server (:data:`RANK_PRELOAD` imported once there, not ~3 s per
    rank; the rank gets this process's environment and working folder) with one intra-op thread and a
    gloo process group; their results in rank
    order. Ranks still running after ``hang_seconds`` are killed and AssertionError raised: ranks
    that disagree on a collective wait 30 minutes for gloo's timeout otherwise."""
    import time

    import torch.multiprocessing as mp

    start_forkserver(RANK_PRELOAD, [str(REPO)])
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(_entry, args=(world_size, free_port(), out_dir, fn, args, dict(os.environ),
                                                   os.getcwd()),
                                     nprocs=world_size, start_method="forkserver", join=False)
        deadline = time.monotonic() + hang_seconds
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise AssertionError(f"{world_size} ranks of {fn.__name__} still ran after {hang_seconds:.0f} s: "
                                     f"they hang (a collective one rank never joined?)")
        return [pickle.loads(Path(out_dir, f"rank-{r}.pkl").read_bytes()) for r in range(world_size)]


def job_env(**extra: str) -> dict[str, str]:
    """This process's environment for a torchrun agent of this checkout, plus ``extra``."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("TORCHELASTIC_", "TORCH_ELASTIC_")) and key not in RANK_VARIABLES}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=loopback_interface(), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])), **extra)
    return env


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def start_forkserver(preload: list[str], paths: list[str]):
    """Start multiprocessing's fork server (once per process) with the modules ``preload`` imported,
    ``paths`` first on its ``PYTHONPATH``; returns the ``forkserver`` context. Python 3.11's fork server
    ignores the parent's ``sys.path``, and a preload that fails to import is skipped silently, so
    without ``paths`` it would import a pip-installed (editable) checkout's modules, or none."""
    import multiprocessing
    import multiprocessing.forkserver

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(preload)
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, *([before] if before else [])])
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before
    return context


def barrier() -> None:
    """Every rank of a :func:`run_ranks` job here (its default gloo group)."""
    import torch.distributed as dist

    dist.barrier()


def by_rank0(rank: int, action) -> None:
    """``action`` on rank 0 only, between two barriers (no rank starts while it runs)."""
    barrier()
    if rank == 0:
        action()
    barrier()
