"""One trial of the corruption campaign (scripts/corruption_campaign.py): the pristine run restored,
one damage applied (scripts/corruption_damage.py), then the checks a-c of the campaign's docstring:
:func:`check_checkpoint_damage` (a) for a damaged checkpoint file, :func:`run_trial` the manager's
load (b) and the catalog's listing (c); the outcome and every violated expectation are recorded.
"""

from __future__ import annotations

import random
import shutil
from dataclasses import asdict
from pathlib import Path

import ckpt
from scripts.bitwise import equal
from scripts.corruption_damage import DATA_FILE, MANIFEST, Damage, apply_damage
from scripts.corruption_probes import load_copy, manager_load, probe_catalog, run_verify
from scripts.corruption_run import STEPS


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
        elif not equal(live, record["_saved"]):
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
    elif step is None or not equal(live, saved[step]):
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
