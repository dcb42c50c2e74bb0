"""The multi-process part of ``bench_save_load.py``: resharded load against same-layout load.

A state of a few large fp32 matrices is saved once by each system in five source layouts, then
loaded into the layouts below (``reshard_layouts.py``); each resharded load is compared with the same-layout load of the
layout it loads into — the same ranks loading a checkpoint saved in their own layout, so that the
ratio is the cost of resharding alone, not of another world size on the same cores:

    2 ranks Shard(0) (same)    saved 2 ranks Shard(0) (DTensors on a 1-D mesh), loaded the same way
    4 ranks Shard(0) (same)    saved 4 ranks Shard(0), loaded the same way
    2 → 4 ranks Shard(0)       from 2 ranks Shard(0): each rank needs half of one saved shard
                               (reference: 4 ranks Shard(0) (same))
    2 ranks Shard(1)           from 2 ranks Shard(0): each rank needs half the columns of both shards
                               (reference: 2 ranks Shard(0) (same): a Shard(1) save loaded as
                               Shard(1) reads each rank's own file whole, the same work)
    FSDP×TP 4 → FSDP 2         saved on a 2×2 mesh (Shard(0) over dp, Shard(1) over tp), loaded as
                               2 ranks Shard(0) (reference: 2 ranks Shard(0) (same))
    1 rank (same)              saved by one process (plain tensors), loaded by one process
    PP 2 → 1                   saved by 2 pipeline stages (each rank holds whole tensors of its own
                               half of the keys), loaded by one process (reference: 1 rank (same))

Systems: ours (``ckpt.save`` / ``ckpt.load`` with the process group) and DCP
(``dcp.save(storage_writer=FileSystemWriter(dir, sync_files=True))`` / ``dcp.load(storage_reader=
FileSystemReader(dir))``), both in place into the live DTensors.

One set of 4 processes is started by the tests' ``run_ranks`` (forked from a fork server: one fresh
process imports torch, ckpt and this module, see ``start_forkserver``; gloo on 127.0.0.1,
``torch.set_num_threads(1)`` in each) and runs everything, so process start-up is paid once. Every repeat times, for each system, each resharded layout right next to a
load of its reference layout (``units``: the reference of two resharded layouts is loaded once for
each), which of the two goes first alternating per repeat, the units and the systems in an order
rotated per repeat: a resharded load's ratio is to the reference load of the same system a second
before, not one up to a dozen loads away (the benchmark box's virtual disk swings 0.4-3 GiB/s over
seconds, with slow spells of 10 s and more). The 2-rank layouts run on ranks 0-1 (a subgroup and
its mesh) while ranks 2-3 wait in the collective that gathers the times (a blocking gloo receive; their CPU time over those loads is
reported). On the 2-vCPU box the 4-rank layout is oversubscribed 2x.

What is timed, per load: every rank of the world meets in a barrier, rank 0 runs ``sync`` and (when
permitted) drops the page cache, a second barrier, then each loading rank times its own
``load`` call (``time.perf_counter``); the load time is the maximum over the loading ranks. Zeroing
the destination before and the bitwise check of every local shard against the same slice of the
full tensor after are outside the timing. Each rank also reads ``/proc/self/io`` around its load:
``rchar`` (bytes its read syscalls returned, page cache hits included: what it read) and
``read_bytes`` (bytes it made the kernel fetch from the disk), summed over the loading ranks.
"""

from __future__ import annotations

import gc
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from harness import REPO, drop_caches, rotated  # first: puts this checkout's root on sys.path

import ckpt  # noqa: E402
import peers  # noqa: E402
from reshard_layouts import (  # noqa: E402
    LAYOUTS, SAVED, SOURCE_DIRS, SOURCES, WORLD, Layout, Rank, chosen, sharded_state, source_dir, units, verify,
)
from states import reshard_source, state_bytes  # noqa: E402
from tests.support import launch  # noqa: E402

SYSTEMS = ("ours", "DCP")
COLS = 4096
RANKS_HANG_SECONDS = 3 * 3600  # a guard against hung ranks, far above a full run


SAVE = {"ours": ckpt.save, "DCP": peers.dcp_save}
LOAD = {"ours": ckpt.load, "DCP": peers.dcp_load}


