"""The devices a plan is judged against: their memory, which one a configuration means, the verdict.

Contract: :data:`KNOWN_DEVICES` (GiB as the runtime reports them); :func:`known_device` maps a
name as people write it to one of them; :func:`device` is the plan's ``device`` section (from
``--device-memory`` GiB or a name, else ``training.device = npu`` means the Ascend 910B, else none)
and :func:`verdict` says whether the fullest rank fits (against every known device when the
device is not known). A bad ``--device-memory`` is a :class:`~trainer.config.ConfigError`.
"""

from __future__ import annotations

from typing import Any

from ..config import Config, ConfigError
from .result import StagePlan

GIB = 2**30

KNOWN_DEVICES: dict[str, float] = {
    "Ascend 910B": 64.0,  # 64 GB HBM: 65536 MB as npu-smi reports it
    "A100": 80.0,  # A100 80GB: 81920 MiB (nvidia-smi)
    "H100": 81559 / 1024,  # H100 SXM 80GB: 81559 MiB = 79.6 GiB
    "H200": 143771 / 1024,  # H200 141GB: 143771 MiB = 140.4 GiB
}
"""Total memory of one device in GiB, as the runtime reports it (vendors' nominal sizes: 910B 64 GB,
A100 80 GB, H100 80 GB, H200 141 GB)."""

DEVICE_TYPES = {"npu": "Ascend 910B"}
"""training.device values that name one known device (cuda could be any of the others)."""


def device(cfg: Config, memory_gib: float | None, name: str | None) -> dict[str, Any]:
    if memory_gib is not None:
        if not memory_gib > 0:
            raise ConfigError(f"--device-memory must be > 0 GiB, got {memory_gib}")
        return {"name": name, "memory_gib": float(memory_gib), "source": "--device-memory"}
    if name is not None:
        key = known_device(name)
        if key is None:
            raise ConfigError(f"--device-memory {name!r} is neither a number of GiB nor a known device "
                              f"({', '.join(KNOWN_DEVICES)})")
        return {"name": key, "memory_gib": KNOWN_DEVICES[key], "source": "--device-memory"}
    key = DEVICE_TYPES.get(cfg.training.device)
    if key is not None:
        return {"name": key, "memory_gib": KNOWN_DEVICES[key], "source": f"training.device = {cfg.training.device}"}
    return {"name": None, "memory_gib": None,
            "source": f"training.device = {cfg.training.device}: not one known device"}


def known_device(name: str) -> str | None:
    """The :data:`KNOWN_DEVICES` key ``name`` names (case, spaces and dashes ignored; the longest
    key contained in it wins: "NVIDIA H100 80GB HBM3" → "H100", "910b" → "Ascend 910B")."""
    def norm(text: str) -> str:
        return "".join(ch for ch in text.lower() if ch.isalnum())

    if name.strip().lower() in DEVICE_TYPES:
        return DEVICE_TYPES[name.strip().lower()]
    wanted = norm(name)
    hits = [k for k in KNOWN_DEVICES if norm(k) in wanted or (len(wanted) >= 4 and wanted in norm(k))]
    return max(hits, key=len) if hits else None


def judge(peak: int, memory_gib: float) -> dict[str, Any]:
    spare = memory_gib - peak / GIB
    if spare < 0:
        return {"fits": False, "text": f"does not fit by {-spare:.1f} GiB", "spare_gib": round(spare, 2)}
    tight = spare < max(2.0, 0.05 * memory_gib)
    text = f"fits, {spare:.1f} GiB to spare" + (" (tight: the runtime itself needs a few GiB)" if tight else "")
    return {"fits": True, "text": text, "spare_gib": round(spare, 2)}


def verdict(stages: list[StagePlan], dev: dict[str, Any]) -> dict[str, Any]:
    worst = max(stages, key=lambda st: st.peak)
    out: dict[str, Any] = {"peak_gib": round(worst.peak / GIB, 2), "fullest_stage": worst.stage}
    if dev["memory_gib"] is not None:
        out.update(judge(worst.peak, dev["memory_gib"]))
    else:
        out["fits"] = None
        out["text"] = "device memory unknown (--device-memory GIB|NAME)"
        out["by_device"] = {k: judge(worst.peak, v)["text"] for k, v in KNOWN_DEVICES.items()}
    return out
