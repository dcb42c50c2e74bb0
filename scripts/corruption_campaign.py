#!/usr/bin/env python
"""Corruption campaign: one damage per trial to a small replicated run; nothing may load silently.

    .venv/bin/python scripts/corruption_campaign.py --trials 1000 --seed 1 --out campaign.json

The run: a :class:`ckpt.CheckpointManager` (``interval=1``, ``keep=5``, ``full_every=3``) saves steps
1..5 (full, delta, delta, full, delta) of a small state (four tensors, one of them bf16, one of 80 KiB
so that a full checkpoint's data file has alignment padding, a ``torch.save`` value and JSON values)
to a primary with one local replica and the LMDB catalog on. Each trial restores that run to the same
absolute paths (so the catalog's mount list stays valid), applies ONE damage and checks:

a. damage to a checkpoint file (a data file or a manifest, on the primary or the replica):
   ``ckpt-inspect PRIMARY --verify --mount REPLICA`` exits 1 with a failure naming the mount, step
   and file (and the tensor when the damage hit a blob's bytes), and ``ckpt.load`` of that copy
   raises :class:`~ckpt.CorruptCheckpointError` naming the file (and the tensor);
b. ``manager.load(state)`` on a new manager configured with the replica returns the newest step,
   bitwise equal to what was saved at that step (from the replica when the primary's copy is bad,
   with a warning saying so); every loaded state is compared with the saved one of the step the
   load returned: a mismatch is a *silent load*;
c. damage to the catalog's ``data.mdb``/``lock.mdb``: the manager's catalog lists the same steps,
   kinds, sizes and mount states as before the damage. The catalog is first opened in a forked
   child on a copy (a crash of LMDB on damaged pages would otherwise end the campaign), which also
   classifies the damage: unreadable (rebuilt), listing unchanged, or listing changed.

Damage kinds: ``bitflip`` (one bit), ``byte`` (one byte set to another value), ``truncate`` (to a
random shorter length), ``delete``. Offsets inside data files are drawn half of the time uniformly
over the file and half of the time by first picking a region (a blob or a gap between blobs)
uniformly, so that alignment padding is hit often enough to be measured.

Outcomes of a checkpoint-file damage (``outcome``):

* ``detected``: (a) holds;
* ``uncovered``: no checksum covers the damaged bytes (alignment padding between blobs): verify
  passes and every load is exact. Reported as a finding, not hidden;
* ``uncommitted``: the manifest was deleted, so by the commit protocol the copy is not a committed
  checkpoint any more (verify does not see it; ``ckpt.load`` raises CheckpointNotFoundError; on the
  primary the next manager removes the directory as the leftover of an interrupted deletion);
* ``problem``: anything else (listed in ``problems``).

``problems`` collects every violated expectation; ``silent_loads`` counts loads whose content was not
the saved content of the returned step. The module is importable: :func:`run_campaign` is what
``tests/reliability/test_corruption.py`` runs with 30 trials.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import io
import json
import logging
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import ckpt
from ckpt.root.catalog.store import Catalog, mount_id, open_catalog
from ckpt.format import MANIFEST_NAME, data_file_name, step_name
from ckpt.storage import locate
from tools import inspection

STEPS = (1, 2, 3, 4, 5)
KEEP = 5
FULL_EVERY = 3
DATA_FILE = data_file_name(0)
MANIFEST = MANIFEST_NAME
KINDS = ("bitflip", "byte", "truncate", "delete")
PLACES = ("primary-data", "primary-manifest", "replica-data", "replica-manifest", "catalog")
CATALOG_FILES = ("data.mdb", "lock.mdb")
MANAGER_OPTIONS = dict(interval=1, keep=KEEP, full_every=FULL_EVERY, replica_retry_initial=0.05,
                       replica_retry_max=0.2, close_timeout=1.0)
# Known bugs, each with a strict xfail test in tests/reliability/test_corruption.py; a problem whose
# text starts with one of these tags is that bug. None is open: the three this campaign found (a
# truncated catalog killing its opener, damage inside a catalog record served as is, a replica step
# directory without a manifest never re-copied) are fixed and tested as ordinary tests.
KNOWN_BUGS: dict[str, str] = {}


# -- the run -------------------------------------------------------------------------------------
def make_state(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(96, 256, generator=gen),  # 96 KiB: starts at a 4096 boundary
            "b": torch.randn(300, generator=gen),
            "h": torch.randn(64, 64, generator=gen).to(torch.bfloat16),
            "z": torch.randn(64, 320, generator=gen),  # 80 KiB after packed blobs: padding before it
        },
        "seen": {1, 2, 3},  # no JSON form: a torch.save value blob
        "lr": 0.1,
        "step": 0,
    }


def blank_state() -> dict:
    """The live state a load fills: same layout, contents that match no saved step."""
    return {
        "model": {
            "w": torch.full((96, 256), 7.0),
            "b": torch.full((300,), 7.0),
            "h": torch.full((64, 64), 7.0, dtype=torch.bfloat16),
            "z": torch.full((64, 320), 7.0),
        },
        "seen": None,
        "lr": -1.0,
        "step": -1,
    }


def clone(state):
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: clone(v) for k, v in state.items()}
    if isinstance(state, set):
        return set(state)
    return state


def same_state(actual, expected) -> bool:
    """Bitwise equality (tensors compared as bytes: NaN- and -0.0-safe)."""
    if isinstance(expected, torch.Tensor):
        return (isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype
                and actual.shape == expected.shape
                and torch.equal(actual.contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8)))
    if isinstance(expected, dict):
        return isinstance(actual, dict) and actual.keys() == expected.keys() and all(
            same_state(actual[k], v) for k, v in expected.items())
    return type(actual) is type(expected) and actual == expected


def build_run(work: Path) -> dict[int, dict]:
    """Save steps 1..5 under ``work/primary`` with ``work/replica``; the states saved, by step."""
    state, saved = make_state(), {}
    with ckpt.CheckpointManager(work / "primary", replicas=[str(work / "replica")], **MANAGER_OPTIONS) as manager:
        for step in STEPS:
            manager.before_step()  # the previous snapshot no longer needs the live tensors
            model = state["model"]
            model["w"][step] += 1.0
            model["h"][step] -= 1
            if step % 2 == 0:
                model["z"][step] *= 2.0
            state["seen"] = {1, 2, 3, 10 + step}
            state["step"] = step
            manager.save(step, state)
            saved[step] = clone(state)
        manager.wait()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status = manager.replication_status()
            if all(set(status.get(s, {}).values()) == {"committed"} for s in STEPS):
                break
            time.sleep(0.02)
        else:
            raise RuntimeError(f"replication did not finish: {manager.replication_status()}")
    return saved


def catalog_listing(path: str | os.PathLike) -> list:
    """What the catalog at ``path`` says, without the times of state changes (a rebuild takes them
    from the manifests)."""
    with Catalog(path, readonly=True) as catalog:
        return listing_of(catalog)


def listing_of(catalog: Catalog) -> list:
    return [[i.step, i.kind, i.base_step, i.bytes, i.raw_bytes, i.tensors, i.created,
             sorted((m, s.state) for m, s in i.mounts.items())] for i in catalog.steps()]


# -- damage --------------------------------------------------------------------------------------
@dataclass
class Damage:
    place: str  # one of PLACES
    kind: str  # one of KINDS
    file: str  # relative to the checkpoint (data/..., manifest.json) or to the catalog (data.mdb)
    path: str  # absolute
    size: int  # before the damage
    mount: str | None = None  # mount_id of the mount (checkpoint files)
    step: int | None = None
    offset: int | None = None  # bitflip/byte: the byte; truncate: the new length
    detail: str = ""  # bit, old -> new byte
    region: str | None = None  # data file: the blob's key, "padding"; manifest: "body", "digest"
    hit: list = field(default_factory=list)  # keys of the blobs whose bytes the damage changed


def blobs_of(step_dir: Path) -> list[tuple[str, int, int]]:
    """``(key, offset, length)`` of every non-empty blob in the step's data file, by offset."""
    manifest = ckpt.read_manifest(step_dir)
    found = [(key, blob.offset, blob.length) for key, blob in manifest.blobs() if blob.file == DATA_FILE]
    return sorted((b for b in found if b[2] > 0), key=lambda b: b[1])


