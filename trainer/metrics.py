"""Per-step metrics: loss, gradient norm, tokens/s, MFU, step and data-loading time, memory, checkpoint
stall and failed saves (``ckpt_failures``, under checkpoint.on_error=continue); to stdout, JSONL and
TensorBoard. A logged step's record holds the means over the steps since the previous one
(:class:`StepWindow`); ``metrics.jsonl`` also holds the run's event records (``{"event": ...}``: the
run's start and end, :mod:`trainer.run_record`; its checkpoints', :mod:`trainer.checkpoint_events`).

MFU = achieved model FLOP/s (``flops_per_token * tokens/s``) over the device's peak dense bf16
FLOP/s from :data:`PEAK_BF16_FLOPS` (per device); n/a where the device is unknown (CPU).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

# Vendor peak dense bf16/fp16 tensor throughput per device, FLOP/s.
PEAK_BF16_FLOPS = {
    "Ascend910B1": 414e12,
    "Ascend910B2": 376e12,
    "Ascend910B3": 313e12,
    "Ascend910B4": 280e12,
    "Ascend910B": 313e12,  # an unspecified 910B: the most common SKU's figure
    "A100": 312e12,
    "H100": 989e12,  # SXM; PCIe is lower, see the H100 PCIe entry
    "H100 PCIe": 756e12,
    "H200": 989e12,
}


def peak_flops(device_name: str) -> float | None:
    """Peak FLOP/s for a device name as reported by torch (longest matching table key wins)."""
    name = device_name.replace(" ", "").lower()
    matches = [key for key in PEAK_BF16_FLOPS if key.replace(" ", "").lower() in name]
    if not matches:
        return None
    return PEAK_BF16_FLOPS[max(matches, key=len)]


class StepWindow:
    """The steps since the last logged one: how many, and the seconds spent loading their data and
    waiting for checkpoints; ``seconds(excluded)`` the wall time since the window opened."""

    def __init__(self):
        self.open()

    def open(self) -> None:
        self.started, self.steps, self.data_s, self.stall_s = time.perf_counter(), 0, 0.0, 0.0

    def add(self, *, data_s: float, stall_s: float) -> None:
        self.steps += 1
        self.data_s += data_s
        self.stall_s += stall_s

    def figures(self, excluded_s: float = 0.0) -> dict:
        """The window's per-step means for a record (``excluded_s``: time that was not training's,
        the final save's drain), from the wall time until now."""
        seconds = time.perf_counter() - self.started - excluded_s
        return {"seconds": seconds, "step_time_ms": 1e3 * seconds / self.steps,
                "data_time_ms": 1e3 * self.data_s / self.steps, "ckpt_stall_ms": 1e3 * self.stall_s / self.steps}


class MetricsLogger:
    """Writes one JSON object per logged step to ``<dump_folder>/metrics.jsonl`` (rank 0 only), and
    event records (``{"event": ...}``) between them, from any thread (a commit's comes from the
    checkpoint writer's)."""

    def __init__(self, dump_folder: str, *, enabled: bool, tensorboard: bool = False):
        self.enabled = enabled
        self._file = None
        self._tb = None
        self._lock = threading.Lock()
        if not enabled:
            return
        folder = Path(dump_folder)
        folder.mkdir(parents=True, exist_ok=True)
        self._file = open(folder / "metrics.jsonl", "a", buffering=1)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(folder / "tb"))
            except ImportError:
                print("tensorboard is not installed; metrics go to metrics.jsonl only", flush=True)

    def record(self, event: dict) -> None:
        """A record that is not a step (``{"event": ...}``): to metrics.jsonl only."""
        if self.enabled:
            self._write({"time": round(time.time(), 3), **event})

    def _write(self, record: dict) -> None:
        with self._lock:
            if self._file is not None and not self._file.closed:
                self._file.write(json.dumps(record) + "\n")

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        record = {"time": round(time.time(), 3), **record}
        self._write(record)
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key not in ("step", "time"):
                    self._tb.add_scalar(key, value, record["step"])
        print(step_line(record), flush=True)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
        if self._tb is not None:
            self._tb.close()


def step_line(record: dict) -> str:
    """A logged step's line on stdout (times in ms, memory in GiB)."""
    mfu, norm, failures = record.get("mfu_pct"), record.get("grad_norm"), record.get("ckpt_failures")
    return (f"step {record['step']:>6}  loss {record['loss']:.4f}  grad_norm {'n/a' if norm is None else f'{norm:.3f}'}  "
            f"lr {record['lr']:.2e}  tok/s {record['tokens_per_sec']:,.0f}  mfu {'n/a' if mfu is None else f'{mfu:.1f}%'}  "
            f"{record['step_time_ms']:.0f} ms/step (data {record['data_time_ms']:.1f} ms)  "
            f"mem {record['memory_gib']:.2f} GiB  ckpt stall {record['ckpt_stall_ms']:.1f} ms"
            + (f"  ckpt failures {failures}" if failures else ""))
