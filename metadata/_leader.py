"""Which metadata service leads: a lease in the store, and the membership row it fences.

Several metadata services may share one store (PostgreSQL). Namespace operations run
on any of them (the store's transactions keep them consistent), but the storage
membership and chain table are a state machine (:class:`~metadata._membership.Membership`)
that exactly one of them runs at a time: the **leader**, holder of the lease row
``metadata-leader`` in the store's ``locks`` table (the same leases clients take,
:mod:`metadata._locks`). The leader renews it every :data:`RENEW` seconds for
:data:`TTL` seconds; when it dies (``kill -9``) another service takes the lease once it
expires, loads the membership row and carries on, within ``TTL + RENEW`` seconds.

Fencing: every write of the membership row checks, in the same transaction, that the
lease is still this service's, with the token it took it with. A paused ex-leader
that wakes up after another took over cannot write an older chain table over the new
one; it finds out and steps down.

The others keep a read-only view of the row (refreshed on routing reads and every
:data:`RENEW` seconds) to answer routing, statfs and status, to pick a new file's
chains once the table is frozen, and to cut chunks on truncate.

Caveats:
    * Lease expiry compares the services' wall clocks (``time.time_ns``): they must
      agree to well under ``TTL`` (one machine, or NTP).
    * A SQLite store is one process's file: its single service always leads (no lease).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from stripefs.wire import ErrorCode, StripefsError

from ._locks import Leases
from ._store import LockRow, Store

log = logging.getLogger(__name__)

__all__ = ["LEADER_KEY", "RENEW", "TTL", "Leadership"]

LEADER_KEY = "metadata-leader"
TTL = 4.0  # seconds a lease lasts without renewal
RENEW = 1.0  # seconds between renewals (and between takeover attempts)

Run = Callable[..., Awaitable[Any]]


class Leadership:
    """The lease of one metadata service and the membership it runs or views.

    Args:
        store: the shared store.
        run: runs a blocking store function on the service's store thread (its
            group-commit queue) and returns its result.
        make_members: builds a :class:`Membership` from a document (``None``: a new
            cluster) and whether this service takes it over (``restarted``).
        legacy_file: an older version's ``servers.json``: imported into the store by
            the first leader that finds no membership row, then renamed ``.imported``.
        solo: always lead, without a lease (a SQLite store: one service by construction).
    """

    def __init__(self, store: Store, run: Run, make_members: Callable[[str | None, bool], Any],
                 legacy_file: str | None = None, *, solo: bool = False) -> None:
        self.store = store
        self.run = run
        self.make_members = make_members
        self.legacy_file = legacy_file
        self.solo = solo
        self.leases = Leases(store)
        self.owner = os.urandom(16)  # replaced by the service's address once it listens
        self.token = 0
        self.leading = False
        self.lease_until = 0.0
        self.members: Any = make_members(None, False)
        self._view_doc: str | None = None
        self._persist_lock = trio.Lock()
        self.on_change: Callable[[], None] = lambda: None

    # -- store functions (run on the store thread) -------------------------------------------
    def _read(self) -> tuple[int, str] | None:
        with self.store.transaction() as txn:
            return txn.get_membership()

    def _write(self, version: int, doc: str, token: int) -> None:
        now = time.time_ns()
        with self.store.transaction() as txn:
            if not self.solo:
                held: LockRow | None = txn.get_lock(LEADER_KEY)
                if held is None or held.owner != self.owner or held.token != token or held.expires_ns <= now:
                    raise StripefsError(ErrorCode.UNAVAILABLE, "this metadata service lost the lead")
            txn.put_membership(version, doc)

    # -- leading ---------------------------------------------------------------------------------
    async def persist(self) -> None:
        """Write the membership row if it changed (the leader, before it answers anyone).

        Raises:
            StripefsError: UNAVAILABLE when the lease is gone (this service steps down);
                IO when the store failed.
        """
        if not (self.leading and self.members.dirty) and not self._persist_lock.locked():
            return  # nothing to write and no write in flight: no lock round (every request calls this)
        async with self._persist_lock:
            members = self.members
            if not self.leading or not members.dirty:
                return
            members.dirty = False
            doc = members.to_doc()  # a snapshot taken on the event loop, written on the store thread
            try:
                await self.run(self._write, members.version, doc, self.token)
            except StripefsError as exc:
                members.dirty = True
                if exc.code == ErrorCode.UNAVAILABLE:
                    await self.step_down(exc.message)
                raise

    async def take_over(self, token: int) -> None:
        """Become the leader: load the membership row (or import ``servers.json``) and own it."""
        row = await self.run(self._read)
        doc, imported = (row[1] if row else None), False
        if row is None and self.legacy_file and os.path.exists(self.legacy_file):
            doc = await trio.to_thread.run_sync(_read_text, self.legacy_file)
            imported = True
        self.token = token
        members = self.make_members(doc, doc is not None)
        members.dirty = True  # the new routing version (or the first row) goes to the store now
        self.members, self.leading = members, True
        self._view_doc = None
        await self.persist()
        if imported:
            assert self.legacy_file is not None
            await trio.to_thread.run_sync(os.replace, self.legacy_file, self.legacy_file + ".imported")
            log.info("imported %s into the store's membership table", self.legacy_file)
        log.info("leading: membership version %d, %d servers", members.version, len(members.servers))
        self.on_change()

    async def step_down(self, why: str) -> None:
        if self.leading:
            log.warning("no longer leading: %s", why)
        self.leading = False
        self.members = self.make_members(None, False)
        self._view_doc = None
        await self.refresh_view()

    async def refresh_view(self) -> None:
        """A follower's view of the leader's row (parsed again only when it changed)."""
        if self.leading:
            return
        row = await self.run(self._read)
        if row is not None and row[1] != self._view_doc and not self.leading:
            self.members = self.make_members(row[1], False)
            self._view_doc = row[1]

    async def keep(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Take, renew or watch the lease forever; ``started`` once the first round is done."""
        if self.solo:
            await self.take_over(0)
            task_status.started()
            await trio.sleep_forever()
        ttl_ns = int(TTL * 1e9)
        first = True
        while True:
            began = trio.current_time()
            row: LockRow | None = None
            why, taken = "", False
            try:
                row = await self.run(self.leases.acquire, LEADER_KEY, self.owner, ttl_ns)
            except StripefsError as exc:
                why, taken = exc.message, exc.code == ErrorCode.WOULD_BLOCK  # another service holds it
            try:
                if row is not None:
                    self.lease_until = began + TTL - RENEW  # a margin for the round trip
                    if not self.leading or row.token != self.token:
                        await self.take_over(row.token)
                elif self.leading and (taken or trio.current_time() > self.lease_until):
                    await self.step_down(why or "lease expired")
                elif not self.leading:
                    await self.refresh_view()
            except StripefsError as exc:  # the store is down: try again next round
                log.warning("leadership round failed: %s", exc.message)
            if first:
                first = False
                task_status.started()
            await trio.sleep(RENEW)

    def require(self) -> None:
        """Raise unless this service leads (messages only the leader may apply)."""
        if not self.leading:
            raise StripefsError(ErrorCode.UNAVAILABLE, "this metadata service does not lead; ask another")


def _read_text(path: str) -> str:
    with open(path) as f:
        return f.read()
