"""Small reads answered on the daemon's event loop, over connections of its own.

A dataset sample opened read-only is asked for whole at its OPEN (``_operations._read_ahead``).
Over the client's connections (``rpc.Connection``) its answer is received by the
connection's reader thread, which must take the GIL from the loop's thread to do it and
hand it back after: two threads woken per file, and the loop's thread stalled at every
system call while the other holds the GIL. Here the loop owns one connection per storage
server: the request goes out with a non-blocking send, one task of the loop per connection
receives the answers straight into the callers' buffers and checks them (the same check as
the client's), and the READ that waits is woken by a trio event. No thread is involved.

Only these reads: any read this cannot start (no connection yet: it connects in the
background and the read goes the client's way meanwhile; a connection that failed, for a
few seconds; a read of more than one chunk) goes through the client, and so does any read
that fails here (``_take_ahead`` reads the file again with the client's retries and
replicas). A connection that fails fails every read in flight on it and is closed, so no
answer lands in a buffer after its read gave up.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from typing import Any

import trio

from stripefs.rpc import Reply
from stripefs.rpc._client import unavailable
from stripefs.wire import (
    ClientConnection,
    ConnectionClosed,
    ErrorCode,
    ErrorReceived,
    HandshakeComplete,
    ResponseCancelled,
    ResponseReceived,
    StripefsError,
    NEED_DATA,
)

from ..core._core import PlannedRead

log = logging.getLogger(__name__)

HEAD_READ = 256  # a frame's prefix and header in one read (the payload goes to its buffer)
CONNECT_TIMEOUT = 5.0
RETRY_AFTER = 5.0  # seconds a failed connection waits before it is tried again


class LoopRead:
    """One read in flight on a :class:`LoopConnection`: ``done()``, ``result()`` (the
    :class:`Reply`, or the error), ``wait(timeout)`` from the loop."""

    __slots__ = ("conn", "dest", "check", "reply", "error", "_event")

    def __init__(self, conn: LoopConnection, dest: memoryview, check: Any):
        self.conn, self.dest, self.check = conn, dest, check
        self.reply: Reply | None = None
        self.error: BaseException | None = None
        self._event: trio.Event | None = None

    def done(self) -> bool:
        return self.reply is not None or self.error is not None

    def exception(self) -> BaseException | None:
        return self.error

    def result(self) -> Reply:
        if self.error is not None:
            raise self.error
        assert self.reply is not None
        return self.reply

    def _settle(self, reply: Reply | None, error: BaseException | None) -> None:
        self.reply, self.error, self.dest = reply, error, None  # type: ignore[assignment]
        if self._event is not None:
            self._event.set()

    async def wait(self, timeout: float) -> None:
        """Until the answer is in; past ``timeout`` the connection is given up (so nothing
        lands later) and the read fails with TIMEOUT."""
        if self.done():
            return
        self._event = trio.Event()
        with trio.move_on_after(timeout):
            await self._event.wait()
        if not self.done():
            self.conn.fail(StripefsError(ErrorCode.TIMEOUT, f"read from {self.conn.address} timed out"))


class LoopConnection:
    """One storage server's connection, owned by the loop: reads in flight at once, their
    answers received by :meth:`run`."""

    def __init__(self, address: tuple[str, int], secret: str, client_id: bytes, role: str):
        self.address = address
        self.machine = ClientConnection(secret, client_id, expect_role="storage", role=role)
        self.sock: socket.socket | None = None
        self.ready = False
        self.failed_at: float | None = None  # trio.current_time() of the failure
        self.pending: dict[int, LoopRead] = {}

    def submit(self, plan: PlannedRead) -> LoopRead | None:
        """Send ``plan``'s request now, or None when this connection cannot (not ready, its
        socket buffer full: the read goes the client's way)."""
        if not self.ready:
            return None
        assert self.sock is not None
        req_id, frame = self.machine.send_request(plan.msg)
        try:
            sent = self.sock.send(frame)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            self.fail(unavailable(self.address, exc))
            return None
        if sent != len(frame):  # a frame cut short cannot be finished later by anyone else
            self.fail(unavailable(self.address, "send buffer full"))
            return None
        read = self.pending[req_id] = LoopRead(self, plan.dest, plan.check)
        return read

    def fail(self, exc: StripefsError) -> None:
        """Close the connection and fail every read in flight on it with ``exc``."""
        if self.failed_at is None:
            self.failed_at = trio.current_time()
        self.ready = False
        pending, self.pending = self.pending, {}
        for read in pending.values():
            read._settle(None, exc)
        if self.sock is not None:
            trio.lowlevel.notify_closing(self.sock)
            self.sock.close()
            self.sock = None

    async def run(self) -> None:
        """Connect, shake hands, then receive answers until the connection fails."""
        try:
            await self._connect()
            self.ready = True
            while True:
                await self._step()
        except trio.ClosedResourceError:
            pass  # fail() closed it
        except Exception as exc:  # whatever broke it, the daemon goes on: its reads go the client's way
            if isinstance(exc, (OSError, EOFError, StripefsError, trio.TooSlowError)):
                log.debug("loop connection to %s failed: %r", self.address, exc)
            else:
                log.exception("loop connection to %s failed", self.address)
            self.fail(exc if isinstance(exc, StripefsError) and exc.code == ErrorCode.PROTOCOL
                      else unavailable(self.address, exc))
        finally:
            if self.sock is not None:  # cancelled (the daemon stops), or failed above
                self.fail(unavailable(self.address, "connection closed"))

    async def _connect(self) -> None:
        with trio.fail_after(CONNECT_TIMEOUT):
            # A host name is resolved off the loop (trio runs getaddrinfo on a thread), and
            # each of its addresses tried in turn, as socket.create_connection does.
            infos = await trio.socket.getaddrinfo(*self.address, type=socket.SOCK_STREAM)
            for k, (family, kind, proto, _name, sockaddr) in enumerate(infos):
                sock = self.sock = socket.socket(family, kind, proto)
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                err = sock.connect_ex(sockaddr)
                if err == errno.EINPROGRESS:
                    await trio.lowlevel.wait_writable(sock)
                    err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if not err:
                    break
                sock.close()
                self.sock = None
                if k == len(infos) - 1:
                    raise OSError(err, f"connect to {self.address}: {os.strerror(err)}")
            assert self.sock is not None
            sock = self.sock
            while True:
                event = self.machine.next_event()
                out = self.machine.data_to_send()
                if out:
                    sock.sendall(out)  # one small frame into an empty buffer
                if isinstance(event, HandshakeComplete):
                    return
                if event is not NEED_DATA:
                    raise StripefsError(ErrorCode.PROTOCOL, f"unexpected {type(event).__name__} in the handshake")
                await self._feed(HEAD_READ)

    async def _feed(self, n: int) -> None:
        assert self.sock is not None
        while True:
            try:
                data = self.sock.recv(max(n, HEAD_READ))
                break
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self.sock)
        if not data:
            raise EOFError("connection closed by peer")
        self.machine.receive_data(data)

    async def _recv_into(self, view: memoryview) -> None:
        assert self.sock is not None
        while view:
            try:
                k = self.sock.recv_into(view)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self.sock)
                continue
            if k == 0:
                raise EOFError("connection closed by peer")
            view = view[k:]

    async def _step(self) -> None:
        machine = self.machine
        n = machine.next_read_size()
        if n:
            await self._feed(n)
            return
        event = machine.next_event()
        if event is NEED_DATA:
            await self._feed(HEAD_READ)
        elif isinstance(event, ResponseReceived):
            await self._answer(self.pending.pop(event.req_id), event)
        elif isinstance(event, ErrorReceived):
            self.pending.pop(event.req_id)._settle(None, event.error)
        elif isinstance(event, ConnectionClosed):
            raise EOFError("connection closed by peer")
        elif not isinstance(event, ResponseCancelled):  # pragma: no cover - nothing else follows a handshake
            raise StripefsError(ErrorCode.PROTOCOL, f"unexpected {type(event).__name__}")

    async def _answer(self, read: LoopRead, event: ResponseReceived) -> None:
        """Move an answer's payload into its read's buffer, check it, settle the read."""
        n, dest = event.payload_len, read.dest
        if n > len(dest):
            raise StripefsError(ErrorCode.PROTOCOL, "response payload larger than the request allows")
        got = self.machine.take_payload(dest[:n])
        await self._recv_into(dest[got:n])
        self.machine.payload_received(n - got)
        try:
            read.check(event.header, dest[:n])
        except StripefsError as exc:  # the stream is intact: only this answer is bad
            read._settle(None, exc)
            return
        read._settle(Reply(event.header, n), None)


