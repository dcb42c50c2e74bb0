#!/usr/bin/env python
"""Incremental checkpoints: delta size on real training runs and codec speed, against peers (issue 5).

    python benchmarks/bench_delta.py --out benchmarks/RESULTS.md          # debug 300 + small 200 steps (~4 min)
    python benchmarks/bench_delta.py --quick --json /tmp/delta.json       # debug, 100 steps (~25 s)
    python benchmarks/bench_delta.py --tiny                               # the tests' run: debug, 10 steps

Sizes (one run; byte counts are deterministic). For each model flavor (``--flavors``, default
``debug`` for 300 steps and ``small`` for 200 steps) the trainer runs in-process, single process on
CPU (``Trainer(load_config(argv))`` with ``--config configs/debug.toml`` and
``--checkpoint.enable false``: FSDP2 over a 1-rank gloo group, fp32 master weights, AdamW). The
``CheckpointManager`` is not used: at every step that is a multiple of a save interval
(``--intervals``, default 10 50 100) ``Trainer.fit(stop_at=step)`` returns and the script takes the
full state itself, tensor by tensor: each parameter (``DTensor.to_local()``, the whole tensor on one
rank) and its AdamW ``exp_avg`` and ``exp_avg_sq``, as flat fp32 copies, plus a bf16 cast of each
weight. AdamW's ``step`` counters (one fp32 scalar per parameter) are excluded. A background thread
measures each snapshot while training goes on; for every interval I and every snapshot step s with
s - I > 0 (so both states hold optimizer state) the pair (state at s - I, state at s) gives:

  ours delta        sum over tensors of ``len(codec.encode_delta(cur, prev, itemsize).data)`` (level
                    ``--level``, default 1 as in the engine) - what a delta checkpoint stores.
  zstd(delta)       zstd level 1 of the same zigzagged integer differences, not split into byte planes
                    (isolates what the plane split buys).
  XOR + planes      ``codec.encode_planes`` of ``cur XOR prev`` (an alternative transform; information).
  zipnn XOR delta   zipnn's own delta mode (``delta_compressed_type="byte"``: XOR with the base, then
                    its byte grouping + entropy coding).
  order-0 entropy   not a codec: sum over the byte planes of our zigzagged difference of n * H0 / 8,
                    the floor for any coder that codes each plane's bytes independently.
and, for the state at s (a full snapshot, what the peers store without a base):
  zstd-1 / zstd-3   plain ``zstandard`` of each tensor's raw bytes, levels 1 (ours) and 3.
  ours planes       ``codec.encode_planes`` (what ``compress="zstd"`` fulls store).
  zipnn             ``zipnn.ZipNN(input_format="byte", bytearray_dtype=...)`` of each tensor's bytes.
All of it for (a) fp32 weights + exp_avg + exp_avg_sq and (b) bf16 weights alone (delta between the
bf16 casts). Ratios are to the raw full bytes of the same state; the table shows the median over the
pairs of an interval (and the mean). The last pair of each interval is decoded back and checked
bitwise (ours and zipnn).

Speed (``--repeats``, default 5; median). ``torch.set_num_threads(1)``, one thread, zipnn with
``threads=1``: on the last pair of the largest flavor, about ``--throughput-mb`` (default 256) MB of
fp32 state (exp_avg, then exp_avg_sq, then weights, whole tensors), each method encodes every tensor
and decodes it back; every repeat runs each method once, order rotated per repeat. GB/s = raw bytes
(10^9) / seconds, both by wall clock (``time.perf_counter``) and by CPU time of the process
(``time.process_time``; nothing else runs in it then), since the box is shared. zipnn reorders the
bits of its float32/bf16 input in place (zipnn 0.5.4), so it gets a fresh copy of the input, made
outside the timing.

zipnn is a peer, not a dependency (the ``bench`` extra installs it): without it its columns say
"n/a" and its goal is reported unmeasured.

Goals (``report.goal``; for fp32 weights + AdamW, each measured as the worst flavor/interval of the
medians over the pairs, every value in the detail): ours (delta) ≤ 0.6× raw; ≥ 1.15× smaller than
zstd-1 of the full state; no larger than zipnn of the full state (zipnn's XOR delta in the detail);
and encode_delta ≥ 0.4 GB/s per core (CPU time). ``--json`` also writes ``delta_x_raw`` per system,
flavor and state kind (the pairs of the smallest interval, i.e. every save), the codec speeds
(``encode_gbps``/``decode_gbps`` by wall clock, ``*_cpu`` by CPU time) and the ``delta_ratio``
series: stored / raw per save step over the run.

The parts live in ``delta_sizes`` (training runs, snapshots, byte counts), ``codec_speed`` (the
speed part) and ``delta_tables`` (tables, goals, size figures); this script runs them and reports.
"""

