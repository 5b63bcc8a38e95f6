"""The metadata service: one ``rpc.Service`` that holds the parts and dispatches requests to them.

Each responsibility has a module of its own, held here by composition:

* ``_commit.py`` (:class:`~metadata._commit.CommitPath`): where store work runs (writer
  and reader threads, the loop's read connection, group commit, the log's fsync,
  checkpoints) and the order in which a mutation is applied, made durable and answered;
* ``_reads.py``: the read requests' plans and their costs;
* ``_lease_grants.py`` (:class:`~metadata._lease_grants.LeaseGrants`): which reads get an
  attribute lease on which keys, and the clients' watch; ``_leasetable.py`` keeps the leases;
  ``_leasebus.py`` carries invalidations between services sharing a PostgreSQL store;
* ``_replay.py``: answers kept for retried mutations;
* ``_membership.py``: storage servers, their states and the chain table, run by one
  leader among the services sharing a store (``_leader.py``);
* ``_admission.py``: the connect-back check of registering servers, failure detection;
* ``_collector.py`` (:class:`~metadata._collector.Collector`): truncations, removals and
  chain drops, told to the storage servers;
* ``_locks.py``: the lease locks clients take (``AcquireLock``).

:meth:`MetadataService.handle` is where a request's steps meet: the operation
(:meth:`~MetadataService._dispatch`), the membership row written if it changed, the
other lease holders told, the answer recorded for retries, then sent.

Background tasks (:func:`serve_metadata`): the store threads, the leadership lease, a
liveness check (a server silent for ``OFFLINE_AFTER`` seconds is reported offline;
rate-limited chain moves for servers that joined a frozen table start there too),
admission (a registering server is ``pending`` until the service has connected back to
it), the garbage collector that tells storage servers to drop the chunks of removed
files and the chains they left, and the lease table's expiry.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import stat
import time
from typing import Any, Callable

import trio

from stripefs.rpc import ServerConn, Service, serve_rpc
from stripefs.wire import ErrorCode, FrameHead, Message, ReplyMessage, ServerInfo, StripefsError
from stripefs.wire import messages as m

from . import _stats
from ._admission import Admission, detect
from ._collector import GC_GRACE, Collector
from ._commit import MAX_BATCH_RETRIES, REQUEST, TOUCHED, CommitPath
from ._leader import Leadership
from ._lease_grants import LeaseGrants
from ._leasebus import LeaseBus
from ._leasetable import LEASE_TTL, LeaseTable
from ._locks import Leases
from ._membership import ADMIT_AFTER, Membership
from ._namespace import Namespace
from ._reads import LEASED, READS, many_reply
from ._replay import Replies, forget_replies, was_applied
from ._sqlite import SqliteStore, check_sync
from ._store import Store

__all__ = ["MetadataService", "open_store", "serve_metadata"]

log = logging.getLogger(__name__)


class MetadataService(Service):
    """The metadata service of one process (see the module docstring).

    Args:
        ns: the namespace on the service's store.
        members: builds a :class:`Membership` from a document and whether this service
            takes it over (``_leader.Leadership``).
        secret: the cluster secret.
        gc_grace: seconds a removed file's chunks are kept (``_collector.GC_GRACE``).
        legacy_file: an older version's ``servers.json``, imported into the store once.
        sync: the store's durability setting (``--sync``), shown in the status.
        lease_ttl: seconds an attribute lease lives (``_leasetable.py``); 0 grants none.
    """

    role = "metadata"

    def __init__(self, ns: Namespace, members: Callable[[str | None, bool], Membership], secret: str,
                 gc_grace: float = GC_GRACE, *, legacy_file: str | None = None, sync: str = "full",
                 lease_ttl: float = LEASE_TTL):
        self.ns = ns
        self.store_kind = "postgresql" if type(ns.store).__name__ == "PostgresStore" else "sqlite"
        # Several services share a PostgreSQL store: one leads membership (a lease), and
        # mutations record their results in the store so a retry elsewhere is not reapplied.
        self.shared = self.store_kind == "postgresql"
        self.commit = CommitPath(ns, shared=self.shared)
        self.lead = Leadership(ns.store, self.commit.store_call, members, legacy_file, solo=not self.shared)
        self.lead.on_change = self._wake
        self.collector = Collector(self.commit, lambda: self.lead.members, secret, gc_grace,
                                   leading=lambda: self.lead.leading, persist=self.lead.persist, shared=self.shared,
                                   told=self._leases_changed)
        self.locks = Leases(ns.store)
        # Attribute leases (``_leasetable.py``): a SQLite store records the keys a mutation
        # writes (``TOUCHED``); services sharing a PostgreSQL store publish them to each
        # other (``_leasebus.py``). The in-memory store records none: no leases.
        leasing = isinstance(ns.store, SqliteStore) or self.shared
        self.lease_table = LeaseTable(lease_ttl if leasing else 0.0)
        self.bus = LeaseBus(ns.store, self.lease_table) if self.shared else None
        self.grants = LeaseGrants(self.lease_table, self.commit)
        self.admission = Admission(self.lead, secret)
        self.replay = Replies()
        self._running: dict[tuple[bytes, int], trio.Event] = {}  # mutations being applied, by replay key
        self.started = time.time()
        self.sync = sync  # the store's durability setting (--sync), shown in the status

    @property
    def members(self) -> Membership:
        """The membership this service runs (leader) or its view of the leader's (follower)."""
        return self.lead.members

    async def _leases_changed(self, keys: set[Any]) -> None:
        """What a background change wrote (a late cut): every lease holder is told, as after a request."""
        if self.bus is not None:  # (published with its commit)
            await self.bus.settle(self.ns.store.published)  # type: ignore[attr-defined]
        elif self.lease_table.enabled:
            await self.lease_table.wait(self.lease_table.invalidate(keys, b""))

    def _wake(self) -> None:
        self.collector.wake()
        self.admission.wake()

    def answer_now(self, conn: ServerConn, head: FrameHead, msg: Message) -> dict[str, Any] | None:
        """Short reads, answered from the loop (see ``_commit.INLINE_COST``); None for the rest.

        No membership is persisted first: a read's answer says nothing of it."""
        plan = READS.get(type(msg))
        if plan is None or not self.commit.reads_now or not self.commit.settled:
            return None  # (not settled: a commit is not durable yet, the answer must wait for it)
        if type(msg) in LEASED and msg.lease and self.lease_table.enabled:  # type: ignore[attr-defined]
            leased = self.grants.reply_now(conn, msg)
            return None if leased is None else leased.to_header()
        fn, args, cost, reply = plan(msg)
        done, result = self.commit.read_now(fn, args, cost)
        return reply(result).to_header() if done else None

    async def _read_reply(self, conn: ServerConn, msg: Message) -> ReplyMessage:
        """The answer to a request that changes nothing (with a lease where it asked for one)."""
        if type(msg) is m.WatchLeases:
            return await self.grants.watch(conn, msg)
        if type(msg) in LEASED and msg.lease and self.lease_table.enabled:  # type: ignore[attr-defined]
            return await self.grants.reply(conn, msg)
        return await self._dispatch(msg)

    async def handle(self, conn: ServerConn, head: FrameHead, msg: Message, payload: Any) -> None:
        if not msg.MUTATES:
            try:
                reply = await self._read_reply(conn, msg)
            except StripefsError:
                await self.commit.visible()  # ENOENT tells of a removal as much as an answer of a name
                raise
            await self.commit.visible()  # what it saw is durable before anyone hears of it
            await self.lead.persist()  # a membership change too
            await conn.send(head, reply.to_header())
            return
        key = (conn.client_id, head.req_id)
        running = self._running.get(key)
        if running is not None:  # a retry of a mutation still being applied: wait for its answer
            await running.wait()
        prior = self.replay.get(key)
        if prior is None:
            done = self._running[key] = trio.Event()
            request = REQUEST.set(key)
            touched: set[Any] | None = set() if self.lease_table.enabled and self.bus is None else None
            published = self.ns.store.published if self.bus is not None else 0  # type: ignore[attr-defined]
            recording = TOUCHED.set(touched)
            try:
                reply = await self._dispatch(msg)  # returns once what it changed is durable (CommitPath.apply)
                await self.lead.persist()
                # Durable, not yet answered nor recorded: a step that must come between (telling
                # other clients' caches) goes here.
                prior = reply.to_header()  # the encoded header: resent as is
            except StripefsError as exc:
                prior = exc
                try:  # a refusal may rest on another mutation not durable yet (EEXIST)
                    await self.commit.visible()
                except StripefsError as io:
                    prior = io
            finally:
                REQUEST.reset(request)
                TOUCHED.reset(recording)
                try:
                    if touched:
                        # Committed (or rolled back: then nothing changed, and telling costs
                        # only a refetch): every other holder of a lease on what it wrote is
                        # told, and acknowledges (or its lease runs out) before anyone hears
                        # of the change.
                        await self.lease_table.wait(self.lease_table.invalidate(touched, conn.client_id))
                    elif self.bus is not None:
                        await self._settled(key, published)
                finally:
                    if isinstance(prior, (dict, StripefsError)):
                        self.replay.put(key, prior)
                    del self._running[key]
                    done.set()
        if isinstance(prior, StripefsError):
            raise prior
        await conn.send(head, prior)

    async def _settled(self, key: tuple[bytes, int], published: int) -> None:
        """A mutation on a shared store: what it wrote was published with its commit (the
        store's number past ``published``); every service's holders are told, or their
        leases ran out, before anyone hears of it (``LeaseBus.settle``). A retry answered
        from another service's record publishes a barrier first: the service that applied
        it may have died before its holders everywhere were told."""
        store: Any = self.ns.store
        if key in store.replayed:
            store.replayed.discard(key)
            await self.commit.store_call(store.barrier)
        if store.published != published:
            await self.bus.settle(store.published)  # type: ignore[union-attr]

    def connection_ended(self, conn: ServerConn, clean: bool) -> None:
        """See ``LeaseGrants.connection_ended``: a watch closed cleanly ends its client's leases."""
        self.grants.connection_ended(conn, clean)

    async def _dispatch(self, msg: Message[Any]) -> ReplyMessage:
        ns, apply = self.ns, self.commit.apply
        plan = READS.get(type(msg))
        if plan is not None:
            fn, args, cost, reply = plan(msg)
            return reply(await self.commit.read(fn, *args, cost=cost))
        if isinstance(msg, m.Create):
            chains = await self._frozen_chains()
            attr, created = await apply(
                ns.create, msg.parent, msg.name, msg.mode, msg.uid, msg.gid,
                chains=chains, exclusive=msg.exclusive, truncate=msg.truncate,
            )
            if msg.truncate and not created:
                attr = await self.collector.truncate_chunks(attr, 0)
            return m.CreateReply(attr, created)
        if isinstance(msg, m.CreatePath):
            self.members.freeze()
            chains = self.members.chain_ids()

            attr, created = await apply(ns.create_path, msg.path, msg.mode, msg.uid, msg.gid, chains=chains,
                                        exclusive=msg.exclusive, truncate=msg.truncate)
            if msg.truncate and not created:
                attr = await self.collector.truncate_chunks(attr, 0)
            return m.CreateReply(attr, created)
        if isinstance(msg, m.UnlinkPath):
            attr = await apply(ns.unlink_path, msg.path)
            self.collector.garbage_added()
            return m.AttrReply(attr)
        if isinstance(msg, m.Mkdir):
            return m.AttrReply(await apply(ns.mkdir, msg.parent, msg.name, msg.mode, msg.uid, msg.gid))
        if isinstance(msg, m.Symlink):
            return m.AttrReply(await apply(ns.symlink, msg.parent, msg.name, msg.target, msg.uid, msg.gid))
        if isinstance(msg, m.Mknod):
            chains = await self._frozen_chains() if stat.S_ISREG(msg.mode) else []
            return m.AttrReply(await apply(ns.mknod, msg.parent, msg.name, msg.mode, msg.rdev, msg.uid, msg.gid,
                                           chains=chains))
        if isinstance(msg, m.SetXattr):
            return m.AttrReply(await apply(ns.setxattr, msg.ino, msg.name, msg.value, msg.flags))
        if isinstance(msg, m.RemoveXattr):
            return m.AttrReply(await apply(ns.removexattr, msg.ino, msg.name))
        if isinstance(msg, m.AcquireLock):
            row = await apply(self.locks.acquire, msg.key, msg.owner, msg.ttl_ms * 1_000_000)
            return m.LockReply(row.token, row.expires_ns)
        if isinstance(msg, m.ReleaseLock):
            return m.ReleaseLockReply(await apply(self.locks.release, msg.key, msg.owner))
        if isinstance(msg, m.Link):
            return m.AttrReply(await apply(ns.link, msg.ino, msg.new_parent, msg.new_name))
        if isinstance(msg, m.Unlink):
            attr = await apply(ns.unlink, msg.parent, msg.name)
            self.collector.garbage_added()
            return m.AttrReply(attr)
        if isinstance(msg, m.Rmdir):
            try:
                await apply(ns.rmdir, msg.parent, msg.name, _committed=self.commit.forget_dirs)
            finally:
                self.commit.forget_dirs()
            return m.EmptyReply()
        if isinstance(msg, m.Rename):
            try:
                await apply(ns.rename, msg.parent, msg.name, msg.new_parent, msg.new_name, msg.flags,
                            _committed=self.commit.forget_dirs)
            finally:
                self.commit.forget_dirs()
            self.collector.garbage_added()
            return m.EmptyReply()
        if isinstance(msg, m.SetAttr):
            return m.AttrReply(await self._setattr(msg))
        if isinstance(msg, m.CommitLength):
            return m.AttrReply(await apply(ns.commit_length, msg.ino, msg.length, msg.mtime_ns, msg.truncations))
        if isinstance(msg, m.SetLayout):
            await apply(ns.set_layout, msg.ino, msg.chunk_size, msg.stripe)
            return m.EmptyReply()
        if isinstance(msg, m.CreateMany):
            Namespace.check_batch(msg.paths)  # refused before the chain table freezes
            chains = await self._frozen_chains()
            found = await apply(ns.create_many, list(msg.paths), msg.mode, msg.uid, msg.gid, chains=chains,
                                exclusive=msg.exclusive, _now=False)
            return many_reply(found)
        if isinstance(msg, m.SymlinkMany):
            Namespace.check_batch(msg.names)
            if not msg.replace:
                return many_reply(await apply(ns.symlink_many, msg.parent, list(msg.names), list(msg.targets),
                                              msg.uid, msg.gid, _now=False))
            try:  # a replaced symlink may be on the way of remembered paths
                found = await apply(ns.symlink_many, msg.parent, list(msg.names), list(msg.targets), msg.uid, msg.gid,
                                    replace=True, _now=False, _committed=self.commit.forget_dirs)
            finally:
                self.commit.forget_dirs()
            return many_reply(found)
        if isinstance(msg, m.ReserveFiles):
            chains = await self._frozen_chains()
            items = await apply(ns.reserve_files, msg.parent_ino or msg.parent, msg.count, chains=chains)
            return m.ReserveFilesReply(inos=[i.ino for i in items], ids=[i.id for i in items],
                                       chunk_sizes=[i.layout.chunk_size for i in items],
                                       chains=[list(i.layout.chains) for i in items])
        if isinstance(msg, m.CommitFiles):
            Namespace.check_batch(msg.paths)
            found = await apply(ns.commit_files, list(msg.paths), list(msg.inos), list(msg.ids), list(msg.lengths),
                                msg.mode, msg.uid, msg.gid, mtime_ns=msg.mtime_ns, exclusive=msg.exclusive,
                                parent_ino=msg.parent_ino, _now=False)
            self.collector.garbage_added()  # a replaced file's last name
            return many_reply(found)
        if isinstance(msg, m.UnlinkMany):
            Namespace.check_batch(msg.paths)
            found = await apply(ns.unlink_many, list(msg.paths), _now=False)
            self.collector.garbage_added()
            return many_reply(found)
        if isinstance(msg, m.GetRouting):
            await self.lead.refresh_view()
            return m.RoutingReply(self.members.routing())
        if isinstance(msg, m.Statfs):
            return await self._statfs()
        if isinstance(msg, m.ClusterStatus):
            return await self._status()
        if isinstance(msg, (m.RegisterServer, m.Heartbeat, m.SyncDone, m.RemoveServer)):
            self.lead.require()  # membership changes: callers try the next metadata address
        if isinstance(msg, m.RegisterServer):
            sid, state = self.members.register(msg)
            self.admission.wake()  # connect back now, not at the next poll
            return m.RegisterServerReply(sid, state, self.members.version)
        if isinstance(msg, m.Heartbeat):
            state = self.members.heartbeat(msg)
            return m.HeartbeatReply(state, self.members.version)
        if isinstance(msg, m.SyncDone):
            self.members.sync_done(msg)
            self.members.place()  # a drain goes on with its next server at once
            return m.SyncDoneReply(self.members.version)
        if isinstance(msg, m.RemoveServer):
            state, chains, lost = self.members.remove(msg.server_id, msg.force)
            if state == "draining":
                self.members.place()
            return m.RemoveServerReply(state, chains, lost, self.members.version)
        if isinstance(msg, m.Ping):
            return m.EmptyReply()
        raise StripefsError(ErrorCode.NOT_SUPPORTED, f"{type(msg).__name__} is not a metadata request")

    async def _setattr(self, msg: m.SetAttr) -> Any:
        """``SetAttr``; a size is cut on the storage servers before the answer.

        A size that grows over a cut still queued (a truncate that failed) waits for that
        cut to land first, or fails with EIO having changed nothing: grown over them, the
        bytes the cut drops would read back as file data.
        """
        setattr = functools.partial(self.commit.apply, self.ns.setattr, msg.ino, mode=msg.mode, uid=msg.uid,
                                    gid=msg.gid, atime_ns=msg.atime_ns, mtime_ns=msg.mtime_ns, size=msg.size)
        try:
            attr = await setattr()
        except StripefsError as exc:
            if exc.code != ErrorCode.CUT_PENDING:
                raise
            await self.collector.cut_pending(msg.ino)  # IO when it cannot
            try:
                attr = await setattr()
            except StripefsError as again:  # another truncate failed meanwhile
                if again.code != ErrorCode.CUT_PENDING:
                    raise
                raise StripefsError(ErrorCode.IO, again.message) from again
        if msg.size is not None:
            attr = await self.collector.truncate_chunks(attr, msg.size)
        return attr

    async def _frozen_chains(self) -> list[int]:
        """The chain ids a new file may use; the first file freezes the table (leader only)."""
        if not self.members.frozen:
            await self.lead.refresh_view()
        if not self.members.frozen:
            key = REQUEST.get()
            if key is not None and self.shared and await self.commit.store_call(was_applied, self.ns.store, key):
                # A retry of a request some service applied already (its view of the frozen
                # table may lag): CommitPath.apply answers it from the record, the chains go unused.
                return []
            self.lead.require()  # a follower cannot freeze the leader's table: the client fails over
            self.members.freeze()
            await self.lead.persist()  # durable before any file names the chains
        return self.members.chain_ids()

    async def _statfs(self) -> m.StatfsReply:
        """Usable space: the serving servers' capacity and usage over the replica count.

        Every chunk is stored once per replica of its chain, so raw bytes would
        overstate what files can hold by that factor. Front ends (the FUSE
        ``statfs``, ``Client.statfs``) report these numbers as they are.
        """
        await self.lead.refresh_view()
        servers = [s for s in self.members.servers.values() if s.state == "serving"]
        counts = await self.commit.read(Namespace.counts)
        # Chains hold min(replicas, servers) targets (Membership._rebuild).
        r = max(1, min(self.members.replicas, len(self.members.servers)))
        used = sum(s.used for s in servers) // r
        # Servers sharing one file system (several targets on one disk) share its size and
        # its free space: count each file system once, and free space as the disk says
        # (other data on it is not ours to hand out). Servers that send no disk (older
        # ones) count their own capacity, less what they hold.
        disks: dict[str, tuple[int, int]] = {}
        for s in servers:
            fs, free = self.members.disks.get(s.server_id, (f"server {s.server_id}", max(0, s.capacity - s.used)))
            disks[fs] = (s.capacity, free)
        capacity = sum(c for c, _ in disks.values()) // r
        free = sum(f for _, f in disks.values()) // r
        return m.StatfsReply(capacity=capacity, used=used, free=min(free, max(0, capacity - used)),
                             files=counts.get("inodes", 0))

    async def _status(self) -> m.ClusterStatusReply:
        await self.lead.refresh_view()
        routing = self.members.routing()
        counts = await self.commit.read(Namespace.counts)
        # Registrations not admitted yet are shown too (state "pending"), with the reason in
        # metadata["pending"]; they are never part of the routing clients use.
        pending = [ServerInfo(c.server_id, c.host, c.port, "pending", c.capacity, c.used, c.pid, c.last_seen)
                   for sid, c in sorted(self.members.pending.items()) if sid not in routing.servers]
        return m.ClusterStatusReply(
            metadata={"pid": os.getpid(), "uptime": time.time() - self.started, "store": self.store_kind,
                      "sync": self.sync, "lease_ttl": self.lease_table.ttl,
                      "leases_granted": self.lease_table.enabled and trio.current_time() < self.lease_table.fresh_until,
                      "leader": self.lead.leading, **counts,
                      # Offline until the cuts they missed are applied to them (``Collector``).
                      "held": sorted(self.members.held),
                      "pending": self.members.pending_status()},
            servers=list(routing.servers.values()) + pending,
            chains=[{"chain_id": c, "targets": [t for t, _ in ms], "states": [st for _, st in ms]}
                    for c, ms in sorted(routing.members.items())],
            replicas=routing.replicas,
            routing_version=routing.version,
        )

    async def background(self) -> None:
        """Garbage collection and chain drops, on the leader: a pass every ``GC_INTERVAL``
        seconds, or when a removal falls due (``Collector.next_pass``); with a shared store,
        once a minute, replay records past ``REPLIES_KEPT`` go too."""
        forgot = trio.current_time()
        while True:
            due = await self.collector.next_pass()
            if not self.lead.leading:
                continue  # the leader collects
            if not due:
                continue
            try:
                await self.collector.collect()
                await self.collector.drop_moved_chains()
                await self.lead.persist()
                if self.shared and trio.current_time() - forgot > 60:  # old replies, once a minute
                    await self.commit.store_call(forget_replies, self.ns.store)
                    forgot = trio.current_time()
            except Exception:  # never let GC take the service down
                log.exception("garbage collection pass failed")


