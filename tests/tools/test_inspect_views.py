"""ckpt-inspect beyond the steps table: one step's values, run config and sizes per prefix; a
.safetensors file and a Hugging Face directory read from their headers (hostile headers refused
with one line); --diff of two steps (checksums first, values where they cannot tell)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

import ckpt
from ckpt.inspect.weights import safetensors_header
from tools.inspection import main

CONFIG = {"config": {"model": {"flavor": "debug", "dim": 64}, "training": {"lr": 0.001, "seq_len": 128}}}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Steps 1 (full), 2 and 3 (deltas): model.w changes at step 2 only; values change every step."""
    path = tmp_path_factory.mktemp("views") / "run"
    with ckpt.CheckpointManager(path, interval=1, full_every=3, user_metadata=CONFIG, catalog="") as manager:
        for step in (1, 2, 3):
            manager.before_step()
            manager.save(step, {"model": {"w": torch.arange(4096.0) + (step >= 2), "b": torch.ones(3)},
                                "optimizer": {"m": torch.zeros(10)}, "step": step, "lr": 0.001 * step,
                                "name": "x" * 500, "rng": np.arange(624, dtype=np.uint32), "pos": (1, 2, step),
                                "blob": {"a": list(range(10_000))}})
    return path


def _json(capsys, argv) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def _error(capsys, argv) -> str:
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ckpt-inspect: error: ")
    return err


def test_one_step_shows_values_config_and_prefix_sizes(root, capsys):
    doc = _json(capsys, [str(root / "step-00000003"), "--json"])
    previews = {key: v["preview"] for key, v in doc["values"].items()}
    assert previews["step"] == "3" and previews["lr"] == repr(0.001 * 3) and previews["pos"] == "(1, 2, 3)"
    assert previews["rng"] == "ndarray <u4 [624]" and "(500 chars)" in previews["name"]
    assert all(len(p) <= 120 for p in previews.values())  # bounded, however large the value
    assert doc["config"] == CONFIG
    assert doc["prefixes"]["model"]["tensors"] == 2 and doc["prefixes"]["model"]["elements"] == 4099
    assert doc["prefixes"]["optimizer"]["raw_bytes"] == 40
    assert main([str(root / "step-00000003")]) == 0
    out = capsys.readouterr().out
    assert "run config (recorded by the trainer):" in out and "training.lr = 0.001" in out
    assert "prefix" in out and "optimizer" in out and "(1, 2, 3)" in out


def test_diff_of_two_steps(root, capsys):
    doc = _json(capsys, [str(root), "--diff", "1", "3", "--json"])
    assert doc["tensors"]["model.w"]["state"] == "changed" and doc["tensors"]["model.w"]["by"] == "values"
    assert doc["tensors"]["model.w"]["max_abs_diff"] == 1.0 and doc["changed_bytes"] == 4096 * 4
    assert doc["tensors"]["model.b"]["state"] == "same"
    assert sorted(doc["values"]["changed"]) == ["lr", "pos", "step"]
    doc = _json(capsys, [str(root), "--diff", "2", "3", "--json"])  # a delta on its base: from the manifest
    assert {t["state"] for t in doc["tensors"].values()} == {"same"}
    assert {t["by"] for t in doc["tensors"].values()} == {"checksums"}
    doc = _json(capsys, ["--diff", str(root / "step-00000003"), str(root / "step-00000001"), "--no-values", "--json"])
    assert doc["counts"]["unknown"] == 3  # nothing read
    assert main([str(root), "--diff", "1", "3"]) == 0
    out = capsys.readouterr().out
    assert "1 changed values" in out and "model.w" in out and "max |diff| 1" in out


def test_diff_added_removed_retyped(root, tmp_path, capsys):
    ckpt.save({"a": torch.zeros(3), "b": torch.zeros(2), "c": torch.zeros(4)}, tmp_path / "x", no_dist=True)
    ckpt.save({"a": torch.zeros(3), "b": torch.zeros(2, dtype=torch.float16), "d": torch.zeros(1)}, tmp_path / "y",
              no_dist=True)
    doc = _json(capsys, ["--diff", str(tmp_path / "x"), str(tmp_path / "y"), "--json"])
    assert doc["added"] == ["d"] and doc["removed"] == ["c"] and doc["tensors"]["b"]["state"] == "retyped"
    assert doc["tensors"]["a"] == {"state": "same", "by": "checksums"}
    err = _error(capsys, [str(root), "--diff", "7", str(tmp_path / "y")])
    assert "no committed step 7" in err and "1, 2, 3" in err


