"""The fault injectors themselves (tests/support/faults.py, the loopback proxy's fault modes): they do what
the fault tests rely on, and nothing else."""

from __future__ import annotations

import errno
import http.client
import socket
import threading
import time

import pytest
import s3fs

from ckpt.storage import LocalStorage, locate, wrapped, wrappers
from tests.support.faults import FaultyStorage, install_faulty
from tests.support.s3proxy import LoopbackProxy
from tests.support.s3server import s3_client


# -- FaultyStorage ------------------------------------------------------------------------------

def test_disk_full_writes_what_fits_then_enospc_and_gives_space_back(tmp_path):
    faulty = FaultyStorage(LocalStorage(), tmp_path / "disk")
    faulty.makedirs(str(tmp_path / "disk"))
    faulty.disk_full(after=10, capacity=True)
    handle = faulty.create(str(tmp_path / "disk" / "a"))
    handle.write(b"12345678")
    with pytest.raises(OSError) as info:
        handle.write(b"abcd")
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(tmp_path / "disk" / "a")
    handle.abort()  # the file goes, and its 10 bytes come back
    faulty.write_bytes(str(tmp_path / "disk" / "b"), b"0123456789")
    with pytest.raises(OSError, match="No space left"):
        faulty.write_bytes(str(tmp_path / "disk" / "c"), b"x")
    assert (tmp_path / "disk" / "c").read_bytes() == b""  # a short write, as on a real full disk
    assert faulty.injected == {"disk full": 2}
    faulty.write_bytes(str(tmp_path / "elsewhere"), b"outside its root: never affected")
    faulty.restore()
    faulty.write_bytes(str(tmp_path / "disk" / "c"), b"room again")


def test_deny_and_vanish(tmp_path):
    root = tmp_path / "mnt"
    faulty = FaultyStorage(LocalStorage(), root)
    faulty.deny("rename")
    faulty.makedirs(str(root / "d"))
    with pytest.raises(PermissionError):
        faulty.rename(str(root / "d"), str(root / "e"))
    faulty.restore()
    faulty.vanish(after=3)
    handle = faulty.create(str(root / "d" / "f"))
    with pytest.raises(FileNotFoundError):
        handle.write(b"12345")
    with pytest.raises(FileNotFoundError):
        handle.abort()  # the unlink cannot reach the file: it stays, as on a real mount
    for call in (lambda: faulty.list(str(root)), lambda: faulty.is_dir(str(root)), lambda: faulty.lock(
            str(root / ".lock"), holder="x")):
        with pytest.raises(FileNotFoundError):
            call()
    faulty.restore()
    assert (root / "d" / "f").read_bytes() == b"123"
    faulty.vanish(errno.EIO)
    with pytest.raises(OSError) as info:
        faulty.list(str(root))
    assert info.value.errno == errno.EIO


def test_install_routes_only_its_roots_and_is_undone(tmp_path):
    before = locate(tmp_path / "a").storage
    with pytest.MonkeyPatch.context() as mp:
        a, b = install_faulty(mp, tmp_path / "a", tmp_path / "b")
        a.vanish()
        with pytest.raises(FileNotFoundError):
            locate(tmp_path / "a" / "x").is_dir()
        assert locate(tmp_path / "b" / "x").is_dir() is False and locate(tmp_path / "c").exists() is False
        assert str(locate(tmp_path / "a")) == str(tmp_path / "a")  # displayed as before
    assert locate(tmp_path / "a").storage is before


def test_wrapped_sends_a_scheme_through_its_wrapper_inside_the_block_only(tmp_path):
    local = locate(tmp_path).storage
    outer, inner = FaultyStorage(local, tmp_path / "w"), FaultyStorage(local, tmp_path / "w")
    with wrapped("file", lambda storage: outer):
        assert locate(tmp_path / "w" / "x").storage is outer and locate(f"file://{tmp_path}").storage is outer
        with wrapped("file", lambda storage: inner):  # nested: the innermost wins, the outer comes back
            inner.vanish()
            with pytest.raises(FileNotFoundError):
                locate(tmp_path / "w").is_dir()
        assert locate(tmp_path / "w").storage is outer and locate(tmp_path / "w").is_dir() is False
    assert locate(tmp_path / "w").storage is local and "file" not in wrappers


