"""Multi-rank loads that fail: every rank refuses, every rank's live state is left as it was.

* a damaged block found by a scatter read (a resharded load writing straight into the live tensor);
* a damaged chunk that several ranks need whole (read by one, sent to the others), or its data
  file cut inside its block tables;
* bytes damaged between the reader and a receiver (a flipped byte put into what the reader's send
  hands to gloo, at :meth:`ckpt.read.exchange.Exchange.send`): the receiver's hash of what it got
  must refuse them, and every rank fails with that error;
* a peer whose process is SIGKILLed in the middle of the exchange: the survivor fails with a
  :class:`~ckpt.errors.PeerLostError` naming the dead rank, not gloo's RuntimeError.

Real gloo ranks on loopback (tests/support/launch.py); the peer-death test starts its own two
processes so that one of them may die.
"""

from __future__ import annotations

import os
import pickle
import signal
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import ckpt
from tests.support import REPO
from tests.support.launch import RANK_PRELOAD, free_port, rank_env, run_ranks, start_forkserver

pytestmark = pytest.mark.slow  # gloo ranks


def _replicated(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    # w (2 MiB) is read by rank 0 and v (1.5 MiB) by rank 1, each sent to the other; the small ones
    # travel in one batch (ckpt.read.assignment)
    return {"w": torch.randn(512, 1024, generator=g), "v": torch.randn(384, 1024, generator=g),
            "b": torch.randn(32, generator=g), "step": seed}


def _snapshot(state: dict) -> dict:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}


def _untouched(live: dict, before: dict) -> bool:
    return all(torch.equal(live[k].contiguous().view(torch.uint8), v.contiguous().view(torch.uint8))
               if isinstance(v, torch.Tensor) else live[k] == v for k, v in before.items())


def _flip_on_disk(path: str, blob, at: int) -> None:
    with open(f"{path}/{blob.file}", "r+b") as f:
        f.seek(blob.offset + at)
        byte = f.read(1)
        f.seek(blob.offset + at)
        f.write(bytes([byte[0] ^ 0x01]))


def _load(live: dict, path: str):
    before = _snapshot(live)
    try:
        ckpt.load(live, path)
    except ckpt.CheckpointError as exc:
        return type(exc).__name__, str(exc), _untouched(live, before)
    return "loaded", None, _untouched(live, before)


# -- a scatter read of a resharded load ------------------------------------------------------------
WIDE = 65536  # fp32: 256 KiB rows; Shard(1) over 2 ranks wants 128 KiB runs of every row: scattered