def regions(blobs: list[tuple[str, int, int]], size: int) -> list[tuple[str, int, int]]:
    """The file cut into blobs and the gaps between them (``"padding"``): ``(name, start, end)``."""
    out, position = [], 0
    for key, offset, length in blobs:
        if offset > position:
            out.append(("padding", position, offset))
        out.append((key, offset, offset + length))
        position = max(position, offset + length)
    if position < size:
        out.append(("padding", position, size))
    return out


def region_at(cut: list[tuple[str, int, int]], offset: int) -> str:
    return next(name for name, start, end in cut if start <= offset < end)


def apply_damage(rng: random.Random, work: Path, layouts: dict, *, place: str | None = None,
                 kind: str | None = None, step: int | None = None, offset: int | None = None) -> Damage:
    """One random damage (``place``/``kind``/``step``/``offset`` force a choice)."""
    place = place or rng.choice(PLACES)
    kind = kind or rng.choice(KINDS)
    if place == "catalog":
        name = rng.choice(CATALOG_FILES)
        path = work / "primary" / ".catalog" / name
        damage = Damage(place, kind, name, str(path), path.stat().st_size)
    else:
        mount = work / place.split("-")[0]
        step = step or rng.choice(STEPS)
        name = DATA_FILE if place.endswith("data") else MANIFEST
        path = mount / step_name(step) / name
        damage = Damage(place, kind, name, str(path), path.stat().st_size, mount=mount_id(locate(mount)), step=step)
    raw = bytearray(path.read_bytes())
    size = len(raw)
    cut = layouts.get(step) if name == DATA_FILE else None
    if kind == "delete":
        path.unlink()
        return damage
    if kind == "truncate":
        damage.offset = rng.randrange(size) if offset is None else offset
        path.write_bytes(bytes(raw[: damage.offset]))
        if cut is not None:
            damage.region = region_at(cut, damage.offset)
            damage.hit = [key for key, start, end in cut if key != "padding" and end > damage.offset]
        return damage
    if offset is None:
        if cut is not None and rng.random() < 0.5:  # stratified: a region first
            _name, start, end = rng.choice(cut)
            offset = rng.randrange(start, end)
        else:
            offset = rng.randrange(size)
    damage.offset = offset
    tail = bytes(raw).rfind(b',"digest":"')
    old = raw[offset]
    if kind == "bitflip":
        bit = rng.randrange(8)
        raw[offset] ^= 1 << bit
        damage.detail = f"bit {bit}: {old:#04x} -> {raw[offset]:#04x}"
    else:
        raw[offset] = rng.choice([b for b in range(256) if b != old])
        damage.detail = f"{old:#04x} -> {raw[offset]:#04x}"
    path.write_bytes(bytes(raw))
    if cut is not None:
        damage.region = region_at(cut, offset)
        damage.hit = [] if damage.region == "padding" else [damage.region]
    elif name == MANIFEST:
        damage.region = "digest" if tail != -1 and offset >= tail else "body"
    return damage


