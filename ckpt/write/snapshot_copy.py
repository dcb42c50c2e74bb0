"""How a snapshot's bytes move into host buffers, and when the live tensors may change again.

``SnapshotCopy.start(pairs, result)`` copies each ``(source, host view)`` pair:

- a source on an accelerator: ``copy_(non_blocking=True)`` on a side stream of *the source's own
  device* (created at its first use, never on whatever device happens to be current), ordered after
  that device's compute stream, then a blocking event (the host thread that waits on it sleeps, it
  does not spin a core). The source is marked in use by the side stream (``record_stream``) and its
  reference held until the copy is known complete, so a temporary source — one ``state_dict()``
  made — is never freed and overwritten by the next forward while the copy still reads it.
- a source in host memory (CPU training, CPU-offloaded parameters and optimizer state): copied by
  the copier thread, off the training thread.

It returns a Future of ``result`` that is done when every byte is in the host buffers. The copier
thread waits on each device's copy event bound to that device (``set_device`` before the first wait
on a device other than the one it is bound to), so it never opens a context on another device (an
NPU refuses that: error 107002; CUDA spends ~0.5 GiB on device 0), whatever device the first
snapshot — or a host-only one — had.

:meth:`SnapshotCopy.wait` makes it safe to modify the sources: host copies are waited for on the
host; device copies only make each compute stream wait on its event (``host=True`` also waits on
the host). That device wait is timed with a pair of timing events on the compute stream, so the
stall the device suffers is measured (:meth:`device_stall_s`), not assumed to be zero.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch


def single_threaded_aten() -> None:
    """Initializer of the engine's long-lived worker threads: one ATen intra-op thread.

    With ATen's OpenMP backend, a parallel op on another long-lived thread gives that thread its own
    OpenMP team; libgomp then has more threads than cores and stops letting idle workers spin, so
    every parallel region of the *training* thread pays a sleep/wake-up from then on (measured in
    benchmarks/bench_trainer.py). The setting is per thread; training keeps its own."""
    torch.set_num_threads(1)


def _copy_all(pairs) -> None:
    for src, dst in pairs:
        dst.copy_(src)


class SnapshotCopy:
    """The copy engine of a :class:`~ckpt.write.staging.DoubleBufferStager` (see the module docstring).

    ``accel`` is ``torch.cuda``, ``torch.npu`` or None (CPU only)."""

    def __init__(self, accel):
        self.accel = accel
        self._streams: dict[Any, Any] = {}  # device -> its side stream
        self._copier: ThreadPoolExecutor | None = None
        self._pending: Future | None = None  # the last snapshot, until a host wait
        self._host_part: Future | None = None  # its host copies, until a host wait
        self._on_device = False  # the last snapshot has device copies
        self._unordered: list[tuple[Any, Any]] = []  # (device, copy event) no compute stream waits on yet
        self._timings: list[tuple[Any, Any]] = []  # (before, after) timing events around a stream wait
        self._device_stall_s = 0.0
        self._copier_device = None  # the device the copier thread is bound to (touched on that thread only)

    def device_of(self, tensor: torch.Tensor):
        """The accelerator device a source lives on, or None for host memory."""
        return None if self.accel is None or tensor.device.type == "cpu" else tensor.device

    # -- a snapshot ------------------------------------------------------------------------------
    def start(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], result: Any) -> Future:
        host, by_device = [], {}
        for src, dst in pairs:
            device = self.device_of(src)
            if device is None:
                host.append((src, dst))
            else:
                by_device.setdefault(device, []).append((src, dst))
        events = [(device, self._copy_on_side_stream(device, on_device)) for device, on_device in by_device.items()]
        copier = self._executor()
        self._host_part = copier.submit(_copy_all, host) if host else None
        # The pairs ride along until the events complete: the sources' lifetime covers the copy.
        self._pending = copier.submit(self._complete, events, pairs, result)
        self._unordered, self._on_device = events, bool(events)
        return self._pending

    def wait(self, host: bool = False) -> None:
        """Make it safe to modify the sources of the last snapshot (see the module docstring)."""
        if self._host_part is not None:
            part, self._host_part = self._host_part, None
            part.result()
        for device, event in self._unordered:
            self._order_compute_stream(device, event)
        self._unordered = []
        if self._pending is not None and (host or not self._on_device):
            pending, self._pending = self._pending, None
            pending.result()

    def forget_completed(self) -> None:
        """Drop the last snapshot's result once its copy is complete (raising its error, as a host
        wait would), so that it no longer keeps its host buffers alive."""
        if self._pending is not None and self._pending.done():
            pending, self._pending = self._pending, None
            pending.result()

    @property
    def pending(self) -> bool:
        """Whether a snapshot has not been host-waited for yet."""
        return self._pending is not None

    def device_stall_s(self) -> float:
        """Seconds the compute streams have waited for copies so far (waits not yet over excluded)."""
        while self._timings and self._timings[0][1].query():
            before, after = self._timings.pop(0)
            self._device_stall_s += before.elapsed_time(after) / 1e3
        return self._device_stall_s

    def close(self) -> None:
        self.wait(host=True)
        if self._copier is not None:
            self._copier.shutdown(wait=True)

    # -- internals -----------------------------------------------------------------------------
    def _executor(self) -> ThreadPoolExecutor:
        if self._copier is None:
            self._copier = ThreadPoolExecutor(1, thread_name_prefix="ckpt-snapshot", initializer=single_threaded_aten)
        return self._copier

    def _bind_copier(self, device) -> None:
        """On the copier thread: make ``device`` its current device, unless it already is."""
        if device != self._copier_device:
            self.accel.set_device(device)
            self._copier_device = device

    def _copy_on_side_stream(self, device, pairs):
        accel = self.accel
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = accel.Stream(device=device)
        stream.wait_stream(accel.current_stream(device))  # copy the values as of now
        with accel.stream(stream):
            for src, dst in pairs:
                dst.copy_(src, non_blocking=True)
                if src.device.type != "cpu":
                    src.record_stream(stream)
            event = accel.Event(blocking=True)
            event.record(stream)
        return event

    def _order_compute_stream(self, device, event) -> None:
        accel = self.accel
        compute = accel.current_stream(device)
        before, after = accel.Event(enable_timing=True), accel.Event(enable_timing=True)
        before.record(compute)
        compute.wait_event(event)
        after.record(compute)
        self._timings.append((before, after))

    def _complete(self, events, pairs, result):
        for device, event in events:
            self._bind_copier(device)
            event.synchronize()
        pairs.clear()  # the sources may go now, before anyone learns that the copy is complete
        return result
