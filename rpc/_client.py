"""Blocking client connections: many requests in flight, payloads received in place.

The bulk data path runs on threads with blocking sockets: the kernel copy in
``recv_into``/``sendall`` releases the GIL, so several connections use both
cores (measured on 2-core VMs: ~30% above any single event loop; docs/architecture.md).

A :class:`Connection` receives in one thread at a time (the *receive role*): a
blocking :meth:`Connection.call` that finds nobody receiving receives its own
reply on the calling thread -- no hand-off to another thread and back, two
context switches less per request -- and completes any other request whose
reply comes first. Otherwise (futures from :meth:`Connection.submit`, callers
that overlap) the connection's reader thread holds the role and demultiplexes
responses by request id; it parks, out of the socket, once nothing is in flight
(after a while without a byte when the last request was a future, so that
futures-only users such as trio code pay no wake-up of it per request).

A caller may hand a destination ``memoryview`` with the request; the response
payload is then received with ``recv_into`` straight into it -- no intermediate
``bytes``. A frame head is read with one read of at least ``MIN_READ`` bytes (a
small answer whole); the few payload bytes that come with it are copied once,
the rest goes straight to its buffer.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import socket
import struct
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from stripefs import wire
from stripefs.wire import (
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

from ._pid import my_pid
from ._server import MIN_READ, SOCK_BUF

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 10.0
# A receive waits at most this long (SO_RCVTIMEO) before the receiver looks at its
# deadline and at what is still in flight; shorter deadlines shorten it.
RECV_SLICE = 1.0
# Who holds the receive role (only that thread reads the socket).
_RX_NONE, _RX_READER, _RX_CALLER = 0, 1, 2


@dataclass(slots=True)
class Reply:
    header: dict[str, Any]
    nbytes: int = 0  # payload bytes received into the caller's buffer
    payload: bytes | None = None  # when no destination buffer was given


class _Waiter:
    """The outcome of one blocking :meth:`Connection.call`: a lock, held from the start,
    released once when the answer (or error) is in -- lighter than a ``Future`` and
    its condition variable. Only the one thread that pops the request from the table
    of requests in flight resolves it."""

    __slots__ = ("_lock", "_done", "_value", "_error")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._done = False
        self._value: Reply | None = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._done

    def set_result(self, value: Reply) -> None:
        self._value, self._done = value, True
        self._lock.release()

    def set_exception(self, exc: BaseException) -> None:
        self._error, self._done = exc, True
        self._lock.release()

    def wait(self, timeout: float | None) -> bool:
        """True once resolved; False after ``timeout`` seconds (None: no limit)."""
        return self._done or self._lock.acquire(timeout=-1 if timeout is None else max(timeout, 0.0))

    def result(self) -> Reply:
        if self._error is not None:
            raise self._error
        assert self._value is not None
        return self._value


@dataclass(slots=True)
class _Pending:
    future: Future | _Waiter
    dest: memoryview | None
    req_id: int = 0
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


def _set_rcvtimeo(sock: socket.socket, seconds: float) -> None:
    whole = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", whole, int((seconds - whole) * 1e6)))


def abandon(fut: Future) -> None:
    """Give up on a request that timed out, safely for its destination buffer.

    The connection is closed (a late answer must never land in a buffer the
    caller has reused or freed; a server that hangs is left behind with it) and we
    wait until the receiving thread is no longer copying into that buffer. A
    :meth:`Connection.call` that times out cancels its request instead and keeps
    the connection.
    """
    pending, conn = getattr(fut, "pending", None), getattr(fut, "conn", None)
    if conn is not None:
        conn.close()
    if pending is not None:
        with pending.lock:
            pending.dest = None


class Connection:
    """One authenticated connection to a stripefs server.

    Thread-safe: any thread may :meth:`submit` or :meth:`call`. One thread at a time
    receives (see the module docstring): a lone :meth:`call` on its own thread, else
    the reader thread. When the peer goes away every pending request fails with
    ``UNAVAILABLE`` and :attr:`broken` becomes true; callers open a new one.

    The protocol (handshake, request ids, response matching) is the sans-IO
    :class:`wire.ClientConnection`; this class moves bytes. ``_plock`` serialises
    the calls into the machine that touch its table of requests in flight, and the
    hand-over of the receive role (``_rx``); the reader thread parks on ``_wake``
    (a lock released once per hand-over to it).
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
        self.pid = my_pid()
        self._machine = ClientConnection(secret, client_id, expect_role, role=role, ids=ids)
        self._pending: dict[int, _Pending] = {}
        self._plock = threading.Lock()
        self._send_lock = threading.Lock()
        self._rx = _RX_READER  # the reader thread starts with the role and parks (nothing in flight)
        self._wake = threading.Lock()
        self._wake.acquire()
        self._rcvtimeo = RECV_SLICE
        # The last request came from submit(): the reader thread stays in the socket (up
        # to RECV_SLICE idle) instead of parking, so futures-only users (trio code) pay no
        # wake-up of the reader per request.
        self._linger = False
        self._cancelled: set[int] = set()  # ids cancelled after a timeout whose answers are still due
        self.broken = False
        try:
            self.sock = socket.create_connection(address, timeout=CONNECT_TIMEOUT)
        except OSError as exc:
            raise unavailable(address, exc) from exc
        try:
            _tune(self.sock)
            self.role = self._handshake()
            self.sock.settimeout(None)
            _set_rcvtimeo(self.sock, RECV_SLICE)
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
                data = self.sock.recv(max(self._machine.next_read_size(), 1))
                if not data:
                    raise EOFError("connection closed by peer")
                self._machine.receive_data(data)
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
        ``check(header, received)``: runs on the receiving thread once the payload is in
        ``dest`` (e.g. its checksums); a ``StripefsError`` it raises fails the future.
        Checks of different connections run in parallel (CRC32C releases the GIL).
        """
        fut: Future = Future()
        if self.broken:
            fut.set_exception(unavailable(self.address, "connection is broken"))
            return fut
        pending = _Pending(fut, dest, check=check)
        # abandon() needs the pending record after a timeout; drop the link once the
        # future resolves so future <-> pending is not a reference cycle.
        fut.pending = pending  # type: ignore[attr-defined]
        fut.conn = self  # type: ignore[attr-defined]
        fut.add_done_callback(_unlink_pending)
        self._send(pending, msg, payload, req_id, True)
        return fut

    def _send(self, pending: _Pending, msg: wire.Message, payload: memoryview | bytes | None,
              req_id: int | None, reader: bool) -> None:
        """Register ``pending`` and send its request (a failure resolves it). ``reader``: wake
        the reader thread when nobody receives (else the caller receives its answer itself)."""
        fut = pending.future
        plen = len(payload) if payload is not None else 0
        wake = retry_too_soon = False
        try:
            with self._plock:
                if self.broken:  # checked under the lock: _fail_all may have just emptied the table
                    raise unavailable(self.address, "connection is broken")
                if self.pid != my_pid():  # a forked child must not touch its parent's stream
                    raise unavailable(self.address, "the connection belongs to the parent process")
                if req_id is not None and req_id in self._cancelled:
                    retry_too_soon = True
                    raise unavailable(self.address, f"request {req_id} timed out here and its answer is still due")
                req_id, prefix = self._machine.send_request(msg, plen, req_id)
                pending.req_id = req_id
                self._pending[req_id] = pending
                self._linger = reader
                if reader and self._rx == _RX_NONE:
                    self._rx, wake = _RX_READER, True
        except StripefsError as exc:
            if retry_too_soon:  # a retry (same id) of a call that timed out: it goes elsewhere,
                self.close()   # as it did when a timeout closed the connection
            # A machine that failed under the receiver means a dead connection, not a bad request.
            fut.set_exception(unavailable(self.address, exc) if self._machine.state is ConnState.ERROR else exc)
            return
        if wake:
            self._wake.release()
        try:
            if self._sendq is not None and plen > 65536:
                # Big payloads go through the send thread so a caller can fan out to many
                # servers at once; small frames are sent right here (one thread hop less).
                self._sendq.put((prefix, payload, req_id))
                return
            with self._send_lock:
                if plen and plen <= 65536:
                    self.sock.sendall(prefix + bytes(payload))  # type: ignore[arg-type]
                else:
                    self.sock.sendall(prefix)
                    if plen:
                        self.sock.sendall(payload)  # type: ignore[arg-type]
        except OSError as exc:
            self._fail_all(unavailable(self.address, exc))

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
        check: Callable[[dict[str, Any], memoryview], None] | None = None,
    ) -> Reply:
        """Send ``msg`` and wait for its :class:`Reply`.

        ``dest`` and ``check`` are as for :meth:`submit`.

        When nobody else is receiving on this connection, the calling thread receives the
        answer itself (and any other answer that comes first); otherwise it waits for the
        thread that is. The request is sent before the caller takes the receive role, so
        a big payload never holds back the answers of others.

        Raises:
            StripefsError: the server's error; TIMEOUT after ``timeout`` seconds (the request
            is cancelled: its late answer is dropped and the connection stays open, unless
            the answer was arriving at that very moment); UNAVAILABLE when the connection is lost.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.broken:
            raise unavailable(self.address, "connection is broken")
        waiter = _Waiter()
        pending = _Pending(waiter, dest, check=check)
        self._send(pending, msg, payload, req_id, False)
        with self._plock:
            mine = self._rx == _RX_NONE and self._pending.get(pending.req_id) is pending
            if mine:
                self._rx = _RX_CALLER
        if mine:
            try:
                self._receive_until(waiter, deadline)
            except TimeoutError:
                if self._cancel(pending):
                    raise self._timed_out(msg) from None
            finally:
                self._leave()
            return waiter.result()
        if not waiter.wait(None if deadline is None else deadline - time.monotonic()):
            self._give_up(pending)
            if not waiter.done():
                raise self._timed_out(msg)
        return waiter.result()

    def _timed_out(self, msg: wire.Message) -> StripefsError:
        return StripefsError(ErrorCode.TIMEOUT, f"{type(msg).__name__} to {self.address[0]}:{self.address[1]} timed out")

    def _cancel(self, pending: _Pending) -> bool:
        """Cancel a request whose answer has not begun to arrive (its late answer is then
        read and dropped); False when it has (or it is over)."""
        with self._plock:
            if self._pending.get(pending.req_id) is not pending:
                return False
            del self._pending[pending.req_id]
            self._machine.cancel(pending.req_id)
            self._cancelled.add(pending.req_id)
        if not pending.future.done():
            pending.future.set_exception(StripefsError(ErrorCode.TIMEOUT, "request cancelled after a timeout"))
        return True

    def _give_up(self, pending: _Pending) -> None:
        """After a timeout: cancel the request, or, when its answer is arriving right now,
        close the connection and wait until nothing is copied into its buffer any more."""
        if self._cancel(pending):
            return
        self.close()
        with pending.lock:
            pending.dest = None

    def _leave(self) -> None:
        """A caller gives up the receive role: to the reader thread when others are in
        flight (or the connection broke: the reader closes the socket), else to nobody."""
        if self._rcvtimeo != RECV_SLICE:  # a short deadline shortened it: the reader waits long
            self._rcvtimeo = RECV_SLICE
            try:
                _set_rcvtimeo(self.sock, RECV_SLICE)
            except OSError:
                pass
        with self._plock:
            if self._pending or self.broken:
                self._rx = _RX_READER
                self._wake.release()
            else:
                self._rx = _RX_NONE

    def _fail_all(self, exc: StripefsError) -> None:
        with self._plock:
            self.broken = True
            pending, self._pending = self._pending, {}
            wake = self._rx == _RX_NONE  # the reader is parked: wake it to close the socket
            if wake:
                self._rx = _RX_READER
        if wake:
            self._wake.release()
        for p in pending.values():
            if not p.future.done():
                p.future.set_exception(exc)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    # -- receiving (whoever holds the receive role) -------------------------------------
    def _feed(self, n: int, deadline: float | None = None) -> bool:
        """Read what the machine asked for (``n`` bytes), or up to ``MIN_READ``: a small
        answer's prefix and header in one read. The few payload bytes that come with
        them are copied once (``take_payload``); the rest of a payload goes straight to
        its buffer.

        Raises:
            TimeoutError: nothing came by ``deadline`` (nothing was read).
        """
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            if left < self._rcvtimeo or (self._rcvtimeo < RECV_SLICE and left > self._rcvtimeo * 2):
                self._rcvtimeo = min(max(left, 0.001), RECV_SLICE)
                _set_rcvtimeo(self.sock, self._rcvtimeo)
        try:
            data = self.sock.recv(max(n, MIN_READ))
        except BlockingIOError:  # SO_RCVTIMEO: nothing for a while
            return False
        if not data:
            raise EOFError("connection closed by peer")
        self._machine.receive_data(data)
        return True

    def _recv_into(self, view: memoryview) -> None:
        while view:
            try:
                k = self.sock.recv_into(view)
            except BlockingIOError:  # a payload must be received whole, however slowly
                continue
            if k == 0:
                raise EOFError("connection closed by peer")
            view = view[k:]

    def _step(self, deadline: float | None = None) -> bool:
        """Read what the machine asks for, or handle one event (an answer's payload is moved
        and its future resolved here). False when a read waited ``RECV_SLICE`` for nothing."""
        machine = self._machine
        n = machine.next_read_size()
        if n:
            return self._feed(n, deadline)  # also where discarded payloads (cancelled, errors) are dropped
        with self._plock:
            event = machine.next_event()
            if event is wire.NEED_DATA:
                return True
            if isinstance(event, ResponseCancelled):
                self._cancelled.discard(event.req_id)
                return True
            answer = isinstance(event, (ResponseReceived, ErrorReceived))
            pending = self._pending.pop(event.req_id, None) if answer else None  # type: ignore[union-attr]
        if isinstance(event, ResponseReceived):
            assert pending is not None  # the machine matched the id
            try:
                self._complete(pending, event)
            except BaseException as exc:
                # The answer stopped short (the server died while sending it): this request
                # is out of the table already, so it fails here, as _fail_all fails the rest.
                if not pending.future.done():
                    pending.future.set_exception(self._lost(exc))
                raise
        elif isinstance(event, ErrorReceived):
            assert pending is not None
            pending.future.set_exception(event.error)
        elif isinstance(event, ConnectionClosed):
            raise EOFError("connection closed by peer")
        return True

    def _lost(self, exc: BaseException) -> StripefsError:
        """What a request lost with the connection fails with: a protocol error as it is,
        anything else (end of stream, a socket error) as UNAVAILABLE."""
        return exc if isinstance(exc, StripefsError) and exc.code == ErrorCode.PROTOCOL else unavailable(self.address, exc)

    def _broke(self, exc: BaseException) -> None:
        self._fail_all(self._lost(exc))

    def _receive_until(self, fut: _Waiter, deadline: float | None) -> None:
        """Receive (holding the role) until ``fut`` resolves.

        Raises:
            TimeoutError: ``deadline`` passed first (between frames: the stream is intact).
        """
        try:
            while not fut.done():
                self._step(deadline)
        except (OSError, EOFError, StripefsError) as exc:
            if isinstance(exc, TimeoutError):
                raise
            self._broke(exc)
        except BaseException as exc:  # e.g. KeyboardInterrupt: maybe in the middle of a payload
            self._broke(exc)
            raise

    def _read_loop(self) -> None:
        try:
            while True:
                with self._plock:
                    if self.broken:
                        return
                    park = not self._pending and not self._linger
                    if park:
                        self._rx = _RX_NONE
                if park:
                    self._wake.acquire()  # until the receive role is handed back to this thread
                    continue
                if not self._step():  # RECV_SLICE without a byte
                    with self._plock:
                        if not self._pending:
                            self._linger = False
        except (OSError, EOFError, StripefsError) as exc:
            self._broke(exc)
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
