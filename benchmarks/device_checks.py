#!/usr/bin/env python
"""The prepared run for a lent accelerator (CUDA GPU or Ascend NPU): does staging hold what it
promises on a real device, and what does it cost. One process, about 6 minutes on one H200.

    python benchmarks/device_checks.py                     # the device machine (its own torch)
    python benchmarks/device_checks.py --only stall,trainer
    python benchmarks/device_checks.py --dry-run           # CPU, tiny sizes: proves the script (CI runs it)

Sections, in order (each one's result is written as soon as it ends; SIGTERM writes what is there;
the code of each in ``device_setup.py``, ``device_staging.py`` or ``device_training.py``):

  preflight  versions, imports (exit 3 when ``import ckpt`` fails), nvidia-smi / npu-smi, free disk
             and memory, a ``cpu:gloo,<device>:<backend>`` group bound to the device + one all-reduce
             of a host and of a device tensor
  pinned     our buffer sets are pinned (a segment and a view at an offset: ``is_pinned()``), the
             host allocator's own figure beside ours, the sets released at close, and how long
             pinning 1/4/16 GiB takes (the first save pays it)
  ordering   tests/ckpt/test_accelerator.py (``pytest -m accelerator``: a snapshot equals the state
             after a device-delayed in-place add, and not a later one after ``wait_snapshot()``; a
             temporary source survives its copy; a DTensor on a device mesh; an FSDP2 manager save
             loaded bitwise) + the negative control: without the wait, the next in-place add reaches
             the snapshot (a mismatch count above zero shows the check can see a race)
  dtensor    the stale-bytes case at size: DTensors of a 1-rank device mesh staged, where the staged
             local tensor lives, whether its bytes equal the state, device memory during ``stage()``
  overlap    a ~1B llama (bf16 autocast, fp32 AdamW): one snapshot each with pinned buffers, pageable
             buffers, and with the host ahead of the device (no synchronize before the save); the
             copy/compute overlap read from a profiler trace (DtoH copies against kernels on other
             streams), the step time lost, the staged state compared with a device clone taken at the
             save (must be equal)
  stall      per save, ours (manager: pinned double buffer, side stream) vs DCP ``async_save`` with
             its pinned ``DefaultStager`` (torchtitan's ``async_with_pinned_mem``) and DCP's default:
             host time in the save and in its waits, the compute stream's wait (events), step time
             lost, the first (allocating) save apart; saves every ``--every`` steps to tmpfs
  trainer    ``python -m trainer.train`` on the device: 40 steps with checkpoints, a resumed run to
             60, an uninterrupted run to 60; losses after the resume against the uninterrupted run

Results: ``<out>/device_checks.json`` (every section: status ok/failed/skipped, seconds, figures)
and ``<out>/device_checks.md`` (a summary), ``<out>`` being ``--out``, else ``$OUT`` (the device
tool's folder), else ``benchmarks/_work/device_checks``. Exit 0 when no section failed, 1 when one
did, 3 when ``import ckpt`` fails. The wheels the device image lacks (``lmdb``, ``zstandard`` for
Python 3.12: ``bash benchmarks/device_wheels.sh``) are installed from ``benchmarks/_wheels`` into a
scratch folder first; the device machine reaches no package index.
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
SECTIONS = ("preflight", "pinned", "ordering", "dtensor", "overlap", "stall", "trainer")


def install_missing_wheels() -> list[str]:
    """pip-install the carried wheels into a scratch site-packages when a dependency is missing."""
    missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
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
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} {flat(v)}" for k, v in value.items()) + "}"
    return str(value)


def checks() -> dict:
    """Each section's function (imported once ``import ckpt`` has succeeded)."""
    from device_setup import preflight
    from device_staging import dtensor, ordering, pinned
    from device_training import overlap, stall, trainer

    return {"preflight": preflight, "pinned": pinned, "ordering": ordering, "dtensor": dtensor,
            "overlap": overlap, "stall": stall, "trainer": trainer}


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes (what CI runs)")
    p.add_argument("--only", default="", help=f"comma-separated sections of {','.join(SECTIONS)} (preflight always runs)")
    p.add_argument("--device", default="auto", help="auto (default), cuda or npu")
    p.add_argument("--out", default=None, help="results folder (default: $OUT, else benchmarks/_work/device_checks)")
    p.add_argument("--work", default=None, help="scratch folder for checkpoints (default: /dev/shm on a device)")
    p.add_argument("--budget", type=float, default=360.0, help="seconds; later sections are skipped past it")
    p.add_argument("--every", type=int, default=30, help="steps between saves in the stall section")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
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
    from device_setup import Context, Failed

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
