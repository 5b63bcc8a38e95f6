"""The storage server: one trio server per target directory.

Requests (see ``wire._messages``): WriteChunk (payload in), ReadChunk (payload
out: up to ``SMALL_READ`` from the connection's own thread, one ``pread`` of a chunk
file kept open and one ``writev``; larger ones by ``sendfile`` when the blocks are
verified), RemoveChunks,
TruncateChunk, StatChunk, TargetInfo. Disk work runs in worker threads; write
payloads are received straight into page-aligned pooled buffers.

On start the server registers with the metadata service and then heartbeats
every second with its capacity and usage. ``ROOT/target.json`` keeps its server
id across restarts and the root's identity token: a random secret created once
per storage root and sent with every membership message, which binds the server
id to this data directory. A registration is ``pending`` until the metadata
service has connected back to the announced address (the server polls quickly
meanwhile); the server reports itself started only once admitted. Replication (forwarding along chains, resync, scrub)
lives in ``_replication.py``. The root also records, on first use, the id of the cluster it
belongs to (``cluster_id``): a server started on it for another cluster is refused before it
listens, so one cluster never registers chunks another one wrote.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import secrets
from collections.abc import Callable
from typing import Any

import trio

from stripefs.rpc import (
    BUSY_AFTER, MAX_CLIENT_CONNECTIONS, PAYLOAD_BUDGET, BufferPool, ServerConn, Service, ThreadReply, serve_rpc,
)
from stripefs.wire import ErrorCode, FrameHead, Message, StripefsError, role_credential
from stripefs.wire import messages as m

from . import _stats
from ._chunks import ChunkStore
from ._metalink import MetadataLink
from ._replication import Replicator, control_call, write_reply

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL = 1.0
# While the metadata service checks a registration (a connect-back, milliseconds) the
# server asks again this often, for up to PENDING_FAST_POLLS times, so startup stays fast.
PENDING_POLL = 0.05
PENDING_FAST_POLLS = 100
SMALL_READ = 256 * 1024
SMALL_WRITE = 256 * 1024  # an unreplicated write this small is done on the connection's thread
COMPACT_EVERY = 10.0  # seconds between passes that reclaim the container logs' dead space
QOS_KNOWN = tuple(m.QOS_CLASSES.values())


class StorageService(Service):
    role = "storage"

    def __init__(self, store: ChunkStore, replicator: Replicator):
        self.store = store
        self.pool = BufferPool()
        self.repl = replicator

    @property
    def server_id(self) -> int | None:
        return self.repl.server_id

    @server_id.setter
    def server_id(self, value: int | None) -> None:
        self.repl.server_id = value

    async def receive_payload(self, conn: ServerConn, head: FrameHead, msg: Message) -> Any:
        if not isinstance(msg, m.WriteChunk):
            await conn.discard_payload()
            return None
        buf = self.pool.get(head.payload_len)
        try:
            await conn.recv_payload_into(memoryview(buf)[: head.payload_len])
        except BaseException:
            self.pool.put(buf)
            raise
        return buf

    def thread_job(self, head: FrameHead, msg: Message) -> Callable[..., None] | None:
        """A small read that needs no routing refresh, confirmation, tail proxying or
        refusal is answered on the connection's own thread (no task), which then receives
        the connection's next requests itself. Called on the loop and on that thread:
        only reads state (the routing table and the dirty set are replaced or changed
        by the loop; a read decided just before a change is one that arrived before it)."""
        if type(msg) is not m.ReadChunk or msg.length > SMALL_READ:
            return None
        if msg.chain:
            repl = self.repl
            routing = repl.routing
            if routing is None or msg.routing_version > routing.version or not repl.confirmed():
                return None  # handle() asks the metadata service first
            if self.server_id not in routing.chains.get(msg.chain, (self.server_id,)):
                return None  # handle() refuses it
            if (msg.ino, msg.index) in repl.dirty:
                return None  # may be proxied to the tail
        return self._small_read

    async def handle(self, conn: ServerConn, head: FrameHead, msg: Message, payload: Any) -> None:
        store = self.store
        if isinstance(msg, (m.WriteChunk, m.ReadChunk)) and msg.chain:
            routing = self.repl.routing
            if routing is None or msg.routing_version > routing.version:
                # The client knows a newer chain table than we do: never decide by an old one
                # (an old table may show a chain without the replicas a write must reach).
                await self.repl.refresh(msg.routing_version)
        if isinstance(msg, m.WriteChunk):
            view = memoryview(payload)[: head.payload_len]
            try:
                if msg.qos not in QOS_KNOWN:
                    raise StripefsError(ErrorCode.INVALID, f"unknown traffic class {msg.qos!r} (known: {QOS_KNOWN})")
                if msg.chain and (msg.version is not None or self._chained(msg.chain)):
                    reply = await self.repl.write(msg, view)
                elif len(view) <= SMALL_WRITE and msg.qos == m.QOS_BY_SIZE:
                    # A small file's chunk: the connection's own reply thread writes, syncs and
                    # answers (no worker-thread hop, no wake-up of the loop to send the reply).
                    await conn.reply_in_thread(head, self._small_write, msg, view, payload)
                    view = payload = None
                    return
                else:  # replication factor 1: nothing to forward
                    reply = write_reply(msg, *await self.repl.store_write(msg, view))
            finally:
                if view is not None:
                    view.release()
                    self.pool.put(payload)
            await conn.send(head, reply.to_header())
        elif isinstance(msg, m.ReadChunk):
            if msg.chain:
                await self.repl.confirm()  # after a silence; unreachable: UNAVAILABLE, the client reads elsewhere
            routing = self.repl.routing
            if msg.chain and routing is not None and self.server_id not in routing.chains.get(msg.chain, (self.server_id,)):
                # We left this chain (or are not serving it yet): never answer with a hole.
                raise StripefsError(ErrorCode.STALE_ROUTING, f"server {self.server_id} does not serve chain {msg.chain}")
            if msg.chain and routing is not None and (msg.ino, msg.index) in self.repl.dirty:
                serving = routing.chains.get(msg.chain, ())
                if serving and serving[-1] != self.server_id:
                    # CRAQ: our newest version is not acknowledged yet; the last serving
                    # target applies a write last, so it holds only what the chain has.
                    # (Unreachable, the error sends the client to the next replica.)
                    tail = serving[-1]
                    fwd = m.ReadChunk(ino=msg.ino, index=msg.index, offset=msg.offset, length=msg.length,
                                      chain=msg.chain, routing_version=routing.version)
                    proxied, tail_bytes = await self.repl.call_peer(tail, fwd)
                    await conn.send(head, proxied.to_header(), payload=bytes(tail_bytes))
                    return
            if msg.length <= SMALL_READ:
                # Latency matters for small reads (dataloader samples): the connection's own
                # reply thread reads and sends (no worker-thread hop, no wake-up of the loop).
                await conn.reply_in_thread(head, self._small_read, msg)
                return
            fd, off, n, data, clen, crcs = await trio.to_thread.run_sync(
                store.open_read_checked, msg.ino, msg.index, msg.offset, msg.length)
            header = m.ReadChunkReply(length=n, chunk_length=clen, crcs=crcs).to_header()
            if data is not None:
                await conn.send(head, header, payload=data)
            elif fd >= 0:
                try:
                    await conn.send(head, header, file=(fd, off, n))
                finally:
                    os.close(fd)
            else:
                await conn.send(head, header)
        elif isinstance(msg, m.RemoveChunks) and msg.chain:  # a cut, ordered through its chain
            await conn.send(head, (await self.repl.cut(msg)).to_header())
        elif isinstance(msg, m.RemoveChunks):
            n = await trio.to_thread.run_sync(store.remove, msg.ino, msg.from_index, msg.forget)
            await conn.send(head, m.RemovedReply(removed=n).to_header())
        elif isinstance(msg, m.TruncateChunk):
            await trio.to_thread.run_sync(store.truncate, msg.ino, msg.index, msg.length)
            await conn.send(head, m.EmptyReply().to_header())
        elif isinstance(msg, m.StatChunk):
            meta = await trio.to_thread.run_sync(store.stat, msg.ino, msg.index)
            if meta is None:
                raise StripefsError(ErrorCode.NOT_FOUND, "no such chunk")
            await conn.send(head, m.StatChunkReply(length=meta.length, version=meta.version, crcs=meta.crcs).to_header())
        elif isinstance(msg, m.FetchChunk):
            found = await trio.to_thread.run_sync(store.read_whole, msg.ino, msg.index)
            if found is None:
                raise StripefsError(ErrorCode.NOT_FOUND, "no such chunk")
            meta, data = found
            await conn.send(head, m.FetchChunkReply(version=meta.version, chain=meta.chain, length=meta.length,
                                                    logged=store.logged(msg.ino, msg.index)).to_header(),
                            payload=data)
        elif isinstance(msg, m.DropChain):
            routing = await self.repl.refresh(-1)
            if self.server_id in routing.forward_order(msg.chain):
                raise StripefsError(ErrorCode.BUSY, f"server {self.server_id} still belongs to chain {msg.chain}")
            removed = await trio.to_thread.run_sync(store.drop_chain, msg.chain)
            await conn.send(head, m.RemovedReply(removed=removed).to_header())
        elif isinstance(msg, m.ListChunks):
            after = (int(msg.after[0]), int(msg.after[1])) if msg.after is not None and len(msg.after) == 2 else None
            limit = max(0, msg.limit)
            # One past the page tells whether more follow.
            chunks = await trio.to_thread.run_sync(store.list_chain, msg.chain, after, limit + 1 if limit else 0)
            more = bool(limit) and len(chunks) > limit
            chunks = chunks[:limit] if more else chunks
            listing = m.ListChunksReply(chunks=[list(c[:4]) for c in chunks], digests=[c[4] for c in chunks], more=more)
            await conn.send(head, listing.to_header())
        elif isinstance(msg, m.Scrub):
            await conn.send(head, (await self.repl.scrub(msg.repair)).to_header())
        elif isinstance(msg, m.TargetInfo):
            await conn.send(head, (await self.info()).to_header())
        elif isinstance(msg, m.Ping):
            await conn.send(head, m.EmptyReply().to_header())
        else:
            raise StripefsError(ErrorCode.NOT_SUPPORTED, f"{type(msg).__name__} is not a storage request")

    def _small_read(self, reply: ThreadReply, msg: m.ReadChunk) -> None:
        """Runs on the connection's own thread: read, then answer (the frame under the wire lock).

        The bytes come from the chunk file kept open (``inline``) and go out with their
        header in one ``writev``. A failure to read propagates before anything is sent;
        the thread answers it.
        """
        _fd, _off, n, data, clen, crcs = self.store.open_read_checked(
            msg.ino, msg.index, msg.offset, msg.length, inline=SMALL_READ)
        header = m.ReadChunkReply(length=n, chunk_length=clen, crcs=crcs).to_header()
        if n:
            reply.send(header, payload=data)
        else:
            reply.send(header)

    def _small_write(self, reply: ThreadReply, msg: m.WriteChunk, view: memoryview, payload: Any) -> None:
        """Runs on the connection's own thread: write a small chunk durably, then answer.
        A failure propagates before anything is sent; the thread answers it. (A job the
        thread skips, its connection torn down, leaves its buffer to the collector.)"""
        try:
            meta = self.store.write(msg.ino, msg.index, msg.offset, view, msg.crc, msg.chunk_size, msg.chain)
        finally:
            view.release()
            self.pool.put(payload)
        reply.send(m.WriteChunkReply(length=meta.length, version=meta.version).to_header())

    def _chained(self, chain: int) -> bool:
        """Must a write to ``chain`` go through the chain logic (forwarding, checks)?

        Only a chain that is exactly this server takes the direct path; anything
        else (replicas, a newcomer syncing, a chain we left) is checked and forwarded.
        """
        routing = self.repl.routing
        return routing is None or routing.forward_order(chain) != [self.server_id]

    async def info(self) -> m.TargetInfoReply:
        total, free = await trio.to_thread.run_sync(self.store.capacity)
        return m.TargetInfoReply(
            server_id=self.server_id,
            capacity=total,
            free=free,
            used=self.store.used,
            chunks=self.store.chunks,
            root=self.store.root,
            syncing=self.repl.syncing,
            sync_progress=dict(self.repl.sync_progress),
        )


def _load_identity(root: str) -> dict[str, Any]:
    try:
        with open(os.path.join(root, "target.json")) as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def _save_identity(root: str, ident: dict[str, Any]) -> None:
    tmp = os.path.join(root, "target.json.tmp")
    with open(tmp, "w") as f:
        json.dump(ident, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, "target.json"))
    ChunkStore._fsync_dir(root)  # the rename itself is durable only once its directory is


def _identity_token(ident: dict[str, Any]) -> bool:
    """Give ``ident`` its root's identity token if it has none; returns whether it was created."""
    token = ident.get("token")
    if isinstance(token, str) and len(token) == 64 and all(c in "0123456789abcdef" for c in token):
        return False
    ident["token"] = secrets.token_hex(32)
    return True


