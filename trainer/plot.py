"""A run's metrics.jsonl as one PNG: loss, tokens per second and checkpoint stall against the step.

    python -m trainer.plot outputs/debug/metrics.jsonl [-o outputs/debug/metrics.png] [--last-run]

Each logged step (a record with ``step`` and ``loss``) is a point; a record of another kind (a run's
start, a failure) is skipped, and a run that resumed at an earlier step starts a new line, so a
resumed or restarted run shows as its own segment instead of a zig-zag. Needs matplotlib (the
``plot`` extra). Exit codes: 0 written, 1 the file is unreadable or holds no logged step, 2 bad
arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PANELS = (("loss", "loss"), ("tokens_per_sec", "tokens / s"), ("ckpt_stall_ms", "checkpoint stall (ms)"))


def read_segments(path: Path) -> list[list[dict]]:
    """The logged steps of ``path``, split wherever the step goes back (a resume or a new run)."""
    segments: list[list[dict]] = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not a JSON line ({exc.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("step"), int) or "loss" not in record:
                continue
            if not segments or record["step"] <= segments[-1][-1]["step"]:
                segments.append([])
            segments[-1].append(record)
    return segments


def draw(segments: list[list[dict]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # a file, never a window
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(PANELS), 1, sharex=True, figsize=(8, 7), constrained_layout=True)
    for axis, (key, label) in zip(axes, PANELS):
        for number, segment in enumerate(segments, 1):
            points = [(r["step"], r[key]) for r in segment if isinstance(r.get(key), (int, float))]
            if points:
                steps, values = zip(*points)
                axis.plot(steps, values, label=f"run segment {number}" if len(segments) > 1 else None)
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    axes[0].set_title(title)
    axes[-1].set_xlabel("step")
    if len(segments) > 1:
        axes[0].legend()
    figure.savefig(out, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.plot", description=__doc__.splitlines()[0])
    p.add_argument("metrics", type=Path, help="a metrics.jsonl the trainer wrote")
    p.add_argument("-o", "--out", type=Path, help="the PNG to write (default: beside the metrics, metrics.png)")
    p.add_argument("--last-run", action="store_true", help="only the last segment (the newest run or resume)")
    args = p.parse_args(argv)
    out = args.out or args.metrics.with_suffix(".png")
    try:
        segments = read_segments(args.metrics)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        print(f"trainer.plot: error: {exc}", file=sys.stderr)
        return 1
    if args.last_run:
        segments = segments[-1:]
    if not segments:
        print(f"trainer.plot: error: {args.metrics} holds no logged step", file=sys.stderr)
        return 1
    try:
        draw(segments, out, title=str(args.metrics))
    except ImportError:
        print("trainer.plot: error: matplotlib is not installed (pip install 'ckpt-engine[plot]')", file=sys.stderr)
        return 1
    steps = sum(map(len, segments))
    print(f"wrote {out} ({steps} steps in {len(segments)} segment(s))")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
