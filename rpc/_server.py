"""The trio server loop shared by the metadata service and the storage servers.

One task per connection reads frames; each request is handled in its own task
(many in flight per connection, answered in any order, matched by request id).
A request's payload is read by its handler *before* the next frame is parsed,
because the stream is ordered; handlers that do not want the payload get it
discarded. Responses share one send lock per connection.

Bulk sends go through worker threads (``sendfile`` of a chunk file, or a
buffer), so no blocking call runs on the trio loop.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
from collections import OrderedDict
from typing import Any

import trio

import wire
from wire import ErrorCode, FrameDecoder, FrameHead, StripefsError, messages

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 10.0
MAX_IN_FLIGHT = 64  # per connection; back-pressure beyond that
RECV_SIZE = 256 * 1024
SOCK_BUF = 4 << 20


def tune_socket(sock: Any) -> None:
    """Big buffers and no Nagle: frames are small headers followed by big payloads."""
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)
        except OSError:
            pass
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _wait_fd(fd: int, events: int) -> None:
    p = select.poll()
    p.register(fd, events)
    if not p.poll(60_000):
        raise StripefsError(ErrorCode.TIMEOUT, "peer stopped reading")


def sendfile_all(sock_fd: int, file_fd: int, offset: int, count: int) -> None:
    """Send ``count`` bytes of a file with ``sendfile`` on a non-blocking socket (thread)."""
    while count > 0:
        try:
            n = os.sendfile(sock_fd, file_fd, offset, count)
        except BlockingIOError:
            _wait_fd(sock_fd, select.POLLOUT)
            continue
        if n == 0:
            raise StripefsError(ErrorCode.IO, "file shorter than announced payload")
        offset += n
        count -= n


def send_all(sock_fd: int, data: memoryview) -> None:
    """``send`` a buffer on a non-blocking socket from a worker thread."""
    view = memoryview(data).cast("B")
    while view:
        try:
            n = os.write(sock_fd, view)
        except BlockingIOError:
            _wait_fd(sock_fd, select.POLLOUT)
            continue
        view = view[n:]


class ServerConn:
    """One accepted, authenticated connection, as a handler sees it."""

    def __init__(self, sock: trio.socket.SocketType, peer: Any):
        self.sock = sock
        self.peer = peer
        self.decoder = FrameDecoder()
        self.send_lock = trio.Lock()
        self.client_id = b""

    async def _fill(self) -> None:
        # Read only up to the end of the next header when a payload may follow, so the
        # payload goes straight from the socket into its destination buffer.
        want = self.decoder.head_bytes_needed()
        data = await self.sock.recv(max(want, 64) if want else RECV_SIZE)
        if not data:
            raise EOFError
        self.decoder.feed(data)

    async def next_head(self) -> FrameHead:
        while True:
            head = self.decoder.next_head()
            if head is not wire.NEED_DATA:
                return head  # type: ignore[return-value]
            await self._fill()

    async def recv_payload_into(self, dest: memoryview) -> None:
        """Receive the current frame's payload straight into ``dest`` (exact length)."""
        got = self.decoder.take_payload(dest)
        view = memoryview(dest)[got:]
        while view:
            n = await self.sock.recv_into(view)
            if n == 0:
                raise EOFError
            self.decoder.payload_received(n)
            view = view[n:]

    async def discard_payload(self) -> None:
        left = self.decoder.payload_left
        if not left:
            return
        scratch = memoryview(bytearray(min(left, RECV_SIZE)))
        while self.decoder.payload_left:
            if self.decoder.take_payload(None):
                continue
            n = await self.sock.recv_into(scratch[: self.decoder.payload_left])
            if n == 0:
                raise EOFError
            self.decoder.payload_received(n)

    async def send(
        self,
        head: FrameHead,
        header: dict[str, Any],
        *,
        payload: memoryview | bytes | None = None,
        file: tuple[int, int, int] | None = None,
        flags: int = wire.FLAG_RESPONSE,
    ) -> None:
        """Send a response; the payload is a buffer or ``(fd, offset, length)`` to sendfile."""
        plen = len(payload) if payload is not None else (file[2] if file else 0)
        prefix = wire.encode_prefix(head.msg_type, head.req_id, header, plen, flags)
        async with self.send_lock:
            await _trio_sendall(self.sock, prefix)
            if plen == 0:
                return
            fd = self.sock.fileno()
            if file is not None:
                await trio.to_thread.run_sync(sendfile_all, fd, *file)
            elif plen < 256 * 1024:
                await _trio_sendall(self.sock, payload)  # type: ignore[arg-type]
            else:
                await trio.to_thread.run_sync(send_all, fd, memoryview(payload))  # type: ignore[arg-type]

    async def send_error(self, head: FrameHead, exc: StripefsError) -> None:
        await self.send(head, exc.to_wire(), flags=wire.FLAG_RESPONSE | wire.FLAG_ERROR)


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
    """

    role: str = "service"

    async def receive_payload(self, conn: "ServerConn", head: FrameHead, msg: wire.Message) -> Any:
        await conn.discard_payload()
        return None

    async def handle(self, conn: "ServerConn", head: FrameHead, msg: wire.Message, payload: Any) -> None:
        raise NotImplementedError


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


async def _authenticate(conn: ServerConn, secret: str, role: str, cluster_id: str) -> None:
    nonce = wire.new_nonce()
    challenge = messages.Challenge(nonce=nonce, role=role, cluster_id=cluster_id)
    await _trio_sendall(conn.sock, wire.encode_frame(messages.Challenge.MSG_ID, 0, challenge.to_header()))
    head = await conn.next_head()
    await conn.discard_payload()
    try:
        if head.msg_type != messages.Authenticate.MSG_ID:
            raise StripefsError(ErrorCode.AUTH, "authenticate first")
        msg = wire.decode_message(head.msg_type, head.header)
        assert isinstance(msg, messages.Authenticate)
        if not wire.check_proof(wire.client_proof(secret, nonce, msg.nonce), msg.proof):
            raise StripefsError(ErrorCode.AUTH, "authentication failed: wrong cluster secret")
    except StripefsError as exc:
        await conn.send_error(head, exc)
        raise
    conn.client_id = msg.client_id
    await conn.send(head, {"proof": wire.server_proof(secret, nonce, msg.nonce)})


_CONN_ERRORS = (EOFError, trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError, trio.TooSlowError)


async def _serve_conn(sock: trio.socket.SocketType, peer: Any, service: Service, secret: str, cluster_id: str) -> None:
    """Serve one connection. Nothing that happens here may take the server down."""
    conn = ServerConn(sock, peer)
    limit = trio.Semaphore(MAX_IN_FLIGHT)

    async def reply_error(head: FrameHead, exc: StripefsError) -> None:
        try:
            await conn.send_error(head, exc)
        except (*_CONN_ERRORS, OSError):
            pass  # the peer is gone; nobody to tell

    async def run_one(head: FrameHead, msg: wire.Message, payload: Any) -> None:
        try:
            await service.handle(conn, head, msg, payload)
        except StripefsError as exc:
            await reply_error(head, exc)
        except _CONN_ERRORS:
            pass
        except OSError as exc:
            await reply_error(head, wire.error_from_oserror(exc))
        except Exception as exc:  # a bug in a handler: answer EIO, keep serving
            log.exception("%s failed", type(msg).__name__)
            await reply_error(head, StripefsError(ErrorCode.IO, f"internal error: {type(exc).__name__}: {exc}"))
        finally:
            limit.release()

    async def read_loop(nursery: trio.Nursery) -> None:
        while True:
            head = await conn.next_head()
            try:
                msg = wire.decode_message(head.msg_type, head.header)
            except StripefsError as exc:
                await conn.discard_payload()
                await reply_error(head, exc)
                continue
            await limit.acquire()
            try:
                payload = await service.receive_payload(conn, head, msg)
            except StripefsError as exc:
                limit.release()
                await conn.discard_payload()
                await reply_error(head, exc)
                continue
            nursery.start_soon(run_one, head, msg, payload)

    try:
        with trio.fail_after(HANDSHAKE_TIMEOUT):
            await _authenticate(conn, secret, service.role, cluster_id)
        async with trio.open_nursery() as nursery:
            try:
                await read_loop(nursery)
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
        sock.close()


async def serve_rpc(
    service: Service,
    host: str,
    port: int,
    *,
    secret: str,
    cluster_id: str = "",
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Listen on ``host:port`` (0 = any free port) and serve until cancelled.

    Calls ``task_status.started((host, port))`` with the bound address.
    """
    listener = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    await listener.bind((host, port))
    listener.listen(512)
    address = listener.getsockname()[:2]
    async with trio.open_nursery() as nursery:
        task_status.started(address)
        try:
            while True:
                sock, peer = await listener.accept()
                tune_socket(sock)
                nursery.start_soon(_serve_conn, sock, peer, service, secret, cluster_id)
        finally:
            listener.close()