# -- checks --------------------------------------------------------------------------------------
class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(f"{record.name}: {record.getMessage()}")


@contextlib.contextmanager
def captured_logs():
    """The engine's log lines (INFO and up) of the block, kept from the console."""
    logger, handler = logging.getLogger("ckpt"), _Collect()
    level, propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def run_verify(work: Path) -> tuple[int, dict | None, str]:
    """``ckpt-inspect PRIMARY --verify --mount REPLICA --json``: exit code, JSON summary, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), captured_logs():
        code = inspection.main([str(work / "primary"), "--verify", "--mount", str(work / "replica"),
                                "--quiet", "--json"])
    try:
        doc = json.loads(out.getvalue())
    except ValueError:
        doc = None
    return code, doc, err.getvalue()


def load_copy(step_dir: Path) -> tuple[dict, BaseException | None]:
    live = blank_state()
    try:
        with captured_logs(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ckpt.load(live, step_dir)
    except BaseException as exc:  # classified by the caller; KeyboardInterrupt still ends the run
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        return live, exc
    return live, None


def manager_load(work: Path) -> dict:
    """A new manager on the damaged run loads, then closes (waiting briefly for the replica to catch
    up): step, state, error, warnings, log lines, replication status, catalog listing."""
    live, step, error, status = blank_state(), None, None, {}
    with captured_logs() as logs, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            manager = ckpt.CheckpointManager(work / "primary", replicas=[str(work / "replica")], **MANAGER_OPTIONS)
            with manager:
                step = manager.load(live)
            status = manager.replication_status()
        except Exception as exc:
            error = exc
    listing = catalog_listing(work / "primary" / ".catalog") if error is None else []
    return {"step": step, "state": live, "error": error, "warnings": [str(w.message) for w in caught],
            "logs": logs, "replication": status, "listing": listing}


def _catalog_child(copy: str, mounts: list[str], expected: list) -> int:
    """In a forked child: (plain read: 0 same, 1 differs, 2 error) * 3 + (open_catalog: same, differs, error)."""
    logging.disable(logging.CRITICAL)
    try:
        with Catalog(copy) as catalog:
            before = 0 if listing_of(catalog) == expected else 1
    except Exception:
        before = 2
    try:
        with open_catalog(copy, [locate(m) for m in mounts]) as catalog:
            after = 0 if listing_of(catalog) == expected else 1
    except Exception:
        after = 2
    return before * 3 + after


def probe_catalog(work: Path, expected: list, timeout: float = 60.0) -> tuple[str, str]:
    """Open a copy of the damaged catalog in a forked child: (plain read, open_catalog) outcomes,
    each ``same``/``differs``/``error``, or ``crash: ...``/``hang``."""
    names = ("same", "differs", "error")
    with tempfile.TemporaryDirectory(prefix="catalog-probe-") as tmp:
        copy = os.path.join(tmp, "catalog")
        shutil.copytree(work / "primary" / ".catalog", copy)
        mounts = [str(work / "primary"), str(work / "replica")]
        if not hasattr(os, "fork"):
            code = _catalog_child(copy, mounts, expected)
            return names[code // 3], names[code % 3]
        outcome = forked(lambda: 10 + _catalog_child(copy, mounts, expected), timeout)
    if outcome == "hang":
        return "hang", "hang"
    if isinstance(outcome, str):
        return f"crash: {outcome}", "crash"
    code = outcome - 10
    if not 0 <= code < 9:
        return f"crash: exit {code + 10}", "crash"
    return names[code // 3], names[code % 3]


def forked(child, timeout: float) -> int | str:
    """``child()`` (returning an exit code) in a forked process: its exit code, ``"signal N"`` when a
    signal killed it (a SIGBUS there is a finding, not the end of this process), or ``"hang"``."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 99
        faulthandler.disable()  # a crash here is the finding, reported by the parent: no dump
        try:
            code = child()
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "hang"
        time.sleep(0.005)
    return f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


