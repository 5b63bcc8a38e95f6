"""The reader's own answers (``Service.answer_now``, refusals of bad requests) are held and
written together (``ServerConn.hold``/``flush``): each still reaches its request, in the
order the reader made it, before anything answered after it by another sender, and
whatever the connection does (pipelined bursts, oversized answers, a stalled reader,
a half-close, a reset, a broken stream).

The client side is a raw socket: requests go out in bursts the blocking client would not
send, and answers are read back frame by frame in the order they came.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import trio

from stripefs import wire
from stripefs.rpc import ServerConn, Service, ThreadReply
from stripefs.rpc._server import BURST_READ, MAX_IN_FLIGHT, MIN_READ, SMALL_SEND
from stripefs.wire import ErrorCode, FrameHead, Message, StripefsError
from stripefs.wire import messages as m

from .threaded import ThreadedServer

SECRET = "test-secret"
CLIENT = wire.role_credential(SECRET, "client")
BIG = 3 * SMALL_SEND  # an answer header past the small-send size
# GetAttr.ino picks the answer: ino % 1000 is the kind, the rest tells requests apart.
NOW, MISSING, BUG, TASK, THREAD, HUGE, TOO_BIG, SLOW = range(8)
SLOW_S = 0.5  # how long a SLOW request's task takes


def kind(ino: int) -> int:
    return ino % 1000


class Answers(Service):
    """GetAttr answered as ``kind(ino)`` says: at once with ``{"ino": ino}`` (NOW), an
    ENOENT or a bug at once, by a task (TASK), on the connection's reply thread via
    ``handle_now`` (THREAD), at once with a header of ``BIG`` bytes (HUGE) or one past
    the frame limit (TOO_BIG), by a task after ``SLOW_S`` (SLOW)."""

    role = "metadata"

    def answer_now(self, conn: ServerConn, head: FrameHead, msg: Message) -> dict[str, Any] | None:
        assert isinstance(msg, m.GetAttr)
        k = kind(msg.ino)
        if k == NOW:
            return {"ino": msg.ino}
        if k == MISSING:
            raise StripefsError(ErrorCode.NOT_FOUND, f"no inode {msg.ino}")
        if k == BUG:
            raise RuntimeError("a bug")
        if k == HUGE:
            return {"ino": msg.ino, "fill": b"x" * BIG}
        if k == TOO_BIG:
            return {"ino": msg.ino, "fill": b"x" * (wire.MAX_HEADER + 1)}
        return None

    def handle_now(self, conn: ServerConn, head: FrameHead, msg: Message) -> bool:
        if isinstance(msg, m.GetAttr) and kind(msg.ino) == THREAD:
            return conn.try_reply_in_thread(head, self._job, msg)
        return False

    def _job(self, reply: ThreadReply, msg: m.GetAttr) -> None:
        reply.send({"ino": msg.ino, "from": "thread"})

    async def handle(self, conn: ServerConn, head: FrameHead, msg: Message, payload: Any) -> None:
        assert isinstance(msg, m.GetAttr)
        if kind(msg.ino) == SLOW:
            await trio.sleep(SLOW_S)
        await conn.send(head, {"ino": msg.ino, "from": "task"})


class NowOrTask(Answers):
    """:class:`Answers` without ``handle_now``: the reader answers at once or starts a task."""

    handle_now = Service.handle_now  # type: ignore[assignment]


@pytest.fixture
def server() -> Iterator[ThreadedServer]:
    s = ThreadedServer(Answers(), SECRET)
    yield s
    s.stop()


class Raw:
    """An authenticated connection driven by hand: ``send`` any bytes, ``frames`` reads
    back answers in the order they arrive."""

    def __init__(self, address: tuple[str, int]):
        self.sock = socket.create_connection(address, timeout=20)
        machine = wire.ClientConnection(CLIENT, os.urandom(16))
        while True:
            event = machine.next_event()
            out = machine.data_to_send()
            if out:
                self.sock.sendall(out)
            if isinstance(event, wire.HandshakeComplete):
                break
            machine.receive_data(self.sock.recv(4096))
        self.decoder = wire.FrameDecoder()  # nothing comes past the handshake before a request

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def frames(self, n: int) -> list[wire.Frame]:
        out: list[wire.Frame] = []
        while len(out) < n:
            frame = self.decoder.next_event()
            if frame is wire.NEED_DATA:
                data = self.sock.recv(1 << 20)
                if not data:
                    raise EOFError(f"the server closed after {len(out)} of {n} answers")
                self.decoder.feed(data)
                continue
            assert isinstance(frame, wire.Frame)
            out.append(frame)
        return out

    def at_eof(self) -> bool:
        """Whether the server ended the stream next (no more frames first)."""
        assert self.decoder.next_event() is wire.NEED_DATA
        return self.sock.recv(1) == b""

    def close(self) -> None:
        self.sock.close()


def getattr_frame(req_id: int, ino: int) -> bytes:
    return wire.encode_frame(m.GetAttr.MSG_ID, req_id, m.GetAttr(ino=ino).to_header())


def bad_frame(req_id: int) -> bytes:
    """A GetAttr whose header does not decode: the machine answers it as a bad request."""
    return wire.encode_frame(m.GetAttr.MSG_ID, req_id, {"ino": "not a number"})


def check(frame: wire.Frame, req_id: int, ino: int | None) -> None:
    """``frame`` is the right answer to request ``req_id`` (``ino`` None: a bad request)."""
    head = frame.head
    assert head.req_id == req_id and head.is_response and head.msg_type == m.GetAttr.MSG_ID
    if ino is None:
        assert head.is_error and head.header["code"] == ErrorCode.INVALID
        return
    k = kind(ino)
    if k == MISSING:
        assert head.is_error and head.header["code"] == ErrorCode.NOT_FOUND, head.header
    elif k == BUG:
        assert head.is_error and head.header["code"] == ErrorCode.IO, head.header
    elif k == TOO_BIG:
        assert head.is_error and head.header["code"] == ErrorCode.TOO_BIG, head.header
    else:
        assert not head.is_error, head.header
        assert head.header["ino"] == ino
        assert head.header.get("from") == {TASK: "task", SLOW: "task", THREAD: "thread"}.get(k)
        assert len(head.header.get("fill", b"")) == (BIG if k == HUGE else 0)


def burst(kinds: list[int], first_id: int = 1) -> tuple[bytes, dict[int, int | None]]:
    """Requests of the given kinds (None: a bad request) as one byte string, and the ino
    each request id asked for."""
    data = bytearray()
    asked: dict[int, int | None] = {}
    for i, k in enumerate(kinds):
        req_id = first_id + i
        asked[req_id] = None if k is None else req_id * 1000 + k
        data += bad_frame(req_id) if k is None else getattr_frame(req_id, asked[req_id])  # type: ignore[arg-type]
    return bytes(data), asked


def padded(kinds: list[int], total: int) -> tuple[bytes, dict[int, int | None]]:
    """:func:`burst`, then one bad request padded so that the whole is ``total`` bytes."""
    data, asked = burst(kinds)
    req_id = len(kinds) + 1
    for pad in range(total):
        frame = wire.encode_frame(m.GetAttr.MSG_ID, req_id, {"ino": "x" * pad})
        if len(data) + len(frame) == total:
            asked[req_id] = None
            return data + frame, asked
    raise AssertionError(f"no padding makes {total} bytes")


def test_a_burst_that_fills_the_first_read_exactly_is_answered_before_the_reader_waits(
        server: ThreadedServer) -> None:
    """The read filled its buffer, so the reader read again before sending what it held:
    that read finds nothing, and the held answers go out before it waits for more."""
    for _ in range(5):
        data, asked = padded([NOW, MISSING, NOW], MIN_READ)
        raw = Raw(server.address)
        try:
            raw.sock.settimeout(5)
            raw.send(data)
            frames = raw.frames(len(asked))
            assert [f.head.req_id for f in frames] == sorted(asked)
            for frame in frames:
                check(frame, frame.head.req_id, asked[frame.head.req_id])
        finally:
            raw.close()


def test_a_stream_that_ends_right_after_a_full_read_still_gets_the_held_answers(server: ThreadedServer) -> None:
    """The read that finds the end of the stream comes right after one that filled its
    buffer: the reader sends what it holds before it ends."""
    for _ in range(5):
        data, asked = padded([NOW, MISSING, None, NOW] * 20, MIN_READ + BURST_READ)
        raw = Raw(server.address)
        try:
            raw.sock.settimeout(5)
            raw.send(data)
            raw.sock.shutdown(socket.SHUT_WR)
            frames = raw.frames(len(asked))
            assert [f.head.req_id for f in frames] == sorted(asked)
            for frame in frames:
                check(frame, frame.head.req_id, asked[frame.head.req_id])
            assert raw.at_eof()
        finally:
            raw.close()


def test_held_answers_do_not_wait_behind_a_full_connection() -> None:
    """With every task slot of the connection taken by slow requests, the reader waits for
    one before it starts the next task: what it answered itself went out before."""
    server = ThreadedServer(NowOrTask(), SECRET)
    slow, asked = burst([SLOW] * MAX_IN_FLIGHT, first_id=2)
    quick, more = burst([NOW, MISSING, NOW, TASK], first_id=2 + MAX_IN_FLIGHT)
    asked.update(more)
    for pad in range(MIN_READ * 2):  # a first bad request, so that the quick ones come in one read
        bad = wire.encode_frame(m.GetAttr.MSG_ID, 1, {"ino": "x" * pad})
        if (len(bad) + len(slow)) % MIN_READ == 0:
            break
    asked[1] = None
    raw = Raw(server.address)
    try:
        raw.send(bad + slow + quick)
        frames = raw.frames(len(asked))
        for frame in frames:
            check(frame, frame.head.req_id, asked[frame.head.req_id])
        order = [f.head.req_id for f in frames]
        first_slow = min(order.index(req_id) for req_id, ino in asked.items() if ino is not None and kind(ino) == SLOW)
        answered_now = [req_id for req_id, ino in more.items() if kind(ino) != TASK]  # type: ignore[arg-type]
        assert all(order.index(req_id) < first_slow for req_id in answered_now), order
    finally:
        raw.close()
        server.stop()


def test_a_burst_with_errors_between_gets_every_answer_under_its_own_id(server: ThreadedServer) -> None:
    pattern = [NOW, NOW, MISSING, NOW, BUG, None, NOW, TASK, NOW, NOW, NOW, THREAD, NOW]
    data, asked = burst(pattern * 40)
    raw = Raw(server.address)
    try:
        raw.send(data)
        frames = raw.frames(len(asked))
        for frame in frames:
            check(frame, frame.head.req_id, asked[frame.head.req_id])
        assert sorted(f.head.req_id for f in frames) == sorted(asked)
        # Nothing more comes: one answer per request.
        raw.sock.settimeout(0.3)
        with pytest.raises(socket.timeout):
            raw.sock.recv(1)
    finally:
        raw.close()


def test_answers_made_at_once_precede_later_answers_from_a_task_or_the_thread(server: ThreadedServer) -> None:
    """An answer the reader made goes out before the request after it is handed to
    another sender, as if it had been written at once."""
    for other in (TASK, THREAD):
        data, asked = burst([NOW, MISSING, None, other] * 50)
        raw = Raw(server.address)
        try:
            raw.send(data)
            frames = raw.frames(len(asked))
            position = {f.head.req_id: i for i, f in enumerate(frames)}
            for req_id in asked:
                check(frames[position[req_id]], req_id, asked[req_id])
            for first in range(1, len(asked) + 1, 4):
                handed = first + 3  # the TASK or THREAD request after three the reader answered
                assert all(position[first + j] < position[handed] for j in range(3)), (other, first)
                # In stream order among themselves, as before.
                assert position[first] < position[first + 1] < position[first + 2]
        finally:
            raw.close()


def test_answers_past_the_small_send_size_and_past_the_frame_limit(server: ThreadedServer) -> None:
    data, asked = burst([NOW, HUGE, NOW, TOO_BIG, NOW, HUGE, HUGE, MISSING, NOW] * 10)
    raw = Raw(server.address)
    try:
        raw.send(data)
        frames = raw.frames(len(asked))
        assert [f.head.req_id for f in frames] == sorted(asked)  # all answered at once: stream order
        for frame in frames:
            check(frame, frame.head.req_id, asked[frame.head.req_id])
        raw.send(getattr_frame(10_000, 10_000_000))  # the connection goes on after a TOO_BIG answer
        check(raw.frames(1)[0], 10_000, 10_000_000)
    finally:
        raw.close()


def test_a_client_that_stops_reading_gets_every_answer_once_it_reads_again(server: ThreadedServer) -> None:
    """More answer bytes than the socket buffers hold: the reader's write is cut short and
    finishes in the loop while other senders (a task, the thread) queue behind it."""
    per = BIG + 200
    count = 2 * ((16 << 20) // per)  # ~32 MiB of answers: well past both sides' buffers (4 MiB each)
    data, asked = burst([HUGE, TASK, HUGE, THREAD, HUGE, NOW] * (count // 6))
    raw = Raw(server.address)
    try:
        raw.send(data)
        time.sleep(0.5)  # the server fills the buffers and waits
        frames = raw.frames(len(asked))
        for frame in frames:
            check(frame, frame.head.req_id, asked[frame.head.req_id])
        assert sorted(f.head.req_id for f in frames) == sorted(asked)
    finally:
        raw.close()


def test_a_half_closed_connection_gets_the_answers_still_held(server: ThreadedServer) -> None:
    data, asked = burst([NOW, MISSING, None, NOW, TASK, NOW] * 30)
    raw = Raw(server.address)
    try:
        raw.send(data)
        raw.sock.shutdown(socket.SHUT_WR)  # the end of the stream right behind the requests
        frames = raw.frames(len(asked))
        for frame in frames:
            check(frame, frame.head.req_id, asked[frame.head.req_id])
        assert sorted(f.head.req_id for f in frames) == sorted(asked)
        assert raw.at_eof()
    finally:
        raw.close()


def test_answers_made_before_a_broken_stream_still_go_out(server: ThreadedServer) -> None:
    data, asked = burst([NOW, MISSING, NOW, BUG] * 10)
    raw = Raw(server.address)
    try:
        raw.send(data + b"XX" + bytes(100))  # bad magic: the stream position is lost
        frames = raw.frames(len(asked))
        assert [f.head.req_id for f in frames] == sorted(asked)
        for frame in frames:
            check(frame, frame.head.req_id, asked[frame.head.req_id])
        assert raw.at_eof()  # then the server closes
    finally:
        raw.close()


def test_a_connection_reset_in_the_middle_of_a_burst_leaves_the_server_serving(server: ThreadedServer) -> None:
    for _ in range(5):
        data, _asked = burst([NOW, HUGE, TASK, THREAD, MISSING, None] * 100)
        raw = Raw(server.address)
        raw.send(data)
        raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        raw.close()  # a reset, with answers being written
    data, asked = burst([NOW, TASK, THREAD, MISSING] * 5)
    raw = Raw(server.address)
    try:
        raw.send(data)
        frames = raw.frames(len(asked))
        for frame in frames:
            check(frame, frame.head.req_id, asked[frame.head.req_id])
    finally:
        raw.close()


def test_concurrent_connections_each_get_their_own_answers(server: ThreadedServer) -> None:
    errors: list[BaseException] = []

    def one(seed: int) -> None:
        try:
            raw = Raw(server.address)
            try:
                for round_ in range(20):
                    kinds = [(seed + round_ + i) % 4 for i in range(30)]  # NOW, MISSING, BUG, TASK
                    data, asked = burst(kinds, first_id=1 + round_ * 100)
                    raw.send(data)
                    for frame in raw.frames(len(asked)):
                        check(frame, frame.head.req_id, asked.pop(frame.head.req_id))
                    assert not asked
            finally:
                raw.close()
        except BaseException as exc:  # noqa: BLE001 -- reported by the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[0]


def test_stopping_the_server_while_a_connection_waits_in_a_write_ends_it() -> None:
    """Stopping the server while a connection holds answers and waits ends it."""
    s = ThreadedServer(Answers(), SECRET)
    raw = Raw(s.address)
    try:
        data, asked = burst([HUGE] * 400)  # more than the buffers: the reader waits in a write
        raw.send(data)
        time.sleep(0.3)
        started = time.monotonic()
        s.stop()
        assert not s.thread.is_alive() and time.monotonic() - started < 5
    finally:
        raw.close()


def test_hold_and_flush() -> None:
    """``hold`` encodes at once (TOO_BIG raised, nothing held); ``flush`` sends what is held
    in one piece and empties it."""
    a, b = socket.socketpair()
    b.setblocking(False)

    async def main() -> None:
        machine = wire.ServerConnection(SECRET, "metadata")
        machine._authenticated = True  # answers need a completed handshake; none on a socket pair
        conn = ServerConn(trio.socket.from_stdlib_socket(a), None, machine)
        head = FrameHead(m.GetAttr.MSG_ID, 7, 0, {}, 0)
        n = conn.hold(head, {"ino": 7})
        assert n == conn.held > 0
        with pytest.raises(StripefsError) as too_big:
            conn.hold(head, {"fill": b"x" * (wire.MAX_HEADER + 1)})
        assert too_big.value.code == ErrorCode.TOO_BIG and conn.held == n
        conn.hold_error(FrameHead(m.GetAttr.MSG_ID, 8, 0, {}, 0), StripefsError(ErrorCode.NOT_FOUND, "gone"))
        total = conn.held
        await conn.flush()
        assert conn.held == 0
        got = b.recv(1 << 16)
        assert len(got) == total
        decoder = wire.FrameDecoder()
        decoder.feed(got)
        first, second = decoder.next_event(), decoder.next_event()
        assert isinstance(first, wire.Frame) and first.head.req_id == 7 and first.head.header == {"ino": 7}
        assert isinstance(second, wire.Frame) and second.head.req_id == 8 and second.head.is_error
        await conn.flush()  # nothing held: nothing sent
        with pytest.raises(BlockingIOError):
            b.recv(1)

    try:
        trio.run(main)
    finally:
        a.close()
        b.close()
