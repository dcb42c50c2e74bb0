"""ckpt.integrations.lightning against the real Lightning: CkptCheckpointIO under ModelCheckpoint
(save_top_k, every_n_train_steps, save_last, ckpt_path="last"), deltas, a damaged newest checkpoint
passed over for an older one of the same run only (an explicitly asked one never replaced),
pickle-free loading, a crash mid-delete; CkptModelParallelStrategy sharded on 2 gloo ranks, resharded."""

from __future__ import annotations

import os
import pathlib

import pytest
import torch

pytest.importorskip("lightning", reason="the lightning extra (CI installs it through dev)")

import ckpt  # noqa: E402
from tests.support.checkpoints import flip_byte, forbid_unpickling  # noqa: E402
from ckpt.integrations.lightning import CkptCheckpointIO  # noqa: E402
from tests.support.lightning_runs import TinyModule, parameters, trainer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:lightning")


def _fit(root, steps, io=None, ckpt_path=None, **kwargs):
    module = TinyModule()
    run = trainer(root, steps, plugins=[io] if io is not None else [], **kwargs)
    run.fit(module, ckpt_path=ckpt_path)
    return module, run


@pytest.mark.slow
def test_resume_from_last_is_bitwise_and_retention_is_lightnings(tmp_path):
    reference, _ = _fit(tmp_path / "ref", 10)
    _fit(tmp_path / "run", 6, CkptCheckpointIO())
    names = sorted(os.listdir(tmp_path / "run"))
    assert names == ["epoch=1-step=4.ckpt", "epoch=2-step=6.ckpt", "last.ckpt"]  # save_top_k=2 + last
    for name in names:  # our committed directories, not torch.save files
        assert (tmp_path / "run" / name / "manifest.json").is_file()
    assert ckpt.read_manifest(tmp_path / "run" / "last.ckpt").step == 6
    resumed, _ = _fit(tmp_path / "run", 10, CkptCheckpointIO(), ckpt_path="last")
    for key, value in parameters(reference).items():
        assert torch.equal(value, parameters(resumed)[key]), key


def test_deltas_through_the_plugin_and_their_bases_kept(tmp_path):
    io = CkptCheckpointIO(full_every=3)
    # A delta names its base by a plain sibling name (no "="): Lightning's filename option gives one.
    _, run = _fit(tmp_path, 8, io, None, filename="step{step:03d}")
    kinds = {name: ckpt.read_manifest(tmp_path / name).kind for name in os.listdir(tmp_path)}
    assert "delta" in kinds.values(), kinds
    assert kinds["last.ckpt"] == "full"  # saved over every time: never a base, never a delta of one
    for name, kind in kinds.items():
        manifest = ckpt.read_manifest(tmp_path / name)
        if kind == "delta":  # its base is still there although save_top_k removed it
            assert (tmp_path / manifest.base / "manifest.json").is_file()
    assert io.stats.deltas >= 1
    newest = max(n for n in kinds if n.startswith("step"))
    tree = CkptCheckpointIO().load_checkpoint(tmp_path / newest)
    assert tree["global_step"] == 8
    module = TinyModule()
    module.load_state_dict(tree["state_dict"])
    for key, value in parameters(run.lightning_module).items():
        assert torch.equal(value, parameters(module)[key]), key


def test_damaged_newest_is_passed_over_and_load_never_unpickles(tmp_path, monkeypatch):
    _fit(tmp_path, 6, CkptCheckpointIO())
    flip_byte(tmp_path / "last.ckpt")

    forbid_unpickling(monkeypatch)
    with pytest.warns(UserWarning, match="cannot be loaded"):
        tree = CkptCheckpointIO().load_checkpoint(tmp_path / "last.ckpt")
    assert tree["global_step"] == 6 and "loops" in tree and "optimizer_states" in tree
    with pytest.raises(ckpt.CorruptCheckpointError):
        CkptCheckpointIO(fallback=False).load_checkpoint(tmp_path / "last.ckpt")


def test_an_explicit_damaged_checkpoint_is_never_replaced(tmp_path):
    _fit(tmp_path, 6, CkptCheckpointIO(), top_k=3)
    asked, older = tmp_path / "epoch=1-step=4.ckpt", tmp_path / "epoch=0-step=2.ckpt"
    flip_byte(asked)
    # Not step 6 (newer), and not step 2 silently either: the error names both.
    with pytest.raises(ckpt.CorruptCheckpointError, match=f"{asked}.*{older}") as raised:
        _fit(tmp_path, 8, CkptCheckpointIO(), ckpt_path=asked, top_k=3)
    assert "asked for by name" in str(raised.value)
    flip_byte(older)  # nothing of the run older than step 2 loads: refused, naming no other
    with pytest.raises(ckpt.CorruptCheckpointError, match="no other checkpoint of the same run at no newer step"):
        CkptCheckpointIO().load_checkpoint(older)


