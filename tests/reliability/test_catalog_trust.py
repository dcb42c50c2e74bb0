"""The catalog is a cache, never an authority (issue 22, items 9-11): tried as a hostile user would.

* a mount planted in the catalog's mount list is never listed, verified or contacted by
  ``ckpt-inspect ROOT``, and ``--rebuild-catalog`` drops it (item 9);
* ``.catalog``, ``data.mdb`` or ``lock.mdb`` as a symlink (or a hard link) to a database or file
  outside the root: neither the manager nor ``--rebuild-catalog`` wipes or writes what it points
  to; the link is replaced by a real catalog inside the root (item 10);
* a truncated ``data.mdb`` is refused by a plain open and rebuilt by the manager and by
  ``ckpt-inspect --rebuild-catalog``, in the process itself (no fork: a SIGBUS ends this test run),
  item 11; the exhaustive cuts are in test_fuzz_catalog.py.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import lmdb
import pytest
import torch

import ckpt
from ckpt.errors import CorruptCheckpointError
from ckpt.root import CheckpointRoot
from ckpt.root.catalog.store import Catalog
from tools import inspection


def _state(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(8, 8, generator=gen), "step": seed}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("trust") / "run"
    with ckpt.CheckpointManager(root, interval=1, full_every=2) as manager:  # with its .catalog
        for step in (1, 2, 3):
            manager.save(step, _state(step))
    return root


@pytest.fixture
def run(source, tmp_path) -> Path:
    shutil.copytree(source, tmp_path / "run", symlinks=True)
    return tmp_path / "run"


def _inspect(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = inspection.main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def _outside_database(path: Path) -> dict[str, bytes]:
    """An unrelated LMDB database (someone else's), its files' bytes."""
    env = lmdb.open(str(path), map_size=1 << 24)
    with env.begin(write=True) as txn:
        txn.put(b"precious", b"another program's record")
    env.close()
    return {name: (path / name).read_bytes() for name in ("data.mdb", "lock.mdb")}


def _listed_steps(catalog_dir: Path) -> list[int]:
    with Catalog(catalog_dir, readonly=True) as catalog:
        return [info.step for info in catalog.steps()]


# -- item 9: a planted mount ---------------------------------------------------------------------
def test_a_mount_planted_in_the_catalog_is_never_listed_verified_or_kept(run, tmp_path):
    planted = tmp_path / "other-run"
    ckpt.save(_state(7), planted / "step-00000007")
    ckpt.save(_state(8), planted / "step-00000008")
    with Catalog(run / ".catalog") as catalog:
        catalog.set_mounts([run, planted])  # as a hostile writer of ROOT/.catalog would
    listed: list[str] = []
    real = CheckpointRoot.committed

    def recording(self):
        listed.append(str(self.path))
        return real(self)

    CheckpointRoot.committed = recording
    try:
        code, out, err = _inspect(run, "--json")
        assert code == 0 and json.loads(out)["mounts"] == [str(run)]
        assert [s["step"] for s in json.loads(out)["steps"]] == [1, 2, 3]
        code, out, _err = _inspect(run, "--verify", "--quiet", "--json")
        assert code == 0 and json.loads(out)["mounts"] == 1 and json.loads(out)["steps"] == 3
        assert str(planted) not in listed, listed  # never read
        assert _inspect(run, "--rebuild-catalog")[0] == 0
    finally:
        CheckpointRoot.committed = real
    with Catalog(run / ".catalog", readonly=True) as catalog:
        assert catalog.mounts() == [str(run)]  # dropped by the rebuild


def test_a_planted_url_mount_is_never_contacted(run, s3_bucket, s3_proxy, aws_env, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_proxy.endpoint_url)
    ckpt.save(_state(9), f"{s3_bucket.url}/planted/step-00000009", storage_options=s3_bucket.storage_options)
    before = s3_proxy.requests
    with Catalog(run / ".catalog") as catalog:
        catalog.set_mounts([run, f"{s3_bucket.url}/planted"])
    for argv in ([run], [run, "--verify", "--quiet"], [run, "--rebuild-catalog"]):
        code, _out, err = _inspect(*argv)
        assert code == 0, err
    assert s3_proxy.requests == before  # not one request to the planted URL


# -- item 10: symlinks and hard links ------------------------------------------------------------
@pytest.mark.parametrize("opener", ["manager", "rebuild-catalog"])
def test_a_catalog_directory_symlinked_outside_the_root_is_never_followed(run, tmp_path, opener):
    outside = tmp_path / "someone-elses-db"
    kept = _outside_database(outside)
    shutil.rmtree(run / ".catalog")
    (run / ".catalog").symlink_to(outside, target_is_directory=True)
    _open(run, opener)
    assert {name: (outside / name).read_bytes() for name in kept} == kept  # untouched
    assert (run / ".catalog").is_dir() and not (run / ".catalog").is_symlink()
    assert _listed_steps(run / ".catalog") == [1, 2, 3]  # a real catalog inside the root


@pytest.mark.parametrize("name", ["data.mdb", "lock.mdb"])
@pytest.mark.parametrize("link", ["symlink", "hardlink"])
@pytest.mark.parametrize("opener", ["manager", "rebuild-catalog"])
def test_catalog_files_linked_outside_the_root_are_never_written(run, tmp_path, name, link, opener):
    outside = tmp_path / "someone-elses-db"
    kept = _outside_database(outside)
    (run / ".catalog" / name).unlink()
    if link == "symlink":
        (run / ".catalog" / name).symlink_to(outside / name)
    else:
        os.link(outside / name, run / ".catalog" / name)
    _open(run, opener)
    assert {n: (outside / n).read_bytes() for n in kept} == kept
    assert not (run / ".catalog" / name).is_symlink() and os.stat(run / ".catalog" / name).st_nlink == 1
    assert _listed_steps(run / ".catalog") == [1, 2, 3]


def test_a_symlinked_catalog_is_refused_by_a_plain_open_and_ignored_by_a_listing(run, tmp_path):
    outside = tmp_path / "someone-elses-db"
    _outside_database(outside)
    shutil.rmtree(run / ".catalog")
    (run / ".catalog").symlink_to(outside, target_is_directory=True)
    with pytest.raises(CorruptCheckpointError, match="symlink"):
        Catalog(run / ".catalog", readonly=True)
    code, out, err = _inspect(run)
    assert code == 0 and "catalog ignored" in err and "symlink" in err


def _open(run: Path, opener: str) -> None:
    if opener == "manager":
        with ckpt.CheckpointManager(run, interval=1) as manager:
            assert manager.load(_state(0)) == 3
    else:
        code, _out, err = _inspect(run, "--rebuild-catalog")
        assert code == 0, err


# -- item 11: a truncated data.mdb, in this very process ----------------------------------------
@pytest.mark.parametrize("opener", ["plain", "inspect", "manager", "rebuild-catalog"])
def test_a_truncated_catalog_is_refused_or_rebuilt_in_process(run, opener):
    data = run / ".catalog" / "data.mdb"
    with open(data, "r+b") as file:
        file.truncate(2 * 4096)  # the two meta pages survive; the pages they point at are gone
    if opener == "plain":
        with pytest.raises(CorruptCheckpointError, match="truncated"):
            Catalog(run / ".catalog", readonly=True)
    elif opener == "inspect":
        code, out, err = _inspect(run)
        assert code == 0 and "catalog ignored" in err and "truncated" in err
        assert [line.split()[0] for line in out.splitlines() if line[:1].isdigit()] == ["1", "2", "3"]
    else:
        _open(run, opener)
        assert _listed_steps(run / ".catalog") == [1, 2, 3]
