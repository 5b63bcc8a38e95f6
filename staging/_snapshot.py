"""The blocking part of a save: copy tensors into reusable host buffers.

One buffer holds the whole snapshot laid out exactly as the data files will be
(see :mod:`staging._format`), so serializing is a plain write of buffer slices
and the upload can stream from the same memory. Buffers are page-aligned
anonymous memory, faulted in when made (``MAP_POPULATE``; pinned ``torch.empty``
when CUDA is present, so device copies are asynchronous), and are reused
across saves: a save copies into warm pages, which is several times faster on
this kind of VM than into fresh ones (256 MiB: 0.03 s against 0.11 s to make
and fault a new buffer). A save holds its buffer only until its local copy is
durable (the upload then reads the staged files).

Double buffering: without a memory cap at most ``max_buffers`` (two) buffers
exist, so a save made while the previous one is still writing its local copy,
or uploading from its buffer, copies into the other buffer and never waits for
the previous save's disk write or upload. The second buffer is made ahead of
need, off the caller's thread (:meth:`BufferPool.reserve`), by a save made while
an earlier one is still in flight (saves that close together are about to
overlap), or else by the first save that finds the first buffer busy (that save
then pays for fresh memory, once); it is then kept pooled, warm, like the first:
memory is one copy of the state while saves never come close, two once they
have. A save that finds every buffer busy
(two earlier saves still hold theirs) either takes another one, when that keeps
all buffers within the memory cap the caller gave (``max_bytes``; 0 keeps one
buffer, as before double buffering), or waits for one to come free — for at
most ``timeout`` seconds, then :class:`TimeoutError`. A buffer that cannot be
made (the host is out of memory) while another exists is waited for instead.

While a snapshot copies, earlier saves' checksum passes pause between spans
(:func:`yield_to_snapshots`): on a machine with few cores they would otherwise
share them with the copy the caller is blocked on.
"""

from __future__ import annotations

import errno
import logging
import mmap
import threading
import time

import torch

from ._format import PAGE, Plan, align_up

__all__ = ["HostBuffer", "BufferPool", "snapshot", "buffer_size", "yield_to_snapshots", "POOL"]

log = logging.getLogger("stripefs.staging")

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
        self.used = 0  # bytes the current snapshot takes (its files, page-aligned)
        self.wait_s = 0.0
        self.extra = False


