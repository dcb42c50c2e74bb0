"""One point of a scaling curve: one system, one state size, one or N ranks, measured in fresh processes.

:func:`run_point` forks one process per rank (after the imports: a fresh heap per point without
re-importing torch; N ranks on gloo over loopback), each running :func:`measure`: a drained warm-up
save, then ``saves`` timed steps of save -> compute (a sleep until the save is durable, at least
``MIN_STEP_S``) -> wait before the update -> update, then the checks outside the timing (the last
save loaded back whole; the snapshot contract, :func:`contract_check`). :func:`summarize` folds the
ranks' results into a :class:`Point`: per save the max over ranks.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from harness import median, remove  # first: puts this checkout's root on sys.path

from probes import peak_rss, rss  # noqa: E402
from scaling_systems import SYSTEMS, Ctx, System, equal_after_update, first_layer, update  # noqa: E402
from states import model_like_state, state_bytes  # noqa: E402
from tests.support.launch import free_port, loopback_interface  # noqa: E402  (shared with the tests)

MIN_STEP_S = 0.1
WARMUPS = 1  # untimed, drained saves before the timed ones (first-call costs: buffers, thread pools, caches)
DURABLE_TIMEOUT_S = 600
WORKER_TIMEOUT_S = 900


def sync(ctx: Ctx) -> None:
    """Line the ranks up before a save, as the step's gradient all-reduce does in a real job."""
    if ctx.distributed:
        dist.barrier()


def until_durable(system: System, step: int) -> float:
    """Sleep until ``step`` is durable (where this rank is told); returns the seconds slept."""
    if not system.tells_durable:
        return 0.0
    start = time.perf_counter()
    while step not in system.durable_at:
        if time.perf_counter() - start > DURABLE_TIMEOUT_S:
            raise TimeoutError(f"save of step {step} not durable after {DURABLE_TIMEOUT_S} s")
        time.sleep(0.002)
    return time.perf_counter() - start


def contract_check(system: System, state: dict, step: int, ctx: Ctx) -> bool:
    """One more save, untimed, of layer 0 only (1/8 of the state, same tensor sizes), with the update
    right where the system allows it: after the call and ``before_step()``, no compute in between.
    Whether the save holds the state at the call (the timed loop's compute, lasting until the save is
    durable, would hide a system that writes from the live tensors)."""
    part = first_layer(state)
    system.state = part
    try:
        sync(ctx)
        system.save(step)
        system.before_step()
        update(part)
        system.drain()
        return equal_after_update(system.load(step, part), part)
    finally:
        system.state = state


def measure(key: str, nbytes: int, saves: int, verify: bool, work: Path, ctx: Ctx) -> dict:
    """A warm-up save (drained), then ``saves`` timed steps of save -> compute -> wait -> update."""
    rss0 = rss()
    state = model_like_state(nbytes, ctx.rank, ctx.world)
    system = SYSTEMS[key](state, work, ctx)
    out: dict[str, Any] = {"rank": ctx.rank, "state_bytes": state_bytes(state), "records": []}
    system.setup()
    try:
        out["warmup"] = []
        for step in range(1, WARMUPS + 1):
            sync(ctx)
            t0 = time.perf_counter()
            system.save(step)
            t1 = time.perf_counter()
            system.drain()
            t2 = time.perf_counter()
            update(state)
            out["warmup"].append({"in_save": t1 - t0, "after_return": t2 - t1})
        out["compute"] = []
        starts = {}
        timed = range(WARMUPS + 1, WARMUPS + saves + 1)
        for step in timed:
            system.prune(step - 1)
            sync(ctx)
            start = starts[step] = time.perf_counter()
            counted = system.save(step)
            in_save = time.perf_counter() - start if counted is None else counted
            parts = dict(system.parts)
            c0 = time.perf_counter()  # the accelerator computes, the host is free: until the save is durable
            time.sleep(MIN_STEP_S)
            until_durable(system, step)
            out["compute"].append(time.perf_counter() - c0)
            w0 = time.perf_counter()
            system.before_step()
            wait = time.perf_counter() - w0
            update(state)
            out["records"].append({"in_save": in_save, "wait": wait, "stall": in_save + wait, "parts": parts})
        t = time.perf_counter()
        system.drain()
        out["drain_s"] = time.perf_counter() - t
        out["host_bytes"] = system.host_bytes()  # before the checks, which stage other layouts
        for step, rec in zip(timed, out["records"]):
            done = system.durable_at.get(step)
            rec["durable"] = None if done is None else done - starts[step]
        if system.writes:
            if verify:  # the whole state, as the last timed save holds it
                out["verified"] = equal_after_update(system.load(timed[-1], state), state)
            out["consistent"] = contract_check(system, state, timed[-1] + 1, ctx)
    finally:
        system.close()
    out["peak_rss_growth"] = peak_rss() - rss0
    return out


