"""Small reads (answered by each storage connection's reply thread) mixed with writes and
large reads on the same pooled connections: every answer holds exactly its bytes."""

from __future__ import annotations

import os
import random
import threading

from stripefs.fsclient import Client
from tests.conftest import TEST_CHUNK


def test_small_reads_among_writes_and_large_reads_on_shared_connections(client: Client, testdir: str) -> None:
    data = os.urandom(TEST_CHUNK * 8)  # over every server of the shared cluster
    path = f"{testdir}/read.bin"
    with client.open(path, "wb") as f:
        f.write(data)
    errors: list[BaseException] = []

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        try:
            with client.open(path, "rb") as f:
                for _ in range(150):
                    n = rng.choice((1, 100, 4096, 4096, 65536, TEST_CHUNK + 4096))  # small, and split large
                    off = rng.randrange(len(data) - n)
                    assert f.pread(n, off) == data[off : off + n]
        except BaseException as exc:  # noqa: BLE001 -- reported by the main thread
            errors.append(exc)

    def writer(seed: int) -> None:
        rng = random.Random(seed)
        mine = f"{testdir}/w{seed}.bin"
        expect = bytearray()
        try:
            with client.open(mine, "wb") as f:
                for _ in range(20):
                    piece = rng.randbytes(rng.choice((512, 65536, 200_000)))
                    f.write(piece)
                    expect += piece
            with client.open(mine, "rb") as f:
                assert f.read() == bytes(expect)
        except BaseException as exc:  # noqa: BLE001 -- reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
    threads += [threading.Thread(target=writer, args=(100 + i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors[0]


def test_storage_small_reads_need_no_trio_worker_thread(tmp_path) -> None:
    """An in-process storage server whose trio thread limiter is held at 0 tokens: small
    reads still complete (none goes through ``trio.to_thread``), bytes verified."""
    import crc32c
    import trio

    from stripefs import wire
    from stripefs.rpc import Connection, serve_rpc
    from stripefs.storage._chunks import ChunkStore
    from stripefs.storage._replication import Replicator
    from stripefs.storage._server import SMALL_READ, StorageService
    from stripefs.wire import messages as m

    store = ChunkStore(str(tmp_path))
    chunks = {index: os.urandom(TEST_CHUNK) for index in range(3)}
    for index, data in chunks.items():
        store.write(9, index, 0, memoryview(data), crc32c.crc32c(data), TEST_CHUNK)
    service = StorageService(store, Replicator(store, "secret", None))  # type: ignore[arg-type]
    ready = threading.Event()
    holder: dict = {}

    async def main() -> None:
        holder["token"] = trio.lowlevel.current_trio_token()
        limiter = trio.to_thread.current_default_thread_limiter()
        for i in range(int(limiter.total_tokens)):
            await limiter.acquire_on_behalf_of(("starved", i))
        with trio.CancelScope() as holder["scope"]:
            async with trio.open_nursery() as nursery:
                holder["address"] = await nursery.start(lambda task_status: serve_rpc(
                    service, "127.0.0.1", 0, secret="secret", task_status=task_status))
                ready.set()

    server = threading.Thread(target=trio.run, args=(main,), daemon=True)
    server.start()
    assert ready.wait(10)
    conn = Connection(holder["address"], wire.role_credential("secret", "client"), os.urandom(16),
                      expect_role="storage")
    try:
        rng = random.Random(3)
        asked = []
        for _ in range(300):
            index = rng.randrange(3)
            n = rng.choice((1, 4096, 65536, SMALL_READ))
            off = rng.randrange(TEST_CHUNK - n + 1)
            asked.append((index, off, n, conn.submit(m.ReadChunk(ino=9, index=index, offset=off, length=n))))
        for index, off, n, fut in asked:
            reply = fut.result(20)
            assert reply.header["length"] == n and reply.payload == chunks[index][off : off + n]
    finally:
        conn.close()
        trio.from_thread.run_sync(holder["scope"].cancel, trio_token=holder["token"])
        server.join(10)
