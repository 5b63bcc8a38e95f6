"""Connection state machines, no sockets: exact bytes, whole input, one byte at a time,
trailing bytes, payload hand-off, request-id correlation, refusals, random chunkings."""

from __future__ import annotations

import hashlib
import hmac
import io
import itertools
from typing import Any, Iterator

import pytest
from hypothesis import given, settings, strategies as st

from stripefs.wire import (
    NEED_DATA,
    BadRequest,
    ClientConnection,
    ConnectionClosed,
    ConnState,
    ErrorCode,
    ErrorReceived,
    FrameHead,
    HandshakeComplete,
    RequestReceived,
    ResponseCancelled,
    ResponseReceived,
    ServerConnection,
    StripefsError,
    encode_frame,
    messages as m,
)

SECRET = "s3cret"  # the cluster secret, as servers hold it
# The client role's credential, derived one-way from it (wire._auth.role_credential).
CLIENT = hmac.new(SECRET.encode(), b"stripefs-role:client", hashlib.sha256).hexdigest()
CID = b"C" * 16
CN = b"\x01" * 32  # client nonce
SN = b"\x02" * 32  # server nonce


def _prefix(flags: int, msg_type: int, req_id: int, hlen: int, plen: int = 0) -> bytes:
    return (b"SF\x01" + bytes([flags]) + msg_type.to_bytes(2, "big") + b"\x00\x00" + req_id.to_bytes(8, "big")
            + hlen.to_bytes(4, "big") + plen.to_bytes(8, "big"))


def _mac(label: bytes, a: bytes, b: bytes, secret: str = CLIENT) -> bytes:
    return hmac.new(secret.encode(), label + a + b, hashlib.sha256).digest()


def pair(client_secret: str = CLIENT, server_secret: str = SECRET, role: str = "storage",
         expect: str | None = "storage") -> tuple[ClientConnection, ServerConnection]:
    return (ClientConnection(client_secret, CID, expect, nonce=CN),
            ServerConnection(server_secret, role, "cl", nonce=SN))


def request_head(msg_type: int, req_id: int) -> FrameHead:
    """The head of a request, as a server answering it holds it."""
    return FrameHead(msg_type, req_id, 0, {}, 0)


def norm(ev: Any) -> Any:
    """Events as comparable values (exceptions compare by identity)."""
    if isinstance(ev, (ErrorReceived, BadRequest)):
        return type(ev).__name__, ev.req_id, ev.error.code, ev.error.message, ev.payload_len
    return ev


def drain(machine: Any) -> list[Any]:
    out = []
    while (ev := machine.next_event()) is not NEED_DATA:
        out.append(ev)
        if isinstance(ev, ConnectionClosed):
            break
    return out


def handshake(client: ClientConnection, server: ServerConnection) -> None:
    client.receive_data(server.start())
    assert drain(client) == []
    server.receive_data(client.data_to_send())
    assert drain(server) == [HandshakeComplete("storage", CID)]
    client.receive_data(server.data_to_send())
    assert drain(client) == [HandshakeComplete("storage", CID)]
    assert client.state is server.state is ConnState.READY


def ready() -> tuple[ClientConnection, ServerConnection]:
    client, server = pair()
    handshake(client, server)
    return client, server


def run(machine: Any, data: bytes, sizes: Iterator[int]) -> list[tuple[Any, bytes]]:
    """Feed ``data`` in chunks of the given sizes, moving payloads like a transport does:
    ``take_payload`` for what is buffered, more data when that is not all of it."""
    out: list[tuple[Any, bytes]] = []
    pos = 0
    while True:
        ev = machine.next_event()
        if ev is NEED_DATA:
            if pos >= len(data):
                return out
            n = next(sizes)
            machine.receive_data(data[pos : pos + n])
            pos += n
            continue
        body = b""
        if isinstance(ev, (RequestReceived, ResponseReceived)) and ev.payload_len:
            buf = bytearray(ev.payload_len)
            got = machine.take_payload(memoryview(buf))
            while got < len(buf):
                n = next(sizes)
                machine.receive_data(data[pos : pos + n])
                pos += n
                got += machine.take_payload(memoryview(buf)[got:])
            body = bytes(buf)
        out.append((norm(ev), body))


