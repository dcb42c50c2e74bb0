"""ckpt-convert of the plug-ins' steps, each written by a real run of its framework (tiny models, CPU):
--to torch / --to safetensors give the weights under the names the framework's model class takes
(load_state_dict of that class, bitwise), DeepSpeed's ZeRO masters exactly as its own zero_to_fp32.py
joins them; --to hf writes the HF Trainer's transformers model for from_pretrained (bitwise) and is
one clear line, nothing written, for a model that is not one."""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from tools import convert  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _convert(capsys, *argv) -> tuple[int, str]:
    """ckpt-convert's exit code and stderr (its stdout read and dropped)."""
    code = convert.main([str(a) for a in argv])
    err = capsys.readouterr().err
    return code, err


def _same(expected: dict, got: dict) -> None:
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        assert value.dtype == got[key].dtype and torch.equal(value, got[key]), key


def _loaded(model: torch.nn.Module, state: dict) -> dict:
    model.load_state_dict(state)  # strict: every key of the class, nothing else
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- DeepSpeed -------------------------------------------------------------------------------------------
def test_deepspeed_steps_load_into_the_module_bitwise_and_refuse_hf(tmp_path, capsys):
    pytest.importorskip("deepspeed")
    from safetensors.torch import load_file

    from tests.support.deepspeed_runs import model, train
    from tests.support.launch import run_ranks

    run = run_ranks(1, train, str(tmp_path / "ds"), 2, 4, (2, 4), False)[0]  # ZeRO-2, tags global_step2 and 4
    assert _convert(capsys, tmp_path / "ds", tmp_path / "w.safetensors", "--to", "safetensors", "--quiet") == (0, "")
    _same(run["params"], _loaded(model(), load_file(tmp_path / "w.safetensors")))
    assert _convert(capsys, tmp_path / "ds" / "global_step4", tmp_path / "w.pt", "--to", "torch", "--quiet")[0] == 0
    _same(run["params"], _loaded(model(), torch.load(tmp_path / "w.pt", weights_only=True)))

    assert _convert(capsys, tmp_path / "ds", tmp_path / "w2.pt", "--to", "torch", "--step", "2", "--quiet")[0] == 0
    older = torch.load(tmp_path / "w2.pt", weights_only=True)
    assert older.keys() == run["params"].keys() and not torch.equal(older["0.weight"], run["params"]["0.weight"])

    code, err = _convert(capsys, tmp_path / "ds", tmp_path / "hf", "--to", "hf")
    assert code == 1 and err.count("\n") == 1 and "not a transformers model" in err and "--to safetensors" in err
    assert not (tmp_path / "hf").exists()


def _bf16_zero2(rank: int, world_size: int, root: str, ours: bool) -> None:
    """Three bf16 ZeRO-2 steps and a save, through our engine or DeepSpeed's own (torch.save files)."""
    from ckpt.integrations import deepspeed as ckpt_deepspeed
    from tests.support.deepspeed_runs import batches, config, model

    net = model()
    cfg = {**config(2, **({"engine": "ckpt"} if ours else {})), "bf16": {"enabled": True}}
    engine, _, _, _ = ckpt_deepspeed.initialize(model=net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-2),
                                                config=cfg)
    for x in batches(rank, 3):
        engine.backward(engine(x.to(torch.bfloat16)).float().pow(2).mean())
        engine.step()
    engine.save_checkpoint(root)
    engine.destroy()


def _bf16_zero2_ours_and_theirs(rank: int, world_size: int, root: str) -> None:
    """:func:`_bf16_zero2` through our engine into ``root/ours``, then through DeepSpeed's own into
    ``root/theirs``: the same steps from the same seeds, in one launch (DeepSpeed's start-up once a rank)."""
    _bf16_zero2(rank, world_size, os.path.join(root, "ours"), True)
    _bf16_zero2(rank, world_size, os.path.join(root, "theirs"), False)


