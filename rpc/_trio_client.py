"""A small trio client for control calls between servers (registration, heartbeats, GC).

One request at a time per connection; reconnects lazily after a failure. The
protocol is the sans-IO :class:`wire.ClientConnection`; this class moves bytes.
Concurrent callers that need several connections to one server take them from
:class:`rpc.TrioPool`.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import trio

from stripefs import wire
from stripefs.wire import (
    ClientConnection,
    ConnectionClosed,
    ErrorCode,
    ErrorReceived,
    Event,
    HandshakeComplete,
    ResponseReceived,
    StripefsError,
)

from ._client import unavailable

CALL_TIMEOUT = 30.0
CONNECT_TIMEOUT = 10.0
RECV_SIZE = 1 << 16


class TrioConnection:
    """A lazily connected, one-call-at-a-time trio connection to one server.

    Args:
        address: ``(host, port)``.
        secret: the credential of ``role`` (``wire.role_credential``).
        client_id: the id presented to the server (random by default).
        role: what the connection authenticates as; servers of the cluster use "server".
    """

    def __init__(self, address: tuple[str, int], secret: str, *, client_id: bytes | None = None, role: str = "client"):
        self.address = address
        self.secret = secret
        self.role = role
        self.client_id = client_id or os.urandom(16)
        self._sock: trio.socket.SocketType | None = None
        self._machine: ClientConnection | None = None
        self._lock = trio.Lock()
        self.broken = False  # the last call failed on the transport; reconnects on the next one

    async def _event(self) -> Event:
        assert self._sock is not None and self._machine is not None
        while True:
            event = self._machine.next_event()
            out = self._machine.data_to_send()
            if out:
                await _sendall(self._sock, out)
            if isinstance(event, ConnectionClosed):
                raise EOFError("connection closed by peer")
            if event is not wire.NEED_DATA:
                return event  # type: ignore[return-value]
            self._machine.receive_data(await self._sock.recv(max(self._machine.next_read_size(), RECV_SIZE)))

    async def _connect(self) -> None:
        sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            with trio.fail_after(CONNECT_TIMEOUT):
                await sock.connect(self.address)
            self._sock, self._machine = sock, ClientConnection(self.secret, self.client_id, role=self.role)
            event = await self._event()
            if not isinstance(event, HandshakeComplete):  # pragma: no cover - the machine allows nothing else
                raise StripefsError(ErrorCode.PROTOCOL, f"unexpected {type(event).__name__} during the handshake")
            self.broken = False
        except BaseException:
            sock.close()
            self._sock = self._machine = None
            raise

    async def _payload(self, n: int) -> bytearray:
        """The current response's payload: what the machine buffered, then straight from the socket."""
        assert self._sock is not None and self._machine is not None
        data = bytearray(n)
        view = memoryview(data)
        got = self._machine.take_payload(view)
        while got < n:
            k = await self._sock.recv_into(view[got:])
            if k == 0:
                raise EOFError("connection closed by peer")
            self._machine.payload_received(k)
            got += k
        return data

    async def call(self, msg: wire.Message, payload: bytes | memoryview = b"",
                   timeout: float = CALL_TIMEOUT) -> tuple[dict[str, Any], bytes | bytearray]:
        """Send one request and wait for its response: ``(header, payload)``.

        Raises:
            StripefsError: the server's error; TIMEOUT; UNAVAILABLE when the server
            cannot be reached; PROTOCOL for a broken stream. Any failure other than the
            server's error closes the connection (:attr:`broken`).
        """
        async with self._lock:
            refused: StripefsError | None = None
            try:
                with trio.fail_after(timeout):
                    if self._sock is None:
                        await self._connect()
                    assert self._sock is not None and self._machine is not None
                    _, prefix = self._machine.send_request(msg, len(payload))
                    if len(payload) <= 65536:
                        await _sendall(self._sock, prefix + bytes(payload))
                    else:
                        await _sendall(self._sock, prefix)
                        await _sendall(self._sock, payload)
                    event = await self._event()
                    if isinstance(event, ErrorReceived):
                        refused = event.error  # the machine skips its payload; the connection stays good
                    else:
                        assert isinstance(event, ResponseReceived)
                        header = event.header
                        data = await self._payload(event.payload_len) if event.payload_len else b""
            except trio.TooSlowError as exc:
                self._fail()
                raise StripefsError(ErrorCode.TIMEOUT, f"{type(msg).__name__} to {self.address} timed out") from exc
            except (OSError, EOFError) as exc:
                self._fail()
                if isinstance(exc, StripefsError):
                    raise
                raise unavailable(self.address, exc) from exc
            except BaseException:
                self._fail()  # cancelled mid-call: the stream position is unknown
                raise
            if refused is not None:
                raise refused
            return header, data

    def _fail(self) -> None:
        self.close()
        self.broken = True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock = self._machine = None


async def _sendall(sock: trio.socket.SocketType, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[await sock.send(view):]
