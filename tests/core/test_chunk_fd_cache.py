"""Small reads keep chunk files open (a bounded descriptor cache of the chunk store): one
open per chunk, not per read, and never an old file's bytes after the chunk changed --
in place, by copy-on-write, by a replica's copy (rename over), truncated or removed."""

from __future__ import annotations

import os
import random

import crc32c
import pytest

from stripefs import wire
from stripefs.storage import BLOCK, ChunkStore, chunk_files
from stripefs.storage._chunks import FDS_PER_LOCK
from stripefs.storage._server import SMALL_READ
from stripefs.wire import ErrorCode, StripefsError

# The chunk-file engine's own layout (new small chunks in files, not container logs).
pytestmark = pytest.mark.usefixtures("file_engine")

CS = 1 << 20


def write(store: ChunkStore, ino: int, index: int, offset: int, data: bytes, chain: int = 0) -> None:
    store.write(ino, index, offset, memoryview(data), crc32c.crc32c(data), CS, chain)


def small_read(store: ChunkStore, ino: int, index: int, offset: int, length: int) -> bytes:
    """As the storage server's small reads: bytes in memory, checked against their segment CRCs."""
    fd, _off, n, data, _clen, crcs = store.open_read_checked(ino, index, offset, length, inline=SMALL_READ)
    assert fd == -1, "a small read leaves no descriptor to its caller"
    if n == 0:
        return b""
    assert data is not None and len(data) == n
    wire.check_segments(memoryview(data), offset, crcs)
    return data


def test_small_reads_open_a_chunk_once(tmp_path, monkeypatch) -> None:
    store = ChunkStore(str(tmp_path))
    data = os.urandom(3 * BLOCK + 100)
    write(store, 1, 0, 0, data)
    opened: list[str] = []
    real = os.open

    def counting(path, *args, **kw):  # the OS call, counted
        opened.append(path)
        return real(path, *args, **kw)

    monkeypatch.setattr(os, "open", counting)
    rng = random.Random(1)
    for _ in range(50):
        n = rng.choice((1, 4096, BLOCK, BLOCK + 10))
        off = rng.randrange(len(data) - n)
        assert small_read(store, 1, 0, off, n) == data[off : off + n]
    monkeypatch.undo()
    assert opened.count(store.path(1, 0)) == 1, opened


@pytest.mark.parametrize("change", ["append", "overwrite_cow", "replica_copy", "truncate", "remove", "forget",
                                    "drop_chain"])
def test_a_small_read_after_a_change_sees_the_change(tmp_path, change: str) -> None:
    store = ChunkStore(str(tmp_path))
    old = os.urandom(2 * BLOCK)
    write(store, 5, 0, 0, old, chain=7)
    assert small_read(store, 5, 0, 100, 4096) == old[100:4196]  # the descriptor is cached now
    new = bytearray(old)
    if change == "append":
        tail = os.urandom(5000)
        write(store, 5, 0, len(old), tail, chain=7)
        new += tail
    elif change == "overwrite_cow":  # over acknowledged bytes: a new file renamed over the old one
        patch = os.urandom(6000)
        write(store, 5, 0, 50, patch, chain=7)
        new[50:6050] = patch
    elif change == "replica_copy":  # what a resync installs: a whole new file renamed over
        new = bytearray(os.urandom(BLOCK + 3))
        store.replace(5, 0, 7, 10, bytes(new))
    elif change == "truncate":
        store.truncate(5, 0, 1000)
        del new[1000:]
    elif change == "remove":
        store.remove(5, 0)
        new = bytearray()
    elif change == "forget":
        store.remove(5, 0, forget=True)
        with pytest.raises(StripefsError) as info:
            small_read(store, 5, 0, 0, 4096)
        assert info.value.code == ErrorCode.STALE_FILE
        return
    elif change == "drop_chain":
        assert store.drop_chain(7) == 1
        new = bytearray()
    for off, n in ((0, 4096), (100, 4096), (BLOCK - 10, 20), (BLOCK, BLOCK), (0, SMALL_READ)):
        assert small_read(store, 5, 0, off, n) == bytes(new[off : off + n]), (change, off, n)


def test_the_descriptor_cache_is_bounded(tmp_path) -> None:
    store = ChunkStore(str(tmp_path))
    before = len(os.listdir("/proc/self/fd"))
    chunks = 256 * FDS_PER_LOCK + 300  # more than the cache holds
    for index in range(chunks):
        write(store, 8, index, 0, index.to_bytes(4, "big"))
    for index in range(chunks):
        assert small_read(store, 8, index, 0, 4) == index.to_bytes(4, "big")
    assert len(os.listdir("/proc/self/fd")) - before <= 256 * FDS_PER_LOCK
    store.close()
    assert len(os.listdir("/proc/self/fd")) <= before



def test_small_reads_see_chunks_a_repair_replaced_under_them(make_cluster) -> None:
    """A server that kept a file's chunk files open for small reads gets every copy damaged
    on disk and repaired by its scrub (a replica's copy renamed over each chunk): its small
    reads then return the repaired bytes, never a read of the old, damaged files."""
    from stripefs.storage import HEADER_SIZE
    from tests.conftest import TEST_CHUNK
    from stripefs.wire import messages as m

    h = make_cluster(servers=2, replicas=2)
    data = os.urandom(TEST_CHUNK * 2)
    with h.client() as c:
        c.write_bytes("/r", data)
        ino = c.stat("/r").ino
        chains = [p["chain"] for p in c.placement("/r")]
        victim = next(s.server_id for s in c.status().servers if s.port == h.data["servers"][0]["port"])

        def read_on_victim(index: int, offset: int, n: int) -> bytes:
            msg = m.ReadChunk(ino=ino, index=index, offset=offset, length=n, chain=chains[index],
                              routing_version=c._core.routing().version)
            return bytes(c._core.data_conn(victim).call(msg, timeout=20).payload)

        def check() -> None:
            for index in range(2):
                for off, n in ((0, 4096), (100, 1), (BLOCK - 10, 20), (BLOCK, BLOCK)):
                    start = index * TEST_CHUNK + off
                    assert read_on_victim(index, off, n) == data[start : start + n], (index, off, n)

        check()  # the victim keeps both chunk files open now
        for name in chunk_files(h.data["servers"][0]["root"], ino):  # a byte of every copy goes bad on disk
            with open(name, "r+b") as f:
                f.seek(HEADER_SIZE + 100)
                b = f.read(1)
                f.seek(HEADER_SIZE + 100)
                f.write(bytes([b[0] ^ 0xFF]))
        repaired = c.call_storage(victim, m.Scrub(repair=True))
        assert len(repaired.bad) == 2
        check()


def test_a_dropped_store_closes_its_descriptors(tmp_path) -> None:
    import gc

    before = len(os.listdir("/proc/self/fd"))
    store = ChunkStore(str(tmp_path))
    for index in range(20):
        write(store, 3, index, 0, b"x" * 100)
        assert small_read(store, 3, index, 0, 100) == b"x" * 100
    assert len(os.listdir("/proc/self/fd")) > before
    del store
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= before
