"""The commit path: where the metadata service's store work runs, and in which order a
mutation is applied, made visible, made durable and answered.

:class:`CommitPath` owns every thread and connection of the store:

* the **writer thread** (``_worker.StoreThread``) runs operations in batches, each in
  its own savepoint (it fails alone), the batch committed once: group commit, one
  durable commit shared by whatever queued while the last batch ran. A batch that lost
  a serialization race with another service (PostgreSQL) runs again
  (``MAX_BATCH_RETRIES``); one that failed as a whole fails each of its operations;
* the **reader thread**, on a read connection of its own (``Store.reader``): the reads
  that cost more than ``INLINE_COST``. It never waits behind a batch's commit, and sees
  every write acknowledged before the read started;
* the **loop's read connection**: the short reads, answered at once on the trio loop
  (:meth:`CommitPath.read_now`);
* the **log sync thread** (``_worker.LogSync``; SQLite under ``--metadata-sync full``):
  one fsync of the log covers every commit made on the loop before it started;
* **checkpoints** of the log, on the writer thread every ``CHECKPOINT_EVERY`` commits.

A mutation (:meth:`CommitPath.apply`) goes through these steps, in this order:

1. **applied and committed**: on a SQLite store a single-path mutation commits on the
   loop (``SqliteStore.commit_unsynced``: the log written to the page cache), while the
   writer thread holds no work, so that it stays in order with it, and only when that
   commit needs no fsync; anything else (a mutation of many paths, a commit that would
   fsync, a store shared by several services) joins the writer's next batch. On a
   shared store a request's first operation is applied at most once, across services:
   :func:`~metadata._replay.apply_once` records its result in the same commit;
2. **seen by reads, not yet told**: every read (the loop's, the reader thread's,
   another service's) runs on the last committed state, so under SQLite a read may see
   a commit before its fsync has made it durable. Under ``full`` no answer that rests on
   it leaves before it is durable: a read's answer, and a mutation's refusal (``EEXIST``
   for a name made a moment ago), wait in :meth:`CommitPath.visible` for the fsyncs that
   cover what the store showed them; while a commit waits for its fsync
   (:attr:`CommitPath.settled` false) no read is answered on the loop. The writer thread's
   batches commit at SQLite's FULL (the log fsynced before the commit is published). A
   rename or rmdir drops the loop's remembered directories the moment it commits (``_committed``);
3. **durable**, as far as the store's setting makes anything durable: under ``full`` a
   batch once the writer thread hands it back (its commit fsyncs the log, as SQLite's
   ``synchronous=FULL``), a commit on the loop once :meth:`CommitPath._made_durable`
   returns (a group fsync of the log that started after it); under ``normal`` at its
   commit (it survives a kill -9 of any process, not a power loss); on PostgreSQL at its
   commit (the database's ``synchronous_commit``). ``apply`` returns only then. A failed
   log fsync fails the waiting mutations, and every later one, with ``EIO`` until the
   service restarts;
4. **visible to cached copies** and **answered**, by ``MetadataService.handle`` (the
   steps between durable and answered belong there): a truncation cuts the chunks on the
   storage servers (in ``_dispatch``); the membership row is written if the request
   changed it; every other client holding a lease on a store key the mutation wrote
   (:data:`TOUCHED` on SQLite; on a shared PostgreSQL store the keys are published with
   the commit and every service tells its own holders, ``_leasebus.py``) is told, and
   acknowledges or its lease runs out; the answer is recorded for retries
   (``_replay.Replies``) and sent.

Caveats:
    * Stores without a reader (in-memory; PostgreSQL for now) run reads in the write
      batches.
    * A job whose awaiting task was cancelled still runs (``_worker.py``).
"""

from __future__ import annotations

import contextvars
import functools
import logging
import random
import time
from typing import Any, Awaitable, Callable

import trio

from stripefs.wire import ErrorCode, StripefsError

from . import _stats
from ._namespace import Namespace
from ._replay import apply_once
from ._sqlite import SqliteStore
from ._worker import Job, LogSync, StoreThread, run_each

__all__ = ["CommitPath", "REQUEST", "TOUCHED", "INLINE_COST", "MAX_BATCH_RETRIES"]

log = logging.getLogger(__name__)

MAX_BATCH = 256  # operations per group commit
MAX_BATCH_RETRIES = 8  # reruns of a batch that lost a serialization race (PostgreSQL)

