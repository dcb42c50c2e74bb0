"""What a run leaves beside its checkpoints to tell runs apart: a run id, ``run_start`` and ``run_end``
records in ``metrics.jsonl``, and a ``config.json`` that is never replaced silently.

Each start of the trainer (a fresh run or a resume) is a *run*, with an id (:func:`new_run_id`:
UTC time and 6 random hex digits). Its first line in ``<dump_folder>/metrics.jsonl`` is
``{"event": "run_start", "run_id", "resumed_step", "resumed_from", "config_digest", "world_size",
"time"}`` (``resumed_from``: ``"storage"``, ``"memory"`` or null), so the steps after it are known to
be that run's (``python -m trainer.plot`` starts a new segment there); its last is
``{"event": "run_end", "run_id", "status", "steps", "last_step", "seconds", "overall_tokens_per_sec",
"final_loss", "checkpoints_written", "checkpoints_kept", "newest_step", "time"}`` (``status``:
``finished``, ``stopped`` by a signal, or ``failed``), written after the last save was waited for.
``config.json`` holds the current run's config; a different config left by an earlier run is kept
as ``config-<its digest>.json`` and the run says so (one line naming the keys that changed).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from pathlib import Path
from typing import Callable


def new_run_id() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(3)


def config_digest(config: dict) -> str:
    """12 hex digits of the SHA-256 of the config as canonical JSON."""
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]


def run_start(run_id: str, config: dict, *, resumed_step: int | None, resumed_from: str | None,
              world_size: int) -> dict:
    return {"event": "run_start", "run_id": run_id, "resumed_step": resumed_step, "resumed_from": resumed_from,
            "config_digest": config_digest(config), "world_size": world_size}


def run_end(run_id: str, *, status: str, figures: dict, checkpoints: dict) -> dict:
    """The run's last record: ``figures`` (steps, last_step, seconds, overall_tokens_per_sec, final_loss) and
    ``checkpoints`` (checkpoints_written, checkpoints_kept, newest_step; empty without them)."""
    return {"event": "run_end", "run_id": run_id, "status": status, **figures, **checkpoints}


def _changed_keys(old: dict, new: dict) -> list[str]:
    keys = []
    for section in sorted(set(old) | set(new)):
        a, b = old.get(section), new.get(section)
        if isinstance(a, dict) and isinstance(b, dict):
            keys += [f"{section}.{k}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        elif a != b:
            keys.append(section)
    return keys


def write_config(folder: str | Path, config: dict, log: Callable[[str], None]) -> Path:
    """``folder/config.json`` := ``config``; an earlier, different one is kept beside it (and logged)."""
    path = Path(folder) / "config.json"
    text = json.dumps(config, indent=2) + "\n"
    try:
        previous = path.read_text()
    except FileNotFoundError:
        previous = None
    if previous is not None and previous != text:
        try:
            old = json.loads(previous)
        except json.JSONDecodeError:
            old = None
        kept = path.with_name(f"config-{config_digest(old) if isinstance(old, dict) else 'unreadable'}.json")
        path.replace(kept) if not kept.exists() else path.unlink()
        changed = _changed_keys(old, config) if isinstance(old, dict) else ["(unreadable)"]
        shown = ", ".join(changed[:6]) + (f" and {len(changed) - 6} more" if len(changed) > 6 else "")
        log(f"config.json of an earlier run differs ({shown}); kept as {kept.name}")
    path.write_text(text)
    return path