def through(call, state: dict | None, path: Path, group, layout: Layout = SAVED) -> None:
    """``call`` (a system's save or load) of ``state`` at ``path`` by the ranks of ``layout``: over
    ``group``, or without a process group for one process."""
    single = layout.ranks == 1
    call(state, path, process_group=None if single else group, no_dist=single)


def io_counters() -> tuple[int, int]:
    """This process's (``rchar``, ``read_bytes``) from ``/proc/self/io`` so far: bytes returned by
    read syscalls (page cache hits included), and bytes it made the kernel fetch from storage; -1s
    where the kernel does not say."""
    fields = {}
    try:
        with open("/proc/self/io") as f:
            for line in f:
                key, value = line.split(":")
                fields[key] = int(value)
    except (OSError, ValueError):
        pass
    return fields.get("rchar", -1), fields.get("read_bytes", -1)


def collective_timed(me: Rank, member: bool, fn, cold: bool) -> tuple[float, tuple[int, int], float]:
    """(max wall seconds over the ranks that run ``fn``, the (syscall, disk) bytes they read in total,
    CPU seconds the other ranks spent meanwhile), after a cache drop between two world barriers."""
    gc.collect()
    dist.barrier()
    if me.rank == 0:
        drop_caches(cold)
    dist.barrier()
    cpu0, io0 = time.process_time(), io_counters()
    seconds = None
    if member:
        start = time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
    io1 = io_counters()
    read = tuple(b - a if a >= 0 and b >= 0 else -1 for a, b in zip(io0, io1))
    row = (seconds, read, time.process_time() - cpu0)
    rows: list = [None] * WORLD
    dist.all_gather_object(rows, row)
    loaders = [r for r in rows if r[0] is not None]
    idle_cpu = max((r[2] for r in rows if r[0] is None), default=0.0)
    read = tuple(-1 if any(r[1][i] < 0 for r in loaders) else sum(r[1][i] for r in loaders) for i in range(2))
    return max(r[0] for r in loaders), read, idle_cpu


def save_sources(me: Rank, full: dict, work: Path, system: str, timed: bool, cold: bool,
                 layouts: tuple[Layout, ...] = LAYOUTS) -> float | None:
    """Save ``full`` once in every source layout ``layouts`` load; the seconds of the 2-rank
    Shard(0) save when ``timed``."""
    seconds = None
    sources = {layout.source for layout in layouts} | {SAVED.name}
    for layout in (s for s in SOURCES if s.name in sources):
        saved = sharded_state(full, layout, me, fill=True) if me.member(layout) else None
        path = work / system / SOURCE_DIRS[layout.name]
        fn = lambda: through(SAVE[system], saved, path, me.group(layout), layout)  # noqa: E731
        if timed and layout is SAVED:
            seconds, _, _ = collective_timed(me, me.member(layout), fn, cold)
        else:
            if me.member(layout):
                fn()
            dist.barrier()
        saved = None
    return seconds


def warm_up(me: Rank, work: Path, layouts: tuple[Layout, ...]) -> None:
    """Untimed: a tiny sharded state through every system and layout (first-call costs, imports)."""
    tiny = {f"w{i}": torch.arange(8 * 16, dtype=torch.float32).reshape(8, 16) + i for i in range(4)}
    for system in SYSTEMS:
        save_sources(me, tiny, work / "warmup", system, False, False, layouts)
        for layout in layouts:
            if me.member(layout):
                state = sharded_state(tiny, layout, me, fill=False)
                through(LOAD[system], state, source_dir(work / "warmup", system, layout), me.group(layout), layout)
                verify(state, tiny, layout, me.rank, f"warm-up {system} {layout.name}")
            dist.barrier()


