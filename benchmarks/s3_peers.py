"""The systems ``bench_storage.py`` compares ours with on S3, each written once (the S3 side of
``peers.py``); the benchmark times these calls.

s3fs put        :func:`s3fs_put`: ``S3FileSystem.put(dir, prefix, recursive=True)`` of a step's
                files, unverified (s3fs's defaults: one PUT below 100 MiB, else 50 MiB parts, up
                to 10 in flight per file).
raw read        :func:`parallel_ranged_get`: every object under a prefix read by ``threads`` ranged
                GETs of ``range_bytes`` in flight into one pre-faulted buffer per object,
                unverified — the limit of a reader making the requests ours makes.
DCP fsspec      :func:`dcp_fsspec_save` / :func:`dcp_fsspec_load`: ``dcp.save(state,
                storage_writer=FsspecWriter(url, thread_count=n, **storage_options), no_dist=True)``
                (one file per thread) and ``dcp.load(state, storage_reader=FsspecReader(url,
                **storage_options), no_dist=True)`` in place.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter


def s3fs_put(fs, source: Path, url: str) -> None:
    fs.put(str(source), url.removeprefix("s3://"), recursive=True)


def parallel_ranged_get(fs, url: str, threads: int, range_bytes: int) -> None:
    fs.invalidate_cache()
    files = {name: info["size"] for name, info in fs.find(url.removeprefix("s3://"), detail=True).items()}
    buffers = {name: bytearray(b"\1") * size for name, size in files.items()}
    ranges = [(name, start) for name, size in files.items() for start in range(0, size, range_bytes)]

    def get(job) -> None:
        name, start = job
        stop = min(start + range_bytes, files[name])
        buffers[name][start:stop] = fs.cat_file(name, start=start, end=stop)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(get, ranges))


def dcp_fsspec_save(state: dict, url: str, threads: int, storage_options: dict) -> None:
    dcp.save(dict(state), storage_writer=FsspecWriter(url, thread_count=threads, **storage_options), no_dist=True)


def dcp_fsspec_load(state: dict, url: str, storage_options: dict) -> None:
    dcp.load(state, storage_reader=FsspecReader(url, **storage_options), no_dist=True)
