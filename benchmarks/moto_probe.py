"""The moto S3 server of ``bench_storage.py``, and what one operation costs against it.

:func:`start_server` starts ``tests.support.s3server.MotoServer`` with its request log in the work
dir, every object kept in the server's memory unless asked otherwise. :class:`Probe` measures one
operation: ``sync`` (and a page-cache drop when ``cold``), then the wall time of the call
(``harness.timed``), the CPU time of this process (every thread) and of the server process over it,
and the requests the server logged meanwhile, by HTTP method (a listing, a GET on the bucket, counts
as ``LIST``). :meth:`Probe.sizes` and :meth:`Probe.clear` read and empty a prefix of the bucket,
outside any timing.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from harness import drop_caches, timed  # first: puts this checkout's root on sys.path

from tests.support.s3server import MotoServer  # noqa: E402

REQUEST = re.compile(rb'"(?:\x1b\[[0-9;]*m)*([A-Z]+) (/\S*) HTTP/1\.[01]')  # one line of the server's request log
KEY_BUFFER = "MOTO_S3_DEFAULT_KEY_BUFFER_SIZE"


def start_server(work: Path, keep_in_memory: bool) -> MotoServer:
    """The moto server, its request log in the work dir. moto keeps an object in a
    ``SpooledTemporaryFile`` that spills to a temporary file on disk past
    ``MOTO_S3_DEFAULT_KEY_BUFFER_SIZE`` (~5 MiB by default); ``keep_in_memory`` raises that limit for
    the server process, so every object stays in its memory and the disk stays out of the figures."""
    saved = os.environ.get(KEY_BUFFER)
    if keep_in_memory:
        os.environ[KEY_BUFFER] = str(1 << 40)
    try:
        return MotoServer(log_path=work / "moto.log").start()
    finally:
        if saved is None:
            os.environ.pop(KEY_BUFFER, None)
        else:
            os.environ[KEY_BUFFER] = saved


def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads), from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


@dataclass
class Sample:
    seconds: float
    client_cpu: float  # this process, every thread
    server_cpu: float  # the moto server process
    requests: dict[str, int] = field(default_factory=dict)  # HTTP method -> requests the server logged


class Probe:
    def __init__(self, server: MotoServer, fs, cold: bool = False):
        self.server, self.fs, self.cold = server, fs, cold

    def measure(self, fn: Callable[[], None]) -> Sample:
        drop_caches(self.cold)
        log_start = self.server.log_path.stat().st_size
        server_cpu = proc_cpu_seconds(self.server.process.pid)
        client_cpu = time.process_time()
        seconds = timed(fn)
        sample = Sample(seconds, time.process_time() - client_cpu, proc_cpu_seconds(self.server.process.pid) - server_cpu)
        time.sleep(0.05)  # the server logs a request as it answers; let the last line land
        with open(self.server.log_path, "rb") as f:
            f.seek(log_start)
            for verb, path in REQUEST.findall(f.read()):
                kind = "LIST" if b"list-type=" in path else verb.decode()  # a listing is a GET on the bucket
                sample.requests[kind] = sample.requests.get(kind, 0) + 1
        return sample

    def sizes(self, url: str) -> dict[str, int]:
        """Size of every object under ``url`` ("s3://bucket/prefix"), by its name below the prefix."""
        prefix = url.removeprefix("s3://").rstrip("/")
        self.fs.invalidate_cache()
        found = self.fs.find(prefix, detail=True)
        return {name[len(prefix) + 1:]: info["size"] for name, info in found.items()}

    def clear(self, prefix: str) -> None:
        """Delete every object under ``prefix`` ("bucket/prefix"), if any."""
        try:
            self.fs.rm(prefix, recursive=True)
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache()
