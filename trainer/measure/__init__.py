"""The dry run proven by measurement: one real training step of a layout at its full world size, in
one process, its memory tracked, beside the plan's figure for the same rank.

``python -m trainer.train --dry-run --measure`` / ``python -m trainer.measure`` (:mod:`~trainer.measure.cli`).
The rooms (each imports only rooms listed before it, and :mod:`trainer.plan`, never the reverse):

* :mod:`~trainer.measure.tracker`: torch's ``MemTracker`` fitted for a whole parallel step;
* :mod:`~trainer.measure.run`: one rank's step on a fake process group under ``FakeTensorMode``;
* :mod:`~trainer.measure.cli`: every rank role (each in a fresh process), the comparison, the command line.
"""

from __future__ import annotations

from .run import Measured, measure

__all__ = ["Measured", "measure"]
