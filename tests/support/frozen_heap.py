"""Imported last by a process that forks workers after importing torch and the trainer (the fork
server of :func:`tests.support.launch.run_ranks`, the launcher of :mod:`tests.support.exit_runs`):
one full collection, then every object still alive moves to the collector's permanent generation
(``gc.freeze``, what Python's documentation advises before forking workers).

A forked process then leaves those ~300,000 imported objects alone in its own full collections
(~0.15 s of CPU each here; the trainer's ``main`` makes two on its way out) and in the collection
of its interpreter's finalization (a forked process's real exit: ~1 s of CPU without this, ~0.25 s
with it). What the process creates itself is collected as before: a run's reference cycles (its
process groups, its model) are made after the fork.
"""

import gc

gc.collect()
gc.freeze()
