"""Garbage collection: the chunks of removed files, the tails of truncated ones, chains left behind.

The namespace queues garbage in the store as it goes (``Namespace.garbage``): a removed
file's layout, a truncation's new length. :class:`Collector` makes storage servers act on
it, as a server of the cluster (its own pool of connections, one call at a time per
server):

* a **truncation** is cut before the truncating request is answered
  (:meth:`Collector.truncate_chunks`); its queue entry is only cleared later;
* a **removal** waits ``GC_GRACE`` seconds first (a reader that opened the file before
  the unlink finishes reading real bytes), then every online target of its chains
  deletes its chunks (:meth:`Collector.collect`, on the leader);
* a server that **left a chain** (``Membership.drops``) deletes its copy once every
  server and client has had ``DROP_GRACE`` seconds to see the new routing
  (:meth:`Collector.drop_moved_chains`).

Offline targets are skipped (a returning server resyncs from a serving peer, which no
longer holds what was dropped); a chain with no target online postpones the removal.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable

import trio

from stripefs.rpc import TrioPool
from stripefs.wire import ErrorCode, Message, StripefsError, role_credential
from stripefs.wire import messages as m

from ._commit import CommitPath
from ._membership import Membership
from ._namespace import Namespace
from ._store import GarbageItem

__all__ = ["Collector", "GC_GRACE", "GC_INTERVAL"]

log = logging.getLogger(__name__)

GC_INTERVAL = 0.5
# Chunks of a removed file stay this long, so clients that opened it before the
# unlink (a reader racing a rename-over) finish reading real bytes, not holes.
GC_GRACE = 30.0
# A server that left a chain keeps its copy this long: every server and client sees the
# new routing first (servers within a heartbeat; clients on STALE_ROUTING).
DROP_GRACE = 5.0


class Collector:
    """Truncations, removals and chain drops, told to the storage servers.

    Args:
        commit: the service's commit path (the garbage queue is read and cleared through it).
        members: the membership in force now (the leader's, or a follower's view of it:
            truncations run on any service): where the chains' targets are.
        secret: the cluster secret (calls go out as a server of the cluster).
        grace: seconds a removed file's chunks are kept (``GC_GRACE``).
    """

    def __init__(self, commit: CommitPath, members: Callable[[], Membership], secret: str,
                 grace: float = GC_GRACE) -> None:
        self.commit = commit
        self._members = members
        self.grace = grace
        self._first_seen: dict[int, float] = {}
        self._drop_seen: dict[tuple[int, int], float] = {}
        self.due = 0.0  # monotonic time before which a wake-up finds no removal due
        # Calls to storage servers run one at a time, as a server of the cluster (GC, DropChain).
        self.storage = TrioPool(role_credential(secret, "server"), keep=1, role="server")
        self.wakeup = trio.Event()

    def wake(self) -> None:
        """Run a pass now, not at the next interval (the lead changed hands)."""
        self.wakeup.set()

    async def next_pass(self) -> bool:
        """Wait ``GC_INTERVAL`` seconds, or less when woken. Returns whether a pass is due:
        not when woken by an unlink within the grace period (nothing is due yet, and
        listing the queue at every unlink would cost a scan per operation)."""
        with trio.move_on_after(GC_INTERVAL):
            await self.wakeup.wait()
        woken, self.wakeup = self.wakeup.is_set(), trio.Event()
        return not (woken and time.monotonic() < self.due)

    def _address(self, server_id: int) -> tuple[str, int] | None:
        info = self._members().servers.get(server_id)
        return None if info is None or info.state == "removed" else (info.host, info.port)

    async def _call_storage(self, server_id: int, msg: Message) -> bool:
        """One call to a storage server; False when the server no longer exists."""
        address = self._address(server_id)
        if address is None:
            return False
        header, _payload = await self.storage.call(server_id, address, msg)
        m.decode_reply(msg, header)  # a malformed answer is a broken peer (PROTOCOL)
        return True

    async def truncate_chunks(self, attr: Any, length: int) -> None:
        """Cut a file's chunks to ``length`` before answering the truncating request.

        Synchronous on purpose: applied later (by the background collector) it
        could cut bytes the client wrote after the truncate. Idempotent, and a
        no-op beyond the stored bytes, so it is safe whether the file shrank or not.
        """
        if attr.layout is None:
            return
        try:
            await self._apply(GarbageItem(0, "truncate", attr.ino, length, attr.layout))
        except StripefsError as exc:
            log.error("truncate of inode %d to %d incomplete: %s", attr.ino, length, exc.message)
            raise StripefsError(ErrorCode.IO, f"truncate could not reach every storage server: {exc.message}") from exc

    def garbage_added(self) -> None:
        """A removal was queued: it is due after the grace period (now, with none)."""
        self.due = min(self.due, time.monotonic() + self.grace)
        self.wakeup.set()

    async def collect(self) -> None:
        """Drop chunks of removed files (after the grace period).

        Truncations were applied when they were asked for (:meth:`truncate_chunks`);
        their queue entries only need clearing.
        """
        self.due = math.inf  # removals queued during this pass lower it again
        limit = 1000
        items = await self.commit.read(Namespace.garbage, limit)
        now = time.monotonic()
        # Items come oldest first: when none on a full page was due, those behind it are
        # younger still, and the next pass is due when the first grace ends (a full page of
        # young removals must not make every unlink's wake-up rescan it).
        due, progressed = math.inf, False
        for item in items:
            if item.kind == "remove":
                seen = self._first_seen.setdefault(item.id, now)
                if now - seen < self.grace:
                    due = min(due, seen + self.grace)
                    continue
                try:
                    await self._apply(item)
                except StripefsError as exc:
                    log.info("removal of inode %d postponed: %s", item.ino, exc.message)
                    due = now
                    continue  # retried on the next pass: removing is idempotent and safe later
            await self.commit.apply(self.commit.ns.garbage_done, item.id)
            self._first_seen.pop(item.id, None)
            progressed = True
        if progressed and len(items) >= limit:
            due = now  # more wait behind these
        self.due = min(self.due, due)

    async def _apply(self, item: Any) -> None:
        layout = item.layout
        cs = layout.chunk_size
        if item.kind == "remove":
            first, cut = 0, None
        else:
            first = -(-item.length // cs)
            cut = (item.length // cs, item.length % cs) if item.length % cs else None
        table = self._members().table
        chains = set(layout.chains)
        for c in chains:
            if table.get(c) and not self._online(table[c]):
                # Nobody could repair a target of this chain later: it must not come back
                # serving with the bytes this removal or cut was meant to drop.
                raise StripefsError(ErrorCode.UNAVAILABLE, f"chain {c} has no target online")
        # Offline targets are skipped: one returns ``syncing`` (it missed writes) and its
        # resync drops the chunks its serving peer no longer holds and copies those whose
        # length (digest) differs, so removals and cuts reach it then. Calling it now would
        # cost a connect timeout per item and fail truncations that already committed a size.
        targets = {t for c in chains for t in self._online(table.get(c, []))}
        # A server that no longer exists has nothing to delete (_call_storage).
        await self._call_all([(sid, m.RemoveChunks(ino=item.ino, from_index=first, forget=item.kind == "remove"))
                              for sid in sorted(targets)])
        if cut is not None:
            await self._call_all([(sid, m.TruncateChunk(ino=item.ino, index=cut[0], length=cut[1]))
                                  for sid in self._online(table.get(layout.chain_of(cut[0]), []))])

    async def _call_all(self, calls: list[tuple[int, Message]]) -> None:
        """Make the calls in parallel (one slow server costs one wait, not one each).

        Raises:
            StripefsError: the first failure, once every call has finished.
        """
        errors: list[StripefsError] = []

        async def one(sid: int, msg: Message) -> None:
            try:
                await self._call_storage(sid, msg)
            except StripefsError as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            for sid, msg in calls:
                nursery.start_soon(one, sid, msg)
        if errors:
            raise errors[0]

    def _online(self, targets: list[int]) -> list[int]:
        """The targets not known to be offline (serving, syncing, or not known at all)."""
        servers = self._members().servers
        return [t for t in targets if t not in servers or servers[t].state != "offline"]

    async def drop_moved_chains(self) -> None:
        """Tell servers that left a chain to delete its chunks, once everyone has the new routing."""
        now = time.monotonic()
        for item in list(self._members().drops):
            if now - self._drop_seen.setdefault(item, now) < DROP_GRACE:
                continue
            try:
                await self._call_storage(item[0], m.DropChain(chain=item[1]))  # gone: nothing to drop
            except StripefsError as exc:
                log.info("dropping chain %d on server %d postponed: %s", item[1], item[0], exc.message)
                continue
            self._members().add_drop_done(item)
            self._drop_seen.pop(item, None)