def test_safetensors_file_and_hf_directory(root, tmp_path, capsys):
    from tools import merge

    assert merge.main([str(root), str(tmp_path / "w.safetensors"), "--quiet"]) == 0
    doc = _json(capsys, [str(tmp_path / "w.safetensors"), "--json"])
    assert doc["format"] == "safetensors" and doc["totals"]["tensors"] == 3
    assert doc["tensors"]["model.w"] == {"dtype": "F32", "shape": [4096], "bytes": 16384,
                                         "offset": doc["tensors"]["model.w"]["offset"]}
    assert doc["metadata"]["ckpt.step"] == "3"
    hf = tmp_path / "hf"
    hf.mkdir()
    (tmp_path / "w.safetensors").rename(hf / "model.safetensors")
    (hf / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                                                "model_type": "llama", "x" * 10: "ignored"}))
    (hf / "pytorch_model.bin").write_bytes(b"\x80never unpickled")
    doc = _json(capsys, [str(hf), "--json"])
    assert doc["format"] == "hf" and doc["config"]["hidden_size"] == 64 and "xxxxxxxxxx" not in doc["config"]
    assert doc["tensors"]["model.b"]["file"] == "model.safetensors" and doc["unread"] == ["pytorch_model.bin"]
    assert main([str(hf)]) == 0
    out = capsys.readouterr().out
    assert "Hugging Face model directory, 3 tensors" in out and "not read (pickles): pytorch_model.bin" in out


def _header_file(path: Path, header, data: bytes = b"", length: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


@pytest.mark.parametrize("header, data, length, words", [
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"", None, "outside"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, b"\0" * 8, None, "its shape needs 16"),
    ({"a": {"dtype": "Q4", "shape": [4], "data_offsets": [0, 4]}}, b"\0" * 4, None, "dtype"),
    ({"a": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, None, "shape"),
    ({"a": {"dtype": "U8", "shape": [1] * 65, "data_offsets": [0, 1]}}, b"\0", None, "shape"),
    ({"__metadata__": {"k": 1}}, b"", None, "__metadata__"),
    (b"[" * 100_000, b"", None, "nested too deeply"),
    (b"{}", b"", 2**40, "header"),
    (b"\xff\xfe", b"", None, "not valid JSON"),
    ([1, 2], b"", None, "not a JSON object"),
    (b'{"\\ud800": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}', b"\0", None, "not valid Unicode"),
    ({"__metadata__": {"k": "\ud800" * 3}}, b"", None, "0 tensors"),  # shown escaped, not refused
])
def test_hostile_safetensors_headers_are_one_line(tmp_path, capsys, header, data, length, words):
    file = _header_file(tmp_path / "bad.safetensors", header, data, length)
    if words == "0 tensors":
        assert main([str(file)]) == 0 and words in capsys.readouterr().out
        return
    assert words in _error(capsys, [str(file)])


def test_deep_header_is_refused_without_recursion(tmp_path):
    deep = b'{"a": ' + b"[" * 40 + b"]" * 40 + b"}"
    with pytest.raises(ckpt.CheckpointError, match="nests more than"):
        safetensors_header(_header_file(tmp_path / "deep.safetensors", deep))


def test_usage(capsys, root):
    for argv in ([], [str(root), "--no-values"], [str(root), "--diff", "1", "2", "--verify"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2


def test_keys_and_values_holding_a_lone_surrogate_print_escaped(tmp_path, capsys):
    """A manifest key may hold a lone surrogate (valid JSON, "\\ud800"; the library saves it): the
    text views crashed with UnicodeEncodeError while --json worked. They print it escaped, aligned."""
    path = tmp_path / "run"
    with ckpt.CheckpointManager(path, interval=1, catalog="") as manager:
        for step in (1, 2):
            manager.before_step()
            extra = {} if step == 1 else {"w\ud800": torch.zeros(2), "v\udc80": "x\ud800y"}
            manager.save(step, {"model": {"w": torch.ones(3), **extra}})
    step = str(path / "step-00000002")
    doc = _json(capsys, [step, "--json"])
    assert "model.w\ud800" in doc["tensors"] and "model.v\udc80" in doc["values"]
    assert main([step]) == 0
    out = capsys.readouterr().out
    assert "model.w\\ud800  float32" in out and "model.v\\udc80  json" in out and "'x\\ud800y'" in out
    assert main([str(path), "--diff", "1", "2"]) == 0
    out = capsys.readouterr().out
    assert "added    model.w\\ud800" in out and "model.v\\udc80" in out
