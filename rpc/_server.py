"""The trio server loop shared by the metadata service and the storage servers.

One task per connection reads frames; each request is handled in its own task
(many in flight per connection, answered in any order, matched by request id),
unless the service answers it at once (``Service.answer_now``: a short read the
service holds no lock for), which the reader task then sends itself.
A request's payload is read by its handler *before* the next frame is parsed,
because the stream is ordered; handlers that do not want the payload get it
discarded. Responses share one send lock per connection.

Small frames take a short path: a frame head is read straight from the socket
when bytes are there (the loop is entered only to wait for more), and a small
response whose connection has no send in progress is written at once, without
taking a trio lock. Each saves a pass through trio's scheduler per request (trio's
socket methods yield once more after an operation that succeeded at once). The
answers the reader makes itself (``answer_now``, refusals of bad requests) are
held (:meth:`ServerConn.hold`) while more requests are already there, and written
together: one ``write`` for a burst of pipelined requests, and the answer to a
lone request at once. The reader sends what it holds before it waits, yields, or
lets anyone else answer a request of its connection, so no other sender sees the
difference.

The protocol itself (handshake, request decoding, payload hand-off) is the
sans-IO :class:`wire.ServerConnection`; this module only moves bytes. Bulk sends
go through worker threads (``sendfile`` of a chunk file, or a buffer; see
``_replies.py``), so no blocking call runs on the trio loop. Latency-bound replies
(small reads) go to the connection's own reply thread instead
(:meth:`ServerConn.reply_in_thread`, :meth:`Service.thread_job`): no worker-thread
hand-off and no wake-up of the loop per request. After the first such request the
thread also receives the connection's frames itself (:meth:`ServerConn.thread_receives`)
until one is not for it, which it hands back to the reader task. Every frame is sent
under the connection's wire lock (a ``threading.Lock``; trio takes it without blocking).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import threading
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import trio

from stripefs import wire
from stripefs.wire import (
    NEED_DATA,
    BadRequest,
    ErrorCode,
    Event,
    FrameHead,
    HandshakeComplete,
    RequestReceived,
    ServerConnection,
    StripefsError,
)

from . import _metrics
from ._replies import ConnThread, ThreadJob, ThreadReply, send_all, sendfile_all

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 10.0
MAX_IN_FLIGHT = 64  # per connection; back-pressure beyond that
MAX_CONNECTIONS = 4096  # per server: accepting pauses at this many open connections
PAYLOAD_BUDGET = 512 << 20  # per server: request payload bytes held at once (received, not yet handled)
# Seconds a request may wait for the byte budget before it is answered BUSY (the client
# backs off and sends it again) rather than holding its connection's stream any longer.
BUSY_AFTER = 1.0
MAX_CLIENT_CONNECTIONS = 64  # per server: open connections from one client id (a pool opens a few)
ACCEPT_RETRY = 0.1  # seconds to wait when accept() fails for lack of descriptors or memory
# accept() errors that mean "not now" (out of descriptors or kernel memory), never "stop serving".
_ACCEPT_TRANSIENT = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
# accept() errors about one connection that died in the backlog.
_ACCEPT_PEER = {errno.ECONNABORTED, errno.EPROTO, errno.EPERM}
MIN_READ = 256  # a whole small request in one read; the few payload bytes past a header are copied once
BURST_READ = 4096  # the read size while answers are held: a burst of pipelined small requests at once
SMALL_SEND = 16384  # responses up to this size go out as one write (copying is cheaper than a syscall)
YIELD_EVERY = 8  # the reader passes through the scheduler at least every 8 requests (reads that find bytes do not)
SOCK_BUF = 4 << 20
# Jobs waiting on a connection's reply thread (ServerConn.reply_in_thread); past this many
# a request waits for room (its task holds one of the connection's MAX_IN_FLIGHT slots).
MAX_QUEUED = MAX_IN_FLIGHT
WIRE_RETRY = (50e-6, 5e-3)  # a trio sender retries a wire lock held by a thread after 50 µs, doubling to 5 ms


def tune_socket(sock: Any) -> None:
    """Big buffers and no Nagle: frames are small headers followed by big payloads."""
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)
        except OSError:
            pass
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class ServerConn:
    """One accepted connection, as a handler sees it.

    Bytes move through a :class:`wire.ServerConnection` state machine (the
    handshake, request decoding, payload hand-off); this class only does I/O.
    """

    def __init__(self, sock: trio.socket.SocketType, peer: Any, machine: ServerConnection):
        self.sock = sock
        self.peer = peer
        self.machine = machine
        self.send_lock = trio.Lock()  # trio senders queue here, in turn
        self.wire_lock = threading.Lock()  # held by whoever writes a frame, trio task or thread
        self._fd = sock.fileno()
        self._thread: ConnThread | None = None
        # While the reply thread receives (thread_receives): set when it hands receiving back.
        self._back: trio.Event | None = None
        self._back_item: Any = None
        self._token = trio.lowlevel.current_trio_token()
        # Response frames the reader made itself (hold()), sent together before it next waits.
        self._held = bytearray()
        self._more = False  # the last read filled its buffer: more bytes are likely waiting

    @property
    def client_id(self) -> bytes:
        """The authenticated peer's client id (b"" before the handshake)."""
        return self.machine.client_id

    @property
    def peer_role(self) -> str:
        """What the peer authenticated as: "client" or "server" ("" before the handshake)."""
        return self.machine.peer_role

    async def _fill(self, n: int) -> None:
        # Read only a little past the end of the next header when a payload may follow,
        # so the payload goes straight from the socket into its destination buffer.
        # The socket is non-blocking: read now, wait in the loop only when nothing is there.
        # Held answers go out before the read when the last read emptied the socket: a
        # client waiting for them sends nothing more until it has them, and the read right
        # after the write may find a quick client's next request. They are kept while a
        # burst of pipelined requests is still being read (reads that fill their buffer),
        # and go out when a read finds nothing.
        if self._held and not self._more:
            await self.flush()
        size = max(n, BURST_READ if self._held else MIN_READ)
        while True:
            try:
                data = os.read(self._fd, size)
                break
            except BlockingIOError:
                if self._held:  # nothing more to answer for now: what the reader answered goes out
                    await self.flush()
                await trio.lowlevel.wait_readable(self.sock)
        self._more = len(data) == size
        self.machine.receive_data(data)

    async def _take_wire(self) -> None:
        """Take the wire lock without blocking the loop: at once when free, else retried
        after short sleeps (a thread holds it for one frame)."""
        wire_lock = self.wire_lock
        delay, most = WIRE_RETRY
        while not wire_lock.acquire(blocking=False):
            await trio.sleep(delay)
            delay = min(delay * 2, most)

    @asynccontextmanager
    async def _sending(self) -> AsyncIterator[None]:
        """Hold the send lock (trio senders in turn), then the wire lock (against threads)."""
        async with self.send_lock:
            await self._take_wire()
            try:
                yield
            finally:
                self.wire_lock.release()

    async def _send_small(self, data: bytes | bytearray) -> None:
        """Send whole small frames: written at once when no other send is in progress and
        the socket takes it all (no pass through the scheduler, no trio lock taken), else
        in turn."""
        wire_lock = self.wire_lock
        if self.send_lock.locked() or not wire_lock.acquire(blocking=False):
            async with self._sending():
                await self._sendall_or_tear(data)
            return
        try:
            n = os.write(self._fd, data)
        except BlockingIOError:
            n = 0
        except BaseException:
            wire_lock.release()
            self._tear()
            raise
        if n == len(data):
            wire_lock.release()
            return
        # The socket took part of it: the rest waits in the loop, with the send lock held so
        # other trio senders queue behind (free: locked() said so, and nothing awaited since).
        self.send_lock.acquire_nowait()
        try:
            await _trio_sendall(self.sock, memoryview(data)[n:])
        except BaseException:
            self._tear()
            raise
        finally:
            wire_lock.release()
            self.send_lock.release()

    def hold(self, head: FrameHead, header: dict[str, Any]) -> int:
        """Encode the response to ``head`` (no payload) and keep it: the reader task sends
        the frames it made itself together (:meth:`flush`) once it has answered the
        requests already there (:meth:`hold_on`). Only the reader task holds frames; it
        flushes before it waits, yields, or lets any other sender answer a request of its
        connection (a task, a thread).

        Returns:
            The bytes held now.

        Raises:
            StripefsError: TOO_BIG for an oversized header (nothing is held).
        """
        held = self._held
        held += self.machine.send_response(head, header)
        return len(held)

    def hold_error(self, head: FrameHead, exc: StripefsError) -> int:
        """:meth:`hold` of the error frame answering ``head``."""
        held = self._held
        held += self.machine.send_error(head, exc)
        return len(held)

    @property
    def held(self) -> int:
        """Bytes of the frames :meth:`hold` kept that are not sent yet."""
        return len(self._held)

    def hold_on(self) -> bool:
        """Whether the reader should keep holding after an answer: below ``SMALL_SEND``, and
        more requests are here already (a whole frame head buffered, or the last read
        filled its buffer). Else it sends now, as early as an answer written at once: a
        client that waits for it sends nothing more, and the read after the write may
        then find its next request."""
        return len(self._held) < SMALL_SEND and (self._more or not self.machine.next_read_size())

    async def flush(self) -> None:
        """Send the frames :meth:`hold` kept, in one write when the socket takes them all."""
        if self._held:
            data, self._held = self._held, bytearray()
            await self._send_small(data)

    async def _sendall_or_tear(self, data: bytes | memoryview) -> None:
        try:
            await _trio_sendall(self.sock, data)
        except BaseException:
            self._tear()
            raise

    async def next_event(self) -> Event:
        """The next event from the peer (frames the machine answers itself are sent here).
        While the reply thread receives (:meth:`thread_receives`), the first event it did
        not serve itself, once it hands receiving back. Frames :meth:`hold` kept are sent
        before it waits.

        Raises:
            StripefsError: a refused handshake (after the refusal was sent) or a broken stream.
            OSError, EOFError: the reply thread's receiving failed.
        """
        if self._back is not None:
            await self.flush()
            await self._back.wait()
            item, self._back, self._back_item = self._back_item, None, None
            if isinstance(item, BaseException):
                raise item
            return item  # type: ignore[no-any-return]
        while True:
            while n := self.machine.next_read_size():
                await self._fill(n)
            try:
                event = self.machine.next_event()
            finally:
                out = self.machine.data_to_send()
                if out:
                    await self.flush()
                    async with self._sending():
                        await _trio_sendall(self.sock, out)
            if event is not NEED_DATA:
                return event  # type: ignore[return-value]

    async def handshake(self) -> None:
        """Send the challenge and check the peer's answer.

        Raises:
            StripefsError: AUTH (refused, the peer was told), PROTOCOL.
            EOFError: the peer left first.
        """
        await _trio_sendall(self.sock, self.machine.start())
        event = await self.next_event()
        if not isinstance(event, HandshakeComplete):
            raise EOFError("connection closed during the handshake")

    async def recv_payload_into(self, dest: memoryview) -> None:
        """Receive the current frame's payload straight into ``dest`` (exact length)."""
        got = self.machine.take_payload(dest)
        view = memoryview(dest)[got:]
        while view:
            n = await self.sock.recv_into(view)
            if n == 0:
                raise EOFError
            self.machine.payload_received(n)
            view = view[n:]

    async def discard_payload(self) -> None:
        """Drop the current frame's payload (the reader skips it as it arrives)."""
        self.machine.discard_payload()

    async def send(
        self,
        head: FrameHead,
        header: dict[str, Any],
        *,
        payload: memoryview | bytes | None = None,
        file: tuple[int, int, int] | None = None,
    ) -> None:
        """Send a response; the payload is a buffer or ``(fd, offset, length)`` to sendfile."""
        plen = len(payload) if payload is not None else (file[2] if file else 0)
        prefix = self.machine.send_response(head, header, plen)
        if file is None and plen <= SMALL_SEND:
            await self._send_small(prefix + bytes(payload) if plen else prefix)  # type: ignore[arg-type]
            return
        async with self._sending():
            try:
                if file is not None:
                    await _trio_sendall(self.sock, prefix)
                    await trio.to_thread.run_sync(sendfile_all, self.sock.fileno(), *file)
                elif plen < 256 * 1024:
                    await _trio_sendall(self.sock, prefix)
                    await _trio_sendall(self.sock, payload)  # type: ignore[arg-type]
                else:
                    await _trio_sendall(self.sock, prefix)
                    await trio.to_thread.run_sync(send_all, self.sock.fileno(), payload)
            except BaseException:
                self._tear()
                raise

    async def send_error(self, head: FrameHead, exc: StripefsError) -> None:
        await self._send_small(self.machine.send_error(head, exc))

    async def reply_from_thread(self, head: FrameHead, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(reply, *args)`` on a worker thread that answers ``head`` itself.

        ``reply`` is a :class:`ThreadReply`; the send and wire locks are held (here, in
        the trio task) for the whole call, so the frame goes out in one piece and in order.
        If ``fn`` raises before sending, the caller answers with the error as usual.

        Raises:
            RuntimeError: ``fn`` returned without answering.
        """
        async with self._sending():
            reply = ThreadReply(self.sock.fileno(), self.machine, head)
            try:
                await trio.to_thread.run_sync(fn, reply, *args)
            finally:
                if reply.torn:
                    self._tear()
        if not reply.sent:
            raise RuntimeError(f"{getattr(fn, '__name__', fn)} returned without answering")

    def try_reply_in_thread(self, head: FrameHead, fn: Callable[..., None], *args: Any) -> bool:
        """:meth:`reply_in_thread` when there is room in the queue (True), else nothing (False).
        Not async: a :meth:`Service.handle_now` can hand a request over from the reader."""
        thread = self._thread
        if thread is None:
            thread = self._thread = ConnThread(self._fd, self.machine, self.wire_lock, self._tear,
                                               name=f"stripefs-conn-{self._fd}")
        elif thread.queued() >= MAX_QUEUED:
            return False
        thread.submit(head, fn, args)
        return True

    def thread_receives(self, serve: ThreadJob) -> None:
        """Hand the receiving side to the connection's reply thread (started by a request
        handed to it first; else nothing happens), from the reader task, between frames.

        The thread reads and decodes frames itself and answers those ``serve(head, msg)``
        gives a job for (the small reads of a data connection: no pass through the loop
        at all); the first other event is handed back and :meth:`next_event` returns it.
        Meanwhile :meth:`reply_in_thread` answers through a trio worker thread."""
        thread = self._thread
        if thread is None or thread.receiving:
            return
        self._back = trio.Event()
        thread.receive(serve, self._thread_back)

    def _thread_back(self, item: Any) -> None:
        """On the reply thread: receiving ends with ``item`` (event or exception)."""
        try:
            self._token.run_sync_soon(self._took_back, item)
        except trio.RunFinishedError:
            pass  # the server is gone

    def _took_back(self, item: Any) -> None:
        if self._back is not None:
            self._back_item = item
            self._back.set()

    async def reply_in_thread(self, head: FrameHead, fn: Callable[..., None], *args: Any) -> None:
        """Have the connection's own reply thread run ``fn(reply, *args)``, which answers
        ``head`` itself; returns at once, without a checkpoint.

        The thread (a :class:`ConnThread`, started at the first call, ended when the
        connection closes) takes the wire lock per frame; an exception from ``fn`` before
        it answered is answered there (StripefsError as is, OSError by errno, others EIO).
        No trio worker thread is involved and the loop is not woken when the job is done.
        With ``MAX_QUEUED`` jobs already waiting, this waits for room (the thread wakes
        the loop then), so a flooding connection is held back.
        """
        thread = self._thread
        if thread is not None and thread.receiving:  # blocked in a read: a worker thread answers
            await self.reply_from_thread(head, fn, *args)
            return
        while not self.try_reply_in_thread(head, fn, *args):
            await self._thread.wait_for_room(MAX_QUEUED)  # type: ignore[union-attr]

    def close(self, *, abandon: bool = True) -> None:
        """Close the connection. With a reply thread, the socket is shut down (``abandon``:
        the queued jobs are skipped) or left to answer the queued jobs (the peer ended the
        stream cleanly), and the thread closes the descriptor when it ends."""
        thread = self._thread
        if thread is None:
            self.sock.close()
            return
        if abandon:
            self._tear()
        trio.lowlevel.notify_closing(self.sock)
        thread.close(self.sock.detach(), abandon=abandon)

    def _tear(self) -> None:
        """A frame went out in part: nothing more may be sent; the peer sees EOF, not garbage."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


