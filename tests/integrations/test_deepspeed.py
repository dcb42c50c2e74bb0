"""ckpt.integrations.deepspeed against the real DeepSpeed on its CPU accelerator (gloo): ZeRO 1 and 2,
one and two ranks, selected from the DeepSpeed config; resume bitwise; `latest` only for committed
tags; a damaged file refused, a damaged newest tag passed over on every rank, a tag asked for by name
never replaced; no unpickling."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
pytest.importorskip("deepspeed", reason="the deepspeed extra (CI installs it through dev)")

import ckpt  # noqa: E402
from tests.support.checkpoints import flip_byte, forbid_unpickling  # noqa: E402
from tests.support.deepspeed_runs import scenario, train  # noqa: E402
from tests.support.launch import run_ranks  # noqa: E402


def _same(a: dict, b: dict) -> None:
    for key, value in a["params"].items():
        assert torch.equal(value, b["params"][key]), key
    for x, y in zip(a["partition"], b["partition"]):
        assert torch.equal(x, y)


# Slow, both stages: three DeepSpeed engines in a fresh rank (7 s on a quiet 2-core box, 112-176 s on a
# busy one); the quick loop keeps DeepSpeed's saves and loads through ours in the tests below.
@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_resume_is_bitwise_on_one_rank(tmp_path, stage):
    run = run_ranks(1, scenario, str(tmp_path), stage, 6, 4)[0]
    assert run["saved"]["engine"] == "CkptCheckpointEngine"
    tag = tmp_path / "run" / "global_step4"
    assert (tmp_path / "run" / "latest").read_text() == "global_step4"
    names = sorted(os.listdir(tag))
    assert names and all((tag / name / "manifest.json").is_file() for name in names)  # ours, not torch.save files
    assert run["resumed"]["step"] == 6
    _same(run["reference"], run["resumed"])


@pytest.mark.slow
def test_zero2_on_two_ranks_each_rank_writes_its_partition_and_resumes_bitwise(tmp_path):
    runs = run_ranks(2, scenario, str(tmp_path), 2, 6, 4)
    names = sorted(os.listdir(tmp_path / "run" / "global_step4"))
    assert sum("optim_states" in n for n in names) == 2  # one ZeRO partition per rank
    for run in runs:
        _same(run["reference"], run["resumed"])


@pytest.mark.slow
def test_a_damaged_newest_tag_is_passed_over_on_every_rank_and_the_resume_is_bitwise(tmp_path):
    # rank 1's optimizer file of global_step4 is damaged; rank 0 verifies it (its share), both fall back
    runs = run_ranks(2, scenario, str(tmp_path), 1, 6, 4, True)
    for run in runs:
        assert any("loading global_step2 instead" in w for w in run["warnings"]), run["warnings"]
        assert run["resumed"]["step"] == 6
        _same(run["reference"], run["resumed"])


def _load_tags(rank: int, world_size: int, root: str, tags: tuple) -> dict:
    """Load each of ``tags`` (None: the one ``latest`` names) into a fresh engine: its step, or the error."""
    import warnings

    from ckpt.integrations import deepspeed as ckpt_deepspeed
    from tests.support.deepspeed_runs import config, model

    net = model()
    engine, _, _, _ = ckpt_deepspeed.initialize(model=net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-2),
                                                config=config(1, engine="ckpt"))
    outcomes = {}
    for tag in tags:
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            try:
                ckpt_deepspeed.load_checkpoint(engine, root, tag=tag)
                outcomes[tag] = engine.global_steps
            except ckpt.CheckpointError as exc:
                outcomes[tag] = str(exc)
    engine.destroy()
    return outcomes


def _damage_the_newest_then_load_tags(rank: int, world_size: int, root: str, tags: tuple) -> dict:
    """Train with saves at steps 2 and 4, damage global_step4's model file, then :func:`_load_tags`:
    one process (DeepSpeed's start-up once), a fresh engine for the loads."""
    train(rank, world_size, root, 1, 4, (2, 4), False)  # tags global_step2, global_step4; latest: 4
    flip_byte(os.path.join(root, "global_step4", "mp_rank_00_model_states.pt"))
    return _load_tags(rank, world_size, root, tags)


def test_a_tag_asked_for_by_name_is_never_replaced(tmp_path):
    outcomes = run_ranks(1, _damage_the_newest_then_load_tags, str(tmp_path),
                         ("global_step4", "global_step3", None))[0]
    # Damaged: refused, naming the tag that would stand in (it was loaded with a warning before).
    assert "global_step4" in outcomes["global_step4"] and "pass tag='global_step2'" in outcomes["global_step4"]
    # Not there: refused (the newest tag, global_step4, was tried in its place before).
    assert "no checkpoint tag" in outcomes["global_step3"] and "tried global_step3)" in outcomes["global_step3"]
    assert outcomes[None] == 2  # the tag latest names still falls back to the older one


def test_a_damaged_file_is_refused_and_nothing_is_unpickled(tmp_path, monkeypatch):
    from ckpt.integrations.deepspeed import CkptCheckpointEngine

    run_ranks(1, train, str(tmp_path), 1, 4, (2, 4), False)
    optim = [n for n in os.listdir(tmp_path / "global_step4") if "optim" in n][0]
    engine = CkptCheckpointEngine()

    forbid_unpickling(monkeypatch)
    state = engine.load(str(tmp_path / "global_step2" / optim))
    assert type(state["optimizer_state_dict"]["loss_scaler"]).__name__ == "LossScaler"  # allow-listed, rebuilt
    assert isinstance(state["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["exp_avg"], torch.Tensor)
    flip_byte(tmp_path / "global_step4" / optim, 1.0)
    with pytest.raises(ckpt.CorruptCheckpointError):
        engine.load(str(tmp_path / "global_step4" / optim))
    engine.cleanup()


def test_config_selects_the_engine_and_rejects_an_unknown_one():
    from ckpt.integrations import deepspeed as ckpt_deepspeed

    with pytest.raises(ValueError, match="knows only 'ckpt'"):
        ckpt_deepspeed.initialize(model=torch.nn.Linear(2, 2), config={"checkpoint": {"engine": "other"}})


def test_the_memory_tier_is_refused_not_ignored(tmp_path):
    """DeepSpeed loads the path (tag) it names, so no resume could take a memory step: memory= is one
    clear error, whichever way the options come."""
    from ckpt.integrations import deepspeed as ckpt_deepspeed

    for make in (lambda: ckpt_deepspeed.CkptCheckpointEngine(memory=str(tmp_path)),
                 lambda: ckpt_deepspeed.CkptCheckpointEngine(options=ckpt.SaveOptions(memory=str(tmp_path)))):
        with pytest.raises(ckpt.InvalidOptionError, match="memory tier is not available with a path-based"):
            make()
    assert not os.listdir(tmp_path)