# -- exact bytes ---------------------------------------------------------------------------

CHALLENGE_HEADER = b"\x83\xa5nonce\xc4\x20" + SN + b"\xa4role\xa7storage\xaacluster_id\xa2cl"
AUTH_HEADER = (b"\x84\xa9client_id\xc4\x10" + CID + b"\xa5nonce\xc4\x20" + CN + b"\xa5proof\xc4\x20"
               + _mac(b"client", SN, CN) + b"\xa4role\xa6client")
PROOF_HEADER = b"\x81\xa5proof\xc4\x20" + _mac(b"server", CN, SN)


def test_exact_bytes_table() -> None:
    client, server = pair()
    sent: dict[str, bytes] = {}
    sent["challenge"] = server.start()
    client.receive_data(sent["challenge"])
    drain(client)
    sent["authenticate"] = client.data_to_send()
    server.receive_data(sent["authenticate"])
    drain(server)
    sent["proof"] = server.data_to_send()
    client.receive_data(sent["proof"])
    drain(client)
    sent["ping"] = client.send_request(m.Ping())[1]
    sent["read"] = client.send_request(m.ReadChunk(ino=5, index=0, offset=0, length=4), req_id=9)[1]
    server.receive_data(sent["ping"])
    (ping,) = drain(server)
    sent["pong"] = server.send_response(ping.head, {})
    sent["error"] = server.send_error(ping.head, StripefsError(ErrorCode.BUSY, "x"))
    table = {
        "challenge": _prefix(0, 1, 0, len(CHALLENGE_HEADER)) + CHALLENGE_HEADER,
        "authenticate": _prefix(0, 2, 0, len(AUTH_HEADER)) + AUTH_HEADER,
        "proof": _prefix(1, 2, 0, len(PROOF_HEADER)) + PROOF_HEADER,
        "ping": _prefix(0, 3, 1, 1) + b"\x80",
        "read": _prefix(0, 41, 9, 53)
        + b"\x86\xa3ino\x05\xa5index\x00\xa6offset\x00\xa6length\x04\xa5chain\x00\xafrouting_version\x00",
        "pong": _prefix(1, 3, 1, 1) + b"\x80",
        "error": _prefix(3, 3, 1, 17) + b"\x82\xa4code\x12\xa7message\xa1x",
    }
    assert len(CHALLENGE_HEADER) == 68
    assert sent == table


# -- handshake -----------------------------------------------------------------------------


def test_handshake_back_to_back() -> None:
    client, server = pair()
    assert (client.state, server.state) == (ConnState.AWAIT_CHALLENGE, ConnState.CHALLENGE)
    client.receive_data(server.start())
    assert drain(client) == [] and client.state is ConnState.AWAIT_PROOF
    assert server.state is ConnState.AWAIT_AUTHENTICATE
    handshake_bytes = client.data_to_send()
    assert client.data_to_send() == b""  # the queue empties
    server.receive_data(handshake_bytes)
    assert drain(server) == [HandshakeComplete("storage", CID)] and server.client_id == CID
    client.receive_data(server.data_to_send())
    assert drain(client) == [HandshakeComplete("storage", CID)] and client.role == "storage"


def _sizes(mode: str, total: int) -> Iterator[int]:
    return itertools.repeat(1) if mode == "bytewise" else itertools.repeat(total)


@pytest.mark.parametrize("mode", ["whole", "bytewise", "trailing"])
def test_server_fed_whole_bytewise_and_with_trailing_bytes(mode: str) -> None:
    client, _ = pair()
    client.receive_data(ServerConnection(SECRET, "storage", "cl", nonce=SN).start())
    drain(client)
    stream = client.data_to_send()
    twin, _ = ready()  # same nonces and ids: the bytes the client would pipeline next
    stream += twin.send_request(m.Ping())[1] + twin.send_request(m.GetAttr(ino=7))[1] + twin.send_request(m.Ping(), req_id=3)[1]
    if mode == "trailing":
        stream += b"SF\x01"
    server = ServerConnection(SECRET, "storage", "cl", nonce=SN)
    server.start()
    events = [ev for ev, _ in run(server, stream, _sizes(mode, len(stream)))]
    assert events[0] == HandshakeComplete("storage", CID)
    assert [(e.req_id, e.message) for e in events[1:]] == [(1, m.Ping()), (2, m.GetAttr(ino=7)), (3, m.Ping())]
    assert server.next_event() is NEED_DATA  # trailing bytes wait for the rest of their frame
    assert server.data_to_send() == _prefix(1, 2, 0, len(PROOF_HEADER)) + PROOF_HEADER


