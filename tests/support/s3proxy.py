"""A TCP proxy on loopback that breaks the link to a server on command (for the S3 tests).

:class:`LoopbackProxy` forwards TCP from 127.0.0.1:<free port> to a target, a thread per direction of
each connection (daemon threads, blocking sockets, no polling). ``drop()`` resets every open
connection and refuses new ones (connection refused, at once) until ``restore()``, which listens
again on the same port; ``close()`` ends it all. The ``mode`` attribute says what it does to traffic:
"forward", "drop", or a fault for the fault tests (tests/reliability): "slow" (``slow(ms)``: every
chunk held), "error" (``error(count, 500|501|503)``: requests answered with S3 XML errors; 501, a
store without a feature), "truncate" (``truncate(count)``: response bodies cut short); ``forward()``
ends those. The proxy frames HTTP/1.1
messages (:mod:`tests.support.http_framing`) to apply them per request and response, and copies
anything else as it is. Nothing here touches the network beyond 127.0.0.1.
"""

from __future__ import annotations

import http.client
import re
import socket
import struct
import threading
import time
from collections import Counter, deque

from tests.support.http_framing import NotHttp, Reader, body_length, forward_body, request_line
from tests.support.launch import HOST
from tests.support.s3server import s3_storage_options

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
    * ``"hold"`` (:meth:`hold`): connections are accepted but no request goes on (a server that does
      not answer: a host gone from the network) until :meth:`forward` or :meth:`close` lets them go.
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
        self._released = threading.Event()  # cleared while holding requests
        self._released.set()
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

    def hold(self) -> None:
        """Forward no request until :meth:`forward` (or :meth:`close`): each one waits, unanswered."""
        with self._lock:
            self._require_listening()
            self.mode = "hold"
            self._released.clear()

    def error(self, count: int = 1, status: int = 500, *, match: str | None = None) -> None:
        """Answer the next ``count`` requests with the S3 error of ``status`` (500 InternalError,
        501 NotImplemented, 503 SlowDown) without forwarding them; forwarding resumes after them. ``match``: only
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
            self._released.set()

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
            self._released.set()
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
        self._released.set()  # held requests go on, to the reset sockets
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
        reader = Reader(src, self.BUFSIZE)
        try:
            if src is conn.client:
                self._requests(reader, dst, conn)
            else:
                self._responses(reader, dst, conn)
            if not conn.ending:
                dst.shutdown(socket.SHUT_WR)
        except NotHttp:
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

    def _copy_raw(self, reader: Reader, dst: socket.socket) -> bool:
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

    def _requests(self, reader: Reader, upstream: socket.socket, conn: "_Connection") -> None:
        while (head := reader.head(self.MAX_HEAD)) is not None:
            method, _, headers = reader.parse(head)
            target = request_line(head)
            status = self._request_fault(target)
            if status is not None:
                self._answer(reader, conn, method, status)
                return
            self._released.wait()  # held (hold()) until forward() or close()
            with self._lock:
                conn.methods.append((method, target))
            self._send(upstream, head)
            forward_body(reader, self._send, upstream, headers, until_eof=False, max_line=self.MAX_HEAD)

    def _responses(self, reader: Reader, client: socket.socket, conn: "_Connection") -> None:
        while (head := reader.head(self.MAX_HEAD)) is not None:
            _, status, headers = reader.parse(head)
            if 100 <= status < 200:  # an interim response (100 Continue): the request is still on
                self._send(client, head)
                continue
            with self._lock:
                method, target = conn.methods.popleft() if conn.methods else ("GET", "")
            length = body_length(method, status, headers)
            keep = self._response_cut(target) if length != 0 else None
            if keep is None:
                self._send(client, head)
                forward_body(reader, self._send, client, headers, until_eof=length is None and "chunked" not in
                             headers.get("transfer-encoding", ""), length=length, max_line=self.MAX_HEAD)
                continue
            # the response, cut: its head and part of the body, then the connection ends
            total = length if length is not None else self.BUFSIZE
            self._send(client, head)
            reader.forward(self._send, client, int(total * keep))
            conn.ending = True
            _quietly(client.shutdown, socket.SHUT_RDWR)
            _quietly(conn.upstream.shutdown, socket.SHUT_RDWR)
            return

    def _answer(self, reader: Reader, conn: "_Connection", method: str, status: int) -> None:
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
    501: ("NotImplemented", "A header you provided implies functionality that is not implemented."),
    503: ("SlowDown", "Please reduce your request rate."),
}


class _Connection:
    """One proxied connection: its sockets, the methods of requests awaiting their responses, how
    many directions are still open, and whether the proxy itself is ending it."""

    def __init__(self, client: socket.socket, upstream: socket.socket):
        self.client, self.upstream = client, upstream
        self.methods: deque[tuple[str, str]] = deque()  # (method, request line) of each request
        self.open = 2
        self.ending = False


def _matches(pattern: str | None, line: str) -> bool:
    return pattern is None or re.search(pattern, line) is not None


def _quietly(call, *args) -> None:
    try:
        call(*args)
    except OSError:
        pass
