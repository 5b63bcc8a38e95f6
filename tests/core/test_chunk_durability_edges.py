"""Two edges of the chunk store's durability protocol, each from the order of its calls:
a gap written over bytes a crash left past the header's length, and the ``chunks/``
directory entry of an inode whose first two chunks are written at once."""

from __future__ import annotations

import os
import threading

import crc32c

from stripefs.storage import HEADER_SIZE, ChunkStore

CS = 4 << 20


def write(store: ChunkStore, ino: int, index: int, offset: int, data: bytes):
    return store.write(ino, index, offset, memoryview(data), crc32c.crc32c(data), CS)


def test_a_gap_over_a_crashed_writes_tail_reads_as_zeros(tmp_path) -> None:
    """An append killed between its data and its header (or a truncate killed between
    its header and its cut) leaves bytes past the header's length. A later write that
    leaves a gap must not make them file data: the gap reads as zeros, CRCs intact."""
    s = ChunkStore(str(tmp_path))
    write(s, 3, 0, 0, b"\x01" * 10_000)
    with open(s.path(3, 0), "r+b") as f:  # what the killed append left on disk
        f.seek(HEADER_SIZE + 10_000)
        f.write(b"\xee" * 30_000)
    s2 = ChunkStore(str(tmp_path))  # the restarted server
    write(s2, 3, 0, 20_000, b"\x11" * 4096)
    meta, data = s2.read_whole(3, 0)  # verified against the stored CRCs
    assert meta.length == 24_096
    assert data[:10_000] == b"\x01" * 10_000
    assert data[10_000:20_000] == bytes(10_000), "stale bytes of an unacknowledged write became file data"
    assert data[20_000:] == b"\x11" * 4096
    meta, data = ChunkStore(str(tmp_path)).read_whole(3, 0)  # and after another restart
    assert data[10_000:20_000] == bytes(10_000)


def test_every_first_chunk_of_an_inode_waits_for_its_directory_entry(tmp_path) -> None:
    """Two first writes to chunks 0 and 1 of one inode at once: the one that did not make
    the inode's directory must not be acknowledged before ``chunks/`` (which holds the
    directory's entry) was fsynced. Here the maker is held inside that fsync."""
    s = ChunkStore(str(tmp_path))
    real = ChunkStore._fsync_dir
    held, release = threading.Event(), threading.Event()
    done: list[str] = []  # directories whose fsync completed, in order
    first = [True]

    def fsync_dir(path: str) -> None:
        if path == s.chunk_root and first[0]:
            first[0] = False
            held.set()
            release.wait(10)  # the maker, stuck in the fsync that makes the entry durable
        real(path)
        done.append(path)

    s._fsync_dir = fsync_dir  # type: ignore[method-assign]
    maker = threading.Thread(target=write, args=(s, 9, 0, 0, b"a" * 4096))
    maker.start()
    try:
        assert held.wait(10)
        write(s, 9, 1, 0, b"b" * 4096)  # the other first chunk, acknowledged here
        assert s.chunk_root in done, "acknowledged while the inode directory's entry may not be on disk"
    finally:
        release.set()
        maker.join(10)
    assert os.path.exists(s.path(9, 0)) and os.path.exists(s.path(9, 1))
