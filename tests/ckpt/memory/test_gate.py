"""The memory gate (memory_interval 1: every step whose previous memory save has finished): a
memory-only save whose snapshot would have to wait for a buffer set is skipped, never waited for,
and on every rank alike, decided without a blocking collective on the training thread.

The writer is held by the test (a stand-in tier whose save waits for a signal), so what is busy
when is fixed, not timed: a save call that waited for the writer would wait for a signal that comes
after it (the stand-in gives up after HELD_S, so that such a bug fails the test instead of hanging
it), and the ranks' kept steps are compared."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from ckpt.memory import MemoryGate
from ckpt.options import SaveOptions
from ckpt.write import SavePipeline, Target
from tests.support.launch import run_ranks

HELD_S = 120  # a guard against a hang only: a passing test never waits on it


class _HeldTier:
    """A memory tier whose saves wait for ``release()`` (``held_from``: the first step held)."""

    def __init__(self, held_from: int | None = None):
        self.stats, self.steps, self.held_from = None, [], held_from
        self._released = threading.Event()

    def save(self, step: int, tree) -> bool:
        if self.held_from is not None and step >= self.held_from:
            self._released.wait(HELD_S)
        self.steps.append(step)
        return True

    def release(self) -> None:
        self._released.set()


def _memory_only(pipeline: SavePipeline, step: int) -> bool:
    tree = {"w": torch.full((256,), float(step)), "step": step}
    return pipeline.save(Target(("memory", step), step, None, memory=True), tree) is not None


def test_a_memory_save_is_skipped_while_both_buffer_sets_are_busy_never_waited_for():
    tier = _HeldTier(held_from=1)
    pipeline = SavePipeline(SaveOptions(async_mode="double_buffer", device_type="cpu"))
    pipeline.use_memory(tier, MemoryGate(None))
    # 1 and 2 take the two buffer sets (the writer holds 1); 3 and 4 would have to wait: skipped, at once
    taken = [_memory_only(pipeline, step) for step in (1, 2, 3, 4)]
    tier.release()
    pipeline.wait()
    # the gate reads the last post: 5 was decided while both sets were busy; 6 finds them free
    taken += [_memory_only(pipeline, step) for step in (5, 6)]
    pipeline.close()
    assert taken == [True, True, False, False, False, True]
    assert tier.steps == [1, 2, 6]


def _ranks_skip_alike(rank: int, world: int, signal: str) -> list[int]:
    """Rank 1's writer is held until its training thread has called save 3; rank 0's never is.
    Both must skip the same steps (the tier's save is collective on the writer thread)."""
    import torch.distributed as dist

    tier = _HeldTier(held_from=1 if rank == 1 else None)
    pipeline = SavePipeline(SaveOptions(async_mode="double_buffer", device_type="cpu"))
    pipeline.use_memory(tier, MemoryGate(dist.new_group(backend="gloo")))
    taken = [step for step in (1, 2, 3) if _memory_only(pipeline, step)]
    if rank == 1:
        tier.release()  # had save 3 waited for this rank's writer, it would never have returned
    pipeline.wait()
    taken += [step for step in (4, 5) if _memory_only(pipeline, step)]
    pipeline.close()
    assert tier.steps == taken
    return taken


@pytest.mark.slow
def test_every_rank_skips_the_same_steps_when_one_rank_s_writer_is_behind(tmp_path: Path):
    assert run_ranks(2, _ranks_skip_alike, str(tmp_path)) == [[1, 2, 5], [1, 2, 5]]
