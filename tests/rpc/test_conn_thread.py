"""A connection's own reply thread (``ServerConn.reply_in_thread``): no trio worker thread
per request, frames of the thread and of trio tasks never interleave, errors are answered,
and the thread ends with its connection."""

from __future__ import annotations

import errno
import os
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import trio

from stripefs import wire
from stripefs.rpc import Connection, ServerConn, Service, ThreadReply
from stripefs.wire import ErrorCode, FrameHead, Message, StripefsError
from stripefs.wire import messages as m

from .threaded import ThreadedServer, temp_file

SECRET = "test-secret"
CLIENT = wire.role_credential(SECRET, "client")
DATA = os.urandom(1 << 20)

# ReadChunk.ino picks what the server does
THREAD_BUF, THREAD_FILE, TRIO_SEND, FAIL_TYPED, FAIL_OS, FORGET, TEAR, SLOW, NOW_RAISES = range(1, 10)


class ThreadService(Service):
    """ReadChunk of DATA[offset:offset+length], answered as ``ino`` says; with ``now``,
    thread jobs are handed over by ``handle_now`` on the reader (no task), as the storage
    server does."""

    role = "storage"

    def __init__(self, path: str, now: bool):
        self.path = path
        self.now = now
        self.handled = 0  # requests that went through handle()

    def handle_now(self, conn: ServerConn, head: FrameHead, msg: Message) -> bool:
        if not self.now or not isinstance(msg, m.ReadChunk) or msg.ino == TRIO_SEND:
            return False
        if msg.ino == NOW_RAISES:
            raise RuntimeError("handle() takes over")
        return conn.try_reply_in_thread(head, self._job, msg)

    async def handle(self, conn: ServerConn, head: FrameHead, msg: Message, payload: Any) -> None:
        assert isinstance(msg, m.ReadChunk)
        self.handled += 1
        if msg.ino == NOW_RAISES:
            await conn.send(head, {"from": "handle"})
        elif msg.ino == TRIO_SEND:  # a frame from the trio side, in between the thread's frames
            await conn.send(head, {"from": "trio"}, payload=DATA[msg.offset : msg.offset + msg.length])
        else:
            await conn.reply_in_thread(head, self._job, msg)

    def _job(self, reply: ThreadReply, msg: m.ReadChunk) -> None:
        assert threading.current_thread().name.startswith("stripefs-conn-")
        if msg.ino == FAIL_TYPED:
            raise StripefsError(ErrorCode.NOT_FOUND, "no such chunk")
        if msg.ino == FAIL_OS:
            raise FileNotFoundError(errno.ENOENT, "gone")
        if msg.ino == FORGET:
            return
        if msg.ino == SLOW:
            time.sleep(msg.index / 1000)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            if msg.ino == TEAR:  # the file is shorter than announced: the frame stops short
                reply.send({"from": "thread"}, file=(fd, len(DATA) - 10, 100))
            elif msg.ino == THREAD_FILE:
                reply.send({"from": "thread"}, file=(fd, msg.offset, msg.length))
            else:
                reply.send({"from": "thread"}, payload=os.pread(fd, msg.length, msg.offset))
        finally:
            os.close(fd)


async def _starve() -> None:
    limiter = trio.to_thread.current_default_thread_limiter()
    for i in range(int(limiter.total_tokens)):
        await limiter.acquire_on_behalf_of(("starved", i))


class Server(ThreadedServer):
    """The service on a trio run of its own; ``starve`` holds every token of trio's default
    thread limiter, so anything that goes through ``trio.to_thread`` waits forever."""

    def __init__(self, path: str, *, starve: bool = False, now: bool = False):
        super().__init__(ThreadService(path, now), SECRET, before=_starve if starve else None)


@pytest.fixture(scope="module")
def data_file() -> Iterator[str]:
    yield from temp_file(DATA)


@pytest.fixture(params=[False, True], ids=["task", "now"])
def server(data_file: str, request: pytest.FixtureRequest) -> Iterator[Server]:
    s = Server(data_file, now=request.param)
    yield s
    s.stop()


def conn_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("stripefs-conn-")]


