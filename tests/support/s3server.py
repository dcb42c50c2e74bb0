"""A real S3-protocol server on loopback for the storage tests (and ``benchmarks/bench_storage.py``).

Contract:

* :class:`MotoServer` runs moto's server (``python -m moto.server``) as a *subprocess* on 127.0.0.1 and a free port,
  so it can be stopped or killed independently of the tests. Its conditional PUTs (``If-None-Match: *``,
  ``If-Match: <etag>``, what the object-store lease is built on) are atomic, as on S3. ``start()`` returns once the server
  answers HTTP (at most ``startup_timeout`` seconds, else :class:`RuntimeError` with the log tail);
  ``stop()`` terminates it (kill after a timeout); ``restart()`` brings it back on the same port
  (moto keeps its data in memory, so a restart empties every bucket). Its output goes to a log
  file, or nowhere: never to a pipe that could fill.
* A stopped server that "comes back with its data": :func:`snapshot_bucket` / :func:`restore_bucket`
  put a bucket's objects back after a restart (moto keeps data in memory only).
* Helpers: :func:`make_bucket`, :func:`s3_client` (a boto3 client with the test credentials),
  :func:`s3_storage_options` (fsspec/s3fs options, configured to fail fast), :func:`aws_env` (the
  standard AWS environment variables). Every credential is the dummy pair :data:`TEST_KEY` /
  :data:`TEST_SECRET`, distinctive so that tests can assert it never lands in a written file or a
  log line.

The proxy that breaks the link to the server on command is :mod:`tests.support.s3proxy`. Nothing
here touches the network beyond 127.0.0.1.
"""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.support.launch import HOST, free_port

REGION = "us-east-1"
TEST_KEY = "ckpttestAKIA0000SECRETID"
TEST_SECRET = "ckpttest-secret-DO-NOT-LEAK-0123456789"



def _answers_http(port: int, timeout: float = 1.0) -> bool:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("GET", "/")
        conn.getresponse().read()
        return True
    except OSError:
        return False
    finally:
        conn.close()


# ``python -m moto.server``, but with one Server header per response: werkzeug always sends its own
# and moto adds "server: amazon.com", a duplicate that aiohttp's strict parser (``python -X dev``,
# PYTHONASYNCIODEBUG=1) rejects, failing every s3fs call.
_MOTO_MAIN = """
import sys
from moto.server import main

def send_response(self, code, message=None):
    self.log_request(code)
    self.send_response_only(code, message)
    self.send_header("Date", self.date_time_string())

try:
    from moto.moto_server.werkzeug_app import MotoRequestHandler
except ImportError:  # another moto layout: run it as it is
    pass
else:
    MotoRequestHandler.send_response = send_response

# moto checks a conditional PUT's If-None-Match / If-Match and then stores the object, two steps
# without a lock between them: two racing conditional PUTs could both succeed (1 race in 200 did,
# under load). S3 decides them atomically; one lock around PutObject and DeleteObject makes moto do so.
import functools, threading
from moto.s3.responses import S3Response

_one_at_a_time = threading.Lock()

def _atomic(method):
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with _one_at_a_time:
            return method(self, *args, **kwargs)
    return call

S3Response.put_object = _atomic(S3Response.put_object)
S3Response.delete_object = _atomic(S3Response.delete_object)
main(sys.argv[1:])
"""