# Reads whose cost is bounded by ``INLINE_COST`` run at once on the trio loop, on a read
# connection of their own, instead of going through the reader thread. Costs are in units of
# ~0.5 us, what one name of a listing costs (measured on a 2-core VM, the pages in memory).
# A stat (4 statements) costs ~25 us in SQLite; the hand-off to a thread and back costs ~40 us
# alone and ~150 us under load (the GIL passes between the threads at every SQLite step). The
# longest read run here (a page of 2,000 names) holds the loop ~1 ms, about as long as the
# same read holds the GIL on the thread; longer ones (big pages with attributes, StatMany of
# many paths) keep the thread. What each read costs: ``_reads.py``.
INLINE_COST = 2500
# Under ``--metadata-sync normal`` a mutation commits on the loop (no fsync: a write of the
# log to the page cache), saving the hand-off to the writer thread and back; the log is then
# checkpointed on the writer thread after this many commits (SQLite's automatic checkpoint,
# run inside a commit, fsyncs: ~1,000 pages, what this many creates write).
CHECKPOINT_EVERY = 256
# A read on the loop waits this long at most for a lock (only a log recovery holds one
# against WAL readers); past it the read goes to the reader thread, which waits longer.
INLINE_BUSY_TIMEOUT = 0.005

# The (client id, request id) of the mutation the current task applies: ``CommitPath.apply``
# records its result in the store under that key (see ``_replay.apply_once``).
REQUEST: contextvars.ContextVar[tuple[bytes, int] | None] = contextvars.ContextVar("request", default=None)
# The store keys the current mutation wrote (``SqliteStore.touched``), when a SQLite store grants
# leases (a shared PostgreSQL store publishes them instead, ``_leasebus.py``):
# their leases are invalidated once it committed, before it is answered (``MetadataService.handle``).
TOUCHED: contextvars.ContextVar[set[Any] | None] = contextvars.ContextVar("touched", default=None)


def _nothing() -> None:
    return None