# -- one trial -----------------------------------------------------------------------------------
def _named(failures: list[dict], damage: Damage) -> list[dict]:
    return [f for f in failures if f["mount"] == damage.mount and f["step"] == damage.step and f["file"] == damage.file]


def check_checkpoint_damage(work: Path, damage: Damage, record: dict) -> list[str]:
    """Check (a) for a damaged checkpoint file; the outcome goes to ``record``; problems returned."""
    problems = []
    code, doc, err = run_verify(work)
    failures = doc["failures"] if doc else []
    named = _named(failures, damage)
    record["verify"] = {"exit": code, "failures": len(failures),
                        "named": sorted({f["tensor"] or "-" for f in named})}
    live, error = load_copy(Path(damage.path).parent.parent if damage.file == DATA_FILE else Path(damage.path).parent)
    record["load_copy"] = "ok" if error is None else f"{type(error).__name__}: {error}"[:300]
    if error is not None:
        record["load_copy_names"] = {"file": getattr(error, "file", None), "tensor": getattr(error, "tensor", None)}
    if error is not None and not isinstance(error, ckpt.CheckpointError):
        problems.append(f"ckpt.load raised a non-CheckpointError {type(error).__name__}: {error}")
    if damage.kind == "delete" and damage.file == MANIFEST:
        record["outcome"] = "uncommitted"
        if not isinstance(error, ckpt.CheckpointNotFoundError):
            problems.append(f"ckpt.load of a copy without manifest: expected CheckpointNotFoundError, got {error!r}")
        if named:
            problems.append(f"verify names a step that is not committed: {named}")
        if code != 0:
            problems.append(f"verify exit {code} ({err.strip()}) for an uncommitted copy")
        return problems
    if damage.region == "padding" and damage.kind in ("bitflip", "byte"):
        record["outcome"] = "uncovered"
        if code != 0 or error is not None:
            record["outcome"] = "detected"  # would be news: nothing covers padding
        elif not same_state(live, record["_saved"]):
            problems.append("a padding flip changed the loaded state")
        return problems
    record["outcome"] = "detected"
    if code != 1:
        problems.append(f"verify exit {code}, expected 1")
    if not named:
        problems.append(f"verify names no failure at {damage.mount} step {damage.step} {damage.file}: {failures}")
    if damage.file == DATA_FILE and damage.hit:
        tensors = {f["tensor"] for f in named}
        expected = set(damage.hit)
        if damage.kind == "truncate":
            # every blob reaching beyond the cut fails; the one holding the cut (if any) among them
            if not expected <= tensors:
                problems.append(f"verify names {sorted(tensors, key=str)}, expected all of {sorted(expected)}")
        elif tensors != expected:
            problems.append(f"verify names tensors {sorted(tensors, key=str)}, expected {sorted(expected)}")
    if not isinstance(error, ckpt.CorruptCheckpointError):
        problems.append(f"ckpt.load of the damaged copy: expected CorruptCheckpointError, got {error!r}")
    else:
        if error.file != damage.file:
            problems.append(f"ckpt.load's error names file {error.file!r}, expected {damage.file!r}")
        if damage.file == DATA_FILE and damage.hit and damage.kind != "delete" and error.tensor not in damage.hit:
            problems.append(f"ckpt.load's error names tensor {error.tensor!r}, expected one of {damage.hit}")
    if record["outcome"] == "detected" and problems:
        record["outcome"] = "problem"
    return problems


