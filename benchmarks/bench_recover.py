#!/usr/bin/env python
"""Time to recover after a worker crash and after a lost node: the memory tier against storage, DCP and torchtitan (issue 38).

    python benchmarks/bench_recover.py --tiny        # the tests' smoke run: a ~1 MB state, 1 rank a node, 3 rows
    python benchmarks/bench_recover.py --quick       # dim 256 (~40 MB), 1 repeat, lost work at interval 50
    python benchmarks/bench_recover.py               # run.py's full run: dim 1024, 8 layers (~1.2 GB), 3 repeats

Every job is one job of 4 ranks (``--per-node`` 2) on 2 "nodes" of this machine: two torchrun agents (``--nnodes 2``,
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
lost work (``recover_rank.py --mode crash``: a run with the memory tier every step and storage every
``--lost-interval`` steps; every rank dies ``--crash-frac`` of a step into the step after C; a fresh
job resumes from the memory tier, while a run without the tier would resume from the newest storage
step, read from the root's listing; steps redone = the steps finished at the crash - the resumed
step); tokens/s of a window of steps
with no save, a memory save every step and a storage save every step (``--mode train``), with the
stall per save.

``--tiny`` (the suite's smoke run, 9 jobs) keeps every part of the report but runs 1 rank a node
and the rows ``mem-loss`` (its node 0 loads its own copies, node 1 fetches the partner's: both memory
load paths), ``disk`` and ``s3`` (the load ratios' denominators): the crash row is the loss row's
code with node 1's folder kept, and the DCP and torchtitan rows are ``resume_rank.py``'s systems,
which bench_resume's tiny test runs. ``--rows`` picks rows in any mode.
"""

from __future__ import annotations

import json
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

from ckpt import CheckpointRoot  # noqa: E402

BENCH_NAME = "recover"
HERE = Path(__file__).resolve().parent
RESUME_RANK, RECOVER_RANK = HERE / "resume_rank.py", HERE / "recover_rank.py"
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
TINY = {"dim": 64, "layers": 2, "repeats": 1, "lost_interval": 4, "window": 4, "per_node": 1,
        "rows": ["mem-loss", "disk", "s3"]}
QUICK = {"dim": 256, "layers": 4, "repeats": 1, "lost_interval": 50, "window": 20, "per_node": 2}
FULL = {"dim": 1024, "layers": 8, "repeats": 3, "lost_interval": 50, "window": 40, "per_node": 2}
WARMUP = 3  # steps before the tokens/s window


