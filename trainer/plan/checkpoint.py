"""The checkpoint: fp32 parameters + AdamW states (12 bytes per parameter) + small state (AdamW step
counters, 4 bytes per tensor; scheduler, data loader and counters, a few KiB). DCP writes every
tensor once: a piece held by several ranks (data-parallel replicas, DDP) is written by one of them,
so the total is the unique state and each rank writes its local state / the replicas of it. Deltas
(checkpoint.full_every > 1) and zstd fulls are sized with the ratios measured in
benchmarks/RESULTS.md ("Incremental checkpoints"). See docs/DRY_RUN.md.
"""

from __future__ import annotations

from typing import Any

from ..config import Config
from .layout import Layout
from .result import StagePlan


RESULTS = "benchmarks/RESULTS.md, \"Incremental checkpoints\""
DELTA_RATIO = {10: 0.780, 50: 0.814, 100: 0.818}
"""Stored delta / raw bytes for fp32 weights + AdamW states, by save interval: the measured median
of the `small` flavor (25M parameters, the larger one measured; `debug` gives 0.761/0.798/0.804)."""
DELTA_RATIO_BF16 = {10: 0.476, 50: 0.564, 100: 0.578}
"""The same for bf16 weights alone; not what this trainer stores (its masters are fp32): cited only."""
ZSTD_FULL_RATIO = 0.832
"""A full checkpoint with checkpoint.compress = zstd (byte planes), fp32 + AdamW, `small` flavor."""
ENCODE_GBPS_PER_CORE = 0.35
"""The delta encoder, one thread (raw GB/s; the median of the latest full run — the repeats spanned
0.35-0.53 and an earlier run measured 0.60: the shared box's CPU speed varies)."""
SMALL_STATE_BYTES = 4096
"""Scheduler, data loader position, train counters, optimizer param groups: an estimate."""


def rank_checkpoint(params: int, tensors: int, *, first: bool, replicas: int, async_mode: str) -> tuple[int, int]:
    """(bytes one rank writes for a full checkpoint, host bytes it stages) for a rank storing
    ``params`` parameters in ``tensors`` tensors, the first pipeline rank holding the small state,
    each piece held by ``replicas`` ranks (DCP writes it once)."""
    local_state = 12 * params + 4 * tensors + (SMALL_STATE_BYTES if first else 0)
    return -(-local_state // replicas), (2 * local_state if async_mode == "double_buffer" else 0)


def interval_ratio(interval: int) -> tuple[float, int, bool]:
    """(ratio, measured interval it comes from, extrapolated?)."""
    for measured in sorted(DELTA_RATIO):
        if interval <= measured:
            return DELTA_RATIO[measured], measured, False
    return DELTA_RATIO[100], 100, True


def checkpoint_info(cfg: Config, total: int, tensors: int, stages: list[StagePlan], lay: Layout,
                    gbps: float, shared: bool) -> dict[str, Any]:
    """The plan's ``checkpoint`` section: sizes of a full and a delta checkpoint of a model of
    ``total`` parameters in ``tensors`` tensors, and the seconds to write them at ``gbps`` GB/s per
    rank (``shared``: through one link)."""
    c = cfg.checkpoint
    tensor_bytes = 12 * total
    unique = tensor_bytes + 4 * tensors + SMALL_STATE_BYTES
    full_ratio = ZSTD_FULL_RATIO if c.compress == "zstd" else 1.0
    full_total = int(tensor_bytes * full_ratio) + unique - tensor_bytes
    per_rank_max = max(st.checkpoint_write for st in stages)
    ratio, measured, extrapolated = interval_ratio(c.interval)
    delta_total = int(tensor_bytes * ratio) + unique - tensor_bytes
    rate = gbps * 1e9
    out: dict[str, Any] = {
        "enabled": c.enable, "unique_bytes": unique, "full_bytes": full_total,
        "full_ratio": full_ratio, "writers": lay.world_size, "replicas_per_piece": lay.replicas,
        "per_rank_bytes": {str(st.stage): st.checkpoint_write for st in stages},
        "per_rank_max_bytes": per_rank_max,
        "storage_gbps": gbps, "storage_shared": shared,
        "seconds_parallel": per_rank_max * full_ratio / rate,
        "seconds_shared": full_total / rate,
        "full_every": c.full_every, "interval": c.interval, "compress": c.compress,
        "delta_ratio": ratio, "delta_ratio_interval": measured, "delta_ratio_extrapolated": extrapolated,
        "delta_bytes": delta_total,
        "delta_seconds_parallel": per_rank_max * ratio / rate, "delta_seconds_shared": delta_total / rate,
        "delta_encode_cpu_seconds_per_rank": per_rank_max / (ENCODE_GBPS_PER_CORE * 1e9),
        "delta_ratio_bf16_weights_cited": DELTA_RATIO_BF16,
        "source": RESULTS,
        "staging_host_bytes_per_rank": max(st.staging_host for st in stages),
    }
    if c.full_every > 1:
        out["mean_bytes_per_save"] = (full_total + (c.full_every - 1) * delta_total) // c.full_every
    out["seconds"] = out["seconds_shared"] if shared else out["seconds_parallel"]
    out["delta_seconds"] = out["delta_seconds_shared"] if shared else out["delta_seconds_parallel"]
    return out