async def _trio_sendall(sock: trio.socket.SocketType, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        n = await sock.send(view)
        view = view[n:]


class Service:
    """What a server plugs into :func:`serve_rpc`.

    ``receive_payload`` runs on the connection's reader task (the stream is
    ordered, so the payload must be read before the next frame); ``handle``
    runs in its own task, so slow requests do not block the connection.
    About a request without a payload the reader asks ``handle_now`` first (hand it
    over, e.g. to the connection's reply thread), then ``answer_now`` (answer it at once).
    """

    role: str = "service"

    def thread_job(self, head: FrameHead, msg: wire.Message) -> Callable[..., None] | None:
        """The job ``fn(reply, msg)`` that answers a request without payload on its
        connection's own reply thread, right where it was received, or None (the default:
        the trio side serves it). Called on the reader task and, once the connection's
        thread receives for itself, on that thread: it must not block, await or change
        state. A service that returns jobs here has the reader hand them over (as
        :meth:`handle_now` would) and the receiving side too, from the first one on."""
        return None

    def handle_now(self, conn: ServerConn, head: FrameHead, msg: wire.Message) -> bool:
        """Dispose of a request on the reader itself, without a task: True when it did
        (typically handed to :meth:`ServerConn.try_reply_in_thread`), False to have
        ``answer_now`` or ``handle`` serve it. Must not block or await; an exception counts as False."""
        return False

    async def receive_payload(self, conn: "ServerConn", head: FrameHead, msg: wire.Message) -> Any:
        await conn.discard_payload()
        return None

    async def handle(self, conn: "ServerConn", head: FrameHead, msg: wire.Message, payload: Any) -> None:
        raise NotImplementedError

    def connection_ended(self, conn: ServerConn, clean: bool) -> None:
        """An admitted connection is over; ``clean``: the peer closed it (end of stream,
        which only the peer's own close or exit sends), not an error or a reset."""

    def answer_now(self, conn: ServerConn, head: FrameHead, msg: wire.Message) -> dict[str, Any] | None:
        """The response header to a request without payload that can be answered at once,
        with no await (the reader task sends it: no task is started for it; answers to a
        burst of pipelined requests leave in one write, see :meth:`ServerConn.hold`); None
        to have :meth:`handle` answer it in a task of its own, as every request by default.

        Raises:
            StripefsError: the request's answer is this error.
        """
        return None


class ByteBudget:
    """Payload bytes a whole server holds at once: acquired before a request's payload
    is received, released when its handler is done.

    A request that does not fit waits (first come, first served), and so does
    the reading of its connection: the client's further bytes stay in the
    socket buffers, and TCP flow control slows the client down. One request
    larger than the whole budget is admitted alone. The server waits through
    :meth:`acquire_within`: past its patience, or behind a queue already a whole
    budget deep, the request is answered BUSY instead (the client backs off).

    Args:
        limit: bytes (> 0).
    """

    def __init__(self, limit: int):
        if limit <= 0:
            raise ValueError("a byte budget must be positive")
        self.limit = limit
        self.used = 0
        self.waiting = 0  # bytes of the requests queued for the budget
        self.refused = 0  # requests answered BUSY (acquire_within gave up)
        self._logged = (-1e9, 0)  # (when, refused then): one log line per 10 s at most
        self._waiters: deque[tuple[int, trio.Event]] = deque()

    async def acquire_within(self, n: int, patience: float) -> bool:
        """:meth:`acquire`, giving up after ``patience`` seconds in the queue, or at once
        when the queue already holds a whole budget's worth of bytes (a request that
        joined it would wait for at least one full turnover). True when acquired."""
        if self.waiting < self.limit:
            with trio.move_on_after(patience):
                await self.acquire(n)
                return True
        self.refused += 1
        now = trio.current_time()
        if now - self._logged[0] >= 10:
            log.warning("payload budget of %d MiB full: %d requests answered BUSY so far (%d since the last report)",
                        self.limit >> 20, self.refused, self.refused - self._logged[1])
            self._logged = (now, self.refused)
        return False

    def _fits(self, n: int) -> bool:
        return self.used + n <= self.limit or self.used == 0

    async def acquire(self, n: int) -> None:
        if not self._waiters and self._fits(n):
            self.used += n
            return
        entry = (n, trio.Event())
        self._waiters.append(entry)
        self.waiting += n
        try:
            await entry[1].wait()
        except BaseException:
            if entry[1].is_set():
                self.release(n)  # granted as we were cancelled: give it back
            else:
                self._waiters.remove(entry)
                self.waiting -= n
                self._wake()  # those behind us may fit now
            raise

    def release(self, n: int) -> None:
        self.used -= n
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self._fits(self._waiters[0][0]):
            n, event = self._waiters.popleft()
            self.waiting -= n
            self.used += n
            event.set()


class ClientSlots:
    """Open connections per client id, capped: the handshake of one more is refused
    with BUSY (the client sees ``StripefsError(BUSY)``, errno EBUSY, from connect).

    Args:
        cap: connections one client id may hold open at once (> 0).
    """

    def __init__(self, cap: int):
        if cap <= 0:
            raise ValueError("a per-client connection cap must be positive")
        self.cap = cap
        self._open: dict[bytes, int] = {}

    def admit(self, client_id: bytes, role: str) -> StripefsError | None:
        """Count one more connection of ``client_id``, or the refusal when it has ``cap`` open."""
        n = self._open.get(client_id, 0)
        if n >= self.cap:
            return StripefsError(ErrorCode.BUSY, f"too many connections from this {role}: {n} open, "
                                                 f"the server allows {self.cap} per client")
        self._open[client_id] = n + 1
        return None

    def release(self, client_id: bytes) -> None:
        n = self._open.pop(client_id, 0) - 1
        if n > 0:
            self._open[client_id] = n


class ReplayCache:
    """Responses to recent mutating requests, by (client id, request id).

    A client that lost its connection retries a mutation with the same ids; the
    replayed answer keeps e.g. an exclusive create from failing with EEXIST on
    its own earlier success.
    """

    def __init__(self, size: int = 8192):
        self.size = size
        self._d: OrderedDict[tuple[bytes, int], dict[str, Any] | StripefsError] = OrderedDict()

    def get(self, key: tuple[bytes, int]) -> dict[str, Any] | StripefsError | None:
        return self._d.get(key)

    def put(self, key: tuple[bytes, int], value: dict[str, Any] | StripefsError) -> None:
        self._d[key] = value
        while len(self._d) > self.size:
            self._d.popitem(last=False)


def _hook(service: Service, name: str) -> Callable[..., Any] | None:
    """``service.<name>``, or None when it is :class:`Service`'s default (which does nothing)."""
    fn = getattr(service, name)
    return None if getattr(fn, "__func__", None) is getattr(Service, name) else fn  # type: ignore[no-any-return]


_CONN_ERRORS = (EOFError, trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError, trio.TooSlowError)


async def _serve_conn(sock: trio.socket.SocketType, peer: Any, service: Service, secret: str, cluster_id: str,
                      budget: ByteBudget, busy_after: float, clients: ClientSlots) -> None:
    """Serve one connection. Nothing that happens here may take the server down."""
    machine = _metrics.server_machine()  # counts requests once this process serves metrics
    conn = ServerConn(sock, peer, machine(secret, service.role, cluster_id, admit=clients.admit))
    limit = trio.Semaphore(MAX_IN_FLIGHT)
    clean_end = False  # the peer ended the stream: queued replies are still sent

    async def reply_error(head: FrameHead, exc: StripefsError) -> None:
        try:
            await conn.send_error(head, exc)
        except (*_CONN_ERRORS, OSError):
            pass  # the peer is gone; nobody to tell

    def failure(msg: wire.Message, exc: Exception) -> StripefsError:
        """The answer to a request whose handler raised ``exc``."""
        if isinstance(exc, StripefsError):
            return exc
        if isinstance(exc, OSError):
            return wire.error_from_oserror(exc)
        log.error("%s failed", type(msg).__name__, exc_info=exc)  # a bug: answer EIO, keep serving
        return StripefsError(ErrorCode.IO, f"internal error: {type(exc).__name__}: {exc}")

    async def run_one(head: FrameHead, msg: wire.Message, payload: Any) -> None:
        try:
            await service.handle(conn, head, msg, payload)
        except StripefsError as exc:  # before _CONN_ERRORS: some codes are ConnectionErrors too
            await reply_error(head, exc)
        except _CONN_ERRORS:
            pass
        except Exception as exc:  # noqa: BLE001 -- answered as failure() says
            await reply_error(head, failure(msg, exc))
        finally:
            limit.release()
            if head.payload_len:
                budget.release(head.payload_len)

    told: list[bool] = []

    def ended(clean: bool) -> None:
        """Tell the service, once, that the connection is over."""
        if told:
            return
        told.append(clean)
        try:
            service.connection_ended(conn, clean)
        except Exception:
            log.exception("connection end of %s", peer)

    # The service's optional hooks, looked up once; one it does not override is never called.
    thread_job = _hook(service, "thread_job")
    handle_now = _hook(service, "handle_now")
    answer_now = _hook(service, "answer_now")

    async def handed_over(head: FrameHead, msg: wire.Message) -> bool:
        """Whether ``thread_job`` or ``handle_now`` disposed of the request (no task)."""
        await conn.flush()  # what the reader answered goes out before what a thread answers
        if thread_job is not None:
            try:
                job = thread_job(head, msg)
                if job is not None and conn.try_reply_in_thread(head, job, msg):
                    conn.thread_receives(thread_job)
                    return True
            except Exception:  # noqa: BLE001, S110 -- served below
                pass
        if handle_now is not None:
            try:
                return bool(handle_now(conn, head, msg))
            except Exception:  # noqa: BLE001 -- answer_now or handle() serves it and answers any failure
                return False
        return False

    def answered_now(head: FrameHead, msg: wire.Message) -> bool:
        """Whether ``answer_now`` answered the request; its frame (or error) is then held."""
        try:
            header = answer_now(conn, head, msg)  # type: ignore[misc]
            if header is None:
                return False
            conn.hold(head, header)
        except Exception as exc:  # noqa: BLE001 -- answered as failure() says
            conn.hold_error(head, failure(msg, exc))
        return True

    async def read_loop(nursery: trio.Nursery) -> None:
        unyielded = 0
        while True:
            unyielded += 1
            if unyielded >= YIELD_EVERY:  # frames were there each time: let the handlers run
                unyielded = 0
                await conn.flush()
                await trio.lowlevel.checkpoint()
            event = await conn.next_event()  # the held answers go out before it waits for bytes
            if type(event) is not RequestReceived:
                if isinstance(event, BadRequest):  # its payload is skipped; the stream goes on
                    conn.hold_error(event.head, event.error)
                    if not conn.hold_on():
                        await conn.flush()
                    continue
                await conn.flush()  # ConnectionClosed: the peer ended the stream, still reading answers
                return
            head, msg = event.head, event.message
            if not head.payload_len:
                if (thread_job is not None or handle_now is not None) and await handed_over(head, msg):
                    continue
                if answer_now is not None and answered_now(head, msg):
                    if not conn.hold_on():
                        await conn.flush()
                    continue
            await conn.flush()  # before anything is awaited or started for this request
            try:
                limit.acquire_nowait()
            except trio.WouldBlock:
                await limit.acquire()
            # The budget is taken before a byte of the payload is received; a request that
            # would wait too long is refused instead (its payload skipped as it arrives).
            if head.payload_len and not await budget.acquire_within(head.payload_len, busy_after):
                limit.release()
                await conn.discard_payload()
                await reply_error(head, StripefsError(
                    ErrorCode.BUSY, f"server busy: {budget.used >> 20} MiB of request payloads held "
                                    f"({budget.limit >> 20} MiB budget), {budget.waiting >> 20} MiB queued; retry later"))
                continue
            try:
                payload = await service.receive_payload(conn, head, msg)
            except BaseException as exc:
                limit.release()
                if head.payload_len:
                    budget.release(head.payload_len)
                if not isinstance(exc, StripefsError):
                    raise
                await conn.discard_payload()
                await reply_error(head, exc)
                continue
            nursery.start_soon(run_one, head, msg, payload)

    try:
        with trio.fail_after(HANDSHAKE_TIMEOUT):
            await conn.handshake()
        async with trio.open_nursery() as nursery:
            try:
                try:
                    await read_loop(nursery)
                except Exception:
                    # The stream broke (a protocol violation, a reset): answers made before it still go out.
                    with contextlib.suppress(*_CONN_ERRORS, OSError, StripefsError):
                        await conn.flush()
                    raise
                clean_end = True
                ended(True)  # now, not once the handlers in flight (a long poll) are done
            except _CONN_ERRORS:
                pass
            except StripefsError as exc:  # protocol violation: stream position is lost
                log.info("closing connection from %s: %s", peer, exc.message)
            except OSError as exc:
                if exc.errno not in (errno.ECONNRESET, errno.EPIPE, errno.EBADF):
                    log.warning("connection from %s failed: %s", peer, exc)
    except _CONN_ERRORS:
        pass
    except StripefsError as exc:
        log.info("refused connection from %s: %s", peer, exc.message)
    except Exception:
        log.exception("connection from %s failed", peer)
    finally:
        if conn.peer_role:  # admitted: counted in ``clients``
            clients.release(conn.client_id)
            ended(clean_end)
        conn.close(abandon=not clean_end)


async def serve_rpc(
    service: Service,
    host: str,
    port: int,
    *,
    secret: str,
    cluster_id: str = "",
    payload_budget: int = PAYLOAD_BUDGET,
    max_connections: int = MAX_CONNECTIONS,
    busy_after: float = BUSY_AFTER,
    max_client_connections: int = MAX_CLIENT_CONNECTIONS,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Listen on ``host:port`` (0 = any free port) and serve until cancelled.

    Calls ``task_status.started((host, port))`` with the bound address.

    Args:
        payload_budget: request payload bytes held at once, server-wide (:class:`ByteBudget`).
        max_connections: open connections at once; accepting pauses at the cap (the
            kernel's backlog holds newcomers).
        busy_after: seconds a request waits for ``payload_budget`` before it is answered
            BUSY (also at once when a whole budget's worth of requests is already queued).
        max_client_connections: open connections per client id; the handshake of one
            more is refused with BUSY (:class:`ClientSlots`).

    Raises:
        ValueError: a budget or cap that is not positive, a negative ``busy_after``.

    Caveats:
        Running out of file descriptors (EMFILE/ENFILE) or kernel memory on accept
        pauses accepting for ``ACCEPT_RETRY`` seconds; it never stops the server.
    """
    if not busy_after >= 0:
        raise ValueError(f"busy_after must be >= 0 seconds, got {busy_after!r}")
    budget = ByteBudget(payload_budget)
    _metrics.watch_budget(service.role, budget)
    clients = ClientSlots(max_client_connections)
    listener = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    await listener.bind((host, port))
    listener.listen(512)
    address = listener.getsockname()[:2]
    slots = trio.Semaphore(max_connections)
    warned = 0.0

    async def serve_one(sock: trio.socket.SocketType, peer: Any) -> None:
        try:
            await _serve_conn(sock, peer, service, secret, cluster_id, budget, busy_after, clients)
        finally:
            slots.release()

    async with trio.open_nursery() as nursery:
        task_status.started(address)
        try:
            while True:
                await slots.acquire()
                try:
                    sock, peer = await listener.accept()
                except OSError as exc:
                    slots.release()
                    if exc.errno in _ACCEPT_PEER:
                        continue
                    if exc.errno not in _ACCEPT_TRANSIENT:
                        raise
                    if trio.current_time() - warned > 10:  # one line per 10 s, not one per retry
                        warned = trio.current_time()
                        log.warning("accept on %s:%d failed (%s); retrying", *address, exc.strerror)
                    await trio.sleep(ACCEPT_RETRY)
                    continue
                try:
                    tune_socket(sock)
                except OSError:  # the peer is already gone
                    sock.close()
                    slots.release()
                    continue
                nursery.start_soon(serve_one, sock, peer)
        finally:
            listener.close()