class Bench:
    def __init__(self, args, work: Path, memory: NodeMemory, env: dict):
        self.args, self.work, self.memory, self.env = args, work, memory, env
        self.layout = LAYOUTS[args.layout]
        self.root = work / "saved"
        self.world = 2 * args.per_node

    def job(self, script: Path, tag: str, node_args, may_fail: bool = False) -> float:
        return two_nodes(script, node_args, self.work / f"{tag}.log", self.args.job_timeout, self.env, may_fail,
                         self.args.per_node)

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
        ranks = rank_records(self.work / "save", self.world)
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
            # The restore read the kept copy from disk: its pages cached would not exist after a real
            # crash, and on this VM they push the job's fresh memory past the host-backed pool, where the
            # first touch of a page costs ~45 us instead of ~3 (the first step took 2-3x as long)
            evict(self.memory.kept)
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
        ranks = rank_records(out, self.world)
        self.memory.clear()
        shutil.rmtree(self.work / f"dump-{tag}", ignore_errors=True)
        read = [r.get("bytes_read") for r in ranks]
        return {"parts": parts_of(launched, ranks), "loss": ranks[0]["loss"],
                "bytes_read": None if None in read else sum(read)}

    # -- lost work ----------------------------------------------------------------------------------
    def lost_work(self) -> dict:
        """A run with the memory tier every step and storage every --lost-interval steps dies
        --crash-frac of a step after step C; a fresh job resumes from the memory tier; without the
        tier a restart resumes from the newest storage step (the root's listing: no job needed). The
        steps finished at the crash minus the resumed step are the work redone."""
        interval = self.args.lost_interval
        crash_at = interval + interval // 4 + 1
        root = self.work / "lost"
        self.memory.clear()

        def node_args(n: int, mode: str) -> list[str]:
            return ["--mode", mode, "--root", str(root), "--out", str(self.work / f"lost-{mode}"),
                    "--dump", str(self.work / "dump-lost"), "--steps", str(crash_at + 10), "--crash-at",
                    str(crash_at), "--crash-frac", str(self.args.crash_frac), "--interval", str(interval), *DEBUG,
                    f"--trainer-args={self.layout} --checkpoint.async_mode double_buffer "
                    f"--checkpoint.memory {self.memory.node(n)} --checkpoint.memory_interval 1"]

        self.job(RECOVER_RANK, "lost-crash", lambda n: node_args(n, "crash"), may_fail=True)
        crashed = [json.loads(f.read_text()) for f in sorted((self.work / "lost-crash").glob("rank-*.json"))]
        if not crashed:
            raise RuntimeError(f"the crash job left no record (logs: {self.work}/lost-crash.log.node*)")
        finished = max(r["finished"] for r in crashed)
        started = set.intersection(*[set(r["started"]) for r in crashed])  # the gate decides alike on every rank
        stored = max([s for s in CheckpointRoot(root / "ours").steps() if s <= finished], default=0)
        self.job(RECOVER_RANK, "lost-restart", lambda n: node_args(n, "restart"))
        ranks = rank_records(self.work / "lost-restart", self.world)
        resumed, read = ranks[0]["resumed"], sum(r["bytes_read"] for r in ranks)
        self.memory.clear()
        shutil.rmtree(root, ignore_errors=True)
        return {"interval": interval, "finished": finished, "frac": self.args.crash_frac,
                "delay_s": crashed[0]["delay_s"], "started": len([s for s in started if s <= finished]),
                "last_started": finished in started, "committed": min(r["memory_committed"] for r in crashed),
                "stored": stored, "resumed": resumed, "from": "storage" if read else "memory tier"}

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
        ranks = rank_records(self.work / f"tps-{tag}", self.world)
        self.memory.clear()
        shutil.rmtree(root, ignore_errors=True)
        count = [r["memory_saves"] if memory else r["saves"] for r in ranks]
        per_step = self.world * self.args.window  # rank-steps in the window
        return {"tokens_per_s": ranks[0]["tokens_per_s"], "memory_failures": sum(r["memory_failures"] for r in ranks),
                "cpu_ms_per_rank_step": {"training": sum(r["cpu_s"]["main"] for r in ranks) / per_step * 1e3,
                                         "gloo": sum(r["cpu_s"]["gloo"] for r in ranks) / per_step * 1e3,
                                         "other": sum(r["cpu_s"]["process"] - r["cpu_s"]["main"] - r["cpu_s"]["gloo"]
                                                      for r in ranks) / per_step * 1e3},
                "stall_per_save": (sum(r["stall_s"] / c for r, c in zip(ranks, count) if c) / self.world
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
        lost = bench.lost_work()
        print(f"lost work: the crash {lost['delay_s'] * 1e3:.0f} ms into step {lost['finished'] + 1}; saves started "
              f"at {lost['started']} of {lost['finished']} steps (step {lost['finished']}'s: {lost['last_started']}), "
              f"memory steps committed {lost['committed']}; resumed at {lost['resumed']} from {lost['from']} "
              f"(newest storage step {lost['stored']})", flush=True)
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
    parser.add_argument("--lost-interval", type=int, help="lost work: the storage interval of the run that crashes (default 50)")
    parser.add_argument("--window", type=int, help=f"steps timed for tokens/s (default {FULL['window']})")
    parser.add_argument("--per-node", type=int, choices=(1, 2), help="ranks per node (default 2: 4 ranks)")
    parser.add_argument("--rows", nargs="+", choices=[r.key for r in ROWS],
                        help="the recovery rows run (default all; torchtitan's only when installed)")
    parser.add_argument("--crash-frac", type=float, default=0.5,
                        help="lost work: how far into the step after the last finished one the crash falls "
                             "(a fraction of a step's time; default 0.5, the middle)")
    parser.add_argument("--layout", choices=list(LAYOUTS), default="fsdp",
                        help="the trainer's data parallelism: fsdp (zero_stage 3, the default) or ddp (zero_stage 0)")
    parser.add_argument("--steps", type=int, default=2, help="steps trained before the save")
    parser.add_argument("--job-timeout", type=float, default=900, help="seconds one job may take")
    args = parser.parse_args(argv)
    apply_mode(args, TINY, QUICK, FULL)
    if args.repeats < 1 or args.lost_interval < 2:
        parser.error("--repeats must be >= 1 and --lost-interval >= 2")
    rows = [r for r in ROWS if (args.rows is None or r.key in args.rows) and (r.system != "titan" or titan_available())]
    command = command_line("bench_recover.py", argv)
    t0 = time.monotonic()
    with work_dir(args.dir, "recover-", keep=args.keep) as work:
        info = {"machine": machine_description(work), "titan": titan_available(),
                "left_out": [f"{r.label} ({r.scenario})" for r in ROWS  # torchtitan's absence has a note of its own
                             if r not in rows and (r.system != "titan" or titan_available())]}
        result = run(args, work, rows)
        info["wall_s"] = time.monotonic() - t0
    section, metrics, goals = report(result, rows, args, info, command)
    publish(section, args.out)
    write_json(args.json, BENCH_NAME, section, command, metrics=metrics, goals=goals,
               params={"dim": args.dim, "layers": args.layers, "repeats": args.repeats, "layout": args.layout,
                       "per_node": args.per_node, "rows": [r.key for r in rows], "crash_frac": args.crash_frac,
                       "lost_interval": args.lost_interval, "window": args.window, "tiny": args.tiny,
                       "quick": args.quick, "params": result["saved"]["params"], "bytes": result["saved"]["bytes"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
