"""Chain replication between storage servers.

A chunk belongs to a chain: an ordered list of targets on distinct servers. A
client writes to the chain's head; each target applies the write durably, then
forwards it (with the version the head assigned) to its successor; the tail
answers first and the acknowledgement flows back, so the client's write is
acknowledged only when every target in the chain has it. The head holds a
per-chunk lock for the whole round trip, so writes to one chunk are applied in
the same order everywhere and a retried write is recognised by its version.

Targets that come back after being offline are ``syncing``: they sit at the end
of their chains and receive new writes (a write whose version shows a gap makes
the target fetch the whole chunk from its predecessor first), while a
background task copies every chunk whose version or digest (ChunkMeta.digest)
differs from a serving replica's and drops chunks removed meanwhile. Then the
target reports ``SyncDone`` and serves again. A forwarded write carries the
digest too, so a replica never acknowledges a version it holds with other bytes.
Reads of a chunk whose newest version here is not acknowledged yet go to the
chain's last serving target (CRAQ). Scrub re-reads every chunk and repairs bad
ones from a replica.

A truncation's cut of one chain's chunks travels the same way (:meth:`Replicator.cut`):
to the head, which holds the inode's *cut lock* of that chain exclusively while the cut
goes down the chain (its writes to the chain's chunks of that inode hold it shared, so
chunks created meanwhile are covered too). Every replica thus sees a chain's writes and
cuts in one order: no write is forwarded into a replica cut before the head, and none
created after the head's cut reaches a replica not cut yet.
"""

from __future__ import annotations

import logging
import time
import contextlib
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterator, TypeVar

import trio

from stripefs.rpc import TrioConnection, TrioPool
from stripefs.wire import ErrorCode, Message, ReplyMessage, Routing, StripefsError, role_credential
from stripefs.wire import messages as m

from ._chunks import ChunkMeta, ChunkStore, VersionGap
from ._qos import background_limiter, bulk_limiter, is_bulk

if TYPE_CHECKING:
    from ._metalink import MetadataLink

log = logging.getLogger(__name__)
R = TypeVar("R", bound=ReplyMessage)

POOL_PER_PEER = 8
LIST_PAGE = 8192  # chunks per ListChunks reply: ~50 bytes each, far below the frame limit
PENDING = -1  # a ``dirty`` mark set before the local write knows its version
SETTLE = 3.0  # seconds: > 2 heartbeats, so every peer routes by the table that includes us
# Seconds without an answer from the metadata service after which this server may have been
# declared offline (the failure timeout is 5 s) and left out of writes: reads ask for the
# chain table first, and a resync in progress starts over.
SILENCE = 3.0
CONFIRM_TIMEOUT = 2.0  # seconds a read waits for the metadata service to confirm the chain table
CONFIRM_BACKOFF = 0.5  # seconds reads fail at once after such a wait ran out


async def control_call(conn: "TrioConnection | MetadataLink", msg: Message[R], payload: bytes = b"") -> tuple[R, bytes | bytearray]:
    """One call over a trio control connection, its reply decoded and checked.

    The transport hands the response header up as a plain map; the caller
    knows the request, so the reply is typed here, above the transport.

    Args:
        conn: a connection to the metadata service or a peer storage server.
        msg: the request.
        payload: bytes sent after the header (a forwarded chunk write).

    Returns:
        ``(reply, payload)``: the typed reply and the response payload (a chunk copy).

    Raises:
        StripefsError: the peer's error, UNAVAILABLE/TIMEOUT from the
            transport, PROTOCOL for a malformed reply.
    """
    header, data = await conn.call(msg, payload)
    return m.decode_reply(msg, header), data


def write_reply(msg: m.WriteChunk, meta: ChunkMeta, waited_us: int) -> m.WriteChunkReply:
    """The answer to ``msg``: the wait for its slots only to a writer that named a class
    (older clients take no field they do not know)."""
    return m.WriteChunkReply(length=meta.length, version=meta.version,
                             queued_us=waited_us if msg.qos != m.QOS_BY_SIZE else 0)