def open_store(state_dir: str, store_url: str | None = None, sync: str = "full") -> Store:
    """The namespace store: PostgreSQL for a ``postgresql://`` URL, else SQLite under ``state_dir``.

    Args:
        sync: the SQLite durability setting (``full`` or ``normal``, see :class:`SqliteStore`).

    Raises:
        StripefsError: INVALID for an unknown store or setting, or ``normal`` with
            PostgreSQL (whose durability is the database's ``synchronous_commit``).
    """
    check_sync(sync)
    if store_url and store_url.startswith(("postgresql://", "postgres://")):
        if sync != "full":
            raise StripefsError(ErrorCode.INVALID, "metadata sync normal applies to SQLite; with PostgreSQL "
                                "set the database's synchronous_commit instead")
        from ._pgstore import PostgresStore

        return PostgresStore(store_url)
    if store_url:
        raise StripefsError(ErrorCode.INVALID, f"unknown metadata store {store_url.split(':', 1)[0]!r}")
    return SqliteStore(os.path.join(state_dir, "meta.db"), synchronous=sync)


def _open_namespace(store: Store, chunk_size: int, max_stripe: int) -> Namespace:
    """The namespace on ``store``; services starting together on a new database race to
    create the root directory, and the losers (a serialization failure) try again."""
    for attempt in range(MAX_BATCH_RETRIES + 1):
        try:
            return Namespace(store, default_chunk_size=chunk_size, max_stripe=max_stripe)
        except Exception as exc:
            if not store.retryable(exc) or attempt == MAX_BATCH_RETRIES:
                raise
            time.sleep(random.uniform(0, 0.01 * 2 ** attempt))
    raise AssertionError("unreachable")


