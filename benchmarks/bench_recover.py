#!/usr/bin/env python
"""Time to recover after a worker crash and after a lost node: the memory tier against storage, DCP and torchtitan (issue 38).

    python benchmarks/bench_recover.py --tiny        # the tests' smoke run: a ~1 MB state, every part (~3 min)
    python benchmarks/bench_recover.py --quick       # dim 256 (~40 MB), 1 repeat, lost work at interval 50
    python benchmarks/bench_recover.py               # run.py's full run: dim 1024, 8 layers (~1.2 GB), 3 repeats

Every job is one job of 4 ranks on 2 "nodes" of this machine: two torchrun agents (``--nnodes 2``,
static rendezvous on loopback; ``recover_jobs.two_nodes``), each node with its own memory folder
under ``/dev/shm`` (``recover_jobs.NodeMemory``, removed at the end whatever happens). The state is
the trainer's (the debug llama widened to ``--dim``/``--layers``, fp32 weights and AdamW moments),
trained ``--steps`` steps by one saving job (``resume_rank.py --mode save``) with the memory tier on
(every step, kept on exit as a crashed run leaves it), ours' storage on local disk with a replica on
S3 (moto on loopback, ``tests.support.s3server``), then the same state through ``dcp.save`` and
torchtitan's ``CheckpointManager``. Then every recovery is a fresh job (``resume_rank.py --mode
resume``), timed from the launcher's clock to the end of the first step, by part (``resume_jobs.PARTS``):

    memory tier, worker crash   both nodes' memory folders as the run left them
    memory tier, node loss      node 1's folder empty (a replaced machine): its ranks fetch their files from node 0
    ours, local disk            no memory tier; the checkpoint's pages evicted (fsync + POSIX_FADV_DONTNEED)
    ours, S3                    no memory tier; checkpoint.folder the S3 replica
    DCP, local disk             dcp.load with FileSystemReader, pages evicted
    torchtitan, local disk      its CheckpointManager.load, pages evicted

Storage, DCP and torchtitan read nothing from the memory folders, so a crash and a lost node are the
same recovery for them: measured once. Then, on the debug flavour (dim 128, 4 layers):
lost work (``recover_rank.py --mode crash``: every rank dies right after step C, a restart resumes;
steps redone = C - the resumed step) at memory_interval 1 and at ``--lost-interval`` (the storage
cadence); tokens/s of a window of steps with no save, a memory save every step and a storage save
every step (``--mode train``), with the stall per save.
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from harness import Load, add_modes, apply_mode, argument_parser, machine_description, rotated, work_dir  # first

from recover_jobs import NodeMemory, two_nodes  # noqa: E402
from recover_report import report  # noqa: E402
from report import command_line, publish, write_json  # noqa: E402
from resume_jobs import dir_bytes, evict, parts_of, rank_records, titan_available  # noqa: E402
from tests.support.s3server import MotoServer, aws_env, make_bucket  # noqa: E402

BENCH_NAME = "recover"
HERE = Path(__file__).resolve().parent
RESUME_RANK, RECOVER_RANK = HERE / "resume_rank.py", HERE / "recover_rank.py"
WORLD = 4
BUCKET = "bench-recover"
S3_ROOT = f"s3://{BUCKET}/ours"
LAYOUTS = {"fsdp": "", "ddp": "--optimization.zero_stage 0"}  # trainer options of each layout
DEBUG = ["--dim", "128", "--layers", "4"]  # the debug flavour: lost work and tokens/s


@dataclass(frozen=True)
class Row:
    key: str
    label: str
    scenario: str
    system: str  # resume_rank.py --system
    reads: str  # the folder of the saved root this row reads (evicted before the job)
    memory: str | None = None  # "crash" | "loss": the memory tier on, node 1's folder kept or lost
    s3: bool = False


ROWS = (Row("mem-crash", "memory tier", "worker crash", "ours", "ours", memory="crash"),
        Row("mem-loss", "memory tier", "node loss (partner fetch)", "ours", "ours", memory="loss"),
        Row("disk", "ours, local disk (evicted)", "either", "ours", "ours"),
        Row("s3", "ours, S3 (moto)", "either", "ours", "ours", s3=True),
        Row("dcp", "DCP, local disk (evicted)", "either", "dcp", "dcp"),
        Row("titan", "torchtitan, local disk (evicted)", "either", "titan", "titan"))
TINY = {"dim": 64, "layers": 2, "repeats": 1, "lost_interval": 4, "window": 4}
QUICK = {"dim": 256, "layers": 4, "repeats": 1, "lost_interval": 50, "window": 20}
FULL = {"dim": 1024, "layers": 8, "repeats": 3, "lost_interval": 50, "window": 40}
WARMUP = 3  # steps before the tokens/s window


class Bench:
    def __init__(self, args, work: Path, memory: NodeMemory, env: dict):
        self.args, self.work, self.memory, self.env = args, work, memory, env
        self.layout = LAYOUTS[args.layout]
        self.root = work / "saved"

    def job(self, script: Path, tag: str, node_args, may_fail: bool = False) -> float:
        return two_nodes(script, node_args, self.work / f"{tag}.log", self.args.job_timeout, self.env, may_fail)

    def model(self) -> list[str]:
        return ["--dim", str(self.args.dim), "--layers", str(self.args.layers), "--steps", str(self.args.steps)]

    # -- the saved state ------------------------------------------------------------------------------
    def save(self, titan: bool) -> dict:
        t0 = time.monotonic()
        self.job(RESUME_RANK, "save", lambda n: [
            "--mode", "save", "--root", str(self.root), "--out", str(self.work / "save"),
            "--dump", str(self.work / "dump-save"), *self.model(), *(["--titan"] if titan else []),
            f"--trainer-args={self.layout} --checkpoint.memory {self.memory.node(n)} "
            f"--checkpoint.memory_keep_on_exit true --checkpoint.replicas {S3_ROOT}"])
        ranks = rank_records(self.work / "save", WORLD)
        self.memory.keep()
        saved = {"params": ranks[0]["params"], "s": time.monotonic() - t0,
                 "memory_saves": min(r["memory_saves"] for r in ranks),
                 "memory_failures": sum(r["memory_failures"] for r in ranks),
                 "bytes": {"ours": dir_bytes(self.root / "ours"), "memory (both nodes)": dir_bytes(self.memory.kept),
                           "dcp": dir_bytes(self.root / "dcp"),
                           **({"titan": dir_bytes(self.root / "titan")} if titan else {})}}
        self.memory.clear()
        print(f"saved: {saved['params']:,} params, " + ", ".join(f"{k} {b / 1e6:.1f} MB" for k, b in
                                                                   saved["bytes"].items())
              + f"; memory saves {saved['memory_saves']}, failures {saved['memory_failures']} ({saved['s']:.0f} s)",
              flush=True)
        return saved

    # -- one recovery ---------------------------------------------------------------------------------
    def recover(self, row: Row, tag: str) -> dict:
        self.memory.clear()
        if row.memory:
            self.memory.restore(lost=1 if row.memory == "loss" else None)
        evict(self.root / row.reads)
        out = self.work / f"recover-{tag}"

        def extra(n: int) -> str:
            options = [self.layout]
            if row.memory:  # no memory save in the first resumed step: the same step as every other row's
                options.append(f"--checkpoint.memory {self.memory.node(n)} --checkpoint.memory_interval 1000")
            if row.s3:
                options.append(f"--checkpoint.folder {S3_ROOT}")
            return " ".join(options)

        launched = self.job(RESUME_RANK, f"recover-{tag}", lambda n: [
            "--mode", "resume", "--system", row.system, "--root", str(self.root), "--out", str(out),
            "--dump", str(self.work / f"dump-{tag}"), *self.model(), f"--trainer-args={extra(n)}"])
        ranks = rank_records(out, WORLD)
        self.memory.clear()
        shutil.rmtree(self.work / f"dump-{tag}", ignore_errors=True)
        read = [r.get("bytes_read") for r in ranks]
        return {"parts": parts_of(launched, ranks), "loss": ranks[0]["loss"],
                "bytes_read": None if None in read else sum(read)}

    # -- lost work ----------------------------------------------------------------------------------
    def lost_work(self, interval: int) -> dict:
        """A run with the memory tier every ``interval`` steps (storage every --lost-interval) dies
        right after step C; the restart resumes at some step; C minus it is the work redone."""
        crash_at = self.args.lost_interval + self.args.lost_interval // 4 + 1
        root, tag = self.work / f"lost-{interval}", f"lost-{interval}"
        self.memory.clear()

        def node_args(n: int, mode: str) -> list[str]:
            return ["--mode", mode, "--root", str(root), "--out", str(self.work / f"{tag}-{mode}"),
                    "--dump", str(self.work / f"dump-{tag}"), "--steps", str(crash_at + 10),
                    "--crash-at", str(crash_at), "--interval", str(self.args.lost_interval), *DEBUG,
                    f"--trainer-args={self.layout} --checkpoint.async_mode double_buffer "
                    f"--checkpoint.memory {self.memory.node(n)} --checkpoint.memory_interval {interval}"]

        self.job(RECOVER_RANK, f"{tag}-crash", lambda n: node_args(n, "crash"), may_fail=True)
        self.job(RECOVER_RANK, f"{tag}-restart", lambda n: node_args(n, "restart"))
        ranks = rank_records(self.work / f"{tag}-restart", WORLD)
        resumed, read = ranks[0]["resumed"], sum(r["bytes_read"] for r in ranks)
        self.memory.clear()
        shutil.rmtree(root, ignore_errors=True)
        return {"interval": interval, "crash_at": crash_at, "resumed": resumed, "lost": crash_at - (resumed or 0),
                "from": "storage" if read else "memory tier"}

    # -- tokens/s -----------------------------------------------------------------------------------
    def throughput(self, variant: str, tag: str) -> dict:
        memory = variant == "memory"
        root = self.work / f"tps-{tag}"
        self.memory.clear()
        self.job(RECOVER_RANK, f"tps-{tag}", lambda n: [
            "--mode", "train", "--root", str(root), "--out", str(self.work / f"tps-{tag}"),
            "--dump", str(self.work / f"dump-tps-{tag}"), "--steps", str(WARMUP + self.args.window),
            "--warmup", str(WARMUP), "--interval", "1" if variant == "storage" else "100000", *DEBUG,
            f"--trainer-args={self.layout} --checkpoint.async_mode double_buffer"
            + (f" --checkpoint.memory {self.memory.node(n)} --checkpoint.memory_interval 1" if memory else "")])
        ranks = rank_records(self.work / f"tps-{tag}", WORLD)
        self.memory.clear()
        shutil.rmtree(root, ignore_errors=True)
        count = [r["memory_saves"] if memory else r["saves"] for r in ranks]
        return {"tokens_per_s": ranks[0]["tokens_per_s"], "memory_failures": sum(r["memory_failures"] for r in ranks),
                "stall_per_save": (sum(r["stall_s"] / c for r, c in zip(ranks, count) if c) / WORLD
                                   if all(count) else None)}


VARIANTS = {"none": "no save", "memory": "memory save every step", "storage": "storage save every step"}


def run(args, work: Path, rows: list[Row]) -> dict:
    with MotoServer(work / "moto.log") as server, NodeMemory(work / "memory-kept") as memory:
        make_bucket(server.endpoint_url, BUCKET)
        env = {**aws_env(server.endpoint_url), "AWS_CONFIG_FILE": str(work / "no-aws-config"),
               "AWS_SHARED_CREDENTIALS_FILE": str(work / "no-aws-credentials")}
        bench = Bench(args, work, memory, env)
        load = Load()
        saved = bench.save(titan=any(r.system == "titan" for r in rows))
        runs: dict = {}
        for rep in range(args.repeats):
            for row in rotated(rows, rep):
                result = bench.recover(row, f"{row.key}-{rep}")
                runs.setdefault(row.key, []).append(result)
                p = result["parts"]
                print(f"[{rep + 1}/{args.repeats}] {row.label:34s} {row.scenario:26s} total {p['total']:6.2f} s | load "
                      f"{p['checkpoint load']:6.2f} s | read {result['bytes_read']} | loss {result['loss']:.6f}", flush=True)
        lost = [bench.lost_work(interval) for interval in (1, args.lost_interval)]
        for item in lost:
            print(f"lost work at memory_interval {item['interval']}: crash after step {item['crash_at']}, "
                  f"resumed at {item['resumed']} from {item['from']}: {item['lost']} step(s) redone", flush=True)
        tps: dict = {}
        for rep in range(args.repeats):
            for variant in rotated(list(VARIANTS), rep):
                result = bench.throughput(variant, f"{variant}-{rep}")
                tps.setdefault(variant, []).append(result)
                print(f"[{rep + 1}/{args.repeats}] tokens/s, {VARIANTS[variant]:24s} {result['tokens_per_s']:8.0f}"
                      f" | stall per save {result['stall_per_save']}", flush=True)
        return {"saved": saved, "runs": runs, "lost": lost, "tps": tps, "warmup": WARMUP,
                "contention": load.stop().describe("during the jobs")}


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__doc__, keep=True)
    add_modes(parser, TINY, QUICK)
    parser.add_argument("--dim", type=int, help=f"model dimension of the recovered state (default {FULL['dim']})")
    parser.add_argument("--layers", type=int, help=f"transformer blocks (default {FULL['layers']})")
    parser.add_argument("--repeats", type=int, help=f"recoveries per row, tokens/s runs per variant ({FULL['repeats']})")
    parser.add_argument("--lost-interval", type=int, help="the interval lost work is measured at beside 1 (default 50)")
    parser.add_argument("--window", type=int, help=f"steps timed for tokens/s (default {FULL['window']})")
    parser.add_argument("--layout", choices=list(LAYOUTS), default="fsdp",
                        help="the trainer's data parallelism: fsdp (zero_stage 3, the default) or ddp (zero_stage 0)")
    parser.add_argument("--steps", type=int, default=2, help="steps trained before the save")
    parser.add_argument("--job-timeout", type=float, default=900, help="seconds one job may take")
    args = parser.parse_args(argv)
    apply_mode(args, TINY, QUICK, FULL)
    if args.repeats < 1 or args.lost_interval < 2:
        parser.error("--repeats must be >= 1 and --lost-interval >= 2")
    rows = [r for r in ROWS if r.system != "titan" or titan_available()]
    command = command_line("bench_recover.py", argv)
    t0 = time.monotonic()
    with work_dir(args.dir, "recover-", keep=args.keep) as work:
        info = {"machine": machine_description(work), "titan": titan_available()}
        result = run(args, work, rows)
        info["wall_s"] = time.monotonic() - t0
    section, metrics, goals = report(result, rows, args, info, command)
    publish(section, args.out)
    write_json(args.json, BENCH_NAME, section, command, metrics=metrics, goals=goals,
               params={"dim": args.dim, "layers": args.layers, "repeats": args.repeats, "layout": args.layout,
                       "lost_interval": args.lost_interval, "window": args.window, "tiny": args.tiny,
                       "quick": args.quick, "params": result["saved"]["params"], "bytes": result["saved"]["bytes"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