@pytest.mark.parametrize("mode", ["whole", "bytewise", "trailing"])
def test_client_fed_whole_bytewise_and_with_trailing_bytes(mode: str) -> None:
    client, _ = pair()
    challenge = _prefix(0, 1, 0, len(CHALLENGE_HEADER)) + CHALLENGE_HEADER
    proof = _prefix(1, 2, 0, len(PROOF_HEADER)) + PROOF_HEADER
    assert run(client, challenge, _sizes(mode, len(challenge))) == []
    assert client.data_to_send() == _prefix(0, 2, 0, len(AUTH_HEADER)) + AUTH_HEADER
    tail = proof + (b"SF\x01\x01" if mode == "trailing" else b"")
    assert [ev for ev, _ in run(client, tail, _sizes(mode, len(tail)))] == [HandshakeComplete("storage", CID)]
    assert client.next_event() is NEED_DATA and client.state is ConnState.READY


# -- refusals ------------------------------------------------------------------------------


def test_wrong_secret_is_refused_with_an_error_frame() -> None:
    client, server = pair(client_secret="wrong")
    client.receive_data(server.start())
    drain(client)
    server.receive_data(client.data_to_send())
    with pytest.raises(StripefsError) as exc:
        server.next_event()
    assert exc.value.code == ErrorCode.AUTH and server.state is ConnState.ERROR
    refusal = server.data_to_send()
    assert refusal[3] == 0x03  # RESPONSE | ERROR
    client.receive_data(refusal)
    with pytest.raises(StripefsError) as exc:
        client.next_event()
    assert exc.value.code == ErrorCode.AUTH and "wrong cluster secret" in exc.value.message
    assert client.state is ConnState.ERROR
    with pytest.raises(StripefsError):  # failed for good
        client.next_event()


def test_a_server_may_refuse_a_proven_peer_with_the_code_it_chooses() -> None:
    asked: list[tuple[bytes, str]] = []

    def admit(client_id: bytes, role: str) -> StripefsError | None:
        asked.append((client_id, role))
        return StripefsError(ErrorCode.BUSY, "too many connections")

    client = ClientConnection(CLIENT, CID, "storage", nonce=CN)
    server = ServerConnection(SECRET, "storage", "cl", nonce=SN, admit=admit)
    client.receive_data(server.start())
    drain(client)
    server.receive_data(client.data_to_send())
    with pytest.raises(StripefsError) as exc:
        server.next_event()
    assert exc.value.code == ErrorCode.BUSY and server.state is ConnState.ERROR
    assert asked == [(CID, "client")]  # asked only once the peer proved its credential
    client.receive_data(server.data_to_send())
    with pytest.raises(StripefsError) as exc:
        client.next_event()
    assert exc.value.code == ErrorCode.BUSY and exc.value.message == "too many connections"
    # A peer with the wrong credential is refused AUTH before anyone is asked.
    client = ClientConnection("wrong", CID, "storage", nonce=CN)
    server = ServerConnection(SECRET, "storage", "cl", nonce=SN, admit=admit)
    client.receive_data(server.start())
    drain(client)
    server.receive_data(client.data_to_send())
    with pytest.raises(StripefsError) as exc:
        server.next_event()
    assert exc.value.code == ErrorCode.AUTH and len(asked) == 1


def test_server_that_cannot_prove_the_secret_is_refused() -> None:
    client, server = pair(server_secret="other")
    client.receive_data(server.start())
    drain(client)
    # The impostor cannot check our proof; it answers with a proof of its own anyway.
    forged = encode_frame(2, 0, {"proof": _mac(b"server", CN, SN, "other")}, flags=1)
    client.receive_data(forged)
    with pytest.raises(StripefsError) as exc:
        client.next_event()
    assert exc.value.code == ErrorCode.AUTH and "prove" in exc.value.message


