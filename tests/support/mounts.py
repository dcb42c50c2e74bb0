"""Real mounts for the fault tests: a size-limited tmpfs, and whether something is mounted at a path.

:class:`SmallFilesystem` mounts a real size-limited tmpfs (``mount -t tmpfs -o size=...``) when the
process may (root with CAP_SYS_ADMIN); :func:`try_tmpfs` returns None otherwise, and the disk-full
tests then rely on the storage wrapper of :mod:`tests.support.faults` alone. :func:`is_mounted` reads
/proc/self/mounts (``os.path.ismount`` misses bind mounts).
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from pathlib import Path


class SmallFilesystem:
    """A tmpfs of ``size`` bytes mounted at ``path`` (see :func:`try_tmpfs`); ``fill()`` takes all but
    ``leave`` bytes of its free space with a filler file, ``free()`` deletes it, ``umount()`` ends it."""

    def __init__(self, path: Path, size: int):
        self.path, self.size = Path(path), size
        self.filler = self.path / ".filler"

    def free_bytes(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def fill(self, leave: int = 0) -> None:
        """Fill the file system until ``write`` fails with ENOSPC, then give back ``leave`` bytes."""
        with open(self.filler, "ab") as out:
            block = b"\0" * 65536
            while True:
                try:
                    out.write(block)
                    out.flush()
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
            for size in (4096, 1):  # the last partial block
                while True:
                    try:
                        os.write(out.fileno(), b"\0" * size)
                    except OSError:
                        break
            end = out.seek(0, os.SEEK_END)
        if leave:
            os.truncate(self.filler, max(0, end - leave))

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)

    def umount(self) -> None:
        """Unmount (lazily when still busy), until nothing is mounted at ``path``."""
        for _ in range(8):
            if not is_mounted(self.path):
                return
            if subprocess.run(["umount", str(self.path)], capture_output=True).returncode:
                subprocess.run(["umount", "-l", str(self.path)], capture_output=True)


def is_mounted(path: str | os.PathLike) -> bool:
    """Whether a file system is mounted at ``path`` (from /proc/self/mounts: ``os.path.ismount``
    misses a bind mount from the same file system)."""
    target = os.path.realpath(path)
    try:
        with open("/proc/self/mounts") as mounts:
            points = [line.split()[1].encode().decode("unicode_escape") for line in mounts if line.strip()]
    except OSError:
        return os.path.ismount(target)
    return target in points


def try_tmpfs(path: Path, size: int) -> SmallFilesystem | None:
    """Mount a ``size``-byte tmpfs at ``path`` (created); None when this process may not mount."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return None
    path.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        return None
    fs = SmallFilesystem(path, size)
    if not is_mounted(path) or fs.free_bytes() > 2 * size:  # not our mount after all
        fs.umount()
        return None
    return fs