def _worker(results, key: str, nbytes: int, saves: int, verify: bool, work: str, rank: int, world: int,
            port: int | None) -> None:
    ctx = Ctx(rank, world, port is not None)
    try:
        if ctx.distributed:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
            os.environ["GLOO_SOCKET_IFNAME"] = loopback_interface()
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                    timeout=timedelta(seconds=WORKER_TIMEOUT_S))
        out = measure(key, nbytes, saves, verify, Path(work), ctx)
        if ctx.distributed:
            dist.barrier()
            dist.destroy_process_group()
        results.put(out)
    except BaseException as exc:  # reported in the table; the other ranks are ended by the parent
        results.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})


def run_point(key: str, nbytes: int, saves: int, verify: bool, work: Path, world: int | None) -> list[dict]:
    """``key`` at one point in fresh forked processes: one (``world`` None: no process group) or
    ``world`` ranks on gloo. Returns each rank's result (or error)."""
    ctx = mp.get_context("fork")  # after the imports: a fresh heap per point without re-importing torch
    results = ctx.Queue()
    port = free_port() if world is not None else None
    procs = [ctx.Process(target=_worker, args=(results, key, nbytes, saves, verify, str(work), r, world or 1, port))
             for r in range(world or 1)]
    for p in procs:
        p.start()
    got: list[dict] = []
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    error_seen = None
    while len(got) < len(procs):
        try:
            got.append(results.get(timeout=1.0))
            if "error" in got[-1] and error_seen is None:
                error_seen = time.monotonic()
        except queue.Empty:
            pass
        dead = [p for p in procs if p.exitcode not in (None, 0)]
        late = error_seen is not None and time.monotonic() - error_seen > 20  # the others wait in collectives
        if time.monotonic() > deadline or late or (dead and results.empty() and len(got) < len(procs)):
            for p in procs:
                if p.is_alive():
                    p.kill()
            reason = "timed out" if time.monotonic() > deadline else "another rank failed" if late else "exited"
            seen = {g["rank"] for g in got}
            got += [{"rank": r, "error": reason} for r in range(len(procs)) if r not in seen]
            break
    for p in procs:
        p.join()
    remove(work / key)
    return sorted(got, key=lambda g: g["rank"])


@dataclass
class Point:
    key: str
    x: int  # state bytes (size axis) or ranks
    state_bytes: int = 0
    stalls: list[float] = field(default_factory=list)  # per save (max over ranks)
    durables: list[float] = field(default_factory=list)  # per save (max over ranks, where known)
    parts: dict[str, list[float]] = field(default_factory=dict)  # named parts of the stall, per save (max over ranks)
    compute: list[float] = field(default_factory=list)  # per save: the emulated compute (max over ranks)
    verified: bool | None = None  # the last timed save, loaded back whole, equals the state at save time
    consistent: bool | None = None  # the contract check (see contract_check), on every rank
    peak_rss_growth: int = 0
    host_buffer_bytes: int | None = None
    error: str | None = None


def summarize(key: str, x: int, ranks: list[dict]) -> Point:
    point = Point(key, x)
    errors = [r for r in ranks if "error" in r]
    if errors:
        point.error = errors[0]["error"]
        if errors[0].get("traceback"):
            print(errors[0]["traceback"], file=sys.stderr, flush=True)
        return point
    point.state_bytes = sum(r["state_bytes"] for r in ranks)
    per_save = list(zip(*[r["records"] for r in ranks]))
    point.stalls = [max(rec["stall"] for rec in recs) for recs in per_save]
    point.parts["in save"] = [max(rec["in_save"] for rec in recs) for recs in per_save]
    point.parts["wait before update"] = [max(rec["wait"] for rec in recs) for recs in per_save]
    for recs in per_save:
        known = [rec["durable"] for rec in recs if rec["durable"] is not None]
        if known:
            point.durables.append(max(known))
        for name in recs[0]["parts"]:
            if all(name in rec["parts"] for rec in recs):
                point.parts.setdefault(name, []).append(max(rec["parts"][name] for rec in recs))
    point.compute = [max(c) for c in zip(*[r["compute"] for r in ranks])]
    checks = [r["verified"] for r in ranks if "verified" in r]
    point.verified = all(checks) if checks else None
    contracts = [r["consistent"] for r in ranks if "consistent" in r]
    point.consistent = all(contracts) if contracts else None
    point.peak_rss_growth = max(r["peak_rss_growth"] for r in ranks)
    buffers = [r["host_bytes"] for r in ranks if r.get("host_bytes") is not None]
    point.host_buffer_bytes = sum(buffers) if buffers else None
    return point


def print_point(p: Point, what: str, wall: float) -> None:
    if p.error:
        print(f"{what:>12s} {SYSTEMS[p.key].label:34s} FAILED: {p.error}", flush=True)
        return
    durable = f" durable {median(p.durables):.3f}s" if p.durables else ""
    check = "" if p.verified is None else f" verified {'OK' if p.verified else 'MISMATCH'}"
    check += "" if p.consistent is None else f" contract {'OK' if p.consistent else 'INCONSISTENT'}"
    print(f"{what:>12s} {SYSTEMS[p.key].label:34s} stall median {median(p.stalls) * 1e3:9.1f} ms ["
          + " ".join(f"{s * 1e3:.1f}" for s in p.stalls) + f"] compute {median(p.compute):.2f}s{durable}{check} "
          f"({wall:.1f}s, load {os.getloadavg()[0]:.1f})", flush=True)
