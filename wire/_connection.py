"""Sans-IO connection state machines: the handshake, request ids, and payload hand-off.

Every stripefs transport (the blocking pipelined client, the trio client, the trio
server) moves bytes through one of these two machines and nothing else, so the
protocol is written once. No sockets here (in the style of h11):

* ``receive_data(data)`` feeds bytes read from the stream (``b""`` means EOF);
* ``next_event()`` returns the next :mod:`event <wire._events>` or :data:`NEED_DATA`;
* bytes to send come back from method calls (``send_request``, ``send_response``,
  ``start``) or, for frames the machine itself decides to send (handshake
  answers, refusals), from ``data_to_send()``.

Payloads stay zero-copy: an event that carries ``payload_len > 0`` leaves the
payload in the stream. The transport either moves it itself --
``take_payload(dest)`` for bytes already buffered, then ``recv_into`` for the rest
reported with ``payload_received(n)`` -- or calls ``discard_payload()``, after which
the machine drops those bytes as they are fed. ``next_read_size()`` says how many
bytes to read so that no payload byte is ever buffered by the machine (and 0
when a frame head is complete: no need to ask ``next_event`` before that).

States::

    client:  AWAIT_CHALLENGE -> AWAIT_PROOF -> READY
    server:  CHALLENGE (start() sends it) -> AWAIT_AUTHENTICATE -> READY
    both:    any -> ERROR (a protocol or auth failure; the connection must close)
             any -> CLOSED (EOF fed)

Roles: the connecting side authenticates as a ``client`` or a ``server`` of the
cluster with that role's credential (``wire._auth``). The server machine refuses
requests that need the server role (``Message.needs_server_role``: membership,
sync, chunk management, forwarded writes) from a client connection itself, with
an ACCESS error: the service never sees them.

The machines are not thread-safe; a transport that sends from several threads
serialises its calls (``rpc._client.Connection`` holds one lock around them).
"""

from __future__ import annotations

import enum
import functools
import itertools
from typing import Any, Callable, Iterator

from . import _auth as auth
from ._build import positional_builder
from ._errors import ErrorCode, StripefsError
from ._events import (
    BadRequest,
    ConnectionClosed,
    ErrorReceived,
    Event,
    HandshakeComplete,
    RequestReceived,
    ResponseCancelled,
    ResponseReceived,
)
from ._frames import FLAG_ERROR, FLAG_RESPONSE, NEED_DATA, PREFIX, FrameDecoder, FrameHead, _NeedData, encode_prefix
from ._messages import MESSAGES, Authenticate, Challenge, Message, decode_message

__all__ = ["ConnState", "ClientConnection", "ServerConnection"]

_DISCARD_READ = 1 << 20  # largest read a transport needs for bytes that are thrown away
# The two events of every call, built without the frozen dataclass __init__ (wire._build).
_request_received = positional_builder(RequestReceived)
_response_received = positional_builder(ResponseReceived)


class ConnState(enum.Enum):
    AWAIT_CHALLENGE = "await-challenge"  # client: connected, nothing received yet
    AWAIT_PROOF = "await-proof"  # client: Authenticate sent, waiting for the server's proof
    CHALLENGE = "challenge"  # server: the challenge has not been produced yet
    AWAIT_AUTHENTICATE = "await-authenticate"  # server: challenge sent
    READY = "ready"
    CLOSED = "closed"
    ERROR = "error"


def _protocol(msg: str) -> StripefsError:
    return StripefsError(ErrorCode.PROTOCOL, msg)


def _server_only(name: str) -> StripefsError:
    return StripefsError(ErrorCode.ACCESS, f"{name} is accepted only from servers of the cluster; "
                                           "this connection authenticated as a client")


