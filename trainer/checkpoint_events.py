"""A run's checkpoint events as records of ``metrics.jsonl`` (rank 0), between its step records.

Contract: :class:`CheckpointEvents` is told by :class:`trainer.checkpointing.RunCheckpoints` what
happens to the run's checkpoints and writes one ``{"event": ..., "time": ...}`` record for each
(through ``send_to``'s function, :meth:`trainer.metrics.MetricsLogger.record`; what happens before
the metrics file is open — the resume — is held until then). Safe from any thread: a commit is told
by the checkpoint writer's. The records:

* ``checkpoint_committed`` ``step kind bytes seconds path replicas``: the manager's ``on_commit``
  (``seconds`` from the start of its write to its commit; ``replicas``: mounts it is being copied to);
* ``checkpoint_replicated`` ``step replica state``: a copy on a replica mount that reached
  ``committed``, ``failed`` or ``dropped`` (:meth:`ckpt.CheckpointManager.replication_status`, read
  after every save call and at the end; the replica's URL without credentials);
* ``checkpoint_skipped`` ``step``: a save not started, both staging buffer sets still being written;
* ``checkpoint_failed`` ``failed_saves noticed_at_step``: a failed background save, counted under
  ``checkpoint.on_error=continue`` when the next due save (or the end) noticed it;
* ``checkpoint_fell_back`` ``step set_aside``: the resume passed over the newest steps (damaged on
  every mount, set aside) and loaded ``step``;
* ``memory_fell_back`` ``step note``: a memory-tier step was not used (the tier's line says why);
* ``memory_outcomes`` ``saved skipped failed noticed_at_step``: memory-tier saves that ended since
  the last such record, by outcome (skipped: no room, or no free staging buffer, on some node). The
  tier writes in the checkpoint writer's thread and only counts its outcomes (``SaveStats``), so
  they are told by count when the trainer reads the counters (after every save call and at the
  end), not by step.
"""

from __future__ import annotations

import threading
from typing import Callable

import ckpt
from ckpt.redact import redact

FINAL_REPLICA_STATES = ("committed", "failed", "dropped")
_MEMORY_OUTCOMES = {"saved": "memory_saves", "skipped": "memory_skipped", "failed": "memory_failures"}


class CheckpointEvents:
    """The event records of one manager's checkpoints (see the module docstring)."""

    def __init__(self, manager: ckpt.CheckpointManager):
        self._manager, self._replicas = manager, bool(manager.options.replicas)
        self._lock = threading.Lock()
        self._sink: Callable[[dict], None] | None = None
        self._held: list[dict] = []
        stats = manager.stats
        self._skipped, self._failures = stats.skipped, stats.failures
        self._memory = {outcome: getattr(stats, name) for outcome, name in _MEMORY_OUTCOMES.items()}
        self._replica_states: dict[tuple[int, str], str] = {}
        self._step: int | None = None

    def send_to(self, record: Callable[[dict], None]) -> None:
        """Write the records to ``record`` from now on, the ones held so far first."""
        with self._lock:
            self._sink, held, self._held = record, self._held, []
        for event in held:
            record(event)

    def emit(self, event: str, **fields) -> None:
        with self._lock:
            sink = self._sink
            if sink is None:
                self._held.append({"event": event, **fields})
                return
        sink({"event": event, **fields})

    def committed(self, info: ckpt.CommitInfo) -> None:
        self.emit("checkpoint_committed", step=info.step, kind=info.kind, bytes=info.bytes,
                  seconds=round(info.seconds, 3), path=redact(info.path), replicas=info.replicas)

    def resumed(self, step: int, *, listed_before: list[int], memory_note: str | None) -> None:
        """A resume from storage loaded ``step`` out of the steps ``listed_before`` it (the newer
        ones were set aside); ``memory_note``: why a memory step was not used, if one was not."""
        if memory_note:
            self.emit("memory_fell_back", step=step, note=memory_note)
        passed_over = [s for s in listed_before if s > step]
        if passed_over:
            self.emit("checkpoint_fell_back", step=step, set_aside=passed_over)

    def saved(self, step: int) -> None:
        """After ``manager.save(step)``."""
        self._step = step
        stats = self._manager.stats
        if stats.skipped > self._skipped:
            self.emit("checkpoint_skipped", step=step)
        self._skipped = stats.skipped
        self.observe()

    def observe(self) -> None:
        """Read the counters and the replication status: records for what changed since the last read."""
        stats = self._manager.stats
        if stats.failures > self._failures:
            self.emit("checkpoint_failed", failed_saves=stats.failures, noticed_at_step=self._step)
        self._failures = stats.failures
        self._memory_outcomes(stats)
        if self._replicas:
            self._replication()

    def _memory_outcomes(self, stats) -> None:
        now = {outcome: getattr(stats, name) for outcome, name in _MEMORY_OUTCOMES.items()}
        new = {outcome: now[outcome] - self._memory[outcome] for outcome in now}
        self._memory = now
        if any(new.values()):
            self.emit("memory_outcomes", **new, noticed_at_step=self._step)

    def _replication(self) -> None:
        for step, copies in self._manager.replication_status().items():
            for url, state in copies.items():
                key = (step, url)
                if state in FINAL_REPLICA_STATES and self._replica_states.get(key) != state:
                    self.emit("checkpoint_replicated", step=step, replica=redact(url), state=state)
                self._replica_states[key] = state
