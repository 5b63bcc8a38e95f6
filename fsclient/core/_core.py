"""The client core: connections, routing, and the parallel chunk data path.

After ``open`` the client knows the file's layout and computes chunk placement
itself: chunk ``i`` of a file lives on chain ``layout.chains[i % stripe]``. The
metadata service is off the data path (one call at open, one at close/fsync).

Data path (threads, blocking sockets: the kernel copy releases the GIL, so threads
use both cores, ~30% above a single event loop; docs/architecture.md):

* every storage server gets ``conns_per_server`` pipelined connections, each
  with a reader thread (responses land with ``recv_into`` straight in the
  caller's buffer) and a sender thread (a caller queues requests to many
  servers at once and never waits on one socket);
* a read or write is cut at chunk boundaries; all pieces go out at once up to a
  window of ``max_inflight`` per call, and complete in any order;
* failures of a server (connection lost, restarted on a new port) refresh the
  routing table and retry the piece: chunk writes are idempotent.

Fork safety: every entry point checks the pid; a forked child (a DataLoader
worker) drops the parent's connections and threads and reconnects lazily.
"""

from __future__ import annotations

import atexit
import functools
import heapq
import itertools
import logging
import os
import random
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Iterator, TypeVar

import crc32c

from stripefs.rpc import BufferPool, Connection, ConnectionPool, Reply, abandon
from stripefs.wire import Attr, ErrorCode, Layout, Message, ReplyMessage, Routing, StripefsError, check_segments, messages as m

from ._attrcache import AttrCache, LeaseWatch
from ._config import ClusterConfig
from ._metaretry import RETRY_DELAY, RETRY_ENV, RETRY_FOR, MetaHealth, MetaRetry
from ._ordering import WriteOrder
from ._pending import PendingCreates
from ._proc import my_pid

log = logging.getLogger(__name__)

# A server over its load bounds answers BUSY: back off exponentially from BUSY_DELAY up to
# BUSY_DELAY_MAX, with jitter (so the clients it turned away do not return in step).
BUSY_DELAY = 0.02
BUSY_DELAY_MAX = 1.0
REQUEST_TIMEOUT = 120.0
_LIVE: "weakref.WeakSet[ClientCore]" = weakref.WeakSet()
R = TypeVar("R", bound=ReplyMessage)
# Chunk replies are decoded once per chunk: bind the decoders once (a fast path, no reflection).
_read_reply = m.ReadChunkReply.from_header


def check_read(header: dict[str, Any], received: memoryview, coff: int) -> None:
    """End to end: the payload of a ``ReadChunk`` answer against its segment checksums.

    Runs on the connection's reader thread as soon as the bytes are in (see
    ``rpc.Connection.submit``), so pieces from different servers are checked in
    parallel; a torn or corrupted payload fails the piece (retried on another
    replica), never reaches the caller as data.
    """
    crcs = header.get("crcs")
    if crcs is None:
        return  # a server from before end-to-end checks
    if not isinstance(crcs, list):
        raise StripefsError(ErrorCode.PROTOCOL, "ReadChunk reply: crcs is not a list")
    check_segments(received, coff, crcs)
_write_reply = m.WriteChunkReply.from_header
# Chunk request failures retried within the retry budget (anything else reaches the caller).
_RETRIED = frozenset({ErrorCode.UNAVAILABLE, ErrorCode.STALE_ROUTING, ErrorCode.CHECKSUM, ErrorCode.TIMEOUT, ErrorCode.BUSY})


def _after_fork_in_child() -> None:
    for core in list(_LIVE):
        core._reset_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _release_leases_at_exit() -> None:
    """A process that exits without closing its clients still tells the metadata service
    its leases are gone: attribute leases (else others' changes to what it held wait for
    them to run out) and lease locks (else others wait for their TTL)."""
    for core in list(_LIVE):
        if core.pid == my_pid():
            core.release_leases()


atexit.register(_release_leases_at_exit)