def claim_root(root: str, cluster_id: str) -> None:
    """Record ``cluster_id`` in ``root``'s target.json on first use; refuse a root of another cluster.

    Raises:
        StripefsError: PERMISSION when the root belongs to another cluster.
    """
    if not cluster_id:  # a cluster without an id (tests, very old files) claims nothing
        return
    ident = _load_identity(root)
    owner = ident.get("cluster_id")
    if owner == cluster_id:
        return
    if owner:
        raise StripefsError(ErrorCode.PERMISSION, f"storage root {root} belongs to cluster {owner}, not to "
                                                  f"cluster {cluster_id} (use an empty directory)")
    ident["cluster_id"] = cluster_id
    _save_identity(root, ident)


async def _register_and_heartbeat(service: StorageService, meta: MetadataLink, host: str, port: int, root: str,
                                  admitted: trio.Event, nursery: trio.Nursery) -> None:
    ident = await trio.to_thread.run_sync(_load_identity, root)
    if _identity_token(ident):  # on disk before it is ever sent: the id it earns is bound to it
        await trio.to_thread.run_sync(_save_identity, root, ident)
    token = ident["token"]
    service.repl.token = token
    known = False  # the metadata service answered our registration (pending or admitted)
    polls = 0
    while True:
        pending = False
        asked = trio.current_time()
        try:
            info = await service.info()
            reply: m.RegisterServerReply | m.HeartbeatReply
            if not known:
                registration, _ = await control_call(meta, m.RegisterServer(
                    host=host, port=port, root=root, server_id=ident.get("server_id"),
                    capacity=info.capacity, used=info.used, pid=os.getpid(), token=token,
                ))
                # Taken at once: the metadata service's connect-back check asks for this id.
                service.server_id = registration.server_id
                reply = registration
                if ident.get("server_id") != service.server_id:
                    ident["server_id"] = service.server_id
                    await trio.to_thread.run_sync(_save_identity, root, ident)
                known = True
            else:
                assert service.server_id is not None
                reply, _ = await control_call(meta, m.Heartbeat(
                    server_id=service.server_id, capacity=info.capacity, used=info.used, chunks=info.chunks,
                    token=token, free=info.free, fsid=service.store.fsid,
                ))
            if reply.state == "pending":
                pending = True
            elif reply.state == "removed":
                log.warning("this storage server was removed from the cluster (stripefs remove-server): stopping")
                nursery.cancel_scope.cancel()
                return
            else:
                repl = service.repl
                if repl.routing is None or repl.routing.version != reply.routing_version:
                    await repl.refresh(-1)
                repl.note_heard(asked)  # alive to the service as of `asked`, with its table
                if reply.state == "syncing" and not repl.syncing:
                    nursery.start_soon(repl.resync)
                admitted.set()
        except StripefsError as exc:
            if exc.code == ErrorCode.NOT_FOUND and known:
                known = False  # the metadata service forgot us (or our registration): register again
            if exc.code in (ErrorCode.PERMISSION, ErrorCode.INVALID, ErrorCode.BUSY):
                log.error("metadata service refused this storage server's registration: %s", exc.message)
            else:
                log.warning("metadata service unreachable from storage server: %s", exc.message)
        polls = polls + 1 if pending else 0
        await trio.sleep(PENDING_POLL if pending and polls <= PENDING_FAST_POLLS else HEARTBEAT_INTERVAL)


