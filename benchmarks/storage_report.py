"""The section of ``bench_storage.py``: the replication table, the save/load table, the goals and
their notes, and the JSON metrics.

Input: the script's method records (``key``, ``name``, ``note``; per repeat ``samples`` and, for
the save/load part, ``load_samples``: ``moto_probe.Sample``), and ``info`` — the state, the machine,
the other load, the source step's files, our S3 writer's and reader's settings (``ours_s3``) and the
optional profile. Every ratio is a speed ratio paired per repeat (``harness.paired``: the peer's
seconds over the method's). The JSON's system labels and operations are the runner's contract
(benchmarks/README.md).
"""

from __future__ import annotations

import argparse

from harness import median, paired

from moto_probe import Sample
from report import goal, goal_line, median_span, metric, provenance, table_head

SECTION = "## Storage: replication and save/load on S3 (moto on loopback)"
MiB = 1 << 20
GOAL_REPLICATION = 0.8  # copy_step >= 0.8x s3fs put (verification costs something)
GOAL_SAVE = 1.0  # ckpt.save to S3 >= 1.0x DCP's fsspec writer
GOAL_LOAD = 1.0  # ckpt.load from S3 >= 1.0x DCP's fsspec reader
GOAL_LOAD_X_RAW = 0.95  # issue 27: ckpt.load from S3 >= 0.95x raw parallel ranged GETs of the same files


def speed_x(m, peer, load: bool = False) -> list[float]:
    """Per repeat: peer's seconds / ``m``'s (how many times peer's speed ``m`` ran at)."""
    return paired(peer.seconds(load), m.seconds(load))


# The JSON's system labels (plot legends, table rows) and operation of each method's timings.
SYSTEMS = {"primary": ("ours (ckpt.save, local disk)", "save_local"), "copy": ("ours (copy_step)", "replicate"),
           "put": ("s3fs put", "replicate"), "copy_rb": ("ours (copy_step, read_back)", "replicate"),
           "ckpt": ("ours (ckpt.save to S3)", "save"), "raw": ("raw (s3fs put)", "save")}
LOAD_SYSTEMS = {"ckpt": "ours (ckpt.load from S3)", "raw": "raw (parallel ranged GETs)"}


def system_of(m, load: bool = False) -> tuple[str, str]:
    """(system label, op) of ``m``'s save (or load) timings in the JSON."""
    if m.key.startswith("dcp"):
        n = int(m.key[3:])
        if load:  # FsspecReader has no thread count: it reads the n files the n-thread writer wrote
            return f"DCP FsspecReader ({n} file{'s' if n > 1 else ''})", "load"
        return f"DCP FsspecWriter ({n} thread{'s' if n > 1 else ''})", "save"
    return (LOAD_SYSTEMS[m.key], "load") if load else SYSTEMS[m.key]


def json_metrics(methods1: list, methods2: list, nbytes: int) -> list[dict]:
    """MiB/s per repeat of every timed operation: replications, saves to S3, loads from S3."""
    out = []
    for m in methods1:
        system, op = system_of(m)
        out.append(metric(system, "mibps", "MiB/s", [nbytes / s / MiB for s in m.seconds()], op=op))
    for load in (False, True):
        for m in methods2:
            system, op = system_of(m, load)
            out.append(metric(system, "mibps", "MiB/s", [nbytes / s / MiB for s in m.seconds(load)], op=op))
    return out


def ratio_goal(name: str, ours: object | None, peer: object | None, target: float, load: bool = False,
               what: str = "") -> dict:
    """A speed goal: the median over repeats of the paired ratio (peer's seconds / ours), min-max in the
    detail; unmeasured (None) when the peer did not run (e.g. --dcp-threads without 1)."""
    if ours is None or peer is None:
        return goal(name, None, target, ">=", f"not measured: {what or 'the peer'} did not run")
    ratios = speed_x(ours, peer, load)
    return goal(name, median(ratios), target, ">=",
                f"median of {len(ratios)} paired repeat(s), min–max {min(ratios):.2f}–{max(ratios):.2f}; "
                f"{median(ours.seconds(load)):.2f} s vs {median(peer.seconds(load)):.2f} s")


