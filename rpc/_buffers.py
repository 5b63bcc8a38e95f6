"""Reusable page-aligned buffers.

Receiving into a page-aligned buffer is ~6x faster on this kind of machine than
into a ``bytearray`` (16 bytes off a page), and reusing buffers avoids the page
faults that halve throughput into fresh memory.
"""

from __future__ import annotations

import mmap
import threading

__all__ = ["BufferPool", "aligned"]


def aligned(n: int) -> mmap.mmap:
    """A new page-aligned, zero-filled anonymous buffer of ``n`` bytes (n >= 1)."""
    return mmap.mmap(-1, max(n, 1))


class BufferPool:
    """Buffers by power-of-two size class; thread-safe; keeps at most ``keep`` per class."""

    def __init__(self, keep: int = 16):
        self.keep = keep
        self._free: dict[int, list[mmap.mmap]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def size_class(n: int) -> int:
        return max(1 << 16, 1 << (max(n, 1) - 1).bit_length())

    def get(self, n: int) -> mmap.mmap:
        size = self.size_class(n)
        with self._lock:
            free = self._free.get(size)
            if free:
                return free.pop()
        return aligned(size)

    def put(self, buf: mmap.mmap) -> None:
        with self._lock:
            free = self._free.setdefault(len(buf), [])
            if len(free) < self.keep:
                free.append(buf)
        # Beyond `keep`, just drop it: closing would fail while a memoryview of it lives,
        # and the mapping goes away with its last reference anyway.
