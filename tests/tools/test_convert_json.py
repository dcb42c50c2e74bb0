"""ckpt-convert: --json reports, a plain DCP checkpoint exported --to hf given its model
(--config / --model-args; transformers loads it and computes our logits), and "pass --force" only
where --force would help."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from tools import convert
from tests.support import REPO

transformers = pytest.importorskip("transformers")
TOLERANCE = 1e-5  # fp32 logits, ours vs transformers' eager llama


def _debug_model() -> "torch.nn.Module":
    from trainer.config import load_config
    from trainer.model import Transformer

    torch.manual_seed(0)
    args = load_config(["--config", str(REPO / "configs" / "debug.toml")]).model_args(258)
    return Transformer(args).eval()


@pytest.fixture(scope="module")
def dcp_root(tmp_path_factory) -> tuple[Path, "torch.nn.Module"]:
    """The debug llama saved by plain torch.distributed.checkpoint, imported --from dcp as step 5."""
    import torch.distributed.checkpoint as dcp

    folder = tmp_path_factory.mktemp("dcp")
    model = _debug_model()
    dcp.save({"model": model.state_dict()}, storage_writer=dcp.FileSystemWriter(str(folder / "dcp")), no_dist=True)
    assert convert.main([str(folder / "dcp"), str(folder / "root" / "step-00000005"), "--from", "dcp", "--quiet"]) == 0
    return folder / "root", model


def _logits_diff(ours, path: Path) -> float:
    kwargs = {"dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype": torch.float32}
    hf = transformers.LlamaForCausalLM.from_pretrained(str(path), attn_implementation="eager", **kwargs).eval()
    tokens = torch.randint(0, ours.args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return (ours(tokens) - hf(tokens).logits).abs().max().item()


def _error(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.err.startswith("ckpt-convert: error: "), captured.err
    return captured.err


def test_dcp_import_needs_a_model_to_go_to_hf(dcp_root, tmp_path, capsys):
    root, _model = dcp_root
    assert convert.main([str(root), str(tmp_path / "hf"), "--to", "hf", "--quiet"]) == 1
    err = _error(capsys)
    assert "records no run config" in err and "--config" in err and "--model-args" in err
    assert not (tmp_path / "hf").exists()


def test_dcp_import_to_hf_with_the_trainer_config(dcp_root, tmp_path, capsys):
    root, model = dcp_root
    assert convert.main([str(root), str(tmp_path / "hf"), "--to", "hf", "--json",
                         "--config", str(REPO / "configs" / "debug.toml")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["direction"], report["format"], report["step"], report["kind"]) == ("to", "hf", 5, "full")
    assert report["model"]["dim"] == model.args.dim and report["bytes"] > 0
    assert any(p.endswith("config.json") for p in report["written"])
    assert _logits_diff(model, tmp_path / "hf") < TOLERANCE


def test_dcp_import_to_hf_with_model_args(dcp_root, tmp_path, capsys):
    root, model = dcp_root
    inline = json.dumps({k: v for k, v in dataclasses.asdict(model.args).items() if v is not None})
    assert convert.main([str(root), str(tmp_path / "hf"), "--to", "hf", "--quiet", "--model-args", inline]) == 0
    assert _logits_diff(model, tmp_path / "hf") < TOLERANCE
    (tmp_path / "args.json").write_text(inline)  # a file works as well
    assert convert.main([str(root), str(tmp_path / "hf2"), "--to", "hf", "--quiet",
                         "--model-args", str(tmp_path / "args.json")]) == 0
    wrong = json.dumps({**json.loads(inline), "dim": model.args.dim * 2})  # shapes are checked against it
    capsys.readouterr()  # transformers' loading bars
    assert convert.main([str(root), str(tmp_path / "hf3"), "--to", "hf", "--model-args", wrong]) == 1
    err = _error(capsys)
    assert "do not match" in err and "more" in err and len(err) < 1000
    assert convert.main([str(root), str(tmp_path / "hf3"), "--to", "hf", "--model-args", '{"width": 3}']) == 1
    assert "width" in _error(capsys)
    assert not (tmp_path / "hf3").exists()


@pytest.mark.parametrize("argv", [["--from", "dcp", "--config", "x.toml"],
                                  ["--to", "hf", "--config", "x.toml", "--model-args", "{}"]])
def test_model_options_usage(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        convert.main(["a", "b", *argv])
    assert exc.value.code == 2


def test_json_reports_and_force_hints(dcp_root, tmp_path, capsys):
    root, model = dcp_root
    hf_dir = tmp_path / "hf"
    assert convert.main([str(root), str(hf_dir), "--to", "hf", "--quiet",
                         "--config", str(REPO / "configs" / "debug.toml")]) == 0
    assert convert.main([str(hf_dir), str(tmp_path / "back"), "--from", "hf", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["direction"], report["format"], report["step"]) == ("from", "hf", 0)
    assert report["tensors"] > 0 and report["trainer_flags"] and report["written"]
    # an existing DST without --force: the hint; with --force into a root holding other steps: not the hint
    assert convert.main([str(hf_dir), str(tmp_path / "back"), "--from", "hf"]) == 1
    assert "already exists; pass --force" in _error(capsys)
    assert convert.main([str(hf_dir), str(root), "--from", "hf", "--force"]) == 1
    err = _error(capsys)
    assert "holds other checkpoints" in err and "pass --force" not in err
    # the DCP import: its own report; a DST that is its source is never "pass --force"
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": model.state_dict()}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "d")), no_dist=True)
    assert convert.main([str(tmp_path / "d"), str(tmp_path / "r" / "step-00000001"), "--from", "dcp", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["step"], report["kind"], report["tensors"]) == (1, "full", len(model.state_dict()))
    assert convert.main([str(tmp_path / "d"), str(tmp_path / "d"), "--from", "dcp"]) == 1
    err = _error(capsys)
    assert "being converted" in err and "pass --force" not in err


def test_summary_lines_use_one_unit_convention(dcp_root, tmp_path, capsys):
    root, _model = dcp_root
    assert convert.main([str(root), str(tmp_path / "w.safetensors"), "--to", "safetensors"]) == 0
    out = capsys.readouterr().out
    assert " kB " in out or " MB " in out
    source = (REPO / "tools").glob("*.py")
    assert not [p.name for p in source if "1e9:.3f" in p.read_text()]