def storage_goals(methods1: list, methods2: list) -> list[dict]:
    by1, by2 = {m.key: m for m in methods1}, {m.key: m for m in methods2}
    dcp_default, ours = by2.get("dcp1"), by2.get("ckpt")
    missing = "DCP's FsspecWriter with thread_count=1 (--dcp-threads without 1)"
    return [
        ratio_goal(f"replication ≥ {GOAL_REPLICATION}× s3fs put", by1["copy"], by1["put"], GOAL_REPLICATION),
        ratio_goal(f"save to S3 ≥ {GOAL_SAVE}× DCP FsspecWriter (default thread_count=1)", ours, dcp_default,
                   GOAL_SAVE, what=missing),
        ratio_goal(f"load from S3 ≥ {GOAL_LOAD}× DCP FsspecReader", ours, dcp_default, GOAL_LOAD, load=True,
                   what=missing),
        ratio_goal(f"load from S3 ≥ {GOAL_LOAD_X_RAW}× raw parallel ranged GETs", ours, by2.get("raw"), GOAL_LOAD_X_RAW,
                   load=True, what="the raw reader"),
    ]


def rate(nbytes: int, seconds: list[float]) -> str:
    xs = [nbytes / s / MiB for s in seconds]
    return f"{median(xs):.1f} ({min(xs):.1f}–{max(xs):.1f})"


