"""Garbage collection: the chunks of removed files, the tails of truncated ones, chains left behind.

The namespace queues garbage in the store as it goes (``Namespace.garbage``): a removed
file's layout, a truncation's new length. :class:`Collector` makes storage servers act on
it, as a server of the cluster (its own pool of connections, one call at a time per
server):

* a **truncation** (a *cut*) is applied before the truncating request is answered
  (:meth:`Collector.truncate_chunks`), and its queue entry cleared then
  (``Namespace.cut_done``). One that failed stays queued: the leader retries it at every
  pass, oldest first, until it lands (``Namespace.cuts_applied``, which tells writers
  that wrote before it). Meanwhile the file may not grow (``Namespace.commit_length``
  refuses, a growing ``SetAttr`` applies the cut first: :meth:`Collector.cut_pending`),
  so the bytes it drops are never inside the size;
* a **removal** waits ``GC_GRACE`` seconds first (a reader that opened the file before
  the unlink finishes reading real bytes), then every online target of its chains
  deletes its chunks (:meth:`Collector.collect`, on the leader);
* a server that **left a chain** (``Membership.drops``) deletes its copy once every
  server and client has had ``DROP_GRACE`` seconds to see the new routing
  (:meth:`Collector.drop_moved_chains`).

Offline targets are skipped (a returning server resyncs from a serving peer, which no
longer holds what was dropped); a chain with no target online postpones the removal.
A cut goes down each chain from its head, ordered with the chain's writes (see
``storage.Replicator.cut``); a target that fails it goes offline
(``Membership.take_offline``) and the chain is asked again, so the targets after it get
it too; when no serving target of a chain has the cut, the targets
lacking it are *held* (``Membership.hold``): offline while they heartbeat, called directly
at their address once they are back, released when every cut they missed landed.

Caveats:
    * Cuts of one file are applied one at a time within a service (:meth:`_inode_lock`),
      and the collector retries only cuts queued for ``CUT_RETRY_AFTER`` seconds (those of
      the service's previous run at once). With a shared store (PostgreSQL) a follower's
      truncate slower than ``CUT_RETRY_AFTER_SHARED`` may see the leader apply its cut
      too: its writers are then refused their commit, as after a late cut.
"""

from __future__ import annotations

import logging
import math
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable

import trio

from stripefs.rpc import TrioPool
from stripefs.wire import ErrorCode, Message, StripefsError, role_credential
from stripefs.wire import messages as m

from ._commit import CommitPath
from ._membership import HEARTBEAT_FRESH, Membership
from ._namespace import Namespace
from ._store import GarbageItem

__all__ = ["Collector", "GC_GRACE", "GC_INTERVAL"]

log = logging.getLogger(__name__)

GC_INTERVAL = 0.5
# A reserved inode number (``Namespace.reserve_files``) not committed this long after the
# collector first saw it is dropped with whatever chunks its client wrote: the client died,
# or took so long that it must write the file again (its commit then fails ESTALE).
RESERVE_GRACE = 300.0
# Chunks of a removed file stay this long, so clients that opened it before the
# unlink (a reader racing a rename-over) finish reading real bytes, not holes.
GC_GRACE = 30.0
# A server that left a chain keeps its copy this long: every server and client sees the
# new routing first (servers within a heartbeat; clients on STALE_ROUTING).
DROP_GRACE = 5.0
# A queued cut is retried by the collector once it has been queued this long: younger, its
# truncate may still be on its way to cutting it (and clears it once done). Applied again
# meanwhile, it would count as late and fail that truncate's writers. Longer with a shared
# store: the truncate may be cutting on another service, which this one cannot wait for.
CUT_RETRY_AFTER = 1.0
CUT_RETRY_AFTER_SHARED = 10.0
# Tries of one chain's cut: a failed target goes offline and the chain is asked again (its
# targets after the failed one still lack the cut); a STALE_ROUTING answer (a table that
# changed meanwhile) is asked again after a short wait.
CUT_ATTEMPTS = 5
# Seconds a chain's head may take per target of the chain (a storage server's call to its
# successor times out after 30 s: it answers which one failed before we give up on it).
CUT_HOP_TIMEOUT = 30.0
# How often a cut in flight looks whether its head was declared offline meanwhile (paused,
# cut off): then it is asked of the chain's next head at once, not after the timeout.
CUT_WATCH = 0.25


