"""``python -m tests.support.held_trainer ARGS``: ``trainer.train`` whose ranks each stop themselves
(SIGSTOP) once, right before step ``HOLD_AFTER_STEP + 1`` begins — a pause point a test can rely on.

Polling a log for "step 7" and then stopping the workers from outside races them: on a loaded box
they may have trained on, saved step 8 or even finished before the signal lands. Here the stop
comes from inside, after step ``HOLD_AFTER_STEP`` finished on every rank (its save, its all-reduce,
its log line) and before the next step touched anything: the files are what a kill of the whole job
at that moment would leave. Each rank stops once per job (``HOLD_MARKS/rank-<RANK>`` made
exclusively), so a group restarted by torchrun trains through. :class:`tests.support.agents.TwoNodes`
(``hold_after=``) launches it and waits for the stop.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from trainer import train


def _hold_before(step: int, marks: Path) -> None:
    real = train.Trainer.train_step

    def train_step(self):
        if self.train_state.step == step:  # the step counter is advanced before train_step runs
            try:
                (marks / f"rank-{os.environ['RANK']}").open("x").close()
            except FileExistsError:  # stopped once already: a restarted group trains through
                pass
            else:
                os.kill(os.getpid(), signal.SIGSTOP)
        return real(self)

    train.Trainer.train_step = train_step


if __name__ == "__main__":
    _hold_before(int(os.environ["HOLD_AFTER_STEP"]) + 1, Path(os.environ["HOLD_MARKS"]))
    sys.exit(train.main(sys.argv[1:]))
