"""trainer/titan/convert.py and ckpt-convert --from/--to torchtitan: a torchtitan run continues in our
trainer and goes back.

A checkpoint in exactly the layout torchtitan's checkpointer writes (its debugmodel's classes, its
ModelWrapper and flat optimizer state, DCP; tests/support/titan_llama3.py) converts with the flags
printed; our trainer resumes it at torchtitan's step with torchtitan's weights, AdamW moments (the
fused wqkv split as torchtitan's own hook splits it), step counts, hyper-parameters and LR position,
bitwise, and trains on; its checkpoint converts back with --to torchtitan and torchtitan's loading
(exclude_from_loading = dataloader) restores our trainer's state bitwise. The trainer refuses
torchtitan's folder and raw steps with one line naming the converter."""

from __future__ import annotations

import math

import pytest
import torch

import ckpt
from tests.support import titan_llama3
from tests.support.trainer_runs import trainer_args
from tools import convert
from trainer import exits
from trainer.config import load_config
from trainer.titan import split_qkv
from trainer.train import Trainer


def _flags(out: str) -> list[str]:
    line = next(line for line in out.splitlines() if line.startswith("resume training from it:"))
    return line.split("<your config> ", 1)[1].split()


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_torchtitan_run_continues_in_our_trainer_and_goes_back(tmp_path, capsys):
    model, optimizer, scheduler, train = titan_llama3.titan_run(tmp_path / "titan", steps=2)
    assert convert.main([str(tmp_path / "titan"), str(tmp_path / "ours"), "--from", "torchtitan",
                         "--flavor", "debugmodel"]) == 0
    out = capsys.readouterr().out
    assert "left out: dataloader.dp_rank_0, dataloader.world_size" in out
    flags = _flags(out)
    assert flags[-3:] == ["--checkpoint.enable", "--checkpoint.folder", str(tmp_path / "ours")]

    cfg = load_config(trainer_args(str(tmp_path / "run"), steps=4, checkpoint__interval=2) + flags)
    trainer = Trainer(cfg)
    try:
        assert trainer.checkpoints.resumed_step == 2 and trainer.train_state.step == 2
        assert trainer.scheduler.last_epoch == 2 and trainer.train_state.tokens_seen == train.ntokens_seen
        titan = model.state_dict()
        ours = trainer.model.state_dict()
        assert torch.equal(ours["layers.5.attention.wk.weight"], titan["layers.5.attention.qkv_linear.wk.weight"])
        assert torch.equal(ours["output.weight"], titan["lm_head.weight"])
        assert len(ours) == len(titan)
        # AdamW: the fused moments split as torchtitan's own save hook splits the weight
        fused = optimizer.state[model.layers["1"].attention.qkv_linear.wqkv.weight]
        mine = {name: p for name, p in trainer.model.named_parameters()}
        for i, proj in enumerate(("wq", "wk", "wv")):
            state = trainer.optimizer.state[mine[f"layers.1.attention.{proj}.weight"]]
            for moment in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(state[moment], split_qkv(fused[moment], 16, 16)[i])
            assert torch.equal(state["step"], fused["step"])
        norm = optimizer.state[model.norm.weight]
        assert torch.equal(trainer.optimizer.state[mine["norm.weight"]]["exp_avg"], norm["exp_avg"])
        group, theirs = trainer.optimizer.param_groups[0], optimizer.param_groups[0]
        assert all(group[k] == theirs[k] for k in ("lr", "betas", "eps", "weight_decay", "initial_lr"))
        losses = trainer.fit()
    finally:
        trainer.close()
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)

    # and back: torchtitan's loading restores what our trainer saved at step 4
    saved = tmp_path / "ours" / "step-00000004"
    assert convert.main([str(tmp_path / "ours"), str(tmp_path / "back"), "--to", "torchtitan"]) == 0
    assert "exclude_from_loading dataloader" in capsys.readouterr().out
    again, again_opt, again_sched, again_train = titan_llama3.titan_load(tmp_path / "back" / "step-4")
    assert (again_train.step, again_sched.last_epoch) == (4, 4)
    from trainer.titan import titan_name

    weights = dict(ckpt.convert.full_tensors(saved, [k for k in ckpt.read_manifest(saved).tensors
                                                    if k.startswith("model.")]))
    assert _equal({titan_name(k[6:]): v for k, v in weights.items()}, again.state_dict())
    fused = again_opt.state[again.layers["3"].attention.qkv_linear.wqkv.weight]
    moments = dict(ckpt.convert.full_tensors(saved, [f"optim.state.layers.3.attention.{p}.weight.exp_avg"
                                                     for p in ("wq", "wk", "wv")]))
    assert torch.equal(torch.cat(split_qkv(fused["exp_avg"], 16, 16)),
                       torch.cat([moments[f"optim.state.layers.3.attention.{p}.weight.exp_avg"]
                                  for p in ("wq", "wk", "wv")]))