class _CutLock:
    """An inode's chunks of one chain: writes hold it shared, a cut exclusively.

    A cut waits for the writes in flight and shuts out new ones (the ``gate``, a fair
    lock, is what shared holders pass through): a stream of writes cannot starve it.
    """

    __slots__ = ("gate", "shared", "idle", "users")

    def __init__(self) -> None:
        self.gate = trio.Lock()
        self.shared = 0
        self.idle = trio.Event()
        self.idle.set()
        self.users = 0


class Replicator:
    def __init__(self, store: ChunkStore, secret: str, meta: "TrioConnection | MetadataLink"):
        self.store = store
        self.secret = secret
        self.meta = meta
        self.server_id: int | None = None
        self.token = ""  # this root's identity token (target.json), sent with SyncDone
        self.routing: Routing | None = None
        # Forwarding runs many calls to a peer at once, as a server of the cluster.
        self.peers = TrioPool(role_credential(secret, "server"), keep=POOL_PER_PEER, role="server")
        self._locks: dict[tuple[int, int], tuple[trio.Lock, int]] = {}
        self._cut_locks: dict[tuple[int, int], _CutLock] = {}  # (ino, chain) -> its cut lock
        self._refresh_lock = trio.Lock()
        self.syncing = False
        self.sync_progress: dict[str, int] = {}
        # CRAQ: chunks whose newest version here is not acknowledged by our successor yet
        # (in flight, or its forward failed). Reads of them go to the chain's last serving
        # target, which holds only what the chain has (see StorageService.handle).
        self.dirty: dict[tuple[int, int], int] = {}
        # When the last heartbeat the metadata service answered was sent (trio clock), which
        # confirms our view of the chain table: see note_heard and StorageService.handle.
        self.heard = -float("inf")
        self._unconfirmed_until = -float("inf")  # a confirm failed: reads fail fast until then
        self._clock: trio.abc.Clock | None = None  # the loop's, for confirmed() on other threads
        self._heard_event = trio.Event()  # set (and replaced) at every answered heartbeat
        self.silences = 0  # how often it went that long without an answer (paused, cut off)
        self.bulk = bulk_limiter()  # bulk local writes (see _qos): few at once, small reads first
        self.background = background_limiter()  # background ones: fewer still, before their bulk slot

    def limiter_for(self, nbytes: int, qos: int = m.QOS_BY_SIZE) -> trio.CapacityLimiter | None:
        """The worker-thread limiter of a local chunk write of ``nbytes`` in class ``qos``:
        bulk ones share :data:`~storage._qos.BULK_SLOTS` slots; others (and reads) trio's default."""
        return self.bulk if is_bulk(nbytes, qos) else None

    async def store_write(self, msg: m.WriteChunk, view: memoryview, version: int | None = None) -> tuple[ChunkMeta, int]:
        """Apply ``msg`` to the local store in a worker thread, under the slots of its class
        (storage/_qos.py); returns the chunk's meta and the microseconds it waited for its
        bulk slot: what other writers' bulk work cost it (the wait for a background slot,
        behind the writer's own uploads, is not counted: a mover must not slow down for
        its own queue)."""
        async with contextlib.AsyncExitStack() as slots:
            if msg.qos == m.QOS_BACKGROUND and self.background is not None:
                await slots.enter_async_context(self.background)
            asked = trio.current_time()
            limiter = self.limiter_for(len(view), msg.qos)
            if limiter is not None:
                await slots.enter_async_context(limiter)
            waited = int((trio.current_time() - asked) * 1e6)
            meta = await trio.to_thread.run_sync(
                self.store.write, msg.ino, msg.index, msg.offset, view, msg.crc, msg.chunk_size, msg.chain, version,
                msg.qos)
        return meta, waited

    # -- routing ----------------------------------------------------------------------------
    async def refresh(self, at_least: int = 0) -> Routing:
        async with self._refresh_lock:
            if self.routing is None or self.routing.version < at_least or at_least == -1:
                # Not a sign of life for the service: a table fetched here says nothing
                # of whether it still counts us as alive (see note_heard).
                reply, _ = await control_call(self.meta, m.GetRouting())
                self.routing = reply.routing
        assert self.routing is not None
        return self.routing

    def note_heard(self, asked: float) -> None:
        """The metadata service answered a heartbeat sent at ``asked`` (trio clock).

        Only heartbeats count: the service declares a server offline ``OFFLINE_AFTER`` (5 s)
        after the last heartbeat it received, and this server serves reads only while its
        last answered heartbeat is less than :data:`SILENCE` (3 s) old -- so it has stopped
        before the service leaves it out of writes. Any other answer (a chain table fetched
        for a resync pass or a client's newer table) proved nothing to the service: counted
        as heard, it let a server whose heartbeats were not getting through serve old bytes
        after the service had declared it offline (a link-fault soak found it)."""
        if asked - self.heard > SILENCE:
            self.silences += 1
        self._clock = trio.lowlevel.current_clock()
        self.heard = max(self.heard, asked)
        self._heard_event.set()
        self._heard_event = trio.Event()

    def confirmed(self, lease: float = SILENCE) -> bool:
        """Did the metadata service answer within ``lease`` seconds (:meth:`confirm` would return at once)?
        Callable from any thread (it reads the loop's clock; False before any answer)."""
        clock = self._clock
        return clock is not None and clock.current_time() - self.heard <= lease

    async def confirm(self, lease: float = SILENCE) -> None:
        """Return once a heartbeat sent within ``lease`` seconds was answered (at once if one was).

        After a silence, a read waits at most :data:`CONFIRM_TIMEOUT` seconds for the
        heartbeat loop (every second) to be answered: a metadata service cut off by a
        network that drops packets silently would otherwise hold every read here for the
        transport's timeouts before the client tried another replica. After a wait that ran
        out, reads fail at once for :data:`CONFIRM_BACKOFF` seconds.

        Raises:
            StripefsError: UNAVAILABLE when no heartbeat was answered in time (the client
                reads from another replica).
        """
        if trio.current_time() - self.heard <= lease:
            return
        self._check_unconfirmed()
        with trio.move_on_after(CONFIRM_TIMEOUT):
            while trio.current_time() - self.heard > lease:
                await self._heard_event.wait()
        if trio.current_time() - self.heard > lease:
            self._unconfirmed_until = trio.current_time() + CONFIRM_BACKOFF
            raise StripefsError(ErrorCode.UNAVAILABLE, f"the metadata service answered no heartbeat within "
                                f"{CONFIRM_TIMEOUT:g} s: this server cannot confirm it still serves the chain")

    def _check_unconfirmed(self) -> None:
        if trio.current_time() < self._unconfirmed_until:
            raise StripefsError(ErrorCode.UNAVAILABLE, "the metadata service did not answer lately: this server "
                                "cannot confirm it still serves the chain")

    # -- peers ------------------------------------------------------------------------------
    async def call_peer(self, sid: int, msg: Message[R], payload: bytes = b"") -> tuple[R, bytes | bytearray]:
        routing = self.routing or await self.refresh()
        info = routing.servers.get(sid)
        if info is None:
            raise StripefsError(ErrorCode.UNAVAILABLE, f"unknown storage server {sid}")
        header, data = await self.peers.call(sid, (info.host, info.port), msg, payload)
        return m.decode_reply(msg, header), data

    @asynccontextmanager
    async def chunk_lock(self, key: tuple[int, int]) -> AsyncIterator[None]:
        lock, users = self._locks.get(key, (None, 0))
        if lock is None:
            lock = trio.Lock()
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock2, users2 = self._locks[key]
            if users2 <= 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock2, users2 - 1)

    @asynccontextmanager
    async def cut_lock(self, ino: int, chain: int, *, exclusive: bool = False) -> AsyncIterator[None]:
        """The cut lock of ``ino``'s chunks of ``chain`` (see :class:`_CutLock`): a head's
        writes and resync copies hold it shared, a cut exclusively. Taken before any chunk lock."""
        key = (ino, chain)
        lock = self._cut_locks.get(key)
        if lock is None:
            lock = self._cut_locks[key] = _CutLock()
        lock.users += 1
        try:
            if exclusive:
                async with lock.gate:
                    while lock.shared:  # no new shared holder passes the gate meanwhile
                        await lock.idle.wait()
                    yield
            else:
                async with lock.gate:
                    lock.shared += 1
                    if lock.shared == 1:
                        lock.idle = trio.Event()
                try:
                    yield
                finally:
                    lock.shared -= 1
                    if not lock.shared:
                        lock.idle.set()
        finally:
            lock.users -= 1
            if not lock.users:
                del self._cut_locks[key]

    # -- the write path ---------------------------------------------------------------------
    async def _place(self, chain: int, routing_version: int, what: str) -> tuple[Routing, list[int], int]:
        """``(table, forward order, our position)`` of ``chain``, by a chain table at least as
        new as the sender's. Raises STALE_ROUTING when we are not in the chain."""
        routing = self.routing
        if routing is None or routing_version > routing.version:
            routing = await self.refresh(routing_version)
        order = routing.forward_order(chain)
        if self.server_id not in order:
            raise StripefsError(ErrorCode.STALE_ROUTING, f"server {self.server_id} is not {what} chain {chain}")
        return routing, order, order.index(self.server_id)

    async def write(self, msg: m.WriteChunk, view: memoryview) -> m.WriteChunkReply:
        """Apply a chunk write here and along the rest of its chain."""
        routing, order, pos = await self._place(msg.chain, msg.routing_version, "serving")
        if msg.version is not None and msg.routing_version < routing.version:
            # The sender forwards by an older chain table than ours: its order may lack a member
            # that joined since (a newcomer, a returning server), which would then never get
            # this write although the chain acknowledges it. It refreshes and the client retries.
            raise StripefsError(ErrorCode.STALE_ROUTING, f"a write for chain {msg.chain} forwarded by an older "
                                                         f"chain table ({msg.routing_version} < {routing.version})")
        if msg.version is not None and pos == 0:
            # We head this chain: a forwarded write comes from a former head that still routes
            # by an old table (paused past the failure timeout, say). Taking it would ack to
            # its client bytes this chain's later writes never saw.
            raise StripefsError(ErrorCode.STALE_ROUTING, f"server {self.server_id} heads chain {msg.chain}: "
                                                         "a forwarded write comes from a stale head")
        if msg.version is None:  # from a client: only the head takes those
            if pos != 0:
                raise StripefsError(ErrorCode.STALE_ROUTING, f"server {self.server_id} is not the head of chain {msg.chain}")
            async with self.cut_lock(msg.ino, msg.chain), self.chunk_lock((msg.ino, msg.index)):
                with self._dirty_while_applied((msg.ino, msg.index), pos + 1 < len(order)):
                    meta, waited = await self.store_write(msg, view)
                await self._forward_marked(order, pos, msg, view, meta.version, routing.version, meta.digest)
        else:
            with self._dirty_while_applied((msg.ino, msg.index), pos + 1 < len(order)):
                meta, waited = await self._apply_forwarded(order, pos, msg, view)
            await self._forward_marked(order, pos, msg, view, msg.version, routing.version, msg.digest)
        return write_reply(msg, meta, waited)

    async def _apply_forwarded(self, order: list[int], pos: int, msg: m.WriteChunk, view: memoryview) -> tuple[Any, int]:
        """Apply a write forwarded by our predecessor here; the chunk's meta now, and the
        microseconds the write waited for its slots here."""
        waited = 0
        try:
            meta, waited = await self.store_write(msg, view, msg.version)
        except VersionGap:
            # We missed versions (we were away): take the predecessor's whole chunk, which
            # already includes this write, then pass the write on.
            try:
                meta = await self.copy_chunk(order[pos - 1], msg.ino, msg.index)
            except StripefsError as exc:
                if exc.code not in (ErrorCode.NOT_FOUND, ErrorCode.STALE_FILE):
                    raise
                # The predecessor applied this write and its chunk is gone since: a truncate
                # or unlink that raced the write cut it there (as here, where the gap comes
                # from). The write is ordered before that cut; nothing of it is left to keep.
                log.info("chunk %d:%d was cut at server %d after it applied version %d",
                         msg.ino, msg.index, order[pos - 1], msg.version)
                return ChunkMeta(), waited
        if msg.digest is not None and len(view) and (meta.version != msg.version or meta.digest != msg.digest):
            # Our copy diverged: we applied another write as this version (or a later
            # one) while heading the chain and failed before forwarding it. The head
            # holds the chunk's lock for this round trip, so the predecessor's copy is
            # exactly this version: take it instead of acknowledging bytes we lack. (An
            # empty write creates no version: there is nothing to compare.)
            log.warning("chunk %d:%d diverged here (version %d, chain at %d): copying it from server %d",
                        msg.ino, msg.index, meta.version, msg.version, order[pos - 1])
            meta = await self.copy_chunk(order[pos - 1], msg.ino, msg.index, force=True)
        return meta, waited

    @contextlib.contextmanager
    def _dirty_while_applied(self, key: tuple[int, int], has_successor: bool) -> Iterator[None]:
        """Mark the chunk dirty before the local write, not after: the worker thread's bytes
        are readable here the moment they are written, and a read in that window must go
        to the tail too (the chain may never apply this version). A write that fails here
        puts back what the mark was (a failed forward's mark stays)."""
        if not has_successor:
            yield
            return
        before = self.dirty.get(key)
        self.dirty[key] = PENDING
        try:
            yield
        except BaseException:
            if self.dirty.get(key) == PENDING:
                if before is None:
                    del self.dirty[key]
                else:
                    self.dirty[key] = before
            raise

    async def _forward_marked(self, order: list[int], pos: int, msg: m.WriteChunk, view: memoryview, version: int,
                              rv: int, digest: int | None) -> None:
        """:meth:`_forward`, the chunk ``dirty`` here until the successor acknowledged it.

        A failed forward leaves it dirty: those bytes were never acknowledged, and stay
        unread here until a later write to the chunk commits.
        """
        key = (msg.ino, msg.index)
        if pos + 1 < len(order):
            self.dirty[key] = version
        await self._forward(order, pos, msg, view, version, rv, digest)
        if self.dirty.get(key) == version:
            del self.dirty[key]

    async def _forward(self, order: list[int], pos: int, msg: m.WriteChunk, view: memoryview, version: int, rv: int,
                       digest: int | None) -> None:
        if pos + 1 >= len(order):
            return
        fwd = m.WriteChunk(ino=msg.ino, index=msg.index, offset=msg.offset, crc=msg.crc, chunk_size=msg.chunk_size,
                           chain=msg.chain, routing_version=rv, version=version, digest=digest, qos=msg.qos)
        try:
            await self.call_peer(order[pos + 1], fwd, bytes(view))
        except StripefsError as exc:
            # The write is not on every replica: the client must not see it acknowledged.
            # It retries after the metadata service has taken the dead target out of the chain.
            if exc.code in (ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT, ErrorCode.STALE_ROUTING):
                raise StripefsError(ErrorCode.UNAVAILABLE, f"replica {order[pos + 1]} of chain {msg.chain}: {exc.message}") from exc
            raise

    # -- cuts ---------------------------------------------------------------------------------
    async def cut(self, msg: m.RemoveChunks) -> m.RemovedReply:
        """Apply a truncation's cut of one chain's chunks here, then down the chain.

        The collector sends it to the head; the head holds the chain's cut lock of the
        inode exclusively until the tail answered, so no write of that chain is in flight
        meanwhile. A replica takes its own lock too: a resync copy (shared) fetched before
        the cut is not installed after it. Idempotent: a retry cuts nothing more.

        Returns:
            The chunks removed here, the targets that applied the cut (``applied``, from
            here on) and the successor that failed it (``failed``: those after it lack it).

        Raises:
            StripefsError: STALE_ROUTING when the sender's chain table disagrees with ours
                (not the head; a forward from a stale head or an older table) or a
                successor said so; this server's own failure to apply the cut.
        """
        routing, order, pos = await self._place(msg.chain, msg.routing_version, "in")
        if msg.forwarded and (pos == 0 or msg.routing_version < routing.version):
            # As for writes: a stale head, or an order that may lack a member that joined since.
            raise StripefsError(ErrorCode.STALE_ROUTING, f"a cut for chain {msg.chain} forwarded by a stale head "
                                                         f"or an older chain table ({msg.routing_version})")
        if not msg.forwarded and pos != 0:
            raise StripefsError(ErrorCode.STALE_ROUTING, f"server {self.server_id} is not the head of chain {msg.chain}")
        async with self.cut_lock(msg.ino, msg.chain, exclusive=True):
            removed = await trio.to_thread.run_sync(self._cut_here, msg)
            applied, failed = [self.server_id or 0], 0
            if pos + 1 < len(order):
                fwd = m.RemoveChunks(ino=msg.ino, from_index=msg.from_index, chain=msg.chain,
                                     routing_version=routing.version, forwarded=True, part=msg.part)
                try:
                    reply, _ = await self.call_peer(order[pos + 1], fwd)
                except StripefsError as exc:
                    if exc.code == ErrorCode.STALE_ROUTING:
                        raise  # alive, by another table: the collector asks again with its newest
                    log.warning("cut of inode %d on chain %d: replica %d failed it: %s",
                                msg.ino, msg.chain, order[pos + 1], exc.message)
                    failed = order[pos + 1]
                else:
                    applied += reply.applied or [order[pos + 1]]
                    failed = reply.failed
        return m.RemovedReply(removed=removed, applied=applied, failed=failed)

    def _cut_here(self, msg: m.RemoveChunks) -> int:
        removed = self.store.remove(msg.ino, msg.from_index, False, msg.chain)
        if msg.part is not None and len(msg.part) == 2:
            self.store.truncate(msg.ino, int(msg.part[0]), int(msg.part[1]))
        return removed

    async def copy_chunk(self, source: int, ino: int, index: int, *, force: bool = False,
                         expect: tuple[int, int] | None = None) -> Any:
        """Copy a whole chunk from ``source`` (see :meth:`ChunkStore.replace` for ``force``/``expect``)."""
        reply, data = await self.call_peer(source, m.FetchChunk(ino=ino, index=index))
        return await trio.to_thread.run_sync(
            lambda: self.store.replace(ino, index, reply.chain, reply.version, data, force=force, expect=expect,
                                       logged=reply.logged),
            limiter=self.limiter_for(len(data)),
        )

    async def list_chunks(self, source: int, chain: int) -> dict[tuple[int, int], tuple[int, int | None]]:
        """``{(ino, index): (version, digest)}`` of ``chain`` on ``source``, page by page.

        Paged so that a chain of any size fits in frames; the digest is None from a
        server that predates digests (then versions alone decide).
        """
        out: dict[tuple[int, int], tuple[int, int | None]] = {}
        after: list[int] | None = None
        while True:
            reply, _ = await self.call_peer(source, m.ListChunks(chain=chain, after=after, limit=LIST_PAGE))
            digests = reply.digests if reply.digests is not None and len(reply.digests) == len(reply.chunks) else None
            for k, entry in enumerate(reply.chunks):
                out[(int(entry[0]), int(entry[1]))] = (int(entry[2]), None if digests is None else int(digests[k]))
            if not reply.more or not reply.chunks:
                return out
            after = [int(reply.chunks[-1][0]), int(reply.chunks[-1][1])]

    # -- resync -------------------------------------------------------------------------------
    async def resync(self) -> None:
        """Catch up with a serving replica of every chain we belong to, then report."""
        if self.syncing:
            return
        self.syncing = True
        try:
            await self._resync()
        except StripefsError as exc:  # retried: the next heartbeat still says "syncing"
            log.warning("resync interrupted: %s", exc.message)
        finally:
            self.syncing = False

    async def _resync(self) -> None:
        # Passes until one copies nothing, and never shorter than SETTLE: a peer may
        # still route by a table from before we joined (servers refresh it with their
        # heartbeat) and apply a write without forwarding it; the next pass sees its
        # higher version and copies it.
        #
        # Under a steady stream of writes a pass may always copy a chunk or two (one
        # written between the listing and our check, its forward still on the way), so
        # passes that begin after SETTLE also end the resync: every write from then on
        # is forwarded to us, and such a pass listed everything applied before.
        started = time.time()
        total_copied = total_removed = settled = 0
        silences = self.silences
        while True:
            if self.silences != silences:
                # We were silent long enough to be declared offline (paused): writes went on
                # without us, and what earlier passes compared is stale. Start over.
                silences, started, settled = self.silences, time.time(), 0
            settled += time.time() - started >= SETTLE
            copied, removed = await self._resync_pass(started)
            total_copied += copied
            total_removed += removed
            if ((copied == 0 and time.time() - started >= SETTLE) or settled >= 2) and self.silences == silences:
                break
            await trio.sleep(0.2)
        log.info("resync done: %d chunks copied, %d removed", total_copied, total_removed)
        await control_call(self.meta, m.SyncDone(server_id=self.server_id or 0, token=self.token))

    async def _resync_pass(self, started: float) -> tuple[int, int]:
        routing = await self.refresh(-1)
        copied = removed = 0
        held = await trio.to_thread.run_sync(self.store.chunks_by_chain)  # one walk per pass
        for chain, members in sorted(routing.members.items()):
            ids = [t for t, _ in members]
            if self.server_id not in ids or dict(members)[self.server_id] == "serving":
                continue  # not ours, or we serve it (its last serving target): nothing to copy
            sources = [t for t, st in members if st == "serving" and t != self.server_id]
            if not sources:
                if len(ids) > 1:
                    # Its other members are offline or syncing too: nobody here has what we
                    # missed, so we are not caught up. Reporting SyncDone now would make us
                    # serve old bytes, and a peer returning later would copy them from us.
                    raise StripefsError(ErrorCode.UNAVAILABLE, f"chain {chain} has no serving replica to copy from")
                continue
            remote = await self.list_chunks(sources[0], chain)
            local = {(i, x): (v, d) for i, x, v, _n, d in held.get(chain, [])}
            self.sync_progress = {"chain": chain, "total": len(remote), "done": 0}
            for (ino, index), (version, digest) in remote.items():
                have = local.get((ino, index))
                # Copy what is behind, and what differs from the serving copy at all: a
                # version we hold that the chain never had (we applied a write as head and
                # failed before forwarding it) or other bytes at the same version.
                behind = have is None or have[0] < version
                if behind or (digest is not None and have != (version, digest)):
                    try:
                        # The cut lock too: a cut forwarded here while the copy is on its
                        # way would find nothing to cut, and the copy bring the bytes back.
                        async with self.cut_lock(ino, chain), self.chunk_lock((ino, index)):
                            now = await trio.to_thread.run_sync(self._current, ino, index)
                            if now != have:
                                # A write forwarded since the walk. At least as new as the listing:
                                # nothing to copy, and not counted, so that a pass under a steady
                                # stream of writes copies nothing and the resync ends. Still behind
                                # (it came by a table from before the listing): copy over it.
                                if now is not None and (now[0] > version or (now[0] == version and digest in (None, now[1]))):
                                    self.sync_progress["done"] += 1
                                    continue
                                have = now
                            await self.copy_chunk(sources[0], ino, index, expect=have or (-1, 0))
                    except StripefsError as exc:
                        if exc.code not in (ErrorCode.NOT_FOUND, ErrorCode.STALE_FILE):
                            raise
                        continue  # removed at the source meanwhile, or already collected here
                    copied += 1
                self.sync_progress["done"] += 1
            for key in set(local) - set(remote):
                # Gone from the serving copy since before this resync began: ours goes too. The
                # age is checked under the chunk's lock, with the removal: a write forwarded
                # between a separate check and the removal would be acknowledged and lost here.
                if await trio.to_thread.run_sync(self.store.remove_one, *key, started):
                    removed += 1
        return copied, removed

    def _current(self, ino: int, index: int) -> tuple[int, int | None] | None:
        """Our copy's ``(version, digest)`` now (None: none, or an unreadable header)."""
        try:
            cur = self.store.stat(ino, index)
        except StripefsError:
            return None  # the copy replaces it
        return None if cur is None else (cur.version, cur.digest)

    # -- scrub --------------------------------------------------------------------------------
    async def scrub(self, repair: bool) -> m.ScrubReply:
        checked, bad = await trio.to_thread.run_sync(self.store.scrub)
        repaired = 0
        if repair and bad:
            routing = await self.refresh(-1)
            for ino, index, chain in bad:
                peers = [t for c, ms in routing.members.items() if chain in (0, c)
                         for t, st in ms if st == "serving" and t != self.server_id]
                for peer in dict.fromkeys(peers):
                    try:
                        async with self.cut_lock(ino, chain), self.chunk_lock((ino, index)):
                            await self.copy_chunk(peer, ino, index, force=True)
                        repaired += 1
                        break
                    except StripefsError as exc:
                        log.info("repair of %d:%d from %d failed: %s", ino, index, peer, exc.message)
        return m.ScrubReply(checked=checked, bad=[list(b) for b in bad], repaired=repaired)
