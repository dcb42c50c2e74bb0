"""The crash harness's checks (scripts/crash_harness.py), on folders no process of the job touches.

**After every kill** (:func:`check_after_kill`, each mount by :func:`check_mount`):

- every listed step (``CheckpointRoot.steps()``) of the primary is a ``step-N`` directory holding
  ``manifest.json`` (no partial step, no ``.tmp-`` / ``.old-`` entry listed), its manifest parses
  and names step N;
- every listed delta's chain (``manifest.base_step``, ``manifest.base``) walks down to a full
  checkpoint through listed, committed steps of the same mount;
- every listed step loads: every tensor through ``ckpt.convert.full_tensors`` (every chunk
  verified, deltas replayed through the chain on that mount only) and every value decoded — the
  newest step (the one a restart resumes from) included;
- the same on the replica, for its own listing; a step listed on both mounts has byte-identical
  manifests;
- (in the campaign) after the restart, the job resumed from exactly the newest step listed here
  (its log's ``resumed from checkpoint step N``; when it was killed again before saying so, not
  checked).

Leftovers (``.tmp-``/``.old-`` entries, step directories without a manifest) and committed deltas
that the listing hides (base gone) are recorded, not failures: the listing must not offer them and
the next manager collects the primary's.

**At the end of each run** (:func:`compare_runs`): every step's loss and learning rate in
``metrics.jsonl`` — every record, re-run steps included — equals the reference's bit for bit; the
final checkpoint's tensors (model and optimizer, through ``full_tensors``) and values equal the
reference's final checkpoint byte for byte (:func:`compare_checkpoints`), on the primary and on the
replica; and no step the primary lists has a replica directory without a manifest
(:func:`blocked_replica_steps`: a killed replica deletion's leftover, which the replica's worker
collects; see tests/reliability/test_crash.py's killed-deletion tests).
"""

from __future__ import annotations

import time
from pathlib import Path

import ckpt
from ckpt.convert import full_tensors
from ckpt.format import MANIFEST_NAME, is_leftover, step_name, step_of_entry
from ckpt.read import ChunkSource, read_manifest_bytes
from ckpt.root import CheckpointRoot
from ckpt.storage import locate
from scripts.bitwise import equal
from scripts.crash_job import RunPaths
from scripts.crash_watch import listing, read_metrics, unmanifested


def load_step(path: Path):
    """Every tensor (verified, deltas replayed on this mount) and value of the checkpoint at ``path``:
    (manifest, {key: tensor}, {key: value})."""
    manifest = ckpt.read_manifest(path)
    tensors = dict(full_tensors(path, manifest=manifest))
    with ChunkSource(locate(path), manifest) as source:
        values = {key: source.value(key, entry) for key, entry in manifest.values.items()}
    return manifest, tensors, values


def _read_listed(path: Path, listed: list[int], names: list[str], problems: list[str]) -> dict:
    """The manifests of the listed steps, by step; what is wrong with each goes to ``problems``."""
    manifests = {}
    for step in listed:
        directory = path / step_name(step)
        if step_name(step) not in names or not directory.is_dir():
            problems.append(f"{path}: step {step} listed, but there is no directory {step_name(step)}")
            continue
        if not (directory / MANIFEST_NAME).is_file():
            problems.append(f"{path}: step {step} listed without a manifest (a partial step)")
            continue
        try:
            manifests[step] = ckpt.read_manifest(directory)
        except ckpt.CheckpointError as exc:
            problems.append(f"{path}: step {step} listed, its manifest does not read: {exc}")
            continue
        if manifests[step].step != step:
            problems.append(f"{path}: {step_name(step)}'s manifest names step {manifests[step].step}")
    return manifests


def _chain_problem(path: Path, step: int, manifests: dict, listed: list[int]) -> str | None:
    """What breaks listed step ``step``'s chain down to a full checkpoint on this mount (None: nothing)."""
    seen, current, link = {step}, manifests[step], step
    while current.base_step is not None:
        base = current.base_step
        if current.base != step_name(base):
            return f"{path}: step {link} names base {current.base!r} for base_step {base}"
        if base in seen:
            return f"{path}: step {step}'s chain loops at {base}"
        if base not in listed or base not in manifests:
            return (f"{path}: listed step {step} (a delta) lacks its base step {base}"
                    f" (chain {sorted(seen, reverse=True)})")
        seen.add(base)
        current, link = manifests[base], base
    if current.kind != "full":
        return f"{path}: step {step}'s chain ends at step {link}, kind {current.kind!r}, no base"
    return None


def check_mount(path: Path, *, verify: bool = True) -> dict:
    """The checks of one mount's listing (the module docstring). Returns ``{"listed", "committed",
    "kinds", "verified", "problems", "leftovers", "hidden"}``; every entry of ``problems`` is a
    failed check."""
    names = listing(path)
    report = {"listed": [], "committed": [], "kinds": {}, "verified": [], "problems": [],
              "leftovers": [n for n in names if is_leftover(n)], "hidden": []}
    if not path.exists():
        return report
    root = CheckpointRoot(path)
    listed, committed = root.steps(), root.committed()
    report["listed"], report["committed"] = listed, committed
    report["hidden"] = [s for s in committed if s not in listed]
    report["leftovers"] += [n for n in names if not is_leftover(n) and step_of_entry(n) is not None
                            and step_of_entry(n) not in committed]
    problems = report["problems"]
    manifests = _read_listed(path, listed, names, problems)
    report["kinds"] = {step: manifest.kind for step, manifest in manifests.items()}
    problems += filter(None, (_chain_problem(path, step, manifests, listed) for step in manifests))
    if verify:
        for step in sorted(manifests):
            try:
                load_step(path / step_name(step))
                report["verified"].append(step)
            except Exception as exc:  # any failure to load is a failed check
                problems.append(f"{path}: listed step {step} does not load: {type(exc).__name__}: {exc}")
    return report