class CommitPath:
    """The store threads and connections of one metadata service (see the module docstring).

    Args:
        ns: the namespace on the service's store (its writing connection).
        shared: other services share the store: mutations are applied once across them.
    """

    def __init__(self, ns: Namespace, *, shared: bool) -> None:
        self.ns = ns
        self.shared = shared
        # Writes go to one store thread in batches (group commit); reads, when the store
        # has a reader, to another, on their own connection: they never wait behind a
        # batch's durable commit, and see every write acknowledged before they started.
        self._writer = StoreThread(self._run_batch, MAX_BATCH)
        self._writing = 0  # writer-thread jobs queued or running: the loop leaves the connection alone
        # Mutations commit on the loop, a write of the log to the page cache (``CHECKPOINT_EVERY``);
        # under ``full`` they are acknowledged once a group fsync of the log covers them.
        store = ns.store
        self._write_now = isinstance(store, SqliteStore)
        self._log_sync: LogSync | None = None
        if isinstance(store, SqliteStore):
            store.sync_log_by_owner()
            if store.log_by_owner:
                self._log_sync = LogSync(_stats.timed_sync(store.sync_log))
        self._checkpoint_due = trio.Event()
        reader = ns.store.reader()
        self._rns = ns.reading(reader) if reader is not None else ns
        self._reader = StoreThread(run_each, MAX_BATCH) if reader is not None else None
        # Short reads run on the loop itself (``INLINE_COST``), on a third connection.
        now_reader = ns.store.reader(busy_timeout_s=INLINE_BUSY_TIMEOUT) if reader is not None else None
        self._lns = ns.reading(now_reader, remember_dirs=True) if now_reader is not None else None
        # The same connection without remembered directories, for the loop's reads while a
        # batch that may rename or remove a directory is on the writer thread (_moving_dirs).
        self._lns_plain = ns.reading(now_reader) if now_reader is not None else None
        self._moving_dirs = 0
        if isinstance(store, SqliteStore):
            # The one writer's path walks remember directories too (a create in a known
            # directory reads no entry of its path); a batch rolled back forgets them (_run_batch).
            ns.remember_dirs()

    async def apply(self, fn: Callable[..., Any], *args: Any, _now: bool = True,
                    _committed: Callable[[], None] | None = None, **kwargs: Any) -> Any:
        """Run one namespace operation; operations queued meanwhile commit together.

        Inside a mutation on a shared store the first call is applied at most once per
        request id, across services (``_replay.apply_once``). ``_now``: it may commit here on the
        loop (False for operations on many paths: too long). Returns once the operation
        is durable, either way: the writer thread's batch fsyncs before it answers, a
        commit on the loop waits in :meth:`_made_durable`. ``_committed``: called as soon as
        the operation committed on the loop, before anything else runs there (a rename's
        remembered directories go before any read can walk them); on the writer thread,
        once its job ran (the loop's reads walk without them meanwhile: _store_call_moving).
        """
        if self._log_sync is not None and self._log_sync.failed is not None:
            raise StripefsError(ErrorCode.IO, f"metadata log could not be made durable: {self._log_sync.failed}; "
                                "restart the metadata service")
        call = self.store_call if _committed is None else functools.partial(self._store_call_moving, _committed)
        key = REQUEST.get()
        if key is not None and self.shared:
            REQUEST.set(None)  # later calls of the same request are not the mutation itself
            return await call(apply_once, self.ns.store, key, functools.partial(fn, *args, **kwargs))
        touched = TOUCHED.get()
        if touched is not None:
            fn, args, kwargs = self._recorded, (touched, functools.partial(fn, *args, **kwargs)), {}
        if _now and self._write_now and not self._writing:
            done, result = self._commit_now(functools.partial(fn, *args, **kwargs))
            if done:
                if _committed is not None:
                    _committed()
                await self._made_durable()
                return result
        return await call(fn, *args, **kwargs)  # durable when it returns

    async def _made_durable(self) -> None:
        """Return once the commits made on the loop so far are durable (``full``: the group
        fsync of the log that covers them; ``normal``: at once). Nothing a mutation did is
        answered before this (nor recorded for replay: ``MetadataService.handle``).

        Raises:
            StripefsError: IO when the log could not be fsynced (the mutation may be lost).
        """
        if self._log_sync is not None:
            await _logged(self._log_sync.durable)

    @property
    def log_syncs(self) -> int:
        """Group fsyncs of the log run so far (``full``)."""
        return 0 if self._log_sync is None else self._log_sync.syncs

    def _recorded(self, touched: set[Any], fn: Callable[[], Any]) -> Any:
        """``fn()``, adding the store keys it writes to ``touched`` (on whichever thread runs it)."""
        store = self.ns.store
        assert isinstance(store, SqliteStore)
        store.touched = touched
        try:
            return fn()
        finally:
            store.touched = None

    def _commit_now(self, fn: Callable[[], Any]) -> tuple[bool, Any]:
        """``(True, fn())`` committed here on the loop when that needs no fsync, else
        ``(False, None)``, nothing applied: the writer thread runs it."""
        store = self.ns.store
        assert isinstance(store, SqliteStore)
        try:
            done, result = store.commit_unsynced(fn)
        except StripefsError:
            raise
        except Exception:  # noqa: BLE001 -- the store failed (e.g. disk full): the thread's batch reports it
            return False, None
        if store.unchecked >= CHECKPOINT_EVERY:
            self._checkpoint_due.set()
        return done, result

    async def store_call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` in the writer's next batch (group commit)."""
        self._writing += 1  # until the job ran, even if this caller is cancelled meanwhile
        return await self._stored(self._writer, lambda: fn(*args, **kwargs), self._written)

    def _written(self) -> None:
        self._writing -= 1

    async def _store_call_moving(self, committed: Callable[[], None], fn: Callable[..., Any], *args: Any,
                                 **kwargs: Any) -> Any:
        """:meth:`store_call` for a mutation that may rename or remove a directory.

        The writer thread's commit shows to the loop's read connection at once, but the
        loop hears of it only later: until then its path walks must not follow the
        directory entries they remember (a renamed directory would still be found under
        its old name, though a read already saw the same commit's other changes). They walk
        without them until the job ran; then ``committed()`` (it forgets them) runs on the
        loop before anything else there."""
        self._writing += 1
        self._moving_dirs += 1

        def done() -> None:
            self._written()
            self._moving_dirs -= 1
            committed()

        return await self._stored(self._writer, lambda: fn(*args, **kwargs), done)

    @property
    def settled(self) -> bool:
        """Nothing a read could see is waiting for its fsync: every commit so far is durable."""
        return self._log_sync is None or self._log_sync.settled

    async def visible(self) -> None:
        """Return once everything a read may have seen so far is durable.

        Under ``full`` with the log fsynced by this service (``LogSync``), SQLite shows a
        commit made on the loop to every reader as soon as it is made, and the next group
        fsync makes it durable. A power loss between the two would undo a mutation some
        client was already told of -- by a read that saw it, or by a refusal that rested on
        it (``EEXIST`` for a name made a moment ago). So every answer that is not the
        mutation's own waits here first: visible means durable. (The writer thread's batches
        commit at SQLite's FULL, which publishes a commit only after its fsync:
        ``SqliteStore._begin``.) Quiet stores (:attr:`settled`) cost nothing.

        Raises:
            StripefsError: IO when the log could not be fsynced.
        """
        if self._log_sync is not None and not self._log_sync.settled:
            await _logged(self._log_sync.caught_up)

    async def read(self, fn: Callable[..., Any], *args: Any, cost: int | None = None) -> Any:
        """Run the read-only ``Namespace`` method ``fn`` (unbound) on a reader, never
        behind a write batch's commit; stores without a reader run it in the write batch.

        Args:
            cost: the most ``fn`` costs, when its arguments bound it (``INLINE_COST``'s
                units): up to ``INLINE_COST`` it runs at once, here on the loop.
        """
        if self._reader is None:
            return await self.store_call(fn, self.ns, *args)
        if cost is not None:
            done, result = self.read_now(fn, args, cost)
            if done:
                return result
        rns = self._rns
        return await self._stored(self._reader, lambda: fn(rns, *args))

    @property
    def reads_now(self) -> bool:
        """Whether short reads run on the loop (:meth:`read_now`): a store with a reader."""
        return self._lns is not None

    def read_now(self, fn: Callable[..., Any], args: tuple[Any, ...], cost: int) -> tuple[bool, Any]:
        """``(True, fn(...))`` run here on the loop's read connection when ``cost`` allows,
        else ``(False, None)``: the read goes to the reader thread.

        Raises:
            StripefsError: the read's own error.
        """
        if cost > INLINE_COST or self._lns is None:
            return False, None
        lns = self._lns if not self._moving_dirs else self._lns_plain
        try:
            return True, fn(lns, *args)
        except StripefsError:
            raise
        except Exception:  # noqa: BLE001 -- e.g. SQLITE_BUSY during a log recovery: the thread waits it out
            return False, None

    def forget_dirs(self) -> None:
        """A directory may have been renamed or removed (committed, nobody told yet): the
        loop's reads forget the directory entries they remember."""
        if self._lns is not None:
            self._lns.forget_dirs()

    @staticmethod
    async def _stored(thread: StoreThread, fn: Callable[[], Any], on_done: Callable[[], None] | None = None) -> Any:
        try:
            return await thread.submit(fn, on_done)
        except StripefsError:
            raise
        except Exception as exc:  # the store itself failed (PostgreSQL went away)
            raise StripefsError(ErrorCode.IO, f"metadata store failed: {exc}") from exc

    async def run(self) -> None:
        """Run the store threads until cancelled. Group commit: every write that arrived
        while the last batch ran goes into the next one -- one durable commit (fsync)
        per batch. With one client nothing changes; with many, the fsync cost is shared.
        Once it returns no thread uses the store any more: the owner may close it."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._writer.run)
            if self._reader is not None:
                nursery.start_soon(self._reader.run)
            if self._log_sync is not None:
                nursery.start_soon(self._log_sync.run)
            if self._write_now:
                nursery.start_soon(self._checkpoints)

    async def _checkpoints(self) -> None:
        """Checkpoint the log on the writer thread when commits on the loop call for it."""
        while True:
            await self._checkpoint_due.wait()
            self._checkpoint_due = trio.Event()
            await self.store_call(_nothing)  # the batch ends with the checkpoint (_run_batch)

    def _run_batch(self, jobs: list[Job]) -> None:
        store = self.ns.store
        _stats.COMMIT_BATCH.observe(len(jobs))
        for attempt in range(MAX_BATCH_RETRIES + 1):
            for job in jobs:
                job.result, job.exc = None, None
            try:
                with store.batch():
                    for job in jobs:
                        try:
                            job.result = job.fn()
                        except Exception as exc:
                            if store.retryable(exc):  # lost a race with another service: rerun the batch
                                raise
                            job.exc = exc  # this operation fails alone (its savepoint rolled back)
                if self._write_now and getattr(store, "unchecked", 0) >= CHECKPOINT_EVERY:
                    self._checkpoint(store)
                return
            except Exception as exc:  # nothing of the batch is durable
                self.ns.forget_dirs()  # a directory it renamed may be remembered under its new name
                if store.retryable(exc) and attempt < MAX_BATCH_RETRIES:
                    time.sleep(random.uniform(0, 0.002 * 2 ** attempt))  # worker thread: spread the rerun
                    continue
                for job in jobs:
                    if job.exc is None or not isinstance(job.exc, StripefsError):
                        job.result = None
                        job.exc = StripefsError(ErrorCode.IO, f"metadata commit failed: {exc}")
                return

    @staticmethod
    def _checkpoint(store: Any) -> None:
        try:
            store.checkpoint()
        except Exception:  # the next commits call for it again
            log.warning("checkpoint of the metadata log failed", exc_info=True)


async def _logged(wait: Callable[[], Awaitable[None]]) -> None:
    """``await wait()``, a wait for the log's fsync, its failure as the IO error clients get.

    Raises:
        StripefsError: IO when the log could not be fsynced (what waited may be lost).
    """
    try:
        await wait()
    except OSError as exc:
        log.error("fsync of the metadata log failed: %s; mutations are refused until a restart", exc)
        raise StripefsError(ErrorCode.IO, f"metadata log could not be made durable: {exc}") from exc