def requests(samples: list[Sample]) -> str:
    """The requests of the last repeat, by HTTP method ('3: 2 PUT, 1 HEAD')."""
    counts = samples[-1].requests
    return f"{sum(counts.values())}: " + ", ".join(f"{n} {verb}" for verb, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def cpu(samples: list[Sample]) -> str:
    return f"{median([s.client_cpu for s in samples]):.2f} / {median([s.server_cpu for s in samples]):.2f}"


def report(methods1: list, methods2: list, info: dict, args: argparse.Namespace, command: str) -> str:
    nbytes = info["nbytes"]
    by1 = {m.key: m for m in methods1}
    by2 = {m.key: m for m in methods2}
    ours1 = by1["copy"]
    put = by1["put"]
    s3 = info["ours_s3"]

    t1 = table_head(["Method", "MiB/s, median (min–max)", "Seconds, median (min–max)",
                     "× s3fs put (paired, min–max)", "CPU s client / server", "Requests", "Notes"], "lrrrrll")
    for m in methods1:
        ratio = median_span(speed_x(m, put), 2) if m.key != "put" else "1.00"
        t1.append(f"| {m.name} | {rate(nbytes, m.seconds())} | {median_span(m.seconds())} | {ratio} "
                  f"| {cpu(m.samples)} | {requests(m.samples) if m.key != 'primary' else '–'} | {m.note} |")

    t2 = table_head(["Method", "Save MiB/s (min–max)", "Save s (min–max)", "Save × DCP default (paired)",
                     "Load MiB/s (min–max)", "Load s (min–max)", "Load × DCP default (paired)",
                     "CPU s client / server: save; load", "Requests: save; load", "Notes"], "l" + "r" * 7 + "ll")
    dcp_default = by2.get("dcp1")
    for m in methods2:
        if dcp_default is not None and m is not dcp_default:
            rs, rl = median_span(speed_x(m, dcp_default), 2), median_span(speed_x(m, dcp_default, True), 2)
        else:
            rs = rl = "1.00" if m is dcp_default else "–"
        t2.append(f"| {m.name} | {rate(nbytes, m.seconds())} | {median_span(m.seconds())} | {rs} "
                  f"| {rate(nbytes, m.seconds(True))} | {median_span(m.seconds(True))} | {rl} "
                  f"| {cpu(m.samples)}; {cpu(m.load_samples)} | {requests(m.samples)}; {requests(m.load_samples)} "
                  f"| {m.note} |")

    notes = [goal_line(g, digits=2) for g in storage_goals(methods1, methods2)]
    primary = by1["primary"]
    notes.append(f"- The copy takes {median(ours1.seconds()) / median(primary.seconds()):.1f}× as long as writing "
                 "the primary to local disk.")
    extra = sum(ours1.samples[-1].requests.values()) - sum(put.samples[-1].requests.values())
    notes.append(f"- Requests (counted from the server's log, last repeat): copy_step makes {extra} more than s3fs put "
                 "for the same bytes: the commit protocol's checks on the target (LISTs and HEADs: is it committed, "
                 "leftovers of dead attempts, objects no manifest references), a HEAD per object to check its stored "
                 "size. On loopback each costs about a millisecond; against a "
                 "real store each is a round trip, and at small sizes (`--quick`) they dominate the copy.")
    notes.append("- moto answers a ranged GET by reading the whole object and slicing it (`FakeKey.value`), so a "
                 "load's server CPU grows with GETs × object size: loads of one object holding the whole state (ours: "
                 f"{s3['range_bytes'] // MiB} MiB ranges; DCP's reader: s3fs blocks) pay for that, DCP with "
                 "`thread_count=4` (four objects of a quarter each) less. A real store serves a range without touching the rest.")
    notes.append("- moto is an in-memory Python server in a subprocess on the same machine: every byte crosses "
                 "loopback HTTP and is handled by Python on both ends, so absolute MiB/s say little about a real "
                 "object store; the ratios between methods of the same run, against the same server, are the result. "
                 "*CPU s client / server* is the CPU time (all threads) of this process and of the moto process "
                 "during the operation: on this 2-vCPU box their sum against the wall time shows when the run is "
                 "CPU-bound.")
    notes.append("- Source step (written once by `ckpt.save` before the repeats): "
                 + ", ".join(f"{k} {v / MiB:.1f} MiB" if v >= MiB else f"{k} {v} B"
                             for k, v in sorted(info["source_files"].items()))
                 + ". Each method writes into a fresh prefix per repeat, deleted afterwards (outside the timing). "
                 "Checked outside the timing: the object sizes in the bucket equal the source's for both copies, "
                 "copy_step's target is committed"
                 + ("" if args.no_verify else ", the first repeat's replica loads with `ckpt.load` bitwise equal, "
                    "and every S3 load is compared bitwise with the state") + ".")
    notes.append(f"- Our S3 writer: multipart uploads of {s3['part_bytes'] // MiB} MiB parts, "
                 f"{s3['parts_in_flight']} in flight per file, each object's size checked after upload, "
                 f"manifest written last (the commit); a load makes ranged GETs of {s3['get_bytes'] // MiB} MiB, "
                 f"{s3['gets_in_flight']} in flight, neighbouring chunks smaller than one GET sharing one "
                 "(`ckpt/read/batch.py`). s3fs `put` uses one PUT below 100 MiB, else 50 MiB parts, "
                 "up to 10 in flight. DCP's FsspecWriter writes through an s3fs file, which uploads what it has buffered "
                 "as one part each time 50 MiB or more have accumulated, one part at a time, and renames `.metadata` "
                 "into place (a copy on S3).")
    if info.get("profile"):
        notes.append("- Profile (`--profile`): " + info["profile"][0] + " " + "; ".join(info["profile"][1:]) + ".")
    cache = ("`sync` + `echo 3 > /proc/sys/vm/drop_caches` before every timed operation (`--cold`: local reads cold)"
             if info["cold"] else "`sync` before every timed operation, page cache kept: the source step is read "
             "warm, as right after the primary's write (`--cold` drops the cache)")
    server = ("moto keeps every object in its memory (`MOTO_S3_DEFAULT_KEY_BUFFER_SIZE` raised for the server)"
              if not args.moto_spill else "moto spills objects over ~5 MiB to temporary files (`--moto-spill`)")
    body = [
        SECTION,
        "",
        f"State: {info['state']}. moto server (`tests.support.s3server.MotoServer`) on 127.0.0.1, one bucket, "
        f"s3fs with the tests' storage options (endpoint, dummy keys). Median of {args.repeats} repeat(s), "
        f"methods of each part interleaved (order rotated per repeat); MiB/s = state bytes (2^20) / wall seconds "
        f"(`time.perf_counter` around the call only); × ratios are speed ratios paired per repeat (peer's seconds / "
        f"the method's). {cache}. {server}.",
        "",
        "Replication of one committed step, local disk → S3:",
        "",
        *t1,
        "",
        "Save straight to S3, then load back in place:",
        "",
        *t2,
        "",
        "Notes:",
        *notes,
        "",
        *provenance(info["machine"], command, load=info["contention"], extra=[info["server_line"]]),
    ]
    return "\n".join(body)