class _Machine:
    """What both sides share: the decoder, the state, payload hand-off, outgoing bytes."""

    def __init__(self, state: ConnState):
        self.state = state
        self._decoder = FrameDecoder()
        self._out = bytearray()
        self._discarding = False
        self._eof = False

    # -- incoming bytes ------------------------------------------------------------------
    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Feed bytes read from the stream; ``b""`` signals EOF.

        Raises:
            StripefsError: PROTOCOL when the machine is closed or failed.
        """
        if self.state in (ConnState.ERROR, ConnState.CLOSED) or self._eof:
            raise _protocol(f"connection is {self.state.value}: no more data expected")
        if not data:
            self._eof = True
            return
        if self._discarding:
            # Bytes of a payload nobody wants are dropped here, never buffered.
            n = min(len(data), self._decoder.payload_left)
            self._decoder.payload_received(n)
            self._discarding = bool(self._decoder.payload_left)
            data = memoryview(data)[n:]
            if not data:
                return
        self._decoder.feed(data)

    def next_read_size(self) -> int:
        """How many bytes to read before calling :meth:`next_event`, without buffering payload bytes.

        The rest of the next frame's prefix and header, or the rest of a payload being
        discarded (capped). 0 means "call next_event" (a head is complete, or the
        stream is bad and next_event will say so) or, while a payload awaits the
        transport, "move it first".
        """
        if self._eof:
            return 0  # next_event reports the end (or a frame cut short)
        decoder = self._decoder
        left = decoder.payload_left
        if left:
            return min(left, _DISCARD_READ) if self._discarding else 0
        need = decoder.head_bytes_needed()
        return need if need <= decoder.max_header else 0  # an oversized header fails in next_event

    @property
    def payload_left(self) -> int:
        """Payload bytes of the last event that the transport has not moved yet."""
        return self._decoder.payload_left

    def take_payload(self, dest: memoryview | bytearray) -> int:
        """Copy already-buffered payload bytes into ``dest``; returns how many (maybe 0)."""
        return self._decoder.take_payload(dest)

    def payload_received(self, n: int) -> None:
        """Report ``n`` payload bytes the transport read from the stream itself.

        Raises:
            StripefsError: PROTOCOL when more is reported than the frame carries, or
            buffered bytes were skipped (``take_payload`` first).
        """
        self._decoder.payload_received(n)

    def discard_payload(self) -> None:
        """Drop the rest of the current payload: buffered bytes now, the others as they are fed."""
        self._decoder.take_payload(None)
        self._discarding = bool(self._decoder.payload_left)

    # -- outgoing bytes ------------------------------------------------------------------
    def data_to_send(self) -> bytes:
        """Bytes the machine itself wants sent (handshake frames, refusals); empties the queue."""
        if not self._out:
            return b""
        out, self._out = bytes(self._out), bytearray()
        return out

    # -- helpers -------------------------------------------------------------------------
    def _fail(self, exc: StripefsError) -> StripefsError:
        self.state = ConnState.ERROR
        return exc

    def _next_head(self) -> FrameHead | _NeedData:
        if self.state is ConnState.ERROR:
            raise _protocol("connection failed earlier: close it")
        decoder = self._decoder
        if decoder.payload_left:
            if not self._discarding:
                raise _protocol("the previous frame's payload has not been moved or discarded")
            if self._eof:
                raise self._fail(_protocol("connection closed in the middle of a payload"))
            return NEED_DATA
        if decoder.buffered < PREFIX.size and not self._eof:
            return NEED_DATA  # the common wait (between frames), answered without parsing
        try:
            head = decoder.next_head()
        except StripefsError as exc:
            raise self._fail(exc) from None
        if head is NEED_DATA and self._eof:
            if decoder.buffered:
                raise self._fail(_protocol("connection closed in the middle of a frame"))
            self.state = ConnState.CLOSED
        return head

    def _discard(self, event: Event) -> Event:
        self.discard_payload()
        return event


class ClientConnection(_Machine):
    """The client side of one connection.

    Args:
        secret: the credential of ``role`` (``wire.role_credential``; a cluster.json
            holds the client's).
        client_id: this client's id (16 bytes, stable per process).
        expect_role: refuse a server announcing any other role.
        role: the role to authenticate as: "client", or "server" for servers of the cluster.
        nonce: the client nonce (tests pin it for exact bytes; fresh by default).
        ids: where request ids come from (a client shares one counter over
            reconnects, so a retried request keeps its id for the replay cache).
    """

    def __init__(self, secret: str | bytes, client_id: bytes, expect_role: str | None = None, *,
                 role: str = "client", nonce: bytes | None = None, ids: Iterator[int] | None = None):
        super().__init__(ConnState.AWAIT_CHALLENGE)
        if role not in auth.ROLES:
            raise ValueError(f"unknown role {role!r}")
        self._secret = secret
        self.peer_role = role  # ours, as the server will know it
        self.client_id = client_id
        self.expect_role = expect_role
        self._nonce = nonce if nonce is not None else auth.new_nonce()
        self._server_nonce = b""
        self._ids = ids if ids is not None else itertools.count(1)
        self._pending: dict[int, int] = {}  # req_id -> msg_type
        self._cancelled: set[int] = set()
        self.role = ""  # the server's role, once the challenge arrived

    @property
    def pending(self) -> frozenset[int]:
        """Request ids sent and not answered yet (cancelled ones excluded)."""
        return frozenset(self._pending.keys() - self._cancelled)

    def send_request(self, msg: Message, payload_len: int = 0, req_id: int | None = None) -> tuple[int, bytes]:
        """Register a request and encode its prefix + header.

        Args:
            msg: the request.
            payload_len: raw bytes the transport sends right after the returned bytes.
            req_id: a caller-chosen id (a retry), else the next from the id counter.

        Returns:
            ``(req_id, bytes to send)``.

        Raises:
            StripefsError: PROTOCOL before the handshake completes, after a failure,
            or for an id already in flight; TOO_BIG for an oversized header or payload.
        """
        if self.state is not ConnState.READY:
            raise _protocol(f"cannot send a request: connection is {self.state.value}")
        if req_id is None:
            req_id = next(self._ids)
        if req_id in self._pending:
            raise _protocol(f"request id {req_id} is already in flight")
        data = encode_prefix(msg.MSG_ID, req_id, msg.to_header(), payload_len)
        self._pending[req_id] = msg.MSG_ID
        return req_id, data

    def cancel(self, req_id: int) -> bool:
        """Give up on a request: its late answer is reported as :class:`ResponseCancelled`.

        Returns whether the id was in flight.
        """
        if req_id in self._pending:
            self._cancelled.add(req_id)
            return True
        return False

    def next_event(self) -> Event | _NeedData:
        """The next event, or :data:`NEED_DATA`.

        Raises:
            StripefsError: PROTOCOL for frames out of place (no challenge first, a
            request frame, an unknown or mismatched response id, a server of the
            wrong role); AUTH when the server refuses us or cannot prove the secret;
            the server's error during the handshake. The machine is then ERROR.
        """
        while True:
            head = self._next_head()
            if head is NEED_DATA:
                return ConnectionClosed() if self.state is ConnState.CLOSED else NEED_DATA
            assert isinstance(head, FrameHead)
            if self.state is ConnState.READY:
                return self._response(head)
            self._handshake(head)
            if self.state is ConnState.READY:
                return HandshakeComplete(self.role, self.client_id, self.peer_role)

    def _handshake(self, head: FrameHead) -> None:
        if head.payload_len:
            raise self._fail(_protocol("handshake frames carry no payload"))
        if self.state is ConnState.AWAIT_CHALLENGE:
            if head.msg_type != Challenge.MSG_ID or head.flags:
                raise self._fail(_protocol("server did not send a challenge"))
            try:
                challenge = decode_message(head.msg_type, head.header)
            except StripefsError as exc:
                raise self._fail(_protocol(f"bad challenge: {exc.message}")) from None
            assert isinstance(challenge, Challenge)
            if self.expect_role and challenge.role != self.expect_role:
                raise self._fail(_protocol(f"expected a {self.expect_role} server, found {challenge.role}"))
            self.role, self._server_nonce = challenge.role, challenge.nonce
            proof = auth.client_proof(self._secret, challenge.nonce, self._nonce)
            msg = Authenticate(client_id=self.client_id, nonce=self._nonce, proof=proof, role=self.peer_role)
            self._out += encode_prefix(msg.MSG_ID, 0, msg.to_header())
            self.state = ConnState.AWAIT_PROOF
            return
        # AWAIT_PROOF: the only acceptable frame is the answer to Authenticate.
        if not head.is_response or head.msg_type != Authenticate.MSG_ID or head.req_id != 0:
            raise self._fail(_protocol("expected the answer to Authenticate"))
        if head.is_error:
            raise self._fail(StripefsError.from_wire(head.header))
        expected = auth.server_proof(self._secret, self._server_nonce, self._nonce)
        if not auth.check_proof(expected, head.header.get("proof")):
            raise self._fail(StripefsError(ErrorCode.AUTH, f"server failed to prove it knows the {self.peer_role} credential"))
        self.state = ConnState.READY

    def _response(self, head: FrameHead) -> Event:
        if not head.is_response:
            raise self._fail(_protocol(f"server sent a request frame (type {head.msg_type})"))
        msg_type = self._pending.pop(head.req_id, None)
        if msg_type is None:
            raise self._fail(_protocol(f"response to unknown request id {head.req_id}"))
        if msg_type != head.msg_type:
            raise self._fail(_protocol(f"response type {head.msg_type} to a request of type {msg_type}"))
        if head.req_id in self._cancelled:
            self._cancelled.discard(head.req_id)
            return self._discard(ResponseCancelled(head.req_id, head.payload_len))
        if head.is_error:
            return self._discard(ErrorReceived(head.req_id, StripefsError.from_wire(head.header), head.payload_len))
        return _response_received(head.req_id, head.header, head.payload_len)  # type: ignore[no-any-return]


@functools.lru_cache(maxsize=8)
def _credentials(secret: str) -> dict[str, str]:
    """Every role's credential (a server derives them once per secret, not per connection)."""
    return {role: auth.role_credential(secret, role) for role in auth.ROLES}


class ServerConnection(_Machine):
    """The server side of one connection.

    Args:
        secret: the cluster secret: every role's credential is derived from it.
        role: what this server is ("metadata", "storage"); announced in the challenge.
        cluster_id: announced in the challenge.
        nonce: the server nonce (tests pin it for exact bytes; fresh by default).
        admit: called as ``admit(client_id, role)`` once a peer has proved its
            credential; an error it returns is the refusal sent instead of the proof
            (a server's per-client connection cap answers BUSY this way).
    """

    def __init__(self, secret: str, role: str, cluster_id: str = "", *, nonce: bytes | None = None,
                 admit: Callable[[bytes, str], StripefsError | None] | None = None):
        super().__init__(ConnState.CHALLENGE)
        self._credentials = _credentials(secret)
        self.role = role
        self.cluster_id = cluster_id
        self._nonce = nonce if nonce is not None else auth.new_nonce()
        self.client_id = b""  # the peer's, once authenticated
        self.peer_role = ""  # "client" or "server", once authenticated
        self._authenticated = False
        self._admit = admit

    def start(self) -> bytes:
        """The challenge frame, sent first on every accepted connection."""
        if self.state is not ConnState.CHALLENGE:
            raise _protocol("the challenge was already sent")
        msg = Challenge(nonce=self._nonce, role=self.role, cluster_id=self.cluster_id)
        self.state = ConnState.AWAIT_AUTHENTICATE
        return encode_prefix(msg.MSG_ID, 0, msg.to_header())

    def next_event(self) -> Event | _NeedData:
        """The next event, or :data:`NEED_DATA`.

        Raises:
            StripefsError: AUTH when the first frame is not a valid ``Authenticate``
            with the right proof -- ``data_to_send()`` then holds the error frame to
            send before closing; PROTOCOL for a broken stream or a response frame
            from the client. The machine is then ERROR.
        """
        if self.state is ConnState.CHALLENGE:
            raise _protocol("call start() and send the challenge first")
        head = self._next_head()
        if head is NEED_DATA:
            return ConnectionClosed() if self.state is ConnState.CLOSED else NEED_DATA
        assert isinstance(head, FrameHead)
        if self.state is ConnState.AWAIT_AUTHENTICATE:
            return self._authenticate(head)
        if head.is_response or head.is_error:
            raise self._fail(_protocol("client sent a response frame"))
        cls = MESSAGES.get(head.msg_type)
        if cls is not None and cls.SERVER_ONLY and self.peer_role != "server":
            # Before its fields are decoded: a client learns nothing about what they should be.
            return self._discard(BadRequest(head.req_id, _server_only(cls.__name__), head.payload_len, head))
        try:
            msg = decode_message(head.msg_type, head.header)
        except StripefsError as exc:
            return self._discard(BadRequest(head.req_id, exc, head.payload_len, head))
        if self.peer_role != "server" and msg.needs_server_role():
            return self._discard(BadRequest(head.req_id, _server_only(type(msg).__name__), head.payload_len, head))
        return _request_received(head.req_id, msg, head.payload_len, head)  # type: ignore[no-any-return]

    def _authenticate(self, head: FrameHead) -> Event:
        try:
            if head.msg_type != Authenticate.MSG_ID or head.flags:
                raise StripefsError(ErrorCode.AUTH, "authenticate first")
            msg = decode_message(head.msg_type, head.header)
            assert isinstance(msg, Authenticate)
            credential = self._credentials.get(msg.role)
            if credential is None:
                raise StripefsError(ErrorCode.AUTH, f"authentication failed: unknown role {msg.role[:40]!r}")
            if not auth.check_proof(auth.client_proof(credential, self._nonce, msg.nonce), msg.proof):
                raise StripefsError(ErrorCode.AUTH, f"authentication failed: wrong cluster secret for the {msg.role} role")
            refusal = self._admit(msg.client_id, msg.role) if self._admit is not None else None
            if refusal is not None:
                raise refusal
        except StripefsError as exc:
            self._out += encode_prefix(head.msg_type, head.req_id, exc.to_wire(), 0, FLAG_RESPONSE | FLAG_ERROR)
            raise self._fail(exc) from None
        self.discard_payload()  # an Authenticate has no payload; never let one desync the stream
        self.client_id = msg.client_id
        self.peer_role = msg.role
        proof = auth.server_proof(credential, self._nonce, msg.nonce)
        self._out += encode_prefix(head.msg_type, head.req_id, {"proof": proof}, 0, FLAG_RESPONSE)
        self.state = ConnState.READY
        self._authenticated = True
        return HandshakeComplete(self.role, self.client_id, self.peer_role)

    def send_response(self, head: FrameHead, header: dict[str, Any], payload_len: int = 0) -> bytes:
        """Prefix + header of the answer to ``head``; the transport sends ``payload_len`` bytes after it.

        Safe to call from any thread (it only encodes).

        Raises:
            StripefsError: PROTOCOL before the handshake completed; TOO_BIG for oversized frames.
        """
        self._check_ready()
        return encode_prefix(head.msg_type, head.req_id, header, payload_len, FLAG_RESPONSE)

    def send_error(self, head: FrameHead, error: StripefsError) -> bytes:
        """The error frame answering ``head``."""
        self._check_ready()
        return encode_prefix(head.msg_type, head.req_id, error.to_wire(), 0, FLAG_RESPONSE | FLAG_ERROR)

    def _check_ready(self) -> None:
        # Requests already received are still answered after EOF (a client may half-close
        # after its last request) or a later protocol error on the receiving side.
        if not self._authenticated:
            raise _protocol(f"cannot answer: connection is {self.state.value}")
