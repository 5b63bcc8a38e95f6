"""The transports and pools against an in-process trio server: answers from worker
threads, connection pools (moves, breakage, several per server, fork, close)."""

from __future__ import annotations

import os
from typing import Any, Iterator

import pytest
import trio

from stripefs.rpc import Connection, ConnectionPool, ServerConn, Service, ThreadReply, TrioConnection, TrioPool
from stripefs import wire
from stripefs.wire import ErrorCode, FrameHead, Message, StripefsError, messages as m

from .threaded import ThreadedServer, temp_file

SECRET = "test-secret"  # the cluster secret: what servers hold
CLIENT = wire.role_credential(SECRET, "client")  # what clients hold
DATA = bytes(range(256)) * 64  # 16 KiB


class EchoService(Service):
    """Ping; ReadChunk answered from a worker thread (offset picks how), as the storage server does."""

    role = "storage"

    def __init__(self, path: str):
        self.path = path

    async def handle(self, conn: ServerConn, head: FrameHead, msg: Message, payload: Any) -> None:
        if isinstance(msg, m.ReadChunk):
            await conn.reply_from_thread(head, self._read, msg)
        else:
            await conn.send(head, {"pong": True})

    def _read(self, reply: ThreadReply, msg: m.ReadChunk) -> None:
        if msg.offset == 1:
            raise StripefsError(ErrorCode.NOT_FOUND, "no such chunk")  # before sending: answered by the loop
        if msg.offset == 2:
            return  # a bug: never answered
        if msg.offset == 3:
            with open(self.path, "rb") as f:
                reply.send({"length": msg.length, "how": "file"}, file=(f.fileno(), msg.index, msg.length))
            return
        reply.send({"length": msg.length, "how": "buffer"}, payload=DATA[msg.index : msg.index + msg.length])


class Server(ThreadedServer):
    """The echo service on a trio server of its own thread; stop() cancels it."""

    def __init__(self, path: str):
        self.path = path
        super().__init__(EchoService(path), SECRET)


@pytest.fixture(scope="module")
def data_file() -> Iterator[str]:
    yield from temp_file(DATA)


@pytest.fixture
def server(data_file: str) -> Iterator[Server]:
    s = Server(data_file)
    yield s
    s.stop()


def read(offset: int, index: int = 0, length: int = 4096) -> m.ReadChunk:
    return m.ReadChunk(ino=1, index=index, offset=offset, length=length)


# -- answers from worker threads -----------------------------------------------------------


def test_reply_from_thread_with_buffer_and_file(server: Server) -> None:
    conn = Connection(server.address, CLIENT, os.urandom(16), expect_role="storage")
    try:
        dest = memoryview(bytearray(5000))
        reply = conn.call(read(0, index=7, length=5000), dest=dest)
        assert reply.header == {"length": 5000, "how": "buffer"} and reply.nbytes == 5000
        assert bytes(dest) == DATA[7:5007]
        reply = conn.call(read(3, index=100, length=4096))
        assert reply.header["how"] == "file" and reply.payload == DATA[100:4196]
        # Many answers from many threads on one connection: frames never interleave.
        futs = [conn.submit(read(i % 2 * 3, index=i, length=1000 + i)) for i in range(64)]
        for i, fut in enumerate(futs):
            assert fut.result(30).payload == DATA[i : i + 1000 + i]
    finally:
        conn.close()


def test_reply_from_thread_failures_are_answered(server: Server) -> None:
    conn = Connection(server.address, CLIENT, os.urandom(16))
    try:
        with pytest.raises(StripefsError) as exc:
            conn.call(read(1))
        assert exc.value.code == ErrorCode.NOT_FOUND
        with pytest.raises(StripefsError) as exc:  # a handler that forgot to answer gets EIO, not silence
            conn.call(read(2))
        assert exc.value.code == ErrorCode.IO
        assert conn.call(m.Ping()).header == {"pong": True}  # the connection is still good
    finally:
        conn.close()


