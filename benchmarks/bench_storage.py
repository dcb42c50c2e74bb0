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
import sys
import time
import warnings

import torch

from harness import (  # first: puts this checkout's root on sys.path
    Load, add_modes, apply_mode, argument_parser, drop_caches, machine_description, rotated, work_dir,
)

import fsspec  # noqa: E402
import fsspec.asyn  # noqa: E402
import moto  # noqa: E402
import s3fs  # noqa: E402

import ckpt  # noqa: E402
from moto_probe import Probe, Sample, start_server  # noqa: E402
from report import command_line, publish, write_json  # noqa: E402
from states import describe_fp32, fp32_matrices_state, state_bytes, zeros_like  # noqa: E402
from storage_methods import BUCKET, OURS_S3, Bench, Method, local_sizes  # noqa: E402
from storage_report import MiB, json_metrics, report, storage_goals  # noqa: E402
from tests.support.s3server import make_bucket, s3_storage_options  # noqa: E402
from thread_profile import profile_call, top_functions  # noqa: E402

BENCH_NAME = "storage"
QUICK = {"size_mb": 32.0, "repeats": 3}  # ~20 s on a quiet 2-core box, moto's start included
TINY = {"size_mb": 4.0, "repeats": 1}  # the tests' smoke run
FULL = {"size_mb": 256.0, "repeats": 3}

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
warnings.filterwarnings("ignore", category=FutureWarning)


def run(args: argparse.Namespace) -> tuple[list[Method], list[Method], dict]:
    with work_dir(args.dir, "storage-", keep=args.keep) as work:
        info: dict = {"ours_s3": OURS_S3}
        server = start_server(work, keep_in_memory=not args.moto_spill)
        try:
            make_bucket(server.endpoint_url, BUCKET)
            bench = Bench(args, work, Probe(server, s3fs.S3FileSystem(**s3_storage_options(server.endpoint_url))))
            t0 = time.perf_counter()
            bench.reference = fp32_matrices_state(args.size_mb)
            bench.live = zeros_like(bench.reference)
            info["nbytes"] = nbytes = state_bytes(bench.reference)
            info["state"] = describe_fp32(bench.reference)
            info["machine"] = machine_description(work, [
                f"s3fs {s3fs.__version__}", f"fsspec {fsspec.__version__}", f"moto {moto.__version__}",
                f"torch threads {torch.get_num_threads()}"])
            print(f"state: {info['state']} (built in {time.perf_counter() - t0:.1f}s)", flush=True)
            print(f"moto server: {server.endpoint_url} (started in {server.startup_seconds:.1f}s), work dir: {work}",
                  flush=True)
            info["cold"] = bench.probe.cold = drop_caches(args.cold)
            ckpt.save(bench.reference, bench.source)  # the committed step every copy starts from
            info["source_files"] = local_sizes(bench.source)

            methods1, methods2 = bench.replication_methods(), bench.s3_methods()
            if not args.no_warmup:
                t0 = time.perf_counter()
                bench.warm_up(methods1 + methods2)
                print(f"warm-up done in {time.perf_counter() - t0:.1f}s", flush=True)

            load = Load(processes=True)
            for rep in range(args.repeats):
                for m in rotated(methods1, rep):
                    s = bench.probe.measure(lambda: m.run(rep))
                    m.samples.append(s)
                    bench.after_replication(m, rep)
                    print(f"[{rep + 1}/{args.repeats}] {m.name:44s} {shown(nbytes, s)}", flush=True)
                for m in rotated(methods2, rep):
                    bench.run_s3_method(m, rep)
                    print(f"[{rep + 1}/{args.repeats}] {m.name:44s} save {shown(nbytes, m.samples[-1])} | load "
                          f"{shown(nbytes, m.load_samples[-1])}", flush=True)
            info["contention"] = load.stop().describe("during the timed rounds")
            info["server_line"] = (f"This run's moto server (pid {server.process.pid}) is a process of the machine too: "
                                   "a busy `moto.server` among the other busy processes above is it (or a test's "
                                   "server running beside it)")
            if args.profile:
                info["profile"] = profile_ours(bench, args.profile)
        finally:
            server.stop()
        return methods1, methods2, info


def shown(nbytes: int, s: Sample) -> str:
    return (f"{s.seconds:7.3f}s {nbytes / s.seconds / MiB:7.1f} MiB/s  (cpu: client {s.client_cpu:.2f}s, "
            f"server {s.server_cpu:.2f}s)")


def profile_ours(bench: Bench, top: int) -> list[str]:
    """cProfile of one ``ckpt.save`` to S3 over every thread that works for it (``thread_profile``:
    the main thread, the writer/hasher/part-upload threads it starts, fsspec's event loop thread);
    the ``top`` functions by own time, blocking waits left out: where the client's CPU goes. The
    server's share is in the tables' CPU columns."""
    url = bench.url(9999, "ckpt")
    total, stats = profile_call(lambda: ckpt.save(bench.reference, url, storage_options=bench.options),
                                loop=fsspec.asyn.get_loop())
    bench.clear(9999, "ckpt")
    busy, rows = top_functions(stats, top)
    print("\n".join(rows))
    return [f"one `ckpt.save` to S3 under cProfile took {total:.2f} s wall; own time in the client's threads "
            f"(main, writer/hash/part-upload threads, fsspec's event loop), blocking waits left out: {busy:.2f} s, "
            f"of which", *rows]


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__doc__, keep=True)
    parser.add_argument("--size-mb", type=float, help=f"state size in MiB (default {FULL['size_mb']:.0f})")
    parser.add_argument("--repeats", type=int, help=f"rounds of every method (default {FULL['repeats']})")
    add_modes(parser, TINY, QUICK, quick_note=" (~20 s; per-request overheads weigh more than at 256 MiB)")
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
    args = parser.parse_args(argv)
    apply_mode(args, TINY, QUICK, FULL)
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
