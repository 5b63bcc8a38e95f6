"""A storage connection's own thread receives for itself once the connection has shown it
is a data connection (its first small read): small reads need neither trio's loop nor its
worker threads, every other request still goes to the trio side (payloads, budgets), and
the thread ends with its connection."""

from __future__ import annotations

import os
import random
import socket
import threading
import time
from collections.abc import Iterator

import crc32c
import pytest

from stripefs import wire
from stripefs.rpc import Connection
from stripefs.storage._chunks import ChunkStore
from stripefs.storage._replication import Replicator
from stripefs.storage._server import SMALL_READ, StorageService
from tests.conftest import TEST_CHUNK
from tests.rpc.threaded import ThreadedServer
from stripefs.wire import messages as m

SECRET = "secret"
INO = 9


class Storage:
    """An in-process storage service (no metadata service: chain 0 only) on a trio thread."""

    def __init__(self, root: str):
        self.store = ChunkStore(root)
        self.chunks = {index: os.urandom(TEST_CHUNK) for index in range(3)}
        for index, data in self.chunks.items():
            self.store.write(INO, index, 0, memoryview(data), crc32c.crc32c(data), TEST_CHUNK)
        self.server = ThreadedServer(StorageService(self.store, Replicator(self.store, SECRET, None)), SECRET)  # type: ignore[arg-type]

    def connect(self, role: str = "client") -> Connection:
        return Connection(self.server.address, wire.role_credential(SECRET, role), os.urandom(16),
                          expect_role="storage", role=role)


@pytest.fixture
def storage(tmp_path: str) -> Iterator[Storage]:
    s = Storage(str(tmp_path))
    yield s
    s.server.stop()


def conn_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("stripefs-conn-")]


def wait_until(cond, within: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return bool(cond())


def read(index: int, offset: int, length: int) -> m.ReadChunk:
    return m.ReadChunk(ino=INO, index=index, offset=offset, length=length)


def test_small_reads_are_served_while_the_loop_is_blocked(storage: Storage) -> None:
    conn = storage.connect()
    try:
        assert conn.call(read(0, 0, 4096), timeout=10).payload == storage.chunks[0][:4096]  # a data connection now
        blocked = threading.Event()

        def hold_loop() -> None:
            storage.server.run_sync(lambda: (blocked.set(), time.sleep(2)))

        holder = threading.Thread(target=hold_loop, daemon=True)
        holder.start()
        assert blocked.wait(5)
        t0 = time.monotonic()
        rng = random.Random(1)
        for _ in range(50):
            index, n = rng.randrange(3), rng.choice((1, 4096, 65536, SMALL_READ))
            off = rng.randrange(TEST_CHUNK - n + 1)
            assert conn.call(read(index, off, n), timeout=10).payload == storage.chunks[index][off : off + n]
        assert time.monotonic() - t0 < 1.0, "small reads waited for the trio loop"
        holder.join(10)
    finally:
        conn.close()


def test_reads_writes_and_other_requests_on_one_connection_stay_intact(storage: Storage) -> None:
    """Pipelined small reads, writes with payloads and stat requests on one connection:
    every answer is the right one, and every byte read is the bytes written."""
    conn = storage.connect("server")  # writes outside a chain come from servers only
    try:
        conn.call(read(0, 0, 1), timeout=10)
        rng = random.Random(2)
        expect = {index: bytearray(data) for index, data in storage.chunks.items()}
        asked = []
        for round_ in range(30):
            for _ in range(8):
                index, n = rng.randrange(3), rng.choice((1, 100, 4096, 65536))
                off = rng.randrange(TEST_CHUNK - n + 1)
                asked.append(("read", index, off, n, bytes(expect[index][off : off + n]),
                              conn.submit(read(index, off, n))))
            if round_ % 3 == 0:  # a write (payload on the stream), answered by a trio task
                index = 2
                off = rng.randrange(0, TEST_CHUNK - 65536)
                data = os.urandom(rng.choice((10, 4096, 65536)))
                for fut in [a[-1] for a in asked if a[0] == "read" and a[1] == index]:
                    fut.result(20)  # reads of the chunk being rewritten see one version or the other
                w = conn.call(m.WriteChunk(ino=INO, index=index, offset=off, crc=crc32c.crc32c(data),
                                           chunk_size=TEST_CHUNK), payload=data, timeout=20)
                assert w.header["length"] == TEST_CHUNK
                expect[index][off : off + len(data)] = data
            asked.append(("stat", 1, 0, 0, b"", conn.submit(m.StatChunk(ino=INO, index=1))))
        for kind, index, off, n, want, fut in asked:
            reply = fut.result(20)
            if kind == "read":
                assert reply.header["length"] == n and reply.payload == want
            else:
                assert reply.header["length"] == TEST_CHUNK
        for index in range(3):
            assert conn.call(read(index, 0, SMALL_READ), timeout=10).payload == bytes(expect[index])
    finally:
        conn.close()


@pytest.mark.parametrize("cut", ["between", "mid_frame", "reset"])
def test_a_peer_gone_mid_request_ends_the_receiving_thread(storage: Storage, cut: str) -> None:
    before = len(conn_threads())
    conn = storage.connect()
    try:
        assert conn.call(read(1, 10, 100), timeout=10).payload == storage.chunks[1][10:110]
        assert wait_until(lambda: len(conn_threads()) > before, 5)
        if cut == "mid_frame":
            conn.sock.sendall(wire.encode_prefix(m.ReadChunk.MSG_ID, 999, {"ino": INO})[:7])
        elif cut == "reset":  # RST instead of FIN
            conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    finally:
        conn.close()
    assert wait_until(lambda: len(conn_threads()) <= before, 5), "the receiving thread outlived its connection"
    fresh = storage.connect()  # the server goes on serving
    try:
        assert fresh.call(read(2, 0, 4096), timeout=10).payload == storage.chunks[2][:4096]
    finally:
        fresh.close()


def test_server_stopped_while_the_thread_receives(tmp_path: str) -> None:
    before = len(conn_threads())
    storage = Storage(str(tmp_path))
    conn = storage.connect()
    try:
        conn.call(read(0, 0, 4096), timeout=10)
        t0 = time.monotonic()
        storage.server.stop()
        assert wait_until(lambda: len(conn_threads()) <= before, 2), "the receiving thread outlived its server"
        assert time.monotonic() - t0 < 2
    finally:
        conn.close()