async def serve_metadata(
    state_dir: str,
    *,
    secret: str,
    host: str = "127.0.0.1",
    port: int = 0,
    cluster_id: str = "",
    chunk_size: int = 4 << 20,
    max_stripe: int = 16,
    gc_grace: float = GC_GRACE,
    replicas: int = 1,
    store_url: str | None = None,
    admit_after: float = ADMIT_AFTER,
    sync: str = "full",
    lease_ttl: float = LEASE_TTL,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the metadata of the cluster whose state lives in ``state_dir``.

    Args:
        store_url: a ``postgresql://`` URL to keep the namespace in PostgreSQL; by
            default it is SQLite in ``state_dir/meta.db``.
        admit_after: with one replica, seconds a new storage server must heartbeat
            before it takes chain slots in a frozen table.
        sync: ``full`` (each acknowledged operation survives power loss) or
            ``normal`` (it survives a kill -9 of any process, not a power loss):
            the SQLite store's durability, see :class:`SqliteStore`.
        lease_ttl: seconds an attribute lease lives (``_leasetable.py``); 0 grants none.
            Services sharing a PostgreSQL store should share it (``_leasebus.py``).
    """
    os.makedirs(state_dir, exist_ok=True)
    store = await trio.to_thread.run_sync(open_store, state_dir, store_url, sync)
    ns = await trio.to_thread.run_sync(_open_namespace, store, chunk_size, max_stripe)

    def members(doc: str | None, restarted: bool) -> Membership:
        return Membership(None, replicas, admit_after=admit_after, doc=doc, restarted=restarted)

    service = MetadataService(ns, members, secret, gc_grace, legacy_file=os.path.join(state_dir, "servers.json"),
                              sync=sync, lease_ttl=lease_ttl)
    _stats.watch(service)  # leases, fsyncs, GC: read when the metrics endpoint is scraped
    try:
        async with trio.open_nursery() as nursery:
            address = await nursery.start(functools.partial(serve_rpc, service, host, port, secret=secret, cluster_id=cluster_id))
            nursery.start_soon(service.commit.run)
            service.lead.owner = f"{address[0]}:{address[1]}".encode()  # a restart on the same port resumes its lease
            if service.bus is not None:
                await nursery.start(service.bus.run)  # listening before the first mutation publishes
            await nursery.start(service.lead.keep)
            nursery.start_soon(detect, service.lead, service.shared)
            nursery.start_soon(service.background)
            nursery.start_soon(service.admission.run)
            nursery.start_soon(service.lease_table.run)
            task_status.started(address)
    finally:
        # Its threads have stopped (CommitPath.run waits for them): the database's writer lock goes with it.
        store.close()