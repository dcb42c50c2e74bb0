"""ckpt-convert --to hf and ckpt-merge of a mixture-of-experts checkpoint (moe_debug, saved by a
2-rank expert-parallel run... here one process: the stored experts are whole tensors either way, the
EP layout only changes how they were chunked): transformers' MixtralForCausalLM loads the export
and computes our logits; a model with a shared expert is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ckpt
from tools import convert, merge
from trainer.hf import model_args_of
from trainer.model import Transformer
from tests.support import REPO

TOLERANCE = 1e-5  # fp32 logits, ours vs transformers' eager Mixtral

transformers = pytest.importorskip("transformers")


def _train(folder: Path, *extra: str) -> Path:
    from trainer.config import load_config
    from trainer.train import Trainer

    trainer = Trainer(load_config(["--config", str(REPO / "configs" / "debug.toml"), "--job.dump_folder", str(folder),
                                   "--model.flavor", "moe_debug", "--training.steps", "2", "--training.seq_len", "32",
                                   "--training.batch_size", "4", "--checkpoint.interval", "2", *extra]))
    try:
        trainer.fit()
    finally:
        trainer.close()
    return folder / "checkpoints" / "step-00000002"


@pytest.fixture(scope="module")
def step(tmp_path_factory) -> Path:
    return _train(tmp_path_factory.mktemp("moe"))


def _ours(step_dir: Path) -> Transformer:
    model = Transformer(model_args_of(ckpt.read_manifest(step_dir)))
    ckpt.load({"model": model}, step_dir, strict=False)
    return model.eval()


def test_to_hf_is_a_mixtral_that_computes_our_logits(step, tmp_path):
    assert convert.main([str(step), str(tmp_path / "hf"), "--to", "hf", "--quiet"]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"] and config["model_type"] == "mixtral"
    assert (config["num_local_experts"], config["num_experts_per_tok"], config["intermediate_size"]) == (8, 2, 128)
    model, info = transformers.MixtralForCausalLM.from_pretrained(
        str(tmp_path / "hf"), attn_implementation="eager", output_loading_info=True, dtype=torch.float32)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    ours = _ours(step)
    tokens = torch.randint(0, ours.args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours(tokens) - model.eval()(tokens).logits).abs().max().item()
    assert diff < TOLERANCE, diff
    # the experts are Mixtral's per-expert tensors on disk
    from safetensors import safe_open

    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.layers.1.block_sparse_moe.experts.7.w2.weight").shape == (128, 128)
    assert "model.layers.0.block_sparse_moe.gate.weight" in keys and len(keys) == 4 * (4 + 1 + 3 * 8 + 2) + 3


def test_merge_writes_the_whole_experts_under_our_names(step, tmp_path):
    out = tmp_path / "merged.safetensors"
    assert merge.main([str(step), str(out), "--only", "model", "--quiet"]) == 0
    from safetensors.torch import load_file

    merged = load_file(str(out))
    ours = _ours(step)
    assert torch.equal(merged["model.layers.0.moe.experts.w1"], ours.layers["0"].moe.experts.w1.detach())
    assert merged["model.layers.3.moe.experts.w2"].shape == (8, 128, 128)


def test_a_shared_expert_has_no_mixtral_layout(tmp_path, capsys):
    step = _train(tmp_path / "shared", "--model.num_shared_experts", "1")
    assert convert.main([str(step), str(tmp_path / "hf"), "--to", "hf"]) == 1
    err = capsys.readouterr().err
    assert "shared expert" in err and err.count("\n") == 1
    assert not (tmp_path / "hf").exists()


def _mixtral(folder: Path, **overrides) -> Path:
    """A tiny random MixtralForCausalLM saved as transformers saves it (per-expert weights on disk)."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=64, **overrides)
    transformers.MixtralForCausalLM(config).save_pretrained(str(folder))
    return folder


def test_from_hf_imports_a_mixtral_that_computes_its_logits_and_exports_it_back_bitwise(tmp_path):
    from safetensors.torch import load_file

    source = _mixtral(tmp_path / "mixtral")
    assert convert.main([str(source), str(tmp_path / "ours"), "--from", "hf", "--quiet"]) == 0
    step = tmp_path / "ours" / "step-00000000"
    ours = _ours(step)
    assert (ours.args.num_experts, ours.args.top_k, ours.args.moe_ffn_dim) == (4, 2, 48)
    section = ckpt.read_manifest(step).user["config"]["model"]  # the trainer flags printed build it
    assert (section["num_experts"], section["top_k"], section["moe_ffn_dim"]) == (4, 2, 48)
    reference = transformers.MixtralForCausalLM.from_pretrained(str(source), attn_implementation="eager",
                                                                dtype=torch.float32).eval()
    tokens = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (ours(tokens) - reference(tokens).logits).abs().max().item()
    assert diff < TOLERANCE, diff

    assert convert.main([str(step), str(tmp_path / "back"), "--to", "hf", "--quiet"]) == 0
    original, back = load_file(source / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert original.keys() == back.keys()
    for key, value in original.items():
        assert torch.equal(value, back[key]), key


def test_our_moe_checkpoint_goes_to_mixtral_and_back_bitwise(step, tmp_path):
    assert convert.main([str(step), str(tmp_path / "hf"), "--to", "hf", "--quiet"]) == 0
    assert convert.main([str(tmp_path / "hf"), str(tmp_path / "back"), "--from", "hf", "--quiet"]) == 0
    back = tmp_path / "back" / "step-00000000"
    original = dict(ckpt.convert.full_tensors(step, ckpt.convert.select_keys(ckpt.read_manifest(step), "model")))
    returned = dict(ckpt.convert.full_tensors(back))
    assert original.keys() == returned.keys()
    for key, value in original.items():
        assert torch.equal(value, returned[key]), key
    flags = ckpt.read_manifest(back).user["config"]["model"]
    assert (flags["num_experts"], flags["top_k"], flags["num_shared_experts"], flags["moe_ffn_dim"]) == (8, 2, 0, 128)


def test_a_mixtral_with_a_sliding_window_is_refused_in_one_line(tmp_path, capsys):
    source = _mixtral(tmp_path / "mixtral", sliding_window=8)
    capsys.readouterr()  # transformers' own progress lines
    assert convert.main([str(source), str(tmp_path / "ours"), "--from", "hf"]) == 1
    err = capsys.readouterr().err
    assert "sliding_window" in err and err.count("\n") == 1 and not (tmp_path / "ours").exists()
