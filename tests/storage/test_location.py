"""ckpt.storage.Location.display_name: the one name of a mount (the catalog's, ``ckpt inspect``'s, a
run's claim): an absolute path when local, else the URL without a trailing ``/``, never credentials."""

from __future__ import annotations

import os

from ckpt.root.catalog import mount_id
from ckpt.storage import Location, locate

KEY, SECRET = "AKIAEXAMPLEKEY", "se/cret+EXAMPLE"


def test_a_local_mount_is_named_by_its_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    location = locate("ckpts/run1/")
    assert location.display_name == os.path.join(str(tmp_path), "ckpts", "run1")
    assert mount_id(location) == mount_id("ckpts/run1") == location.display_name


def test_a_url_is_named_without_its_credentials():
    location = locate(f"s3://{KEY}:{SECRET}@bucket/run/")
    assert location.display_name == "s3://bucket/run" == mount_id(location)
    # a Location built by hand around a path that still holds userinfo is named without it too
    by_hand = Location(location.storage, f"{KEY}:{SECRET}@bucket/run/")
    assert by_hand.display_name == "s3://bucket/run"
    assert KEY not in by_hand.display_name and SECRET not in by_hand.display_name