def rank_main(rank: int, world: int, full: dict, work: str, repeats: int, cold: bool, check: bool,
              only: tuple[str, ...] | None = None) -> dict | None:
    """Everything one rank does (``run_ranks``' function, on :data:`WORLD` ranks); rank 0 returns the
    measurements."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    me = Rank(rank)
    layouts = chosen(only)
    work = Path(work)
    out: dict = {"save_s": {}, "load_s": {}, "paired_s": {}, "read": {}, "idle_cpu_s": [],
                 "clock": {"ready": time.time()}}
    warm_up(me, work, layouts)
    out["clock"]["warm"] = time.time()

    for system in SYSTEMS:
        out["save_s"][system] = save_sources(me, full, work, system, True, cold, layouts)
    out["clock"]["saved"] = time.time()

    shared: dict = {}  # layouts of the same shape share their live state (a 1-process layout holds it all)
    live = {}
    for layout in layouts:
        if me.member(layout):
            shape = (layout.ranks, layout.dim, layout.kind)
            if shape not in shared:
                shared[shape] = sharded_state(full, layout, me, fill=False)
            live[layout] = shared[shape]
    for rep in range(repeats):
        for unit in rotated(units(layouts), rep):
            for system in rotated(SYSTEMS, rep):
                seconds_of = {}
                for layout in (unit if rep % 2 == 0 else unit[::-1]):  # which of a pair goes first alternates
                    state = live.get(layout)
                    if state is not None:
                        for t in state.values():  # outside the timing: prove the load really writes
                            (t.to_local() if isinstance(t, DTensor) else t).zero_()
                    seconds, read, idle_cpu = collective_timed(
                        me, state is not None,
                        lambda: through(LOAD[system], state, source_dir(work, system, layout), me.group(layout), layout),
                        cold)
                    if state is not None and check:
                        verify(state, full, layout, rank, f"{system} {layout.name}")
                    seconds_of[layout.name] = seconds
                    out["load_s"].setdefault((system, layout.name), []).append(seconds)
                    out["read"].setdefault((system, layout.name), []).append(read)
                    if layout.ranks < WORLD:
                        out["idle_cpu_s"].append(idle_cpu)
                    if rank == 0:
                        print(f"[reshard {rep + 1}/{repeats}] {system:5s} {layout.name:24s} load {seconds:7.3f}s",
                              flush=True)
                if len(unit) == 2:
                    reference, resharded = unit
                    out["paired_s"].setdefault((system, resharded.name), []).append(
                        (seconds_of[resharded.name], seconds_of[reference.name]))
    out["clock"]["loaded"] = time.time()
    return out if rank == 0 else None


# ---------------------------------------------------------------------------------------------
# In the benchmark's process
# ---------------------------------------------------------------------------------------------
def _noop() -> None:
    pass


def start_forkserver() -> None:
    """Start the process the ranks will be forked from: it imports torch, ckpt and this module once
    (instead of each of the 4 ranks importing them on the 2 cores) and has no threads, so forking
    from it is safe. Starting it early, while the libraries are still in the page cache, keeps the
    benchmark's cache drops from making it read them back from the disk."""
    launch.start_forkserver(["__main__", __name__], [str(REPO), str(Path(__file__).resolve().parent)])


def wait_forkserver() -> None:
    """Block until the forkserver has finished its imports (a no-op child forked from it), so that
    they do not compete with timed work."""
    child = mp.get_context("forkserver").Process(target=_noop)
    child.start()
    child.join()


def run(gib: float, repeats: int, work: Path, cold: bool, check: bool = True,
        only: tuple[str, ...] | None = None) -> dict:
    """Start the 4 ranks, run the whole part (the layouts named in ``only`` and their references,
    when given), return rank 0's measurements plus the state's bytes, shapes and the wall time of
    the part (start-up included)."""
    start = time.perf_counter()
    full = reshard_source(gib, cols=COLS)
    started = time.time()
    start_forkserver()  # no-op if the benchmark started it already
    result = launch.run_ranks(WORLD, rank_main, full, str(work), repeats, cold, check, only,
                              hang_seconds=RANKS_HANG_SECONDS)[0]
    result["nbytes"] = state_bytes(full)
    result["shapes"] = [tuple(t.shape) for t in full.values()]
    result["wall_s"] = time.perf_counter() - start
    clock = result.pop("clock")
    result["phases_s"] = {"start-up (fork, gloo)": clock["ready"] - started,
                          "warm-up": clock["warm"] - clock["ready"], "saves": clock["saved"] - clock["warm"],
                          "loads": clock["loaded"] - clock["saved"]}
    return result