def test_wrong_role_is_refused() -> None:
    client, server = pair(role="metadata", expect="storage")
    client.receive_data(server.start())
    with pytest.raises(StripefsError) as exc:
        client.next_event()
    assert exc.value.code == ErrorCode.PROTOCOL and "expected a storage server, found metadata" in exc.value.message


@pytest.mark.parametrize("first", [
    encode_frame(3, 0, {}),  # a request, not a challenge
    encode_frame(1, 0, {"nonce": SN, "role": "storage", "cluster_id": ""}, flags=1),  # a challenge flagged response
    encode_frame(1, 0, {"nonce": SN}),  # a challenge missing fields
    encode_frame(1, 0, {"nonce": SN, "role": "storage", "cluster_id": ""}, b"p"),  # with a payload
])
def test_a_first_frame_that_is_not_a_challenge_is_refused(first: bytes) -> None:
    client = ClientConnection(SECRET, CID, nonce=CN)
    client.receive_data(first)
    with pytest.raises(StripefsError) as exc:
        client.next_event()
    assert exc.value.code == ErrorCode.PROTOCOL and client.state is ConnState.ERROR


def test_frames_before_the_handshake_completes() -> None:
    client, server = pair()
    with pytest.raises(StripefsError) as exc:  # nothing may be sent before READY
        client.send_request(m.Ping())
    assert exc.value.code == ErrorCode.PROTOCOL
    with pytest.raises(StripefsError):  # nor answered
        server.send_response(request_head(3, 1), {})
    with pytest.raises(StripefsError):  # the server speaks first
        server.next_event()
    server.start()
    server.receive_data(encode_frame(13, 4, m.Resolve(path="/").to_header()))
    with pytest.raises(StripefsError) as exc:
        server.next_event()
    assert exc.value.code == ErrorCode.AUTH and "authenticate first" in exc.value.message
    refusal = server.data_to_send()
    assert refusal[:16] == _prefix(3, 13, 4, 0)[:16]  # answers the offending request's id
    # A client that gets a response while waiting for the proof fails too.
    client.receive_data(ServerConnection(SECRET, "storage", nonce=SN).start())
    drain(client)
    client.receive_data(encode_frame(3, 1, {}, flags=1))
    with pytest.raises(StripefsError) as exc:
        client.next_event()
    assert exc.value.code == ErrorCode.PROTOCOL


# -- request ids ---------------------------------------------------------------------------


def test_out_of_order_responses_with_payloads() -> None:
    client, server = ready()
    ids = [client.send_request(m.ReadChunk(ino=1, index=i, offset=0, length=3))[0] for i in range(3)]
    assert client.pending == {1, 2, 3}
    server.receive_data(client.send_request(m.Ping())[1])
    (ping,) = drain(server)  # the server decodes it; its answer comes last
    heads = {i: request_head(41, i) for i in ids}
    stream = b"".join(server.send_response(heads[i], {"n": i}, 3) + bytes([i]) * 3 for i in (3, 1, 2))
    stream += server.send_response(ping.head, {})
    got = run(client, stream, itertools.repeat(5))
    assert [(ev.req_id, ev.header, body) for ev, body in got] == [
        (3, {"n": 3}, b"\x03" * 3), (1, {"n": 1}, b"\x01" * 3), (2, {"n": 2}, b"\x02" * 3), (4, {}, b"")]
    assert client.pending == set()


def test_cancelled_response_and_its_payload_are_discarded() -> None:
    client, server = ready()
    a, _ = client.send_request(m.ReadChunk(ino=1, index=0, offset=0, length=8))
    b, _ = client.send_request(m.Ping())
    assert client.cancel(a) and not client.cancel(99)
    assert client.pending == {b}
    head_a = request_head(41, a)
    head_b = request_head(3, b)
    stream = server.send_response(head_a, {}, 8) + b"late-bye" + server.send_response(head_b, {"ok": 1})
    client.receive_data(stream[:33])  # the payload arrives in two pieces
    assert client.next_event() == ResponseCancelled(a, 8)
    assert client.next_event() is NEED_DATA and client.payload_left
    client.receive_data(stream[33:])
    assert client.next_event() == ResponseReceived(b, {"ok": 1}, 0)
    with pytest.raises(StripefsError) as exc:  # answered once only: a second answer is unknown
        client.receive_data(server.send_response(head_b, {}))
        client.next_event()
    assert exc.value.code == ErrorCode.PROTOCOL and "unknown request id" in exc.value.message


