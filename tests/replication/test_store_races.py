"""Chunk store races the fault harness found (issue 14): each replayed deterministically
by holding the chunk's lock while the racing operation runs."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import crc32c

from stripefs.storage import ChunkStore

CHUNK = 256 * 1024
BLOCK = 64 * 1024


def test_a_read_racing_a_copy_on_write_does_not_cache_the_old_header(tmp_path: Path) -> None:
    store = ChunkStore(str(tmp_path))
    a = os.urandom(CHUNK)
    store.write(1, 0, 0, memoryview(a), crc32c.crc32c(a), CHUNK, chain=1)
    lock = store._lock(1, 0)
    got: list[tuple] = []
    lock.acquire()
    try:
        reader = threading.Thread(target=lambda: got.append(store.open_read_checked(1, 0, 0, CHUNK)))
        reader.start()
        time.sleep(0.3)  # the reader waits for the chunk's lock
        b = os.urandom(4096)
        new = store._write_locked(1, 0, 0, memoryview(b), 1)  # an overwrite: copy-on-write, rename
    finally:
        lock.release()
    reader.join(10)
    fd = got[0][0]
    if fd >= 0:
        os.close(fd)
    assert store.stat(1, 0).version == new.version  # the cached header is the new file's
    c = os.urandom(100)
    store.write(1, 0, 2 * BLOCK, memoryview(c), crc32c.crc32c(c), CHUNK, chain=1)
    meta, data = store.read_whole(1, 0)  # every block still matches its checksum
    assert data == b + a[4096 : 2 * BLOCK] + c + a[2 * BLOCK + 100 :]
    assert meta.version == new.version + 1


def test_a_chunk_is_dirty_from_the_moment_its_local_write_lands(tmp_path: Path) -> None:
    """CRAQ: a head (or middle) replica's bytes are readable here as soon as its worker
    thread wrote them; the chunk must already be ``dirty`` then (reads of a dirty chunk go
    to the tail), not only once the forward starts: the chain may never apply this
    version. Here the successor is unreachable, so the write fails and stays dirty."""
    import socket

    import pytest
    import trio

    from stripefs import wire
    from stripefs.storage._replication import Replicator
    from stripefs.wire import StripefsError
    from stripefs.wire import messages as m

    with socket.socket() as probe:  # a port nobody listens on: the successor is down
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    store = ChunkStore(str(tmp_path))
    repl = Replicator(store, "secret", None)  # type: ignore[arg-type]  # no metadata calls here
    repl.server_id = 1
    repl.routing = wire.Routing(1, {1: (1, 2)},
                                {1: wire.ServerInfo(1, "127.0.0.1", 1), 2: wire.ServerInfo(2, "127.0.0.1", dead_port)},
                                {1: ((1, "serving"), (2, "serving"))}, 2)
    seen: list[bool] = []
    real_write = store.write

    def write_and_look(*args):  # type: ignore[no-untyped-def]
        meta = real_write(*args)
        seen.append((args[0], args[1]) in repl.dirty)  # the bytes are on disk here now
        return meta

    store.write = write_and_look  # type: ignore[method-assign]
    data = os.urandom(4096)

    async def main() -> None:
        msg = m.WriteChunk(ino=5, index=0, offset=0, crc=crc32c.crc32c(data), chunk_size=CHUNK, chain=1,
                           routing_version=1)
        with pytest.raises(StripefsError):
            await repl.write(msg, memoryview(data))

    trio.run(main)
    assert seen == [True], "the chunk was readable here as clean while its forward had not started"
    assert (5, 0) in repl.dirty  # the failed forward leaves it dirty
