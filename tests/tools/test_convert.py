"""tools.convert, the ckpt-convert CLI: a trainer checkpoint to Hugging Face (transformers loads it and
computes our logits), to plain torch/safetensors weights, from Hugging Face back into a checkpoint the
trainer starts from, from DCP; errors as one line with exit 1, usage errors exit 2."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.convert import full_tensors
from tools import convert
from trainer.hf import from_hf, model_args_of, rotary
from trainer.model import Transformer
from tests.support import REPO

TOLERANCE = 1e-5  # fp32 logits, ours vs transformers' eager llama (measured ~1e-6)

transformers = pytest.importorskip("transformers")


def _trainer_args(folder: Path, steps: int, *extra: str) -> list[str]:
    return ["--config", str(REPO / "configs" / "debug.toml"), "--job.dump_folder", str(folder),
            "--training.steps", str(steps), "--training.seq_len", "64", "--training.batch_size", "8",
            "--checkpoint.interval", "2", "--metrics.log_freq", "1", *extra]


def _train(folder: Path, steps: int, *extra: str) -> tuple[list[float], dict]:
    from trainer.config import load_config
    from trainer.train import Trainer

    trainer = Trainer(load_config(_trainer_args(folder, steps, *extra)))
    try:
        initial = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        return trainer.fit(), initial
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A trainer run of the debug flavor (GQA: 4 heads, 2 kv heads), checkpoints at steps 2 and 4."""
    folder = tmp_path_factory.mktemp("run")
    _train(folder, 4)
    return folder / "checkpoints"


def _load_hf(path: Path):
    kwargs = {"dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype": torch.float32}
    model, info = transformers.LlamaForCausalLM.from_pretrained(str(path), attn_implementation="eager",
                                                                output_loading_info=True, **kwargs)
    return model.eval(), info


def _ours(step_dir: Path) -> Transformer:
    manifest = ckpt.read_manifest(step_dir)
    model = Transformer(model_args_of(manifest))
    ckpt.load({"model": model}, step_dir, strict=False)
    return model.eval()


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(0))


def _logits_diff(ours: Transformer, hf) -> float:
    tokens = _tokens(ours.args.vocab_size)
    with torch.no_grad():
        return (ours(tokens) - hf(tokens).logits).abs().max().item()


def test_to_hf_loads_in_transformers_and_computes_our_logits(run, tmp_path, monkeypatch, capsys):
    assert convert.main([str(run), str(tmp_path / "hf"), "--to", "hf"]) == 0  # newest step: 4
    out = capsys.readouterr().out
    assert "step 4" in out and "byte tokenizer" in out and out.count("\n") == 1
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert files == ["config.json", "generation_config.json", "model.safetensors",  # no temporary left
                     "tokenizer.json", "tokenizer_config.json"]  # the byte tokenizer, as HF files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["bos_token_id"]) == (4, 2, 256)
    hf, info = _load_hf(tmp_path / "hf")
    assert not any(info.values())  # no missing, unexpected or mismatched keys, no errors
    ours = _ours(run / "step-00000004")
    diff = _logits_diff(ours, hf)
    assert diff < TOLERANCE
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    text = "def f(x):\n    return x  # ünïcode"
    assert tokenizer(text)["input_ids"] == [256, *text.encode()]  # exactly the trainer's byte ids, BOS first
    assert tokenizer.decode([256, *text.encode(), 257], skip_special_tokens=True) == text
    generate = transformers.pipeline("text-generation", model=hf, tokenizer=tokenizer)
    sample = generate("def ", max_new_tokens=8, do_sample=False)[0]["generated_text"]
    assert sample.startswith("def ") and len(sample) > len("def ")

    # The same export without the rotary permutation computes something else: the test can fail.
    monkeypatch.setattr(rotary, "permute_to_hf", lambda weight, n_heads: weight)
    assert convert.main([str(run), str(tmp_path / "plain"), "--to", "hf", "--quiet"]) == 0
    unpermuted = _logits_diff(ours, _load_hf(tmp_path / "plain")[0])
    print(f"max |logits diff| of the export: {diff:.3g}; without the permutation: {unpermuted:.3g}")
    assert unpermuted > 100 * max(diff, 1e-7)


