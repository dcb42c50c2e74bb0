"""Codec speed, one thread: the speed half of bench_delta.

On one pair of states (:func:`pick_throughput_pair`: about ``cap`` bytes of fp32 state, exp_avg, then
exp_avg_sq, then weights, whole tensors), each :class:`Method` (ours ``encode_delta`` and
``encode_planes``, zstd-1/-3 of the full state, zipnn full and XOR delta) encodes every tensor and
decodes it back; every repeat runs each method once, order rotated per repeat
(:func:`run_throughput`). Seconds by wall clock (``time.perf_counter``) and by CPU time of the process
(``time.process_time``); GB/s = raw bytes (10^9) / seconds. zipnn reorders its float input's bits in
place, so it gets a fresh copy made outside the timing (``prepare``). The first repeat's decodes are
checked bitwise, outside the timing.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import zstandard

from harness import Load, rotated  # first: puts this checkout's root on sys.path

import peers  # noqa: E402
from ckpt.format import codec  # noqa: E402
from delta_sizes import Snapshot  # noqa: E402
from report import median_span, metric, table_head  # noqa: E402


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


def throughput_methods(level: int, zipnn: bool) -> list[Method]:
    """Ours (delta, planes), zstd-1/-3 and, with ``zipnn``, zipnn full and XOR delta: fp32 tensors."""
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
    if zipnn:
        methods += [
            Method("zipnn (full, threads=1)", "zipnn (full)",
                   lambda c, p: peers.zipnn_codec(4).compress(c),
                   lambda s, p: peers.zipnn_decompress(s, 4), prepare=lambda c: bytearray(memoryview(c))),
            Method("zipnn XOR delta (threads=1)", "zipnn (XOR delta)", lambda c, p: peers.zipnn_compress(c, 4, base=p),
                   lambda s, p: peers.zipnn_decompress(s, 4, base=p)),
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


def run_throughput(pairs: list, repeats: int, level: int, zipnn: bool) -> tuple[list[Method], dict]:
    """Every method on ``pairs`` (cur, prev), ``repeats`` times, one thread; the machine's other load."""
    torch.set_num_threads(1)
    nbytes = sum(c.nbytes for c, _ in pairs)
    methods = throughput_methods(level, zipnn)
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