def _resharded(rank: int, world: int, path: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ckpt.read import prefetch

    def staged(*args, **kwargs):
        raise AssertionError("window staged: this test is about scatter reads")

    mesh = init_device_mesh("cpu", (world,))
    full = torch.randn(32, WIDE, generator=torch.Generator().manual_seed(1))  # 8 MiB: 4 blocks a chunk
    shared = torch.randn(600, 1024, generator=torch.Generator().manual_seed(2))  # every rank reads it whole
    ckpt.save({"w": distribute_tensor(full, mesh, [Shard(0)]), "r": shared}, path)
    torch.distributed.barrier()
    if rank == 0:
        chunk = ckpt.read_manifest(path).tensors["w"].chunks[1]  # rank 1's, last in its file
        _flip_on_disk(path, chunk.blob, 3 * chunk.blob.block_size + 99)
    torch.distributed.barrier()
    prefetch._Window = staged
    live = {"w": distribute_tensor(torch.full((32, WIDE), -1.0), mesh, [Shard(1)]), "r": torch.zeros(600, 1024)}
    before = {"w": live["w"].to_local().clone(), "r": live["r"].clone()}
    try:
        ckpt.load(live, path)
    except ckpt.CheckpointError as exc:
        now = {"w": live["w"].to_local(), "r": live["r"]}
        return type(exc).__name__, str(exc), _untouched(now, before)
    return "loaded", None, None


def test_a_damaged_block_of_a_scatter_read_fails_every_rank_and_leaves_its_state(tmp_path):
    results = run_ranks(2, _resharded, str(tmp_path / "ckpt"))
    for name, message, untouched in results:
        assert name == "CorruptCheckpointError" and "block 3 of" in message, results
        assert untouched, results  # neither the damaged rows nor anything loaded before them stayed


# -- chunks shared between ranks -------------------------------------------------------------------
def _shared(rank: int, world: int, path: str, damage: str):
    from ckpt.read import exchange

    ckpt.save(_replicated(0), path)
    torch.distributed.barrier()
    if damage == "on disk" and rank == 0:
        blob = ckpt.read_manifest(path).tensors["v"].chunks[0].blob  # read by rank 1, sent to rank 0
        _flip_on_disk(path, blob, 1000)
    if damage == "cut table" and rank == 0:
        blob = ckpt.read_manifest(path).tensors["w"].chunks[0].blob  # read by rank 0, sent to rank 1
        os.truncate(f"{path}/{blob.file}", blob.block_table + 8)  # every payload whole, w's table cut
    torch.distributed.barrier()
    if damage == "in transit":
        send = exchange.Exchange.send

        def damaging_send(self, receivers, header, raw, what):
            if raw is not None:  # what gloo carries differs from what the reader verified and hashed
                raw = raw.clone()
                raw.view(torch.uint8).reshape(-1)[raw.numel() // 3] ^= 0x20
            return send(self, receivers, header, raw, what)

        exchange.Exchange.send = damaging_send
    return _load(_replicated(7), path)


@pytest.mark.parametrize("damage", ["on disk", "in transit", "cut table"])
def test_a_damaged_shared_chunk_fails_every_rank_and_leaves_its_state(tmp_path, damage):
    results = run_ranks(2, _shared, str(tmp_path / "ckpt"), damage)
    expected = {"on disk": "checksum mismatch", "in transit": "differ from the bytes it read and verified",
                "cut table": "the block table of w"}[damage]
    for name, message, untouched in results:
        assert name == "CorruptCheckpointError" and expected in message, results
        assert untouched, results


# -- a peer killed mid-exchange --------------------------------------------------------------------
def _killed_mid_exchange(rank: int, world: int, path: str):
    from ckpt.read import exchange

    ckpt.save(_replicated(0), path)
    torch.distributed.barrier()
    if rank == 1:
        def die(*args, **kwargs):  # rank 1 got w from rank 0; about to send v, its process is killed
            os.kill(os.getpid(), signal.SIGKILL)

        exchange.Exchange.send = die
    live = _replicated(7)
    before = _snapshot(live)
    try:
        ckpt.load(live, path)
    except ckpt.CheckpointError as exc:
        return type(exc).__name__, getattr(exc, "peer", None), str(exc), _untouched(live, before)
    except Exception as exc:
        return type(exc).__name__, None, str(exc), _untouched(live, before)
    return "loaded", None, None, None


def _entry(rank: int, world: int, port: int, out_dir: str, path: str) -> None:
    import torch.distributed as dist

    os.environ.update(rank_env(rank, world, port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    result = _killed_mid_exchange(rank, world, path)
    Path(out_dir, f"rank-{rank}.pkl").write_bytes(pickle.dumps(result))
    os._exit(0)  # no barrier, no teardown: the other rank is dead


def test_a_peer_killed_mid_exchange_fails_the_load_with_a_checkpoint_error_naming_it(tmp_path):
    context = start_forkserver(RANK_PRELOAD, [str(REPO)])
    port = free_port()
    ranks = [context.Process(target=_entry, args=(rank, 2, port, str(tmp_path), str(tmp_path / "ckpt")))
             for rank in range(2)]
    for process in ranks:
        process.start()
    deadline = time.monotonic() + 600  # a guard against a hang, not a timing
    for process in ranks:
        process.join(max(1.0, deadline - time.monotonic()))
    for process in ranks:
        if process.is_alive():
            process.kill()
    assert ranks[1].exitcode == -signal.SIGKILL
    assert not (tmp_path / "rank-1.pkl").exists()
    name, peer, message, untouched = pickle.loads((tmp_path / "rank-0.pkl").read_bytes())
    assert (name, peer) == ("PeerLostError", 1), message
    assert "rank 1" in message and "stopped answering" in message
    assert untouched  # w, received from nobody, and nothing else of rank 0's state changed