def test_a_damaged_last_falls_back_within_its_own_run_only(tmp_path):
    _fit(tmp_path, 8, CkptCheckpointIO(), filename="other{step}")  # another run, left in the folder: step 8
    ours, _ = _fit(tmp_path, 4, CkptCheckpointIO())  # this run: steps 2 and 4, and its last checkpoint,
    last = tmp_path / "last-v1.ckpt"  # which Lightning names last-v1.ckpt beside the other run's last.ckpt
    assert ckpt.read_manifest(last).step == 4
    flip_byte(last)

    with pytest.warns(UserWarning, match="epoch=1-step=4.ckpt instead"):
        resumed, run = _fit(tmp_path, 4, CkptCheckpointIO(), ckpt_path="last")
    assert run.global_step == 4  # not the other run's step 8
    for key, value in parameters(ours).items():
        assert torch.equal(value, parameters(resumed)[key]), key

    # last.ckpt's manifest unreadable: whose run it was cannot be told, so nothing stands in for it.
    (last / "manifest.json").write_text("{}")
    with pytest.raises(ckpt.CheckpointError, match="cannot be told from another run's.*/last.ckpt is not loaded"):
        _fit(tmp_path, 4, CkptCheckpointIO(), ckpt_path="last")


class _Crash(BaseException):
    """A process dying mid-delete (no handler of the engine's catches it)."""


@pytest.mark.parametrize("listing", ["listed", "reversed"])  # the order rmtree meets entries in is the filesystem's
def test_a_crash_mid_delete_leaves_the_checkpoint_whole_or_invisible(tmp_path, monkeypatch, listing):
    path = tmp_path / "epoch=0-step=2.ckpt"
    io = CkptCheckpointIO(async_mode="sync")
    io.save_checkpoint({"state_dict": {"w": torch.arange(64.0)}, "global_step": 2}, path)
    real_scandir, real_unlink, unlinked = os.scandir, os.unlink, []

    class Entries(list):
        def __enter__(self):
            return iter(self)

        def __exit__(self, *exc):
            return False

    def scandir(*args):
        with real_scandir(*args) as it:
            entries = list(it)
        return Entries(entries if listing == "listed" else entries[::-1])

    def unlink(name, *args, **kwargs):
        unlinked.append(name)
        if len(unlinked) == 2:  # the first file is gone, the process dies before the second
            raise _Crash
        return real_unlink(name, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(os, "scandir", scandir)
        patch.setattr(os, "unlink", unlink)
        with pytest.raises(_Crash):
            io.remove_checkpoint(path)
    io.teardown()
    try:
        ckpt.read_manifest(path)
    except ckpt.CheckpointError:
        pass  # not committed: no reader lists or loads it
    else:  # still committed: then whole
        assert torch.equal(CkptCheckpointIO().load_checkpoint(path)["state_dict"]["w"], torch.arange(64.0))
    CkptCheckpointIO().remove_checkpoint(path)  # the next delete clears what is left
    assert not path.exists()


def test_sync_mode_and_a_manual_save(tmp_path):
    module, run = _fit(tmp_path, 2, CkptCheckpointIO(async_mode="sync"))
    run.save_checkpoint(tmp_path / "manual.ckpt")
    tree = CkptCheckpointIO().load_checkpoint(tmp_path / "manual.ckpt")
    assert tree["global_step"] == 2
    assert isinstance(tree["optimizer_states"][0]["state"], dict) and 0 in tree["optimizer_states"][0]["state"]


def test_missing_extra_is_named(monkeypatch):
    from ckpt.integrations._optional import require

    with pytest.raises(ImportError, match=r"ckpt-engine\[lightning\]"):
        require("lightning_not_installed_here", extra="lightning", integration="ckpt.integrations.lightning")


@pytest.mark.slow
def test_model_parallel_sharded_save_on_two_ranks_loads_resharded_on_one(tmp_path):
    from tests.support.lightning_runs import sharded_fit
    from tests.support.launch import run_ranks

    root = str(tmp_path / "sharded")
    saved = run_ranks(2, sharded_fit, root, 4, None)[0]
    (step4,) = (tmp_path / "sharded").glob("*-step=4.ckpt")  # each rank sees one batch an epoch
    manifest = ckpt.read_manifest(step4)
    assert manifest.world_size == 2 and manifest.step == 4
    assert any(len(entry.chunks) == 2 for entry in manifest.tensors.values())  # shards of both ranks
    # 2 ranks -> 1 rank: the same strategy reshards into a one-rank mesh and continues to step 6,
    # where a one-rank run resumed from our checkpoint must agree with a two-rank continuation.
    assert set(saved["model"]) and all(v.dtype == torch.float32 for v in saved["model"].values())
    one = run_ranks(1, sharded_fit, root, 4, str(step4))[0]  # resumed at step 4: no step left, state as saved
    for key, value in saved["model"].items():
        assert torch.equal(value, one["model"][key]), key
    for key, state in saved["optim"].items():
        for name, value in state.items():
            assert torch.equal(value, one["optim"][key][name]), (key, name)


def test_the_memory_tier_is_refused_not_ignored(tmp_path):
    """Lightning loads the path it names, so no resume could take a memory step: memory= is one clear
    error, from the plug-in (as a field or in options) and from the sharded strategy."""
    from ckpt.integrations.lightning import CkptModelParallelStrategy

    for make in (lambda: CkptCheckpointIO(memory=str(tmp_path)),
                 lambda: CkptCheckpointIO(ckpt.SaveOptions(memory=str(tmp_path))),
                 lambda: CkptModelParallelStrategy(ckpt_options=ckpt.SaveOptions(memory=str(tmp_path)))):
        with pytest.raises(ckpt.InvalidOptionError, match="memory tier is not available with Lightning"):
            make()
    assert not os.listdir(tmp_path)  # nothing made for it
