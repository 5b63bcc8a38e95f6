"""The blocking part of a save: copy tensors into reusable host buffers.

One buffer holds the whole snapshot laid out exactly as the data files will be
(see :mod:`staging._format`), so serializing is a plain write of buffer slices
and the upload can stream from the same memory. Buffers are page-aligned
anonymous memory (pinned ``torch.empty`` when CUDA is present, so device
copies are asynchronous) and are reused across saves: the second save copies
into warm pages, which is several times faster on this kind of VM than into
fresh ones. At most ``max_buffers`` exist; a save that finds all of them busy
waits for the oldest one's local write — that bounds memory to one extra copy
of the state per buffer, never more.
"""

from __future__ import annotations

import mmap
import threading
import time

import torch

from ._format import PAGE, Plan, align_up

__all__ = ["HostBuffer", "BufferPool", "snapshot", "POOL"]

ROUND = 64 << 20  # buffers grow in 64 MiB steps so that slightly larger states reuse them


class HostBuffer:
    """A page-aligned byte buffer with a uint8 tensor view over it."""

    def __init__(self, size: int):
        self.size = max(align_up(size, ROUND), ROUND)
        if torch.cuda.is_available():
            self.tensor = torch.empty(self.size, dtype=torch.uint8, pin_memory=True)
            self._mm: mmap.mmap | None = None
            self.view = memoryview(self.tensor.numpy()).cast("B")
        else:
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
            self._mm = mmap.mmap(-1, self.size, flags=flags)
            self.view = memoryview(self._mm)
            self.tensor = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.file_offsets: list[int] = []


class BufferPool:
    """At most ``max_buffers`` reusable snapshot buffers, shared by every save of a process."""

    def __init__(self, max_buffers: int = 1):
        self.max_buffers = max_buffers
        self._free: list[HostBuffer] = []
        self._count = 0
        self._cond = threading.Condition()

    def acquire(self, size: int, timeout: float | None = None) -> HostBuffer:
        """A buffer of at least ``size`` bytes; waits while all buffers are busy.

        Raises:
            TimeoutError: no buffer became free within ``timeout``.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                fits = [b for b in self._free if b.size >= size]
                if fits:
                    buf = min(fits, key=lambda b: b.size)
                    self._free.remove(buf)
                    return buf
                if self._count < self.max_buffers or self._free:
                    if self._free:  # too small: drop it and make a bigger one
                        self._free.pop()
                        self._count -= 1
                    self._count += 1
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError("no snapshot buffer became free (previous save still writing)")
                self._cond.wait(left)
        try:
            return HostBuffer(size)
        except BaseException:
            with self._cond:
                self._count -= 1
                self._cond.notify_all()
            raise

    def release(self, buf: HostBuffer) -> None:
        with self._cond:
            self._free.append(buf)
            self._cond.notify_all()

    def clear(self) -> None:
        """Drop idle buffers (their memory returns to the OS once no tensor views remain)."""
        with self._cond:
            self._count -= len(self._free)
            self._free.clear()


POOL = BufferPool()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t if t.is_contiguous() else t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def snapshot(plan: Plan, pool: BufferPool = POOL, timeout: float | None = None) -> HostBuffer:
    """Copy every tensor of ``plan`` into a pooled buffer; returns once the copy is complete.

    The caller may modify its tensors as soon as this returns. Device tensors are
    copied with ``non_blocking`` into pinned memory, then synchronized once.

    Caveats:
        Non-contiguous tensors are made contiguous first (a temporary copy).
    """
    starts = [0]
    for size in plan.file_sizes:
        starts.append(starts[-1] + align_up(size, PAGE))
    buf = pool.acquire(max(starts[-1], 1), timeout)
    buf.file_offsets = starts[:-1]
    try:
        devices = set()
        for e in plan.tensors:
            if e.nbytes == 0 or e.tensor is None:
                continue
            base = buf.file_offsets[e.file] + e.offset
            dst = buf.tensor[base : base + e.nbytes]
            src = _as_bytes(e.tensor)
            if src.device.type != "cpu":
                devices.add(src.device)
                dst.copy_(src, non_blocking=True)
            else:
                dst.copy_(src)
        for dev in devices:
            torch.cuda.synchronize(dev) if dev.type == "cuda" else None
    except BaseException:
        pool.release(buf)
        raise
    for e in plan.tensors:
        e.tensor = None  # the snapshot must not keep the caller's tensors alive
    return buf
