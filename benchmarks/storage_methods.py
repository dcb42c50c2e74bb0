"""The methods ``bench_storage.py`` times against the S3 server, and what is checked around them.

Part 1, replication of one committed local step (``Bench.source``) to S3: the primary's local
``ckpt.save`` (the write a copy follows), ours (``ckpt.root.copy_step``, optionally
``read_back=True``) and ``s3fs put``; after each, outside the timing, the object sizes in the bucket
against the source, copy_step's target committed and (first repeat) its replica loaded bitwise equal.
Part 2, save straight to S3 and load back in place: ours (``ckpt.save``/``ckpt.load`` with
``storage_options``), the raw peer (s3fs put of the same files / parallel ranged GETs as many and as
large as ours) and DCP's fsspec writer/reader per ``--dcp-threads``; each load compared bitwise with
the state. Every method writes into its own prefix per repeat (``Bench.url``), deleted afterwards;
``Bench.warm_up`` runs every method once on a small state, untimed. The peers are ``s3_peers``'s.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from harness import check_equal, remove  # first: puts this checkout's root on sys.path

import ckpt  # noqa: E402
import ckpt.read  # noqa: E402
from ckpt.root import copy_step  # noqa: E402
from ckpt.storage import locate  # noqa: E402
import ckpt.storage  # noqa: E402
import s3_peers  # noqa: E402
from moto_probe import Probe, Sample  # noqa: E402
from states import zeros_like  # noqa: E402
from tests.support.s3server import s3_storage_options  # noqa: E402

BUCKET = "bench"
# Our S3 writer's and reader's settings: the raw reader makes as many GETs in flight as ours, of the same size.
OURS_S3 = {"part_bytes": ckpt.storage.PART_BYTES, "parts_in_flight": ckpt.storage.PARALLEL_PARTS,
           "range_bytes": ckpt.storage.RANGE_BYTES, "get_bytes": ckpt.read.REMOTE_PIECE_BYTES,
           "gets_in_flight": ckpt.read.REMOTE_READ_THREADS}


@dataclass
class Method:
    key: str
    name: str
    run: Callable[[int], None]  # run(rep): the timed operation, into repeat rep's prefix
    note: str = ""
    samples: list[Sample] = field(default_factory=list)
    load: Callable[[int], None] | None = None
    load_samples: list[Sample] = field(default_factory=list)
    verify: bool = True  # the load fills the live state (raw reads bytes only)

    def seconds(self, load: bool = False) -> list[float]:
        return [s.seconds for s in (self.load_samples if load else self.samples)]


class Bench:
    def __init__(self, args: argparse.Namespace, work: Path, probe: Probe):
        self.args, self.work, self.probe = args, work, probe
        self.options = s3_storage_options(probe.server.endpoint_url)
        self.fs = probe.fs  # fsspec's cached instance: the one ours and DCP get too
        self.reference: dict[str, torch.Tensor] = {}
        self.live: dict[str, torch.Tensor] = {}
        self.source = work / "source" / "step-1"

    def url(self, rep: int, key: str) -> str:
        return f"s3://{BUCKET}/rep{rep}/{key}/step-1"

    def clear(self, rep: int, key: str) -> None:
        self.probe.clear(self.url(rep, key).removeprefix("s3://").rsplit("/", 1)[0])

    def check_equal(self, what: str) -> None:
        if not self.args.no_verify:
            check_equal(self.live, self.reference, what)

    def zero_live(self) -> None:
        for t in self.live.values():
            t.zero_()

    # -- part 1: replication ---------------------------------------------------------------------
    def replication_methods(self) -> list[Method]:
        def primary(rep: int) -> None:
            ckpt.save(self.reference, self.work / f"primary-{rep}")

        def ours(rep: int, read_back: bool = False) -> None:
            copy_step(locate(str(self.source)), locate(self.url(rep, "copy_rb" if read_back else "copy"), self.options),
                      read_back=read_back)

        methods = [
            Method("primary", "primary: ckpt.save to local disk", primary, "the write the copy follows; fsync + commit"),
            Method("copy", "ours: copy_step local → S3", ours, "streaming, every blob's xxh3 checked, sizes checked, manifest last"),
            Method("put", "s3fs put (recursive)", lambda rep: s3_peers.s3fs_put(self.fs, self.source, self.url(rep, "put")),
                   "unverified; 50 MiB parts, ≤ 10 in flight"),
        ]
        if self.args.read_back:
            methods.append(Method("copy_rb", "ours: copy_step(read_back=True)", lambda rep: ours(rep, True),
                                  "+ every blob read back from S3 and verified"))
        return methods

    def after_replication(self, m: Method, rep: int) -> None:
        """Outside the timing: check what landed, then free the server's memory."""
        if m.key == "primary":
            remove(self.work / f"primary-{rep}")
            return
        url = self.url(rep, m.key)
        expected = local_sizes(self.source)
        got = self.probe.sizes(url)
        if got != expected:
            raise RuntimeError(f"{m.name}: the bucket holds {got}, the source {expected}")
        if m.key == "copy":
            if not ckpt.read.is_committed(locate(url, self.options)):
                raise RuntimeError(f"{m.name}: {url} is not committed")
            if rep == 0 and not self.args.no_verify:
                self.zero_live()
                ckpt.load(self.live, url, storage_options=self.options)
                self.check_equal("replica loaded with ckpt.load")
        self.clear(rep, m.key)

    # -- part 2: save to S3 and load back --------------------------------------------------------
    def s3_methods(self) -> list[Method]:
        url, options = self.url, self.options
        methods = [Method("ckpt", "ours: ckpt.save / ckpt.load",
                          lambda rep: ckpt.save(self.reference, url(rep, "ckpt"), storage_options=options),
                          f"multipart, {OURS_S3['part_bytes'] >> 20} MiB parts, {OURS_S3['parts_in_flight']} in flight; "
                          f"{OURS_S3['get_bytes'] >> 20} MiB ranged GETs, {OURS_S3['gets_in_flight']} in flight; "
                          "checksums verified",
                          load=lambda rep: ckpt.load(self.live, url(rep, "ckpt"), storage_options=options)),
                   Method("raw", "raw: s3fs put / parallel ranged GETs",
                          lambda rep: s3_peers.s3fs_put(self.fs, self.source, url(rep, "raw")),
                          f"the files ours wrote; load = {OURS_S3['gets_in_flight']} ranged GETs of "
                          f"{OURS_S3['get_bytes'] >> 20} MiB in flight into one pre-faulted buffer per file, unverified",
                          load=lambda rep: s3_peers.parallel_ranged_get(self.fs, url(rep, "raw"), OURS_S3["gets_in_flight"],
                                                                        OURS_S3["get_bytes"]),
                          verify=False)]
        for threads in self.args.dcp_threads:
            key = f"dcp{threads}"
            default = " (defaults)" if threads == 1 else ""
            methods.append(Method(
                key, f"DCP FsspecWriter / FsspecReader, thread_count={threads}{default}",
                lambda rep, key=key, threads=threads: s3_peers.dcp_fsspec_save(self.reference, url(rep, key), threads,
                                                                               options),
                "s3fs write stream: a part per ≥ 50 MiB buffered, one at a time; "
                + ("one file" if threads == 1 else f"{threads} files, {threads} threads"),
                load=lambda rep, key=key: s3_peers.dcp_fsspec_load(self.live, url(rep, key), options)))
        return methods

    def run_s3_method(self, m: Method, rep: int) -> None:
        m.samples.append(self.probe.measure(lambda: m.run(rep)))
        self.zero_live()
        m.load_samples.append(self.probe.measure(lambda: m.load(rep)))
        if m.verify:
            self.check_equal(m.name)
        self.clear(rep, m.key)

    # -- the run ---------------------------------------------------------------------------------
    def warm_up(self, methods: list[Method]) -> None:
        """Untimed: imports, sessions, connection pools and the server's first allocations."""
        small = {k: v[: max(1, v.shape[0] // 64)].clone() for k, v in self.reference.items()}
        saved, saved_live = self.reference, self.live
        self.reference, self.live = small, zeros_like(small)
        full_source, self.source = self.source, self.work / "warmup" / "step-1"
        try:
            ckpt.save(self.reference, self.source)
            for m in methods:
                m.run(-1)
                if m.key == "primary":
                    remove(self.work / "primary--1")
                    continue
                if m.load is not None:
                    self.zero_live()
                    m.load(-1)
                    if m.verify:
                        self.check_equal(f"warm-up {m.name}")
                self.clear(-1, m.key)
        finally:
            remove(self.work / "warmup")
            self.reference, self.live, self.source = saved, saved_live, full_source
        # One full-size upload, so the server's first big allocations land on no method.
        s3_peers.s3fs_put(self.fs, self.source, f"s3://{BUCKET}/warmup/step-1")
        self.probe.clear(f"{BUCKET}/warmup")


def local_sizes(path: Path) -> dict[str, int]:
    return {str(p.relative_to(path)): p.stat().st_size for p in path.rglob("*") if p.is_file()}
