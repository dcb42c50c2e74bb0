"""Run the benchmark suite and regenerate RESULTS.md, the plots and the README's results block.

    python benchmarks/run.py --quick              # every benchmark, small states (< 5 min on 2 cores)
    python benchmarks/run.py                      # every benchmark, full sizes and repeats
    python benchmarks/run.py --only stall merge   # rerun some; the others' stored results are kept

Each benchmark runs as its own process (``python benchmarks/bench_X.py ... --json F``), one after
the other so that they never share the cores, and leaves its section and numbers in
``benchmarks/results/<name>.json``. The report is then rebuilt from every stored result (so
``--only`` refreshes part of it): ``RESULTS.md`` (the run, the machine, every goal met or missed,
the plots, then each benchmark's own section with its command), the PNG plots under
``benchmarks/plots/`` and the block between the ``bench:begin``/``bench:end`` markers in
README.md — for a full run of every benchmark, or with ``--publish``; a quick or partial run reports
into ``benchmarks/_work/report/`` (untracked) instead, so it never replaces the published figures.
``--report-only`` rebuilds the published report and keeps its "last runner call" line, so nothing
changes when no result did. A benchmark that fails is reported as failed, with the last lines of its output; its
previous result is not shown as current. The layouts benchmark (2 and 4 ranks, ~5 min) runs in full
runs and when named; its stored result, from whichever machine ran it, is included. The checks on a
lent accelerator are ``device_checks.py``, run by hand there (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import report  # noqa: E402


@dataclass(frozen=True)
class Bench:
    name: str
    script: str
    quick: list[str]
    full: list[str]
    title: str
    default: bool = True
    in_quick: bool = True
    extra_env: dict = field(default_factory=dict)


# Order: what the report reads first. Full arguments keep the full run near 45 minutes on 2 cores.
BENCHES = [
    Bench("save_load", "bench_save_load.py", ["--quick"], ["--gib", "1", "--repeats", "9"],
          "save/load throughput and resharded load"),
    Bench("stall", "bench_stall.py", ["--quick"], ["--gib", "1", "--saves", "3", "--nosave-steps", "10"],
          "stall per save in a training loop"),
    Bench("scaling", "bench_scaling.py", ["--quick"], [],
          "stall vs state size and ranks"),
    Bench("delta", "bench_delta.py", ["--quick"], [],
          "delta size and codec speed"),
    Bench("merge", "bench_merge.py", ["--quick"], [],
          "merge throughput and peak memory"),
    Bench("storage", "bench_storage.py", ["--quick"], [],
          "replication and object-store save/load"),
    Bench("trainer", "bench_trainer.py", ["--quick"],
          ["--threads", "2", "--repeats", "3", "2", "--window", "40", "10", "--breakdown", "20", "0"],
          "trainer tokens/s with and without checkpointing"),
    Bench("integrations", "bench_integrations.py", ["--quick"], [],
          "Lightning and HF Trainer plug-ins vs their default saving"),
    Bench("resume", "bench_resume.py", ["--quick"], ["--repeats", "3"],
          "time to first step after resume"),
    Bench("recover", "bench_recover.py", ["--quick"], [],
          "time to recover after a crash or a lost node: memory tier vs storage"),
    Bench("planning", "bench_planning.py", ["--quick"], [],
          "load planning per rank vs world size, ours vs DCP"),
    Bench("layouts", "bench_layouts.py", ["--quick"], ["--repeats", "3"],
          "trainer tokens/s per parallel layout", in_quick=False),
    Bench("cp", "bench_cp.py", ["--quick"], ["--repeats", "3"],
          "context parallel tokens/s against one rank", in_quick=False),
    Bench("moe", "bench_moe.py", ["--quick"], ["--repeats", "3"],
          "mixture of experts: EP 2 vs EP 1 tokens/s, MoE delta ratio", in_quick=False),
]
BY_NAME = {b.name: b for b in BENCHES}
RESULTS_DIR = HERE / "results"
TAIL_LINES = 15


def run_one(bench: Bench, quick: bool, timeout: float, log_dir: Path, results_dir: Path) -> dict:
    """Run one benchmark in its own process; store and return its result record (or a failure record)."""
    args = bench.quick if quick else bench.full
    out = results_dir / f"{bench.name}.json"
    partial = out.with_suffix(".json.partial")
    partial.unlink(missing_ok=True)
    cmd = [sys.executable, str(HERE / bench.script), *args, "--json", str(partial)]
    shown = " ".join(["python", f"benchmarks/{bench.script}", *args])
    log = log_dir / f"{bench.name}.log"
    print(f"== {bench.name}: {shown}", flush=True)
    t0 = time.monotonic()
    failure = None
    with open(log, "w") as f:
        try:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, cwd=HERE.parent,
                                  env={**os.environ, **bench.extra_env})
            if proc.returncode != 0:
                failure = f"exit status {proc.returncode}"
        except subprocess.TimeoutExpired:
            failure = f"ran past the runner's limit of {timeout:.0f} s"
    wall = time.monotonic() - t0
    if failure is None and not partial.exists():
        failure = "finished without writing its results (--json)"
    if failure is not None:
        tail = log.read_text(errors="replace").splitlines()[-TAIL_LINES:]
        print(f"   FAILED after {wall:.0f} s ({failure}); log: {log}", flush=True)
        record = {"bench": bench.name, "failed": failure, "command": shown, "tail": tail,
                  "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        partial.unlink(missing_ok=True)
    else:
        record = json.loads(partial.read_text())
        partial.unlink()
        print(f"   done in {wall:.0f} s", flush=True)
    record["mode"] = "quick" if quick else "full"
    record["wall_s"] = round(wall, 1)
    out.write_text(json.dumps(record, indent=1, default=str) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--quick", action="store_true", help="small states, one repeat: under 5 minutes on 2 cores")
    parser.add_argument("--only", nargs="+", choices=list(BY_NAME), metavar="NAME",
                        help=f"run only these ({', '.join(BY_NAME)}); the stored results of the others are kept")
    parser.add_argument("--report-only", action="store_true", help="run nothing: rebuild the report from the stored results")
    parser.add_argument("--publish", action="store_true",
                        help="store the results in benchmarks/results and rebuild RESULTS.md, the plots and the "
                             "README block (what a full run of every benchmark does by itself)")
    parser.add_argument("--out", default=None, help="the report (default: benchmarks/RESULTS.md when publishing, "
                                                    "else benchmarks/_work/report/RESULTS.md)")
    parser.add_argument("--no-readme", action="store_true", help="leave README.md's results block alone")
    parser.add_argument("--timeout", type=float, help="seconds per benchmark (default 300 quick, 1800 full)")
    args = parser.parse_args(argv)

    selected = [] if args.report_only else [BY_NAME[n] for n in args.only] if args.only else \
        [b for b in BENCHES if b.default and (b.in_quick or not args.quick)]
    # Quick and partial runs never replace the published figures unless asked: they report into
    # benchmarks/_work/report (the published results first, then this run's on top).
    publish = args.publish or args.report_only or not (args.quick or args.only)
    results_dir = RESULTS_DIR if publish else HERE / "_work" / "report" / "results"
    if not publish:
        results_dir.mkdir(parents=True, exist_ok=True)
        for stored in RESULTS_DIR.glob("*.json") if RESULTS_DIR.is_dir() else ():
            (results_dir / stored.name).write_text(stored.read_text())
    out = Path(args.out) if args.out else (HERE / "RESULTS.md" if publish else results_dir.parent / "RESULTS.md")
    RESULTS_DIR.mkdir(exist_ok=True)
    log_dir = HERE / "_work" / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    timeout = args.timeout or (300 if args.quick else 1800)
    command = "python benchmarks/run.py" + (" --quick" if args.quick else "") + \
        (" --only " + " ".join(args.only) if args.only else "") + (" --report-only" if args.report_only else "")

    t0 = time.monotonic()
    fresh = [run_one(b, args.quick, timeout, log_dir, results_dir) for b in selected]
    wall = time.monotonic() - t0

    records = {}
    for bench in BENCHES:
        path = results_dir / f"{bench.name}.json"
        if path.exists():
            records[bench.name] = json.loads(path.read_text())
    run_info = {"command": command, "wall_s": wall, "ran": [r["bench"] for r in fresh],
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if args.report_only:  # nothing ran: the report keeps the call that produced its figures
        run_info["previous"] = report.last_call_lines(out)
    readme = None if args.no_readme or not publish else HERE.parent / "README.md"
    report.build(records, BENCHES, run_info, out, HERE / "plots" if publish else out.parent / "plots", readme)
    print(f"wrote {out}, the plots{' and the README block' if readme else ''} after {wall:.0f} s of benchmarks"
          + ("" if publish else " (not published: add --publish to replace benchmarks/RESULTS.md)"))
    failed = [r["bench"] for r in fresh if r.get("failed")]
    if failed:
        print(f"failed: {', '.join(failed)} (see the report and benchmarks/_work/logs/)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