def split(layout: Layout, offset: int, length: int) -> Iterator[tuple[int, int, int, int]]:
    """Cut ``[offset, offset+length)`` at chunk boundaries: ``(index, chunk_off, n, pos)``.

    ``pos`` is the piece's offset relative to ``offset``.
    """
    cs = layout.chunk_size
    pos = 0
    while pos < length:
        at = offset + pos
        index, coff = divmod(at, cs)
        n = min(cs - coff, length - pos)
        yield index, coff, n, pos
        pos += n


def seconds_setting(value: float | None, env: str, default: float, what: str) -> float:
    """``value``, else ``$env``, else ``default``: a non-negative number of seconds.

    Raises:
        StripefsError: INVALID for a negative or non-numeric value.
    """
    raw: Any = value
    if raw is None:
        raw = os.environ.get(env) or default
    try:
        seconds = float(raw)
    except (TypeError, ValueError) as exc:
        raise StripefsError(ErrorCode.INVALID, f"{what} must be a number of seconds, got {raw!r}") from exc
    if not seconds >= 0:  # also refuses NaN
        raise StripefsError(ErrorCode.INVALID, f"{what} must be >= 0 seconds, got {raw!r}")
    return seconds


def retry_budget(retry_for: float | None = None) -> float:
    """Seconds failing requests keep retrying (chunk requests, and metadata requests of a
    client that reached the cluster before): ``retry_for``, else ``$STRIPEFS_RETRY_FOR``, else 30.

    Raises:
        StripefsError: INVALID for a negative or non-numeric budget.
    """
    return seconds_setting(retry_for, RETRY_ENV, RETRY_FOR, "retry budget")


def busy_delay(attempt: int, rng: random.Random | None = None) -> float:
    """Seconds to wait before the ``attempt``-th retry (0-based) of a request answered BUSY:
    exponential, capped at ``BUSY_DELAY_MAX``, jittered over the upper half of the step."""
    step = min(BUSY_DELAY * 2 ** min(attempt, 30), BUSY_DELAY_MAX)
    return step / 2 + (rng or random).random() * step / 2


def _read_request(ino: int, index: int, coff: int, k: int, chain: int,
                  version: int) -> tuple[m.ReadChunk, Callable[[dict[str, Any], memoryview], None]]:
    """The ``ReadChunk`` for ``k`` bytes at ``coff`` of chunk ``index``, and the check of its answer."""
    msg = m.ReadChunk(ino=ino, index=index, offset=coff, length=k, chain=chain, routing_version=version)
    return msg, functools.partial(check_read, coff=coff)


def _landed(reply: Reply, dest: memoryview, k: int) -> None:
    """Finish a ``ReadChunk`` answer received into ``dest`` (``k`` bytes asked): the bytes
    it announces must be the bytes that came; a hole or a chunk shorter than the file
    reads as zeros."""
    got = _read_reply(reply.header).length
    if got != reply.nbytes:
        raise StripefsError(ErrorCode.PROTOCOL, f"ReadChunk reply announces {got} bytes, its payload has {reply.nbytes}")
    if got < k:
        dest[got:k] = bytes(k - got)


class PlannedRead:
    """One request that answers a read (:meth:`ClientCore.plan_read`)."""

    __slots__ = ("server_id", "address", "msg", "check", "dest")

    def __init__(self, server_id: int, address: tuple[str, int], msg: m.ReadChunk,
                 check: Callable[[dict[str, Any], memoryview], None], dest: memoryview):
        self.server_id, self.address, self.msg, self.check, self.dest = server_id, address, msg, check, dest

    def finish(self, reply: Reply) -> int:
        """Check ``reply`` (received into ``dest``), zero-fill a hole: the bytes read."""
        _landed(reply, self.dest, len(self.dest))
        return len(self.dest)


def _settle(inflight: "deque[tuple[int, Future]]") -> None:
    """Before failing a call, let its other requests finish: none may write into the
    caller's buffer after we return. Requests that do not finish in time are abandoned."""
    for _, fut in inflight:
        try:
            fut.result(REQUEST_TIMEOUT)
        except TimeoutError:
            abandon(fut)
        except BaseException:  # noqa: BLE001 - only completion matters here
            pass