def test_unknown_or_mismatched_response_is_a_protocol_error() -> None:
    client, _ = ready()
    client.receive_data(encode_frame(3, 42, {}, flags=1))
    with pytest.raises(StripefsError) as exc:
        client.next_event()
    assert exc.value.code == ErrorCode.PROTOCOL and client.state is ConnState.ERROR
    client, _ = ready()
    req, _ = client.send_request(m.Ping())
    client.receive_data(encode_frame(41, req, {}, flags=1))
    with pytest.raises(StripefsError) as exc:
        client.next_event()
    assert "type 41" in exc.value.message


def test_request_ids_are_unique_in_flight_and_reusable_after() -> None:
    client, server = ready()
    client.send_request(m.Ping(), req_id=5)
    with pytest.raises(StripefsError):
        client.send_request(m.Ping(), req_id=5)
    client.receive_data(encode_frame(3, 5, {}, flags=1))
    assert client.next_event() == ResponseReceived(5, {}, 0)
    assert client.send_request(m.Ping(), req_id=5)[0] == 5  # a retry may reuse it
    shared = itertools.count(100)
    c2 = ClientConnection(SECRET, CID, ids=shared)
    c2.state = ConnState.READY
    assert c2.send_request(m.Ping())[0] == 100 and next(shared) == 101


def test_error_response_payload_is_discarded() -> None:
    client, _ = ready()
    req, _ = client.send_request(m.ReadChunk(ino=1, index=0, offset=0, length=4))
    nxt, _ = client.send_request(m.Ping())
    client.receive_data(encode_frame(41, req, {"code": 12, "message": "bad"}, b"junk", flags=3)
                        + encode_frame(3, nxt, {}, flags=1))
    ev = client.next_event()
    assert isinstance(ev, ErrorReceived) and ev.error.code == ErrorCode.CHECKSUM and ev.payload_len == 4
    assert client.next_event() == ResponseReceived(nxt, {}, 0)


def test_bad_request_is_reported_and_the_stream_goes_on() -> None:
    _, server = ready()
    server.receive_data(encode_frame(999, 7, {}, b"payload") + encode_frame(11, 8, {"ino": "x"})
                        + encode_frame(3, 9, {}))
    ev = server.next_event()
    assert isinstance(ev, BadRequest) and ev.req_id == 7 and ev.error.code == ErrorCode.PROTOCOL
    ev = server.next_event()
    assert isinstance(ev, BadRequest) and ev.error.code == ErrorCode.INVALID
    ev = server.next_event()
    assert isinstance(ev, RequestReceived) and ev.message == m.Ping()
    server.receive_data(encode_frame(3, 10, {}, flags=1))  # a response frame from a client
    with pytest.raises(StripefsError) as exc:
        server.next_event()
    assert exc.value.code == ErrorCode.PROTOCOL


def test_payload_must_be_moved_before_the_next_event() -> None:
    _, server = ready()
    write = m.WriteChunk(ino=1, index=0, offset=0, crc=0, chunk_size=1 << 20, chain=1)
    server.receive_data(encode_frame(40, 1, write.to_header(), b"abc") + encode_frame(3, 2, {}))
    ev = server.next_event()
    assert ev.payload_len == 3
    with pytest.raises(StripefsError):
        server.next_event()
    dest = bytearray(3)
    assert server.take_payload(memoryview(dest)) == 3 and dest == b"abc"
    assert server.next_event().req_id == 2


# -- zero copy and end of stream -----------------------------------------------------------


