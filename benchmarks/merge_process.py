"""One consolidation of ``bench_merge.py``, timed in a fresh process forked from a fork server.

* :func:`fork_server`: multiprocessing's fork server with the modules a run uses imported once
  (:data:`PRELOAD`), so a run pays no import time and inherits no other run's heap.
* :func:`run`: :func:`worker` in a fresh process forked from it; its result, or its error raised.
* :func:`worker`: in that process: every page of the file-backed mappings mapped in
  (:func:`populate_file_mappings`), ``gc`` + ``malloc_trim``, the page cache dropped (``cold``, as
  root), VmHWM reset, then the call timed: ours (``ckpt.convert.merge`` to ``.pt`` or
  ``.safetensors``) or DCP's ``dcp_to_torch_save`` + an ``fsync`` of its file. Returns the wall and CPU
  seconds, the RSS before the call and the peak growth over it (VmHWM after minus RSS before).
"""

from __future__ import annotations

import ctypes
import os
import time
import traceback

from harness import REPO, drop_caches, fsync_path, settle  # first: puts this checkout's root on sys.path

from probes import proc_status, reset_peak  # noqa: E402
from tests.support.launch import start_forkserver  # noqa: E402

# The modules a run uses, imported once by the fork server (``__main__`` is the benchmark's script,
# where the Python version honours it; 3.11 drops the main path on the way).
PRELOAD = ["__main__", "harness", "merge_process", "ckpt", "ckpt.convert", "torch.distributed.checkpoint.format_utils",
           "safetensors", "xxhash"]
MADV_POPULATE_READ = 22  # Linux >= 5.14


def populate_file_mappings() -> None:
    """Map in every page of this process's readable file-backed mappings (libraries' code and data:
    shared page-cache pages, no new memory). A forked child maps those pages lazily, so without this
    the code a call runs for the first time would count as the call's RSS growth."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) < 6 or not parts[5].startswith("/") or not parts[1].startswith("r"):
                continue
            start, end = (int(x, 16) for x in parts[0].split("-"))
            libc.madvise(start, end - start, MADV_POPULATE_READ)  # best effort: an old kernel says EINVAL


def worker(method: str, source: str, out: str, cold: bool) -> dict:
    """One timed consolidation in this (fresh) process: seconds, CPU seconds and peak RSS growth."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from ckpt.convert import merge

    populate_file_mappings()
    settle()
    dropped = drop_caches(cold)
    if not reset_peak():  # VmHWM := current RSS (Linux >= 4.0)
        raise RuntimeError("cannot reset VmHWM (/proc/self/clear_refs): peak memory is not measurable here")
    base = proc_status("VmRSS")
    cpu0, t0 = time.process_time(), time.perf_counter()
    if method == "dcp":
        dcp_to_torch_save(source, out)
        fsync_path(out)
    else:
        merge(source, out, format="torch" if method == "ours-torch" else "safetensors")
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {"seconds": seconds, "cpu": cpu, "base": base, "peak": proc_status("VmHWM") - base,
            "out_bytes": os.path.getsize(out), "cold": dropped}


def child_main(method: str, source: str, out: str, cold: bool, conn) -> None:
    try:
        conn.send(worker(method, source, out, cold))
    except BaseException:  # noqa: BLE001 - reported by the parent
        conn.send({"error": traceback.format_exc()})
    finally:
        conn.close()


def fork_server():
    """The fork server's context, its process started: it imports ``PRELOAD`` from this checkout."""
    return start_forkserver(PRELOAD, [str(REPO), str(REPO / "benchmarks")])


def run(ctx, method: str, source, out, cold: bool) -> dict:
    """``worker`` in a fresh process forked from the fork server; its result or its error."""
    if out.exists():
        out.unlink()
    receiver, sender = ctx.Pipe(duplex=False)
    process = ctx.Process(target=child_main, args=(method, str(source), str(out), cold, sender),
                          name=f"merge-{method}")
    process.start()
    sender.close()
    try:
        result = receiver.recv()
    except EOFError:  # it died without a word (killed, out of memory)
        result = None
    process.join()
    if result is None:
        result = {"error": f"the run's process died (exit code {process.exitcode})"}
    if "error" in result:
        raise RuntimeError(f"{method} failed:\n{result['error'][-3000:]}")
    return result