class Collector:
    """Truncations, removals and chain drops, told to the storage servers.

    Args:
        commit: the service's commit path (the garbage queue is read and cleared through it).
        members: the membership in force now (the leader's, or a follower's view of it:
            truncations run on any service): where the chains' targets are.
        secret: the cluster secret (calls go out as a server of the cluster).
        grace: seconds a removed file's chunks are kept (``GC_GRACE``).
        leading: whether this service runs the membership (only it takes servers offline).
        persist: writes the membership once changed (before a failed truncate is answered).
        shared: other services share the store (``CUT_RETRY_AFTER_SHARED``).
        told: tells the holders of attribute leases on these store keys that they changed
            (a late cut moves the file's ``truncations``), and waits for them.
    """

    def __init__(self, commit: CommitPath, members: Callable[[], Membership], secret: str,
                 grace: float = GC_GRACE, *, leading: Callable[[], bool] = lambda: True,
                 persist: Callable[[], Awaitable[None]] | None = None, shared: bool = False,
                 told: Callable[[set[Any]], Awaitable[None]] | None = None) -> None:
        self.commit = commit
        self._members = members
        self.grace = grace
        self._leading = leading
        self._persist = persist
        self._retry_after = CUT_RETRY_AFTER_SHARED if shared else CUT_RETRY_AFTER
        self._shared = shared
        self._told = told
        self._passes = 0
        self._cutting: dict[int, trio.Lock] = {}  # inode -> its cuts, one at a time
        self._first_seen: dict[int, float] = {}
        self._drop_seen: dict[tuple[int, int], float] = {}
        self.due = 0.0  # monotonic time before which a wake-up finds no removal due
        # Calls to storage servers go out as a server of the cluster (GC, DropChain, cuts: one per
        # chain at once, so a few connections per server are kept).
        self.storage = TrioPool(role_credential(secret, "server"), keep=8, role="server")
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

    @asynccontextmanager
    async def _inode_lock(self, ino: int) -> AsyncIterator[None]:
        """One cut of a file at a time in this service: a pending cut re-applied after the
        truncating request cleared it could drop bytes written since."""
        lock = self._cutting.setdefault(ino, trio.Lock())
        try:
            async with lock:
                yield
        finally:
            if not lock.locked() and not lock.statistics().tasks_waiting:
                self._cutting.pop(ino, None)

    async def truncate_chunks(self, attr: Any, length: int) -> Any:
        """Cut a file's chunks to ``length`` before answering the truncating request.

        Synchronous on purpose: applied later it could cut bytes the client wrote after
        the truncate (so a cut that fails stays queued, and the file may not grow until
        it lands). Idempotent, and a no-op beyond the stored bytes, so it is safe whether
        the file shrank or not.

        Returns:
            The file's attributes once its queued cuts are cleared.

        Raises:
            StripefsError: IO when a storage server that holds the bytes did not apply
                the cut (the cut stays queued; the server is kept offline until it did).
        """
        if attr.layout is None:
            return attr
        async with self._inode_lock(attr.ino):
            missing = await self._cut(GarbageItem(0, "truncate", attr.ino, length, attr.layout))
            if missing:
                log.error("truncate of inode %d to %d incomplete: servers %s lack the cut; it stays queued",
                          attr.ino, length, sorted(missing))
                raise StripefsError(ErrorCode.IO, f"truncate could not reach storage servers {sorted(missing)}; "
                                    "the cut is applied when they are back, and the file cannot grow until then")
            _attr, queued = await self.commit.read(Namespace.cuts, attr.ino)
            if any(item.length >= length for item in queued):
                done = await self.commit.apply(self.commit.ns.cut_done, attr.ino, length, attr.truncations)
                return done or attr
        return attr

    async def cut_pending(self, ino: int) -> None:
        """Apply every queued cut of ``ino`` now (a size that grows waits for them).

        Raises:
            StripefsError: IO when one could not be applied.
        """
        _attr, queued = await self.commit.read(Namespace.cuts, ino)
        for item in queued:
            missing = await self._late_cut(item)
            if missing:
                raise StripefsError(ErrorCode.IO, f"inode {ino} has a cut storage servers {sorted(missing)} "
                                    "have not applied (they are offline): it cannot grow until they have")

    def garbage_added(self) -> None:
        """A removal was queued (maybe: every ``CommitFiles`` calls this): it is due after
        the grace period (now, with none). The background task is woken only when that
        makes a pass due sooner, or one is overdue: a wake-up per small file cost the
        service's loop a scheduling round and a cancel scope each, to find nothing due."""
        now = time.monotonic()
        due = now + self.grace
        if due < self.due or self.due <= now:
            self.due = min(self.due, due)
            self.wakeup.set()

    async def collect(self) -> None:
        """Apply the cuts still queued, drop chunks of removed files (after the grace
        period), and release held servers that every queued cut has reached."""
        self.due = math.inf  # removals queued during this pass lower it again
        limit = 1000
        # Held before the queue is read: the cut that held a server is queued before it was held.
        held = set(self._members().held)
        items = await self.commit.read(Namespace.garbage, limit)
        now = time.monotonic()
        # Cuts queued before this service started are retried at once (its first pass), unless
        # other services share the store (one of them may be cutting).
        first_pass, self._passes = self._passes == 0 and not self._shared, self._passes + 1
        # Items come oldest first: when none on a full page was due, those behind it are
        # younger still, and the next pass is due when the first grace ends (a full page of
        # young removals must not make every unlink's wake-up rescan it).
        due, progressed = math.inf, False
        needed: set[int] = set()  # held servers a queued cut still waits for
        every_cut = len(items) < limit  # every queued cut was tried in this pass
        for item in items:
            if item.kind == "truncate":
                seen = self._first_seen.setdefault(item.id, now - (self._retry_after if first_pass else 0))
                if now - seen < self._retry_after:
                    due, every_cut = min(due, seen + self._retry_after), False
                    continue
                try:
                    missing = await self._late_cut(item)
                except StripefsError as exc:
                    log.info("cut of inode %d postponed: %s", item.ino, exc.message)
                    due, every_cut = now, False
                    continue
                if missing:
                    needed |= missing
                    due = now  # retried at the next pass (a held server heartbeats back)
                    continue
                self._first_seen.pop(item.id, None)
                progressed = True
                continue
            seen = self._first_seen.setdefault(item.id, now)
            grace = RESERVE_GRACE if item.kind == "reserved" else self.grace
            if now - seen < grace:
                due = min(due, seen + grace)
                continue
            try:
                await self._apply(item)
            except StripefsError as exc:
                log.info("removal of inode %d (%s) postponed: %s", item.ino, item.kind, exc.message)
                due = now
                continue  # retried on the next pass: removing is idempotent and safe later
            await self.commit.apply(self.commit.ns.garbage_done, item.id)
            self._first_seen.pop(item.id, None)
            progressed = True
        if every_cut and self._leading():
            members = self._members()
            for sid in sorted(held & members.held - needed):
                members.release(sid)
        if len(items) < limit:  # forget items cleared elsewhere (a truncate's own cut)
            ids = {item.id for item in items}
            self._first_seen = {i: t for i, t in self._first_seen.items() if i in ids}
        if progressed and len(items) >= limit:
            due = now  # more wait behind these
        self.due = min(self.due, due)

    async def _late_cut(self, item: GarbageItem) -> set[int]:
        """Apply a queued cut whose truncate was answered already (with an error, or
        before this service restarted). Returns the servers that still lack it."""
        async with self._inode_lock(item.ino):
            attr, queued = await self.commit.read(Namespace.cuts, item.ino)
            if all(q.id != item.id for q in queued):
                return set()  # cleared meanwhile: applying it now could drop newer bytes
            if attr is None or attr.size > item.length:
                # Removed (its removal drops the chunks), or grown past the cut since: only
                # an item queued before cuts stayed queued, whose cut had landed when its
                # truncate was answered. Cutting now could drop acknowledged bytes.
                await self.commit.apply(self.commit.ns.cuts_applied, item.ino, [item.id], False)
                return set()
            missing = await self._cut(item)
            if not missing:
                log.info("cut of inode %d to %d applied late", item.ino, item.length)
                await self.commit.apply(self.commit.ns.cuts_applied, item.ino, [item.id], True)
                if self._told is not None:  # a cached count would fail the next writer's commit
                    await self._told({item.ino})
            return missing

    async def _apply(self, item: Any) -> None:
        """Drop a removed file's chunks on every online target of its chains."""
        layout = item.layout
        table = self._members().table
        chains = set(layout.chains)
        for c in chains:
            if table.get(c) and not self._online(table[c]):
                # Nobody could repair a target of this chain later: it must not come back
                # serving with the bytes this removal was meant to drop.
                raise StripefsError(ErrorCode.UNAVAILABLE, f"chain {c} has no target online")
        # Offline targets are skipped: one returns ``syncing`` (it missed writes) and its
        # resync drops the chunks its serving peer no longer holds. Calling it now would
        # cost a connect timeout per item.
        targets = {t for c in chains for t in self._online(table.get(c, []))}
        # A server that no longer exists has nothing to delete (_call_storage).
        await self._call_all([(sid, m.RemoveChunks(ino=item.ino, from_index=0, forget=True))
                              for sid in sorted(targets)])

    async def _cut(self, item: GarbageItem) -> set[int]:
        """Apply a cut on the targets of the file's chains; returns those that still lack it.

        Each chain's cut goes to its head, which applies it and forwards it down the chain
        like a write (``RemoveChunks`` with ``chain``: see ``storage.Replicator.cut``), so
        every replica sees the chain's writes and the cut in one order. A target that
        failed it goes offline (on the leader) and the chain is asked again, so the targets
        after it get it too. Held targets (offline, heartbeating) are called directly at
        their recorded address: nothing is written to them. A chain is done once a target
        that serves it has the cut: the others resync from it when they return
        (``syncing``). Otherwise every target of the chain without the cut is returned,
        and (on the leader) held. A target that failed goes offline either way, so no
        client reads the bytes it kept.
        """
        layout, cs = item.layout, item.layout.chunk_size
        first = -(-item.length // cs)
        part = (item.length // cs, item.length % cs) if item.length % cs else None
        members = self._members()
        now = members.clock()
        chains = {c: list(members.table.get(c, [])) for c in sorted(set(layout.chains))}
        part_chain = layout.chain_of(part[0]) if part is not None else None
        got: dict[int, set[int]] = {c: {t for t in ts if t not in members.servers} for c, ts in chains.items()}
        failed: dict[int, StripefsError] = {}

        def held(t: int) -> bool:  # offline, kept so by a cut it missed, and heartbeating
            info = members.servers.get(t)
            return (info is not None and info.state == "offline" and t in members.held
                    and now - info.last_seen <= HEARTBEAT_FRESH)

        direct: dict[int, list[Message]] = {}
        for c, ts in chains.items():
            for t in ts:
                if held(t):
                    direct.setdefault(t, [m.RemoveChunks(ino=item.ino, from_index=first, forget=False)])
        if part is not None:
            for t in chains.get(part_chain, []):  # type: ignore[arg-type]
                if t in direct:
                    direct[t].append(m.TruncateChunk(ino=item.ino, index=part[0], length=part[1]))

        async def through(c: int) -> None:
            """The cut of chain ``c``, through its head, until every target in its order has it."""
            for attempt in range(CUT_ATTEMPTS):
                routing = self._members().routing()
                order = routing.forward_order(c)
                if not order:
                    return
                msg = m.RemoveChunks(ino=item.ino, from_index=first, chain=c, routing_version=routing.version,
                                     part=list(part) if c == part_chain and part is not None else None)
                bad = order[0]
                try:
                    reply = await self._call_head(order[0], msg, CUT_HOP_TIMEOUT * (len(order) + 1))
                except StripefsError as exc:
                    if exc.code == ErrorCode.STALE_ROUTING and attempt + 1 < CUT_ATTEMPTS:
                        await trio.sleep(0.05 * (attempt + 1))  # a table changed meanwhile: ask again
                        continue
                    log.warning("cut of inode %d on chain %d: head %d failed it: %s", item.ino, c, bad, exc.message)
                    failed[bad] = exc
                else:
                    if reply is None:
                        return  # the head no longer exists
                    got[c].update(reply.applied or [bad])
                    if not reply.failed:
                        return
                    bad = reply.failed
                    failed[bad] = StripefsError(ErrorCode.UNAVAILABLE, f"replica {bad} of chain {c} failed the cut")
                if not self._leading():
                    return  # a follower cannot take it offline: the leader retries the cut
                # Offline now (no client reads what it kept); the targets after it get the
                # cut at the next attempt, which no longer passes through it.
                self._members().take_offline(bad)

        async def at_held(sid: int, msgs: list[Message]) -> None:
            try:
                for msg in msgs:
                    await self._call_storage(sid, msg)
            except StripefsError as exc:
                log.warning("cut of inode %d on held storage server %d failed: %s", item.ino, sid, exc.message)
                failed[sid] = exc
                return
            for c, ts in chains.items():
                if sid in ts:
                    got[c].add(sid)

        async with trio.open_nursery() as nursery:
            for c in chains:
                nursery.start_soon(through, c)
            for sid, msgs in direct.items():
                nursery.start_soon(at_held, sid, msgs)
        members = self._members()  # (the lead may have changed hands meanwhile)
        leading = self._leading()
        if leading:
            for t in sorted(failed):
                members.take_offline(t)
        missing: set[int] = set()
        for c, ts in chains.items():
            if any(members.serves(c, t) for t in got[c]):
                continue
            missing.update(t for t in ts if t not in got[c] and self._state(t) != "removed")
        if not leading:
            missing.update(failed)  # a follower cannot take them offline: the leader retries
        if leading:
            for t in sorted(missing):
                members.hold(t)
        if leading and (failed or missing) and self._persist is not None:
            try:
                await self._persist()  # before anyone hears of the failure
            except StripefsError as exc:
                log.warning("membership not recorded after a failed cut: %s", exc.message)
        return missing

    async def _call_head(self, server_id: int, msg: m.RemoveChunks, timeout: float) -> m.RemovedReply | None:
        """A cut sent through a chain, to its head (None: the server no longer exists).

        Raises:
            StripefsError: the head's error; UNAVAILABLE as soon as the head is offline in
                the membership (the chain is asked again through its new head).
        """
        address = self._address(server_id)
        if address is None:
            return None
        header: dict[str, Any] | None = None
        error: StripefsError | None = None

        async def call(scope: trio.CancelScope) -> None:
            nonlocal header, error
            try:
                header, _payload = await self.storage.call(server_id, address, msg, timeout=timeout)
            except StripefsError as exc:
                error = exc
            scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call, nursery.cancel_scope)
            while True:
                await trio.sleep(CUT_WATCH)
                info = self._members().servers.get(server_id)
                if info is None or info.state in ("offline", "removed"):
                    nursery.cancel_scope.cancel()
                    break
        if error is not None:
            raise error
        if header is None:
            raise StripefsError(ErrorCode.UNAVAILABLE, f"storage server {server_id} went offline during a cut")
        return m.decode_reply(msg, header)

    def _state(self, sid: int) -> str:
        info = self._members().servers.get(sid)
        return "serving" if info is None else info.state

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
