"""Shared reads travel in host memory and release every peer (issue 39, item 8).

A chunk several ranks need whole is read by one of them and sent to the others
(:mod:`ckpt.read.exchange`). These tests hold it to its contract on real gloo ranks
(tests/support/launch.py):

* a load group without a host side — a stand-in for NCCL: a backend named like it, registered for
  ``cuda`` only, which refuses CPU tensors — never carries a message of the exchange: the exchange
  runs on one gloo group over the same ranks, made at the first load and reused by the next, also for
  a group of some ranks only (made by those ranks alone); a mixed group's ``cpu:gloo`` side carries
  the exchange itself (no group is made). Every point-to-point call is recorded with its group.
* a failure on one rank — a read that raises a MemoryError, a receive buffer that cannot be
  allocated, a source that cannot be opened before the walk — raises a CheckpointError naming it on
  every rank, leaves every live tensor as it was, and leaves the ranks in step: the next load on the
  same group loads. A hang is bounded by the launcher's guard.
* every load that succeeds is bitwise what each rank reads for itself (``no_dist=True``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import ckpt
from ckpt.read import SafeLoadPlanner
from tests.support.launch import run_ranks

pytestmark = pytest.mark.slow  # gloo ranks

HANG_SECONDS = 300.0  # a guard against ranks left waiting, far above the seconds these ranks take
STAND_IN = "standin_nccl"  # "nccl" in its name, as the exchange's old device path looked for


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    # every rank loads every tensor whole: each chunk is read by one rank and sent to the others;
    # w is a non-contiguous view, received through a buffer; b and c travel in one batch
    w = torch.randn(1024, 512, generator=g).t()
    return {"w": w, "v": torch.randn(384, 1024, generator=g), "u": torch.randn(300, 1024, generator=g),
            "b": torch.randn(32, generator=g), "c": torch.randn(64, generator=g), "step": seed}


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k].contiguous().view(torch.uint8), b[k].contiguous().view(torch.uint8))
               if isinstance(b[k], torch.Tensor) else a[k] == b[k] for k in b)


def _snapshot(state: dict) -> dict:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}


def _direct(path: str) -> dict:
    state = _state(9)
    ckpt.load(state, path, no_dist=True)
    return state


def _record_p2p(labels: dict) -> tuple[list, list]:
    """Record the group of every point-to-point call (by label) and every group made."""
    calls, made = [], []
    for name in ("isend", "irecv", "send", "recv"):
        real = getattr(dist, name)

        def recorded(*args, _real=real, **kwargs):
            calls.append(labels.get(id(kwargs.get("group")), "other"))
            return _real(*args, **kwargs)

        setattr(dist, name, recorded)
    real_new_group = dist.new_group

    def new_group(*args, **kwargs):
        made.append(kwargs.get("backend"))
        return real_new_group(*args, **kwargs)

    dist.new_group = new_group
    return calls, made


def _load_on(state: dict, path: str, group, dcp_group) -> ckpt.LoadStats:
    """A load whose exchange runs on ``group`` and whose DCP collectives on ``dcp_group``."""
    reader = ckpt.dcp.Reader(path, process_group=group)
    dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), process_group=dcp_group)
    return reader.stats


def _transports(rank: int, world: int, path: str):
    dist.Backend.register_backend(STAND_IN, lambda store, r, n, timeout: dist.ProcessGroupGloo(store, r, n, timeout),
                                  devices=["cuda"])
    standin = dist.new_group(backend=STAND_IN)
    pair_standin = dist.new_group(ranks=[0, 1], backend=STAND_IN)
    pair_gloo = dist.new_group(ranks=[0, 1], backend="gloo")
    mixed = dist.new_group(backend=f"cpu:gloo,cuda:{STAND_IN}")
    ckpt.save(_state(0), path)
    dist.barrier()
    expected = _direct(path)
    labels = {id(standin): "standin", id(pair_standin): "standin", id(mixed): "mixed",
              id(dist.group.WORLD): "world", id(pair_gloo): "world"}
    calls, made = _record_p2p(labels)
    seen = {}
    for load in range(2):  # the second load reuses the gloo group the first one made
        state = _state(1)
        stats = _load_on(state, path, standin, None)
        seen[f"standin {load}"] = (sorted(set(calls)), list(made), _same(state, expected), stats.bytes_received)
        calls.clear()
    made.clear()
    if rank in (0, 1):  # a group of some ranks: its gloo twin is made by those ranks alone
        state = _state(1)
        stats = _load_on(state, path, pair_standin, pair_gloo)
        seen["pair"] = (sorted(set(calls)), list(made), _same(state, expected), stats.bytes_received)
        calls.clear()
        made.clear()
    dist.barrier()
    state = _state(1)
    stats = ckpt.LoadStats()
    ckpt.load(state, path, process_group=mixed, stats=stats)
    seen["mixed"] = (sorted(set(calls)), list(made), _same(state, expected), stats.bytes_received)
    return seen


def test_the_exchange_runs_on_a_gloo_group_made_once_or_on_the_groups_own_cpu_side(tmp_path):
    results = run_ranks(3, _transports, str(tmp_path / "ckpt"), hang_seconds=HANG_SECONDS)
    for rank, seen in enumerate(results):
        calls, made, same, _ = seen["standin 0"]
        assert "standin" not in calls and calls == ["other"], seen  # on a group the load did not get
        assert made == ["gloo"] and same, seen
        calls, made, same, _ = seen["standin 1"]
        assert calls == ["other"] and made == ["gloo"] and same, seen  # no second group made
        calls, made, same, _ = seen["mixed"]
        assert calls == ["mixed"] and made == [] and same, seen  # the group's own cpu:gloo side
        if rank < 2:
            calls, made, same, _ = seen["pair"]
            assert calls == ["other"] and made == ["gloo"] and same, seen
        else:
            assert "pair" not in seen
    for key in ("standin 0", "standin 1", "mixed"):  # chunks really travelled between the ranks
        assert sum(seen[key][3] for seen in results) > 0
    assert sum(results[r]["pair"][3] for r in (0, 1)) > 0


# -- failures ----------------------------------------------------------------------------------------
def _inject(kind: str):
    """Make this rank fail as ``kind`` says; return what undoes it."""
    from ckpt.read import ChunkSource, exchange, storage_reader

    if kind == "read":
        owner, name = ChunkSource, "read_tensors"
    elif kind == "buffer":
        owner, name = exchange.Exchange, "buffer"
    else:
        owner, name = storage_reader, "ChunkSource"
    real = getattr(owner, name)

    def failing(*args, **kwargs):
        raise (OSError if kind == "open" else MemoryError)(f"injected {kind} failure")

    setattr(owner, name, failing)
    return lambda: setattr(owner, name, real)


FAILURES = {"read": 1, "buffer": 2, "open": 0}  # what fails, on which rank


def _failures(rank: int, world: int, path: str):
    ckpt.save(_state(0), path)
    dist.barrier()
    expected = _direct(path)
    outcomes = {}
    for kind, failing_rank in FAILURES.items():
        undo = _inject(kind) if rank == failing_rank else (lambda: None)
        live = _state(1)
        before = _snapshot(live)
        try:
            ckpt.load(live, path)
            outcomes[kind] = ("loaded", "", None)
        except ckpt.CheckpointError as exc:
            outcomes[kind] = (type(exc).__name__, str(exc), _same(live, before))
        except Exception as exc:
            outcomes[kind] = (type(exc).__name__, str(exc), _same(live, before))
        finally:
            undo()
    live = _state(1)
    ckpt.load(live, path)  # the ranks are still in step on the same group
    outcomes["after"] = _same(live, expected)
    return outcomes


def test_a_failure_on_one_rank_raises_a_checkpoint_error_on_every_rank_and_releases_its_peers(tmp_path):
    results = run_ranks(3, _failures, str(tmp_path / "ckpt"), hang_seconds=HANG_SECONDS)
    for outcomes in results:
        for kind, failing_rank in FAILURES.items():
            name, message, untouched = outcomes[kind]
            assert name in ("CheckpointError", "StorageError"), outcomes
            assert f"injected {kind} failure" in message and f"rank {failing_rank}" in message, outcomes
            assert untouched, outcomes
        assert outcomes["after"], outcomes