class BufferPool:
    """Reusable snapshot buffers shared by every save of a process.

    Args:
        max_buffers: how many buffers may exist when an ``acquire`` names no memory cap
            (two: a save never waits for the previous one's local write or upload).
    """

    def __init__(self, max_buffers: int = 2):
        self.max_buffers = max_buffers
        self._free: list[HostBuffer] = []
        self._count = 0   # buffers in existence, busy or free
        self._bytes = 0   # their sizes together
        self._reserving = False  # a buffer is being made ahead of need (``reserve``)
        self._clears = 0  # ``clear`` calls so far: a buffer reserved across one is not pooled
        self._cond = threading.Condition()

    def acquire(self, size: int, timeout: float | None = None, max_bytes: int | None = None) -> HostBuffer:
        """A buffer of at least ``size`` bytes.

        A free buffer that fits is reused. Otherwise a new one is made when no buffer is
        busy, or when every buffer together stays within ``max_bytes`` (None: at most
        ``max_buffers`` buffers); free buffers too small to reuse are dropped to make room.
        Failing that — or when the new buffer cannot be made (out of memory) while others
        exist — waits for a buffer to come free. The buffer's ``wait_s`` and ``extra`` say
        which of these happened (``extra``: made while ``max_buffers`` or more were busy,
        which only ``max_bytes`` allows).

        Raises:
            TimeoutError: no buffer became free within ``timeout`` seconds (None: no limit).
            MemoryError, OSError, RuntimeError: no buffer exists and none can be made.
        """
        need = buffer_size(size)
        deadline = None if timeout is None else time.monotonic() + timeout
        waited = 0.0  # only time spent blocked below; a buffer at hand reports exactly 0
        no_room = False  # a new buffer could not be made: wait for a busy one instead
        while True:
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
                    if busy == 0 or (room and not no_room):
                        # Every free buffer is too small for this state: drop them rather than
                        # keep memory that no save of this size can use.
                        self._drop_free()
                        self._count += 1
                        self._bytes += need
                        break
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(f"no snapshot buffer became free within {timeout:g}s ({busy} earlier "
                                           "save(s) still hold theirs, writing their local copies or streaming "
                                           "their uploads); raise snapshot_timeout, or allow another buffer with "
                                           "snapshot_memory")
                    t = time.monotonic()
                    self._cond.wait(left)
                    waited += time.monotonic() - t
            try:
                buf = HostBuffer(size)  # outside the lock: faulting in fresh memory takes a while
            except BaseException as exc:
                with self._cond:
                    self._count -= 1
                    self._bytes -= need
                    self._cond.notify_all()
                if busy == 0 or not _out_of_memory(exc):
                    raise
                log.warning("snapshot: no memory for another %d MiB buffer (%s: %s); waiting for one of the "
                            "%d busy buffer(s) to come free", need >> 20, type(exc).__name__, exc, busy)
                no_room = True
                continue
            buf.wait_s, buf.extra = waited, busy >= self.max_buffers
            return buf

    def release(self, buf: HostBuffer) -> None:
        with self._cond:
            self._free.append(buf)
            self._cond.notify_all()

    def reserve(self, size: int, max_bytes: int | None = None) -> bool:
        """Make one more buffer of at least ``size`` bytes ahead of need and pool it, free.

        Only when no free buffer fits, no other reserve is under way, and the buffers together
        stay within ``max_bytes`` (None: ``max_buffers``) with it; a failure to make it (no
        memory) is logged and ignored: a later save then makes one, or waits. An ``acquire``
        meanwhile counts the buffer being made as busy and takes it once it is pooled.

        Returns:
            whether a buffer was made and pooled.
        """
        need = buffer_size(size)
        with self._cond:
            if self._reserving or any(b.size >= size for b in self._free):
                return False
            if (self._count >= self.max_buffers) if max_bytes is None else (self._bytes + need > max_bytes):
                return False
            self._reserving = True
            self._count += 1
            self._bytes += need
            clears = self._clears
        try:
            buf = HostBuffer(size)
        except BaseException as exc:
            with self._cond:
                self._reserving = False
                self._count -= 1
                self._bytes -= need
                self._cond.notify_all()
            log.warning("snapshot: could not make a spare %d MiB buffer ahead of need (%s: %s)", need >> 20,
                        type(exc).__name__, exc)
            return False
        with self._cond:
            self._reserving = False
            kept = clears == self._clears  # a clear meanwhile asked for the memory back
            if kept:
                self._free.append(buf)
            else:
                self._count -= 1
                self._bytes -= need
            self._cond.notify_all()
        return kept

    def reserve_in_background(self, size: int, max_bytes: int | None = None) -> None:
        """:meth:`reserve` on a thread of its own (faulting in fresh memory takes a while)."""
        with self._cond:
            if self._reserving:
                return
        threading.Thread(target=self.reserve, args=(size, max_bytes), daemon=True,
                         name="stripefs-snapshot-reserve").start()

    def clear(self) -> int:
        """Drop every idle buffer (a save in flight keeps its own); returns the bytes dropped.

        Their memory returns to the OS once no tensor views remain (pinned buffers go back to
        torch's pinned-memory cache); the next save makes a buffer again. A buffer being
        reserved meanwhile is dropped when made, not pooled.
        """
        with self._cond:
            self._clears += 1
            return self._drop_free()

    def _drop_free(self) -> int:
        """Forget the free buffers (the caller holds ``_cond``); returns their bytes."""
        freed = sum(b.size for b in self._free)
        self._count -= len(self._free)
        self._bytes -= freed
        self._free = []
        return freed


POOL = BufferPool()


def _out_of_memory(exc: BaseException) -> bool:
    """Whether making a buffer failed for want of memory (plain or pinned host memory)."""
    if isinstance(exc, MemoryError):
        return True
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOMEM, errno.EAGAIN)
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


_copying = 0  # snapshots copying right now (their callers blocked in save)
_copy_cond = threading.Condition()


def yield_to_snapshots(limit: float = 1.0) -> None:
    """Let a snapshot being copied have the cores: an earlier save's background work (its
    checksums) calls this between pieces and waits while any save's copy runs — at most
    ``limit`` seconds. A copy never waits for background work, so this cannot deadlock; it
    delays the earlier save by the copy's duration. Free when no copy runs (an int read)."""
    if _copying:
        with _copy_cond:
            _copy_cond.wait_for(lambda: not _copying, limit)


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
    buf.file_offsets, buf.used = starts[:-1], max(starts[-1], 1)
    global _copying
    with _copy_cond:
        _copying += 1  # only once the buffer is ours: waiting for one never holds others back
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
    finally:
        with _copy_cond:
            _copying -= 1
            _copy_cond.notify_all()
    for e in plan.tensors:
        e.tensor = None  # the snapshot must not keep the caller's tensors alive
    return buf
