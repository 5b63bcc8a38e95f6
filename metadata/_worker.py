"""Store threads: where the metadata service's namespace work runs, off the trio loop.

A :class:`StoreThread` is one long-lived thread fed by a queue. Whatever queued
while it ran a batch becomes its next batch: for the writer that is the group
commit (one durable commit per batch), for the reader one wake-up for many
reads. Results go back to the loop with one ``run_sync_soon`` per batch, so a
request costs one queue hand-off each way instead of a ``trio.to_thread`` call
(measured: ~150 us per hop on a 2-core VM against ~30 us here).

Caveats:

* The thread belongs to the task running :meth:`StoreThread.run`; when that task
  is cancelled the thread finishes the batch in hand and exits, and ``run`` returns
  once it has (after ``STOP_WAIT`` seconds at most): the caller may then close the
  store, no thread still uses it.
* A job whose awaiting task was cancelled still runs (the store's transaction is
  not interruptible); its result is dropped.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from typing import Any, Callable

import trio

STOP_WAIT = 30.0  # seconds a cancelled run waits for the batch in hand (a commit's fsync)


class Job:
    """One unit of store work and, once run, its result or exception."""

    __slots__ = ("fn", "result", "exc", "done", "on_done")

    def __init__(self, fn: Callable[[], Any], on_done: Callable[[], None] | None = None):
        self.fn = fn
        self.result: Any = None
        self.exc: BaseException | None = None
        self.done = trio.Event()
        self.on_done = on_done


def run_each(jobs: list[Job]) -> None:
    """Run jobs one by one, each failing alone (the reader's batch: no transaction around it)."""
    for job in jobs:
        try:
            job.result = job.fn()
        except Exception as exc:
            job.exc = exc


def _deliver(jobs: list[Job]) -> None:
    for job in jobs:
        job.done.set()
        if job.on_done is not None:
            job.on_done()


class _Life:
    """Whether a store thread started, and when it stopped: ``start`` (the thread) and
    ``end`` (its owner, cancelled) decide under one lock which came first."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started = self._ended = False
        self.stopped = threading.Event()

    def start(self) -> bool:
        """True: run (the owner waits for :attr:`stopped`); False: the owner left already."""
        with self._lock:
            self._started = not self._ended
            return self._started

    def end(self) -> bool:
        """True when the thread started, so the owner must wait for it to stop."""
        with self._lock:
            self._ended = True
            return self._started


class StoreThread:
    """A dedicated thread running ``run_batch(jobs)`` on batches of at most ``max_batch`` jobs.

    Args:
        run_batch: runs every job of a batch and fills in ``result``/``exc``.
        max_batch: most jobs per batch.
    """

    def __init__(self, run_batch: Callable[[list[Job]], None], max_batch: int):
        self._run_batch = run_batch
        self.max_batch = max_batch
        self._q: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self.jobs_run = 0  # jobs handed to the thread so far (how many hand-offs the loop made)

    async def submit(self, fn: Callable[[], Any], on_done: Callable[[], None] | None = None) -> Any:
        """Run ``fn()`` on the thread; its result, or its exception raised here.

        ``on_done()`` runs on the loop once the job ran, even if this call was cancelled."""
        job = Job(fn, on_done)
        self._q.put(job)
        await job.done.wait()
        if job.exc is not None:
            raise job.exc
        return job.result

    async def run(self) -> None:
        """Serve jobs until cancelled; then wait for the batch in hand (see Caveats)."""
        token = trio.lowlevel.current_trio_token()
        life = _Life()
        try:
            await trio.to_thread.run_sync(self._loop, token, life, abandon_on_cancel=True)
        finally:
            self._q.put(None)  # the abandoned thread exits after the batch in hand
            if life.end():  # it started: wait for it (one cancelled before it started never will)
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(life.stopped.wait, STOP_WAIT)

    def _loop(self, token: trio.lowlevel.TrioToken, life: _Life) -> None:
        if not life.start():
            return
        try:
            self._serve(token)
        finally:
            life.stopped.set()

    def _serve(self, token: trio.lowlevel.TrioToken) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            jobs, stop = [job], False
            while len(jobs) < self.max_batch:
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                jobs.append(nxt)
            self._run_batch(jobs)
            self.jobs_run += len(jobs)
            try:
                token.run_sync_soon(_deliver, jobs)
            except trio.RunFinishedError:
                return
            if stop:
                return


class LogSync:
    """Group fsync: commits made on the loop become durable together, on one thread.

    The loop commits (a write of the log to the page cache), then awaits :meth:`durable`.
    The thread runs ``sync()`` (an fsync of the log) whenever a commit waits: every
    commit made before an fsync starts is acknowledged when that fsync returns; commits
    arriving while one runs wait for the next. One fsync serves as many commits as the
    loop made meanwhile. The request to the thread leaves once the tasks that were ready
    to run alongside the first waiting commit have run too (two passes of the scheduler,
    no system call): requests that arrived together commit together.

    A failed fsync leaves the log in doubt (the kernel may have dropped the pages it
    could not write): every waiter then, and every later :meth:`durable`, raises
    :attr:`failed`'s error -- the owner stops acknowledging mutations until restarted.

    Args:
        sync: makes every commit that returned before it was called durable.
    """

    def __init__(self, sync: Callable[[], None]):
        self._sync = sync
        self._cond = threading.Condition(threading.Lock())
        self._wanted = 0  # the newest commit waiting (a sequence number; thread: under _cond)
        self._taken = 0  # the newest commit an fsync started for (thread only)
        self._stop = False
        self.committed = 0  # commits made (loop)
        self.synced = 0  # the newest commit known durable (loop)
        self.syncs = 0  # fsyncs run (loop's count)
        self.failed: OSError | None = None
        self._waiters: deque[tuple[int, trio.Event]] = deque()
        self._asked = trio.Event()  # a commit waits: the kicker asks the thread (run)

    async def durable(self) -> None:
        """Return once every commit made so far on the loop is durable.

        Raises:
            OSError: an fsync failed (now or before): the commit may not be durable.
        """
        if self.failed is not None:
            raise self.failed
        self.committed += 1
        await self._until(self.committed)

    @property
    def settled(self) -> bool:
        """Every commit made on the loop so far is durable."""
        return self.synced >= self.committed

    async def caught_up(self) -> None:
        """Return once every commit made on the loop so far is durable, without adding one:
        what a read saw of them may be told (a commit is visible before its fsync).

        Raises:
            OSError: an fsync failed (now or before).
        """
        if self.failed is not None:
            raise self.failed
        if self.synced < self.committed:
            await self._until(self.committed)

    async def _until(self, seq: int) -> None:
        """Wait for the fsync that covers commit ``seq`` (the thread is asked for one)."""
        done = trio.Event()
        self._waiters.append((seq, done))  # in order: every waiter queued has seq <= committed
        self._asked.set()
        await done.wait()
        if self.failed is not None and self.synced < seq:
            raise self.failed

    async def run(self) -> None:
        """Run the sync thread until cancelled (an fsync in progress finishes first)."""
        token = trio.lowlevel.current_trio_token()
        life = _Life()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._kicker)
                await trio.to_thread.run_sync(self._loop, token, life, abandon_on_cancel=True)
        finally:
            with self._cond:
                self._stop = True
                self._cond.notify()
            if life.end():
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(life.stopped.wait, STOP_WAIT)

    async def _kicker(self) -> None:
        """Ask the thread for an fsync covering every commit made so far, once the tasks
        ready to run beside the first waiting commit have had their turn."""
        while True:
            await self._asked.wait()
            self._asked = trio.Event()
            await trio.lowlevel.checkpoint()  # the tasks ready now run (and may commit) first
            with self._cond:
                self._wanted = self.committed
                self._cond.notify()

    def _loop(self, token: trio.lowlevel.TrioToken, life: _Life) -> None:
        if not life.start():
            return
        try:
            while True:
                with self._cond:
                    while self._wanted <= self._taken and not self._stop:
                        self._cond.wait()
                    if self._stop:
                        return
                    target = self._taken = self._wanted
                error = None
                try:
                    self._sync()
                except OSError as exc:
                    error = exc
                try:
                    token.run_sync_soon(self._done, target, error)
                except trio.RunFinishedError:
                    return
        finally:
            life.stopped.set()

    def _done(self, target: int, error: OSError | None) -> None:
        """On the loop: every commit up to ``target`` is durable (or, with ``error``, in doubt)."""
        self.syncs += 1
        if error is not None and self.failed is None:
            self.failed = error
        if self.failed is None:
            self.synced = max(self.synced, target)
        waiters = self._waiters
        while waiters and (waiters[0][0] <= target or self.failed is not None):
            waiters.popleft()[1].set()