from __future__ import annotations

import sys
import warnings

import numpy as np
import torch
import zstandard

from harness import (  # first: puts this checkout's root on sys.path
    Load, add_modes, apply_mode, argument_parser, machine_description, package_version, work_dir,
)

import peers  # noqa: E402
from ckpt.format import codec  # noqa: E402
from codec_speed import json_speed, pick_throughput_pair, run_throughput, speed_table  # noqa: E402
from delta_sizes import BASE_CONFIG, GROUP_NAMES, GROUPS, FlavorRun, run_flavor  # noqa: E402
from delta_tables import delta_goals, goal_notes, json_sizes, plane_table, size_tables  # noqa: E402
from report import command_line, provenance, publish, write_json  # noqa: E402

ZIPNN_NOTE = peers.zipnn_missing()  # zipnn is a peer, not a dependency: its columns say n/a without it
SECTION = "## Incremental checkpoints: delta size and codec speed (issue 5)"
BENCH_NAME = "delta"
# --quick: the debug model only, ~25 s on a quiet 2-core box (zipnn included)
QUICK = {"flavors": ["debug"], "steps": [100], "intervals": [10, 50], "repeats": 3, "throughput_mb": 10.0}
TINY = {"flavors": ["debug"], "steps": [10], "intervals": [5, 10], "repeats": 1, "throughput_mb": 2.0}  # the tests'
FULL = {"flavors": ["debug", "small"], "intervals": [10, 50, 100], "repeats": 5, "throughput_mb": 256}  # defaults

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)


