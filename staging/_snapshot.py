"""The blocking part of a save: copy tensors into reusable host buffers.

One buffer holds the whole snapshot laid out exactly as the data files will be
(see :mod:`staging._format`), so serializing is a plain write of buffer slices
and the upload can stream from the same memory. Buffers are page-aligned
anonymous memory (pinned ``torch.empty`` when CUDA is present, so device
copies are asynchronous) and are reused across saves: the second save copies
into warm pages, which is several times faster on this kind of VM than into
fresh ones. A save holds its buffer only until its local copy is durable (the
upload then reads the staged files). A save that finds every buffer busy
either takes another one, when that keeps all buffers within the memory cap
the caller gave (``max_bytes``), or waits for one to come free — for at most
``timeout`` seconds, then :class:`TimeoutError`. Without a cap at most
``max_buffers`` (one) exist: memory stays bounded to one copy of the state.
"""

from __future__ import annotations

import mmap
import threading
import time

import torch

from ._format import PAGE, Plan, align_up

__all__ = ["HostBuffer", "BufferPool", "snapshot", "buffer_size", "POOL"]

ROUND = 64 << 20  # buffers grow in 64 MiB steps so that slightly larger states reuse them


def buffer_size(size: int) -> int:
    """Bytes a buffer for ``size`` bytes of snapshot really takes (rounded up to ``ROUND``)."""
    return max(align_up(size, ROUND), ROUND)


class HostBuffer:
    """A page-aligned byte buffer with a uint8 tensor view over it.

    ``wait_s`` and ``extra`` describe how its current holder got it: seconds spent waiting
    for it to come free, and whether it was made while every other buffer was busy.
    """

    def __init__(self, size: int):
        self.size = buffer_size(size)
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
        self.wait_s = 0.0
        self.extra = False


class BufferPool:
    """Reusable snapshot buffers shared by every save of a process.

    Args:
        max_buffers: how many buffers may exist when an ``acquire`` names no memory cap.
    """

    def __init__(self, max_buffers: int = 1):
        self.max_buffers = max_buffers
        self._free: list[HostBuffer] = []
        self._count = 0   # buffers in existence, busy or free
        self._bytes = 0   # their sizes together
        self._cond = threading.Condition()

    def acquire(self, size: int, timeout: float | None = None, max_bytes: int | None = None) -> HostBuffer:
        """A buffer of at least ``size`` bytes.

        A free buffer that fits is reused. Otherwise a new one is made when no buffer is
        busy, or when every buffer together stays within ``max_bytes`` (None: at most
        ``max_buffers`` buffers); free buffers too small to reuse are dropped to make room.
        Failing that, waits for a buffer to come free. The buffer's ``wait_s`` and ``extra``
        say which of these happened.

        Raises:
            TimeoutError: no buffer became free within ``timeout`` seconds (None: no limit).
        """
        need = buffer_size(size)
        deadline = None if timeout is None else time.monotonic() + timeout
        waited = 0.0  # only time spent blocked below; a buffer at hand reports exactly 0
        with self._cond:
            while True:
                fits = [b for b in self._free if b.size >= size]
                if fits:
                    buf = min(fits, key=lambda b: b.size)
                    self._free.remove(buf)
                    buf.wait_s, buf.extra = waited, False
                    return buf
                busy = self._count - len(self._free)
                busy_bytes = self._bytes - sum(b.size for b in self._free)
                room = busy < self.max_buffers if max_bytes is None else busy_bytes + need <= max_bytes
                if busy == 0 or room:
                    # Every free buffer is too small for this state: drop them rather than
                    # keep memory that no save of this size can use.
                    self._count -= len(self._free)
                    self._bytes -= sum(b.size for b in self._free)
                    self._free.clear()
                    self._count += 1
                    self._bytes += need
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"no snapshot buffer became free within {timeout:g}s (an earlier save is "
                                       "still writing its local copy); raise snapshot_timeout, or allow another "
                                       "buffer with snapshot_memory")
                t = time.monotonic()
                self._cond.wait(left)
                waited += time.monotonic() - t
        try:
            buf = HostBuffer(size)
        except BaseException:
            with self._cond:
                self._count -= 1
                self._bytes -= need
                self._cond.notify_all()
            raise
        buf.wait_s, buf.extra = waited, busy > 0
        return buf

    def release(self, buf: HostBuffer) -> None:
        with self._cond:
            self._free.append(buf)
            self._cond.notify_all()

    def clear(self) -> None:
        """Drop idle buffers (their memory returns to the OS once no tensor views remain)."""
        with self._cond:
            self._count -= len(self._free)
            self._bytes -= sum(b.size for b in self._free)
            self._free.clear()


POOL = BufferPool()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t if t.is_contiguous() else t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def snapshot(plan: Plan, pool: BufferPool = POOL, timeout: float | None = None,
             max_bytes: int | None = None) -> HostBuffer:
    """Copy every tensor of ``plan`` into a pooled buffer; returns once the copy is complete.

    The caller may modify its tensors as soon as this returns. Device tensors are
    copied with ``non_blocking`` into pinned memory, then synchronized once.
    ``timeout`` and ``max_bytes`` are passed to :meth:`BufferPool.acquire`.

    Raises:
        TimeoutError: no buffer was free within ``timeout`` and ``max_bytes`` allowed no other.

    Caveats:
        Non-contiguous tensors are made contiguous first (a temporary copy).
    """
    starts = [0]
    for size in plan.file_sizes:
        starts.append(starts[-1] + align_up(size, PAGE))
    buf = pool.acquire(max(starts[-1], 1), timeout, max_bytes)
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
