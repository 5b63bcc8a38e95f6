"""Bulk transfers at background CPU priority: a checkpoint burst yields the CPU to small reads.

On a machine whose cores are busy, a dataloader's small read waits less for the disk
than for a core: its request wakes three or four threads (the reader's, the server's
reply thread, the metadata service's), and each wake-up queues behind whatever is
running. A checkpoint burst is that: megabytes of CRC32C and socket and page-cache
copies in the writing client and in every storage server of the chain. Measured on
2 cores, the readers' p99 rose forty-fold during a 256 MiB burst, and only ~1.2× when
the writing side ran at a lower priority (docs/benchmarks.md).

So the bulk part of a write (a payload of at least :data:`BULK` bytes) runs on threads
of a :class:`BackgroundPool`, each lowered by :data:`NICE` steps of ``nice`` once, when it
starts (Linux's nice value is per thread; a process started at nice 0 runs them at 10). The kernel still gives them every idle cycle; under
contention a nice-0 thread outweighs one at nice 10 by about nine to one. Only threads
of our own pools are lowered: a lowered thread cannot be raised back without privilege,
so no shared thread (trio's worker cache, the caller's) is ever touched.

``STRIPEFS_BULK_NICE`` sets the steps (0: off, bulk runs where it is called).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from ._pid import my_pid

__all__ = ["BULK", "NICE", "BackgroundPool", "bulk_nice", "int_setting", "lower_this_thread"]

log = logging.getLogger(__name__)

T = TypeVar("T")

BULK = 1 << 20  # bytes: a transfer at least this large is bulk
NICE = 10


def int_setting(env: str, default: int) -> int:
    """An integer setting from the environment variable ``env`` (``default`` when unset or
    not a number, said in the log)."""
    raw = os.environ.get(env, "")
    try:
        return int(raw) if raw else default
    except ValueError:
        log.warning("%s=%r is not a number: using %d", env, raw, default)
        return default


def bulk_nice() -> int:
    """How many steps of ``nice`` bulk threads run below their process (``STRIPEFS_BULK_NICE``;
    0: bulk is not lowered)."""
    return max(0, min(19, int_setting("STRIPEFS_BULK_NICE", NICE)))


def lower_this_thread(nice: int) -> bool:
    """Lower the calling thread (only it) by ``nice`` steps below where it ran (at most
    to 19, the lowest); False where it cannot."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return False
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError:
        return False
    return True


_local = threading.local()


class BackgroundPool:
    """Worker threads at background CPU priority, made on first use (and again after a fork).

    :meth:`call` runs a function on one and waits (called from a pool thread, it runs in
    place); :meth:`submit` returns its future. With ``nice`` 0 both run in the caller.
    """

    def __init__(self, workers: int, name: str, nice: int | None = None):
        self.workers = max(1, workers)
        self.name = name
        self.nice = bulk_nice() if nice is None else nice
        self._pool: ThreadPoolExecutor | None = None
        self._pid = 0
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.nice > 0

    def _executor(self) -> ThreadPoolExecutor:
        pid = my_pid()
        with self._lock:
            if self._pool is None or self._pid != pid:  # a forked child has no threads of the parent's pool
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix=self.name, initializer=self._start)
                self._pid = pid
            return self._pool

    def _start(self) -> None:
        _local.background = True
        lower_this_thread(self.nice)

    def submit(self, fn: Callable[..., T], *args: Any) -> "Future[T]":
        if not self.enabled or getattr(_local, "background", False):
            fut: Future[T] = Future()
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # delivered through the future, as from a pool thread
                fut.set_exception(exc)
            return fut
        return self._executor().submit(fn, *args)

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        if not self.enabled or getattr(_local, "background", False):
            return fn(*args)
        return self._executor().submit(fn, *args).result()

    def shutdown(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None and self._pid == my_pid():
            pool.shutdown(wait=False)
