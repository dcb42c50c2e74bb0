"""ckpt.format.validate: every byte of a manifest is covered by its digest, checked before anything in it is
trusted; no field defaults silently; malformed JSON stays inside the error hierarchy; the manager
falls back past a damaged manifest but stops on a genuinely incompatible checkpoint."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

import ckpt
from ckpt.format.blobs import checksum
from ckpt.format import unseal
from ckpt.manager import CheckpointManager
from tests.support.checkpoints import reseal, step_path
from tests.support import models

MANIFEST = "manifest.json"


def _state(model, optim, scheduler, loader, step) -> dict:
    return {"model": model, "optim": optim, "lr_scheduler": scheduler, "loader": loader,
            "train": {"step": step, "tokens": step * 4096, "betas": (0.9, 0.95), "eps": 1e-8}}


def _run(root: Path) -> dict:
    """Two steps of a small model with AdamW, a scheduler and a loader position: step 1 a full
    checkpoint, step 2 a delta on it. Returns what each step holds."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 / (1 + s))
    loader = {"position": 0, "epoch": 0}
    expected = {}
    with CheckpointManager(root, full_every=2, keep=5) as manager:
        manager.attach(optim)
        for step in (1, 2):
            model(torch.randn(4, 16)).square().mean().backward()
            optim.step()
            optim.zero_grad()
            scheduler.step()
            loader["position"] += 37
            state = _state(model, optim, scheduler, loader, step)
            expected[step] = {**models.full_state(model, optim), "scheduler": scheduler.state_dict(),
                              "loader": dict(loader), "train": dict(state["train"])}
            manager.save(step, state)
    return expected


def _fresh():
    torch.manual_seed(123)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))
    optim = torch.optim.AdamW(model.parameters(), lr=5e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 / (1 + s))
    loader = {"position": -1, "epoch": -1}
    return model, optim, scheduler, loader, _state(model, optim, scheduler, loader, -1)


def _held(model, optim, scheduler, loader, state) -> dict:
    return {**models.full_state(model, optim), "scheduler": scheduler.state_dict(), "loader": dict(loader),
            "train": dict(state["train"])}


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("two_steps")
    return root, _run(root)


def _position_classes(raw: bytes) -> dict[str, list[int]]:
    """Byte positions of a compact JSON document by what they belong to: keys, numbers, strings
    (values), structure (braces, brackets, commas, colons, quotes)."""
    classes: dict[str, list[int]] = {"keys": [], "numbers": [], "strings": [], "structure": []}
    for match in re.finditer(rb'"((?:[^"\\]|\\.)*)"(\s*:)?', raw):
        kind = "keys" if match.group(2) else "strings"
        classes[kind].extend(range(match.start(1), match.end(1)))
        classes["structure"].extend([match.start(), match.end(1)])
    for match in re.finditer(rb"(?<![\w\"])-?\d+(\.\d+)?([eE][-+]?\d+)?", raw):
        classes["numbers"].extend(range(match.start(), match.end()))
    classes["structure"].extend(i for i, b in enumerate(raw) if b in b"{}[],:")
    return classes


def test_every_byte_of_a_manifest_is_covered(two_steps, tmp_path):
    """Random one-bit flips in every class of position of the newest step's manifest: no load
    succeeds silently, and the manager falls back to the older good step, bit for bit, every time."""
    root, expected = two_steps
    raw = (step_path(root, 2) / MANIFEST).read_bytes()
    classes = _position_classes(raw)
    rng = random.Random(0)
    trials = [(kind, rng.choice(positions), rng.randrange(8)) for kind, positions in sorted(classes.items())
              for _ in range(12)]
    copy = tmp_path / "root"
    for kind, position, bit in trials:
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(root, copy)
        damaged = bytearray(raw)
        damaged[position] ^= 1 << bit
        (step_path(copy, 2) / MANIFEST).write_bytes(bytes(damaged))
        *parts, state = _fresh()
        with pytest.raises(ckpt.CorruptCheckpointError):
            ckpt.load(state, step_path(copy, 2))
        *parts, state = _fresh()
        with CheckpointManager(copy) as manager, pytest.warns(UserWarning, match="falling back"):
            assert manager.load(state) == 1, (kind, position, bit)
        models.assert_same(_held(*parts, state), expected[1], f"{kind} byte {position} bit {bit}")


