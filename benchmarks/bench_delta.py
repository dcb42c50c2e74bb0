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
"""

from __future__ import annotations

import gc
import queue
import statistics
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import zstandard
from torch.distributed.tensor import DTensor

from harness import (  # first: puts this checkout's root on sys.path
    Load, argument_parser, machine_description, rotated, work_dir,
)

from ckpt.format import codec  # noqa: E402
from report import (  # noqa: E402
    command_line, goal, goal_line, median_span, metric, provenance, publish, table_head, write_json,
)
from trainer import model as model_mod  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.train import Trainer  # noqa: E402

try:
    import zipnn  # noqa: E402

    ZIPNN_NOTE = None
except Exception as exc:  # a peer, not a dependency
    zipnn = None
    ZIPNN_NOTE = (f"zipnn is not importable ({type(exc).__name__}: {exc}); `pip install zipnn` (or the bench extra) "
                  "to include it")

SECTION = "## Incremental checkpoints: delta size and codec speed (issue 5)"
BASE_CONFIG = "configs/debug.toml"
KINDS = ("weight", "exp_avg", "exp_avg_sq")  # group (a), fp32
BF16 = "bf16"  # group (b)
GROUPS = {"a": KINDS, "b": (BF16,)}
GROUP_NAMES = {"a": "fp32 weights + AdamW", "b": "bf16 weights"}
WIDTH = {"a": 4, "b": 2}
ZIPNN_DTYPE = {4: "float32", 2: "bfloat16"}
GOAL_DELTA_RAW = 0.6
GOAL_VS_ZSTD = 1.15
GOAL_ENCODE_GBS = 0.4
BENCH_NAME = "delta"
# --quick: the debug model only, ~25 s on a quiet 2-core box (zipnn included)
QUICK = {"flavors": ["debug"], "steps": [100], "intervals": [10, 50], "repeats": 3, "throughput_mb": 10.0}
TINY = {"flavors": ["debug"], "steps": [10], "intervals": [5, 10], "repeats": 1, "throughput_mb": 2.0}  # the tests'
# The JSON's systems (plot legends, table rows): analyzer key -> label, for the size metrics and series.
SIZE_SYSTEMS = {"delta": "ours (delta)", "zstd1_full": "zstd-1 (full)", "zstd3_full": "zstd-3 (full)",
                "zipnn_full": "zipnn (full)", "zipnn_xor": "zipnn (XOR delta)"}

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)


# ---------------------------------------------------------------------------------------------
# Snapshots of the trainer's state
# ---------------------------------------------------------------------------------------------
Snapshot = dict  # kind -> list of (parameter name, flat uint8 numpy view of an owned copy)


def whole(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a (possibly) DTensor: the local shard on one rank, else gathered."""
    t = t.detach()
    if isinstance(t, DTensor):
        return t.to_local() if t.device_mesh.size() == 1 else t.full_tensor()
    return t


