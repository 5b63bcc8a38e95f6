"""Two edges of the chunk store's durability protocol, each from the order of its calls:
a gap written over bytes a crash left past the header's length, and the ``chunks/``
directory entry of an inode whose first two chunks are written at once."""

from __future__ import annotations

import os
import threading

import crc32c
import pytest

from stripefs.storage import HEADER_SIZE, ChunkStore

# The chunk-file engine's own layout (new small chunks in files, not container logs).
pytestmark = pytest.mark.usefixtures("file_engine")

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


def test_every_first_chunk_of_a_bucket_waits_for_its_directory_entry(tmp_path) -> None:
    """Two first writes to chunks 0 and 1 of one inode (one bucket) at once: the one that
    did not make the bucket's directory must not be acknowledged before ``chunks/`` (which
    holds the directory's entry) was fsynced. Here the maker is held inside that fsync."""
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
        assert s.chunk_root in done, "acknowledged while the bucket directory's entry may not be on disk"
    finally:
        release.set()
        maker.join(10)
    assert os.path.exists(s.path(9, 0)) and os.path.exists(s.path(9, 1))


def test_data_sync_none_acknowledges_from_the_page_cache(tmp_path, monkeypatch) -> None:
    """``--data-sync none`` (MooseFS's default): no fdatasync and no directory fsync at all,
    yet the same bytes and checksums; ``full`` syncs every new chunk."""
    syncs: list[str] = []
    monkeypatch.setattr(os, "fdatasync", lambda fd: syncs.append("data"))
    monkeypatch.setattr(os, "fsync", lambda fd: syncs.append("dir"))
    loose = ChunkStore(str(tmp_path / "none"), sync=False)
    write(loose, 1, 0, 0, b"x" * 100_000)
    write(loose, 1, 0, 100_000, b"y" * 5)  # an append into a partial block
    write(loose, 1, 0, 10, b"z" * 10)  # an overwrite: copy-on-write
    loose.truncate(1, 0, 50_000)
    assert syncs == []
    meta, data = ChunkStore(str(tmp_path / "none")).read_whole(1, 0)
    assert data == b"x" * 10 + b"z" * 10 + b"x" * 49_980 and meta.length == 50_000
    strict = ChunkStore(str(tmp_path / "full"))
    write(strict, 1, 0, 0, b"x" * 100)
    assert "data" in syncs and "dir" in syncs


def test_a_cluster_started_with_data_sync_none_says_so_and_serves(make_cluster) -> None:
    h = make_cluster(servers=1, data_sync="none")
    assert h.data["data_sync"] == "none"
    with h.client() as c:
        pid = c.status().servers[0].pid
        c.write_bytes("/f", b"page cache")
        assert c.read_bytes("/f") == b"page cache"
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        assert b"--data-sync\x00none" in f.read()
