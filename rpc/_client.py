"""Blocking client connections: many requests in flight, payloads received in place.

The bulk data path runs on threads with blocking sockets: the kernel copy in
``recv_into``/``sendall`` releases the GIL, so several connections use both
cores (measured on 2-core VMs: ~30% above any single event loop; docs/architecture.md).

A :class:`Connection` has one reader thread that demultiplexes responses by
request id. A caller may hand a destination ``memoryview`` with the request;
the response payload is then received with ``recv_into`` straight into it --
no intermediate ``bytes``. Frames are read with exact-length reads (the state
machine says how many bytes) so payload bytes never pass through a staging buffer.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import socket
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import wire
from wire import (
    ClientConnection,
    ConnectionClosed,
    ConnState,
    ErrorCode,
    ErrorReceived,
    HandshakeComplete,
    ResponseCancelled,
    ResponseReceived,
    StripefsError,
)

from ._server import SOCK_BUF

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 10.0


@dataclass(slots=True)
class Reply:
    header: dict[str, Any]
    nbytes: int = 0  # payload bytes received into the caller's buffer
    payload: bytes | None = None  # when no destination buffer was given


@dataclass(slots=True)
class _Pending:
    future: Future
    dest: memoryview | None
    lock: threading.Lock = field(default_factory=threading.Lock)
    cancelled: bool = False
    check: Callable[[dict[str, Any], memoryview], None] | None = None


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)
        except OSError:
            pass


def unavailable(address: tuple[str, int], exc: BaseException | str) -> StripefsError:
    return StripefsError(ErrorCode.UNAVAILABLE, f"{address[0]}:{address[1]} unavailable: {exc}")


def _unlink_pending(fut: Future) -> None:
    fut.pending = None  # type: ignore[attr-defined]
    fut.conn = None  # type: ignore[attr-defined]


def abandon(fut: Future) -> None:
    """Give up on a request that timed out, safely for its destination buffer.

    The connection is closed (a late answer must never land in a buffer the
    caller has reused or freed) and we wait until the reader thread is no
    longer copying into that buffer.
    """
    pending, conn = getattr(fut, "pending", None), getattr(fut, "conn", None)
    if conn is not None:
        conn.close()
    if pending is not None:
        with pending.lock:
            pending.dest = None


class Connection:
    """One authenticated connection to a stripefs server.

    Thread-safe: any thread may :meth:`submit`; one reader thread completes the
    futures. When the peer goes away every pending request fails with
    ``UNAVAILABLE`` and :attr:`broken` becomes true; callers open a new one.

    The protocol (handshake, request ids, response matching) is the sans-IO
    :class:`wire.ClientConnection`; this class moves bytes. ``_plock`` serialises
    the calls into the machine that touch its table of requests in flight.
    """

    def __init__(
        self,
        address: tuple[str, int],
        secret: str,
        client_id: bytes,
        *,
        expect_role: str | None = None,
        ids: "itertools.count[int] | None" = None,
        send_thread: bool = False,
        role: str = "client",
    ):
        self.address = address
        self.pid = os.getpid()
        self._machine = ClientConnection(secret, client_id, expect_role, role=role, ids=ids)
        self._pending: dict[int, _Pending] = {}
        self._plock = threading.Lock()
        self._send_lock = threading.Lock()
        self.broken = False
        try:
            self.sock = socket.create_connection(address, timeout=CONNECT_TIMEOUT)
        except OSError as exc:
            raise unavailable(address, exc) from exc
        try:
            _tune(self.sock)
            self.role = self._handshake()
            self.sock.settimeout(None)
        except BaseException:
            self.sock.close()
            raise
        self._reader = threading.Thread(target=self._read_loop, name=f"stripefs-rx-{address[1]}", daemon=True)
        self._reader.start()
        # With a send thread, submit() only queues: a caller fans requests out to many
        # servers without waiting for any one socket to drain.
        self._sendq: queue.SimpleQueue | None = None
        if send_thread:
            self._sendq = queue.SimpleQueue()
            threading.Thread(target=self._send_loop, name=f"stripefs-tx-{address[1]}", daemon=True).start()

    # -- handshake --------------------------------------------------------------------
    def _feed(self, n: int) -> None:
        """Read up to ``n`` bytes, what the machine asked for (never payload bytes: those go
        to their buffer)."""
        data = self.sock.recv(n)
        if not data:
            raise EOFError("connection closed by peer")
        self._machine.receive_data(data)

    def _handshake(self) -> str:
        try:
            while True:
                event = self._machine.next_event()
                out = self._machine.data_to_send()
                if out:
                    self.sock.sendall(out)
                if isinstance(event, HandshakeComplete):
                    return self._machine.role
                if event is not wire.NEED_DATA:
                    raise EOFError("connection closed during the handshake")
                self._feed(max(self._machine.next_read_size(), 1))
        except (OSError, EOFError) as exc:
            if isinstance(exc, StripefsError):
                raise
            raise unavailable(self.address, exc) from exc

    # -- requests ---------------------------------------------------------------------
    def submit(
        self,
        msg: wire.Message,
        payload: memoryview | bytes | None = None,
        dest: memoryview | None = None,
        req_id: int | None = None,
        check: Callable[[dict[str, Any], memoryview], None] | None = None,
    ) -> Future:
        """Send ``msg`` (with an optional payload); the future resolves to a :class:`Reply`.

        ``dest``: where the response payload goes (``recv_into``, no copy).
        ``check(header, received)``: runs on the reader thread once the payload is in
        ``dest`` (e.g. its checksums); a ``StripefsError`` it raises fails the future.
        Checks of different connections run in parallel (CRC32C releases the GIL).
        """
        fut: Future = Future()
        if self.broken:
            fut.set_exception(unavailable(self.address, "connection is broken"))
            return fut
        pending = _Pending(fut, dest, check=check)
        # call()/abandon() need the pending record after a timeout; drop the link once
        # the future resolves so future <-> pending is not a reference cycle.
        fut.pending = pending  # type: ignore[attr-defined]
        fut.conn = self  # type: ignore[attr-defined]
        fut.add_done_callback(_unlink_pending)
        plen = len(payload) if payload is not None else 0
        try:
            with self._plock:
                if self.broken:  # checked under the lock: _fail_all may have just emptied the table
                    raise unavailable(self.address, "connection is broken")
                req_id, prefix = self._machine.send_request(msg, plen, req_id)
                self._pending[req_id] = pending
        except StripefsError as exc:
            # A machine that failed under the reader means a dead connection, not a bad request.
            fut.set_exception(unavailable(self.address, exc) if self._machine.state is ConnState.ERROR else exc)
            return fut
        try:
            if self._sendq is not None and plen > 65536:
                # Big payloads go through the send thread so a caller can fan out to many
                # servers at once; small frames are sent right here (one thread hop less).
                self._sendq.put((prefix, payload, req_id))
                return fut
            with self._send_lock:
                if plen and plen <= 65536:
                    self.sock.sendall(prefix + bytes(payload))  # type: ignore[arg-type]
                else:
                    self.sock.sendall(prefix)
                    if plen:
                        self.sock.sendall(payload)  # type: ignore[arg-type]
        except OSError as exc:
            self._fail_all(unavailable(self.address, exc))
        return fut

    def _send_loop(self) -> None:
        assert self._sendq is not None
        while True:
            item = self._sendq.get()
            if item is None or self.broken:
                if item is None:
                    return
                continue
            prefix, payload, req_id = item
            try:
                with self._send_lock:
                    self.sock.sendall(prefix)
                    if payload is not None and len(payload):
                        self.sock.sendall(payload)
            except OSError as exc:
                self._fail_all(unavailable(self.address, exc))

    def call(
        self,
        msg: wire.Message,
        payload: memoryview | bytes | None = None,
        dest: memoryview | None = None,
        timeout: float | None = 120.0,
        req_id: int | None = None,
    ) -> Reply:
        fut = self.submit(msg, payload, dest, req_id)
        try:
            return fut.result(timeout)
        except TimeoutError as exc:
            abandon(fut)
            raise StripefsError(ErrorCode.TIMEOUT, f"{type(msg).__name__} to {self.address[0]}:{self.address[1]} timed out") from exc

    def _fail_all(self, exc: StripefsError) -> None:
        with self._plock:
            self.broken = True
            pending, self._pending = self._pending, {}
        for p in pending.values():
            if not p.future.done():
                p.future.set_exception(exc)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    # -- reader thread ----------------------------------------------------------------
    def _recv_into(self, view: memoryview) -> None:
        while view:
            k = self.sock.recv_into(view)
            if k == 0:
                raise EOFError("connection closed by peer")
            view = view[k:]

    def _read_loop(self) -> None:
        machine = self._machine
        try:
            while True:
                n = machine.next_read_size()
                if n:
                    self._feed(n)  # also where discarded payloads (cancelled, errors) are dropped
                    continue
                with self._plock:
                    event = machine.next_event()
                    if event is wire.NEED_DATA:
                        continue
                    answer = isinstance(event, (ResponseReceived, ErrorReceived, ResponseCancelled))
                    pending = self._pending.pop(event.req_id, None) if answer else None  # type: ignore[union-attr]
                if isinstance(event, ResponseReceived):
                    assert pending is not None  # the machine matched the id
                    self._complete(pending, event)
                elif isinstance(event, ErrorReceived):
                    assert pending is not None
                    pending.future.set_exception(event.error)
                elif isinstance(event, ConnectionClosed):
                    raise EOFError("connection closed by peer")
                pending = None  # do not pin the last request's buffer while waiting
        except (OSError, EOFError, StripefsError) as exc:
            err = exc if isinstance(exc, StripefsError) and exc.code == ErrorCode.PROTOCOL else unavailable(self.address, exc)
            self._fail_all(err)
        finally:
            try:
                self.sock.close()
            except OSError:
                pass

    def _complete(self, pending: _Pending, event: ResponseReceived) -> None:
        """Move a response's payload (``recv_into`` the caller's buffer when it gave one)."""
        n = event.payload_len
        if n and pending.dest is not None:
            with pending.lock:
                dest = pending.dest
                if dest is None:  # abandoned after a timeout: the connection is closing
                    raise EOFError("request abandoned")
                if n > len(dest):
                    raise StripefsError(ErrorCode.PROTOCOL, "response payload larger than the request allows")
                got = self._machine.take_payload(dest[:n])
                self._recv_into(dest[got:n])
                if pending.check is not None:
                    try:
                        pending.check(event.header, dest[:n])
                    except StripefsError as exc:  # the stream is intact: only this answer is bad
                        pending.dest = dest = None
                        self._machine.payload_received(n - got)
                        pending.future.set_exception(exc)
                        return
                pending.dest = dest = None  # no reference to the caller's buffer survives
            self._machine.payload_received(n - got)
            pending.future.set_result(Reply(event.header, n))
        elif n:
            data = bytearray(n)
            got = self._machine.take_payload(data)
            self._recv_into(memoryview(data)[got:])
            self._machine.payload_received(n - got)
            pending.future.set_result(Reply(event.header, 0, bytes(data)))
        else:
            pending.future.set_result(Reply(event.header))

    def close(self) -> None:
        self._fail_all(StripefsError(ErrorCode.UNAVAILABLE, "connection closed"))
        if self._sendq is not None:
            self._sendq.put(None)
