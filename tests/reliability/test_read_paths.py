"""Every read path detects a flipped byte (issue 22, item 17): "0 silent loads" for every layout, not only
the same-layout one. Each case saves a small checkpoint, flips one byte of one blob, reads through
one path of :mod:`ckpt.read.source`, and expects :class:`CorruptCheckpointError` naming the data file and the
tensor (or value).

The paths: a raw chunk read straight into the live tensor; the indirect raw read (a new tensor, then
copied: a non-contiguous target, a device target, a resharded load on 2 ranks, a Shard(1) merge of a
2-rank save, a dtype conversion — which only the consolidating reader does: ``ckpt.load`` refuses a
live tensor of another dtype); ``DataFiles.read`` (zstd chunks, ``torch.save`` values,
:func:`~ckpt.read.source.verify_blobs`); a delta chain (the delta's own blob, its base's blob, replay); the
consolidating reader (:func:`ckpt.convert.consolidate.full_tensors`, direct and with a dtype).

Each case also names the one check it relies on (:data:`tests.support.read_checks.CHECKS`):
``test_each_case_fails_without_its_check`` removes that check alone and shows the same damage then
goes through undetected, so no case passes by accident of another check.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.errors import CorruptCheckpointError
from ckpt.format import step_name
from tests.support.launch import run_ranks
from tests.support.read_checks import flip_blob, with_check_removed

W, B = "w", "b"


def _state(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {W: torch.randn(16, 8, generator=gen), B: torch.randn(8, generator=gen), "step": seed}


def _save(path: Path, **manager) -> Path:
    if manager:
        root = path.parent
        with ckpt.CheckpointManager(root, interval=1, catalog="", **manager) as m:
            m.save(1, _state(1))
        return root / step_name(1)
    ckpt.save(_state(1), path)
    return path


def _load(path, live: dict) -> None:
    ckpt.load(live, path)


def _live(**changes) -> dict:
    live = {W: torch.zeros(16, 8), B: torch.zeros(8), "step": -1}
    live.update(changes)
    return live


# -- the cases: (build, read) -> (file, what) ------------------------------------------------------
def direct(tmp: Path):
    path = _save(tmp / "c")
    return flip_blob(path, W), W, lambda: _load(path, _live())


def non_contiguous(tmp: Path):
    path = _save(tmp / "c")
    target = torch.zeros(8, 16).t()
    assert not target.is_contiguous()
    return flip_blob(path, W), W, lambda: _load(path, _live(w=target))


def device_target(tmp: Path):
    path = _save(tmp / "c")
    return flip_blob(path, W), W, lambda: _load(path, _live(w=torch.zeros(16, 8, device="cuda")))


def zstd(tmp: Path):
    path = _save(tmp / "run" / "x", compress="zstd")
    assert ckpt.read_manifest(path).tensors[W].chunks[0].blob.codec != "raw"
    return flip_blob(path, W), W, lambda: _load(path, _live())


def torch_save_value(tmp: Path):
    path = tmp / "c"
    ckpt.save({**_state(1), "extra": complex(1, 2)}, path)
    return flip_blob(path, "extra", at=40), "extra", lambda: _load(path, {**_live(), "extra": None})


def verify_blobs(tmp: Path):
    from ckpt.read.source import verify_blobs as verify
    from ckpt.storage import locate

    path = _save(tmp / "c")
    return flip_blob(path, B), B, lambda: verify(locate(path), ckpt.read_manifest(path))


def _chain(tmp: Path) -> Path:
    root = tmp / "run"
    live = _state(1)
    with ckpt.CheckpointManager(root, interval=1, keep=10, full_every=2, catalog="") as manager:
        manager.save(1, live)
        manager.before_step()
        live[W][0] += 1.0
        manager.save(2, live)
    assert ckpt.read_manifest(root / step_name(2)).base == step_name(1)
    return root


def delta_blob(tmp: Path):
    root = _chain(tmp)
    # inside the zstd payload, where only the checksum can tell (at its start the frame would not parse)
    return flip_blob(root / step_name(2), W, at=40), W, lambda: _load(root / step_name(2), _live())


def delta_base(tmp: Path):
    root = _chain(tmp)
    return flip_blob(root / step_name(1), W), W, lambda: _load(root / step_name(2), _live())


def replay(tmp: Path):
    from ckpt.convert.replay import materialize

    root = _chain(tmp)
    return flip_blob(root / step_name(1), W), W, lambda: materialize(root / step_name(2), tmp / "full")


def consolidate(tmp: Path):
    from ckpt.convert.consolidate import full_tensors

    path = _save(tmp / "c")
    return flip_blob(path, W), W, lambda: list(full_tensors(path))


def consolidate_dtype(tmp: Path):
    from ckpt.convert.consolidate import full_tensors

    path = _save(tmp / "c")
    return flip_blob(path, W), W, lambda: list(full_tensors(path, dtype=torch.float64))


CASES = {  # name -> (build, the check it relies on)
    "direct read into the live tensor": (direct, "direct"),
    "non-contiguous target": (non_contiguous, "indirect"),
    "device target": (device_target, "indirect"),
    "zstd chunk": (zstd, "data_files"),
    "torch.save value": (torch_save_value, "data_files"),
    "verify_blobs (ckpt-inspect --verify)": (verify_blobs, "data_files"),
    "delta chunk": (delta_blob, "data_files"),
    "delta base": (delta_base, "data_files"),
    "replay through a chain": (replay, "data_files"),
    "consolidate": (consolidate, "direct_stream"),
    "consolidate with a dtype": (consolidate_dtype, "indirect"),
}


def _case(name: str, tmp_path: Path):
    build, check = CASES[name]
    if build is device_target and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return (*build(tmp_path), check)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_flipped_byte_is_caught_naming_file_and_tensor(name, tmp_path):
    file, what, read_it, _ = _case(name, tmp_path)
    with pytest.raises(CorruptCheckpointError) as caught:
        read_it()
    assert caught.value.file == file and caught.value.tensor == what, (caught.value.file, caught.value.tensor)
    assert file in str(caught.value) and what in str(caught.value)


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_case_fails_without_its_check(name, tmp_path, monkeypatch):
    file, what, read_it, check = _case(name, tmp_path)
    with_check_removed(monkeypatch, check)
    read_it()  # the damage now goes through silently: this case's check, and only it, catches it


# -- two ranks: a resharded load, a Shard(1) merge ------------------------------------------------------
def _load_resharded(rank: int, world: int, path: str, shard_dim: int):
    """Load the one-process checkpoint ``path`` into a DTensor sharded over ``world`` ranks: what the
    error names, then whether the load goes through with the indirect read's check removed."""
    from _pytest.monkeypatch import MonkeyPatch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))

    def live():
        return _live(w=distribute_tensor(torch.zeros(16, 8), mesh, [Shard(shard_dim)]))

    try:
        _load(path, live())
        caught = None
    except CorruptCheckpointError as exc:
        caught = (exc.file, exc.tensor)
    patch = MonkeyPatch()
    with_check_removed(patch, "indirect")
    try:
        _load(path, live())
        silent = True
    except CorruptCheckpointError:
        silent = False
    finally:
        patch.undo()
    return caught, silent


