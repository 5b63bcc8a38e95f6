"""Quality of service in a storage server: bulk writes yield to small reads.

A checkpoint burst is a stream of multi-megabyte chunk writes, each ending in an
``fdatasync``; a dataloader is a stream of small reads that each wait for one disk
read. Left alone, the burst fills the disk's queue and the reads wait behind it
(their p99 went up fifty-fold). Two rules keep the reads' latency:

* **bulk writes take few slots**: a write of at least :data:`BULK_WRITE` bytes runs in
  one of :data:`BULK_SLOTS` worker threads (a ``trio.CapacityLimiter``), so the disk
  queue holds at most that many bulk writes' bytes at once. Only the local disk write
  holds a slot, never a forward to the next replica (two servers forwarding to each
  other could otherwise wait for each other's slots);
* **at idle I/O priority**: the thread writing a bulk chunk (and syncing it: a sync's
  writeback is submitted by the syncing thread) runs in the kernel's ``idle`` I/O
  class for that write, so the block layer's scheduler (mq-deadline, bfq) dispatches
  reads first; it ages, so a burst never starves. No privilege is needed to lower a
  thread's class and to put it back.

* **flushed piece by piece**: a durable bulk write goes to the disk in pieces of
  :data:`BULK_PIECE` bytes, each flushed (``fdatasync``) before the next is submitted.
  A flush is where a read waits longest: a virtual disk (and many real ones) serves
  nothing else while it writes back what the flush covers, for about as long as those
  bytes take to reach the medium. A whole 4 MiB chunk flushed at once held every read
  of the disk for that long (docs/benchmarks.md, "A checkpoint burst, flushed piece by
  piece": readers' p99 28 ms during the burst, 2 ms alone); 512 KiB pieces cut that to
  9 ms at ~0.8x the burst's throughput. ``STRIPEFS_BULK_PIECE`` (bytes, 0: one flush per
  write, as before) sets it.

Small writes (a dataloader's outputs, metadata-sized files) and every read keep the
default class and need no slot. ``STRIPEFS_BULK_SLOTS`` sets the slots (0: no limit).

**Classes a writer names** (``WriteChunk.qos``, ``Client(qos=...)``): by size (the
default, as above); ``bulk`` -- every write of that client takes a bulk slot at idle I/O
priority, the small ones too (a checkpoint's small shards); ``background`` -- as bulk,
and at most :data:`BACKGROUND_SLOTS` of them at once per server, so a background upload
(the checkpoint mover, a copy) holds at most that many of the bulk slots and a burst of
the writer's own job gets the rest. Every write that named a class is told how long it
waited for its bulk slot (``WriteChunkReply.queued_us``; not for its background slot,
which it waits for behind its own uploads): what a background writer paces itself on
(``staging``'s mover). Replicas apply a forwarded write in its class.
"""

from __future__ import annotations

import contextlib
import ctypes
import platform
from typing import Iterator

import trio

from stripefs.rpc import int_setting
from stripefs.wire import messages as m

__all__ = ["BULK_WRITE", "BULK_PIECE", "BULK_SLOTS", "BACKGROUND_SLOTS", "bulk_limiter", "background_limiter",
           "is_bulk", "idle_io"]

BULK_WRITE = 1 << 20  # bytes: a write at least this large is bulk
BULK_PIECE = int_setting("STRIPEFS_BULK_PIECE", 512 << 10)  # bytes a bulk write flushes at a time (0: all)
BULK_SLOTS = 2
BACKGROUND_SLOTS = 1
QOS_BY_SIZE = m.QOS_BY_SIZE

_IOPRIO_WHO_PROCESS = 1  # with who=0: the calling thread
_IOPRIO_CLASS_SHIFT = 13
_IOPRIO_CLASS_IDLE = 3
_SYSCALLS = {"x86_64": (251, 252), "aarch64": (30, 31)}  # ioprio_set, ioprio_get


def _syscalls() -> tuple[ctypes.CDLL, int, int] | None:
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None or not platform.system() == "Linux":
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    return libc, numbers[0], numbers[1]


_IOPRIO = _syscalls()


def bulk_limiter() -> trio.CapacityLimiter | None:
    """The limiter a server's bulk writes run under (None: unlimited)."""
    slots = int_setting("STRIPEFS_BULK_SLOTS", BULK_SLOTS)
    return trio.CapacityLimiter(slots) if slots > 0 else None


def background_limiter() -> trio.CapacityLimiter | None:
    """The limiter background-class writes take before their bulk slot (None: unlimited)."""
    slots = int_setting("STRIPEFS_BACKGROUND_SLOTS", BACKGROUND_SLOTS)
    return trio.CapacityLimiter(slots) if slots > 0 else None


def is_bulk(nbytes: int, qos: int = QOS_BY_SIZE) -> bool:
    """Is a write of ``nbytes`` in class ``qos`` scheduled as bulk (a slot, idle I/O)?"""
    return qos != QOS_BY_SIZE or nbytes >= BULK_WRITE


@contextlib.contextmanager
def idle_io(nbytes: int, qos: int = QOS_BY_SIZE) -> Iterator[None]:
    """Run the block at idle I/O priority when it is a bulk write (this thread only)."""
    if not is_bulk(nbytes, qos) or _IOPRIO is None:
        yield
        return
    libc, set_nr, get_nr = _IOPRIO
    before = libc.syscall(get_nr, _IOPRIO_WHO_PROCESS, 0)
    lowered = before >= 0 and libc.syscall(set_nr, _IOPRIO_WHO_PROCESS, 0,
                                           _IOPRIO_CLASS_IDLE << _IOPRIO_CLASS_SHIFT) == 0
    try:
        yield
    finally:
        if lowered:
            libc.syscall(set_nr, _IOPRIO_WHO_PROCESS, 0, before)