# Two DeepSpeed runs on one launch of 2 ranks (ZeRO-2's partitions: one per rank, joined by both tools).
@pytest.mark.slow
def test_deepspeed_bf16_zero2_masters_are_what_zero_to_fp32_gives(tmp_path, capsys):
    pytest.importorskip("deepspeed")
    import importlib.util

    from tests.support.launch import run_ranks

    run_ranks(2, _bf16_zero2_ours_and_theirs, str(tmp_path))
    assert _convert(capsys, tmp_path / "ours", tmp_path / "w.pt", "--to", "torch", "--quiet")[0] == 0
    spec = importlib.util.spec_from_file_location("zero_to_fp32", tmp_path / "theirs" / "zero_to_fp32.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    expected = script.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "theirs"))
    got = torch.load(tmp_path / "w.pt", weights_only=True)
    _same(dict(expected), got)
    assert got["0.weight"].dtype == torch.float32  # the masters, not the bf16 module


# -- Lightning -------------------------------------------------------------------------------------------
def test_lightning_checkpoints_load_into_the_lightning_module_bitwise(tmp_path, capsys):
    pytest.importorskip("lightning")
    from safetensors.torch import load_file

    from ckpt.integrations.lightning import CkptCheckpointIO
    from tests.support.lightning_runs import TinyModule, parameters, trainer

    module = TinyModule()
    trainer(tmp_path / "run", 4, plugins=[CkptCheckpointIO()]).fit(module)
    trained = parameters(module)  # BatchNorm's running statistics and its int64 counter included
    assert _convert(capsys, tmp_path / "run", tmp_path / "w.safetensors", "--to", "safetensors", "--quiet")[0] == 0
    _same(trained, _loaded(TinyModule(), load_file(tmp_path / "w.safetensors")))
    step2 = tmp_path / "run" / "epoch=0-step=2.ckpt"
    assert _convert(capsys, step2, tmp_path / "w.pt", "--to", "torch", "--quiet")[0] == 0
    older = torch.load(tmp_path / "w.pt", weights_only=True)
    assert older.keys() == trained.keys() and not torch.equal(older["net.0.weight"], trained["net.0.weight"])

    code, err = _convert(capsys, tmp_path / "run" / "last.ckpt", tmp_path / "hf", "--to", "hf")
    assert code == 1 and "LightningModule.load_state_dict" in err and not (tmp_path / "hf").exists()


# -- the Hugging Face Trainer ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    """A 4-step Trainer run checkpointing through CkptCallback (steps 2 and 4) and its final weights."""
    pytest.importorskip("transformers")
    from ckpt.integrations.hf import CkptCallback
    from tests.support.hf_runs import parameters, trainer

    folder = tmp_path_factory.mktemp("hf")
    run = trainer(folder, [CkptCallback()], max_steps=4)
    run.train()
    return folder, parameters(run.model)


def test_hf_trainer_steps_are_models_from_pretrained_loads_bitwise(hf_run, tmp_path, capsys):
    import transformers

    folder, trained = hf_run
    assert _convert(capsys, folder, tmp_path / "hf", "--to", "hf", "--quiet")[0] == 0
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors"]
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "llama"
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), output_loading_info=True,
                                                                    dtype=torch.float32)
    assert type(model).__name__ == "LlamaForCausalLM" and not any(info.values()), info
    _same(trained, {k: v.detach() for k, v in model.state_dict().items()})


def test_hf_trainer_checkpoint_folder_exports_the_models_own_state_dict(hf_run, tmp_path, capsys):
    from safetensors.torch import load_file

    from tests.support.hf_runs import tiny_llama

    folder, trained = hf_run
    out = tmp_path / "w.safetensors"
    assert convert.main([str(folder / "checkpoint-4"), str(out), "--to", "safetensors", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["framework"], report["step"]) == ("hf", 4)
    _same(trained, _loaded(tiny_llama(), load_file(out)))


def test_an_hf_step_without_its_model_config_is_refused_for_hf(tmp_path, capsys):
    """A step saved before the callback recorded the config: one line naming what --to hf needs."""
    import ckpt
    from tests.support.hf_runs import tiny_llama

    ckpt.save({"model": tiny_llama(), "trainer_state": {"global_step": 2}}, tmp_path / "ckpt" / "step-00000002",
              step=2)
    code, err = _convert(capsys, tmp_path / "ckpt", tmp_path / "hf", "--to", "hf")
    assert code == 1 and err.count("\n") == 1 and "records no model config" in err
    assert not (tmp_path / "hf").exists()