def as_bytes(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy()


def take_snapshot(tr: Trainer) -> Snapshot:
    snap: Snapshot = {k: [] for k in (*KINDS, BF16)}
    for name, p in tr.model.named_parameters():
        state = tr.optimizer.state.get(p)
        if not state or "exp_avg" not in state:
            raise RuntimeError(f"{name}: no AdamW state yet")
        w = whole(p)
        if w.dtype != torch.float32:
            raise RuntimeError(f"{name}: master weight is {w.dtype}, expected fp32")
        for kind, t in (("weight", w), ("exp_avg", whole(state["exp_avg"])), ("exp_avg_sq", whole(state["exp_avg_sq"]))):
            snap[kind].append((name, as_bytes(t.reshape(-1).clone())))  # clone: contiguous, owned
        snap[BF16].append((name, as_bytes(w.reshape(-1).to(torch.bfloat16))))
    return snap


def kind_width(kind: str) -> int:
    return 2 if kind == BF16 else 4


# ---------------------------------------------------------------------------------------------
# Per-tensor measures
# ---------------------------------------------------------------------------------------------
_UINT = {2: np.uint16, 4: np.uint32}


def zigzag_delta(cur: np.ndarray, prev: np.ndarray, width: int) -> np.ndarray:
    """docs/FORMAT.md's delta transform: zigzag of the wrapped integer difference of the bit patterns."""
    signed = np.subtract(cur.view(_UINT[width]), prev.view(_UINT[width])).view(f"i{width}")
    return ((signed << 1) ^ (signed >> (8 * width - 1))).view(np.uint8)


def plane_entropy_bytes(raw: np.ndarray, width: int) -> float:
    """Sum over byte planes of n * H0(plane) / 8: what an ideal order-0 coder per plane would store."""
    matrix = raw.reshape(-1, width)
    total = 0.0
    for k in range(width):
        counts = np.bincount(matrix[:, k], minlength=256)
        probs = counts[counts > 0] / matrix.shape[0]
        total += -float((probs * np.log2(probs)).sum()) * matrix.shape[0] / 8
    return total


def zipnn_compress(data, width: int, base=None) -> bytes:
    """zipnn's output for ``data`` (a full tensor), or for its XOR delta against ``base``.
    zipnn reorders a float input's bits in place, so it always gets a private copy."""
    if base is None:
        z = zipnn.ZipNN(input_format="byte", bytearray_dtype=ZIPNN_DTYPE[width], threads=1)
        return z.compress(bytearray(memoryview(data)))
    z = zipnn.ZipNN(input_format="byte", bytearray_dtype=ZIPNN_DTYPE[width], threads=1, delta_compressed_type="byte")
    return z.compress(memoryview(data), delta_second_data=memoryview(base))  # XORs into a new buffer first


def zipnn_decompress(stored, width: int, base=None) -> bytes:
    if base is None:
        return zipnn.ZipNN(input_format="byte", bytearray_dtype=ZIPNN_DTYPE[width], threads=1).decompress(stored)
    z = zipnn.ZipNN(input_format="byte", bytearray_dtype=ZIPNN_DTYPE[width], threads=1, delta_compressed_type="byte")
    return z.decompress(stored, delta_second_data=memoryview(base))


@dataclass
class PairResult:
    flavor: str
    interval: int
    step: int
    sizes: dict  # group -> metric -> bytes (pair metrics and the full-state metrics of `step`)
    planes: dict  # kind -> [stored bytes of plane k]; kind -> plane bytes
    plane_len: dict
    raw_planes: dict  # kind -> number of (tensor, plane) stored raw
    unchanged: int


class Analyzer(threading.Thread):
    """Measures snapshots handed over by the training thread (a bounded queue: training waits when
    the measuring falls behind, so at most a few snapshots are alive)."""

    def __init__(self, flavor: str, intervals: list[int], last_step: int, level: int, verify: bool):
        super().__init__(name="bench-delta-analyzer", daemon=True)
        self.flavor, self.intervals, self.last_step, self.level, self.verify = flavor, intervals, last_step, level, verify
        self.queue: queue.Queue = queue.Queue(maxsize=1)
        self.kept: dict[int, Snapshot] = {}
        self.full: dict[int, dict] = {}  # step -> group -> metric -> bytes
        self.raw: dict[str, int] = {}
        self.pairs: list[PairResult] = []
        self.checked: list[str] = []
        self.last_pair: tuple[Snapshot, Snapshot] | None = None
        self.busy_s = 0.0
        self.error: BaseException | None = None
        self.zstd1 = zstandard.ZstdCompressor(level=1)
        self.zstd3 = zstandard.ZstdCompressor(level=3)

    # Thread plumbing -------------------------------------------------------------------------
    def run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            if self.error is not None:
                continue  # drain; the main thread raises it
            try:
                start = time.perf_counter()
                self.process(*item)
                self.busy_s += time.perf_counter() - start
            except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
                self.error = exc

    def put(self, step: int, snap: Snapshot) -> None:
        if self.error is not None:
            raise self.error
        self.queue.put((step, snap))

    def finish(self) -> None:
        self.queue.put(None)
        self.join()
        if self.error is not None:
            raise self.error

    # Measuring ------------------------------------------------------------------------------
    def process(self, step: int, snap: Snapshot) -> None:
        if not self.raw:
            self.raw = {g: sum(a.nbytes for k in kinds for _, a in snap[k]) for g, kinds in GROUPS.items()}
        if any(step % i == 0 and step - i > 0 for i in self.intervals):  # the current state of some pair
            self.full[step] = self.measure_full(snap)
        for interval in self.intervals:
            base_step = step - interval
            if step % interval or base_step <= 0:
                continue
            prev = self.kept[base_step]
            last = step + interval > self.last_step
            self.pairs.append(self.measure_pair(interval, step, prev, snap, check=self.verify and last))
            if interval == min(self.intervals) and last:
                self.last_pair = (prev, snap)
        if any(step % i == 0 and step + i <= self.last_step for i in self.intervals):
            self.kept[step] = snap
        for old in list(self.kept):
            if not any(old % i == 0 and old + i > step for i in self.intervals):
                del self.kept[old]

    def measure_full(self, snap: Snapshot) -> dict:
        out = {}
        for group, kinds in GROUPS.items():
            width = WIDTH[group]
            m = dict.fromkeys(("zstd1_full", "zstd3_full", "planes_full", "zipnn_full"), 0)
            for kind in kinds:
                for _, a in snap[kind]:
                    m["zstd1_full"] += len(self.zstd1.compress(a.data))
                    m["zstd3_full"] += len(self.zstd3.compress(a.data))
                    m["planes_full"] += len(codec.encode_planes(a, width, self.level).data)
                    if zipnn is not None:
                        m["zipnn_full"] += len(zipnn_compress(a, width))
            if zipnn is None:
                m["zipnn_full"] = None
            out[group] = m
        return out

    def measure_pair(self, interval: int, step: int, prev: Snapshot, cur: Snapshot, check: bool) -> PairResult:
        sizes = {}
        planes, plane_len, raw_planes, unchanged = {}, {}, {}, 0
        for group, kinds in GROUPS.items():
            width = WIDTH[group]
            m = dict.fromkeys(("delta", "zstd1_zigzag", "xor_planes", "zipnn_xor", "entropy0"), 0)
            for kind in kinds:
                planes[kind], plane_len[kind], raw_planes[kind] = [0] * width, 0, 0
                for (name, c), (_, p) in zip(cur[kind], prev[kind]):
                    enc = codec.encode_delta(c, p, width, self.level)
                    m["delta"] += len(enc.data)
                    plane_len[kind] += c.nbytes // width
                    if enc.codec == codec.UNCHANGED:
                        unchanged += 1
                    else:
                        for k, (plane_codec, length) in enumerate(enc.planes):
                            planes[kind][k] += length
                            raw_planes[kind] += plane_codec == "raw"
                    z = zigzag_delta(c, p, width)
                    m["zstd1_zigzag"] += len(self.zstd1.compress(z.data))
                    m["entropy0"] += plane_entropy_bytes(z, width)
                    m["xor_planes"] += len(codec.encode_planes(np.bitwise_xor(c, p), width, self.level).data)
                    if zipnn is not None:
                        zx = zipnn_compress(c, width, base=p)
                        m["zipnn_xor"] += len(zx)
                    if check:
                        back = codec.decode(enc.codec, enc.data, raw_length=enc.raw_length, itemsize=width,
                                            planes=enc.planes, base=p, what=name)
                        if not np.array_equal(back, c):
                            raise RuntimeError(f"{self.flavor} step {step} {kind} {name}: ours decodes wrong")
                        if zipnn is not None:
                            if bytes(zipnn_decompress(zx, width, base=p)) != c.tobytes() or \
                                    bytes(zipnn_decompress(zipnn_compress(c, width), width)) != c.tobytes():
                                raise RuntimeError(f"{self.flavor} step {step} {kind} {name}: zipnn decodes wrong")
            if zipnn is None:
                m["zipnn_xor"] = None
            sizes[group] = m
        if check:
            self.checked.append(f"{self.flavor} interval {interval} (steps {step - interval}->{step})")
        return PairResult(self.flavor, interval, step, sizes, planes, plane_len, raw_planes, unchanged)


# ---------------------------------------------------------------------------------------------
# Training runs
# ---------------------------------------------------------------------------------------------
@dataclass
class FlavorRun:
    flavor: str
    steps: int
    batch: int
    seq_len: int
    params: int = 0
    tensors: int = 0
    losses: list = field(default_factory=list)
    train_s: float = 0.0
    wall_s: float = 0.0
    analyzer: Analyzer | None = None


def trainer_argv(flavor: str, steps: int, batch: int, seq_len: int, dump: Path) -> list[str]:
    return ["--config", BASE_CONFIG, "--model.flavor", flavor, "--training.steps", str(steps),
            "--training.batch_size", str(batch), "--training.seq_len", str(seq_len),
            "--training.device", "cpu", "--checkpoint.enable", "false",
            "--metrics.log_freq", "1000000000", "--job.dump_folder", str(dump)]


def run_flavor(run: FlavorRun, intervals: list[int], level: int, verify: bool, work: Path) -> None:
    snap_steps = sorted({s for i in intervals for s in range(i, run.steps + 1, i)})
    analyzer = Analyzer(run.flavor, intervals, snap_steps[-1] if snap_steps else 0, level, verify)
    analyzer.start()
    run.analyzer = analyzer
    dump = work / run.flavor
    dump.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    tr = Trainer(load_config(trainer_argv(run.flavor, run.steps, run.batch, run.seq_len, dump)))
    try:
        run.params = model_mod.num_params(tr.model)
        run.tensors = sum(1 for _ in tr.model.parameters())
        print(f"[{run.flavor}] {run.params:,} parameters in {run.tensors} tensors; {run.steps} steps, batch "
              f"{run.batch} x seq_len {run.seq_len}; snapshots at {len(snap_steps)} steps", flush=True)
        for s in snap_steps:
            t0 = time.perf_counter()
            run.losses += tr.fit(stop_at=s)
            run.train_s += time.perf_counter() - t0
            analyzer.put(s, take_snapshot(tr))
            print(f"[{run.flavor}] step {s:4d} loss {run.losses[-1]:.3f} (training {run.train_s:6.1f}s, "
                  f"measuring {analyzer.busy_s:6.1f}s)", flush=True)
        t0 = time.perf_counter()
        run.losses += tr.fit()  # any steps past the last snapshot
        run.train_s += time.perf_counter() - t0
    finally:
        tr.close()
        try:
            analyzer.finish()
        finally:
            run.wall_s = time.perf_counter() - start


# ---------------------------------------------------------------------------------------------
# Throughput
# ---------------------------------------------------------------------------------------------
@dataclass
class Method:
    name: str
    system: str  # the JSON's label
    encode: object  # (cur, prev) -> stored
    decode: object  # (stored, cur, prev) -> raw bytes (bytes-like)
    size: object = len
    prepare: object = None  # cur -> what encode gets (outside the timing)
    enc_wall: list = field(default_factory=list)
    enc_cpu: list = field(default_factory=list)
    dec_wall: list = field(default_factory=list)
    dec_cpu: list = field(default_factory=list)
    stored: int = 0


def ours_decode(e: codec.Encoded, prev) -> np.ndarray:
    return codec.decode(e.codec, e.data, raw_length=e.raw_length, itemsize=4, planes=e.planes, base=prev)


def throughput_methods(level: int) -> list[Method]:
    z1, z3, dz = zstandard.ZstdCompressor(level=1), zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor()
    methods = [
        Method(f"ours encode_delta / decode (level {level})", "ours",
               lambda c, p: codec.encode_delta(c, p, 4, level), lambda e, p: ours_decode(e, p),
               size=lambda e: len(e.data)),
        Method(f"ours encode_planes / decode (level {level})", "ours (planes, full)",
               lambda c, p: codec.encode_planes(c, 4, level), lambda e, p: ours_decode(e, None),
               size=lambda e: len(e.data)),
        Method("zstd level 1 (full)", "zstd-1 (full)", lambda c, p: z1.compress(c.data), lambda s, p: dz.decompress(s)),
        Method("zstd level 3 (full)", "zstd-3 (full)", lambda c, p: z3.compress(c.data), lambda s, p: dz.decompress(s)),
    ]
    if zipnn is not None:
        methods += [
            Method("zipnn (full, threads=1)", "zipnn (full)",
                   lambda c, p: zipnn.ZipNN(input_format="byte", bytearray_dtype="float32", threads=1).compress(c),
                   lambda s, p: zipnn_decompress(s, 4), prepare=lambda c: bytearray(memoryview(c))),
            Method("zipnn XOR delta (threads=1)", "zipnn (XOR delta)", lambda c, p: zipnn_compress(c, 4, base=p),
                   lambda s, p: zipnn_decompress(s, 4, base=p)),
        ]
    return methods


def pick_throughput_pair(pair: tuple[Snapshot, Snapshot], cap_bytes: int) -> tuple[list, str]:
    prev, cur = pair
    chosen, total, counts = [], 0, {}
    for kind in ("exp_avg", "exp_avg_sq", "weight"):
        for (name, c), (_, p) in zip(cur[kind], prev[kind]):
            if total + c.nbytes > cap_bytes and chosen:
                continue
            chosen.append((c, p))
            total += c.nbytes
            counts[kind] = counts.get(kind, [0, 0])
            counts[kind][0] += 1
            counts[kind][1] += c.nbytes
    desc = ", ".join(f"{n} {kind} tensors ({b / 1e6:.1f} MB)" for kind, (n, b) in counts.items())
    return chosen, f"{total / 1e6:.1f} MB of fp32 state in {len(chosen)} tensors: {desc}"


def run_throughput(pairs: list, repeats: int, level: int) -> tuple[list[Method], dict]:
    torch.set_num_threads(1)
    nbytes = sum(c.nbytes for c, _ in pairs)
    methods = throughput_methods(level)
    load = Load()
    for rep in range(repeats):
        for m in rotated(methods, rep):
            inputs = [(m.prepare(c) if m.prepare else c, c, p) for c, p in pairs]
            gc.collect()
            w0, c0 = time.perf_counter(), time.process_time()
            stored = [m.encode(x, p) for x, _, p in inputs]
            w1, c1 = time.perf_counter(), time.process_time()
            del inputs
            gc.collect()
            w2, c2 = time.perf_counter(), time.process_time()
            back = [m.decode(s, p) for s, (_, p) in zip(stored, pairs)]
            w3, c3 = time.perf_counter(), time.process_time()
            m.enc_wall.append(w1 - w0)
            m.enc_cpu.append(c1 - c0)
            m.dec_wall.append(w3 - w2)
            m.dec_cpu.append(c3 - c2)
            m.stored = sum(m.size(s) for s in stored)
            if rep == 0:  # outside the timing
                for b, (c, _) in zip(back, pairs):
                    if memoryview(b).nbytes != c.nbytes or not np.array_equal(np.frombuffer(b, dtype=np.uint8), c):
                        raise RuntimeError(f"{m.name}: decode differs from the input")
            del stored, back
            print(f"[speed {rep + 1}/{repeats}] {m.name:44s} encode {nbytes / (w1 - w0) / 1e9:5.2f} GB/s "
                  f"(cpu {nbytes / max(c1 - c0, 1e-9) / 1e9:5.2f}) | decode {nbytes / (w3 - w2) / 1e9:5.2f} GB/s "
                  f"(cpu {nbytes / max(c3 - c2, 1e-9) / 1e9:5.2f})", flush=True)
    return methods, {"contention": load.stop().describe(), "nbytes": nbytes}


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------
def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def fmt(x, digits=3):
    return "n/a" if x is None else f"{x:.{digits}f}"


def pair_ratio(p: PairResult, a: FlavorRun, group: str, key: str):
    """``key``'s bytes / raw full bytes for a pair (full-state measures: of the pair's current step)."""
    raw = a.analyzer.raw[group]
    value = p.sizes[group].get(key)
    if value is None and key in a.analyzer.full[p.step][group]:
        value = a.analyzer.full[p.step][group][key]
    return None if value is None else value / raw


def vs(p: PairResult, a: FlavorRun, group: str, peer: str):
    """peer bytes / our delta bytes (> 1: ours is smaller)."""
    full = a.analyzer.full[p.step][group]
    value = full[peer] if peer in full else p.sizes[group].get(peer)
    delta = p.sizes[group]["delta"]
    return None if value is None or delta == 0 else value / delta


def size_tables(runs: list[FlavorRun], intervals: list[int]) -> tuple[list[str], list[str], dict]:
    cols = [("delta", "**ours delta**"), ("zstd1_full", "zstd-1 full"), ("zstd3_full", "zstd-3 full"),
            ("planes_full", "ours planes full"), ("zipnn_full", "zipnn full"), ("zipnn_xor", "zipnn XOR delta"),
            ("zstd1_zigzag", "zstd-1 of zigzag delta (no planes)"), ("xor_planes", "XOR + our planes"),
            ("entropy0", "order-0 entropy of our delta's planes")]
    t1 = table_head(["Flavor", "Interval", "State", "Pairs", "Raw full", *(c for _, c in cols)],
                    "lrlrr" + "r" * len(cols))
    t2 = table_head(["Flavor", "Interval", "State", "delta / raw (goal ≤ 0.6)", "zstd-1 full / delta (goal ≥ 1.15)",
                     "zstd-3 full / delta", "zipnn full / delta (goal ≥ 1)", "zipnn XOR delta / delta",
                     "zstd-1 zigzag / delta (plane split gain)"], "lrl" + "r" * 6)
    goals: dict = {"delta_raw": [], "vs_zstd": [], "vs_zipnn": [], "vs_zipnn_delta": [], "entropy0": [],
                   "low_planes": []}
    for a in runs:
        for interval in intervals:
            ps = [p for p in a.analyzer.pairs if p.interval == interval]
            if not ps:
                continue
            for group in ("a", "b"):
                raw = a.analyzer.raw[group]
                cells = []
                for key, _ in cols:
                    rs = [pair_ratio(p, a, group, key) for p in ps]
                    m, mu = med(rs), mean(rs)
                    cells.append("n/a" if m is None else (f"{m:.3f} ({mu:.3f})" if len(ps) > 1 else f"{m:.3f}"))
                t1.append(f"| {a.flavor} | {interval} | {GROUP_NAMES[group]} | {len(ps)} | {raw / 1e6:.1f} MB | "
                          + " | ".join(cells) + " |")
                d = med([pair_ratio(p, a, group, "delta") for p in ps])
                v_z1 = med([vs(p, a, group, "zstd1_full") for p in ps])
                v_z3 = med([vs(p, a, group, "zstd3_full") for p in ps])
                v_zn = med([vs(p, a, group, "zipnn_full") for p in ps])
                v_zx = med([vs(p, a, group, "zipnn_xor") for p in ps])
                v_zz = med([vs(p, a, group, "zstd1_zigzag") for p in ps])
                t2.append(f"| {a.flavor} | {interval} | {GROUP_NAMES[group]} | {fmt(d)} | {fmt(v_z1, 2)} | "
                          f"{fmt(v_z3, 2)} | {fmt(v_zn, 2)} | {fmt(v_zx, 2)} | {fmt(v_zz, 2)} |")
                if group == "a":
                    tag = f"{a.flavor}/{interval}"
                    goals["delta_raw"].append((tag, d))
                    goals["vs_zstd"].append((tag, v_z1))
                    goals["vs_zipnn"].append((tag, v_zn))
                    goals["vs_zipnn_delta"].append((tag, v_zx))
                    goals["entropy0"].append((tag, med([pair_ratio(p, a, group, "entropy0") for p in ps])))
                    goals["low_planes"] += [med([p.planes[kind][k] / p.plane_len[kind] for p in ps])
                                            for kind in KINDS for k in (0, 1)]
    return t1, t2, goals


def plane_table(runs: list[FlavorRun], intervals: list[int]) -> list[str]:
    lines = table_head(["Flavor", "Interval", "Tensors", "delta / raw", "plane 0 (low byte)", "plane 1", "plane 2",
                        "plane 3 (high byte)", "share of the group's delta", "planes stored raw"], "lrl" + "r" * 7)
    for a in runs:
        for interval in intervals:
            ps = [p for p in a.analyzer.pairs if p.interval == interval]
            if not ps:
                continue
            for kind in (*KINDS, BF16):
                group = "b" if kind == BF16 else "a"
                width = kind_width(kind)
                nplanes = len(ps[0].planes[kind])
                per_plane = [med([p.planes[kind][k] / p.plane_len[kind] for p in ps]) for k in range(nplanes)]
                kind_raw = ps[0].plane_len[kind] * width
                ratio = med([sum(p.planes[kind]) / kind_raw for p in ps])
                share = med([sum(p.planes[kind]) / max(1, p.sizes[group]["delta"]) for p in ps])
                cells = [fmt(x) for x in per_plane] + ["–"] * (4 - nplanes)
                raws = med([p.raw_planes[kind] for p in ps])
                total_planes = a.tensors * width
                label = "bf16 weights" if kind == BF16 else f"fp32 {kind}"
                lines.append(f"| {a.flavor} | {interval} | {label} | {fmt(ratio)} | " + " | ".join(cells)
                             + f" | {fmt(share, 2)} | {raws:g} of {total_planes} |")
    return lines


def speed_table(methods: list[Method], info: dict) -> list[str]:
    n = info["nbytes"]
    lines = table_head(["Method", "Encode GB/s (wall)", "Encode GB/s (CPU time)", "Decode GB/s (wall)",
                        "Decode GB/s (CPU time)", "Encode s (min–max)", "Decode s (min–max)", "Stored / raw"],
                       "l" + "r" * 7)
    for m in methods:
        ew, ec, dw, dc = (statistics.median(x) for x in (m.enc_wall, m.enc_cpu, m.dec_wall, m.dec_cpu))
        lines.append(f"| {m.name} | {n / ew / 1e9:.2f} | {n / ec / 1e9:.2f} | {n / dw / 1e9:.2f} | {n / dc / 1e9:.2f} "
                     f"| {median_span(m.enc_wall, 2)} | {median_span(m.dec_wall, 2)} | {m.stored / n:.3f} |")
    return lines


def worst_goal(name: str, items: list, target: float, direction: str, show, why_none: str, extra: str = "") -> dict:
    """A size goal over every flavor/interval (each value the median over that interval's pairs): the
    worst one is the measured value, all of them are in the detail."""
    vals = [(t, v) for t, v in items if v is not None]
    if not vals:
        return goal(name, None, target, direction, why_none)
    worst = max(v for _, v in vals) if direction == "<=" else min(v for _, v in vals)
    return goal(name, worst, target, direction,
                "the worst flavor/interval (median over its pairs): " + ", ".join(f"{t}: {show(v)}" for t, v in vals)
                + extra)


def delta_goals(goals: dict, methods: list[Method] | None, info: dict | None) -> list[dict]:
    """The goals this run measured, as report.goal records (the notes print the same)."""
    no_zipnn = f"not measured: {ZIPNN_NOTE}" if ZIPNN_NOTE else "not measured"
    xor = [(t, v) for t, v in goals["vs_zipnn_delta"] if v is not None]
    out = [
        worst_goal(f"ours (delta) ≤ {GOAL_DELTA_RAW}× raw (fp32 weights + AdamW)", goals["delta_raw"], GOAL_DELTA_RAW,
                   "<=", lambda v: f"{v:.3f}×", "not measured: no pair of states"),
        worst_goal(f"ours (delta) ≥ {GOAL_VS_ZSTD}× smaller than zstd-1 of the full state (fp32 weights + AdamW)",
                   goals["vs_zstd"], GOAL_VS_ZSTD, ">=", lambda v: f"{v:.2f}×", "not measured: no pair of states"),
        worst_goal("ours (delta) no larger than zipnn of the full state (fp32 weights + AdamW)", goals["vs_zipnn"],
                   1.0, ">=", lambda v: f"zipnn/ours {v:.2f}×", no_zipnn,
                   ("; for information, zipnn's own XOR delta of the same pair / ours: "
                    + ", ".join(f"{t}: {v:.2f}×" for t, v in xor)) if xor else ""),
    ]
    if methods:
        ours, n = methods[0], info["nbytes"]
        cpu = [n / t / 1e9 for t in ours.enc_cpu]
        wall = [n / t / 1e9 for t in ours.enc_wall]
        out.append(goal(f"encode_delta ≥ {GOAL_ENCODE_GBS} GB/s per core", statistics.median(cpu), GOAL_ENCODE_GBS,
                        ">=", f"one thread, {n / 1e6:.0f} MB of fp32 state, by CPU time: median of {len(cpu)} "
                        f"{statistics.median(cpu):.2f} GB/s (min–max {min(cpu):.2f}–{max(cpu):.2f}); by wall clock "
                        f"on this shared box {statistics.median(wall):.2f} GB/s ({min(wall):.2f}–{max(wall):.2f})"))
    else:
        out.append(goal(f"encode_delta ≥ {GOAL_ENCODE_GBS} GB/s per core", None, GOAL_ENCODE_GBS, ">=",
                        "not measured: the speed part did not run (--repeats 0)"))
    return out


def goal_notes(goals: dict, json_goals: list[dict]) -> list[str]:
    notes = []
    for g in json_goals:
        notes.append(goal_line(g))
        if g["goal"].startswith("ours (delta) ≤"):
            floor = [v for _, v in goals["entropy0"] if v is not None]
            if floor and goals["low_planes"]:
                notes.append(
                    f"- Why: the order-0 entropy of our delta's byte planes (last column of the first table) is "
                    f"{min(floor):.3f}–{max(floor):.3f}× raw for fp32 weights + AdamW, so no order-0 coder of the "
                    f"individual planes can go below that with this transform; planes 0 and 1 (the low 16 bits of each "
                    f"difference) store at ≥ {min(goals['low_planes']):.3f} of their size in every fp32 kind, i.e. "
                    f"they alone cost ~0.5× raw.")
    return notes


def report(runs, intervals, methods, speed_info, args, command, machine) -> tuple[str, list[dict]]:
    """The results section, and the goals it states (report.goal records)."""
    t1, t2, goals = size_tables(runs, intervals)
    json_goals = delta_goals(goals, methods, speed_info)
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
        body.append(f"- zipnn {getattr(zipnn, '__version__', '') or zipnn_version()} via `ZipNN(input_format=\"byte\", "
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


def json_sizes(runs: list[FlavorRun], intervals: list[int]) -> tuple[list[dict], dict]:
    """Stored bytes / raw per pair of the save interval (the smallest), per flavor and state kind:
    the ``delta_x_raw`` metrics (one value per pair) and the ``delta_ratio`` series (per save step).
    A full-state system's value at step s is its size for the state at s alone."""
    interval = min(intervals)
    metrics, series = [], {}
    for a in runs:
        pairs = sorted((p for p in a.analyzer.pairs if p.interval == interval), key=lambda p: p.step)
        if not pairs:
            continue
        for group in GROUPS:
            curves = {}
            for key, system in SIZE_SYSTEMS.items():
                points = [(p.step, pair_ratio(p, a, group, key)) for p in pairs]
                if any(r is None for _, r in points):  # zipnn not installed
                    continue
                metrics.append(metric(system, "delta_x_raw", "×", [r for _, r in points], flavor=a.flavor,
                                      kind=GROUP_NAMES[group], interval=interval))
                curves[system] = [[step, r] for step, r in points]
            series[f"{a.flavor} {GROUP_NAMES[group]}"] = curves
    return metrics, {"delta_ratio": series}


def json_speed(methods: list[Method] | None, info: dict | None) -> list[dict]:
    """GB/s (10^9 bytes of raw input per second) per repeat, encode and decode, by wall clock and by
    CPU time (``*_cpu``), one thread."""
    if not methods:
        return []
    n, out = info["nbytes"], []
    for m in methods:
        for name, seconds, clock in (("encode_gbps", m.enc_wall, "wall"), ("decode_gbps", m.dec_wall, "wall"),
                                     ("encode_gbps_cpu", m.enc_cpu, "cpu"), ("decode_gbps_cpu", m.dec_cpu, "cpu")):
            out.append(metric(m.system, name, "GB/s", [n / t / 1e9 for t in seconds], clock=clock,
                              raw_mb=n / 1e6, stored_x_raw=m.stored / n))
    return out


def zipnn_version() -> str:
    try:
        from importlib.metadata import version

        return version("zipnn")
    except Exception:  # noqa: BLE001
        return "?"


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
    parser.add_argument("--flavors", nargs="+", default=["debug", "small"], help="model flavors (default debug small)")
    parser.add_argument("--steps", nargs="+", type=int,
                        help="training steps, one value or one per flavor (default: debug 300, small 200)")
    parser.add_argument("--batch", nargs="+", type=int,
                        help="global batch size, one value or one per flavor (default: debug 8, small 4)")
    parser.add_argument("--seq-len", nargs="+", type=int,
                        help="sequence length, one value or one per flavor (default: debug 128, small 64)")
    parser.add_argument("--intervals", nargs="+", type=int, default=[10, 50, 100], help="save intervals (steps)")
    parser.add_argument("--level", type=int, default=codec.DEFAULT_LEVEL, help="zstd level of ours (default: engine's)")
    parser.add_argument("--repeats", type=int, default=5, help="speed repeats (default 5; 0 skips the speed part)")
    parser.add_argument("--throughput-mb", type=float, default=256, help="MB of fp32 state for the speed part")
    parser.add_argument("--train-threads", type=int, default=1,
                        help="torch threads while training (default 1: fastest on a shared 2-core box)")
    parser.add_argument("--no-verify", action="store_true", help="skip decoding the last pairs back")
    parser.add_argument("--quick", action="store_true",
                        help="debug flavor, 100 steps, intervals 10 50, 3 speed repeats of 10 MB (~25 s)")
    parser.add_argument("--tiny", action="store_true",
                        help="the tests' smoke run: debug flavor, 10 steps, intervals 5 10, 1 speed repeat of 2 MB")
    args = parser.parse_args(argv)
    for key, value in (TINY if args.tiny else QUICK if args.quick else {}).items():
        setattr(args, key, value)
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
            run_flavor(run, args.intervals, args.level, not args.no_verify, work)
        source = max((r for r in runs if r.analyzer.last_pair is not None), key=lambda r: r.params, default=None)
        for r in runs:  # free what the speed part does not use
            if r is not source:
                r.analyzer.last_pair = None
            r.analyzer.kept.clear()
        if args.repeats and source is not None:
            pairs, desc = pick_throughput_pair(source.analyzer.last_pair, int(args.throughput_mb * 1e6))
            print(f"speed: {desc}", flush=True)
            methods, speed_info = run_throughput(pairs, args.repeats, args.level)
            speed_info.update(desc=desc, flavor=source.flavor,
                              steps=f"{source.steps - min(args.intervals)} → {source.steps}"
                              if source.steps % min(args.intervals) == 0 else "last pair")
            del pairs
            source.analyzer.last_pair = None
    load.stop()
    versions = [f"numpy {np.__version__}", f"zstandard {zstandard.__version__} (libzstd "
                f"{'.'.join(map(str, zstandard.ZSTD_VERSION[:3]))})"] + ([] if ZIPNN_NOTE else [f"zipnn {zipnn_version()}"])
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
                       "zipnn": None if ZIPNN_NOTE else zipnn_version(),
                       "raw_bytes": {f"{a.flavor} {GROUP_NAMES[g]}": a.analyzer.raw.get(g) for a in runs
                                     for g in GROUPS}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
