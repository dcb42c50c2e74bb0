"""trainer/hf/checks.py (issue 22, item 6): a hostile Hugging Face directory is refused by
``open_hf`` / ``ckpt-convert --from hf`` with an InvalidManifestError naming the file and the field,
exit 1 and one line, at once: config values of the wrong type or an absurd size (which escaped as
TypeError/ValueError/OverflowError, blamed "writing DST", or hung for 10^6 layers), deep or non-finite
JSON (and JSON files over the documented 16 MiB, while one at it is read), weight_map entries
leaving the directory (``../x``, absolute: read from outside before), weights files that are
symbolic links out (followed before)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

import ckpt
from tests.support.hf_sources import save_tiny, write_config
from tools import convert
from trainer.hf import open_hf

CONFIG_VALUES = [
    ("num_key_value_heads", "2"), ("num_key_value_heads", 2.5), ("num_key_value_heads", -1),
    ("num_key_value_heads", 0), ("rms_norm_eps", None), ("rms_norm_eps", -1e-5), ("rope_theta", [1]),
    ("rope_theta", "1e4"), ("hidden_size", 10 ** 12), ("vocab_size", 10 ** 18), ("num_hidden_layers", 10 ** 6),
    ("intermediate_size", True), ("head_dim", "8"), ("partial_rotary_factor", [1]), ("architectures", 5),
    ("rope_scaling", [1]), ("rope_parameters", {"rope_type": "default", "rope_theta": "big"}),
    ("tie_word_embeddings", "no"), ("bos_token_id", -3), ("max_position_embeddings", 2.0 ** 70),
]
RAW_CONFIGS = [  # config.json text edits: (name, old, new, the field named)
    ("eps-nan", '"rms_norm_eps": 1e-05', '"rms_norm_eps": NaN', "rms_norm_eps"),
    ("positions-1e400", '"max_position_embeddings": 2048', '"max_position_embeddings": 1e400',
     "max_position_embeddings"),
    ("unknown-nan", '"use_cache": true', '"use_cache": true, "foo": {"bar": [1, -Infinity]}', "foo.bar[1]"),
    ("deep-array", '"use_cache": true', '"use_cache": true, "x": ' + "[" * 100_000 + "]" * 100_000, None),
    ("deep-object", '"use_cache": true', '"use_cache": true, "x": ' + '{"a": ' * 40 + "1" + "}" * 40, "x.a"),
]


def _refused(src: Path, tmp_path: Path, capsys, *words: str) -> str:
    """open_hf raises an InvalidManifestError naming the words; the CLI exits 1 with one line, quickly,
    writing nothing."""
    start = time.monotonic()
    with pytest.raises(ckpt.InvalidManifestError) as info:
        open_hf(src)
    assert all(word in str(info.value) for word in words), str(info.value)
    assert convert.main([str(src), str(tmp_path / "out"), "--from", "hf", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ckpt-convert: error: ") and "writing" not in err, err
    assert all(word in err for word in words), err
    assert time.monotonic() - start < 5
    assert not (tmp_path / "out").exists()
    return err


@pytest.mark.parametrize("key, value", CONFIG_VALUES, ids=[f"{k}={v!r}"[:40] for k, v in CONFIG_VALUES])
def test_config_values_of_wrong_type_or_absurd_size(tmp_path, capsys, key, value):
    src = save_tiny(tmp_path / "hf", **{key: value})
    err = _refused(src, tmp_path, capsys, str(src / "config.json"), f"{key.split('.')[0]}")
    assert "is invalid" in err


@pytest.mark.parametrize("name, old, new, field", RAW_CONFIGS, ids=[c[0] for c in RAW_CONFIGS])
def test_non_finite_and_deep_json(tmp_path, capsys, name, old, new, field):
    src = save_tiny(tmp_path / "hf")
    text = (src / "config.json").read_text()
    assert old in text
    write_config(src, text.replace(old, new))
    _refused(src, tmp_path, capsys, str(src / "config.json"), *([field] if field else ["nested too deeply"]))


def _redirect_shard(src: Path, target: str) -> None:
    index = json.loads((src / "model.safetensors.index.json").read_text())
    second = "model-00002-of-00002.safetensors"
    index["weight_map"] = {k: target if v == second else v for k, v in index["weight_map"].items()}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("target", ["../outside.safetensors", "ABSOLUTE", "sub/x.safetensors", 7])
def test_weight_map_leaving_the_directory(tmp_path, capsys, target):
    src = save_tiny(tmp_path / "hf", sharded=True)
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes((src / "model-00002-of-00002.safetensors").read_bytes())  # would load if followed
    _redirect_shard(src, str(outside) if target == "ABSOLUTE" else target)
    _refused(src, tmp_path, capsys, "model.safetensors.index.json", "weight_map")


def test_weights_file_that_is_a_symlink_out(tmp_path, capsys):
    src = save_tiny(tmp_path / "hf")
    os.replace(src / "model.safetensors", tmp_path / "elsewhere.safetensors")
    os.symlink(tmp_path / "elsewhere.safetensors", src / "model.safetensors")
    _refused(src, tmp_path, capsys, "model.safetensors", "symbolic link")


def test_config_that_is_a_symlink_out(tmp_path, capsys):
    src = save_tiny(tmp_path / "hf")
    os.replace(src / "config.json", tmp_path / "config.json")
    os.symlink(tmp_path / "config.json", src / "config.json")
    _refused(src, tmp_path, capsys, "config.json", "symbolic link")


def test_hub_cache_links_into_its_blobs_are_read(tmp_path):
    """The Hugging Face hub cache keeps every file as snapshots/<rev>/<name> -> ../../blobs/<hash>:
    those links are the one kind admitted."""
    plain = save_tiny(tmp_path / "plain", sharded=True)
    repo = tmp_path / "models--x--tiny"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, file in enumerate(sorted(plain.iterdir())):
        (blobs / f"h{i}").write_bytes(file.read_bytes())
        os.symlink(f"../../blobs/h{i}", snapshot / file.name)
    model = open_hf(snapshot)
    assert model.args.dim == 16 and len(model.weights) == 12


DOCUMENTED_JSON_BOUND = 16 << 20  # docs/RELIABILITY.md: config.json and the index are at most 16 MiB


def _pad_json(file: Path, size: int) -> None:
    """Rewrite the JSON object in ``file`` as exactly ``size`` bytes (an extra string key)."""
    value = json.loads(file.read_text())
    value["padding"] = ""
    short = len(json.dumps(value))
    value["padding"] = "x" * (size - short)
    file.write_text(json.dumps(value))
    assert file.stat().st_size == size


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_json_files_at_the_documented_bound_are_read_and_one_byte_over_refused(tmp_path, capsys, name):
    at = save_tiny(tmp_path / "at", sharded=True)
    _pad_json(at / name, DOCUMENTED_JSON_BOUND)
    assert open_hf(at).args.dim == 16
    over = save_tiny(tmp_path / "over", sharded=True)
    _pad_json(over / name, DOCUMENTED_JSON_BOUND + 1)
    _refused(over, tmp_path, capsys, str(over / name), f"is {DOCUMENTED_JSON_BOUND + 1} bytes")


NULL_ROTARY_FACTORS = {"top-level": {"partial_rotary_factor": None},
                       "rope_parameters": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                               "partial_rotary_factor": None}}}


@pytest.mark.parametrize("where", NULL_ROTARY_FACTORS)
def test_null_partial_rotary_factor_means_full_rotary_as_in_transformers(tmp_path, capsys, where):
    """checks.py admits null; config.py read it with float() (a TypeError traceback). Null is the
    default, every head dimension rotated: transformers' llama reads the same rotary frequencies."""
    plain, nulled = save_tiny(tmp_path / "plain"), save_tiny(tmp_path / "nulled", **NULL_ROTARY_FACTORS[where])
    for src in (plain, nulled):
        assert convert.main([str(src), str(tmp_path / src.name / "out"), "--from", "hf", "--quiet"]) == 0
    assert capsys.readouterr().err == ""
    args = [ckpt.read_manifest(tmp_path / src.name / "out" / "step-00000000").user["model_args"]
            for src in (plain, nulled)]
    assert args[0] == args[1]
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    frequencies = [LlamaRotaryEmbedding(transformers.LlamaConfig.from_pretrained(src)).inv_freq
                   for src in (plain, nulled)]
    assert torch.equal(frequencies[0], frequencies[1])


def test_a_valid_tiny_model_still_imports(tmp_path):
    src = save_tiny(tmp_path / "hf", sharded=True)
    assert convert.main([str(src), str(tmp_path / "out"), "--from", "hf", "--quiet"]) == 0
    assert ckpt.read_manifest(tmp_path / "out" / "step-00000000").user["model_args"]["dim"] == 16
