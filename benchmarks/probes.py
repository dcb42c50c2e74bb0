"""What the benchmarks read about this process's and the machine's memory, from /proc (Linux).

* :func:`proc_status`: a ``/proc/self/status`` field in bytes (``VmRSS``, ``VmHWM``; 0 when absent);
  :func:`rss` and :func:`peak_rss` name the two the benchmarks use.
* :func:`reset_peak`: reset ``VmHWM`` to the current RSS (``/proc/self/clear_refs``, Linux >= 4.0), so
  a later :func:`peak_rss` is the peak of what ran in between; False where the kernel refuses.
* :func:`meminfo`: ``/proc/meminfo`` in bytes (``MemTotal``, ``MemAvailable``, ...); empty when unreadable.
"""

from __future__ import annotations


def proc_status(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    return 0


def rss() -> int:
    return proc_status("VmRSS")


def peak_rss() -> int:
    return proc_status("VmHWM")


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5\n")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def meminfo() -> dict[str, int]:
    fields = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                fields[key] = int(value.split()[0]) * 1024
    except OSError:
        return {}
    return fields
