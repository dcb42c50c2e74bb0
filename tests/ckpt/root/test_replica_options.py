"""ckpt.root.replica_options: the manager's replica settings reach the replicator as one object."""

from __future__ import annotations

import dataclasses

from ckpt.options import SaveOptions
from ckpt.root import ReplicaOptions


def test_every_replica_setting_of_the_save_options_is_carried():
    options = SaveOptions(keep=7, keep_every=50, replica_read_back=True, replica_backlog=3,
                          replica_retry_initial=0.25, replica_retry_max=9.0)
    assert ReplicaOptions.of(options) == ReplicaOptions(keep=7, keep_every=50, read_back=True, backlog=3,
                                                        retry_initial=0.25, retry_max=9.0)
    defaults = ReplicaOptions.of(SaveOptions())
    assert [f.name for f in dataclasses.fields(ReplicaOptions)
            if getattr(defaults, f.name) == getattr(ReplicaOptions.of(options), f.name)] == []


def test_the_backlog_is_at_least_one_step():
    assert ReplicaOptions(backlog=0).backlog == 1
