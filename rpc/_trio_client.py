"""A small trio client for control calls between servers (registration, heartbeats, GC).

One request at a time per connection; reconnects lazily after a failure.
"""

from __future__ import annotations

import itertools
import os
import socket
from typing import Any

import trio

import wire
from wire import ErrorCode, FrameDecoder, StripefsError, messages

from ._client import unavailable

CALL_TIMEOUT = 30.0


class TrioConnection:
    def __init__(self, address: tuple[str, int], secret: str, *, client_id: bytes | None = None):
        self.address = address
        self.secret = secret
        self.client_id = client_id or os.urandom(16)
        self._sock: trio.socket.SocketType | None = None
        self._dec = FrameDecoder()
        self._lock = trio.Lock()
        self._ids = itertools.count(1)

    async def _recv_frame(self) -> wire.Frame:
        assert self._sock is not None
        while True:
            ev = self._dec.next_event()
            if ev is not wire.NEED_DATA:
                return ev  # type: ignore[return-value]
            data = await self._sock.recv(1 << 20)
            if not data:
                raise EOFError("connection closed by peer")
            self._dec.feed(data)

    async def _connect(self) -> None:
        sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            with trio.fail_after(10):
                await sock.connect(self.address)
            self._sock, self._dec = sock, FrameDecoder()
            frame = await self._recv_frame()
            challenge = wire.decode_message(frame.head.msg_type, frame.head.header)
            if not isinstance(challenge, messages.Challenge):
                raise StripefsError(ErrorCode.PROTOCOL, "server did not send a challenge")
            nonce = wire.new_nonce()
            auth = messages.Authenticate(self.client_id, nonce, wire.client_proof(self.secret, challenge.nonce, nonce))
            await sock.send(wire.encode_frame(auth.MSG_ID, 0, auth.to_header()))
            frame = await self._recv_frame()
            if frame.head.is_error:
                raise StripefsError.from_wire(frame.head.header)
            if not wire.check_proof(wire.server_proof(self.secret, challenge.nonce, nonce), frame.head.header.get("proof")):
                raise StripefsError(ErrorCode.AUTH, "server failed to prove it knows the cluster secret")
        except BaseException:
            sock.close()
            self._sock = None
            raise

    async def call(self, msg: wire.Message, payload: bytes = b"", timeout: float = CALL_TIMEOUT) -> tuple[dict[str, Any], bytes]:
        """Send one request and wait for its response: ``(header, payload)``."""
        async with self._lock:
            try:
                with trio.fail_after(timeout):
                    if self._sock is None:
                        await self._connect()
                    assert self._sock is not None
                    req_id = next(self._ids)
                    data = memoryview(wire.encode_frame(msg.MSG_ID, req_id, msg.to_header(), payload))
                    while data:
                        data = data[await self._sock.send(data):]
                    frame = await self._recv_frame()
            except trio.TooSlowError as exc:
                self.close()
                raise StripefsError(ErrorCode.TIMEOUT, f"{type(msg).__name__} to {self.address} timed out") from exc
            except (OSError, EOFError) as exc:
                self.close()
                if isinstance(exc, StripefsError):
                    raise
                raise unavailable(self.address, exc) from exc
            if frame.head.req_id != req_id:
                self.close()
                raise StripefsError(ErrorCode.PROTOCOL, "response to a different request")
            if frame.head.is_error:
                raise StripefsError.from_wire(frame.head.header)
            return frame.head.header, frame.payload

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
