"""The llama-3 family against transformers: llama3 rope scaling, tied embeddings, any SwiGLU width and
norm epsilon compute transformers' ``LlamaForCausalLM`` logits on the same weights (fp32, < 1e-5), and
Llama-3.x / SmolLM-shaped Hugging Face directories go through ``--from hf`` (the printed flags build
the model) and ``--to hf`` (tie, rope scaling and max_position_embeddings written back as given).

Tiny configs built here (no download)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import ckpt
from tools import convert
from trainer.config import load_config
from trainer.hf import expected_shapes, hf_config, model_args_of, to_hf
from trainer.model import ModelArgs, Transformer, build, ffn_hidden_dim
from trainer.rope import RopeScaling

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-5
# head_dim 16 with theta 500000: wavelengths from 6 to ~6e5 positions, so an original context of
# 128 positions puts frequencies in all three llama3 bands (kept, smoothed, slowed by `factor`).
LLAMA3 = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=300, ffn_dim=160, norm_eps=1e-6,
                   rope_theta=500000.0, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 128), max_seq_len=256)


def _ours(args: ModelArgs, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = build(args).eval()
    with torch.no_grad():  # sharper attention than at init, as a trained model has: positions matter
        for layer in model.layers.values():
            layer.attention.wq.weight.mul_(8.0)
            layer.attention.wk.weight.mul_(8.0)
    return model


def _hf_model(args: ModelArgs, model: Transformer, config_args: ModelArgs | None = None):
    config = transformers.LlamaConfig(**hf_config(config_args or args, torch.float32))
    config._attn_implementation = "eager"
    hf = transformers.LlamaForCausalLM(config).eval()
    state = dict(to_hf(k, v, args) for k, v in model.state_dict().items()
                 if not (args.tie_embeddings and k == "output.weight"))
    result = hf.load_state_dict(state, strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}
    if args.tie_embeddings:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    return hf


def _computes(args: ModelArgs) -> tuple:
    """What decides the function a model computes (the SwiGLU rounding rule does not, its width does)."""
    return (expected_shapes(args), ffn_hidden_dim(args), args.norm_eps, args.rope_theta, args.rope_scaling,
            args.tie_embeddings, args.max_seq_len)


def _diff(model, hf, tokens) -> float:
    with torch.no_grad():
        return (model(tokens) - hf(tokens).logits).abs().max().item()


TOKENS = torch.randint(0, 300, (2, 96), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("tied", [False, True])
def test_llama3_rope_scaling_and_tied_embeddings_compute_transformers_logits(tied):
    args = dataclasses.replace(LLAMA3, tie_embeddings=tied)
    model = _ours(args)
    assert (model.output.weight is model.tok_embeddings.weight) == tied
    assert len(list(model.parameters())) == len(model.state_dict()) - tied  # one matrix under two keys
    hf = _hf_model(args, model)
    diff = _diff(model, hf, TOKENS)
    # the scaling matters here: transformers without it computes something else
    unscaled = _diff(model, _hf_model(args, model, dataclasses.replace(args, rope_scaling=None)), TOKENS)
    print(f"tied={tied}: max |logits diff| {diff:.3g} (against transformers without the scaling: {unscaled:.3g})")
    assert diff < TOLERANCE
    assert unscaled > 1e-3


def _save_hf(path, tied: bool, **config) -> torch.nn.Module:
    config = transformers.LlamaConfig(tie_word_embeddings=tied, bos_token_id=256, eos_token_id=257, **config)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0, 0.3 if "q_proj" in name or "k_proj" in name else 0.05)
    hf.save_pretrained(path)
    return hf


SHAPES = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=300)
LLAMA32 = dict(SHAPES, rms_norm_eps=1e-5, max_position_embeddings=131072, rope_parameters={
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
SMOLLM = dict(SHAPES, rms_norm_eps=1e-5, max_position_embeddings=2048, rope_parameters={
    "rope_type": "default", "rope_theta": 100000.0})  # SmolLM2: tied, rope base 1e5, no scaling


@pytest.mark.parametrize("config, tied", [(LLAMA32, True), (LLAMA32, False), (SMOLLM, True)],
                         ids=["llama3.2-tied", "llama3.1-untied", "smollm2-tied"])
def test_from_hf_prints_flags_that_build_it_and_to_hf_writes_it_back(tmp_path, capsys, config, tied):
    hf = _save_hf(tmp_path / "hf", tied, **config)
    assert convert.main([str(tmp_path / "hf"), str(tmp_path / "init"), "--from", "hf"]) == 0
    out = capsys.readouterr().out
    command = next(line for line in out.splitlines() if line.startswith("start training from it:"))
    flags = command.split("<your config> ", 1)[1].split()[:-2]  # without --checkpoint.initial_load_path
    step = tmp_path / "init" / "step-00000000"
    stored = model_args_of(ckpt.read_manifest(step))
    assert stored.tie_embeddings == tied and stored.max_seq_len == config["max_position_embeddings"]
    built = load_config(flags).model_args(None)
    assert _computes(built) == _computes(stored), flags  # the flags build exactly the imported model
    model = Transformer(stored)
    ckpt.load({"model": model}, step)
    diff = _diff(model.eval(), hf, TOKENS)
    print(f"{config['rope_parameters']['rope_type']} tied={tied}: max |logits diff| after --from hf {diff:.3g}")
    assert diff < TOLERANCE

    assert convert.main([str(step), str(tmp_path / "back"), "--to", "hf", "--quiet"]) == 0
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert written["tie_word_embeddings"] is tied
    assert written["max_position_embeddings"] == config["max_position_embeddings"]
    assert written["rope_parameters"] == {**config["rope_parameters"], "rope_theta": written["rope_theta"]}
    assert "max_length" not in json.loads((tmp_path / "back" / "generation_config.json").read_text())
    again = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager").eval()
    assert _diff(model, again, TOKENS) < TOLERANCE
    original, back = hf.state_dict(), again.state_dict()
    assert original.keys() == back.keys() and all(torch.equal(original[k], back[k]) for k in original)