def check_after_kill(paths: RunPaths) -> dict:
    """Every check after a kill (the module docstring) on the primary and the replica."""
    started = time.monotonic()
    primary, replica = check_mount(paths.primary), check_mount(paths.replica)
    problems = [*primary["problems"], *replica["problems"]]
    for step in sorted(set(primary["verified"]) & set(replica["verified"])):
        a, b = (read_manifest_bytes(locate(mount / step_name(step)))[1] for mount in (paths.primary, paths.replica))
        if a != b:
            problems.append(f"step {step}: the replica's manifest differs from the primary's")
    newest = primary["listed"][-1] if primary["listed"] else None
    if newest is not None and newest not in primary["verified"]:
        problems.append(f"the newest listed step {newest} (the one a restart resumes from) does not load")
    return {"ok": not problems, "problems": problems, "newest": newest, "primary": primary, "replica": replica,
            "seconds": round(time.monotonic() - started, 3)}


def compare_checkpoints(path: Path, reference: Path) -> dict:
    """Tensors (dtype, shape, bytes) and values of two checkpoints, exactly."""
    _, tensors, values = load_step(path)
    _, ref_tensors, ref_values = load_step(reference)
    problems = []
    for what, ours, theirs in (("tensor", tensors, ref_tensors), ("value", values, ref_values)):
        if ours.keys() != theirs.keys():
            problems.append(f"{path}: {what} keys differ from the reference's" + (
                f" (missing {sorted(theirs.keys() - ours.keys())[:3]}, extra {sorted(ours.keys() - theirs.keys())[:3]})"
                if what == "tensor" else ""))
        differing = [key for key in sorted(ours.keys() & theirs.keys()) if not equal(ours[key], theirs[key])]
        if differing:
            problems.append(f"{path}: {len(differing)} {what}s differ from the reference's: {differing[:5]}")
    return {"ok": not problems, "problems": problems, "tensors": len(tensors),
            "model_tensors": sum(1 for key in tensors if key.startswith("model.")),
            "optim_tensors": sum(1 for key in tensors if key.startswith("optim.")), "values": len(values),
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}


def _metrics_problems(paths: RunPaths, reference: RunPaths, steps: int) -> tuple[list[str], dict]:
    """Every record's loss and learning rate against the reference's, bit for bit."""
    problems = []
    records, bad = read_metrics(paths.metrics)
    ref = {r["step"]: r for r in read_metrics(reference.metrics)[0]}
    by_step: dict[int, list[dict]] = {}
    for record in records:
        by_step.setdefault(record["step"], []).append(record)
    missing = [s for s in range(1, steps + 1) if s not in by_step]
    if missing:
        problems.append(f"steps without a logged loss: {missing}")
    mismatched = []
    for step, logged in sorted(by_step.items()):
        for record in logged:
            expected = ref.get(step)
            if expected is None or not (float(record["loss"]).hex() == float(expected["loss"]).hex()
                                        and float(record["lr"]).hex() == float(expected["lr"]).hex()):
                mismatched.append((step, record["loss"], None if expected is None else expected["loss"]))
    if mismatched:
        problems.append(f"{len(mismatched)} logged losses/lrs differ from the uninterrupted run's "
                        f"(step, loss, reference): {mismatched[:5]}")
    return problems, {"steps_logged": len(by_step), "records": len(records),
                      "rerun_records": len(records) - len(by_step), "unparsable_lines": bad}


def compare_runs(paths: RunPaths, reference: RunPaths, steps: int) -> dict:
    """The end-of-run checks (the module docstring): losses and learning rates of every step, every
    record, bit for bit; the final checkpoint on both mounts byte for byte."""
    problems, counts = _metrics_problems(paths, reference, steps)
    final = {}
    for name, mount in paths.mounts().items():
        listed = CheckpointRoot(mount).steps()
        if steps not in listed:
            problems.append(f"{name}: the final step {steps} is not listed ({listed})")
            continue
        final[name] = compare_checkpoints(mount / step_name(steps), reference.mounts()[name] / step_name(steps))
        problems += final[name]["problems"]
    leftovers = {name: [n for n in listing(mount) if is_leftover(n)] + unmanifested(mount, listing(mount), set())
                 for name, mount in paths.mounts().items()}
    blocked = blocked_replica_steps(paths)
    if blocked:
        problems.append(f"replication blocked at the end of the run: on the replica, the directories of steps "
                        f"{blocked} have no manifest (a killed deletion's leftover) while the primary lists those "
                        f"steps; before 48523c3 every copy of them was refused ('already exists') and retried, newer "
                        f"steps waiting behind them, and each exit waited close_timeout")
    return {"ok": not problems, "problems": problems, **counts, "final": final, "leftovers_at_end": leftovers,
            "blocked_replica_steps": blocked}


def blocked_replica_steps(paths: RunPaths) -> list[int]:
    """Steps the primary lists whose replica directory exists without a manifest: ``copy_step``
    refuses such a target (``commit.begin(overwrite=False)``) and nothing on a replica removes it."""
    listed = set(CheckpointRoot(paths.primary).steps()) if paths.primary.exists() else set()
    return sorted(s for s in map(step_of_entry, unmanifested(paths.replica, listing(paths.replica), set()))
                  if s in listed)