def test_a_changed_digit_in_a_value_is_caught(two_steps, tmp_path):
    """What the digest exists for: the loader position, the scheduler and the optimizer's
    hyper-parameters live only in the manifest."""
    root, _ = two_steps
    raw = (step_path(root, 2) / MANIFEST).read_bytes()
    position = raw.index(b'"position":') + len(b'"position":')
    copy = tmp_path / "root"
    shutil.copytree(root, copy)
    damaged = bytearray(raw)
    damaged[position] = ord("9") if damaged[position] != ord("9") else ord("8")
    (step_path(copy, 2) / MANIFEST).write_bytes(bytes(damaged))
    with pytest.raises(ckpt.CorruptCheckpointError, match="digest mismatch") as info:
        ckpt.read_manifest(step_path(copy, 2))
    assert info.value.file == MANIFEST and info.value.path == str(step_path(copy, 2))


def test_no_field_defaults_silently(two_steps, tmp_path):
    """A delta chunk whose codec key is gone must not load as raw bytes (it used to)."""
    root, _ = two_steps
    for drop in ("codec", "kind", "files", "world_size", "user"):
        copy = tmp_path / drop
        shutil.copytree(root, copy)

        def mutate(doc, drop=drop):
            if drop == "codec":
                for entry in doc["tensors"].values():
                    for chunk in entry["chunks"]:
                        chunk.pop("codec")
            else:
                doc.pop(drop)

        reseal(step_path(copy, 2), mutate)
        with pytest.raises(ckpt.InvalidManifestError, match=f"'{drop}' is missing"):
            ckpt.read_manifest(step_path(copy, 2))


def test_run_is_the_one_optional_field_and_is_checked_when_present(two_steps, tmp_path):
    """Issue 22: a manifest records the run that wrote it (``run``); older ones have none and still load."""
    root, _ = two_steps
    assert ckpt.read_manifest(step_path(root, 2)).run is not None  # a manager's steps name their run
    for value, ok in ((None, True), ("a" * 64, True), (123, False), ("../x", False), ("a" * 65, False), ("", False)):
        copy = tmp_path / f"run-{len(str(value))}-{type(value).__name__}-{ok}"
        shutil.copytree(root, copy)

        def mutate(doc, value=value):
            doc.pop("run", None)
            if value is not None:
                doc["run"] = value

        reseal(step_path(copy, 2), mutate)
        if ok:
            assert ckpt.read_manifest(step_path(copy, 2)).run == value
        else:
            with pytest.raises(ckpt.InvalidManifestError, match="run must be"):
                ckpt.read_manifest(step_path(copy, 2))


def test_version_1_manifests_are_still_read(tmp_path):
    state = {"w": torch.randn(8, 8), "step": 3}
    ckpt.save(state, tmp_path / "c")
    doc = json.loads((tmp_path / "c" / MANIFEST).read_bytes())
    doc.pop("digest")
    doc["format_version"] = 1
    (tmp_path / "c" / MANIFEST).write_bytes(json.dumps(doc, separators=(",", ":")).encode())
    live = {"w": torch.zeros(8, 8), "step": 0}
    ckpt.load(live, tmp_path / "c")
    assert torch.equal(live["w"], state["w"]) and live["step"] == 3
    doc["format_version"] = 2  # a version-2 manifest without its digest is damaged, not old
    (tmp_path / "c" / MANIFEST).write_bytes(json.dumps(doc, separators=(",", ":")).encode())
    with pytest.raises(ckpt.CorruptCheckpointError, match="digest is missing"):
        ckpt.read_manifest(tmp_path / "c")