def test_exact_reads_never_buffer_payload_bytes() -> None:
    """A transport reading ``next_read_size()`` bytes gets payloads straight from the stream."""
    client, server = ready()
    ids = [client.send_request(m.ReadChunk(ino=1, index=i, offset=0, length=1000))[0] for i in range(4)]
    stream = io.BytesIO()
    for i in ids:
        head = request_head(41, i)
        stream.write(server.send_response(head, {"i": i}, 1000) + bytes([i]) * 1000)
    client.cancel(ids[1])
    stream.seek(0)
    got = {}
    while len(got) < 3:
        ev = client.next_event()
        if ev is NEED_DATA:
            client.receive_data(stream.read(client.next_read_size()))
        elif isinstance(ev, ResponseReceived):
            dest = bytearray(ev.payload_len)
            assert client.take_payload(memoryview(dest)) == 0  # nothing buffered
            n = stream.readinto(dest)  # the socket's recv_into
            client.payload_received(n)
            got[ev.req_id] = bytes(dest)
    assert got == {i: bytes([i]) * 1000 for i in (1, 3, 4)}
    assert stream.read() == b""


def test_end_of_stream() -> None:
    client, _ = ready()
    client.receive_data(b"")
    assert client.next_event() == ConnectionClosed() and client.state is ConnState.CLOSED
    with pytest.raises(StripefsError):
        client.receive_data(b"more")
    client, _ = ready()
    client.send_request(m.Ping())
    client.receive_data(encode_frame(3, 1, {}, flags=1)[:10])
    client.receive_data(b"")
    with pytest.raises(StripefsError) as exc:
        client.next_event()
    assert "middle of a frame" in exc.value.message


def test_garbage_breaks_the_connection_for_good() -> None:
    _, server = ready()
    server.receive_data(b"GET / HTTP/1.1\r\n\r\n" + b"\x00" * 20)
    with pytest.raises(StripefsError):
        server.next_event()
    assert server.state is ConnState.ERROR
    with pytest.raises(StripefsError):
        server.next_event()


# -- random chunkings ----------------------------------------------------------------------


def _conversation() -> tuple[bytes, bytes, list[int]]:
    """Both directions of a whole connection: the handshake, requests with payloads, and
    answers out of order (some with payloads, one error, one cancelled)."""
    client, server = pair()
    to_client = server.start()
    client.receive_data(to_client)
    drain(client)
    to_server = client.data_to_send()
    server.receive_data(to_server)
    drain(server)
    proof = server.data_to_send()
    to_client += proof
    client.receive_data(proof)
    drain(client)
    ids = []
    for i in range(6):
        req, prefix = client.send_request(m.WriteChunk(ino=1, index=i, offset=0, crc=0, chunk_size=1 << 20, chain=1), i * 7)
        to_server += prefix + bytes([i]) * (i * 7)
        ids.append(req)
    for i in (5, 0, 3, 1, 4, 2):
        head = request_head(40, ids[i])
        if i == 4:
            to_client += server.send_error(head, StripefsError(ErrorCode.IO, "disk"))
        else:
            to_client += server.send_response(head, {"i": i}, i * 3) + bytes([i]) * (i * 3)
    return to_client, to_server, ids


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=64), min_size=1, max_size=50))
def test_random_chunkings_give_the_same_events(cuts: list[int]) -> None:
    to_client, to_server, ids = _conversation()
    def serve(sizes: Iterator[int]) -> list[Any]:
        server = ServerConnection(SECRET, "storage", "cl", nonce=SN)
        server.start()
        return run(server, to_server, sizes)

    whole_server = serve(itertools.repeat(len(to_server)))
    chunked_server = serve(itertools.cycle(cuts))
    assert chunked_server == whole_server
    assert [(ev.req_id, body) for ev, body in whole_server[1:]] == [(ids[i], bytes([i]) * (i * 7)) for i in range(6)]

    def replay(sizes: Iterator[int]) -> list[Any]:
        client = ClientConnection(CLIENT, CID, "storage", nonce=CN)
        challenge_len = 28 + len(CHALLENGE_HEADER)
        got = run(client, to_client[:challenge_len], sizes)
        assert client.data_to_send().startswith(to_server[:28])
        rest = to_client[challenge_len:]
        proof_len = 28 + len(PROOF_HEADER)
        got += run(client, rest[:proof_len], sizes)
        for i in range(6):
            client.send_request(m.WriteChunk(ino=1, index=i, offset=0, crc=0, chunk_size=1 << 20, chain=1), i * 7)
        client.cancel(ids[1])
        return got + run(client, rest[proof_len:], sizes)

    whole = replay(itertools.repeat(len(to_client)))
    assert replay(itertools.cycle(cuts)) == whole
    kinds = [(ev[0], ev[1], body) if isinstance(ev, tuple) else (type(ev).__name__, getattr(ev, "req_id", None), body)
             for ev, body in whole]
    assert kinds == [
        ("HandshakeComplete", None, b""),
        ("ResponseReceived", ids[5], b"\x05" * 15),
        ("ResponseReceived", ids[0], b""),
        ("ResponseReceived", ids[3], b"\x03" * 9),
        ("ResponseCancelled", ids[1], b""),
        ("ErrorReceived", ids[4], b""),
        ("ResponseReceived", ids[2], b"\x02" * 6),
    ]


