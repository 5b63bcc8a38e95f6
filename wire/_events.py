"""Events that the connection state machines (``wire._connection``) hand to their transport.

Each event is a small frozen value. Events that announce a frame carry its
``payload_len``: the payload stays in the stream (or the machine's buffer) until
the transport moves it, so it can land with ``recv_into`` straight in its final
buffer. Events whose payload nobody wants (errors, cancelled requests, refused
requests) are discarded by the machine itself; their ``payload_len`` is informational.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._errors import StripefsError
from ._frames import FrameHead
from ._messages import Message

__all__ = [
    "Event",
    "HandshakeComplete",
    "RequestReceived",
    "BadRequest",
    "ResponseReceived",
    "ErrorReceived",
    "ResponseCancelled",
    "ConnectionClosed",
]


class Event:
    """Base class of every event a connection state machine returns."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class HandshakeComplete(Event):
    """The challenge-response exchange succeeded; requests may flow.

    ``role`` is the server's role ("metadata", "storage", ...); ``client_id`` is
    the client's id (its own on the client side, the peer's on the server side);
    ``peer_role`` is the role the connecting side authenticated as ("client" or
    "server", see ``wire._auth``).
    """

    role: str
    client_id: bytes
    peer_role: str = "client"


@dataclass(frozen=True, slots=True)
class RequestReceived(Event):
    """Server side: a valid request. The transport must move or discard its payload.

    ``head`` is the decoded frame head; responses echo its ``msg_type`` and ``req_id``.
    """

    req_id: int
    message: Message
    payload_len: int
    head: FrameHead


@dataclass(frozen=True, slots=True)
class BadRequest(Event):
    """Server side: a frame that is not a valid request (unknown type, bad fields).

    Its payload is discarded by the machine; the transport answers with ``error``
    and keeps serving (the stream position is intact).
    """

    req_id: int
    error: StripefsError
    payload_len: int
    head: FrameHead


@dataclass(frozen=True, slots=True)
class ResponseReceived(Event):
    """Client side: the answer to an outstanding request. The transport moves or discards its payload."""

    req_id: int
    header: dict[str, Any]
    payload_len: int


@dataclass(frozen=True, slots=True)
class ErrorReceived(Event):
    """Client side: an outstanding request failed on the server. Any payload is discarded."""

    req_id: int
    error: StripefsError
    payload_len: int


@dataclass(frozen=True, slots=True)
class ResponseCancelled(Event):
    """Client side: a late answer to a request given up with ``cancel``; its payload is discarded."""

    req_id: int
    payload_len: int


@dataclass(frozen=True, slots=True)
class ConnectionClosed(Event):
    """The peer closed the stream cleanly, between frames."""
