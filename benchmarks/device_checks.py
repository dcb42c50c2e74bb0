#!/usr/bin/env python
"""The prepared run for a lent accelerator (CUDA GPU or Ascend NPU): does staging hold what it
promises on a real device, and what does checkpointing cost a training job. One process, about 6
minutes on one H100 (start-up excluded).

    python benchmarks/device_checks.py                     # the device machine (its own torch)
    python benchmarks/device_checks.py --only stall,trainer
    python benchmarks/device_checks.py --dry-run           # CPU, tiny sizes: proves the script (CI runs it)

Sections, in order (each one's result is written as soon as it ends; SIGTERM writes what is there;
the code in ``device_setup.py``, ``device_staging.py``, ``device_training.py``, ``device_trainer.py``,
the job and its timing in ``device_job.py``, the savers compared in ``device_savers.py``;
benchmarks/CHECKS.md says what each figure measures):

  preflight  the process group first (``cpu:gloo,<device>:<backend>``, one rank, bound to the
             device; gloo alone if that cannot start), versions, imports (exit 3 when ``import
             ckpt`` fails), nvidia-smi / npu-smi, room for checkpoints (tmpfs, else disk; a
             section that needs more room is skipped, not failed), one all-reduce of a host and a
             device tensor
  pinned     our buffer sets are pinned (a segment and a view at an offset), the host allocator's
             own figure beside ours, the sets released at close, pinning 1/4/16 GiB timed
  ordering   tests/ckpt/test_accelerator.py (``pytest -m accelerator``; the JUnit file and the tail
             of pytest's output kept in the results) + the negative control of the snapshot wait
  dtensor    the stale-bytes case at size: DTensors of a 1-rank device mesh staged, where the staged
             local tensor lives, whether its bytes equal the state, device memory during ``stage()``
  overlap    our stager on the ~1B llama (FSDP2, 1 rank, bf16): pinned, pageable and host-ahead
             snapshots, both buffer sets warmed first; step time lost against a plain step timed
             alike (``sync; t0; save; fwd/bwd; wait; step; sync; t1``), the copy's device time
             (events on the copy stream), the compute stream's wait; a separate profiled repeat for
             the copy/compute overlap and the staged bytes against a device clone
  stall      per save every ``--every`` steps: ours (the manager) vs what torchtitan runs for
             ``async_with_pinned_mem`` (DefaultStager(StagingOptions(True, True, True, True)), the
             PROCESS checkpointer, a gc first) vs DCP's default ``async_save``; step time lost, host
             time in the save, DCP's staging and its upload drain apart; the first save apart
  trainer    one training loop of the ~1B llama (FSDP2, 1 rank, bf16): tokens/s and MFU without
             checkpoints, with ours and with torchtitan's CheckpointManager, a save every 10 steps
  resume     the project's trainer on the device: stopped at 10, resumed to 20, against an
             uninterrupted 20; the losses after the resume

Results: ``<out>/device_checks.json`` (every section: status ok/failed/skipped, seconds, figures)
and ``<out>/device_checks.md`` (a summary), ``<out>`` being ``--out``, else ``$OUT`` (the device
tool's folder), else ``benchmarks/_work/device_checks``. Exit 0 when no section failed, 1 when one
did, 3 when ``import ckpt`` fails. The wheels the device image lacks (``lmdb``, ``zstandard``, and
torchtitan with what its checkpoint manager imports, for Python 3.12: ``bash
benchmarks/device_wheels.sh``) are installed from ``benchmarks/_wheels`` into a scratch folder
first; the device machine reaches no package index.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / "benchmarks" / "_wheels"
SCRATCH_SITE = Path("/tmp/ckpt-device-site")
NEEDED = ("numpy", "lmdb", "xxhash", "zstandard", "fsspec", "safetensors", "tqdm", "yaml")
OPTIONAL = ("torchtitan", "tyro", "spmd_types")  # torchtitan's manager in the trainer section
SECTIONS = ("preflight", "pinned", "ordering", "dtensor", "overlap", "stall", "trainer", "resume")


def install_missing_wheels() -> list[str]:
    """pip-install the carried wheels into a scratch site-packages when a dependency is missing."""
    missing = [m for m in NEEDED + OPTIONAL if importlib.util.find_spec(m) is None]
    if missing and any(WHEELS.glob("*.whl")):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(SCRATCH_SITE), *map(str, WHEELS.glob("*.whl"))],
                       check=False)
        sys.path.insert(0, str(SCRATCH_SITE))
        os.environ["PYTHONPATH"] = os.pathsep.join([str(SCRATCH_SITE), str(REPO), os.environ.get("PYTHONPATH", "")])
        importlib.invalidate_caches()
    return missing


class Results:
    """The JSON record, rewritten (atomically) after every section."""

    def __init__(self, out: Path, argv: list[str]):
        self.out = out
        self.data = {"command": "python benchmarks/device_checks.py " + " ".join(argv), "started": time.time(),
                     "sections": {}}

    def record(self, name: str, status: str, seconds: float, figures: dict, error: str | None = None) -> None:
        self.data["sections"][name] = {"status": status, "seconds": round(seconds, 2), "figures": figures,
                                       **({"error": error} if error else {})}
        self.write()

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / "device_checks.json.tmp"
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        os.replace(tmp, self.out / "device_checks.json")
        (self.out / "device_checks.md").write_text(summary(self.data))

    @property
    def failed(self) -> bool:
        return any(s["status"] == "failed" for s in self.data["sections"].values())


def summary(data: dict) -> str:
    lines = ["## Device checks (benchmarks/device_checks.py)", "", f"`{data['command']}`", "",
             "| section | status | seconds | figures |", "|---|---|---|---|"]
    for name, s in data["sections"].items():
        figures = "; ".join(f"{k}: {flat(v)}" for k, v in s["figures"].items())
        lines.append(f"| {name} | {s['status']}{' — ' + s['error'] if s.get('error') else ''} | {s['seconds']} | {figures} |")
    return "\n".join(lines) + "\n"


def flat(value) -> str:
    """One table cell: a nested dict inline, a long text (pytest's tail) on one line, cut short."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} {flat(v)}" for k, v in value.items()) + "}"
    text = " ".join(str(value).split()).replace("|", "/")
    return text if len(text) <= 300 else text[:150] + " … " + text[-140:]


def checks() -> dict:
    """Each section's function (imported once ``import ckpt`` has succeeded)."""
    from device_setup import preflight
    from device_staging import dtensor, ordering, pinned
    from device_trainer import resume, trainer
    from device_training import overlap, stall

    return {"preflight": preflight, "pinned": pinned, "ordering": ordering, "dtensor": dtensor,
            "overlap": overlap, "stall": stall, "trainer": trainer, "resume": resume}


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes (what CI runs)")
    p.add_argument("--only", default="", help=f"comma-separated sections of {','.join(SECTIONS)} (preflight always runs)")
    p.add_argument("--device", default="auto", help="auto (default), cuda or npu")
    p.add_argument("--out", default=None, help="results folder (default: $OUT, else benchmarks/_work/device_checks)")
    p.add_argument("--work", default=None, help="scratch folder for checkpoints (default: /dev/shm on a device)")
    p.add_argument("--budget", type=float, default=370.0, help="seconds; later sections are skipped past it")
    p.add_argument("--every", type=int, default=None, help="steps between saves in the stall section "
                   "(default: 30 on a device, 3 in a dry run)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    args.every = args.every or (3 if args.dry_run else 30)
    out = Path(args.out or os.environ.get("OUT") or REPO / "benchmarks" / "_work" / "device_checks")
    wanted = [s for s in args.only.split(",") if s] or list(SECTIONS)
    unknown = set(wanted) - set(SECTIONS)
    if unknown:
        print(f"device_checks: unknown sections {sorted(unknown)}; expected {','.join(SECTIONS)}", file=sys.stderr)
        return 2
    results = Results(out, argv)
    signal.signal(signal.SIGTERM, lambda *_: (results.write(), os._exit(143)))
    sys.path.insert(0, str(REPO))
    missing = install_missing_wheels()
    try:
        import ckpt  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - the one reason the rest cannot run
        results.record("preflight", "failed", 0.0, {"missing_before_wheels": missing}, f"import ckpt: {exc}")
        print(f"device_checks: import ckpt failed: {exc}", file=sys.stderr)
        return 3
    from device_setup import Context, Failed, Skipped

    sections = checks()
    ctx = Context(args)
    ctx.out = out
    for name in SECTIONS:
        if name != "preflight" and name not in wanted:
            continue
        if name != "preflight" and ctx.left() < 0:
            results.record(name, "skipped", 0.0, {}, "time budget spent")
            continue
        start, figures = time.perf_counter(), {}
        if name == "preflight" and missing:
            figures["installed_from_wheels"] = missing
        try:
            sections[name](ctx, figures)
            results.record(name, "ok", time.perf_counter() - start, figures)
        except Skipped as exc:
            results.record(name, "skipped", time.perf_counter() - start, figures, str(exc))
        except Failed as exc:  # what was measured up to the failure is kept
            results.record(name, "failed", time.perf_counter() - start, figures, str(exc))
        except Exception as exc:  # noqa: BLE001 - one section's crash must not lose the others
            traceback.print_exc()
            results.record(name, "failed", time.perf_counter() - start, figures, f"{type(exc).__name__}: {exc}")
        print(f"device_checks: {name}: {results.data['sections'][name]['status']} "
              f"({results.data['sections'][name]['seconds']} s)", flush=True)
    print(summary(results.data))
    return 1 if results.failed else 0


if __name__ == "__main__":
    sys.exit(main())
