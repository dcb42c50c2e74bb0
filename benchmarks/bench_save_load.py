#!/usr/bin/env python
"""Save/load throughput of the ckpt engine against its peers, in one run (issue 2).

    python benchmarks/bench_save_load.py --gib 1 --repeats 3 --out benchmarks/RESULTS.md

A synthetic training state of about ``--gib`` GiB (a realistic mix: a few large fp32 matrices, a
few bf16 matrices, some medium fp32 tensors and 200 tensors of a few KB, random values) is saved
and loaded back by every method below. Each repeat runs every method once (save, then load), in
an order rotated per repeat so that slow drifts of the machine hit all methods alike; the table
reports the median over repeats.

What is timed (``time.perf_counter`` around the call only; deleting old output, dropping the page
cache, zeroing the destination and verifying the result are outside the timing):

raw            save: ``os.write`` of every tensor's bytes back to back into one file, then
               ``fsync`` - the physical limit of one writer. load: ``os.preadv`` of the whole file
               (64 MiB per call) into one preallocated, pre-faulted buffer.
ckpt.save      save: ``ckpt.save(state, dir)`` - everything up to and including the atomic commit
               (data fsync, manifest, rename, directory fsyncs). load: ``ckpt.load(state, dir)``
               into the live tensors in place, checksums verified.
ckpt DCP plug-in  ``dcp.save(sd, storage_writer=ckpt.dcp.Writer(dir), no_dist=True)`` and
               ``dcp.load(sd, storage_reader=ckpt.dcp.Reader(dir), no_dist=True)`` (DCP's default
               planners).
DCP FileSystem ``dcp.save(sd, storage_writer=FileSystemWriter(dir), no_dist=True)`` (defaults:
               one file per rank, ``sync_files=True`` i.e. fsync'd, one thread) and
               ``dcp.load(sd, storage_reader=FileSystemReader(dir), no_dist=True)`` in place.
torch.save     save: ``torch.save(sd, file)`` then ``fsync`` of the file (included in the time).
               load: ``torch.load(file, mmap=False, weights_only=True)`` into fresh tensors, then
               ``copy_`` into the live tensors (included).
safetensors    save: ``safetensors.torch.save_file(sd, file)`` then ``fsync`` (included).
               load: ``safetensors.torch.load_file(file)`` then ``copy_`` into the live tensors.

Before every timed operation the script runs ``sync`` and, when it may (root), drops the page cache
(``echo 3 > /proc/sys/vm/drop_caches``), so writes start with no dirty pages and reads are cold;
when it may not, reads are warm and the report says so. Throughput is state bytes (tensor payload,
not file size) / seconds, in GB/s (10^9 bytes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp

from harness import (  # first: puts this checkout's root on sys.path
    Load, argument_parser, command_line, drop_caches, fsync_path, machine_description, median_span, provenance,
    publish, remove, rotated, timed, verdict, work_dir,
)

import ckpt  # noqa: E402
import ckpt.dcp  # noqa: E402

SECTION = "## Save/load throughput (issue 2)"
IO_SLICE = 64 << 20
GOAL_RAW_RATIO = 0.9

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
warnings.filterwarnings("ignore", category=FutureWarning)


# ---------------------------------------------------------------------------------------------
# The state
# ---------------------------------------------------------------------------------------------
def make_state(gib: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """A flat state dict of about ``gib`` GiB: ~60% in 4 large fp32 matrices, ~25% in 4 bf16
    matrices, ~15% in 24 medium fp32 tensors, plus 200 small tensors (1-8 KB; fp32 and bf16)."""
    total = int(gib * (1 << 30))
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    cols = 4096

    def matrix(nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        elem = torch.empty((), dtype=dtype).element_size()
        rows = max(1, nbytes // (cols * elem))
        return torch.randn(rows, cols, generator=gen).to(dtype)

    small_bytes = 0
    for i in range(200):
        dtype = torch.bfloat16 if i % 4 == 3 else torch.float32
        numel = int(torch.randint(256, 2049, (1,), generator=gen))
        t = torch.randn(numel, generator=gen).to(dtype)
        state[f"model.layers.{i // 4}.small.{i % 4}"] = t
        small_bytes += t.nbytes
    rest = max(total - small_bytes, 0)
    for i in range(4):
        state[f"model.big_fp32.{i}.weight"] = matrix(int(rest * 0.60 / 4), torch.float32)
    for i in range(4):
        state[f"model.big_bf16.{i}.weight"] = matrix(int(rest * 0.25 / 4), torch.bfloat16)
    for i in range(24):
        numel = max(1, int(rest * 0.15 / 24) // 4)
        state[f"optim.medium.{i}"] = torch.randn(numel, generator=gen)
    return state


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.nbytes for t in state.values())


def describe_state(state: dict[str, torch.Tensor]) -> str:
    groups: dict[str, list[torch.Tensor]] = {}
    for key, t in state.items():
        kind = "large" if ".big_" in key else "medium" if key.startswith("optim.medium") else "small"
        groups.setdefault(f"{kind} {str(t.dtype).removeprefix('torch.')}", []).append(t)
    parts = []
    for name, ts in groups.items():
        size = sum(t.nbytes for t in ts)
        unit = f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.0f} KiB"
        shape = "x".join(map(str, ts[0].shape)) if len({tuple(t.shape) for t in ts}) == 1 else "various shapes"
        parts.append(f"{len(ts)} {name} ({shape}; {unit})")
    return f"{len(state)} tensors, {state_bytes(state) / 2**30:.3f} GiB: " + ", ".join(parts)


# ---------------------------------------------------------------------------------------------
# Methods
# ---------------------------------------------------------------------------------------------
@dataclass
class Method:
    name: str
    target: str  # file or directory name in the work dir
    save: Callable[[dict, Path], None]
    load: Callable[[dict, Path], None]
    on_disk: Callable[[Path], int]
    note: str = ""
    save_times: list[float] = field(default_factory=list)
    load_times: list[float] = field(default_factory=list)
    size: int = 0


def _dir_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


class Raw:
    """The physical limit: one sequential writer / reader on one file."""

    def __init__(self, nbytes: int):
        self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.buffer.fill_(1)  # pre-fault, so the read pays no page faults the live state would not

    @staticmethod
    def save(state: dict, path: Path) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for t in state.values():
                view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
                done = 0
                while done < len(view):
                    done += os.write(fd, view[done : done + IO_SLICE])
            os.fsync(fd)
        finally:
            os.close(fd)

    def load(self, state: dict, path: Path) -> None:
        view = memoryview(self.buffer.numpy())
        fd = os.open(path, os.O_RDONLY)
        try:
            done = 0
            while done < len(view):
                n = os.preadv(fd, [view[done : done + IO_SLICE]], done)
                if n == 0:
                    break
                done += n
        finally:
            os.close(fd)
        if done != len(view):
            raise RuntimeError(f"raw read: short read {done} of {len(view)}")

    def verify(self, reference: dict) -> None:
        offset = 0
        for key, t in reference.items():
            n = t.nbytes
            if not torch.equal(self.buffer[offset : offset + n], t.reshape(-1).view(torch.uint8)):
                raise RuntimeError(f"raw read: {key} differs")
            offset += n


def ckpt_save(state: dict, path: Path) -> None:
    ckpt.save(state, path)


def ckpt_load(state: dict, path: Path) -> None:
    ckpt.load(state, path)


def plugin_save(state: dict, path: Path) -> None:
    dcp.save(state, storage_writer=ckpt.dcp.Writer(path), no_dist=True)


def plugin_load(state: dict, path: Path) -> None:
    dcp.load(state, storage_reader=ckpt.dcp.Reader(path), no_dist=True)


def dcp_fs_save(state: dict, path: Path) -> None:
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path, sync_files=True), no_dist=True)


def dcp_fs_load(state: dict, path: Path) -> None:
    dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=True)


def torch_save(state: dict, path: Path) -> None:
    torch.save(state, path)
    fsync_path(path)


def torch_load(state: dict, path: Path) -> None:
    loaded = torch.load(path, mmap=False, weights_only=True)
    for key, t in state.items():
        t.copy_(loaded[key])


def st_save(state: dict, path: Path) -> None:
    safetensors.torch.save_file(state, path)
    fsync_path(path)


def st_load(state: dict, path: Path) -> None:
    loaded = safetensors.torch.load_file(path)
    for key, t in state.items():
        t.copy_(loaded[key])


def build_methods(nbytes: int, selected: list[str] | None) -> tuple[list[Method], Raw]:
    raw = Raw(nbytes)
    methods = [
        Method("raw", "raw.bin", raw.save, raw.load, _dir_size, "write+fsync / preadv into one buffer"),
        Method("ckpt.save / ckpt.load", "ckpt", ckpt_save, ckpt_load, _dir_size, "ours; incl. commit, checksums"),
        Method("ckpt.dcp.Writer / Reader", "plugin", plugin_save, plugin_load, _dir_size, "ours as DCP plug-in"),
        Method("DCP FileSystemWriter / Reader", "dcp", dcp_fs_save, dcp_fs_load, _dir_size, "sync_files=True"),
        Method("torch.save / torch.load", "torch.pt", torch_save, torch_load, _dir_size, "+fsync; load + copy_"),
        Method("safetensors save_file / load_file", "model.safetensors", st_save, st_load, _dir_size, "+fsync; load + copy_"),
    ]
    keys = {"raw": 0, "ckpt": 1, "plugin": 2, "dcp": 3, "torch": 4, "safetensors": 5}
    if selected:
        wanted = {keys[s] for s in selected} | {0}  # raw is always measured: it is the yardstick
        methods = [m for i, m in enumerate(methods) if i in wanted]
    return methods, raw


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------
def verify(live: dict, reference: dict, what: str) -> None:
    for key, t in reference.items():
        if not torch.equal(live[key], t):
            raise RuntimeError(f"{what}: {key} differs after load")


def run(args: argparse.Namespace) -> tuple[list[Method], dict]:
    with work_dir(args.dir, "save_load-", keep=args.keep) as work:
        info: dict = {"work": work}
        t0 = time.perf_counter()
        reference = make_state(args.gib, seed=0)
        live = {k: torch.zeros_like(v) for k, v in reference.items()}
        nbytes = state_bytes(reference)
        info["nbytes"] = nbytes
        info["state"] = describe_state(reference)
        info["machine"] = machine_description(work, [f"safetensors {safetensors.__version__}",
                                                     f"torch threads {torch.get_num_threads()}"])
        print(f"state: {info['state']} (built in {time.perf_counter() - t0:.1f}s)", flush=True)
        print(f"work dir: {work}", flush=True)

        methods, raw = build_methods(nbytes, args.methods)
        cold = drop_caches(not args.warm)
        info["cold"] = cold
        print("reads: " + ("cold (page cache dropped before every timed operation)" if cold else
                           "warm (page cache NOT dropped: " + ("--warm given" if args.warm else "not permitted") + ")"),
              flush=True)

        if not args.no_warmup:  # untimed: lazy imports and first-call costs of every library
            small = {k: v for k, v in reference.items() if k.startswith("model.layers.")}
            small_live = {k: torch.empty_like(v) for k, v in small.items()}
            for m in methods:
                target = work / ("warmup-" + m.target)
                if m.name == "raw":
                    Raw.save(small, target)
                else:
                    m.save(small, target)
                    m.load(small_live, target)
                remove(target)
            # The first big write of a process is often several times slower than the next ones
            # here (fresh page cache); absorb it outside the timing so it does not land on one method.
            target = work / "warmup-full.bin"
            Raw.save(reference, target)
            remove(target)

        load = Load()
        for rep in range(args.repeats):
            for m in rotated(methods, rep):
                target = work / m.target
                remove(target)
                drop_caches(cold)
                ts = timed(lambda: m.save(reference, target))
                m.size = m.on_disk(target)
                for t in live.values():  # outside the timing: prove the load really writes
                    t.zero_()
                drop_caches(cold)
                tl = timed(lambda: m.load(live, target))
                if not args.no_verify:
                    if m.name == "raw":
                        raw.verify(reference)
                    else:
                        verify(live, reference, m.name)
                m.save_times.append(ts)
                m.load_times.append(tl)
                print(f"[{rep + 1}/{args.repeats}] {m.name:36s} save {ts:7.3f}s {nbytes / ts / 1e9:6.2f} GB/s"
                      f" | load {tl:7.3f}s {nbytes / tl / 1e9:6.2f} GB/s", flush=True)
                remove(target)
        info["contention"] = load.stop().describe("during the timed rounds")
        return methods, info


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------
def report(methods: list[Method], info: dict, args: argparse.Namespace, command: str) -> str:
    nbytes = info["nbytes"]
    med = {m.name: (statistics.median(m.save_times), statistics.median(m.load_times)) for m in methods}
    raw_save, raw_load = med["raw"]
    lines = [
        "| Method | Save GB/s | Save × raw | Load GB/s | Load × raw | Save s (min–max) | Load s (min–max) | On disk | Notes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for m in methods:
        s, l = med[m.name]
        lines.append(
            f"| {m.name} | {nbytes / s / 1e9:.2f} | {raw_save / s:.2f} | {nbytes / l / 1e9:.2f} | {raw_load / l:.2f} "
            f"| {median_span(m.save_times)} | {median_span(m.load_times)} "
            f"| {m.size / 2**20:.1f} MiB | {m.note} |"
        )
    notes = []
    dcp_name = "DCP FileSystemWriter / Reader"
    for ours in ("ckpt.save / ckpt.load", "ckpt.dcp.Writer / Reader"):
        if ours not in med:
            continue
        s, l = med[ours]
        save_ratio, load_ratio = raw_save / s, raw_load / l
        goals = [
            f"save ≥ {GOAL_RAW_RATIO}× raw write+fsync: {verdict(save_ratio >= GOAL_RAW_RATIO)} ({save_ratio:.2f}×)",
        ]
        if dcp_name in med:
            d = med[dcp_name][0]
            goals.append(f"save not slower than DCP: {verdict(s <= d)} "
                         f"({s:.3f}s vs {d:.3f}s, {d / s:.2f}× DCP's speed)")
        goals.append(f"load ≥ {GOAL_RAW_RATIO}× raw read: {verdict(load_ratio >= GOAL_RAW_RATIO)} ({load_ratio:.2f}×)")
        if dcp_name in med:
            d = med[dcp_name][1]
            goals.append(f"(load vs DCP: {d / l:.2f}× DCP's speed)")
        best = next(m for m in methods if m.name == ours)
        raw_m = next(m for m in methods if m.name == "raw")
        goals.append(f"best repeat vs best raw: save {min(raw_m.save_times) / min(best.save_times):.2f}×, "
                     f"load {min(raw_m.load_times) / min(best.load_times):.2f}×")
        notes.append(f"- Goals (medians), {ours}: " + "; ".join(goals) + ".")
    cache = ("cold: `sync` + `echo 3 > /proc/sys/vm/drop_caches` before every timed save and load"
             if info["cold"] else "warm: the page cache could not be dropped (or `--warm`), so reads may be served from memory")
    body = [
        SECTION,
        "",
        f"State: {info['state']}. Median of {args.repeats} repeat(s), methods interleaved (order rotated per repeat); "
        f"GB/s = state bytes (10^9) / wall seconds (`time.perf_counter` around the call only). "
        f"Reads were **{'cold' if info['cold'] else 'warm'}** ({cache}).",
        "",
        *lines,
        "",
        "Notes:",
        *notes,
        "- raw: `os.write` of every tensor's bytes to one file + `fsync`; load = `os.preadv` (64 MiB per call) into one "
        "preallocated, pre-faulted buffer. ckpt and DCP save times include their fsyncs (DCP `sync_files=True`) and, for "
        "ckpt, the whole atomic commit; torch.save and safetensors times include an `fsync` of the file after the call. "
        "ckpt and DCP load in place into the live tensors (ckpt also verifies xxh3 checksums); torch.load "
        "(`mmap=False, weights_only=True`) and safetensors `load_file` build fresh tensors, then `copy_` into the live ones "
        "(included).",
        "- Loads are verified bitwise against the saved state (outside the timing)." if not args.no_verify
        else "- Loads were not verified (`--no-verify`).",
        "",
        *provenance(info["machine"], command, load=info["contention"]),
    ]
    return "\n".join(body)


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__doc__, keep=True)
    parser.add_argument("--gib", type=float, default=1.0, help="state size in GiB (default 1.0)")
    parser.add_argument("--repeats", type=int, default=3, help="save+load rounds per method (default 3)")
    parser.add_argument("--methods", nargs="+", choices=["raw", "ckpt", "plugin", "dcp", "torch", "safetensors"],
                        help="subset to run (raw is always included)")
    parser.add_argument("--warm", action="store_true", help="do not drop the page cache (warm reads)")
    parser.add_argument("--no-verify", action="store_true", help="skip the bitwise check after each load")
    parser.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up round")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.gib <= 0:
        parser.error("--repeats must be >= 1 and --gib > 0")

    command = command_line("bench_save_load.py", argv)
    methods, info = run(args)
    publish(report(methods, info, args, command), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