class LoopReads:
    """The loop's connections, one per storage server, started on first use in ``nursery``
    (:meth:`attach`); without a nursery (operations driven without the daemon's loop)
    every read goes the client's way."""

    def __init__(self, secret: str, client_id: bytes, role: str):
        self.secret, self.client_id, self.role = secret, client_id, role
        self.nursery: trio.Nursery | None = None
        self.conns: dict[tuple[int, tuple[str, int]], LoopConnection] = {}

    def attach(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery

    def start(self, plan: PlannedRead) -> LoopRead | None:
        """Send ``plan`` on its server's loop connection, or None (see the module's docs)."""
        conn = self.connection(plan.server_id, plan.address)
        return conn.submit(plan) if conn is not None else None

    def connection(self, server_id: int, address: tuple[str, int]) -> LoopConnection | None:
        """The loop's connection to a server (maybe still connecting); None without a
        nursery. One that failed more than ``RETRY_AFTER`` seconds ago is replaced."""
        if self.nursery is None:
            return None
        key = (server_id, address)
        conn = self.conns.get(key)
        if conn is None or (conn.failed_at is not None and trio.current_time() - conn.failed_at > RETRY_AFTER):
            conn = self.conns[key] = LoopConnection(address, self.secret, self.client_id, self.role)
            self.nursery.start_soon(conn.run)
        return conn
