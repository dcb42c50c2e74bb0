#!/usr/bin/env python
"""Before/after check of the local save/load path without the disk's noise.

    LABEL=after PYTHONPATH=. python benchmarks/ab_tmpfs.py /dev/shm/ab 10
    LABEL=before PYTHONPATH=/path/to/old/worktree python benchmarks/ab_tmpfs.py /dev/shm/ab 10

Saves and loads a 0.5 GiB state (4 x 128 MiB fp32 + 100 small tensors) ``N`` times with
``ckpt.save``/``ckpt.load`` under ``DIR`` (a tmpfs) and prints the median seconds of each. Run the
two checkouts alternately, several processes each; ``PYTHONPATH`` picks which ``ckpt`` is measured
(so, unlike the other scripts, it does not import the harness, which would put this checkout first).
"""

import os
import shutil
import statistics
import sys
import time

import torch

import ckpt


def main() -> None:
    root, repeats = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    state = {f"big{i}": torch.randn(8192, 4096) for i in range(4)}
    state.update({f"small{i}": torch.randn(1000) for i in range(100)})
    saves, loads = [], []
    for i in range(repeats):
        path = f"{root}/step-{i}"
        start = time.perf_counter()
        ckpt.save(state, path)
        saves.append(time.perf_counter() - start)
        start = time.perf_counter()
        ckpt.load(state, path)
        loads.append(time.perf_counter() - start)
        shutil.rmtree(path)
    print(f"{os.environ.get('LABEL', '')} save {statistics.median(saves):.3f} load {statistics.median(loads):.3f}")


if __name__ == "__main__":
    main()
