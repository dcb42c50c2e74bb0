"""Fuzzing the catalog (issue 22): random byte damage, overwritten runs, truncations and appends to
``data.mdb`` and ``lock.mdb`` of a replicated run's catalog (scripts/corruption_campaign.py's run).

Each damaged copy is opened in a forked child (a SIGBUS or a hang there is the finding, and must not
end the test run): a plain read-only :class:`~ckpt.root.catalog.store.Catalog` listing raises only
:class:`ckpt.CheckpointError` or returns a listing; ``ckpt-inspect ROOT --catalog COPY`` exits 0;
:func:`~ckpt.root.catalog.store.open_catalog` with the run's mounts never raises and lists exactly what the
undamaged catalog listed (damage is discarded and rebuilt from the manifests, never served).

Sizes: ``CKPT_FUZZ_EXAMPLES`` scales the number of examples (default 150 -> 60 here);
``CKPT_FUZZ_RANDOM=1`` draws fresh examples.
"""

from __future__ import annotations

import importlib.util
import io
import logging
import os
import shutil
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckpt.errors import CheckpointError
from ckpt.root.catalog.store import Catalog, open_catalog
from ckpt.storage import locate
from tests.support import REPO

spec = importlib.util.spec_from_file_location("corruption_campaign", REPO / "scripts" / "corruption_campaign.py")
campaign = importlib.util.module_from_spec(spec)
sys.modules.setdefault("corruption_campaign", campaign)
spec.loader.exec_module(campaign)

EXAMPLES = max(10, int(os.environ.get("CKPT_FUZZ_EXAMPLES", "150")) * 2 // 5)
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                derandomize=os.environ.get("CKPT_FUZZ_RANDOM") != "1",
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
TIMEOUT = 60.0
# the child's findings (exit codes); 0: all held
FINDINGS = {1: "a plain read raised something else than CheckpointError", 2: "open_catalog raised",
            3: "open_catalog served a listing other than the truth", 4: "ckpt-inspect did not exit 0",
            99: "the child failed to run its checks"}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    work = tmp_path_factory.mktemp("catalog-fuzz") / "run"
    with campaign.captured_logs():
        campaign.build_run(work)
    catalog = work / "primary" / ".catalog"
    return work, campaign.catalog_listing(catalog), {name: (catalog / name).read_bytes()
                                                     for name in ("data.mdb", "lock.mdb")}


damages = st.lists(st.tuples(
    st.sampled_from(["data.mdb", "data.mdb", "data.mdb", "lock.mdb"]),
    st.sampled_from(["flip", "overwrite", "zero", "truncate", "append"]),
    st.floats(0.0, 1.0, allow_nan=False),  # where, as a fraction of the file's length
    st.integers(1, 9000),  # how many bytes (overwrite, zero, append)
    st.binary(min_size=1, max_size=16),  # the bytes written (repeated)
), min_size=1, max_size=3)


def damage(raw: bytes, op: str, where: float, count: int, fill: bytes) -> bytes:
    at = min(int(where * len(raw)), max(len(raw) - 1, 0))
    data = bytearray(raw)
    if op == "flip" and data:
        data[at] ^= 1 << (count % 8)
    elif op in ("overwrite", "zero"):
        chunk = bytes(count) if op == "zero" else (fill * (count // len(fill) + 1))[:count]
        data[at:at + count] = chunk[:max(len(data) - at, 0)]
    elif op == "truncate":
        del data[at:]
    elif op == "append":
        data += (fill * (count // len(fill) + 1))[:count]
    return bytes(data)


def _child(work: Path, copy: str, expected: list) -> int:
    logging.disable(logging.CRITICAL)
    try:
        with Catalog(copy, readonly=True) as catalog:
            campaign.listing_of(catalog)
    except CheckpointError:
        pass
    except BaseException:
        return 1
    try:
        from tools import inspection
        with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
            if inspection.main([str(work / "primary"), "--catalog", copy]) != 0:
                return 4
    except BaseException:
        return 4
    try:
        with open_catalog(copy, [locate(work / "primary"), locate(work / "replica")]) as catalog:
            return 0 if campaign.listing_of(catalog) == expected else 3
    except BaseException:
        return 2


def probe(work: Path, copy: str, expected: list) -> str:
    """The child's verdict: "held", a finding, "signal N" or "hang"."""
    outcome = campaign.forked(lambda: _child(work, copy, expected), TIMEOUT)
    if isinstance(outcome, str):
        return outcome
    return "held" if outcome == 0 else FINDINGS.get(outcome, f"exit {outcome}")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the probe forks")
@pytest.mark.slow
def test_damaged_catalog_files_are_refused_or_rebuilt_never_a_crash(pristine, tmp_path):
    work, expected, files = pristine
    tried = []

    @FUZZ
    @given(damages)
    def one(ops):
        copy = tmp_path / "catalog"
        shutil.rmtree(copy, ignore_errors=True)
        copy.mkdir()
        raw = dict(files)
        for name, op, where, count, fill in ops:
            raw[name] = damage(raw[name], op, where, count, fill)
        for name, body in raw.items():
            (copy / name).write_bytes(body)
        verdict = probe(work, str(copy), expected)
        tried.append(verdict)
        assert verdict == "held", (ops, verdict)

    one()
    print(f"\ncatalog fuzz: {len(tried)} damaged catalogs, all refused or rebuilt")
    assert len(tried) >= EXAMPLES


def test_a_catalog_cut_at_every_page_boundary_is_refused_or_rebuilt(pristine, tmp_path):
    """The SIGBUS cases, exhaustively: data.mdb cut at every page (and mid-page) below its length."""
    work, expected, files = pristine
    raw = files["data.mdb"]
    cuts = sorted({n * 4096 for n in range(len(raw) // 4096)} | {n * 4096 + 100 for n in range(len(raw) // 4096)})
    for cut in cuts:
        copy = tmp_path / f"cut-{cut}"
        copy.mkdir()
        (copy / "data.mdb").write_bytes(raw[:cut])
        (copy / "lock.mdb").write_bytes(files["lock.mdb"])
        assert probe(work, str(copy), expected) == "held", cut