@pytest.mark.parametrize("body", [b"[" * 100_000 + b"]" * 100_000, b'{"format":"ckpt","format_version":' + b"7" * 5000 + b"}"],
                         ids=["deeply-nested", "5000-digit-int"])
def test_malformed_json_stays_in_the_hierarchy_and_the_manager_falls_back(two_steps, tmp_path, body):
    root, expected = two_steps
    copy = tmp_path / "root"
    shutil.copytree(root, copy)
    (step_path(copy, 2) / MANIFEST).write_bytes(body)
    with pytest.raises(ckpt.InvalidManifestError):
        ckpt.read_manifest(step_path(copy, 2))
    *parts, state = _fresh()
    with CheckpointManager(copy) as manager, pytest.warns(UserWarning, match="falling back"):
        assert manager.load(state) == 1
    models.assert_same(_held(*parts, state), expected[1])


@pytest.mark.parametrize("depth", [700, 100_000])
def test_deeply_nested_value_in_a_sealed_manifest_is_refused(tmp_path, depth):
    """Sealed correctly (a hostile author, not damage) and nested deeper than Python recurses."""
    ckpt.save({"w": torch.zeros(2), "cfg": {"a": 1}}, tmp_path / "c")
    reseal(tmp_path / "c", lambda doc: doc["values"]["cfg"].update(value="NESTED"))
    body, _, _ = unseal((tmp_path / "c" / MANIFEST).read_bytes())
    body = body.replace(b'"NESTED"', b"[" * depth + b"1" + b"]" * depth)
    (tmp_path / "c" / MANIFEST).write_bytes(body[:-1] + b',"digest":"' + checksum(body).encode() + b'"}')
    with pytest.raises(ckpt.InvalidManifestError):
        ckpt.load({"w": torch.zeros(2), "cfg": None}, tmp_path / "c")


def test_an_incompatible_checkpoint_stops_with_the_full_report(two_steps):
    """Not damage: the user changed the model. The manager must not fall back silently."""
    root, _ = two_steps
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Linear(64, 8))  # another width
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0)
    state = _state(model, optim, scheduler, {"position": 0}, 0)
    with CheckpointManager(root) as manager, pytest.raises(ckpt.IncompatibleCheckpointError) as info:
        manager.load(state)
    assert "model.0.weight" in str(info.value) and str(step_path(root, 2)) in str(info.value)
    assert info.value.path == str(step_path(root, 2))


@pytest.mark.parametrize("where", ["shape", "chunk offsets", "chunk sizes", "blob offset", "path", "world_size"])
def test_a_boolean_is_never_a_number(tmp_path, where):
    """JSON's true/false equal 1/0 in Python: each field below holds a 0 or a 1 that the boolean would
    pass for, and is refused (the parser's exact-type checks, ``type(v) is int``, must keep refusing bool)."""
    ckpt.save({"w": torch.zeros(1), "layers": [torch.zeros(2)]}, tmp_path / "c")

    def mutate(doc):
        chunk = doc["tensors"]["w"]["chunks"][0]
        first = min((c for e in doc["tensors"].values() for c in e["chunks"]), key=lambda c: c["offset"])
        if where == "shape":
            doc["tensors"]["w"]["shape"] = [True]
        elif where == "chunk offsets":
            chunk["offsets"] = [False]
        elif where == "chunk sizes":
            chunk["sizes"] = [True]
        elif where == "blob offset":
            first["offset"] = False
        elif where == "path":
            key, path = next((k, p) for k, p in doc["paths"].items() if 0 in p)
            doc["paths"][key] = [False if part == 0 and type(part) is int else part for part in path]
        else:
            doc["world_size"] = True

    reseal(tmp_path / "c", mutate)
    with pytest.raises(ckpt.InvalidManifestError):
        ckpt.read_manifest(tmp_path / "c")
