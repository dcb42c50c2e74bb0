"""Fixtures shared by every test directory: one torch thread a process; a real S3-protocol server
(moto) on loopback; the checkout's modules compiled once per session (``pytest_sessionstart``);
the order and the hand-out of tests to pytest-xdist's workers (``-n auto``, the README's command:
slow tests first, a file with a shared fixture to one worker whole).

* ``one_torch_thread`` (autouse): every test runs torch on one intra-op thread, in pytest's process
  (``torch.set_num_threads(1)``: the trainer's in-process runs) and in the processes it starts
  (``OMP_NUM_THREADS=1``, which ``python -m trainer.train`` honours, trainer.threads). A test shares
  the box's cores with the processes it starts (ranks, tools, the S3 server) and, on CI, with other
  jobs: OpenMP's threads wait for each other at every parallel region, so a team as large as the
  box runs at the pace of a core the kernel gives elsewhere. Measured on the 2-core box at a load of
  3-5: the in-process trainer runs of tests/trainer/test_exits.py and test_train.py took half the
  CPU time and less wall time on one thread than on torch's default of one per core.

* ``s3_server`` (session): a :class:`tests.support.s3server.MotoServer`, started the first time a test asks
  for it and stopped at the end of the session. If it cannot start the test errors (no skip:
  CI installs ``moto[server]``); its log is in the session's basetemp, ``moto/server.log``.
* ``s3_bucket`` (function): a fresh, uniquely named, empty bucket, a
  :class:`tests.support.s3server.S3Bucket` (``.name``, ``.url``, ``.endpoint_url``, ``.storage_options``).
* ``s3_proxy`` (function): a :class:`tests.s3proxy.LoopbackProxy` in front of ``s3_server``
  (``.drop()``, ``.restore()``, ``.endpoint_url``, ``.storage_options``); closed at teardown.
* ``aws_env`` (function): the standard variables AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID,
  AWS_SECRET_ACCESS_KEY and AWS_DEFAULT_REGION point at ``s3_server`` (other AWS variables and
  the user's ~/.aws files are hidden); returns them as a dict.

s3fs caches filesystem instances (fsspec's instance cache, keyed on the constructor's arguments),
so an instance made before the environment or the endpoint changed would be reused. Tests that
rely on the environment should build ``s3fs.S3FileSystem(skip_instance_cache=True)`` or call
``s3fs.S3FileSystem.clear_instance_cache()``; every fixture here clears that cache at setup and
teardown.
"""

from __future__ import annotations

import functools
import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import REPO, s3proxy, s3server


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hooks (the dev extra)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (the README's test command): one worker per core this process may use, at most 4.
    Most tests run on one core (one torch thread; their ranks and tools wait on each other), so a
    second worker nearly halves the 2-core box's wall time; more than 4 would only multiply the
    rank processes that the multi-rank tests start."""
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slow tests first, each group in its order: under pytest-xdist the long ones then start
    early instead of leaving one worker busy at the end (harmless without it)."""
    items[:] = [item for item in items if item.get_closest_marker("slow")] + \
               [item for item in items if not item.get_closest_marker("slow")]


_SHARED_SCOPES = re.compile(r"""scope\s*=\s*["'](module|class|package)["']""")


@functools.cache
def _shares_fixtures(test_file: str) -> bool:
    """Whether a test file defines, or sits below a conftest.py that defines, a fixture shared by
    several tests (module, class or package scope)."""
    path = REPO / test_file
    sources = [path, *(parent / "conftest.py" for parent in path.parents if parent.is_relative_to(REPO / "tests"))]
    return any(source.is_file() and _SHARED_SCOPES.search(source.read_text()) for source in sources)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist`` for ``-n``: tests are handed out one by one (the ordering above keeps the long ones
    first), except that a file with a shared fixture goes to one worker whole, so that the fixture
    (a trained run, a saved root, a module's server) is built once, not once per worker. (xdist's
    ``loadgroup`` would say the same with marks, but its marks do not reach pytest 9.2's node ids.)"""
    from xdist.scheduler import LoadScopeScheduling

    class SharedFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            test_file = nodeid.split("::", 1)[0]
            return test_file if _shares_fixtures(test_file) else nodeid

    return SharedFixtureScheduling(config, log)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile this checkout's modules to bytecode once, before any test. The suite starts a few
    hundred Python processes (torchrun ranks, the command-line tools); where the environment sets
    PYTHONDONTWRITEBYTECODE (which stops the writing of ``__pycache__``, not its reading), each of
    them would otherwise compile every module of ours it imports again, ~0.4 s a process here."""
    import compileall

    for package in ("ckpt", "trainer", "tools", "tests", "benchmarks"):
        compileall.compile_dir(REPO / package, quiet=1)


@pytest.fixture(autouse=True)
def one_torch_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    if torch.get_num_threads() != 1:  # a test's in-process trainer.train.main() may have set more
        torch.set_num_threads(1)


def _clear_s3fs_cache() -> None:
    try:
        import s3fs
    except ImportError:
        return
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[s3server.MotoServer]:
    with pytest.MonkeyPatch.context() as mp:
        # An HTTP(S)_PROXY in the environment must not capture loopback requests.
        for var in ("NO_PROXY", "no_proxy"):
            mp.setenv(var, ",".join(filter(None, [os.environ.get(var), "127.0.0.1", "localhost"])))
        server = s3server.MotoServer(log_path=tmp_path_factory.mktemp("moto") / "server.log")
        server.start()
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture
def s3_bucket(s3_server: s3server.MotoServer) -> Iterator[s3server.S3Bucket]:
    _clear_s3fs_cache()
    name = s3server.make_bucket(s3_server.endpoint_url, f"ckpt-test-{uuid.uuid4().hex[:16]}")
    yield s3server.S3Bucket(name, s3_server.endpoint_url)
    _clear_s3fs_cache()


@pytest.fixture
def s3_proxy(s3_server: s3server.MotoServer) -> Iterator[s3proxy.LoopbackProxy]:
    _clear_s3fs_cache()
    proxy = s3proxy.LoopbackProxy.to(s3_server.endpoint_url)
    try:
        yield proxy
    finally:
        proxy.close()
        _clear_s3fs_cache()


_HIDDEN_AWS_VARS = (
    "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
    "AWS_REGION", "AWS_ENDPOINT_URL_S3", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS",
)


@pytest.fixture
def aws_env(
    s3_server: s3server.MotoServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[dict[str, str]]:
    env = s3server.aws_env(s3_server.endpoint_url)
    for var in _HIDDEN_AWS_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    _clear_s3fs_cache()
    yield env
    _clear_s3fs_cache()