def test_the_trainer_refuses_torchtitans_folders_naming_the_converter(tmp_path):
    titan_llama3.titan_run(tmp_path / "titan", steps=1)
    argv = trainer_args(str(tmp_path / "run"), steps=2)
    with pytest.raises(exits.Refused, match=r"not this trainer's.*step-1.*--from torchtitan --flavor"):
        Trainer(load_config(argv + ["--checkpoint.enable", "--checkpoint.folder", str(tmp_path / "titan")]))
    with pytest.raises(exits.Refused, match=r"plain DCP checkpoint.*--from torchtitan"):
        Trainer(load_config(argv + ["--checkpoint.initial_load_path", str(tmp_path / "titan" / "step-1")]))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_names_not_shapes_are_named_as_the_cause(tmp_path):
    from trainer.checkpointing import names_problem

    live = {"model.tok_embeddings.weight", "model.layers.0.attention.wq.weight", "model.output.weight"}
    titan = {"model.tok_embeddings.weight", "model.layers.0.attention.qkv_linear.wq.weight", "model.lm_head.weight"}
    assert "not named as this trainer's" in names_problem(live, titan, titan)
    assert "--from torchtitan" in names_problem(live, set(), {"tok_embeddings.weight"})
    fewer = {"model.tok_embeddings.weight", "model.output.weight"}
    assert "set model.*" in names_problem(live, fewer, fewer)


def test_arguments(capsys):
    with pytest.raises(SystemExit):
        convert.main(["a", "b", "--from", "torchtitan"])
    assert "needs --flavor" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        convert.main(["a", "b", "--to", "torchtitan", "--dtype", "bf16"])
    assert "neither --dtype" in capsys.readouterr().err


def test_a_step_of_torchtitans_own_manager_exports_to_hf(tmp_path, capsys):
    """Issue 36 item 14: a step torchtitan's own CheckpointManager wrote (its llama3 debugmodel, plain
    DCP) goes --to hf with its flavor: the weights are what torchtitan's own state-dict adapter makes
    of the saved model, bitwise; the other way (--from torchtitan) takes it too."""
    pytest.importorskip("torchtitan.components.checkpointer")
    from safetensors.torch import load_file

    from tests.support.titan import llama_job, seeded_step

    torch.set_num_threads(1)
    job = llama_job(str(tmp_path), [], seed=0, interval=2, async_mode="disabled", keep_latest_k=0)
    assert type(job.checkpointer).__module__.startswith("torchtitan.")  # torchtitan's manager, not ours
    for _ in range(2):
        seeded_step(job)
        job.checkpointer.save(job.train_state.step)
    job.checkpointer.close()
    folder = tmp_path / "checkpoint"
    assert (folder / "step-2" / ".metadata").is_file()

    assert convert.main([str(folder), str(tmp_path / "hf-x"), "--to", "hf"]) == 1
    assert "torchtitan checkpoint: export it with --flavor" in capsys.readouterr().err
    assert convert.main([str(folder), str(tmp_path / "hf"), "--to", "hf", "--flavor", "debugmodel"]) == 0
    assert "of " + str(folder / "step-2") in capsys.readouterr().out
    adapter = titan_llama3.llama3().Llama3StateDictAdapter(titan_llama3.llama3().model_registry("debugmodel").model,
                                                           None)
    expected = adapter.to_hf(job.model.state_dict())
    written = load_file(tmp_path / "hf" / "model.safetensors")
    assert written.keys() == expected.keys()
    for key, value in expected.items():
        assert written[key].dtype == value.dtype and torch.equal(written[key], value), key

    assert convert.main([str(folder / "step-2"), str(tmp_path / "ours"), "--from", "torchtitan",
                         "--flavor", "debugmodel"]) == 0
    from trainer.titan import our_name

    imported = dict(ckpt.convert.full_tensors(tmp_path / "ours" / "step-00000002"))
    for key, value in job.model.state_dict().items():
        assert torch.equal(imported["model." + our_name(key)], value), key


