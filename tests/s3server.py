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
  ``mode`` attribute says what it does to traffic: "forward", "drop", or a fault for the fault
  tests (tests/reliability): "slow" (``slow(ms)``: every chunk held), "error" (``error(count, 500|503)``:
  requests answered with S3 XML errors), "truncate" (``truncate(count)``: response bodies cut
  short); ``forward()`` ends those. The proxy frames HTTP/1.1 messages to apply them per request
  and response, and copies anything else as it is.
* Helpers: :func:`make_bucket`, :func:`s3_storage_options` (fsspec/s3fs options, configured to
  fail fast), :func:`aws_env` (the standard AWS environment variables). Every credential is the
  dummy pair :data:`TEST_KEY` / :data:`TEST_SECRET`, distinctive so that tests can assert it never
  lands in a written file or a log line.

Nothing here touches the network beyond 127.0.0.1.
"""

from __future__ import annotations

import http.client
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import Counter, deque
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

    ``mode`` says what it does to traffic:

    * ``"forward"``: bytes pass unchanged (HTTP/1.1 requests and responses are framed on the way, to
      count them and to find where a fault applies; traffic that is not HTTP is copied as it is).
    * ``"drop"`` (:meth:`drop`): nothing listens on the port, so a new connection is refused at once
      (the client fails fast rather than waiting on a timeout); the port stays reserved by a bound,
      non-listening socket, so :meth:`restore` gets it back.
    * ``"slow"`` (:meth:`slow`): every chunk forwarded, either way, is held ``delay_ms`` first.
    * ``"error"`` (:meth:`error`): the next ``count`` requests (optionally only those matching a
      regular expression) are answered by the proxy itself with an S3-style XML error (500
      InternalError, 503 SlowDown), ``Connection: close``, without reaching the server; then
      forwarding resumes by itself.
    * ``"truncate"`` (:meth:`truncate`): the next ``count`` responses that have a body are forwarded
      with only part of it (``keep`` of its bytes), then the connection is closed; then forwarding
      resumes by itself.

    :meth:`forward` clears slow/error/truncate (not a drop: :meth:`restore` ends that). Counters:
    ``requests`` (HTTP requests seen), ``injected`` (faults applied, by kind).
    Bounded: a request or response head is at most :data:`MAX_HEAD` bytes (else the connection is
    copied raw), an answered connection is drained for at most :data:`DRAIN_SECONDS`.
    """

    BUFSIZE = 64 * 1024
    MAX_HEAD = 64 * 1024
    DRAIN_SECONDS = 2.0

    def __init__(self, target_host: str, target_port: int, connect_timeout: float = 5.0):
        self.target = (target_host, target_port)
        self.connect_timeout = connect_timeout
        self.mode = "forward"
        self.delay_ms = 0.0
        self.requests = 0
        self.injected: Counter = Counter()
        self._errors: tuple[int, int] = (0, 500)  # (requests still to answer, status)
        self._truncate: tuple[int, float] = (0, 0.5)  # (responses still to cut, share of the body kept)
        self._match: str | None = None  # errors/truncation only for request lines matching this regex
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

    # -- faults ------------------------------------------------------------------------------------
    def slow(self, delay_ms: float) -> None:
        """Hold every forwarded chunk (both directions) ``delay_ms`` milliseconds."""
        with self._lock:
            self._require_listening()
            self.mode, self.delay_ms = "slow", max(0.0, float(delay_ms))

    def error(self, count: int = 1, status: int = 500, *, match: str | None = None) -> None:
        """Answer the next ``count`` requests with the S3 error of ``status`` (500 InternalError,
        503 SlowDown) without forwarding them; forwarding resumes after them. ``match``: only
        requests whose request line (``PUT /bucket/key HTTP/1.1``) this regular expression is
        found in are answered (and counted)."""
        if status not in S3_ERRORS:
            raise ValueError(f"no S3 error body for status {status}; one of {sorted(S3_ERRORS)}")
        with self._lock:
            self._require_listening()
            self.mode, self._errors, self._match = "error", (max(0, int(count)), status), match

    def truncate(self, count: int = 1, keep: float = 0.5, *, match: str | None = None) -> None:
        """Cut the next ``count`` responses that have a body after ``keep`` (0..1) of it and close
        the connection; forwarding resumes after them. ``match``: as for :meth:`error`, on the
        request the response answers."""
        with self._lock:
            self._require_listening()
            self.mode, self._match = "truncate", match
            self._truncate = (max(0, int(count)), min(max(float(keep), 0.0), 1.0))

    def forward(self) -> None:
        """Stop slowing, answering errors and truncating (a drop is ended by :meth:`restore`)."""
        with self._lock:
            if self.mode != "drop":
                self.mode = "forward"
            self.delay_ms, self._errors, self._truncate, self._match = 0.0, (0, 500), (0, 0.5), None

    def _require_listening(self) -> None:
        if self._closed or self.mode == "drop":
            raise RuntimeError("LoopbackProxy is dropping or closed; restore() first")

    def _request_fault(self, target: str) -> int | None:
        """Count one request; the status to answer it with when an error is due."""
        with self._lock:
            self.requests += 1
            left, status = self._errors
            if self.mode != "error" or left <= 0 or not _matches(self._match, target):
                return None
            left -= 1
            self._errors = (left, status)
            if left == 0:
                self.mode = "forward"
            self.injected[f"error {status}"] += 1
            return status

    def _response_cut(self, target: str) -> float | None:
        """The share of a response body to keep when a truncation is due."""
        with self._lock:
            left, keep = self._truncate
            if self.mode != "truncate" or left <= 0 or not _matches(self._match, target):
                return None
            left -= 1
            self._truncate = (left, keep)
            if left == 0:
                self.mode = "forward"
            self.injected["truncate"] += 1
            return keep

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
        """Listen and forward again, on the same port (also ends slow/error/truncate)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("LoopbackProxy is closed")
            self.delay_ms, self._errors, self._truncate, self._match = 0.0, (0, 500), (0, 0.5), None
            if self._listener is not None:
                self.mode = "forward"
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

    # -- connections -------------------------------------------------------------------------------
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
            if self.mode != "drop" and not self._closed:
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
        conn = _Connection(client, upstream)
        threading.Thread(target=self._pump, args=(upstream, client, conn), daemon=True).start()
        self._pump(client, upstream, conn)

    def _pump(self, src: socket.socket, dst: socket.socket, conn: "_Connection") -> None:
        """One direction of a connection: HTTP messages framed (requests from the client, responses
        from the server) so faults apply per message, then the EOF passed on (half-close); the last
        direction to end closes both sockets. An error in either direction resets both, unless the
        proxy itself is ending the connection (an answered error, a cut response)."""
        reader = _Reader(src, self.BUFSIZE)
        try:
            if src is conn.client:
                self._requests(reader, dst, conn)
            else:
                self._responses(reader, dst, conn)
            if not conn.ending:
                dst.shutdown(socket.SHUT_WR)
        except _NotHttp:
            if not (conn.ending or self._copy_raw(reader, dst)):
                self._forget(src, dst, reset=True)
                return
        except Exception:  # OSError: the link broke (or a drop); anything else: reset rather than hang
            if not conn.ending:
                self._forget(src, dst, reset=True)
                return
        with self._lock:
            conn.open -= 1
            last = conn.open == 0
        if last:
            self._forget(src, dst, reset=False)

    def _copy_raw(self, reader: "_Reader", dst: socket.socket) -> bool:
        """Traffic that is not HTTP: copied as it is until EOF; False on a socket error."""
        try:
            data = reader.take_buffer()
            while data:
                self._send(dst, data)
                data = reader.sock.recv(self.BUFSIZE)
            dst.shutdown(socket.SHUT_WR)
            return True
        except OSError:
            return False

    def _send(self, dst: socket.socket, data) -> None:
        if self.mode == "slow" and self.delay_ms:
            time.sleep(self.delay_ms / 1000)
        dst.sendall(data)

    def _requests(self, reader: "_Reader", upstream: socket.socket, conn: "_Connection") -> None:
        while (head := reader.head(self.MAX_HEAD)) is not None:
            method, _, headers = reader.parse(head)
            target = _target(head)
            status = self._request_fault(target)
            if status is not None:
                self._answer(reader, conn, method, status)
                return
            with self._lock:
                conn.methods.append((method, target))
            self._send(upstream, head)
            self._body(reader, upstream, headers, until_eof=False)

    def _responses(self, reader: "_Reader", client: socket.socket, conn: "_Connection") -> None:
        while (head := reader.head(self.MAX_HEAD)) is not None:
            _, status, headers = reader.parse(head)
            if 100 <= status < 200:  # an interim response (100 Continue): the request is still on
                self._send(client, head)
                continue
            with self._lock:
                method, target = conn.methods.popleft() if conn.methods else ("GET", "")
            length = _body_length(method, status, headers)
            keep = self._response_cut(target) if length != 0 else None
            if keep is None:
                self._send(client, head)
                self._body(reader, client, headers, until_eof=length is None and "chunked" not in
                           headers.get("transfer-encoding", ""), length=length)
                continue
            # the response, cut: its head and part of the body, then the connection ends
            total = length if length is not None else self.BUFSIZE
            self._send(client, head)
            reader.forward(self, client, int(total * keep))
            conn.ending = True
            _quietly(client.shutdown, socket.SHUT_RDWR)
            _quietly(conn.upstream.shutdown, socket.SHUT_RDWR)
            return

    def _body(self, reader: "_Reader", dst: socket.socket, headers: dict, *, until_eof: bool,
              length: int | None = None) -> None:
        if "chunked" in headers.get("transfer-encoding", ""):
            while True:
                line = reader.line(self.MAX_HEAD)
                self._send(dst, line)
                try:
                    size = int(line.split(b";", 1)[0].strip() or b"0", 16)
                except ValueError:
                    raise _NotHttp("bad chunk size") from None
                if size == 0:
                    while (trailer := reader.line(self.MAX_HEAD)) not in (b"\r\n", b"\n"):
                        self._send(dst, trailer)
                    self._send(dst, trailer)
                    return
                reader.forward(self, dst, size)
                self._send(dst, reader.line(self.MAX_HEAD))
        if until_eof:
            reader.forward(self, dst, None)
            return
        if length is None:
            length = _content_length(headers)
        reader.forward(self, dst, length)

    def _answer(self, reader: "_Reader", conn: "_Connection", method: str, status: int) -> None:
        """Answer a request with an S3 error and end the connection gracefully (the error must reach
        the client whole: no reset)."""
        code, message = S3_ERRORS[status]
        body = b"" if method == "HEAD" else (
            f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
            f"<RequestId>proxy{self.requests:08d}</RequestId><HostId>loopback-proxy</HostId></Error>").encode()
        head = (f"HTTP/1.1 {status} {http.client.responses.get(status, 'Error')}\r\n"
                f"Content-Type: application/xml\r\nContent-Length: {len(body)}\r\n"
                f"x-amz-request-id: proxy{self.requests:08d}\r\nConnection: close\r\n\r\n").encode()
        conn.ending = True
        _quietly(conn.upstream.shutdown, socket.SHUT_RDWR)  # the response pump ends without a word
        conn.client.sendall(head + body)
        _quietly(conn.client.shutdown, socket.SHUT_WR)
        conn.client.settimeout(self.DRAIN_SECONDS)  # drain what the client still sends (its body), bounded
        deadline = time.monotonic() + self.DRAIN_SECONDS
        try:
            while time.monotonic() < deadline and conn.client.recv(self.BUFSIZE):
                pass
        except OSError:
            pass

    def _forget(self, *socks: socket.socket, reset: bool) -> None:
        with self._lock:
            self._conns.difference_update(socks)
        for sock in socks:
            if reset:
                _reset(sock)
            else:
                sock.close()


# The S3 error a proxy answers with, by status: (Code, Message) as S3 writes them.
S3_ERRORS = {
    500: ("InternalError", "We encountered an internal error. Please try again."),
    503: ("SlowDown", "Please reduce your request rate."),
}


class _NotHttp(Exception):
    """The bytes on a connection are not HTTP/1.x framing the proxy understands."""


class _Connection:
    """One proxied connection: its sockets, the methods of requests awaiting their responses, how
    many directions are still open, and whether the proxy itself is ending it."""

    def __init__(self, client: socket.socket, upstream: socket.socket):
        self.client, self.upstream = client, upstream
        self.methods: deque[tuple[str, str]] = deque()  # (method, request line) of each request
        self.open = 2
        self.ending = False


class _Reader:
    """Buffered reads from one socket: heads, lines and counted bodies."""

    def __init__(self, sock: socket.socket, bufsize: int):
        self.sock, self.bufsize, self.buffer = sock, bufsize, b""

    def _fill(self) -> bool:
        data = self.sock.recv(self.bufsize)
        self.buffer += data
        return bool(data)

    def take_buffer(self) -> bytes:
        data, self.buffer = self.buffer, b""
        return data

    def parse(self, head: bytes) -> tuple[str, int, dict[str, str]]:
        """:func:`_parse_head`; a head that is not HTTP goes back into the buffer (copied raw)."""
        try:
            return _parse_head(head)
        except _NotHttp:
            self.buffer = head + self.buffer
            raise

    def head(self, limit: int) -> bytes | None:
        """The next message head (through the blank line); None at a clean EOF between messages."""
        while (end := self.buffer.find(b"\r\n\r\n")) < 0:
            if len(self.buffer) > limit:
                raise _NotHttp("head too long")
            if not self._fill():
                if self.buffer:
                    raise _NotHttp("EOF inside a head")
                return None
        head, self.buffer = self.buffer[: end + 4], self.buffer[end + 4 :]
        return head

    def line(self, limit: int) -> bytes:
        while (end := self.buffer.find(b"\n")) < 0:
            if len(self.buffer) > limit or not self._fill():
                raise _NotHttp("bad chunk framing")
        line, self.buffer = self.buffer[: end + 1], self.buffer[end + 1 :]
        return line

    def forward(self, proxy: LoopbackProxy, dst: socket.socket, count: int | None) -> None:
        """Send the next ``count`` bytes (None: everything until EOF) to ``dst``."""
        while count is None or count > 0:
            if not self.buffer and not self._fill():
                if count is None:
                    return
                raise OSError("EOF inside a body")
            take = len(self.buffer) if count is None else min(count, len(self.buffer))
            piece, self.buffer = self.buffer[:take], self.buffer[take:]
            proxy._send(dst, piece)
            if count is not None:
                count -= take


def _parse_head(head: bytes) -> tuple[str, int, dict[str, str]]:
    """(method, status, headers) of a request or response head (method "" for a response, status 0
    for a request); header names lower-case."""
    try:
        lines = head.decode("latin-1").split("\r\n")
        first = lines[0].split(" ", 2)
        headers = {}
        for line in lines[1:]:
            if line:
                name, value = line.split(":", 1)
                headers[name.strip().lower()] = value.strip().lower() if name.strip().lower() == \
                    "transfer-encoding" else value.strip()
        if first[0].startswith("HTTP/"):
            return "", int(first[1]), headers
        if len(first) == 3 and first[2].startswith("HTTP/"):
            return first[0].upper(), 0, headers
    except (ValueError, IndexError):
        pass
    raise _NotHttp("not an HTTP/1.x head")


def _target(head: bytes) -> str:
    """The request line of a request head: ``METHOD target HTTP/1.1``."""
    return head.split(b"\r\n", 1)[0].decode("latin-1")


def _matches(pattern: str | None, request_line: str) -> bool:
    return pattern is None or re.search(pattern, request_line) is not None


def _body_length(method: str, status: int, headers: dict) -> int | None:
    """Bytes of a response body: 0 when it has none, None when it is chunked or runs to EOF."""
    if method == "HEAD" or status in (204, 304):
        return 0
    if "chunked" in headers.get("transfer-encoding", ""):
        return None
    if "content-length" in headers:
        return _content_length(headers)
    return None


def _content_length(headers: dict) -> int:
    try:
        length = int(headers.get("content-length", "0") or 0)
    except ValueError:
        raise _NotHttp("bad Content-Length") from None
    if length < 0:
        raise _NotHttp("bad Content-Length")
    return length


def _quietly(call, *args) -> None:
    try:
        call(*args)
    except OSError:
        pass


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
