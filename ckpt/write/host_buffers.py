"""Host buffers of one snapshot: every tensor of the state laid out in a few large host allocations.

Pinned host memory comes from the accelerator's caching host allocator, which rounds each block up
to a power of two (torch's ``CachingHostAllocator``: a 10.65 GiB set asked as one block reserves
16 GiB). So a pinned set is cut into *segments* whose sizes are powers of two — tensors packed first
fit, largest first, into segments of ``max(256 MiB, the largest tensor rounded up to a power of
two)``, each segment then sized to the power of two that holds what it got. What is asked is what
is reserved, so :attr:`HostBuffers.nbytes` is the allocator's real figure, and the waste is below
one segment per set. Unpinned sets are one exact allocation, the tensors in order.

The memory comes from a :class:`~ckpt.device.HostMemory` (the device's pinned host allocator, or
plain). A set has no ``release``: its owner drops every reference to it (the set, its views, the
staged trees that hold them) and only then asks the allocator to give cached blocks back — emptying
the cache while a view still holds a block frees nothing (DCP #131270, #170163).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..device import HostMemory

ALIGN = 64  # bytes between tensors inside one segment
SEGMENT_MIN = 256 << 20


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _power_of_two(nbytes: int) -> int:
    return 1 << max(nbytes - 1, 0).bit_length()


@dataclass(frozen=True)
class Layout:
    """Where each tensor goes: ``places[i] = (segment, byte offset)``; ``sizes[s]`` bytes per segment."""

    sizes: tuple[int, ...]
    places: tuple[tuple[int, int], ...]


def plan_layout(nbytes: list[int], *, pinned: bool) -> Layout:
    """Segments for tensors of these byte sizes (see the module docstring)."""
    if not pinned:
        offsets, total = [], 0
        for n in nbytes:
            offsets.append((0, total))
            total += _aligned(n)
        return Layout((total,) if nbytes else (), tuple(offsets))
    capacity = max([SEGMENT_MIN] + [_power_of_two(_aligned(n)) for n in nbytes])
    fills: list[int] = []
    places: list[tuple[int, int] | None] = [None] * len(nbytes)
    for i in sorted(range(len(nbytes)), key=lambda i: -nbytes[i]):
        size = _aligned(nbytes[i])
        segment = next((s for s, fill in enumerate(fills) if fill + size <= capacity), None)
        if segment is None:
            segment = len(fills)
            fills.append(0)
        places[i] = (segment, fills[segment])
        fills[segment] += size
    return Layout(tuple(_power_of_two(fill) for fill in fills), tuple(places))  # type: ignore[arg-type]


class HostBuffers:
    """One buffer set's memory: segments and a host view per source tensor (same shape and dtype)."""

    def __init__(self, sources: list[torch.Tensor], memory: HostMemory):
        self.signature = signature(sources)
        self.pinned = memory.pinned
        layout = plan_layout([t.numel() * t.element_size() for t in sources], pinned=memory.pinned)
        self.segments = [memory.empty(size) for size in layout.sizes]
        self.views = [
            self.segments[segment][offset : offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for (segment, offset), t in zip(layout.places, sources)
        ]

    @property
    def nbytes(self) -> int:
        """Host bytes this set holds, as the allocator reserves them."""
        return sum(segment.numel() for segment in self.segments)


def signature(sources: list[torch.Tensor]) -> tuple:
    """What a buffer set must match to be reused: each tensor's shape and dtype, in order."""
    return tuple((tuple(t.shape), t.dtype) for t in sources)
