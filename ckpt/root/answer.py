"""Asking a replica without being held up by it: its listing runs on a thread of its own while the
primary is listed, and the caller waits for it only so long after the primary has answered.

    answer = Answer(lambda: replica.committed())     # starts at once, on a daemon thread
    ...                                               # the primary's listing
    done, steps = answer.wait(deadline)               # deadline None: as long as it takes

    primary_steps, [(answered, steps, error), ...] = primary_then_replicas(
        primary.committed, [replica.committed, ...], wait_all=lambda steps: not steps)

Why (measured, S3 through s3fs): an endpoint that refuses connections costs 8-15 s per call
(botocore's retries with back-off), and one that does not answer at all (a host gone from the network)
60 s of connect timeout per attempt, five attempts — at every restart, before a single step. A
replica is a second copy: when the primary has steps to resume from, a replica that has not answered
``REPLICA_WAIT_S`` seconds after it is passed over, as one that cannot be listed always was, with a
line saying so. The thread is a daemon (a call stuck in the network must not keep the process from
exiting) and its late answer is dropped.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

REPLICA_WAIT_S = 5.0  # seconds a resume waits for a replica's listing once the primary's is in


class Answer:
    """``fn()`` on a daemon thread, started at once; :meth:`wait` takes its result or its error."""

    def __init__(self, fn: Callable[[], Any], *, name: str = "ckpt-ask-replica"):
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        threading.Thread(target=self._run, args=(fn,), name=name, daemon=True).start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._value = fn()
        except BaseException as exc:  # raised by wait(), in the caller's thread
            self._error = exc
        finally:
            self._done.set()

    def wait(self, deadline: float | None) -> tuple[bool, Any]:
        """``(True, value)`` once ``fn`` returned (its exception raised here), ``(False, None)`` when
        ``deadline`` (``time.monotonic()``; None: none) passed first."""
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not self._done.wait(timeout):
            return False, None
        if self._error is not None:
            raise self._error
        return True, self._value


def primary_then_replicas(primary: Callable[[], Any], replicas: list[Callable[[], Any]], *,
                          wait_all: Callable[[Any], bool]) -> tuple[Any, list[tuple[bool, Any, BaseException | None]]]:
    """``primary()`` in this thread while each of ``replicas`` runs on a thread of its own; its
    result, and each replica's ``(answered, value, error)``: one that has not answered
    ``REPLICA_WAIT_S`` seconds after the primary is ``(False, None, None)``, unless
    ``wait_all(primary's result)``, then each is waited for as long as it takes. The primary's
    error is raised; a replica's :class:`~ckpt.errors.CheckpointError` is returned (anything else
    raised)."""
    from ..errors import CheckpointError

    answers = [Answer(fn) for fn in replicas]
    first = primary()
    deadline = None if wait_all(first) else time.monotonic() + REPLICA_WAIT_S
    outcomes = []
    for answer in answers:
        try:
            done, value = answer.wait(deadline)
            outcomes.append((done, value, None))
        except CheckpointError as exc:
            outcomes.append((True, None, exc))
    return first, outcomes
