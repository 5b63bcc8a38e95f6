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