def test_next_read_size_walks_a_frame_exactly() -> None:
    client, server = ready()
    req, _ = client.send_request(m.ReadChunk(ino=1, index=0, offset=0, length=5))
    head = request_head(41, req)
    frame = server.send_response(head, {"length": 5}, 5) + b"hello"
    assert client.next_read_size() == 28
    client.receive_data(frame[:28])
    assert client.next_read_size() == len(frame) - 28 - 5  # the header, not the payload
    client.receive_data(frame[28:-5])
    assert client.next_read_size() == 0  # a head is complete: ask next_event
    assert client.next_event() == ResponseReceived(req, {"length": 5}, 5)
    assert client.next_read_size() == 0  # the payload is the transport's to move
    client.discard_payload()
    assert client.next_read_size() == 5
    client.receive_data(b"hello")
    assert client.next_read_size() == 28
    client.receive_data(b"")
    assert client.next_read_size() == 0 and client.next_event() == ConnectionClosed()


# -- roles ---------------------------------------------------------------------------------


def test_server_only_requests_need_the_server_role() -> None:
    """A client-role peer's membership or forwarded-write frame is refused by the machine
    itself (ACCESS, payload skipped); the same frames from a server-role peer pass."""
    server_cred = hmac.new(SECRET.encode(), b"stripefs-role:server", hashlib.sha256).hexdigest()
    frames = [m.SyncDone(server_id=1, token="ab" * 32), m.RemoveChunks(ino=7),
              m.WriteChunk(ino=7, index=0, offset=0, crc=0, chunk_size=4096, chain=1, version=3)]
    for role, credential in (("client", CLIENT), ("server", server_cred)):
        client = ClientConnection(credential, CID, "storage", role=role, nonce=CN)
        server = ServerConnection(SECRET, "storage", "cl", nonce=SN)
        client.receive_data(server.start())
        drain(client)
        server.receive_data(client.data_to_send())
        assert drain(server) == [HandshakeComplete("storage", CID, role)]
        client.receive_data(server.data_to_send())
        assert drain(client) == [HandshakeComplete("storage", CID, role)]
        for msg in frames:
            server.receive_data(client.send_request(msg, payload_len=3)[1] + b"xyz")
            event = server.next_event()
            if role == "client":
                assert isinstance(event, BadRequest) and event.error.code == ErrorCode.ACCESS, event
                assert type(msg).__name__ in event.error.message
            else:
                assert isinstance(event, RequestReceived) and event.message == msg
                server.discard_payload()
        # An ordinary request goes through either way (the stream stayed in step).
        server.receive_data(client.send_request(m.Ping())[1])
        assert isinstance(drain(server)[0], RequestReceived)


def test_unknown_role_or_wrong_role_credential_is_refused() -> None:
    for role, credential in (("server", CLIENT), ("admin", CLIENT)):
        server = ServerConnection(SECRET, "storage", "cl", nonce=SN)
        server.start()
        auth = m.Authenticate(client_id=CID, nonce=CN, proof=_mac(b"client", SN, CN, credential), role=role)
        server.receive_data(encode_frame(2, 0, auth.to_header()))
        with pytest.raises(StripefsError) as exc:
            server.next_event()
        assert exc.value.code == ErrorCode.AUTH and role in exc.value.message
        assert server.state is ConnState.ERROR