class MotoServer:
    """moto's server in a subprocess on 127.0.0.1; see the module docstring."""

    def __init__(self, log_path: str | Path | None = None, startup_timeout: float = 30.0):
        self.log_path = Path(log_path) if log_path is not None else None
        self.startup_timeout = startup_timeout
        self.port: int | None = None
        self.process: subprocess.Popen | None = None
        self.startup_seconds: float | None = None  # how long the last start took

    @property
    def endpoint_url(self) -> str:
        if self.port is None:
            raise RuntimeError("MotoServer is not started")
        return f"http://{HOST}:{self.port}"

    def start(self) -> "MotoServer":
        """Start on a fresh free port (a few tries: another process may take the port first)."""
        if self.process is not None:
            raise RuntimeError("MotoServer is already running")
        error = None
        for _ in range(3):
            try:
                self._launch(free_port())
                return self
            except RuntimeError as e:
                error = e
        raise error

    def restart(self) -> None:
        """Stop and start again on the same port, so ``endpoint_url`` stays valid; the data is gone."""
        port = self.port
        self.stop()
        self._launch(port)

    def stop(self, timeout: float = 5.0) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout)

    def _launch(self, port: int) -> None:
        env = {**os.environ, **aws_env(f"http://{HOST}:{port}")}
        log = open(self.log_path, "ab") if self.log_path is not None else subprocess.DEVNULL
        started = time.monotonic()
        try:
            process = subprocess.Popen(
                [sys.executable, "-c", _MOTO_MAIN, "-H", HOST, "-p", str(port)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
            )
        finally:
            if log is not subprocess.DEVNULL:
                log.close()  # the child holds its own descriptor
        self.process, self.port = process, port
        deadline = started + self.startup_timeout
        while time.monotonic() < deadline:
            if process.poll() is not None:
                break
            if _answers_http(port):
                self.startup_seconds = time.monotonic() - started
                return
            time.sleep(0.05)
        code = process.poll()
        self.stop()
        why = f"exited with code {code}" if code is not None else f"did not answer in {self.startup_timeout:g} s"
        raise RuntimeError(f"moto server on port {port} {why}{self._log_tail()}")

    def _log_tail(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "; log tail:\n" + self.log_path.read_text(errors="replace")[-2000:]

    def __enter__(self) -> "MotoServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def s3_storage_options(endpoint_url: str) -> dict:
    """fsspec/s3fs options for the S3 server at ``endpoint_url``, failing fast when the link breaks.

    The botocore config bounds each attempt (connect 2 s, read 5 s) and makes two attempts at most
    (standard mode: under 1 s of backoff). A refused connection then surfaces as botocore's
    ``EndpointConnectionError``, which s3fs does not retry. A connection closed mid-request
    (``ConnectionClosedError``) s3fs does retry (``S3FileSystem.retries``: 5 tries, ~2 s of backoff).
    """
    return {
        "key": TEST_KEY,
        "secret": TEST_SECRET,
        "client_kwargs": {"endpoint_url": endpoint_url, "region_name": REGION},
        "config_kwargs": {"connect_timeout": 2, "read_timeout": 5, "retries": {"total_max_attempts": 2, "mode": "standard"}},
    }


def aws_env(endpoint_url: str) -> dict[str, str]:
    """The standard AWS environment variables pointing at ``endpoint_url`` with the dummy credentials."""
    return {
        "AWS_ENDPOINT_URL": endpoint_url,
        "AWS_ACCESS_KEY_ID": TEST_KEY,
        "AWS_SECRET_ACCESS_KEY": TEST_SECRET,
        "AWS_DEFAULT_REGION": REGION,
    }


def s3_client(endpoint_url: str):
    """A boto3 S3 client of the server at ``endpoint_url`` with the test credentials (close it)."""
    import boto3

    return boto3.client("s3", endpoint_url=endpoint_url, region_name=REGION,
                        aws_access_key_id=TEST_KEY, aws_secret_access_key=TEST_SECRET)


def make_bucket(endpoint_url: str, name: str) -> str:
    """Create bucket ``name`` on the server at ``endpoint_url``; returns ``name``."""
    client = s3_client(endpoint_url)
    try:
        client.create_bucket(Bucket=name)
    finally:
        client.close()
    return name


class S3Bucket:
    """A bucket on a test server: ``name``, ``url`` ("s3://name"), ``endpoint_url``, ``storage_options``."""

    def __init__(self, name: str, endpoint_url: str):
        self.name = name
        self.url = f"s3://{name}"
        self.endpoint_url = endpoint_url
        self.storage_options = s3_storage_options(endpoint_url)

    def __repr__(self) -> str:
        return f"S3Bucket({self.url!r} at {self.endpoint_url})"


def bucket_fs(bucket: S3Bucket):
    """A fresh s3fs filesystem on ``bucket``'s server (no instance cache)."""
    import fsspec

    return fsspec.filesystem("s3", skip_instance_cache=True, **bucket.storage_options)


def bucket_objects(bucket: S3Bucket, prefix: str = "") -> dict[str, bytes]:
    """Every object of ``bucket`` under ``prefix``: ``"<bucket>/<key>"`` -> bytes."""
    fs = bucket_fs(bucket)
    return {path: fs.cat_file(path) for path in fs.find(f"{bucket.name}/{prefix}")}


def snapshot_bucket(endpoint_url: str, bucket: str) -> dict[str, bytes]:
    """Every object of ``bucket``, key -> bytes (moto keeps data in memory only: a stopped server
    comes back empty, so a test that wants "the server returned with its data" restores this)."""
    client = s3_client(endpoint_url)
    try:
        objects = {}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for entry in page.get("Contents", []):
                objects[entry["Key"]] = client.get_object(Bucket=bucket, Key=entry["Key"])["Body"].read()
        return objects
    finally:
        client.close()


def restore_bucket(endpoint_url: str, bucket: str, objects: dict[str, bytes]) -> None:
    """Create ``bucket`` (if missing) and put ``objects`` back into it."""
    client = s3_client(endpoint_url)
    try:
        try:
            client.create_bucket(Bucket=bucket)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        for key, data in objects.items():
            client.put_object(Bucket=bucket, Key=key, Body=data)
    finally:
        client.close()
