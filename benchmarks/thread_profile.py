"""cProfile of one call over every thread that works for it, and where its CPU time goes.

:func:`profile_call` profiles ``fn()`` on the calling thread, on every thread started meanwhile
(``threading.setprofile``: writer, hasher, part uploads...) and, when given, on an asyncio event
loop's thread (fsspec's, where s3fs/aiobotocore prepare, sign and send every request).
:func:`top_functions` ranks the functions by their own time summed over those threads, blocking
waits (lock acquire, epoll, queue get, sleep: a thread waiting, not working) left out.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import re
import threading
import time
from typing import Callable

from harness import REPO

# Blocking calls (a thread waiting, not working), left out of the ranking.
WAITS = {"<method 'acquire' of '_thread.lock' objects>", "<method 'acquire' of '_thread.RLock' objects>",
         "<method 'poll' of 'select.epoll' objects>", "<method 'select' of 'select.epoll' objects>",
         "<method 'get' of '_queue.SimpleQueue' objects>", "<built-in method time.sleep>"}


def function_name(filename: str, line: int, name: str) -> str:
    """'name (file:line)' for Python functions, 'module.Class.method' for builtins."""
    if filename == "~":
        match = re.fullmatch(r"<method '(\w+)' of '([\w.]+)' objects>", name)
        if match:
            return f"{match.group(2)}.{match.group(1)}"
        match = re.fullmatch(r"<(?:built-in method|function) ([\w.]+)(?: at 0x\w+)?>", name)
        return match.group(1) if match else name
    where = filename.split("site-packages/")[-1].replace(str(REPO) + "/", "")
    where = re.sub(r"^.*/lib/python3\.\d+/", "", where)
    return f"{name} ({where}:{line})"


def _on_loop(loop, action: Callable[[], None]) -> None:
    done = threading.Event()
    loop.call_soon_threadsafe(lambda: (action(), done.set()))
    done.wait()


def profile_call(fn: Callable[[], None], loop=None) -> tuple[float, pstats.Stats]:
    """Wall seconds of ``fn()`` and the profile of every thread that ran for it (see the module)."""
    profiles: list[cProfile.Profile] = []

    def hook(*_):  # runs first in every new thread: profile that thread from here on
        profile = cProfile.Profile()
        profiles.append(profile)
        profile.enable()

    main_profile = cProfile.Profile()
    if loop is not None:
        loop_profile = cProfile.Profile()
        profiles.append(loop_profile)
        _on_loop(loop, loop_profile.enable)
    threading.setprofile(hook)
    start = time.perf_counter()
    main_profile.enable()
    try:
        fn()
    finally:
        main_profile.disable()
        total = time.perf_counter() - start
        threading.setprofile(None)
        if loop is not None:
            _on_loop(loop, loop_profile.disable)
    stats = pstats.Stats(main_profile, stream=io.StringIO())
    for profile in profiles:
        if profile.getstats():
            stats.add(profile)
    return total, stats


def top_functions(stats: pstats.Stats, top: int) -> tuple[float, list[str]]:
    """The own time of every function but the waits, summed, and the ``top`` ones as
    '`name (file:line)` 0.123 s (N calls)'."""
    work = {k: v for k, v in stats.stats.items() if k[2] not in WAITS}
    busy = sum(v[2] for v in work.values())
    rows = [f"`{function_name(filename, line, name)}` {tt:.3f} s ({nc} calls)"
            for (filename, line, name), (_, nc, tt, ct, _) in sorted(work.items(), key=lambda kv: -kv[1][2])[:top]]
    return busy, rows