def report(runs, intervals, methods, speed_info, args, command, machine) -> tuple[str, list[dict]]:
    """The results section, and the goals it states (report.goal records)."""
    t1, t2, goals = size_tables(runs, intervals)
    json_goals = delta_goals(goals, methods, speed_info, ZIPNN_NOTE)
    body = [SECTION, ""]
    runs_desc = "; ".join(
        f"`{a.flavor}`: {a.params / 1e6:.2f}M parameters in {a.tensors} tensors, {a.steps} steps, batch {a.batch} × "
        f"seq_len {a.seq_len}, loss {a.losses[0]:.3f} → {a.losses[-1]:.3f}, training {a.train_s:.0f}s "
        f"(run incl. measuring {a.wall_s:.0f}s)" for a in runs)
    body += [
        f"Real training runs, single process on CPU (`Trainer(load_config(argv))`, `--config {BASE_CONFIG}`: lr 1e-3, "
        f"20 warmup steps then cosine to 0.1× at the last step, AdamW β=(0.9, 0.95), weight decay 0.1, clip 1.0; "
        f"FSDP2 over a 1-rank gloo group; fp32 master weights; torch threads {args.train_threads}): {runs_desc}. "
        f"State taken at every multiple of the save intervals ({', '.join(map(str, intervals))}) without the "
        "CheckpointManager: each parameter (`DTensor.to_local()`) and its AdamW `exp_avg`, `exp_avg_sq`, as flat "
        "fp32 tensors (AdamW's `step` scalars excluded), and a bf16 cast of each weight. A pair = (state at s − I, "
        "state at s) for interval I, s − I > 0; bytes summed over tensors, each tensor encoded on its own "
        f"(as the engine encodes per chunk), zstd level {args.level} as in the engine.",
        "",
        "Stored bytes / raw full bytes, median over the pairs of an interval (mean in parentheses). "
        "\"full\" columns compress the state at s alone (what a peer stores without a base); \"delta\" columns "
        "need the state at s − I. The last column is not a codec: it is the size an ideal order-0 coder would "
        "reach on each byte plane of our zigzagged difference (a floor for any per-plane byte coder, zstd included):",
        "",
        *t1,
        "",
        "Ratios (median over pairs; > 1 means ours stores less):",
        "",
        *t2,
        "",
        "Where our delta's bytes go (stored bytes / plane bytes per byte plane, median over pairs; plane k = byte k "
        "of each little-endian element of the zigzagged difference; ~1.0 = incompressible, stored raw):",
        "",
        *plane_table(runs, intervals),
        "",
    ]
    if methods:
        body += [
            f"Codec speed, one thread (`torch.set_num_threads(1)`, zipnn `threads=1`), {speed_info['desc']}, from the "
            f"`{speed_info['flavor']}` run (steps {speed_info['steps']}); every tensor encoded then decoded; median of "
            f"{args.repeats} repeats, methods interleaved; GB/s = raw bytes (10^9) / seconds. Decodes verified bitwise "
            f"(first repeat, outside the timing).",
            "",
            *speed_table(methods, speed_info),
            "",
        ]
    body += ["Notes:", *goal_notes(goals, json_goals)]
    if ZIPNN_NOTE:
        body.append(f"- {ZIPNN_NOTE}: its columns are n/a.")
    else:
        body.append(f"- zipnn {package_version('zipnn')} via `ZipNN(input_format=\"byte\", "
                    "bytearray_dtype=\"float32\"|\"bfloat16\", threads=1)` per tensor (method AUTO: byte grouping + "
                    "Huffman/zstd), its XOR delta with `delta_compressed_type=\"byte\"`. zipnn's compress reorders the "
                    "bits of a float32/bf16 input **in place** (the caller's buffer, even a `bytes` object), so it is "
                    "handed a private copy (made outside the timing).")
    checked = [c for a in runs for c in a.analyzer.checked]
    if checked:
        body.append("- Decoded back and compared bitwise (ours" + ("" if ZIPNN_NOTE else " and zipnn, full and delta")
                    + "): the last pair of " + "; ".join(checked) + ".")
    if methods:
        body.append(f"- Other load on the machine during the speed part: {speed_info['contention']}. Wall-clock GB/s "
                    "on this 2-core box shared with other jobs understate the codec; CPU-time GB/s are the per-core "
                    "figure.")
    body += [
        "",
        *provenance(machine, command),
    ]
    return "\n".join(body), json_goals


# steps, batch, seq_len: the whole default run ~4 min on a quiet 2-core box; small runs 200 steps so that
# the interval-100 pair (100 -> 200) is measured on the larger model (trainer/plan.py cites it)
DEFAULT_RUN = {"debug": (300, 8, 128), "small": (200, 4, 64)}
FALLBACK_RUN = (150, 4, 64)