def run_trial(work: Path, pristine: Path, saved: dict[int, dict], layouts: dict, expected_listing: list,
              rng: random.Random, **force) -> dict:
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(pristine, work, symlinks=True)
    damage = apply_damage(rng, work, layouts, **force)
    record: dict = {"damage": asdict(damage), "problems": []}
    problems = record["problems"]
    newest = max(STEPS)
    if damage.place == "catalog":
        before, after = probe_catalog(work, expected_listing)
        record["catalog_probe"] = {"read": before, "open_catalog": after}
        if after == "crash" or after == "hang":
            record["outcome"] = after
            problems.append(f"opening the damaged catalog kills the process ({before})")
            return record
        code, _doc, err = run_verify(work)
        record["verify"] = {"exit": code}
        if code != 0:
            problems.append(f"verify exit {code} after catalog damage: {err.strip()}")
    else:
        record["_saved"] = saved[damage.step]
        problems += check_checkpoint_damage(work, damage, record)
        record.pop("_saved")
    result = manager_load(work)
    step, live, error, warned, logs = (result[k] for k in ("step", "state", "error", "warnings", "logs"))
    listing = result["listing"]
    unfinished = {s: states for s, states in result["replication"].items()
                  if set(states.values()) - {"committed", "dropped"}}
    if unfinished:
        record["replication_unfinished"] = unfinished
        stuck = [line for line in logs if "already exists" in line]
        problems.append(f"replication unfinished at close: {unfinished}"
                        + (f" ({stuck[-1][:200]})" if stuck else ""))
    load = {"step": step, "error": None if error is None else f"{type(error).__name__}: {error}"[:300],
            "warnings": warned[:5], "served_by_replica": any("served by" in line for line in logs)}
    record["manager_load"] = load
    if error is not None:
        load["source"] = "error"
        problems.append(f"manager.load raised {type(error).__name__}: {error}")
    elif step is None or not same_state(live, saved[step]):
        load["source"] = "silent"
        record["silent"] = True
        problems.append(f"SILENT LOAD: manager.load returned step {step} whose content is not that step's")
    else:
        replica = any("loaded from replica" in w for w in warned)
        fallback = any("falling back" in w for w in warned)
        load["source"] = ("older step" if step != newest else "replica" if replica
                          else "primary, base link from replica" if load["served_by_replica"] else "primary")
        if step != newest:
            problems.append(f"manager.load fell back to step {step} although the replica's copy of {newest} is intact")
        if step != newest and not fallback:
            problems.append("an older step was loaded without a warning")
        primary_newest_bad = (damage.place.startswith("primary") and damage.step == newest
                              and record.get("outcome") in ("detected", "uncommitted", "problem"))
        if primary_newest_bad and not replica:
            problems.append(f"the primary's step {newest} is damaged but no warning says the replica served it")
        if replica and not primary_newest_bad:
            problems.append(f"loaded from the replica although the primary's step {newest} is intact")
    if damage.place == "catalog":
        record["catalog_same"] = listing == expected_listing
        if not record["catalog_same"]:
            record["outcome"] = "listing changed"
            problems.append("the manager's catalog lists something else than "
                            f"before the damage (plain read: {record['catalog_probe']['read']})")
        else:
            record["outcome"] = {"error": "unreadable, rebuilt", "differs": "changed, rebuilt",
                                 "same": "no effect"}.get(record["catalog_probe"]["read"], "?")
    return record


