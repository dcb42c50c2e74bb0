"""The corruption campaign's probes (scripts/corruption_campaign.py): the damaged run, looked at the
ways a user would, each outcome kept for the checks.

* :func:`run_verify`: ``ckpt-inspect PRIMARY --verify --mount REPLICA --json`` (exit code, report, stderr);
* :func:`load_copy`: ``ckpt.load`` of one copy of a step, its error kept;
* :func:`manager_load`: a new manager's ``load`` (step, state, warnings, log lines, replication, catalog);
* :func:`probe_catalog`: the damaged catalog opened in a forked child (:func:`forked`) on a copy, since
  a crash of LMDB on damaged pages would otherwise end the campaign.

The engine's log lines are kept from the console (:func:`captured_logs`) and returned where they matter.
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import warnings
from pathlib import Path

import ckpt
from ckpt.root import Catalog, open_catalog
from ckpt.storage import locate
from scripts.corruption_run import MANAGER_OPTIONS, blank_state, catalog_listing, listing_of
from tools import inspection


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