def per_flavor(values: list | None, flavors: list[str], what: str, parser) -> list:
    if values is None:
        index = ("--steps", "--batch", "--seq-len").index(what)
        return [DEFAULT_RUN.get(f.lower(), FALLBACK_RUN)[index] for f in flavors]
    if len(values) == 1:
        return values * len(flavors)
    if len(values) != len(flavors):
        parser.error(f"{what}: give one value, or one per flavor ({len(flavors)})")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--flavors", nargs="+", help="model flavors (default debug small)")
    parser.add_argument("--steps", nargs="+", type=int,
                        help="training steps, one value or one per flavor (default: debug 300, small 200)")
    parser.add_argument("--batch", nargs="+", type=int,
                        help="global batch size, one value or one per flavor (default: debug 8, small 4)")
    parser.add_argument("--seq-len", nargs="+", type=int,
                        help="sequence length, one value or one per flavor (default: debug 128, small 64)")
    parser.add_argument("--intervals", nargs="+", type=int, help="save intervals (steps; default 10 50 100)")
    parser.add_argument("--level", type=int, default=codec.DEFAULT_LEVEL, help="zstd level of ours (default: engine's)")
    parser.add_argument("--repeats", type=int, help="speed repeats (default 5; 0 skips the speed part)")
    parser.add_argument("--throughput-mb", type=float, help="MB of fp32 state for the speed part (default 256)")
    parser.add_argument("--train-threads", type=int, default=1,
                        help="torch threads while training (default 1: fastest on a shared 2-core box)")
    parser.add_argument("--no-verify", action="store_true", help="skip decoding the last pairs back")
    add_modes(parser, TINY, QUICK, quick_note=" (~25 s)")
    args = parser.parse_args(argv)
    apply_mode(args, TINY, QUICK, FULL)
    args.steps = per_flavor(args.steps, args.flavors, "--steps", parser)
    args.batch = per_flavor(args.batch, args.flavors, "--batch", parser)
    args.seq_len = per_flavor(args.seq_len, args.flavors, "--seq-len", parser)
    if min(args.intervals) < 1 or args.repeats < 0:
        parser.error("--intervals must be >= 1 and --repeats >= 0")
    args.intervals = sorted(set(args.intervals))
    command = command_line("bench_delta.py", argv)
    if ZIPNN_NOTE:
        print(f"note: {ZIPNN_NOTE}; its columns will be n/a", flush=True)

    load = Load()
    runs = [FlavorRun(f, s, b, l) for f, s, b, l in zip(args.flavors, args.steps, args.batch, args.seq_len)]
    methods, speed_info = None, None
    with work_dir(args.dir, "delta-") as work:
        torch.set_num_threads(args.train_threads)
        for run in runs:
            run_flavor(run, args.intervals, args.level, not args.no_verify, work, zipnn=not ZIPNN_NOTE)
        source = max((r for r in runs if r.analyzer.last_pair is not None), key=lambda r: r.params, default=None)
        for r in runs:  # free what the speed part does not use
            if r is not source:
                r.analyzer.last_pair = None
            r.analyzer.kept.clear()
        if args.repeats and source is not None:
            pairs, desc = pick_throughput_pair(source.analyzer.last_pair, int(args.throughput_mb * 1e6))
            print(f"speed: {desc}", flush=True)
            methods, speed_info = run_throughput(pairs, args.repeats, args.level, zipnn=not ZIPNN_NOTE)
            speed_info.update(desc=desc, flavor=source.flavor,
                              steps=f"{source.steps - min(args.intervals)} → {source.steps}"
                              if source.steps % min(args.intervals) == 0 else "last pair")
            del pairs
            source.analyzer.last_pair = None
    load.stop()
    versions = [f"numpy {np.__version__}", f"zstandard {zstandard.__version__} (libzstd "
                f"{'.'.join(map(str, zstandard.ZSTD_VERSION[:3]))})"]
    versions += [] if ZIPNN_NOTE else [f"zipnn {package_version('zipnn')}"]
    machine = [*machine_description(versions=versions),
               f"Other load on the machine over the whole run: {load.describe()}",
               f"Total run time: {load.elapsed / 60:.1f} min"]
    section, goals = report(runs, args.intervals, methods, speed_info, args, command, machine)
    publish(section, args.out)
    size_metrics, series = json_sizes(runs, args.intervals)
    write_json(args.json, BENCH_NAME, section, command, metrics=size_metrics + json_speed(methods, speed_info),
               goals=goals, series=series,
               params={"flavors": args.flavors, "steps": args.steps, "batch": args.batch, "seq_len": args.seq_len,
                       "intervals": args.intervals, "metrics_interval": min(args.intervals), "level": args.level,
                       "repeats": args.repeats, "throughput_mb": args.throughput_mb, "quick": args.quick,
                       "zipnn": None if ZIPNN_NOTE else package_version("zipnn"),
                       "raw_bytes": {f"{a.flavor} {GROUP_NAMES[g]}": a.analyzer.raw.get(g) for a in runs
                                     for g in GROUPS}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