# -- the proxy's fault modes ----------------------------------------------------------------------

def _fs(proxy: LoopbackProxy) -> s3fs.S3FileSystem:
    return s3fs.S3FileSystem(skip_instance_cache=True, **proxy.storage_options)


def _raw(proxy: LoopbackProxy) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)


def test_error_mode_answers_s3_xml_then_forwards_again(s3_bucket, s3_proxy):
    fs = _fs(s3_proxy)
    fs.pipe_file(f"{s3_bucket.name}/k", b"v")
    s3_proxy.error(2, 503)
    conn = _raw(s3_proxy)
    conn.request("GET", f"/{s3_bucket.name}/k")
    answer = conn.getresponse()
    assert answer.status == 503 and answer.getheader("Connection") == "close"
    assert b"<Code>SlowDown</Code>" in answer.read()
    conn.close()
    conn = _raw(s3_proxy)
    conn.request("HEAD", f"/{s3_bucket.name}/k")
    answer = conn.getresponse()
    assert answer.status == 503 and answer.read() == b""  # a HEAD's answer has no body
    conn.close()
    assert s3_proxy.mode == "forward" and s3_proxy.injected == {"error 503": 2}
    assert fs.cat_file(f"{s3_bucket.name}/k") == b"v"
    s3_proxy.error(1, 500, match=r"^GET \S*/other")  # only matching requests are answered
    assert fs.cat_file(f"{s3_bucket.name}/k") == b"v" and s3_proxy.mode == "error"
    s3_proxy.forward()
    assert s3_proxy.mode == "forward"


def _presigned_get(proxy: LoopbackProxy, bucket: str, key: str) -> str:
    """The path and query of a signed GET through the proxy (moto refuses unsigned requests)."""
    client = s3_client(proxy.endpoint_url)
    try:
        url = client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": key})
    finally:
        client.close()
    return url.split(str(proxy.port), 1)[1]


def test_truncate_mode_cuts_a_body_and_closes(s3_bucket, s3_proxy):
    _fs(s3_proxy).pipe_file(f"{s3_bucket.name}/big", b"x" * 100_000)
    target = _presigned_get(s3_proxy, s3_bucket.name, "big")
    s3_proxy.truncate(1, keep=0.25)
    conn = _raw(s3_proxy)
    conn.request("GET", target)
    answer = conn.getresponse()
    assert answer.status == 200
    with pytest.raises(http.client.IncompleteRead) as info:
        answer.read()
    assert len(info.value.partial) == 25_000
    conn.close()
    assert s3_proxy.mode == "forward" and s3_proxy.injected == {"truncate": 1}
    conn = _raw(s3_proxy)
    conn.request("GET", target)
    assert len(conn.getresponse().read()) == 100_000
    conn.close()


def test_slow_mode_delays_each_chunk(s3_bucket, s3_proxy):
    fs = _fs(s3_proxy)
    fs.pipe_file(f"{s3_bucket.name}/s", b"s")
    started = time.monotonic()
    fs.cat_file(f"{s3_bucket.name}/s")
    fast = time.monotonic() - started
    s3_proxy.slow(100)
    started = time.monotonic()
    assert fs.cat_file(f"{s3_bucket.name}/s") == b"s"
    assert time.monotonic() - started >= 0.2 + fast / 2  # a request and its response: two chunks or more
    s3_proxy.forward()


def test_traffic_that_is_not_http_is_copied_as_it_is():
    server = socket.create_server(("127.0.0.1", 0))

    def echo():
        peer, _ = server.accept()
        with peer:
            data = b""
            while chunk := peer.recv(65536):
                data += chunk
            peer.sendall(data[::-1])

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    with LoopbackProxy("127.0.0.1", server.getsockname()[1]) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as conn:
            conn.sendall(b"\x00\x01 not http \xff")
            conn.shutdown(socket.SHUT_WR)
            got = b""
            while chunk := conn.recv(65536):
                got += chunk
    assert got == b"\xff ptth ton \x01\x00"
    thread.join(5)
    server.close()
