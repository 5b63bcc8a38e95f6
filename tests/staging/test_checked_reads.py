"""``_checked.CheckedFile``, what the DCP reader reads a checkpoint's files through: any mix of
seeks and reads returns the stored bytes, and no byte of a chunk whose CRC32C fails reaches the
caller -- while the file's other chunks still read."""

from __future__ import annotations

import io
import random

import crc32c
import pytest

from stripefs.staging import ChecksumError
from stripefs.staging._checked import CheckedFile

CHUNK = 4096


def _file(data: bytes, *, bad: bytes | None = None, fallback: bytes | None = None) -> tuple[CheckedFile, list]:
    """A CheckedFile over ``bad`` (default ``data``) checked against ``data``'s chunk CRCs."""
    crcs = [crc32c.crc32c(data[a : a + CHUNK]) for a in range(0, len(data), CHUNK)]
    stored = memoryview(bad if bad is not None else data)
    reads: list = []

    def pread_into(src):
        def read(dest, off):
            n = max(0, min(len(dest), len(src) - off))
            dest[:n] = src[off : off + n]
            reads.append((off, n))
            return n
        return read

    fb = (lambda: pread_into(memoryview(fallback))) if fallback is not None else None
    return CheckedFile("f", {"size": len(data), "chunk": CHUNK, "chunk_crc32c": crcs}, pread_into(stored),
                       fallback=fb), reads


@pytest.mark.parametrize("size", [0, 1, CHUNK - 1, CHUNK, 5 * CHUNK + 17])
def test_any_mix_of_seeks_and_reads_returns_the_stored_bytes(size):
    rng = random.Random(size)
    data = rng.randbytes(size)
    f, _ = _file(data)
    assert f.read() == data
    for _ in range(300):
        pos = rng.randrange(size + 2)
        n = rng.choice([1, 7, CHUNK - 1, CHUNK, 2 * CHUNK + 3, 10 * CHUNK])
        f.seek(pos)
        got = f.read(n)  # one call, whole (torch's loader takes a short read for the end)
        assert got == data[pos : pos + n] and f.tell() == pos + len(got)
        f.seek(pos)
        buf = bytearray(n)
        assert f.readinto(buf) == len(got) and buf[: len(got)] == got
    if size >= 3:
        f.seek(-3, io.SEEK_END)
        assert f.read() == data[-3:]
    with pytest.raises(ValueError):
        f.seek(-1)


def test_whole_chunks_land_in_the_callers_buffer_in_one_read():
    data = random.Random(1).randbytes(8 * CHUNK)
    f, reads = _file(data)
    f.seek(2 * CHUNK)
    buf = bytearray(5 * CHUNK)
    assert f.readinto(buf) == 5 * CHUNK and bytes(buf) == data[2 * CHUNK : 7 * CHUNK]
    assert reads == [(2 * CHUNK, 5 * CHUNK)]


def test_a_bad_chunk_fails_only_its_own_reads():
    data = random.Random(2).randbytes(6 * CHUNK + 100)
    bad = bytearray(data)
    bad[3 * CHUNK + 50] ^= 1
    f, _ = _file(data, bad=bytes(bad))
    for pos, n in ((3 * CHUNK + 60, 1), (3 * CHUNK, 4 * CHUNK), (2 * CHUNK + 10, CHUNK)):
        f.seek(pos)
        with pytest.raises(ChecksumError, match="chunk 3"):
            f.read(n)
    f.seek(4 * CHUNK)
    assert f.read() == data[4 * CHUNK :]  # the chunks after it
    f.seek(0)
    assert f.read(3 * CHUNK) == data[: 3 * CHUNK]  # and before it


def test_a_bad_local_chunk_is_read_again_from_the_fallback():
    data = random.Random(3).randbytes(3 * CHUNK)
    bad = bytearray(data)
    bad[CHUNK + 1] ^= 1
    f, _ = _file(data, bad=bytes(bad), fallback=data)
    assert f.read() == data
    f, _ = _file(data, bad=bytes(bad), fallback=bytes(bad))  # the store is damaged too: an error
    with pytest.raises(ChecksumError):
        f.read()


def test_a_short_file_is_an_error():
    data = random.Random(4).randbytes(2 * CHUNK)
    f, _ = _file(data, bad=data[: CHUNK + 5])
    f.seek(CHUNK)
    with pytest.raises(ChecksumError, match="shorter"):
        f.read(10)


def test_reads_that_come_back_to_a_recent_chunk_do_not_read_it_again():
    """torch's loader parses a record from its start and its end before reading its bytes."""
    data = random.Random(5).randbytes(10 * CHUNK)
    f, reads = _file(data)
    for pos in (10, 9 * CHUNK + 5, 20, 9 * CHUNK + 50, 3 * CHUNK + 1, 30):
        f.seek(pos)
        assert f.read(7) == data[pos : pos + 7]
    assert reads == [(0, CHUNK), (9 * CHUNK, CHUNK), (3 * CHUNK, CHUNK)]


@pytest.mark.parametrize("start,n", [(0, 10 * CHUNK), (5, 10 * CHUNK - 5), (CHUNK - 1, 2), (CHUNK + 7, 7 * CHUNK),
                                     (3 * CHUNK, 4 * CHUNK), (2 * CHUNK + 1, CHUNK - 2), (9 * CHUNK + 3, CHUNK - 3)])
def test_a_split_read_returns_whole_chunks_for_other_threads(start, n):
    """read_split reads the partial chunks at either end and hands the whole chunks between
    out in pieces; read_checked fills them (in any order) and checks them."""
    data = random.Random(6).randbytes(10 * CHUNK)
    f, reads = _file(data)
    dest = bytearray(n)
    pieces = f.read_split(memoryview(dest), start, 2 * CHUNK)
    for view, at in reversed(pieces):
        assert at % CHUNK == 0 and len(view) <= 2 * CHUNK and (len(view) % CHUNK == 0 or at + len(view) == len(data))
        f.read_checked(view, at)
    assert bytes(dest) == data[start : start + n]
    assert sum(len(v) for v, _ in pieces) == len(range(-(-start // CHUNK) * CHUNK, (start + n) // CHUNK * CHUNK, 1))


def test_a_bad_chunk_in_a_split_read_fails_its_piece():
    data = random.Random(7).randbytes(8 * CHUNK)
    bad = bytearray(data)
    bad[4 * CHUNK + 9] ^= 1
    f, _ = _file(data, bad=bytes(bad))
    dest = bytearray(6 * CHUNK)
    pieces = f.read_split(memoryview(dest), CHUNK + 100, CHUNK)
    outcomes = []
    for view, at in pieces:
        try:
            f.read_checked(view, at)
            outcomes.append("ok")
        except ChecksumError as exc:
            outcomes.append(str(exc))
    assert [o == "ok" for o in outcomes] == [True, True, False, True, True] and "chunk 4" in outcomes[2]
    with pytest.raises(ChecksumError, match="shorter"):
        f.read_split(memoryview(bytearray(10)), 8 * CHUNK - 5, CHUNK)


def test_a_split_read_to_the_end_takes_the_short_last_chunk_whole():
    data = random.Random(8).randbytes(3 * CHUNK + 50)
    f, reads = _file(data)
    dest = bytearray(2 * CHUNK + 50)
    pieces = f.read_split(memoryview(dest), CHUNK, 4 * CHUNK)
    assert [(len(v), at) for v, at in pieces] == [(2 * CHUNK + 50, CHUNK)] and reads == []
    f.read_checked(*pieces[0])
    assert bytes(dest) == data[CHUNK:]