def _save_sharded(rank: int, world: int, path: str, shard_dim: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = _state(1)
    state[W] = distribute_tensor(state[W], mesh, [Shard(shard_dim)])
    ckpt.save(state, path)


@pytest.mark.slow  # spawns two ranks
def test_a_resharded_load_catches_a_flipped_byte_on_every_rank(tmp_path):
    path = _save(tmp_path / "c")
    file = flip_blob(path, W, at=4 * 8 * 8 + 3)  # in the rows rank 1 reads (read indirectly: offsets)
    assert run_ranks(2, _load_resharded, str(path), 0) == [((file, W), True)] * 2  # and silent without it


@pytest.mark.slow  # spawns two ranks
def test_a_shard1_merge_into_one_process_catches_a_flipped_byte(tmp_path, monkeypatch):
    path = tmp_path / "c"
    run_ranks(2, _save_sharded, str(path), 1)
    assert len(ckpt.read_manifest(path).tensors[W].chunks) == 2
    file = flip_blob(path, W)
    target = _live()
    with pytest.raises(CorruptCheckpointError) as caught:
        _load(path, target)
    assert (caught.value.file, caught.value.tensor) == (file, W)
    with_check_removed(monkeypatch, "indirect")  # the merge reads each column block indirectly
    _load(path, _live())