async def _compact_small(store: ChunkStore, every: float = COMPACT_EVERY) -> None:
    """Reclaim the container logs' dead space in the background (``ChunkStore.compact_small``):
    a pass every ``every`` seconds, one log at a time, at idle I/O priority."""
    while True:
        await trio.sleep(every)
        while await trio.to_thread.run_sync(store.compact_small):
            await trio.sleep(0.1)


async def serve_storage(
    root: str,
    *,
    secret: str,
    metadata: tuple[str, int] | list[tuple[str, int]],
    host: str = "127.0.0.1",
    port: int = 0,
    cluster_id: str = "",
    payload_budget: int = PAYLOAD_BUDGET,
    busy_after: float = BUSY_AFTER,
    max_client_connections: int = MAX_CLIENT_CONNECTIONS,
    data_sync: bool = True,
    small_chunks: bool | None = None,
    advertise: tuple[str, int] | None = None,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the target in ``root`` until cancelled.

    Reports ``(host, port)`` through ``task_status`` once it is listening *and*
    admitted by the metadata service, so callers can use it at once.

    Args:
        payload_budget: write payload bytes held at once, over all connections;
            beyond it, connections wait before receiving more (``rpc.ByteBudget``).
        busy_after: seconds a write waits for the budget before it is answered BUSY
            (the client backs off with jitter and sends it again).
        max_client_connections: open connections per client id (one more is refused
            with BUSY at the handshake).
        data_sync: sync chunk writes before acknowledging them (``--data-sync full``);
            False acknowledges them from the page cache (``none``).
        small_chunks: new small chunks (up to 256 KiB) go to the container logs (True) or to
            chunk files (False); None: ``$STRIPEFS_SMALL_CHUNKS``, else the logs.
        advertise: the address registered with the metadata service, which clients and
            peers connect to (``host`` may be 0.0.0.0); port 0 stands for the bound port.
            By default the bound address itself.

    Raises:
        StripefsError: PERMISSION when ``root`` belongs to another cluster (:func:`claim_root`).
    """
    os.makedirs(root, exist_ok=True)
    await trio.to_thread.run_sync(claim_root, root, cluster_id)
    store = await trio.to_thread.run_sync(ChunkStore, root, data_sync, small_chunks)
    credential = role_credential(secret, "server")  # every call this server makes is as a server
    addresses = [metadata] if isinstance(metadata, tuple) else list(metadata)  # type: ignore[list-item]
    meta_conn = MetadataLink(addresses, credential, role="server")  # heartbeats find the leading metadata service
    service = StorageService(store, Replicator(store, secret, MetadataLink(addresses, credential, role="server")))  # type: ignore[arg-type]
    _stats.watch(service)  # usage and resync progress, read when the metrics endpoint is scraped
    async with trio.open_nursery() as nursery:
        address = await nursery.start(functools.partial(serve_rpc, service, host, port, secret=secret, cluster_id=cluster_id,
                                                         payload_budget=payload_budget, busy_after=busy_after,
                                                         max_client_connections=max_client_connections))
        admitted = trio.Event()
        shown_host, shown_port = advertise or address  # what the metadata service and clients connect to
        nursery.start_soon(_register_and_heartbeat, service, meta_conn, shown_host, shown_port or address[1], store.root,
                           admitted, nursery)
        nursery.start_soon(_compact_small, store)
        await admitted.wait()
        task_status.started(address)