def wait_until(cond: Any, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def read(ino: int, offset: int = 0, length: int = 4096, index: int = 0) -> m.ReadChunk:
    return m.ReadChunk(ino=ino, index=index, offset=offset, length=length)


@pytest.mark.parametrize("now", [False, True], ids=["task", "now"])
def test_replies_need_no_trio_worker_thread(data_file: str, now: bool) -> None:
    server = Server(data_file, starve=True, now=now)
    conn = Connection(server.address, CLIENT, os.urandom(16), expect_role="storage")
    try:
        futs = [(i, conn.submit(read(THREAD_BUF if i % 2 else THREAD_FILE, offset=i * 4096)))
                for i in range(200)]
        for i, fut in futs:
            assert fut.result(10).payload == DATA[i * 4096 : i * 4096 + 4096]
        assert len(conn_threads()) >= 1
        if now:  # only those that found the queue full (64 waiting) went through a task: at
            # least the first 64 were handed over at once, more when the thread drained some
            assert server.service.handled <= 200 - 64
    finally:
        conn.close()
        server.stop()


def test_thread_and_trio_frames_never_interleave(server: Server) -> None:
    rng = random.Random(7)
    conn = Connection(server.address, CLIENT, os.urandom(16), expect_role="storage")
    try:
        for _ in range(3):
            asked = []
            for _ in range(150):
                ino = rng.choice((THREAD_BUF, THREAD_FILE, TRIO_SEND))
                # trio sends cover its three paths: one write, two writes, a worker thread
                length = rng.choice((1, 4096, 20_000, 300_000 if ino == TRIO_SEND else 200_000))
                offset = rng.randrange(0, len(DATA) - length)
                asked.append((ino, offset, length, conn.submit(read(ino, offset, length))))
            for ino, offset, length, fut in asked:
                reply = fut.result(30)
                assert reply.header["from"] == ("trio" if ino == TRIO_SEND else "thread")
                assert reply.payload == DATA[offset : offset + length]
    finally:
        conn.close()


def test_failures_in_the_thread_are_answered(server: Server) -> None:
    conn = Connection(server.address, CLIENT, os.urandom(16), expect_role="storage")
    try:
        for ino, code in ((FAIL_TYPED, ErrorCode.NOT_FOUND), (FAIL_OS, ErrorCode.NOT_FOUND), (FORGET, ErrorCode.IO)):
            with pytest.raises(StripefsError) as exc:
                conn.call(read(ino), timeout=10)
            assert exc.value.code == code
        assert conn.call(read(NOW_RAISES), timeout=10).header == {"from": "handle"}  # handle_now failed: handle() serves
        assert conn.call(read(THREAD_BUF, 8192), timeout=10).payload == DATA[8192:12288]  # still good
    finally:
        conn.close()


def test_a_frame_cut_short_in_the_thread_ends_the_connection(server: Server) -> None:
    before = len(conn_threads())
    conn = Connection(server.address, CLIENT, os.urandom(16), expect_role="storage")
    try:
        assert conn.call(read(THREAD_BUF), timeout=10).payload == DATA[:4096]
        with pytest.raises(StripefsError) as exc:
            conn.call(read(TEAR), timeout=10)
        assert exc.value.code in (ErrorCode.UNAVAILABLE, ErrorCode.IO)
        assert conn.broken
    finally:
        conn.close()
    assert wait_until(lambda: len(conn_threads()) <= before, 5), "the reply thread outlived its connection"
    fresh = Connection(server.address, CLIENT, os.urandom(16), expect_role="storage")
    try:  # the server goes on serving
        assert fresh.call(read(THREAD_FILE, 4096), timeout=10).payload == DATA[4096:8192]
    finally:
        fresh.close()


def test_the_thread_ends_when_its_busy_connection_closes(server: Server) -> None:
    before = len(conn_threads())
    conn = Connection(server.address, CLIENT, os.urandom(16), expect_role="storage")
    conn.call(read(THREAD_BUF), timeout=10)
    for _ in range(20):  # 20 x 50 ms of work queued behind each other
        conn.submit(read(SLOW, index=50))
    time.sleep(0.1)
    conn.close()
    # The peer ended the stream: what is queued is still tried (sends fail at once), then
    # the thread closes the descriptor and ends.
    assert wait_until(lambda: len(conn_threads()) <= before, 5), "the reply thread outlived its connection"


def test_server_cancelled_with_a_busy_thread_abandons_its_queue(data_file: str) -> None:
    before = len(conn_threads())
    server = Server(data_file)
    conn = Connection(server.address, CLIENT, os.urandom(16), expect_role="storage")
    try:
        conn.call(read(THREAD_BUF), timeout=10)
        for _ in range(50):  # 50 x 100 ms: far past the bound below
            conn.submit(read(SLOW, index=100))
        time.sleep(0.05)
        t0 = time.monotonic()
        server.stop()
        assert wait_until(lambda: len(conn_threads()) <= before, 2), "queued jobs ran after the server stopped"
        assert time.monotonic() - t0 < 2
    finally:
        conn.close()