class QueueDelay:
    """A moving average of the waits the storage servers report for a client's classed
    writes (``WriteChunkReply.queued_us``): the first report sets it, each later one moves
    it an eighth of the way."""

    WEIGHT = 1 / 8

    def __init__(self) -> None:
        self.seconds = 0.0
        self.last = 0.0  # the latest report
        self.reports = 0

    def add(self, waited: float) -> None:
        self.last = waited
        self.reports += 1  # (a lost increment under a race only delays the averaging)
        self.seconds += (waited - self.seconds) * (1.0 if self.reports == 1 else self.WEIGHT)


class ClientCore:
    """Shared machinery of :class:`fsclient.Client` (sync) and the async API."""

    def __init__(self, config: ClusterConfig, *, conns_per_server: int = 2, max_inflight: int = 32,
                 retry_for: float | None = None):
        self.config = config
        self.retry_for = retry_budget(retry_for)
        self.conns_per_server = conns_per_server
        self.max_inflight = max_inflight
        self.buffers = BufferPool()
        self.attrs: "AttrCache | None" = None  # set by Client(attr_timeout=..., leases=...): told of every mutation
        self.leases = False  # ask for attribute leases (Client(leases=True)): the watch starts with the first stat
        self._watch: LeaseWatch | None = None
        self.locks: "weakref.WeakSet[Any]" = weakref.WeakSet()  # the Lease locks held through this core
        self.owner: Callable[[], Any] = lambda: None  # the Client of this core (a weak reference)
        self.meta_health = MetaHealth()  # answered before? waiting now? (how metadata retries behave)
        self.qos = m.QOS_BY_SIZE  # the class of this client's chunk writes (Client(qos=...))
        self.queue_delay = QueueDelay()  # what the servers report of their waits (classed writes only)
        self._init_state()
        _LIVE.add(self)

    def _init_state(self) -> None:
        self.pid = my_pid()
        self.client_id = os.urandom(16)
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        # Pools forget the parent's sockets in a forked child on their own; new ones here
        # also carry the child's new client id.
        secret, role = self.config.secret, self.config.role
        self._meta = ConnectionPool(secret, self.client_id, expect_role="metadata", ids=self._ids, role=role)
        self._data = ConnectionPool(secret, self.client_id, per_server=self.conns_per_server,
                                    expect_role="storage", send_thread=True, role=role)
        self._routing: Routing | None = None
        # Metadata requests go round the services (several with --metadata-services N),
        # each client starting at a different one.
        self._spread = itertools.count(int.from_bytes(self.client_id[:4], "little"))
        self._order = WriteOrder()  # overlapping writes in flight go out in program order
        self.pending = PendingCreates(self)  # names of files opened as new, made at fsync/close

    def _reset_after_fork(self) -> None:
        # The parent's sockets are shared with us: drop them without shutdown(), which
        # would break the parent's connections too.
        self._init_state()
        if self.attrs is not None:  # its lock may have been held by a parent thread at fork time
            self.attrs = AttrCache(self.attrs.timeout)
        self._watch = None  # the parent's thread is not in this process: the next stat starts one

    def lease_cache(self) -> AttrCache | None:
        """The attribute cache, its lease watch started (on first use, and again in a
        forked child): stats ask for leases once the watch is live."""
        if my_pid() != self.pid:
            self._reset_after_fork()
        if self.pending:  # a cached answer must not miss a name this process made
            self.pending.settle()
        cache = self.attrs
        if cache is not None and self.leases and self._watch is None:
            with self._lock:
                if self._watch is None:
                    self._watch = LeaseWatch(self, cache)
        return cache

    def release_leases(self) -> None:
        """Give back the lease locks held through this core and stop its lease watch (the
        service forgets its attribute leases); a forked child gives back nothing."""
        for lock in list(self.locks):  # a forked child's release is a no-op
            lock.release()
        watch = self._watch
        if watch is not None and my_pid() == self.pid:
            watch.close()
            self._watch = None

    def close(self) -> None:
        """:meth:`release_leases`, then close every connection (their threads end with them)."""
        self.release_leases()
        self._data.close()  # in a forked child the pools only forget the parent's sockets
        self._meta.close()

    # -- metadata ---------------------------------------------------------------------------
    def _meta_conn(self, index: int = 0) -> Connection:
        if my_pid() != self.pid:
            self._reset_after_fork()
        return self._meta.get(("metadata", index), self.config.addresses[index])

    def call(self, msg: Message[R], timeout: float = 60.0) -> R:
        """One metadata request, retried across reconnects with the same request id.

        With several metadata services each request goes to the next one in turn,
        and a request that fails with UNAVAILABLE or TIMEOUT (the service died, or it
        does not lead and the request needs the leader) moves on to the next; after a
        full round without an answer it backs off, for the retry budget at most
        (:mod:`._metaretry`: a client that never reached the cluster and finds nobody
        at any address gives up in about a second). The services replay their answer to
        a retried mutation (a shared store records it with the change itself), so a
        retry after a lost connection cannot apply an operation twice, whichever
        service it reaches.

        Returns:
            The typed reply (``msg.Reply``), decoded and checked.

        Raises:
            StripefsError: the service's error; UNAVAILABLE/TIMEOUT once
                ``timeout`` has passed or the retry budget is spent, UNAVAILABLE at once
                when nobody is there (see :mod:`._metaretry`); PROTOCOL for a malformed reply.
        """
        if self.pending:
            self.pending.settle_for(msg)  # what this process made is there before anything looks
        watch = self.attrs if msg.MUTATES else None
        if watch is not None:
            watch.begin(msg)
        reply: Any = None
        try:
            req_id = next(self._ids)
            retry = MetaRetry(self, timeout)
            while True:
                try:
                    header = self._meta_conn(retry.index).call(msg, timeout=timeout, req_id=req_id).header
                    self.meta_health.ok()
                    break
                except StripefsError as exc:
                    wait = retry.after(exc)
                    if wait is None:
                        raise
                    time.sleep(wait)
            reply = m.decode_reply(msg, header)
            return reply
        finally:
            if watch is not None:
                watch.done(msg, reply if reply is not None else StripefsError(ErrorCode.IO, "failed"))

    def attr(self, msg: Message[m.AttrReply]) -> Attr:
        """A metadata request answered with an inode's attributes (:class:`AttrReply`)."""
        return self.call(msg).attr

    # -- routing ----------------------------------------------------------------------------
    def routing(self, refresh: bool = False) -> Routing:
        if refresh or self._routing is None or my_pid() != self.pid:
            routing = self.call(m.GetRouting()).routing
            with self._lock:
                self._routing = routing  # servers that moved get new connections in data_conn
        assert self._routing is not None
        return self._routing

    def _head(self, chain: int) -> int:
        """Writes go to the chain's head; it forwards along the chain."""
        targets = self.routing().chains.get(chain)
        if not targets:
            raise StripefsError(ErrorCode.UNAVAILABLE, f"chain {chain} has no serving target")
        return targets[0]

    def _replica(self, chain: int, spread: int, attempt: int) -> int:
        """Reads go to any serving replica: spread by chunk, the next one on each retry."""
        targets = self.routing().chains.get(chain)
        if not targets:
            raise StripefsError(ErrorCode.UNAVAILABLE, f"chain {chain} has no serving target")
        return targets[(spread + attempt) % len(targets)]

    def data_conn(self, server_id: int) -> Connection:
        if my_pid() != self.pid:
            self._reset_after_fork()
        info = self.routing().servers.get(server_id)
        if info is None:
            raise StripefsError(ErrorCode.UNAVAILABLE, f"unknown storage server {server_id}")
        return self._data.get(server_id, (info.host, info.port))

    # -- data path --------------------------------------------------------------------------
    def _run_pieces(self, pieces: list[tuple[Any, ...]], submit: Any, finish: Any) -> None:
        """Submit pieces with a bounded window; retry failed pieces after a routing refresh.

        ``submit(piece, attempt)`` returns a future; ``finish(piece, reply)`` consumes it.
        Unavailable servers, stale routing, a chain with no serving target and bad
        replicas (checksum) are retried, on the next replica where there is one, for
        up to ``retry_for`` seconds after the piece first failed (a fault in the middle
        of a long call gets the whole budget). A piece that waits does not hold up the
        others: it is due again after a short backoff, and the routing is refreshed
        once per backoff however many pieces wait. A piece answered BUSY (a server
        over its load bounds) backs off exponentially with jitter (:func:`busy_delay`)
        within the same budget, without a routing refresh.
        """
        attempts = [0] * len(pieces)
        busy = [0] * len(pieces)  # BUSY answers in a row, per piece
        seen = [0] * len(pieces)  # routing version each piece was sent with
        failing_since: dict[int, float] = {}
        queue = deque(range(len(pieces)))
        waiting: list[tuple[float, int]] = []  # (due, piece): a heap of pieces backing off
        inflight: deque[tuple[int, Future]] = deque()
        stale = False  # a piece waits for the routing to change: ask for it when one is due
        while queue or inflight or waiting:
            now = time.monotonic()
            while waiting and waiting[0][0] <= now:
                queue.append(heapq.heappop(waiting)[1])
            if stale and queue:
                stale = False
                try:
                    self.routing(refresh=True)
                except StripefsError:
                    pass  # the metadata call has its own retries; the pieces fail below again
            while queue and len(inflight) < self.max_inflight:
                i = queue.popleft()
                try:
                    seen[i] = self.routing().version
                    inflight.append((i, submit(pieces[i], attempts[i])))
                except StripefsError as exc:
                    failed: Future = Future()
                    failed.set_exception(exc)
                    inflight.append((i, failed))
            if not inflight:
                time.sleep(max(0.0, waiting[0][0] - time.monotonic()))
                continue
            i, fut = inflight.popleft()
            try:
                finish(pieces[i], fut.result(REQUEST_TIMEOUT))
                failing_since.pop(i, None)
            except StripefsError as exc:  # first: a TIMEOUT answer is a TimeoutError too, and is retried
                if exc.code not in _RETRIED:
                    _settle(inflight)
                    raise
                now = time.monotonic()
                since = failing_since.setdefault(i, now)
                chain = pieces[i][-1]
                replicas = len(self.routing().chains.get(chain, ()))
                if exc.code == ErrorCode.CHECKSUM and attempts[i] + 1 >= max(replicas, 1):
                    _settle(inflight)
                    raise  # every replica was tried: the bytes are bad everywhere
                if now - since > self.retry_for:
                    _settle(inflight)
                    raise StripefsError(exc.code, f"{exc.message} (still failing after {self.retry_for:g} s of retries; "
                                                  f"the budget is the client's retry_for or {RETRY_ENV})") from exc
                attempts[i] += 1
                if exc.code == ErrorCode.BUSY:
                    heapq.heappush(waiting, (now + busy_delay(busy[i]), i))
                    busy[i] += 1
                    continue
                busy[i] = 0
                if exc.code == ErrorCode.CHECKSUM or self.routing().version > seen[i]:
                    queue.append(i)  # another replica, or newer routing already: at once
                else:
                    # Wait for the routing to change (a dead target taken out of its chain,
                    # a returning one serving again): back off, up to a second.
                    heapq.heappush(waiting, (now + min(RETRY_DELAY * attempts[i], 1.0), i))
                    stale = True
            except TimeoutError as exc:  # no answer within REQUEST_TIMEOUT: give the call up
                for _, other in [(i, fut), *inflight]:  # nothing may land in dest after we return
                    abandon(other)
                raise StripefsError(ErrorCode.TIMEOUT, "storage request timed out") from exc

    def read_into(self, ino: int, layout: Layout, file_size: int, offset: int, dest: memoryview) -> int:
        """Read up to ``len(dest)`` bytes at ``offset``; holes read as zeros. Returns bytes read."""
        n = max(0, min(len(dest), file_size - offset))
        if n == 0:
            return 0
        dest = dest.cast("B") if dest.format != "B" or dest.ndim != 1 else dest
        pieces = [(*p, layout.chain_of(p[0])) for p in split(layout, offset, n)]

        lone = len(pieces) == 1
        if lone:
            # One chunk (a dataloader's sample): one blocking call, whose thread receives
            # the answer itself when the connection is idle -- no hand-off from the reader
            # thread, no future. A failure the retry loop retries goes to it below.
            index, coff, k, pos, chain = pieces[0]
            msg, check = _read_request(ino, index, coff, k, chain, self.routing().version)
            t0 = time.monotonic()
            try:
                conn = self.data_conn(self._replica(chain, ino + index, 0))
                _landed(conn.call(msg, dest=dest[pos : pos + k], timeout=REQUEST_TIMEOUT, check=check), dest[pos : pos + k], k)
                return n
            except StripefsError as exc:
                if exc.code not in _RETRIED:
                    raise
                if exc.code == ErrorCode.TIMEOUT and time.monotonic() - t0 >= REQUEST_TIMEOUT:
                    raise StripefsError(ErrorCode.TIMEOUT, "storage request timed out") from exc  # as the loop's

        def submit(p: tuple[int, int, int, int, int], attempt: int) -> Future:
            index, coff, k, pos, chain = p
            conn = self.data_conn(self._replica(chain, ino + index, attempt))
            msg, check = _read_request(ino, index, coff, k, chain, self.routing().version)
            if not lone:
                return conn.submit(msg, dest=dest[pos : pos + k], check=check)
            # One chunk again, after the call above failed: its outcome goes through the
            # retry loop as a future's would.
            done: Future = Future()
            t0 = time.monotonic()
            try:
                done.set_result(conn.call(msg, dest=dest[pos : pos + k], timeout=REQUEST_TIMEOUT, check=check))
            except StripefsError as exc:
                ours = exc.code == ErrorCode.TIMEOUT and time.monotonic() - t0 >= REQUEST_TIMEOUT
                done.set_exception(TimeoutError() if ours else exc)  # our own timeout: as a future's
            return done

        def finish(p: tuple[int, int, int, int, int], reply: Reply) -> None:
            _index, _coff, k, pos, _chain = p
            _landed(reply, dest[pos : pos + k], k)

        self._run_pieces(pieces, submit, finish)
        return n

    def plan_read(self, ino: int, layout: Layout, file_size: int, offset: int,
                  dest: memoryview) -> PlannedRead | None:
        """Where a read that one request answers goes, or None when it takes more (several
        chunks, nothing to read, the routing to fetch, a forked child's first call): the
        server (the replica this client reads the chunk from), the request, the check of
        its answer and the bytes it lands in. :meth:`start_read` sends it on this
        client's connection; the FUSE daemon may send it on its loop's own."""
        routing = self._routing
        n = max(0, min(len(dest), file_size - offset))
        if n == 0 or routing is None or my_pid() != self.pid:
            return None
        index, coff = divmod(offset, layout.chunk_size)
        if coff + n > layout.chunk_size:
            return None
        chain = layout.chain_of(index)
        targets = routing.chains.get(chain)
        info = routing.servers.get(targets[(ino + index) % len(targets)]) if targets else None
        if info is None:
            return None
        dest = (dest.cast("B") if dest.format != "B" or dest.ndim != 1 else dest)[:n]
        msg, check = _read_request(ino, index, coff, n, chain, routing.version)
        return PlannedRead(info.server_id, (info.host, info.port), msg, check, dest)

    def start_read(self, ino: int, layout: Layout, file_size: int, offset: int,
                   dest: memoryview) -> tuple[Future, Callable[[Reply], int]] | None:
        """One attempt at a read that one request answers, for callers that must not block.

        A read within one chunk, on a connection already open, under routing already
        known (:meth:`plan_read`): the request frame goes out from the calling thread (a
        small frame, the socket's send buffer takes it) and the answer lands in ``dest``
        on the connection's reader thread. Returns its future and ``finish(reply)``, which
        checks the answer, zero-fills a hole and returns the bytes read -- or None when
        the read takes more (several chunks, nothing to read, a connection or the routing
        to fetch): :meth:`read_into` then. A failed attempt is not retried here;
        :meth:`read_into`, which has the whole retry loop, takes over.
        """
        plan = self.plan_read(ino, layout, file_size, offset, dest)
        return self.submit_planned(plan) if plan is not None else None

    def submit_planned(self, plan: PlannedRead) -> tuple[Future, Callable[[Reply], int]] | None:
        """:meth:`start_read` of a read already planned: None without an open connection."""
        conn = self._data.live_one(plan.server_id, plan.address)
        if conn is None:
            return None
        return conn.submit(plan.msg, dest=plan.dest, check=plan.check), plan.finish

    def write_from(self, ino: int, layout: Layout, offset: int, data: memoryview) -> None:
        """Write ``data`` at ``offset``, all chunks in parallel; returns once every piece is acked.

        Ordered after earlier writes of this client to overlapping bytes (see :meth:`submit_write`).

        Raises:
            StripefsError: a piece could not be written (the other pieces have finished).
        """
        for fut in self.submit_write(ino, layout, offset, data):
            fut.result()

    def submit_write(self, ino: int, layout: Layout, offset: int, data: memoryview) -> list[Future]:
        """Start a write in the background; one future per call, resolving when acked.

        Writes are ordered where they overlap: the pieces are registered here, in
        the caller's thread, and a piece is not sent before every earlier write of
        this client to overlapping bytes of the same inode has finished, so the
        later bytes always land last (requests on the wire complete in any order).
        Writes to disjoint ranges still go out in parallel. A write of at most
        one chunk whose range is free is sent from the caller's thread; any
        other runs on a thread of its own.

        The caller must keep ``data`` unchanged until the future resolves.

        Args:
            ino: the file's inode.
            layout: the file's layout (chunk size, chains).
            offset: the file offset of ``data[0]``.
            data: the bytes to write.

        Returns:
            One future, resolving to None when every piece is acknowledged, or
            to the error that stopped the write.
        """
        data = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        done: Future = Future()
        pieces = [(*p, layout.chain_of(p[0])) for p in split(layout, offset, len(data))]
        ticket = self._order.register(ino, [(offset + p[3], offset + p[3] + p[2]) for p in pieces])
        acked = {p[3]: fut for p, fut in zip(pieces, ticket.pieces)}

        def run() -> None:
            try:
                ticket.wait()
                crcs = {p[3]: crc32c.crc32c(data[p[3] : p[3] + p[2]]) for p in pieces}

                def submit(p: tuple[int, int, int, int, int], attempt: int) -> Future:
                    index, coff, k, pos, chain = p
                    conn = self.data_conn(self._head(chain))
                    msg = m.WriteChunk(ino=ino, index=index, offset=coff, crc=crcs[pos], chunk_size=layout.chunk_size,
                                       chain=chain, routing_version=self.routing().version, qos=self.qos)
                    return conn.submit(msg, payload=data[pos : pos + k])

                def finish(p: tuple[int, int, int, int, int], reply: Reply) -> None:
                    answer = _write_reply(reply.header)  # a well-formed WriteChunkReply, or PROTOCOL
                    if self.qos != m.QOS_BY_SIZE:
                        self.queue_delay.add(answer.queued_us / 1e6)
                    acked[p[3]].set_result(None)  # later writes over this piece may go now

                self._run_pieces(pieces, submit, finish)
                ticket.finish()
                done.set_result(None)
            except BaseException as exc:  # delivered to whoever waits on the future
                # A piece abandoned after a timeout may still land later; its error is
                # what the file reports, and later writes are not held back forever.
                ticket.finish(exc)
                done.set_exception(exc)

        if len(data) <= layout.chunk_size and ticket.ready():
            run()
        else:
            threading.Thread(target=run, name="stripefs-write", daemon=True).start()
        return [done]
