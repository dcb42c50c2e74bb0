"""Fuzzing the importers (issue 22): hostile Hugging Face directories against ``open_hf`` /
``ckpt-convert --from hf``, hostile DCP checkpoints against ``import_dcp`` / ``--from dcp``.

A tiny valid source of each kind is mutated with hypothesis: config.json values replaced by values
of any JSON type (huge and negative integers, NaN/Infinity, strings, nulls, lists, deep nesting),
keys added or dropped, weight_map entries aimed out of the directory (at a valid shard outside, so
following it would *succeed*); DCP metadata fields (sizes, chunk boxes, offsets, lengths, dtypes,
paths, transforms, keys, a value replaced by a memo DAG, a 3000-deep list, a cycle, a meta tensor or a
lone-surrogate key) and data-file bytes (cuts, flips, random bytes). Every call must either
succeed or raise a :class:`ckpt.CheckpointError` subclass (the CLI: exit 0/1 with one line, never an
exception), within a few seconds per input; nothing outside a directory is read as part of a model.

Seeded (derandomized) unless ``CKPT_FUZZ_RANDOM=1``; ``CKPT_FUZZ_EXAMPLES`` scales the counts
(default 150: 60 HF configs, 30 HF indexes, 60 DCP metadata, 30 DCP data files).
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import shutil
import sys
import time
from collections import Counter
from contextlib import redirect_stderr, redirect_stdout
from io import BytesIO, StringIO
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import MetadataIndex

import ckpt
from ckpt.convert import import_dcp, read_dcp_metadata
from tests.support import dcp_sources
from tests.support.hf_sources import save_tiny
from tools import convert
from trainer.hf import open_hf

EXAMPLES = int(os.environ.get("CKPT_FUZZ_EXAMPLES", "150"))


def _settings(share: float) -> settings:
    return settings(max_examples=max(10, int(EXAMPLES * share)), deadline=None, database=None,
                    derandomize=os.environ.get("CKPT_FUZZ_RANDOM") != "1",
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


REPORT: Counter = Counter()  # outcomes per importer (printed by the last test)
SECONDS = 5  # per input, import and CLI together
HUGE = st.sampled_from([0, -1, 1, 2, 3, 7, 2 ** 31, 2 ** 63, 10 ** 12, 10 ** 18, 10 ** 400])
NUMBERS = st.one_of(HUGE, st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e400, -0.0, 1e-300]))
SCALARS = st.one_of(NUMBERS, st.none(), st.booleans(), st.text(max_size=8),
                    st.sampled_from(["2", "silu", "llama", "default", "llama3", "../x", "\udc80"]))
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                      st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                    max_leaves=12)


def _cli_line(argv: list[str]) -> int:
    err = StringIO()
    with redirect_stderr(err), redirect_stdout(StringIO()):
        code = convert.main(argv)
    assert code in (0, 1), code
    if code == 1:
        assert err.getvalue().count("\n") == 1 and err.getvalue().startswith("ckpt-convert: error: "), err.getvalue()
    return code


def _only_checkpoint_errors(kind: str, call) -> str:
    """Run ``call``; a CheckpointError is an outcome (tallied in REPORT), anything else fails the test."""
    try:
        call()
        outcome = "ok"
    except ckpt.CheckpointError as exc:
        outcome = type(exc).__name__
    REPORT[f"{kind}: {outcome}"] += 1
    return outcome


# -- Hugging Face --------------------------------------------------------------------------------
HF_KEYS = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
           "intermediate_size", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
           "partial_rotary_factor", "max_position_embeddings", "architectures", "model_type", "hidden_act",
           "attention_bias", "mlp_bias", "tie_word_embeddings", "bos_token_id", "eos_token_id", "torch_dtype",
           "unknown_key"]


@pytest.fixture(scope="module")
def hf_source(tmp_path_factory) -> Path:
    top = tmp_path_factory.mktemp("hf-fuzz")
    src = save_tiny(top / "model", sharded=True)
    shutil.copy(src / "model-00002-of-00002.safetensors", top / "outside.safetensors")
    return src


@_settings(0.4)
@given(edits=st.lists(st.tuples(st.sampled_from(HF_KEYS), st.one_of(JSON, st.just("DROP"), st.just("DEEP"))),
                      min_size=1, max_size=4))
def test_fuzzed_hf_configs_raise_only_checkpoint_errors(hf_source, tmp_path_factory, edits):
    work = tmp_path_factory.mktemp("hf")
    src = Path(shutil.copytree(hf_source, work / "model"))
    config = json.loads((src / "config.json").read_text())
    for key, value in edits:
        if value == "DROP":
            config.pop(key, None)
        else:
            config[key] = "__DEEP__" if value == "DEEP" else value
    text = json.dumps(config, allow_nan=True).replace('"__DEEP__"', "[" * 2000 + "1" + "]" * 2000)
    (src / "config.json").write_text(text)
    start = time.monotonic()
    _only_checkpoint_errors("hf config", lambda: open_hf(src))
    _cli_line([str(src), str(work / "out"), "--from", "hf", "--quiet"])
    assert time.monotonic() - start < SECONDS


@_settings(0.2)
@given(target=st.one_of(st.sampled_from(["../outside.safetensors", "OUTSIDE_ABS", "./../outside.safetensors",
                                         "model/../../outside.safetensors", "", ".", "..", "\x00", "a/b"]),
                        JSON))
def test_fuzzed_hf_indexes_never_read_outside(hf_source, tmp_path_factory, target):
    work = tmp_path_factory.mktemp("hfi")
    src = Path(shutil.copytree(hf_source, work / "model"))
    index = json.loads((src / "model.safetensors.index.json").read_text())
    target = str(hf_source.parent / "outside.safetensors") if target == "OUTSIDE_ABS" else target
    index["weight_map"] = {k: target if v.startswith("model-00002") else v for k, v in index["weight_map"].items()}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    outcome = _only_checkpoint_errors("hf index", lambda: open_hf(src))
    assert outcome != "ok", f"weight_map {target!r} accepted"  # the only complete set of weights is outside
    assert _cli_line([str(src), str(work / "out"), "--from", "hf", "--quiet"]) == 1


# -- DCP -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dcp_source(tmp_path_factory) -> Path:
    return dcp_sources.save_small(tmp_path_factory.mktemp("dcp-fuzz") / "dcp")


INTS = st.one_of(st.integers(-3, 70), HUGE.filter(lambda v: v < 2 ** 63))
DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64, torch.uint8])


def _mutate_metadata(md, data):
    """One structural edit of DCP's Metadata (drawn with hypothesis ``data``)."""
    tensors = [k for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks")]
    infos = list(md.storage_data.items())
    kind = data.draw(st.sampled_from(["size", "chunk", "dtype", "offset", "length", "path", "transform",
                                      "drop", "key", "planner", "index"]))
    if kind in ("size", "chunk", "dtype") and tensors:
        entry = md.state_dict_metadata[data.draw(st.sampled_from(tensors))]
        if kind == "size":
            entry.size = torch.Size(data.draw(st.lists(INTS.filter(lambda v: v >= 0), max_size=3)))
        elif kind == "chunk" and entry.chunks:
            chunk = entry.chunks[0]
            setattr(chunk, data.draw(st.sampled_from(["offsets", "sizes"])),
                    torch.Size(data.draw(st.lists(INTS.filter(lambda v: v >= 0), max_size=3))))
        else:
            entry.properties.dtype = data.draw(DTYPES)
    elif kind in ("offset", "length", "path", "transform", "index") and infos:
        index, info = infos[data.draw(st.integers(0, len(infos) - 1))]
        if kind in ("offset", "length"):
            setattr(info, kind, data.draw(INTS.filter(lambda v: v >= 0)))
        elif kind == "path":
            info.relative_path = data.draw(st.sampled_from(["../x.distcp", "/etc/hostname", ".metadata",
                                                            "__0_0.distcp", "__0_1.distcp", "missing", "a/b/c",
                                                            "__0_01.distcp", "\udc80"]))
        elif kind == "transform":
            info.transform_descriptors = data.draw(st.sampled_from([["stream.zstd/1"], ["stream.zstd/2"],
                                                                     ["x"], [], None]))
        else:
            md.storage_data.pop(index)
    elif kind == "drop" and md.state_dict_metadata:
        md.state_dict_metadata.pop(data.draw(st.sampled_from(sorted(md.state_dict_metadata))))
    elif kind == "key" and md.state_dict_metadata:
        old = data.draw(st.sampled_from(sorted(md.state_dict_metadata)))
        new = data.draw(st.sampled_from(["", "a.b", "\udc80", "x\udcff", "x" * 300, "../up", old + "2"]))
        md.state_dict_metadata[new] = md.state_dict_metadata.pop(old)
        if data.draw(st.booleans()):  # consistently: its stored items too
            md.storage_data = {MetadataIndex(new if i.fqn == old else i.fqn, i.offset, i.index): v
                               for i, v in md.storage_data.items()}
    elif kind == "planner":
        md.planner_data = data.draw(st.one_of(st.none(), st.dictionaries(st.text(max_size=4), JSON, max_size=3)))


HOSTILE_VALUES = st.sampled_from(["dag", "deep", "meta", "surrogate", "cycle", "many"])


def _hostile_value(kind: str):
    if kind == "dag":
        node: list = [1]
        for _ in range(30):
            node = [node, node]
        return node
    if kind == "deep":
        node = []
        for _ in range(3000):
            node = [node]
        return node
    if kind == "meta":
        return {"t": torch.empty(4, device="meta")}
    if kind == "surrogate":
        return {"\udc80": 1}
    if kind == "cycle":
        node = [1]
        node.append(node)
        return node
    return list(range(100_000))  # large but plain: imports


def _replace_value(src: Path, md, kind: str) -> None:
    """Store the value ``step`` as a torch.save of a hostile value, in its own data file."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)
    try:
        stream = BytesIO()
        torch.save(_hostile_value(kind), stream)
    finally:
        sys.setrecursionlimit(limit)
    (src / "__7_0.distcp").write_bytes(stream.getvalue())
    for index, info in md.storage_data.items():
        if index.fqn == "step":
            info.relative_path, info.offset, info.length = "__7_0.distcp", 0, len(stream.getvalue())


@_settings(0.4)
@given(data=st.data())
def test_fuzzed_dcp_metadata_raise_only_checkpoint_errors(dcp_source, tmp_path_factory, data):
    work = tmp_path_factory.mktemp("dcpm")
    src = Path(shutil.copytree(dcp_source, work / "dcp"))
    md = copy.deepcopy(read_dcp_metadata(dcp_source))
    if data.draw(st.integers(0, 3)) == 0:
        _replace_value(src, md, data.draw(HOSTILE_VALUES))
    for _ in range(data.draw(st.integers(0 if md.storage_data else 1, 3))):
        _mutate_metadata(md, data)
    (src / ".metadata").write_bytes(pickle.dumps(md, protocol=data.draw(st.sampled_from([2, 4, 5]))))
    start = time.monotonic()
    _only_checkpoint_errors("dcp metadata", lambda: import_dcp(src, work / "a" / "step-00000001"))
    _cli_line([str(src), str(work / "b" / "step-00000001"), "--from", "dcp", "--quiet"])
    assert time.monotonic() - start < SECONDS


@_settings(0.2)
@given(file=st.sampled_from([".metadata", "__0_0.distcp", "__0_1.distcp"]),
       how=st.sampled_from(["cut", "flip", "random", "append", "zeros"]), where=st.floats(0, 1),
       noise=st.binary(min_size=1, max_size=64))
def test_fuzzed_dcp_files_raise_only_checkpoint_errors(dcp_source, tmp_path_factory, file, how, where, noise):
    work = tmp_path_factory.mktemp("dcpf")
    src = Path(shutil.copytree(dcp_source, work / "dcp"))
    raw = bytearray((src / file).read_bytes())
    at = min(int(where * len(raw)), len(raw) - 1)
    if how == "cut":
        raw = raw[:at]
    elif how == "flip":
        raw[at] ^= noise[0] or 1
    elif how == "random":
        raw[at:at + len(noise)] = noise
    elif how == "append":
        raw += noise
    else:
        raw[at:] = bytes(len(raw) - at)
    (src / file).write_bytes(bytes(raw))
    start = time.monotonic()
    outcome = _only_checkpoint_errors("dcp file", lambda: import_dcp(src, work / "a" / "step-00000001"))
    if outcome == "ok":  # what imported loads (a flip inside a value's padding may leave it intact)
        ckpt.read_manifest(work / "a" / "step-00000001")
    _cli_line([str(src), str(work / "b" / "step-00000001"), "--from", "dcp", "--quiet"])
    assert time.monotonic() - start < SECONDS


def test_report_import_fuzz_figures():
    print("\nimport fuzz outcomes:", dict(sorted(REPORT.items())))
