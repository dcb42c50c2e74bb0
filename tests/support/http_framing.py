"""HTTP/1.1 message framing for the loopback proxy (:mod:`tests.support.s3proxy`): message heads,
chunked and counted bodies, read from one socket and forwarded through a ``send(dst, data)``
callable (the proxy's, so that its "slow" mode holds every piece). Anything that is not HTTP/1.x
framing raises :class:`NotHttp`, and the proxy then copies the connection raw.
"""

from __future__ import annotations

import socket
from typing import Callable

Send = Callable[[socket.socket, bytes], None]


class NotHttp(Exception):
    """The bytes on a connection are not HTTP/1.x framing the proxy understands."""


class Reader:
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
        """:func:`parse_head`; a head that is not HTTP goes back into the buffer (copied raw)."""
        try:
            return parse_head(head)
        except NotHttp:
            self.buffer = head + self.buffer
            raise

    def head(self, limit: int) -> bytes | None:
        """The next message head (through the blank line); None at a clean EOF between messages."""
        while (end := self.buffer.find(b"\r\n\r\n")) < 0:
            if len(self.buffer) > limit:
                raise NotHttp("head too long")
            if not self._fill():
                if self.buffer:
                    raise NotHttp("EOF inside a head")
                return None
        head, self.buffer = self.buffer[: end + 4], self.buffer[end + 4 :]
        return head

    def line(self, limit: int) -> bytes:
        while (end := self.buffer.find(b"\n")) < 0:
            if len(self.buffer) > limit or not self._fill():
                raise NotHttp("bad chunk framing")
        line, self.buffer = self.buffer[: end + 1], self.buffer[end + 1 :]
        return line

    def forward(self, send: Send, dst: socket.socket, count: int | None) -> None:
        """Send the next ``count`` bytes (None: everything until EOF) to ``dst``."""
        while count is None or count > 0:
            if not self.buffer and not self._fill():
                if count is None:
                    return
                raise OSError("EOF inside a body")
            take = len(self.buffer) if count is None else min(count, len(self.buffer))
            piece, self.buffer = self.buffer[:take], self.buffer[take:]
            send(dst, piece)
            if count is not None:
                count -= take


def parse_head(head: bytes) -> tuple[str, int, dict[str, str]]:
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
    raise NotHttp("not an HTTP/1.x head")


def request_line(head: bytes) -> str:
    """The request line of a request head: ``METHOD target HTTP/1.1``."""
    return head.split(b"\r\n", 1)[0].decode("latin-1")


def body_length(method: str, status: int, headers: dict) -> int | None:
    """Bytes of a response body: 0 when it has none, None when it is chunked or runs to EOF."""
    if method == "HEAD" or status in (204, 304):
        return 0
    if "chunked" in headers.get("transfer-encoding", ""):
        return None
    if "content-length" in headers:
        return content_length(headers)
    return None


def content_length(headers: dict) -> int:
    try:
        length = int(headers.get("content-length", "0") or 0)
    except ValueError:
        raise NotHttp("bad Content-Length") from None
    if length < 0:
        raise NotHttp("bad Content-Length")
    return length


def forward_body(reader: Reader, send: Send, dst: socket.socket, headers: dict, *, until_eof: bool,
                 length: int | None = None, max_line: int) -> None:
    """Forward one message body: chunked (each chunk line, chunk and trailer), to EOF, or ``length``
    (default: Content-Length) bytes."""
    if "chunked" in headers.get("transfer-encoding", ""):
        while True:
            line = reader.line(max_line)
            send(dst, line)
            try:
                size = int(line.split(b";", 1)[0].strip() or b"0", 16)
            except ValueError:
                raise NotHttp("bad chunk size") from None
            if size == 0:
                while (trailer := reader.line(max_line)) not in (b"\r\n", b"\n"):
                    send(dst, trailer)
                send(dst, trailer)
                return
            reader.forward(send, dst, size)
            send(dst, reader.line(max_line))
    if until_eof:
        reader.forward(send, dst, None)
        return
    if length is None:
        length = content_length(headers)
    reader.forward(send, dst, length)