# -- the campaign --------------------------------------------------------------------------------
def run_campaign(trials: int, seed: int, *, workdir: str | os.PathLike | None = None, progress=None,
                 **force) -> dict:
    """Build the run once, then ``trials`` trials of one random damage each; the report (a dict)."""
    start = time.perf_counter()
    rng = random.Random(seed)
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="corruption-campaign-"))
        top = Path(workdir)
        work, pristine = top / "run", top / "pristine"
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(pristine, ignore_errors=True)
        with captured_logs():
            saved = build_run(work)
        code, doc, err = run_verify(work)
        if code != 0:
            raise RuntimeError(f"the undamaged run does not verify: {err} {doc}")
        expected_listing = catalog_listing(work / "primary" / ".catalog")
        layouts = {}
        for step in STEPS:
            step_dir = work / "primary" / step_name(step)
            layouts[step] = regions(blobs_of(step_dir), (step_dir / DATA_FILE).stat().st_size)
        shutil.copytree(work, pristine, symlinks=True)
        built = time.perf_counter() - start
        records = []
        for number in range(trials):
            record = run_trial(work, pristine, saved, layouts, expected_listing, rng, **force)
            record["trial"] = number
            records.append(record)
            if progress is not None:
                progress(number, record)
        shutil.rmtree(work, ignore_errors=True)
    return summarise(records, seed=seed, seconds=time.perf_counter() - start, build_seconds=built,
                     layouts=layouts)


def summarise(records: list[dict], **extra) -> dict:
    by_place_kind = Counter(f"{r['damage']['place']}/{r['damage']['kind']}" for r in records)
    outcomes = Counter(f"{r['damage']['place']}: {r.get('outcome')}" for r in records)
    sources = Counter(r["manager_load"]["source"] for r in records if "manager_load" in r)
    padding = [r for r in records if r["damage"].get("region") == "padding" and r["damage"]["kind"] in ("bitflip", "byte")]
    return {
        "trials": len(records),
        "seconds": round(extra.pop("seconds"), 2),
        "build_seconds": round(extra.pop("build_seconds"), 2),
        **extra,
        "applied": dict(sorted(by_place_kind.items())),
        "outcomes": dict(sorted(outcomes.items())),
        "checkpoint_damages": sum(r["damage"]["place"] != "catalog" for r in records),
        "detected": sum(r.get("outcome") == "detected" for r in records),
        "uncovered": len(padding),
        "uncommitted": sum(r.get("outcome") == "uncommitted" for r in records),
        "catalog_damages": sum(r["damage"]["place"] == "catalog" for r in records),
        "catalog_listing_changed": sum(r.get("catalog_same") is False for r in records),
        "manager_load_sources": dict(sorted(sources.items())),
        "silent_loads": sum(bool(r.get("silent")) for r in records),
        "problems": [{"trial": r["trial"], "damage": r["damage"], "problems": r["problems"]}
                     for r in records if r["problems"]],
        "records": records,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the report (JSON) here")
    p.add_argument("--workdir", help="where the run and its copies live (default: a temporary directory)")
    args = p.parse_args(argv)

    def progress(number, record):
        if (number + 1) % 50 == 0 or record["problems"]:
            flag = " PROBLEM: " + "; ".join(record["problems"]) if record["problems"] else ""
            print(f"trial {number + 1}/{args.trials}{flag}", file=sys.stderr, flush=True)

    report = run_campaign(args.trials, args.seed, workdir=args.workdir, progress=progress)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    short = {k: v for k, v in report.items() if k not in ("records", "layouts")}
    short["problems"] = len(report["problems"])
    print(json.dumps(short, indent=1, default=str))
    return 1 if report["silent_loads"] or report["problems"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
