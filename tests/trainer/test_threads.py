"""trainer.threads: an explicit OMP_NUM_THREADS is honoured; without it the cores this process may
use are shared by the ranks on the node; the trainer's command line applies the count and names it in
its header line."""

from __future__ import annotations

import pytest
import torch

from tests.support.trainer_runs import trainer_args
from trainer.threads import choose


@pytest.mark.parametrize("value, count", [("3", 3), ("4,2", 4), (" 2 ", 2)])
def test_an_explicit_omp_num_threads_is_honoured(value, count):
    threads = choose({"OMP_NUM_THREADS": value, "LOCAL_WORLD_SIZE": "8"}, cores=64)
    assert (threads.count, threads.reason) == (count, "OMP_NUM_THREADS")


@pytest.mark.parametrize("env, cores, count", [
    ({}, 2, 2),                                          # python -m trainer.train: every usable core
    ({"LOCAL_WORLD_SIZE": "4"}, 16, 4),                  # 4 ranks on the node share its cores
    ({"LOCAL_WORLD_SIZE": "4"}, 2, 1),                   # never below one
    ({"OMP_NUM_THREADS": "0", "LOCAL_WORLD_SIZE": "2"}, 8, 4),    # not a count: the cores decide
    ({"OMP_NUM_THREADS": "many", "LOCAL_WORLD_SIZE": "x"}, 3, 3),
])
def test_without_it_the_usable_cores_are_shared_by_the_local_ranks(env, cores, count):
    threads = choose(env, cores=cores)
    assert threads.count == count and threads.reason.startswith(f"{cores} usable core")


def test_the_cores_are_those_this_process_may_run_on(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 2, 5}, raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 64)
    assert choose({}).count == 3


def test_the_command_line_sets_the_count_and_names_it_in_its_header(tmp_path, capsys, monkeypatch):
    from trainer.train import main

    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert main(trainer_args(str(tmp_path), steps=1)) == 0
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("training "))
    assert header.endswith(", 3 torch threads (3 usable cores / 1 rank on this node)")
    assert torch.get_num_threads() == 3
