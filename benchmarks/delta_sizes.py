"""What each system stores for the states of a real training run: the size half of bench_delta.

:func:`run_flavor` trains one model flavor in-process (``Trainer(load_config(argv))``, CPU, FSDP2 over a
1-rank gloo group, fp32 master weights, AdamW) and stops at every multiple of a save interval to take
the full state tensor by tensor (:func:`take_snapshot`: each parameter and its ``exp_avg`` and
``exp_avg_sq`` as flat fp32 copies, plus a bf16 cast of each weight). An :class:`Analyzer` thread
measures the snapshots while training goes on: for every (state at s - I, state at s) pair, our
``codec.encode_delta`` and the transforms compared with it (zstd of the zigzagged difference, XOR +
our planes, zipnn's XOR delta, the order-0 entropy floor), and for the state at s alone what the
peers store without a base (zstd-1/-3, our planes, zipnn). The last pair of each interval is decoded
back and checked bitwise. The results are byte counts (:class:`PairResult`, ``Analyzer.full``); the
tables and goals are made from them in ``delta_tables``.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import zstandard
from torch.distributed.tensor import DTensor

import harness  # noqa: F401  (first: puts this checkout's root on sys.path)
import peers
from ckpt.format import codec
from trainer import model as model_mod
from trainer.config import load_config
from trainer.train import Trainer

BASE_CONFIG = "configs/debug.toml"
KINDS = ("weight", "exp_avg", "exp_avg_sq")  # group (a), fp32
BF16 = "bf16"  # group (b)
GROUPS = {"a": KINDS, "b": (BF16,)}
GROUP_NAMES = {"a": "fp32 weights + AdamW", "b": "bf16 weights"}
WIDTH = {"a": 4, "b": 2}


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
    the measuring falls behind, so at most a few snapshots are alive); ``zipnn``: whether that peer is
    measured too (it is optional)."""

    def __init__(self, flavor: str, intervals: list[int], last_step: int, level: int, verify: bool, zipnn: bool):
        super().__init__(name="bench-delta-analyzer", daemon=True)
        self.flavor, self.intervals, self.last_step, self.level, self.verify = flavor, intervals, last_step, level, verify
        self.zipnn = zipnn
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
                    if self.zipnn:
                        m["zipnn_full"] += len(peers.zipnn_compress(a, width))
            if not self.zipnn:
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
                    if self.zipnn:
                        zx = peers.zipnn_compress(c, width, base=p)
                        m["zipnn_xor"] += len(zx)
                    if check:
                        back = codec.decode(enc.codec, enc.data, raw_length=enc.raw_length, itemsize=width,
                                            planes=enc.planes, base=p, what=name)
                        if not np.array_equal(back, c):
                            raise RuntimeError(f"{self.flavor} step {step} {kind} {name}: ours decodes wrong")
                        if self.zipnn:
                            if bytes(peers.zipnn_decompress(zx, width, base=p)) != c.tobytes() or \
                                    bytes(peers.zipnn_decompress(peers.zipnn_compress(c, width), width)) != c.tobytes():
                                raise RuntimeError(f"{self.flavor} step {step} {kind} {name}: zipnn decodes wrong")
            if not self.zipnn:
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


def run_flavor(run: FlavorRun, intervals: list[int], level: int, verify: bool, work: Path, zipnn: bool) -> None:
    """Train ``run``'s flavor, handing a snapshot to a new ``run.analyzer`` at every multiple of an interval."""
    snap_steps = sorted({s for i in intervals for s in range(i, run.steps + 1, i)})
    analyzer = Analyzer(run.flavor, intervals, snap_steps[-1] if snap_steps else 0, level, verify, zipnn)
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
