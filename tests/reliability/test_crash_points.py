"""The commit protocol proven at every crash point (issue 22, item 16b): for each of a save, an overwrite,
a delta, a replication and a retention, on a local POSIX mount and on the loopback S3 server, every
operation boundary of the recorded sequence and every state a crash there can leave (a page cache on
POSIX: what was not fsync'd, file and directory, may be lost) is checked — every listed step loads
bitwise, an overwrite leaves the old or the new copy, no replica lists a step whose data is missing,
a save that returned is durable (:mod:`tests.support.crash_sweep`). Exhaustive, not sampled.

The four mutants the mutation audit left alive (a lost fsync of the data files; the rename before the
manifest on POSIX; the manifest before the data on a replica; an overwrite's old objects deleted before
the manifest PUT on S3) each fail the sweep.

Figures: ``.venv/bin/python -m pytest -q tests/reliability/test_crash_points.py -s`` prints one line
per sweep (operations, boundaries, crash states, distinct states): docs/RELIABILITY.md quotes them.
"""

from __future__ import annotations

import pytest

from tests.support.crash_sweep import sweep
from tests.support.protocol_scenarios import MUTANTS, SCENARIOS, Where

KINDS = ("posix", "s3")


@pytest.fixture
def where(request, tmp_path):
    kind = request.param
    bucket = request.getfixturevalue("s3_bucket") if kind == "s3" else None
    return Where(kind, tmp_path, bucket)


@pytest.mark.parametrize("where", KINDS, indirect=True)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_crash_point_leaves_a_loadable_root(scenario, where, tmp_path):
    run = SCENARIOS[scenario](where)
    result = sweep(run.mounts, run.expected, tmp_path / "crash", final=run.final)
    print(f"\nSWEEP {scenario} on {where.kind}: {result.operations} operations, {result.boundaries} crash "
          f"points, {result.crash_states} crash states, {result.distinct_states} distinct")
    assert not result.violations, "\n".join(result.violations[:5])
    assert result.boundaries >= result.operations + 1  # more where a recursive delete is one per object
    for mount in run.mounts:  # nothing the engine did escaped the recording
        assert mount.replay_matches(where.bucket), mount.name


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_each_surviving_mutant_of_the_audit_fails_the_sweep(mutant, monkeypatch, tmp_path, request):
    patch, scenario, kind = MUTANTS[mutant]
    bucket = request.getfixturevalue("s3_bucket") if kind == "s3" else None
    where = Where(kind, tmp_path, bucket)
    with monkeypatch.context() as patched:
        patch(patched)
        run = SCENARIOS[scenario](where)
    result = sweep(run.mounts, run.expected, tmp_path / "crash", final=run.final, stop_at_first=True)
    print(f"\nMUTANT {mutant!r} caught: {result.violations[:1]}")
    assert result.violations, f"the sweep of {scenario} on {kind} misses the mutant {mutant!r}"
