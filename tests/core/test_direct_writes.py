"""Bulk chunk writes go to the disk with O_DIRECT (storage/_chunks.py ``_write_data``):
the bytes land, verified by their CRCs, and bypass the page cache; anything direct I/O
cannot take (a misaligned buffer or offset, a file system without it, a store that does
not sync) is written through the page cache instead, with the same result."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import crc32c
import pytest

from stripefs.rpc import aligned
from stripefs.storage import HEADER_SIZE, ChunkStore
from stripefs.storage import _chunks, _qos

CS = 4 << 20
MIB = 1 << 20
_libc = ctypes.CDLL(None, use_errno=True)


def _payload(n: int, seed: int) -> mmap.mmap:
    """``n`` bytes in a page-aligned buffer, as a server receives a write's payload."""
    buf = aligned(n)
    buf[:] = (bytes(range(seed % 251, 256)) + bytes(range(seed % 251))) * (n // 256) + b"\x5a" * (n % 256)
    return buf


def _write(store: ChunkStore, ino: int, offset: int, data: memoryview | mmap.mmap) -> None:
    view = memoryview(data)
    store.write(ino, 0, offset, view, crc32c.crc32c(view), CS)


def _resident_pages(path: str, start: int, length: int) -> int:
    """How many pages of ``path``'s bytes [start, start + length) are in the page cache
    (``mincore`` of a mapping of the file; nothing is read)."""
    size = start + length
    _libc.mmap.restype = ctypes.c_void_p
    _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    fd = os.open(path, os.O_RDONLY)
    try:
        base = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    finally:
        os.close(fd)
    assert base not in (None, ctypes.c_void_p(-1).value)
    try:
        vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
        assert _libc.mincore(ctypes.c_void_p(base), ctypes.c_size_t(size), vec) == 0
        return sum(v & 1 for v in vec[start // mmap.PAGESIZE:])
    finally:
        _libc.munmap(ctypes.c_void_p(base), ctypes.c_size_t(size))


def _drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _direct_supported(path: Path) -> bool:
    try:
        fd = os.open(path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    os.unlink(path / "probe")
    return True


@pytest.fixture
def store(tmp_path: Path) -> ChunkStore:
    if not _chunks.DIRECT_IO or not _direct_supported(tmp_path):
        pytest.skip("no O_DIRECT on this file system (or STRIPEFS_DIRECT_IO=0)")
    return ChunkStore(str(tmp_path / "root"))


def test_a_bulk_write_bypasses_the_page_cache_and_reads_back_verified(store: ChunkStore) -> None:
    data = _payload(2 * MIB, 1)
    _write(store, 11, 0, data)
    assert store.direct_bytes == 2 * MIB
    path = store.path(11, 0)
    assert _resident_pages(path, HEADER_SIZE, 2 * MIB) == 0  # never copied into the page cache
    meta, back = store.read_whole(11, 0)  # type: ignore[misc]  # verifies every block's CRC
    assert meta.length == 2 * MIB and back == bytes(data)

    # A small write to the same chunk stays buffered (its pages are cached), and an
    # append at an aligned offset goes direct again; all of it reads back verified.
    small = os.urandom(5000)
    _write(store, 11, 2 * MIB, memoryview(small))
    assert store.direct_bytes == 2 * MIB
    more = _payload(MIB + 1234, 2)  # whole blocks direct, the 1,234-byte tail buffered
    at = 2 * MIB + 8192  # past a hole: the hole reads as zeros
    _write(store, 11, at, more)
    assert store.direct_bytes == 3 * MIB
    meta, back = store.read_whole(11, 0)  # type: ignore[misc]
    expect = bytes(data) + small + bytes(8192 - 5000) + bytes(more)
    assert meta.length == len(expect) and back == expect


def _flush_units(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Bytes written between two flushes, in order, from here on (``os.pwrite`` and
    ``os.fdatasync`` watched; the last entry: bytes written since the last flush)."""
    units = [0]
    real_pwrite, real_sync = os.pwrite, os.fdatasync

    def pwrite(fd: int, data: object, offset: int) -> int:
        n = real_pwrite(fd, data, offset)
        units[-1] += n
        return n

    def fdatasync(fd: int) -> None:
        real_sync(fd)
        units.append(0)

    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(os, "fdatasync", fdatasync)
    return units


@pytest.mark.parametrize("how", ["direct", "page cache", "resync copy"])
def test_a_bulk_write_reaches_the_disk_one_flushed_piece_at_a_time(store: ChunkStore, monkeypatch, how: str) -> None:
    # A flush holds every read of the disk for as long as what it covers takes to land:
    # a bulk write never leaves more than one piece (and the header) unflushed.
    units = _flush_units(monkeypatch)
    data = _payload(4 * MIB, 5)
    if how == "direct":
        _write(store, 15, 0, data)
        assert store.direct_bytes == 4 * MIB
    elif how == "page cache":  # a buffer off a page: refused by O_DIRECT
        raw = bytearray(4 * MIB + 1)
        raw[1:] = data
        _write(store, 15, 0, memoryview(raw)[1:])
        assert store.direct_bytes == 0
    else:
        store.replace(15, 0, 0, 1, bytes(data))
    assert max(units) <= _qos.BULK_PIECE + HEADER_SIZE
    assert len(units) > 4 * MIB // _qos.BULK_PIECE
    monkeypatch.undo()
    _drop_cache(store.path(15, 0))
    assert store.read_whole(15, 0)[1] == bytes(data)  # type: ignore[index]


def test_what_direct_io_cannot_take_goes_through_the_page_cache(store: ChunkStore) -> None:
    # A buffer one byte off a page: the kernel refuses it (EINVAL, nothing written).
    raw = bytearray(2 * MIB + 1)
    raw[1:] = os.urandom(2 * MIB)
    _write(store, 12, 0, memoryview(raw)[1:])
    assert store.direct_bytes == 0 and store.direct  # refused for this write only
    # An offset off a 4 KiB boundary.
    data = _payload(2 * MIB, 3)
    _write(store, 13, 1000, data)
    assert store.direct_bytes == 0
    _drop_cache(store.path(12, 0))
    assert store.read_whole(12, 0)[1] == bytes(raw[1:])  # type: ignore[index]
    assert store.read_whole(13, 0)[1] == bytes(1000) + bytes(data)  # type: ignore[index]


def test_a_store_that_does_not_sync_writes_through_the_page_cache(tmp_path: Path) -> None:
    s = ChunkStore(str(tmp_path), sync=False)
    data = _payload(2 * MIB, 4)
    _write(s, 14, 0, data)
    assert s.direct_bytes == 0 and not s.direct
    assert s.read_whole(14, 0)[1] == bytes(data)  # type: ignore[index]


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no tmpfs at /dev/shm")
def test_a_file_system_without_direct_io_is_written_through_the_page_cache(tmp_path: Path) -> None:
    root = Path("/dev/shm") / f"stripefs-direct-{os.getpid()}"
    if _direct_supported(Path("/dev/shm")):
        pytest.skip("/dev/shm takes O_DIRECT here")
    try:
        s = ChunkStore(str(root))
        for ino in (15, 16):
            data = _payload(2 * MIB, ino)
            _write(s, ino, 0, data)
            assert s.read_whole(ino, 0)[1] == bytes(data)  # type: ignore[index]
        assert s.direct_bytes == 0 and not s.direct  # refused once, not asked again
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