def test_thread_reply_answers_once() -> None:
    from stripefs.wire import ServerConnection

    machine = ServerConnection(SECRET, "storage")
    machine._authenticated = True  # as after a handshake
    r, w = os.pipe()
    try:
        reply = ThreadReply(w, machine, FrameHead(3, 9, 0, {}, 0))
        reply.send({"a": 1}, payload=b"xyz")
        with pytest.raises(RuntimeError):
            reply.send_error(StripefsError(ErrorCode.IO, "again"))
        frame = os.read(r, 100)
        assert frame[8:16] == (9).to_bytes(8, "big") and frame.endswith(b"xyz") and not reply.torn
    finally:
        os.close(r)
        os.close(w)


def test_wrong_role_is_refused(server: Server) -> None:
    with pytest.raises(StripefsError) as exc:
        Connection(server.address, CLIENT, os.urandom(16), expect_role="metadata")
    assert exc.value.code == ErrorCode.PROTOCOL


# -- the blocking pool ---------------------------------------------------------------------


def test_pool_shares_per_server_connections_and_replaces_broken_ones(server: Server) -> None:
    pool = ConnectionPool(CLIENT, os.urandom(16), per_server=2, expect_role="storage")
    try:
        got = {id(pool.get(1, server.address)) for _ in range(6)}
        assert len(got) == 2  # round-robin over exactly per_server connections
        conn = pool.get(1, server.address)
        conn.close()
        assert conn.broken
        fresh = [pool.get(1, server.address) for _ in range(4)]
        assert all(not c.broken for c in fresh) and conn not in fresh
        assert fresh[0].call(m.Ping()).header == {"pong": True}
    finally:
        pool.close()
    assert all(c.broken for c in fresh)


def test_pool_follows_a_server_that_moved(server: Server, data_file: str) -> None:
    other = Server(data_file)  # the "restarted" server on another port
    pool = ConnectionPool(CLIENT, os.urandom(16))
    try:
        old = pool.get(5, server.address)
        new = pool.get(5, other.address)  # the routing table now says so
        assert new is not old and old.broken and new.address == other.address
        assert new.call(m.Ping()).header == {"pong": True}
    finally:
        pool.close()
        other.stop()


def test_pool_unreachable_server() -> None:
    pool = ConnectionPool(CLIENT, os.urandom(16))
    with pytest.raises(StripefsError) as exc:
        pool.get(1, ("127.0.0.1", 1))
    assert exc.value.code == ErrorCode.UNAVAILABLE


def test_forked_child_does_not_reuse_the_parents_sockets(server: Server) -> None:
    pool = ConnectionPool(CLIENT, os.urandom(16))
    parent = pool.get(1, server.address)
    pid = os.fork()
    if pid == 0:  # the child: a new connection; closing the pool must not touch the parent's
        try:
            child = pool.get(1, server.address)
            ok = child is not parent and child.call(m.Ping(), timeout=10).header == {"pong": True}
            pool.close()
            os._exit(0 if ok else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert pool.get(1, server.address) is parent and parent.call(m.Ping()).header == {"pong": True}
    pool.close()


# -- the trio pool -------------------------------------------------------------------------


def test_trio_pool_leases_keeps_and_drops(server: Server, data_file: str) -> None:
    other = Server(data_file)

    async def main() -> None:
        pool = TrioPool(CLIENT, keep=2)
        opened: list[TrioConnection] = []

        async def one() -> None:
            async with pool.connection(1, server.address) as conn:
                opened.append(conn)
                assert (await conn.call(m.Ping()))[0] == {"pong": True}
                await trio.sleep(0.05)  # hold it: the others need connections of their own

        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(one)
        assert len({id(c) for c in opened}) == 4  # concurrent callers each got one
        header, payload = await pool.call(1, server.address, read(0, index=3, length=10))
        assert payload == DATA[3:13]
        with pytest.raises(StripefsError) as exc:  # the server's error: the connection stays
            await pool.call(1, server.address, read(1))
        assert exc.value.code == ErrorCode.NOT_FOUND
        async with pool.connection(1, server.address) as conn:
            conn._fail()  # as after a timeout: broken, so not kept
            broken = conn
        async with pool.connection(1, server.address) as conn:
            assert conn is not broken
        header, _ = await pool.call(1, other.address, m.Ping())  # the server moved
        assert header == {"pong": True}
        pool.close()

    try:
        trio.run(main)
    finally:
        other.stop()
