"""Per-step metrics: loss, tokens/s, MFU, memory, checkpoint stall and failed saves (``ckpt_failures``,
under checkpoint.on_error=continue); to stdout, JSONL and TensorBoard.

MFU = achieved model FLOP/s (``flops_per_token * tokens/s``) over the device's peak dense bf16
FLOP/s from :data:`PEAK_BF16_FLOPS` (per device); n/a where the device is unknown (CPU).
"""

from __future__ import annotations

import json
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


class MetricsLogger:
    """Writes one JSON object per logged step to ``<dump_folder>/metrics.jsonl`` (rank 0 only), and
    event records (``{"event": "run_start", ...}``: :mod:`trainer.run_record`) between them."""

    def __init__(self, dump_folder: str, *, enabled: bool, tensorboard: bool = False):
        self.enabled = enabled
        self._file = None
        self._tb = None
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
            self._file.write(json.dumps({"time": round(time.time(), 3), **event}) + "\n")

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        record = {"time": round(time.time(), 3), **record}
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key not in ("step", "time"):
                    self._tb.add_scalar(key, value, record["step"])
        mfu, failures = record.get("mfu_pct"), record.get("ckpt_failures")
        print(
            f"step {record['step']:>6}  loss {record['loss']:.4f}  lr {record['lr']:.2e}  "
            f"tok/s {record['tokens_per_sec']:,.0f}  mfu {'n/a' if mfu is None else f'{mfu:.1f}%'}  "
            f"mem {record['memory_gib']:.2f} GiB  ckpt stall {record['ckpt_stall_ms']:.1f} ms"
            + (f"  ckpt failures {failures}" if failures else ""),
            flush=True,
        )

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
