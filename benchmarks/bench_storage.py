#!/usr/bin/env python
"""Storage throughput against S3 (a moto server on loopback): replication and save/load, in one run.

    python benchmarks/bench_storage.py --out benchmarks/RESULTS.md          # 256 MiB, 3 repeats (~2 min)
    python benchmarks/bench_storage.py --quick --json /tmp/storage.json     # 32 MiB, 3 repeats (~20 s)
    python benchmarks/bench_storage.py --tiny                               # the tests' run: 4 MiB, 1 repeat

A state of ``--size-mb`` MiB of fp32 in six tensors (four large matrices, two vectors; random
values) is measured in two parts against one moto S3 server (``tests.support.s3server.MotoServer``: moto's
server in a subprocess on 127.0.0.1, one bucket). moto is an in-memory Python server, so the
absolute figures are bounded by it (and by the two processes sharing the machine's cores); what
matters are the ratios against the peers measured in the same run, under the same server.

Part 1, replication of one committed step from local disk to S3 (the step is written once by
``ckpt.save`` before the repeats and is the source of every copy):

primary        ``ckpt.save(state, dir)`` to local disk: the write the copy follows (fresh dir
               each repeat; fsyncs and the atomic commit included).
copy_step      ``ckpt.root.copy_step(local_step, s3_step)``: ours; streams every data file
               to a multipart upload, checking every blob's xxh3 against the manifest as it
               passes, checks each stored object's size, writes the manifest last (the commit).
s3fs put       ``S3FileSystem.put(step_dir, s3_prefix, recursive=True)`` of the same files:
               unverified, s3fs's defaults (50 MiB parts, up to 10 in flight per file).
copy_step (read_back)  with ``--read-back``: copy_step(..., read_back=True), every blob read
               back from S3 and verified before the commit.

Part 2, save straight to S3 and load back (the same state, the same server):

ckpt           ``ckpt.save(state, "s3://...", storage_options=...)`` and ``ckpt.load`` in place
               (checksums verified).
DCP fsspec     ``dcp.save(sd, storage_writer=FsspecWriter("s3://...", **storage_options),
               no_dist=True)`` (DCP's defaults: one file per rank, ``thread_count=1``) and
               ``dcp.load(sd, storage_reader=FsspecReader(...))`` in place. ``--dcp-threads``
               adds DCP writers with more threads (DCP then splits the rank's data into that
               many files).

Every repeat runs every method of a part once, in an order rotated per repeat, each into a fresh
prefix of the bucket (deleted afterwards, outside the timing); the tables give the median and the
min-max over repeats, and the ratios are paired per repeat. Outside the timing: the sizes of what
landed in the bucket are checked against the source, the replica of the first repeat is loaded
with ``ckpt.load`` and compared bitwise, and every load is compared bitwise with the state.
``sync`` precedes each timed operation (``--cold`` also drops the page cache, when permitted).
Throughput is state bytes / wall seconds, in MiB/s (2^20 bytes).

Goals (``--json``: ``report.goal``, each the median of the per-repeat paired speed ratios, min-max
in the detail): replication ≥ 0.8× s3fs put; save to S3 ≥ 1.0× DCP's FsspecWriter with its default
``thread_count=1``; load from S3 ≥ 1.0× DCP's FsspecReader (reading what that writer wrote).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import re
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp

from harness import (  # first: puts this checkout's root on sys.path
    REPO, Load, argument_parser, drop_caches, machine_description, median, remove, rotated, timed, work_dir,
)

import fsspec  # noqa: E402
import fsspec.asyn  # noqa: E402
import moto  # noqa: E402
import s3fs  # noqa: E402
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter  # noqa: E402

import ckpt  # noqa: E402
from ckpt import commit  # noqa: E402
from ckpt.root import copy_step  # noqa: E402
from ckpt.storage import locate  # noqa: E402
from ckpt.storage import remote as ckpt_remote  # noqa: E402
from ckpt.read import prefetch as ckpt_prefetch  # noqa: E402
from report import (  # noqa: E402
    command_line, goal, goal_line, median_span, metric, provenance, publish, table_head, write_json,
)
from states import describe_fp32, fp32_matrices_state, state_bytes, zeros_like  # noqa: E402
from tests.support.s3server import MotoServer, make_bucket, s3_storage_options  # noqa: E402

SECTION = "## Storage: replication and save/load on S3 (moto on loopback)"
BUCKET = "bench"
MiB = 1 << 20
REQUEST = re.compile(rb'"(?:\x1b\[[0-9;]*m)*([A-Z]+) (/\S*) HTTP/1\.[01]')  # one line of the server's request log
GOAL_REPLICATION = 0.8  # copy_step >= 0.8x s3fs put (verification costs something)
GOAL_SAVE = 1.0  # ckpt.save to S3 >= 1.0x DCP's fsspec writer
GOAL_LOAD = 1.0  # ckpt.load from S3 >= 1.0x DCP's fsspec reader
GOAL_LOAD_X_RAW = 0.95  # issue 27: ckpt.load from S3 >= 0.95x raw parallel ranged GETs of the same files
RAW_THREADS, RAW_RANGE = 8, 16 << 20  # the raw reader: as many GETs in flight as ours, of the same size
BENCH_NAME = "storage"
QUICK = {"size_mb": 32.0, "repeats": 3}  # ~20 s on a quiet 2-core box, moto's start included
TINY = {"size_mb": 4.0, "repeats": 1}  # the tests' smoke run

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
warnings.filterwarnings("ignore", category=FutureWarning)


# ---------------------------------------------------------------------------------------------
# The state
# ---------------------------------------------------------------------------------------------
# ---------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------
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


@dataclass
class Method:
    key: str
    name: str
    run: Callable[[int], None]  # run(rep): the timed operation, into repeat rep's prefix
    note: str = ""
    samples: list[Sample] = field(default_factory=list)
    load: Callable[[int], None] | None = None
    load_samples: list[Sample] = field(default_factory=list)
    verify: bool = True  # the load fills the live state (raw reads bytes only)

    def seconds(self, load: bool = False) -> list[float]:
        return [s.seconds for s in (self.load_samples if load else self.samples)]


class Bench:
    def __init__(self, args: argparse.Namespace, work: Path, server: MotoServer):
        self.args, self.work, self.server = args, work, server
        self.options = s3_storage_options(server.endpoint_url)
        self.fs = s3fs.S3FileSystem(**self.options)  # fsspec's cached instance: the one ours and DCP get too
        self.cold = False
        self.reference: dict[str, torch.Tensor] = {}
        self.live: dict[str, torch.Tensor] = {}
        self.source = work / "source" / "step-1"

    # -- helpers ---------------------------------------------------------------------------------
    def url(self, rep: int, key: str) -> str:
        return f"s3://{BUCKET}/rep{rep}/{key}/step-1"

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

    def remote_sizes(self, url: str) -> dict[str, int]:
        prefix = url.removeprefix("s3://").rstrip("/")
        self.fs.invalidate_cache()
        found = self.fs.find(prefix, detail=True)
        return {name[len(prefix) + 1:]: info["size"] for name, info in found.items()}

    def local_sizes(self, path: Path) -> dict[str, int]:
        return {str(p.relative_to(path)): p.stat().st_size for p in path.rglob("*") if p.is_file()}

    def clear(self, rep: int, key: str) -> None:
        prefix = self.url(rep, key).removeprefix("s3://").rsplit("/", 1)[0]
        try:
            self.fs.rm(prefix, recursive=True)
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache()

    def check_equal(self, what: str) -> None:
        if self.args.no_verify:
            return
        for key, t in self.reference.items():
            if not torch.equal(self.live[key], t):
                raise RuntimeError(f"{what}: {key} differs after load")

    def zero_live(self) -> None:
        for t in self.live.values():
            t.zero_()

    # -- part 1: replication ---------------------------------------------------------------------
    def replication_methods(self) -> list[Method]:
        def primary(rep: int) -> None:
            ckpt.save(self.reference, self.work / f"primary-{rep}")

        def ours(rep: int, read_back: bool = False) -> None:
            copy_step(locate(str(self.source)), locate(self.url(rep, "copy_rb" if read_back else "copy"), self.options),
                      read_back=read_back)

        def put(rep: int) -> None:
            self.fs.put(str(self.source), self.url(rep, "put").removeprefix("s3://"), recursive=True)

        methods = [
            Method("primary", "primary: ckpt.save to local disk", primary, "the write the copy follows; fsync + commit"),
            Method("copy", "ours: copy_step local → S3", ours, "streaming, every blob's xxh3 checked, sizes checked, manifest last"),
            Method("put", "s3fs put (recursive)", put, "unverified; 50 MiB parts, ≤ 10 in flight"),
        ]
        if self.args.read_back:
            methods.append(Method("copy_rb", "ours: copy_step(read_back=True)", lambda rep: ours(rep, True),
                                  "+ every blob read back from S3 and verified"))
        return methods

    def after_replication(self, m: Method, rep: int) -> None:
        """Outside the timing: check what landed, then free the server's memory."""
        if m.key == "primary":
            remove(self.work / f"primary-{rep}")
            return
        url = self.url(rep, m.key)
        expected = self.local_sizes(self.source)
        got = self.remote_sizes(url)
        if got != expected:
            raise RuntimeError(f"{m.name}: the bucket holds {got}, the source {expected}")
        if m.key == "copy":
            if not commit.is_committed(locate(url, self.options)):
                raise RuntimeError(f"{m.name}: {url} is not committed")
            if rep == 0 and not self.args.no_verify:
                self.zero_live()
                ckpt.load(self.live, url, storage_options=self.options)
                self.check_equal("replica loaded with ckpt.load")
        self.clear(rep, m.key)

    # -- part 2: save to S3 and load back --------------------------------------------------------
    def s3_methods(self) -> list[Method]:
        def ours_save(rep: int) -> None:
            ckpt.save(self.reference, self.url(rep, "ckpt"), storage_options=self.options)

        def ours_load(rep: int) -> None:
            ckpt.load(self.live, self.url(rep, "ckpt"), storage_options=self.options)

        def raw_put(rep: int) -> None:
            self.fs.put(str(self.source), self.url(rep, "raw").removeprefix("s3://"), recursive=True)

        def raw_get(rep: int) -> None:
            raw_parallel_get(self.fs, self.url(rep, "raw").removeprefix("s3://"))

        methods = [Method("ckpt", "ours: ckpt.save / ckpt.load", ours_save,
                          "multipart, 32 MiB parts, 4 in flight; 16 MiB ranged GETs, 8 in flight; checksums verified",
                          load=ours_load),
                   Method("raw", "raw: s3fs put / parallel ranged GETs", raw_put,
                          f"the files ours wrote; load = {RAW_THREADS} ranged GETs of {RAW_RANGE >> 20} MiB in flight "
                          "into one pre-faulted buffer per file, unverified", load=raw_get, verify=False)]
        for threads in self.args.dcp_threads:
            key = f"dcp{threads}"

            def dcp_save(rep: int, key=key, threads=threads) -> None:
                writer = FsspecWriter(self.url(rep, key), thread_count=threads, **self.options)
                dcp.save(dict(self.reference), storage_writer=writer, no_dist=True)

            def dcp_load(rep: int, key=key) -> None:
                dcp.load(self.live, storage_reader=FsspecReader(self.url(rep, key), **self.options), no_dist=True)

            default = " (defaults)" if threads == 1 else ""
            methods.append(Method(key, f"DCP FsspecWriter / FsspecReader, thread_count={threads}{default}", dcp_save,
                                  "s3fs write stream: a part per ≥ 50 MiB buffered, one at a time; " + ("one file" if threads == 1 else
                                                                          f"{threads} files, {threads} threads"),
                                  load=dcp_load))
        return methods

    def run_s3_method(self, m: Method, rep: int) -> None:
        m.samples.append(self.measure(lambda: m.run(rep)))
        self.zero_live()
        m.load_samples.append(self.measure(lambda: m.load(rep)))
        if m.verify:
            self.check_equal(m.name)
        self.clear(rep, m.key)

    # -- the run ---------------------------------------------------------------------------------
    def warm_up(self, methods1: list[Method], methods2: list[Method]) -> None:
        """Untimed: imports, sessions, connection pools and the server's first allocations."""
        small = {k: v[: max(1, v.shape[0] // 64)].clone() for k, v in self.reference.items()}
        saved, saved_live = self.reference, self.live
        self.reference, self.live = small, zeros_like(small)
        full_source, self.source = self.source, self.work / "warmup" / "step-1"
        try:
            ckpt.save(self.reference, self.source)
            for m in methods1 + methods2:
                if m.key in ("primary",):
                    m.run(-1)
                    remove(self.work / "primary--1")
                elif m.load is None:
                    m.run(-1)
                    self.clear(-1, m.key)
                else:
                    m.run(-1)
                    self.zero_live()
                    m.load(-1)
                    if m.verify:
                        self.check_equal(f"warm-up {m.name}")
                    self.clear(-1, m.key)
        finally:
            remove(self.work / "warmup")
            self.reference, self.live, self.source = saved, saved_live, full_source
        # One full-size upload, so the server's first big allocations land on no method.
        self.fs.put(str(self.source), f"{BUCKET}/warmup/step-1", recursive=True)
        self.fs.rm(f"{BUCKET}/warmup", recursive=True)
        self.fs.invalidate_cache()


def start_server(work: Path, keep_in_memory: bool) -> MotoServer:
    """The moto server, its request log in the work dir. moto keeps an object in a
    ``SpooledTemporaryFile`` that spills to a temporary file on disk past
    ``MOTO_S3_DEFAULT_KEY_BUFFER_SIZE`` (~5 MiB by default); ``keep_in_memory`` raises that limit for
    the server process, so every object stays in its memory and the disk stays out of the figures."""
    name, saved = "MOTO_S3_DEFAULT_KEY_BUFFER_SIZE", os.environ.get("MOTO_S3_DEFAULT_KEY_BUFFER_SIZE")
    if keep_in_memory:
        os.environ[name] = str(1 << 40)
    try:
        return MotoServer(log_path=work / "moto.log").start()
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def run(args: argparse.Namespace) -> tuple[list[Method], list[Method], dict]:
    with work_dir(args.dir, "storage-", keep=args.keep) as work:
        info: dict = {}
        server = start_server(work, keep_in_memory=not args.moto_spill)
        try:
            make_bucket(server.endpoint_url, BUCKET)
            bench = Bench(args, work, server)
            t0 = time.perf_counter()
            bench.reference = fp32_matrices_state(args.size_mb)
            bench.live = zeros_like(bench.reference)
            info["nbytes"] = state_bytes(bench.reference)
            info["state"] = describe_fp32(bench.reference)
            info["machine"] = machine_description(work, [
                f"s3fs {s3fs.__version__}", f"fsspec {fsspec.__version__}", f"moto {moto.__version__}",
                f"torch threads {torch.get_num_threads()}"])
            print(f"state: {info['state']} (built in {time.perf_counter() - t0:.1f}s)", flush=True)
            print(f"moto server: {server.endpoint_url} (started in {server.startup_seconds:.1f}s), work dir: {work}",
                  flush=True)
            bench.cold = drop_caches(args.cold)
            info["cold"] = bench.cold
            ckpt.save(bench.reference, bench.source)  # the committed step every copy starts from
            info["source_files"] = bench.local_sizes(bench.source)

            methods1, methods2 = bench.replication_methods(), bench.s3_methods()
            if not args.no_warmup:
                t0 = time.perf_counter()
                bench.warm_up(methods1, methods2)
                print(f"warm-up done in {time.perf_counter() - t0:.1f}s", flush=True)

            nbytes = info["nbytes"]
            load = Load(processes=True)
            for rep in range(args.repeats):
                for m in rotated(methods1, rep):
                    s = bench.measure(lambda: m.run(rep))
                    m.samples.append(s)
                    bench.after_replication(m, rep)
                    print(f"[{rep + 1}/{args.repeats}] {m.name:44s} {s.seconds:7.3f}s {nbytes / s.seconds / MiB:7.1f} MiB/s"
                          f"  (cpu: client {s.client_cpu:.2f}s, server {s.server_cpu:.2f}s)", flush=True)
                for m in rotated(methods2, rep):
                    bench.run_s3_method(m, rep)
                    s, l = m.samples[-1], m.load_samples[-1]
                    print(f"[{rep + 1}/{args.repeats}] {m.name:44s} save {s.seconds:7.3f}s "
                          f"{nbytes / s.seconds / MiB:7.1f} MiB/s (cpu {s.client_cpu:.2f}/{s.server_cpu:.2f}s) | load "
                          f"{l.seconds:7.3f}s {nbytes / l.seconds / MiB:7.1f} MiB/s (cpu {l.client_cpu:.2f}/"
                          f"{l.server_cpu:.2f}s)", flush=True)
            info["contention"] = load.stop().describe("during the timed rounds")
            info["server_line"] = (f"This run's moto server (pid {server.process.pid}) is a process of the machine too: "
                                   "a busy `moto.server` among the other busy processes above is it (or a test's "
                                   "server running beside it)")
            if args.profile:
                info["profile"] = profile_ours(bench, args.profile)
        finally:
            server.stop()
        return methods1, methods2, info


# Blocking calls (a thread waiting, not working), left out of the profile's ranking.
WAITS = {"<method 'acquire' of '_thread.lock' objects>", "<method 'acquire' of '_thread.RLock' objects>",
         "<method 'poll' of 'select.epoll' objects>", "<method 'select' of 'select.epoll' objects>",
         "<method 'get' of '_queue.SimpleQueue' objects>", "<built-in method time.sleep>"}


def function_name(filename: str, line: int, name: str) -> str:
    """'name (file:line)' for Python functions, 'module.Class.method' for builtins."""
    if filename == "~":
        match = re.fullmatch(r"<method '(\w+)' of '([\w.]+)' objects>", name)
        if match:
            return f"{match.group(2)}.{match.group(1)}"
        match = re.fullmatch(r"<(?:built-in method|function) ([\w.]+)(?: at 0x\w+)?>", name)
        return match.group(1) if match else name
    where = filename.split("site-packages/")[-1].replace(str(REPO) + "/", "")
    where = re.sub(r"^.*/lib/python3\.\d+/", "", where)
    return f"{name} ({where}:{line})"


def profile_ours(bench: Bench, top: int) -> list[str]:
    """cProfile of one ``ckpt.save`` to S3 over every thread that works for it: the main thread, the
    threads it starts (writer, hasher, part uploads: ``threading.setprofile``) and fsspec's event
    loop thread, where s3fs/aiobotocore prepare, sign and send every request. Returns the ``top``
    functions by own time summed over those threads, blocking waits (lock acquire, epoll, queue get)
    left out: where the client's CPU goes. The server's share is in the tables' CPU columns."""
    profiles: list[cProfile.Profile] = []

    def hook(*_):  # runs first in every new thread: profile that thread from here on
        profile = cProfile.Profile()
        profiles.append(profile)
        profile.enable()

    loop = fsspec.asyn.get_loop()
    loop_profile, main_profile = cProfile.Profile(), cProfile.Profile()
    started = threading.Event()
    loop.call_soon_threadsafe(lambda: (loop_profile.enable(), started.set()))
    started.wait()
    url = bench.url(9999, "ckpt")
    threading.setprofile(hook)
    start = time.perf_counter()
    main_profile.enable()
    try:
        ckpt.save(bench.reference, url, storage_options=bench.options)
    finally:
        main_profile.disable()
        total = time.perf_counter() - start
        threading.setprofile(None)
        stopped = threading.Event()
        loop.call_soon_threadsafe(lambda: (loop_profile.disable(), stopped.set()))
        stopped.wait()
    bench.clear(9999, "ckpt")
    stats = pstats.Stats(main_profile, stream=io.StringIO())
    for profile in [loop_profile, *profiles]:
        if profile.getstats():
            stats.add(profile)
    rows = []
    work = {k: v for k, v in stats.stats.items() if k[2] not in WAITS}
    busy = sum(v[2] for v in work.values())
    for (filename, line, name), (_, nc, tt, ct, _) in sorted(work.items(), key=lambda kv: -kv[1][2])[:top]:
        rows.append(f"`{function_name(filename, line, name)}` {tt:.3f} s ({nc} calls)")
    print("\n".join(rows))
    return [f"one `ckpt.save` to S3 under cProfile took {total:.2f} s wall; own time in the client's threads "
            f"(main, writer/hash/part-upload threads, fsspec's event loop), blocking waits left out: {busy:.2f} s, "
            f"of which", *rows]


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------
def raw_parallel_get(fs, prefix: str) -> None:
    """The raw peer of a load: every data file under ``prefix`` read by ``RAW_THREADS`` ranged GETs of
    ``RAW_RANGE`` bytes in flight into one pre-faulted buffer per file (the manifest too), unverified."""
    from concurrent.futures import ThreadPoolExecutor

    fs.invalidate_cache()
    files = {name: info["size"] for name, info in fs.find(prefix, detail=True).items()}
    buffers = {name: bytearray(b"\1") * size for name, size in files.items()}
    ranges = [(name, start) for name, size in files.items() for start in range(0, size, RAW_RANGE)]

    def get(job) -> None:
        name, start = job
        stop = min(start + RAW_RANGE, files[name])
        buffers[name][start:stop] = fs.cat_file(name, start=start, end=stop)

    with ThreadPoolExecutor(RAW_THREADS) as pool:
        list(pool.map(get, ranges))


def paired(ours: Method, peer: Method, load: bool = False) -> list[float]:
    """Per repeat: peer's seconds / ours (how many times peer's speed ours ran at)."""
    return [p / o for o, p in zip(ours.seconds(load), peer.seconds(load))]


# The JSON's system labels (plot legends, table rows) and operation of each method's timings.
SYSTEMS = {"primary": ("ours (ckpt.save, local disk)", "save_local"), "copy": ("ours (copy_step)", "replicate"),
           "put": ("s3fs put", "replicate"), "copy_rb": ("ours (copy_step, read_back)", "replicate"),
           "ckpt": ("ours (ckpt.save to S3)", "save"), "raw": ("raw (s3fs put)", "save")}
LOAD_SYSTEMS = {"ckpt": "ours (ckpt.load from S3)", "raw": "raw (parallel ranged GETs)"}


def system_of(m: Method, load: bool = False) -> tuple[str, str]:
    """(system label, op) of ``m``'s save (or load) timings in the JSON."""
    if m.key.startswith("dcp"):
        n = int(m.key[3:])
        if load:  # FsspecReader has no thread count: it reads the n files the n-thread writer wrote
            return f"DCP FsspecReader ({n} file{'s' if n > 1 else ''})", "load"
        return f"DCP FsspecWriter ({n} thread{'s' if n > 1 else ''})", "save"
    return (LOAD_SYSTEMS[m.key], "load") if load else SYSTEMS[m.key]


def json_metrics(methods1: list[Method], methods2: list[Method], nbytes: int) -> list[dict]:
    """MiB/s per repeat of every timed operation: replications, saves to S3, loads from S3."""
    out = []
    for m in methods1:
        system, op = system_of(m)
        out.append(metric(system, "mibps", "MiB/s", [nbytes / s / MiB for s in m.seconds()], op=op))
    for load in (False, True):
        for m in methods2:
            system, op = system_of(m, load)
            out.append(metric(system, "mibps", "MiB/s", [nbytes / s / MiB for s in m.seconds(load)], op=op))
    return out


def ratio_goal(name: str, ours: Method | None, peer: Method | None, target: float, load: bool = False,
               what: str = "") -> dict:
    """A speed goal: the median over repeats of the paired ratio (peer's seconds / ours), min-max in the
    detail; unmeasured (None) when the peer did not run (e.g. --dcp-threads without 1)."""
    if ours is None or peer is None:
        return goal(name, None, target, ">=", f"not measured: {what or 'the peer'} did not run")
    ratios = paired(ours, peer, load)
    return goal(name, median(ratios), target, ">=",
                f"median of {len(ratios)} paired repeat(s), min–max {min(ratios):.2f}–{max(ratios):.2f}; "
                f"{median(ours.seconds(load)):.2f} s vs {median(peer.seconds(load)):.2f} s")


def storage_goals(methods1: list[Method], methods2: list[Method]) -> list[dict]:
    by1, by2 = {m.key: m for m in methods1}, {m.key: m for m in methods2}
    dcp_default, ours = by2.get("dcp1"), by2.get("ckpt")
    missing = "DCP's FsspecWriter with thread_count=1 (--dcp-threads without 1)"
    return [
        ratio_goal(f"replication ≥ {GOAL_REPLICATION}× s3fs put", by1["copy"], by1["put"], GOAL_REPLICATION),
        ratio_goal(f"save to S3 ≥ {GOAL_SAVE}× DCP FsspecWriter (default thread_count=1)", ours, dcp_default,
                   GOAL_SAVE, what=missing),
        ratio_goal(f"load from S3 ≥ {GOAL_LOAD}× DCP FsspecReader", ours, dcp_default, GOAL_LOAD, load=True,
                   what=missing),
        ratio_goal(f"load from S3 ≥ {GOAL_LOAD_X_RAW}× raw parallel ranged GETs", ours, by2.get("raw"), GOAL_LOAD_X_RAW,
                   load=True, what="the raw reader"),
    ]


def rate(nbytes: int, seconds: list[float]) -> str:
    xs = [nbytes / s / MiB for s in seconds]
    return f"{median(xs):.1f} ({min(xs):.1f}–{max(xs):.1f})"


def requests(samples: list[Sample]) -> str:
    """The requests of the last repeat, by HTTP method ('3: 2 PUT, 1 HEAD')."""
    counts = samples[-1].requests
    return f"{sum(counts.values())}: " + ", ".join(f"{n} {verb}" for verb, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def cpu(samples: list[Sample]) -> str:
    return f"{median([s.client_cpu for s in samples]):.2f} / {median([s.server_cpu for s in samples]):.2f}"


def report(methods1: list[Method], methods2: list[Method], info: dict, args: argparse.Namespace, command: str) -> str:
    nbytes = info["nbytes"]
    by1 = {m.key: m for m in methods1}
    by2 = {m.key: m for m in methods2}
    ours1 = by1["copy"]
    put = by1["put"]

    t1 = table_head(["Method", "MiB/s, median (min–max)", "Seconds, median (min–max)",
                     "× s3fs put (paired, min–max)", "CPU s client / server", "Requests", "Notes"], "lrrrrll")
    for m in methods1:
        ratio = median_span(paired(m, put), 2) if m.key != "put" else "1.00"
        t1.append(f"| {m.name} | {rate(nbytes, m.seconds())} | {median_span(m.seconds())} | {ratio} "
                  f"| {cpu(m.samples)} | {requests(m.samples) if m.key != 'primary' else '–'} | {m.note} |")

    t2 = table_head(["Method", "Save MiB/s (min–max)", "Save s (min–max)", "Save × DCP default (paired)",
                     "Load MiB/s (min–max)", "Load s (min–max)", "Load × DCP default (paired)",
                     "CPU s client / server: save; load", "Requests: save; load", "Notes"], "l" + "r" * 7 + "ll")
    dcp_default = by2.get("dcp1")
    for m in methods2:
        if dcp_default is not None and m is not dcp_default:
            rs, rl = median_span(paired(m, dcp_default), 2), median_span(paired(m, dcp_default, True), 2)
        else:
            rs = rl = "1.00" if m is dcp_default else "–"
        t2.append(f"| {m.name} | {rate(nbytes, m.seconds())} | {median_span(m.seconds())} | {rs} "
                  f"| {rate(nbytes, m.seconds(True))} | {median_span(m.seconds(True))} | {rl} "
                  f"| {cpu(m.samples)}; {cpu(m.load_samples)} | {requests(m.samples)}; {requests(m.load_samples)} "
                  f"| {m.note} |")

    notes = [goal_line(g, digits=2) for g in storage_goals(methods1, methods2)]
    primary = by1["primary"]
    notes.append(f"- The copy takes {median(ours1.seconds()) / median(primary.seconds()):.1f}× as long as writing "
                 "the primary to local disk.")
    extra = sum(ours1.samples[-1].requests.values()) - sum(put.samples[-1].requests.values())
    notes.append(f"- Requests (counted from the server's log, last repeat): copy_step makes {extra} more than s3fs put "
                 "for the same bytes: the commit protocol's checks on the target (LISTs and HEADs: is it committed, "
                 "leftovers of dead attempts, objects no manifest references), a HEAD per object to check its stored "
                 "size. On loopback each costs about a millisecond; against a "
                 "real store each is a round trip, and at small sizes (`--quick`) they dominate the copy.")
    notes.append("- moto answers a ranged GET by reading the whole object and slicing it (`FakeKey.value`), so a "
                 "load's server CPU grows with GETs × object size: loads of one object holding the whole state (ours: "
                 f"{ckpt_remote.RANGE_BYTES // MiB} MiB ranges; DCP's reader: s3fs blocks) pay for that, DCP with "
                 "`thread_count=4` (four objects of a quarter each) less. A real store serves a range without touching the rest.")
    notes.append("- moto is an in-memory Python server in a subprocess on the same machine: every byte crosses "
                 "loopback HTTP and is handled by Python on both ends, so absolute MiB/s say little about a real "
                 "object store; the ratios between methods of the same run, against the same server, are the result. "
                 "*CPU s client / server* is the CPU time (all threads) of this process and of the moto process "
                 "during the operation: on this 2-vCPU box their sum against the wall time shows when the run is "
                 "CPU-bound.")
    notes.append("- Source step (written once by `ckpt.save` before the repeats): "
                 + ", ".join(f"{k} {v / MiB:.1f} MiB" if v >= MiB else f"{k} {v} B"
                             for k, v in sorted(info["source_files"].items()))
                 + ". Each method writes into a fresh prefix per repeat, deleted afterwards (outside the timing). "
                 "Checked outside the timing: the object sizes in the bucket equal the source's for both copies, "
                 "copy_step's target is committed"
                 + ("" if args.no_verify else ", the first repeat's replica loads with `ckpt.load` bitwise equal, "
                    "and every S3 load is compared bitwise with the state") + ".")
    notes.append(f"- Our S3 writer: multipart uploads of {ckpt_remote.PART_BYTES // MiB} MiB parts, "
                 f"{ckpt_remote.PARALLEL_PARTS} in flight per file, each object's size checked after upload, "
                 f"manifest written last (the commit); a load makes ranged GETs of {ckpt_prefetch.REMOTE_PIECE_BYTES // MiB} MiB, "
                 f"{ckpt_prefetch.REMOTE_READ_THREADS} in flight, neighbouring chunks smaller than one GET sharing one "
                 "(`ckpt/_read_batch.py`). s3fs `put` uses one PUT below 100 MiB, else 50 MiB parts, "
                 "up to 10 in flight. DCP's FsspecWriter writes through an s3fs file, which uploads what it has buffered "
                 "as one part each time 50 MiB or more have accumulated, one part at a time, and renames `.metadata` "
                 "into place (a copy on S3).")
    if info.get("profile"):
        notes.append("- Profile (`--profile`): " + info["profile"][0] + " " + "; ".join(info["profile"][1:]) + ".")
    cache = ("`sync` + `echo 3 > /proc/sys/vm/drop_caches` before every timed operation (`--cold`: local reads cold)"
             if info["cold"] else "`sync` before every timed operation, page cache kept: the source step is read "
             "warm, as right after the primary's write (`--cold` drops the cache)")
    server = ("moto keeps every object in its memory (`MOTO_S3_DEFAULT_KEY_BUFFER_SIZE` raised for the server)"
              if not args.moto_spill else "moto spills objects over ~5 MiB to temporary files (`--moto-spill`)")
    body = [
        SECTION,
        "",
        f"State: {info['state']}. moto server (`tests.support.s3server.MotoServer`) on 127.0.0.1, one bucket, "
        f"s3fs with the tests' storage options (endpoint, dummy keys). Median of {args.repeats} repeat(s), "
        f"methods of each part interleaved (order rotated per repeat); MiB/s = state bytes (2^20) / wall seconds "
        f"(`time.perf_counter` around the call only); × ratios are speed ratios paired per repeat (peer's seconds / "
        f"the method's). {cache}. {server}.",
        "",
        "Replication of one committed step, local disk → S3:",
        "",
        *t1,
        "",
        "Save straight to S3, then load back in place:",
        "",
        *t2,
        "",
        "Notes:",
        *notes,
        "",
        *provenance(info["machine"], command, load=info["contention"], extra=[info["server_line"]]),
    ]
    return "\n".join(body)


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__doc__, keep=True)
    parser.add_argument("--size-mb", type=float, default=256.0, help="state size in MiB (default 256)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every method (default 3)")
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK['size_mb']:.0f} MiB state, {QUICK['repeats']} repeats (~20 s; per-request "
                             "overheads weigh more than at 256 MiB)")
    parser.add_argument("--read-back", action="store_true", help="also time copy_step(read_back=True)")
    parser.add_argument("--dcp-threads", type=int, nargs="+", default=[1, 4],
                        help="thread_count of the DCP FsspecWriter variants (default 1 4; 1 is the goal's peer)")
    parser.add_argument("--profile", type=int, nargs="?", const=12, default=0, metavar="N",
                        help="after the repeats, cProfile one ckpt.save to S3 and report the top N (default 12)")
    parser.add_argument("--cold", action="store_true",
                        help="drop the page cache before every timed operation (root only; default: keep it)")
    parser.add_argument("--moto-spill", action="store_true",
                        help="leave moto's object buffer limit as it is (objects over ~5 MiB go to temporary files)")
    parser.add_argument("--no-verify", action="store_true", help="skip the bitwise checks of loads")
    parser.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up round")
    parser.add_argument("--tiny", action="store_true", help="the tests' smoke run: a 4 MiB state, one repeat")
    args = parser.parse_args(argv)
    for key, value in (TINY if args.tiny else QUICK if args.quick else {}).items():
        setattr(args, key, value)
    if args.repeats < 1 or args.size_mb <= 0 or any(t < 1 for t in args.dcp_threads):
        parser.error("--repeats and --dcp-threads must be >= 1 and --size-mb > 0")
    args.dcp_threads = list(dict.fromkeys(args.dcp_threads))

    command = command_line("bench_storage.py", argv)
    methods1, methods2, info = run(args)
    section = report(methods1, methods2, info, args, command)
    publish(section, args.out)
    write_json(args.json, BENCH_NAME, section, command, metrics=json_metrics(methods1, methods2, info["nbytes"]),
               goals=storage_goals(methods1, methods2),
               params={"state_mib": info["nbytes"] / MiB, "state_bytes": info["nbytes"], "repeats": args.repeats,
                       "quick": args.quick, "dcp_threads": args.dcp_threads, "read_back": args.read_back,
                       "cold": info["cold"], "moto_in_memory": not args.moto_spill})
    return 0


if __name__ == "__main__":
    sys.exit(main())
