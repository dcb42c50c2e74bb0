#!/usr/bin/env python
"""Save/load throughput of the ckpt engine against its peers, and resharded loads, in one run (issues 2, 15).

    python benchmarks/bench_save_load.py --tiny                                  # the tests' run: 10 MiB states
    python benchmarks/bench_save_load.py --quick --json /tmp/save_load.json     # smoke run, < 30 s
    python benchmarks/bench_save_load.py --gib 1 --repeats 3 --reshard-gib 1 --out benchmarks/RESULTS.md

Part 1, one process. A synthetic training state of about ``--gib`` GiB (a realistic mix: a few
large fp32 matrices, a few bf16 matrices, some medium fp32 tensors and 200 tensors of a few KB,
random values) is saved and loaded back by every method below. Each repeat runs every method once
(save, then load), in an order rotated per repeat so that slow drifts of the machine hit all methods
alike; the table reports the median over repeats, and the ratios to raw are paired per repeat: a
save with raw's save of the same repeat, a load with a raw read of the same bytes (a file written
once, untimed, at the start) timed right next to it, before or after it alternating per repeat, since
this box's virtual disk swings 0.4-3 GiB/s over seconds.

What is timed (``time.perf_counter`` around the call only; deleting old output, dropping the page
cache, zeroing the destination and verifying the result are outside the timing):

raw            save: ``os.write`` of every tensor's bytes back to back into one file, then
               ``fsync`` - the physical limit of one writer. load: ``os.preadv`` of the whole file
               (64 MiB per call) into one preallocated, pre-faulted buffer.
ours           save: ``ckpt.save(state, dir)`` - everything up to and including the atomic commit
               (data fsync, manifest, rename, directory fsyncs). load: ``ckpt.load(state, dir)``
               into the live tensors in place, checksums verified.
ours (DCP plug-in)  ``dcp.save(sd, storage_writer=ckpt.dcp.Writer(dir), no_dist=True)`` and
               ``dcp.load(sd, storage_reader=ckpt.dcp.Reader(dir), no_dist=True)`` (DCP's default
               planners).
DCP            ``dcp.save(sd, storage_writer=FileSystemWriter(dir), no_dist=True)`` (defaults:
               one file per rank, ``sync_files=True`` i.e. fsync'd, one thread) and
               ``dcp.load(sd, storage_reader=FileSystemReader(dir), no_dist=True)`` in place.
torch.save     save: ``torch.save(sd, file)`` then ``fsync`` of the file (included in the time).
               load: ``torch.load(file, mmap=False, weights_only=True)`` into fresh tensors, then
               ``copy_`` into the live tensors (included).
safetensors    save: ``safetensors.torch.save_file(sd, file)`` then ``fsync`` (included).
               load: ``safetensors.torch.load_file(file)`` then ``copy_`` into the live tensors.
torchsnapshot  save: ``Snapshot.take(dir, app_state={"s": StateDict(**sd)})``, then ``fsync`` of
               every file it wrote (included: torchsnapshot itself only writes and closes its
               files, through aiofiles, and never fsyncs). load: ``Snapshot(dir).restore(app_state)``
               with a ``StateDict`` over the live tensors: torchsnapshot reads into the tensors the
               stateful's ``state_dict()`` returns, i.e. in place (the bitwise check of the live
               tensors afterwards proves it).

Part 2, four processes (``reshard_load.py``; ``--no-reshard`` skips it): a sharded state of
``--reshard-gib`` GiB (four fp32 matrices as DTensors, ``Shard(0)`` on a CPU mesh of 2 ranks, gloo
on 127.0.0.1) is saved once by ours (``ckpt.save``/``ckpt.load``) and by DCP
(``FileSystemWriter``/``FileSystemReader``), then loaded into the same layout, into 4 ranks
``Shard(0)`` and into 2 ranks ``Shard(1)``; saved on 4 ranks FSDP×TP and loaded as FSDP 2, saved by 2
pipeline stages and loaded by one process (against a one-process save); load time = the slowest rank, cold cache, each shard
verified bitwise against the full tensor. See that module's docstring.

Before every timed operation the script runs ``sync`` and, when it may (root), drops the page cache
(``echo 3 > /proc/sys/vm/drop_caches``), so writes start with no dirty pages and reads are cold;
when it may not, reads are warm and the report says so. Throughput is state bytes (tensor payload,
not file size) / seconds, in GB/s (10^9 bytes).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import safetensors
import torch
import torch.distributed.checkpoint as dcp

from harness import (  # first: puts this checkout's root on sys.path
    Load, add_modes, apply_mode, argument_parser, check_equal, drop_caches, machine_description, package_version,
    remove, rotated, timed, work_dir,
)

import ckpt  # noqa: E402
import ckpt.dcp  # noqa: E402
import peers  # noqa: E402
import reshard_load  # noqa: E402  (next to this script: the multi-process part)
from report import command_line, publish, write_json  # noqa: E402
from save_load_report import report  # noqa: E402
from states import describe_mixed, mixed_state, state_bytes, zeros_like  # noqa: E402

BENCH_NAME = "save_load"
QUICK = {"gib": 0.25, "repeats": 1, "reshard_gib": 0.125}
TINY = {"gib": 0.01, "repeats": 1, "reshard_gib": 0.01}  # the tests' smoke run
FULL = {"gib": 1.0, "repeats": 9, "reshard_gib": 1.0}  # 9: the benchmark box's virtual disk swings 0.4-3 GiB/s over seconds

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", message="TypedStorage is deprecated")  # torchsnapshot 0.1.0, every save


# ---------------------------------------------------------------------------------------------
# Methods
# ---------------------------------------------------------------------------------------------
@dataclass
class Method:
    label: str  # the system's name in the tables, the JSON and the plots
    calls: str  # what it calls
    target: str  # file or directory name in the work dir
    save: Callable[[dict, Path], None]
    load: Callable[[dict, Path], None]
    note: str = ""
    save_times: list[float] = field(default_factory=list)
    load_times: list[float] = field(default_factory=list)
    raw_load_times: list[float] = field(default_factory=list)  # the raw read timed next to each load
    size: int = 0


def _dir_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def ckpt_save(state: dict, path: Path) -> None:
    ckpt.save(state, path)


def ckpt_load(state: dict, path: Path) -> None:
    ckpt.load(state, path)


def plugin_save(state: dict, path: Path) -> None:
    dcp.save(state, storage_writer=ckpt.dcp.Writer(path), no_dist=True)


def plugin_load(state: dict, path: Path) -> None:
    dcp.load(state, storage_reader=ckpt.dcp.Reader(path), no_dist=True)


METHOD_KEYS = ("raw", "ckpt", "plugin", "dcp", "torch", "safetensors", "torchsnapshot")


def build_methods(nbytes: int, selected: list[str] | None) -> tuple[list[Method], peers.Raw]:
    raw = peers.Raw(nbytes)
    methods = {
        "raw": Method("raw", "os.write + fsync / os.preadv", "raw.bin", raw.save, raw.load,
                      "one file; load into one pre-faulted buffer"),
        "ckpt": Method("ours", "ckpt.save / ckpt.load", "ckpt", ckpt_save, ckpt_load, "incl. commit; checksums verified"),
        "plugin": Method("ours (DCP plug-in)", "ckpt.dcp.Writer / Reader", "plugin", plugin_save, plugin_load,
                         "through dcp.save / dcp.load"),
        "dcp": Method("DCP", "FileSystemWriter / Reader", "dcp", peers.dcp_save, peers.dcp_load, "sync_files=True"),
        "torch": Method("torch.save", "torch.save / torch.load", "torch.pt", peers.torch_save, peers.torch_load_into,
                        "+fsync; load + copy_"),
        "safetensors": Method("safetensors", "save_file / load_file", "model.safetensors", peers.safetensors_save,
                              peers.safetensors_load_into,
                              "+fsync; load + copy_"),
        "torchsnapshot": Method("torchsnapshot", "Snapshot.take / restore", "snapshot", peers.snapshot_take, peers.snapshot_restore,
                                "+fsync of its files; restore in place"),
    }
    wanted = set(selected or METHOD_KEYS) | {"raw"}  # raw is always measured: it is the yardstick
    return [m for key, m in methods.items() if key in wanted], raw


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------
def warm_up(methods: list[Method], reference: dict, work: Path) -> None:
    """Untimed: lazy imports and first-call costs of every library, then one full-size raw write."""
    small = {k: v for k, v in reference.items() if k.startswith("model.layers.")}
    small_live = {k: torch.empty_like(v) for k, v in small.items()}
    for m in methods:
        target = work / ("warmup-" + m.target)
        if m.label == "raw":
            peers.Raw.save(small, target)
        else:
            m.save(small, target)
            m.load(small_live, target)
        remove(target)
    # The first big write of a process is often several times slower than the next ones
    # here (fresh page cache); absorb it outside the timing so it does not land on one method.
    target = work / "warmup-full.bin"
    peers.Raw.save(reference, target)
    remove(target)


def run(args: argparse.Namespace, work: Path, info: dict) -> list[Method]:
    """Part 1: every method saves and loads the state once per repeat."""
    t0 = time.perf_counter()
    reference = mixed_state(args.gib, seed=0)
    live = zeros_like(reference)
    nbytes = state_bytes(reference)
    info["nbytes"] = nbytes
    info["state"] = describe_mixed(reference)
    print(f"state: {info['state']} (built in {time.perf_counter() - t0:.1f}s)", flush=True)

    methods, raw = build_methods(nbytes, args.methods)
    if not args.no_warmup:
        warm_up(methods, reference, work)
    if not args.no_reshard:  # the reshard part's forkserver, started in main(), must be idle from here on
        reshard_load.wait_forkserver()

    yardstick = work / "raw-yardstick.bin"  # read raw right next to every other method's load
    peers.Raw.save(reference, yardstick)
    load = Load()
    for rep in range(args.repeats):
        for m in rotated(methods, rep):
            target = work / m.target
            drop_caches(info["cold"])
            ts = timed(lambda: m.save(reference, target))
            m.size = _dir_size(target)
            for t in live.values():  # outside the timing: prove the load really writes
                t.zero_()
            if m.label != "raw" and rep % 2 == 1:  # which of the two goes first alternates per repeat
                m.raw_load_times.append(raw_read(raw, yardstick, info["cold"]))
            drop_caches(info["cold"])
            tl = timed(lambda: m.load(live, target))
            if not args.no_verify:
                if m.label == "raw":
                    raw.verify(reference)
                else:
                    check_equal(live, reference, m.label)
            if m.label != "raw" and rep % 2 == 0:
                m.raw_load_times.append(raw_read(raw, yardstick, info["cold"]))
            m.save_times.append(ts)
            m.load_times.append(tl)
            print(f"[{rep + 1}/{args.repeats}] {m.label:20s} save {ts:7.3f}s {nbytes / ts / 1e9:6.2f} GB/s"
                  f" | load {tl:7.3f}s {nbytes / tl / 1e9:6.2f} GB/s", flush=True)
        # Outputs are deleted once a repeat is over, not between methods: on this VM's disk (ext4 with
        # online discard) a write right after a large delete ran up to ~2x slower, which used to land
        # on whichever method followed raw in the rotation (always the same one).
        for m in methods:
            remove(work / m.target)
    remove(yardstick)
    info["contention"] = load.stop().describe("during the timed rounds")
    info["part1_s"] = time.perf_counter() - t0
    return methods


def raw_read(raw: peers.Raw, path: Path, cold: bool) -> float:
    """Seconds of one raw read of ``path`` (after a cache drop when ``cold``)."""
    drop_caches(cold)
    return timed(lambda: raw.load({}, path))


def run_reshard(args: argparse.Namespace, work: Path, info: dict) -> dict:
    """Part 2: resharded loads on 2 and 4 ranks (reshard_load.py)."""
    load = Load()
    result = reshard_load.run(args.reshard_gib, args.repeats, work / "reshard", info["cold"],
                              check=not args.no_verify)
    result["contention"] = load.stop().describe("during the reshard part")
    result["cold"] = info["cold"]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__doc__, keep=True)
    add_modes(parser, TINY, QUICK, quick_note=" (< 30 s on 2 cores)")
    parser.add_argument("--gib", type=float, help=f"state size in GiB (default {FULL['gib']})")
    parser.add_argument("--repeats", type=int, help=f"rounds per method and per reshard layout (default {FULL['repeats']})")
    parser.add_argument("--reshard-gib", type=float,
                        help=f"size of the sharded state of the reshard part in GiB (default {FULL['reshard_gib']})")
    parser.add_argument("--no-reshard", action="store_true", help="skip the multi-process reshard part")
    parser.add_argument("--methods", nargs="+", choices=METHOD_KEYS, help="subset of part 1 (raw is always included)")
    parser.add_argument("--warm", action="store_true", help="do not drop the page cache (warm reads)")
    parser.add_argument("--no-verify", action="store_true", help="skip the bitwise check after each load")
    parser.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up round of part 1")
    args = parser.parse_args(argv)
    apply_mode(args, TINY, QUICK, FULL)
    if args.repeats < 1 or args.gib <= 0 or args.reshard_gib <= 0:
        parser.error("--repeats must be >= 1, --gib and --reshard-gib > 0")

    command = command_line("bench_save_load.py", argv)
    with work_dir(args.dir, "save_load-", keep=args.keep) as work:
        info: dict = {"machine": machine_description(work, [f"safetensors {safetensors.__version__}",
                                                             f"torchsnapshot {package_version('torchsnapshot')}",
                                                             f"torch threads {torch.get_num_threads()}"])}
        print(f"work dir: {work}", flush=True)
        info["cold"] = drop_caches(not args.warm)
        print("reads: " + ("cold (page cache dropped before every timed operation)" if info["cold"] else
                           "warm (page cache NOT dropped: " + ("--warm given" if args.warm else "not permitted") + ")"),
              flush=True)
        if not args.no_reshard:  # it imports torch and ckpt (still in the page cache) while part 1 sets up
            reshard_load.start_forkserver()
        methods = run(args, work, info)
        reshard = None if args.no_reshard else run_reshard(args, work, info)
    section, metrics, goals = report(methods, info, reshard, args, command)
    publish(section, args.out)
    write_json(args.json, BENCH_NAME, section, command, metrics=metrics, goals=goals,
               params={"gib": args.gib, "repeats": args.repeats, "state_bytes": info["nbytes"], "cold": info["cold"],
                       "reshard_gib": None if args.no_reshard else args.reshard_gib,
                       "reshard_state_bytes": None if reshard is None else reshard["nbytes"],
                       "methods": [m.label for m in methods], "quick": args.quick})
    return 0


if __name__ == "__main__":
    sys.exit(main())