def test_to_hf_sharded_with_index_then_back_from_hf_bitwise(run, tmp_path, capsys):
    src = run / "step-00000002"
    assert convert.main([str(src), str(tmp_path / "hf"), "--to", "hf", "--max-shard-size", "1MB", "--quiet"]) == 0
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in (tmp_path / "hf").glob("model-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    manifest = ckpt.read_manifest(src)
    model_keys = sorted(k for k in manifest.tensors if k.startswith("model."))
    assert len(index["weight_map"]) == len(model_keys)
    entries = [manifest.tensors[k] for k in model_keys]
    assert index["metadata"]["total_size"] == sum(e.dtype.itemsize * math.prod(e.shape) for e in entries)
    hf, info = _load_hf(tmp_path / "hf")
    assert not any(info.values())
    assert _logits_diff(_ours(src), hf) < TOLERANCE

    # back: --from hf writes the original weights, bitwise, as step 0 of a new root
    assert convert.main([str(tmp_path / "hf"), str(tmp_path / "back"), "--from", "hf"]) == 0
    out = capsys.readouterr().out
    assert "--checkpoint.initial_load_path" in out and "--model.flavor debug" in out
    back = dict(full_tensors(tmp_path / "back" / "step-00000000"))
    original = dict(full_tensors(src, model_keys))
    assert back.keys() == original.keys() and all(torch.equal(back[k], original[k]) for k in original)
    # and out again: the same Hugging Face model (config included)
    assert convert.main([str(tmp_path / "back"), str(tmp_path / "again"), "--to", "hf", "--quiet"]) == 0
    assert (tmp_path / "again" / "config.json").read_text() == (tmp_path / "hf" / "config.json").read_text()


def test_from_hf_then_the_trainer_starts_from_it(tmp_path, capsys):
    """A transformers llama (bf16 on disk) -> --from hf -> the trainer, with the flags printed, loads
    exactly its weights (fp32) and trains; our model computes transformers' logits."""
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                      rms_norm_eps=1e-5, max_position_embeddings=256, bos_token_id=256,
                                      eos_token_id=257, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0, 0.2 if "q_proj" in name or "k_proj" in name else 0.05)
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    hf = hf.float()  # the bf16 values, in fp32: what the import writes
    assert convert.main([str(tmp_path / "hf"), str(tmp_path / "init"), "--from", "hf"]) == 0
    lines = capsys.readouterr().out.splitlines()
    command = next(line for line in lines if line.startswith("start training from it:"))
    flags = command.split("<your config> ", 1)[1].split()
    assert flags[-2:] == ["--checkpoint.initial_load_path", str(tmp_path / "init")]
    step = tmp_path / "init" / "step-00000000"
    assert _logits_diff(_ours(step), hf) < TOLERANCE

    expected = dict(from_hf(k, v, model_args_of(ckpt.read_manifest(step)))
                    for k, v in hf.state_dict().items())
    losses, loaded = _train(tmp_path / "run", 2, *flags)
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) and loaded[k].dtype == torch.float32 for k in expected)
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)


