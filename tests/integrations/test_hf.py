"""ckpt.integrations.hf against the real transformers Trainer (a tiny LlamaForCausalLM on CPU) and
accelerate: saves through our manager instead of the Trainer's, save_total_limit as our retention,
resume_from_checkpoint bitwise through the Trainer's own resume path, a damaged newest step passed
over, deltas, no unpickling; accelerate's save_state/load_state hooks."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (CI installs it through dev)")

import ckpt  # noqa: E402
from tests.support.checkpoints import flip_byte, forbid_unpickling  # noqa: E402
from ckpt.integrations.hf import CkptCallback  # noqa: E402
from tests.support.hf_runs import StopAt, parameters, trainer  # noqa: E402


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The parameters of an uninterrupted 8-step run (the Trainer's own checkpoints)."""
    run = trainer(tmp_path_factory.mktemp("reference"))
    run.train()
    return parameters(run.model)


def _interrupted_then_resumed(tmp_path, stop: int, resume, **options):
    first = trainer(tmp_path, [CkptCallback(**options), StopAt(stop)])
    first.train()
    second = trainer(tmp_path, [CkptCallback(**options)])
    second.train(resume_from_checkpoint=resume)
    return first, second


@pytest.mark.slow
def test_resume_is_bitwise_and_the_trainer_writes_nothing_of_its_own(tmp_path, reference):
    first, second = _interrupted_then_resumed(tmp_path / "run", 4, True)
    run = tmp_path / "run"
    assert sorted(os.listdir(run)) == ["checkpoint-6", "checkpoint-8", "ckpt"]
    assert os.listdir(run / "checkpoint-8") == ["trainer_state.json"]  # no weights, optimizer.pt, rng_state.pth
    assert ckpt.CheckpointRoot(run / "ckpt").steps() == [6, 8]  # limit 2
    assert json.loads((run / "checkpoint-8" / "trainer_state.json").read_text())["global_step"] == 8
    assert second.state.global_step == 8
    for key, value in reference.items():
        assert torch.equal(value, parameters(second.model)[key]), key


@pytest.mark.slow
def test_damaged_newest_step_is_passed_over_and_nothing_is_unpickled(tmp_path, monkeypatch, reference):
    first = trainer(tmp_path, [CkptCallback(), StopAt(6)])
    first.train()
    flip_byte(tmp_path / "ckpt" / "step-00000006", 1 / 3)

    forbid_unpickling(monkeypatch)
    second = trainer(tmp_path, [CkptCallback()])
    with pytest.warns(UserWarning, match="resuming from step 4"):
        second.train(resume_from_checkpoint=str(tmp_path / "checkpoint-6"))
    assert second.state.global_step == 8
    for key, value in reference.items():
        assert torch.equal(value, parameters(second.model)[key]), key


@pytest.mark.slow
def test_deltas_and_retention_through_the_callback(tmp_path):
    callback = CkptCallback(full_every=2)
    trainer(tmp_path, [callback], save_total_limit=3).train()
    root = ckpt.CheckpointRoot(tmp_path / "ckpt")
    kinds = {step: ckpt.read_manifest(root.step_path(step)).kind for step in root.steps()}
    assert "delta" in kinds.values(), kinds
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("checkpoint-")) == \
        sorted(f"checkpoint-{s}" for s in root.steps())


def test_a_trainer_written_checkpoint_still_loads_the_trainers_way(tmp_path):
    trainer(tmp_path, [StopAt(2)]).train()  # the Trainer's own checkpoint-2
    assert os.path.isfile(tmp_path / "checkpoint-2" / "model.safetensors")
    resumed = trainer(tmp_path, [CkptCallback()], max_steps=4)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert resumed.state.global_step == 4 and ckpt.CheckpointRoot(tmp_path / "ckpt").steps() == [4]


def test_accelerate_save_state_writes_the_weights_through_the_engine(tmp_path):
    accelerate = pytest.importorskip("accelerate")
    from ckpt.integrations.hf import register_accelerate_hooks
    from tests.support.hf_runs import tiny_llama

    accelerator = accelerate.Accelerator(cpu=True)
    model = accelerator.prepare(tiny_llama())
    register_accelerate_hooks(accelerator)
    accelerator.save_state(str(tmp_path / "state"))
    assert not any(n.endswith(".safetensors") or n.endswith(".bin") for n in os.listdir(tmp_path / "state"))
    assert ckpt.read_manifest(tmp_path / "state" / "ckpt_model").tensors
    saved = parameters(model)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    accelerator.load_state(str(tmp_path / "state"))
    for key, value in saved.items():
        assert torch.equal(value, parameters(model)[key]), key


def test_the_memory_tier_is_refused_not_ignored(tmp_path):
    """The Trainer resumes from the checkpoint-N folder it names and the callback reads that step before
    the optimizer exists: no resume could take a memory step, so memory= is one clear error."""
    for make in (lambda: CkptCallback(memory=str(tmp_path)),
                 lambda: CkptCallback(options=ckpt.SaveOptions(memory=str(tmp_path)))):
        with pytest.raises(ckpt.InvalidOptionError, match="memory tier is not available with the Hugging Face"):
            make()
    assert not os.listdir(tmp_path)
