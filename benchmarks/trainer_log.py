"""The trainer's tokens/s over a window of steps, read back from its ``metrics.jsonl``.

The trainer logs one record per ``metrics.log_freq`` steps (``step``, ``tokens_per_sec`` over the
steps since the previous record, and with checkpointing ``ckpt_stall_ms`` per step), besides
``{"event": ...}`` records. :func:`logged_window` takes the step records after ``warmup`` and gives
the rate over them: their tokens over the sum of their seconds (each record's seconds are its
tokens over its ``tokens_per_sec``), not the mean of their rates, so a slow record weighs by its time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Window:
    records: list[dict]  # the step records after the warm-up, in order
    steps: list[int]  # steps each record covers (since the previous record, or since the warm-up)
    tokens_per_s: float
    seconds: float

    def per_step_sum(self, field: str) -> float:
        """A per-step figure of the records (e.g. ``ckpt_stall_ms``) summed over every step of the window."""
        return sum(r[field] * n for r, n in zip(self.records, self.steps))


def logged_window(dump: Path, warmup: int, step_tokens: int) -> Window:
    """The window after step ``warmup`` of the run that logged into ``dump``/metrics.jsonl, whose
    steps each train ``step_tokens`` tokens (global batch × sequence length)."""
    records = [json.loads(line) for line in (Path(dump) / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if "tokens_per_sec" in r and r["step"] > warmup]  # not the {"event": ...} ones
    previous = [warmup] + [r["step"] for r in timed[:-1]]
    steps = [r["step"] - p for r, p in zip(timed, previous)]
    tokens = [n * step_tokens for n in steps]
    seconds = sum(n / r["tokens_per_sec"] for n, r in zip(tokens, timed))
    return Window(timed, steps, sum(tokens) / seconds, seconds)