def test_flavor_arguments(capsys):
    with pytest.raises(SystemExit):
        convert.main(["a", "b", "--to", "torchtitan", "--flavor", "debugmodel"])
    assert "--flavor applies to --from torchtitan and to --to hf" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        convert.main(["a", "b", "--to", "hf", "--flavor", "debugmodel", "--model-args", "{}"])
    assert "--flavor names a torchtitan checkpoint's model" in capsys.readouterr().err


def test_a_step_of_our_torchtitan_integration_exports_to_hf_and_converts(tmp_path, capsys):
    """The steps ckpt.integrations.torchtitan writes (ours, torchtitan's layout; here a delta) go --to
    hf with --flavor as torchtitan's own do, and --from torchtitan takes them, moments included."""
    pytest.importorskip("torchtitan.components.checkpointer")
    from safetensors.torch import load_file

    from tests.support.titan import OVERRIDE, llama_job, seeded_step

    torch.set_num_threads(1)
    job = llama_job(str(tmp_path), [(OVERRIDE, {"full_every": 2})], seed=0, interval=1, async_mode="async",
                    keep_latest_k=0)
    for _ in range(2):
        seeded_step(job)
        job.checkpointer.save(job.train_state.step)
    job.checkpointer.close()
    root = tmp_path / "checkpoint"
    assert ckpt.read_manifest(root / "step-00000002").kind != "full"

    assert convert.main([str(root), str(tmp_path / "hf-x"), "--to", "hf"]) == 1
    assert "torchtitan's model names" in capsys.readouterr().err
    assert convert.main([str(root), str(tmp_path / "hf"), "--to", "hf", "--flavor", "debugmodel"]) == 0
    adapter = titan_llama3.llama3().Llama3StateDictAdapter(titan_llama3.llama3().model_registry("debugmodel").model,
                                                           None)
    expected = adapter.to_hf(job.model.state_dict())
    written = load_file(tmp_path / "hf" / "model.safetensors")
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[key], value) for key, value in expected.items())

    assert convert.main([str(root), str(tmp_path / "ours"), "--from", "torchtitan", "--flavor", "debugmodel"]) == 0
    saved = tmp_path / "ours" / "step-00000002"
    fused = job.optimizers.optimizers[0].state[job.model.layers["1"].attention.qkv_linear.wqkv.weight]
    moments = dict(ckpt.convert.full_tensors(saved, [f"optim.state.layers.1.attention.{p}.weight.exp_avg"
                                                     for p in ("wq", "wk", "wv")]))
    assert torch.equal(torch.cat(split_qkv(fused["exp_avg"], 16, 16)),
                       torch.cat([moments[f"optim.state.layers.1.attention.{p}.weight.exp_avg"]
                                  for p in ("wq", "wk", "wv")]))
