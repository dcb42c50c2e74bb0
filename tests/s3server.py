"""A real S3-protocol server on loopback for the storage tests, and a proxy to break the link to it.

Contract:

* :class:`MotoServer` runs moto's server (``python -m moto.server``) as a *subprocess* on 127.0.0.1 and a free port,
  so it can be stopped or killed independently of the tests. ``start()`` returns once the server
  answers HTTP (at most ``startup_timeout`` seconds, else :class:`RuntimeError` with the log tail);
  ``stop()`` terminates it (kill after a timeout); ``restart()`` brings it back on the same port
  (moto keeps its data in memory, so a restart empties every bucket). Its output goes to a log
  file, or nowhere: never to a pipe that could fill.
* :class:`LoopbackProxy` forwards TCP from 127.0.0.1:<free port> to a target, a thread per
  direction of each connection (daemon threads, blocking sockets, no polling). ``drop()`` resets
  every open connection and refuses new ones (connection refused, at once) until ``restore()``,
  which listens again on the same port; ``close()`` ends it all. The
  ``mode`` attribute says what it does to traffic ("forward" or "drop"); later modes (slow,
  errors) hook into :meth:`LoopbackProxy._handle` and :meth:`LoopbackProxy._pump`.
* Helpers: :func:`make_bucket`, :func:`s3_storage_options` (fsspec/s3fs options, configured to
  fail fast), :func:`aws_env` (the standard AWS environment variables). Every credential is the
  dummy pair :data:`TEST_KEY` / :data:`TEST_SECRET`, distinctive so that tests can assert it never
  lands in a written file or a log line.

Nothing here touches the network beyond 127.0.0.1.
"""

from __future__ import annotations

import http.client
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

HOST = "127.0.0.1"
REGION = "us-east-1"
TEST_KEY = "ckpttestAKIA0000SECRETID"
TEST_SECRET = "ckpttest-secret-DO-NOT-LEAK-0123456789"


def free_port() -> int:
    """A port on 127.0.0.1 free right now (another process could still take it before it is used)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


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


def _reset(sock: socket.socket) -> None:
    """Close ``sock`` with a TCP reset (linger 0), waking any thread blocked on it."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RDWR)  # close() alone does not wake a blocked recv()
    except OSError:
        pass
    sock.close()


class LoopbackProxy:
    """TCP proxy 127.0.0.1:<free port> -> ``target``; see the module docstring.

    ``mode`` is "forward" or "drop". While dropping nothing listens on the port, so a new
    connection is refused at once (the client fails fast rather than waiting on a timeout); the
    port stays reserved by a bound, non-listening socket, so ``restore()`` gets it back.
    """

    BUFSIZE = 64 * 1024

    def __init__(self, target_host: str, target_port: int, connect_timeout: float = 5.0):
        self.target = (target_host, target_port)
        self.connect_timeout = connect_timeout
        self.mode = "forward"
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()  # every open socket, both sides
        self._closed = False
        self._listener: socket.socket | None = socket.create_server((HOST, 0))
        self._placeholder: socket.socket | None = None  # holds the port while dropping
        self.port = self._listener.getsockname()[1]
        self._thread = self._serve(self._listener)

    @classmethod
    def to(cls, endpoint_url: str) -> "LoopbackProxy":
        """A proxy to an ``http://host:port`` endpoint."""
        host, port = endpoint_url.split("//", 1)[1].rstrip("/").rsplit(":", 1)
        return cls(host, int(port))

    @property
    def endpoint_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def storage_options(self) -> dict:
        """s3fs options for the S3 server behind this proxy, going through the proxy."""
        return s3_storage_options(self.endpoint_url)

    def drop(self) -> None:
        """Reset every open connection and refuse new ones until :meth:`restore`."""
        with self._lock:
            self.mode = "drop"
            conns, self._conns = self._conns, set()
            listener, self._listener = self._listener, None
        if listener is not None:
            _reset(listener)  # shutdown() wakes the accept() blocked in the thread; close() alone may not
            self._thread.join(5)
            self._placeholder = socket.socket()
            self._placeholder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._placeholder.bind((HOST, self.port))
        for sock in conns:
            _reset(sock)

    def restore(self) -> None:
        """Listen and forward again, on the same port."""
        with self._lock:
            if self._closed:
                raise RuntimeError("LoopbackProxy is closed")
            if self._listener is not None:
                return
            self._placeholder.close()
            self._placeholder = None
            self._listener = socket.create_server((HOST, self.port))
            self.mode = "forward"
        self._thread = self._serve(self._listener)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.drop()
        self._placeholder.close()

    def __enter__(self) -> "LoopbackProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _serve(self, listener: socket.socket) -> threading.Thread:
        thread = threading.Thread(target=self._accept_loop, args=(listener,), name=f"proxy:{self.port}", daemon=True)
        thread.start()
        return thread

    def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # the listener was closed
            threading.Thread(target=self._handle, args=(client,), daemon=True).start()

    def _track(self, *socks: socket.socket) -> bool:
        """Register open sockets; False (and reset them) when the proxy is dropping or closed."""
        with self._lock:
            if self.mode == "forward" and not self._closed:
                self._conns.update(socks)
                return True
        for sock in socks:
            _reset(sock)
        return False

    def _handle(self, client: socket.socket) -> None:
        if not self._track(client):
            return
        try:
            upstream = socket.create_connection(self.target, timeout=self.connect_timeout)
            upstream.settimeout(None)
        except OSError:
            self._forget(client, reset=True)
            return
        if not self._track(upstream):
            self._forget(client, reset=True)
            return
        open_directions = [2]
        threading.Thread(target=self._pump, args=(upstream, client, open_directions), daemon=True).start()
        self._pump(client, upstream, open_directions)

    def _pump(self, src: socket.socket, dst: socket.socket, open_directions: list[int]) -> None:
        """Copy ``src`` to ``dst`` until EOF, pass the EOF on (half-close); the last direction
        to end closes both sockets. An error in either direction resets both."""
        try:
            while data := src.recv(self.BUFSIZE):
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            self._forget(src, dst, reset=True)
            return
        with self._lock:
            open_directions[0] -= 1
            last = open_directions[0] == 0
        if last:
            self._forget(src, dst, reset=False)

    def _forget(self, *socks: socket.socket, reset: bool) -> None:
        with self._lock:
            self._conns.difference_update(socks)
        for sock in socks:
            if reset:
                _reset(sock)
            else:
                sock.close()


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


def make_bucket(endpoint_url: str, name: str) -> str:
    """Create bucket ``name`` on the server at ``endpoint_url``; returns ``name``."""
    import boto3

    client = boto3.client(
        "s3", endpoint_url=endpoint_url, region_name=REGION,
        aws_access_key_id=TEST_KEY, aws_secret_access_key=TEST_SECRET,
    )
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
