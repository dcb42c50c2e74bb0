"""A guard against hangs, not a speed check: ``ends(fn)`` runs ``fn`` on a daemon thread and fails
the test if it has not returned after :data:`HANG_SECONDS` (minutes, far above any loaded machine's
time for the bounded work; an unbounded loop — a memo DAG walked leaf by leaf, 10^9 layers built —
never returns). Speed is measured in benchmarks/, never asserted here."""

from __future__ import annotations

import threading
from typing import Any, Callable

HANG_SECONDS = 300.0


def ends(fn: Callable[[], Any]) -> Any:
    """``fn()``'s result (or its exception, re-raised); AssertionError if it hangs."""
    outcome: dict[str, Any] = {}

    def body() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # handed to the test's thread
            outcome["error"] = exc

    worker = threading.Thread(target=body, daemon=True)
    worker.start()
    worker.join(HANG_SECONDS)
    assert not worker.is_alive(), f"{fn} did not return within {HANG_SECONDS:.0f} s: it hangs"
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")
