"""The corruption campaign's damage (scripts/corruption_campaign.py): one per trial, recorded.

:func:`apply_damage` damages ONE file of the campaign's run (:data:`PLACES`: a step's data file or
manifest on the primary or the replica, or the catalog's ``data.mdb``/``lock.mdb``) in one of the
:data:`KINDS`: ``bitflip`` (one bit), ``byte`` (one byte set to another value), ``truncate`` (to a
random shorter length), ``delete``. Offsets inside data files are drawn half of the time uniformly
over the file and half of the time by first picking a region (a blob or a gap between blobs,
:func:`regions`) uniformly, so that alignment padding is hit often enough to be measured. The
:class:`Damage` says where it landed: the region and the blobs whose bytes it changed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import ckpt
from ckpt.format import MANIFEST_NAME, data_file_name, step_name
from ckpt.root import mount_id
from ckpt.storage import locate
from scripts.corruption_run import STEPS

DATA_FILE = data_file_name(0)
MANIFEST = MANIFEST_NAME
KINDS = ("bitflip", "byte", "truncate", "delete")
PLACES = ("primary-data", "primary-manifest", "replica-data", "replica-manifest", "catalog")
CATALOG_FILES = ("data.mdb", "lock.mdb")


@dataclass
class Damage:
    place: str  # one of PLACES
    kind: str  # one of KINDS
    file: str  # relative to the checkpoint (data/..., manifest.json) or to the catalog (data.mdb)
    path: str  # absolute
    size: int  # before the damage
    mount: str | None = None  # mount_id of the mount (checkpoint files)
    step: int | None = None
    offset: int | None = None  # bitflip/byte: the byte; truncate: the new length
    detail: str = ""  # bit, old -> new byte
    region: str | None = None  # data file: the blob's key, "padding"; manifest: "body", "digest"
    hit: list = field(default_factory=list)  # keys of the blobs whose bytes the damage changed


def blobs_of(step_dir: Path) -> list[tuple[str, int, int]]:
    """``(key, offset, length)`` of every non-empty blob in the step's data file, by offset."""
    manifest = ckpt.read_manifest(step_dir)
    found = [(key, blob.offset, blob.length) for key, blob in manifest.blobs() if blob.file == DATA_FILE]
    return sorted((b for b in found if b[2] > 0), key=lambda b: b[1])


def regions(blobs: list[tuple[str, int, int]], size: int) -> list[tuple[str, int, int]]:
    """The file cut into blobs and the gaps between them (``"padding"``): ``(name, start, end)``."""
    out, position = [], 0
    for key, offset, length in blobs:
        if offset > position:
            out.append(("padding", position, offset))
        out.append((key, offset, offset + length))
        position = max(position, offset + length)
    if position < size:
        out.append(("padding", position, size))
    return out


def region_at(cut: list[tuple[str, int, int]], offset: int) -> str:
    return next(name for name, start, end in cut if start <= offset < end)


def _target(rng: random.Random, work: Path, place: str, kind: str, step: int | None) -> Damage:
    """The file ``place`` names (a random catalog file; a random step's unless ``step``), undamaged yet."""
    if place == "catalog":
        name = rng.choice(CATALOG_FILES)
        path = work / "primary" / ".catalog" / name
        return Damage(place, kind, name, str(path), path.stat().st_size)
    mount = work / place.split("-")[0]
    step = step or rng.choice(STEPS)
    name = DATA_FILE if place.endswith("data") else MANIFEST
    path = mount / step_name(step) / name
    return Damage(place, kind, name, str(path), path.stat().st_size, mount=mount_id(locate(mount)), step=step)


def apply_damage(rng: random.Random, work: Path, layouts: dict, *, place: str | None = None,
                 kind: str | None = None, step: int | None = None, offset: int | None = None) -> Damage:
    """One random damage (``place``/``kind``/``step``/``offset`` force a choice)."""
    place = place or rng.choice(PLACES)
    kind = kind or rng.choice(KINDS)
    damage = _target(rng, work, place, kind, step)
    path = Path(damage.path)
    raw = bytearray(path.read_bytes())
    cut = layouts.get(damage.step) if damage.file == DATA_FILE else None
    if kind == "delete":
        path.unlink()
        return damage
    if kind == "truncate":
        damage.offset = rng.randrange(len(raw)) if offset is None else offset
        path.write_bytes(bytes(raw[: damage.offset]))
        if cut is not None:
            damage.region = region_at(cut, damage.offset)
            damage.hit = [key for key, start, end in cut if key != "padding" and end > damage.offset]
        return damage
    if offset is None:
        if cut is not None and rng.random() < 0.5:  # stratified: a region first
            _name, start, end = rng.choice(cut)
            offset = rng.randrange(start, end)
        else:
            offset = rng.randrange(len(raw))
    damage.offset = offset
    tail = bytes(raw).rfind(b',"digest":"')
    old = raw[offset]
    if kind == "bitflip":
        bit = rng.randrange(8)
        raw[offset] ^= 1 << bit
        damage.detail = f"bit {bit}: {old:#04x} -> {raw[offset]:#04x}"
    else:
        raw[offset] = rng.choice([b for b in range(256) if b != old])
        damage.detail = f"{old:#04x} -> {raw[offset]:#04x}"
    path.write_bytes(bytes(raw))
    if cut is not None:
        damage.region = region_at(cut, offset)
        damage.hit = [] if damage.region == "padding" else [damage.region]
    elif damage.file == MANIFEST:
        damage.region = "digest" if tail != -1 and offset >= tail else "body"
    return damage