def test_to_torch_and_safetensors_under_our_names(run, tmp_path, capsys):
    from safetensors.torch import load_file

    src = run / "step-00000004"
    original = {k[len("model."):]: v for k, v in full_tensors(src) if k.startswith("model.")}
    assert convert.main([str(run), str(tmp_path / "w.pt"), "--to", "torch"]) == 0
    weights = torch.load(tmp_path / "w.pt", weights_only=True)
    model = Transformer(model_args_of(ckpt.read_manifest(src)))
    model.load_state_dict(weights)  # strict: exactly the model's keys
    assert all(torch.equal(weights[k], original[k]) for k in original)
    assert convert.main([str(run), str(tmp_path / "w.safetensors"), "--to", "safetensors", "--step", "2",
                         "--dtype", "bf16"]) == 0
    loaded = load_file(tmp_path / "w.safetensors")
    assert loaded.keys() == original.keys() and {v.dtype for v in loaded.values()} == {torch.bfloat16}
    assert convert.main([str(run), str(tmp_path / "shards"), "--to", "safetensors", "--max-shard-size", "1MB"]) == 0
    index = json.loads((tmp_path / "shards" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(original)
    assert "model tensors" in capsys.readouterr().out


def test_to_hf_copies_the_runs_tokenizer(run, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    src = run / "step-00000004"
    manifest = ckpt.read_manifest(src)
    config = json.loads(json.dumps(manifest.user["config"]))
    config["model"]["tokenizer"] = str(tmp_path / "tokenizer.json")
    state = {k: v for k, v in full_tensors(src) if k.startswith("model.")}
    ckpt.save(state, tmp_path / "ckpt", user_metadata={"config": config})
    assert convert.main([str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--to", "hf", "--quiet"]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (tmp_path / "tokenizer.json").read_bytes()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["bos_token_id"] == 1
    loaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert loaded("hello world")["input_ids"][-2:] == [3, 4] and loaded.eos_token == "</s>"


def _one_error_line(capsys, *words: str) -> str:
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.err.startswith("ckpt-convert: error: "), captured.err
    for word in words:
        assert word in captured.err, captured.err
    return captured.err


def test_errors_are_one_line_and_nothing_partial_is_left(run, tmp_path, capsys):
    main = convert.main
    assert main([str(run), str(tmp_path / "x"), "--to", "hf", "--step", "3"]) == 1
    _one_error_line(capsys, "no committed step 3", "newest committed: 2, 4")
    (tmp_path / "taken").mkdir()
    assert main([str(run), str(tmp_path / "taken"), "--to", "hf"]) == 1
    _one_error_line(capsys, "already exists", "--force")
    assert main([str(run), str(tmp_path / "taken"), "--to", "hf", "--force", "--quiet"]) == 0
    assert (tmp_path / "taken" / "config.json").is_file()
    # the wrong kind of directory, both ways
    assert main([str(tmp_path / "taken"), str(tmp_path / "y"), "--to", "hf"]) == 1
    _one_error_line(capsys, "neither a checkpoint", "--from hf")
    assert main([str(run), str(tmp_path / "y"), "--from", "hf"]) == 1
    _one_error_line(capsys, "not a Hugging Face model directory", "--to")
    assert main([str(run.parent), str(tmp_path / "y"), "--from", "hf"]) == 1
    _one_error_line(capsys, "trainer run's folder")
    # a model ours cannot represent
    config = json.loads((tmp_path / "taken" / "config.json").read_text())
    (tmp_path / "taken" / "config.json").write_text(json.dumps({**config, "rope_scaling": {"rope_type": "yarn"}}))
    assert main([str(tmp_path / "taken"), str(tmp_path / "y"), "--from", "hf"]) == 1
    _one_error_line(capsys, "rope_type='yarn'")
    # a checkpoint without a run config: its heads are unknown
    ckpt.save({"model": {"w": torch.zeros(2)}}, tmp_path / "bare")
    assert main([str(tmp_path / "bare"), str(tmp_path / "y"), "--to", "hf"]) == 1
    _one_error_line(capsys, "records no run config")
    assert main([str(tmp_path / "nowhere"), str(tmp_path / "y"), "--from", "dcp"]) == 1
    _one_error_line(capsys, "nowhere")
    assert not (tmp_path / "y").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bare", "taken"]  # no temporary left anywhere


@pytest.mark.parametrize("argv", [
    ["a", "b"],  # neither --to nor --from
    ["a", "b", "--to", "hf", "--from", "hf"],
    ["a", "b", "--from", "hf", "--max-shard-size", "1GB"],
    ["a", "b", "--from", "dcp", "--step", "3"],
    ["a", "b.pt", "--to", "safetensors"],
    ["a", "b", "--to", "hf", "--max-shard-size", "lots"],
    ["a", "s3://bucket/b", "--to", "hf"],
])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        convert.main(argv)
    assert exc.value.code == 2 and "usage: ckpt-convert" in capsys.readouterr().err


def test_help(capsys):
    with pytest.raises(SystemExit) as exc:
        convert.main(["--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and "--from hf" in out and "examples:" in out and "initial_load_path" in out


def test_from_dcp(tmp_path, capsys):
    pytest.importorskip("ckpt.convert.dcp.importer")
    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": torch.arange(12.0).reshape(3, 4)}, "step": 7}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")), no_dist=True)
    assert convert.main([str(tmp_path / "dcp"), str(tmp_path / "root" / "step-00000007"), "--from", "dcp"]) == 0
    assert "1 tensors" in capsys.readouterr().out
    loaded = {"model": {"w": torch.zeros(3, 4)}, "step": 0}
    ckpt.load(loaded, tmp_path / "root" / "step-00000007")
    assert torch.equal(loaded["model"]["w"], state["model"]["w"]) and loaded["step"] == 7
