"""Cold reads: random reads never look sequential, and POSIX reads can bypass the page cache."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Any

import pytest

from stripefs.bench._pattern import Pattern, file_id
from stripefs.bench._sessions import PosixSession
from stripefs.bench._workloads import ClientContext, PartResult, _random_reads

KiB = 1 << 10


class RecordingReader:
    """Serves pattern bytes and records every offset asked for."""

    def __init__(self, pattern: Pattern, fid: int):
        self.pattern, self.fid, self.offsets = pattern, fid, []

    def pread_into(self, view: memoryview, offset: int) -> int:
        self.offsets.append(offset)
        at = offset % self.pattern.block  # files repeat the block from their start
        block = self.pattern.stamped(self.fid, offset - at, self.pattern.block)
        view[:] = block[at:at + len(view)]
        return len(view)

    def close(self) -> None:
        pass


class Progress(list):
    def __init__(self) -> None:
        super().__init__([0])


@pytest.mark.parametrize("slots", [3, 4, 16])
def test_random_reads_never_continue_the_previous_read(slots: int) -> None:
    req = 4 * KiB
    pattern = Pattern(64 * KiB)
    fid = file_id("seq/c0")
    reader = RecordingReader(pattern, fid)
    ctx: Any = ClientContext(0, 1, None, Progress(), None, pattern)
    part = PartResult()
    _random_reads(reader, ctx, fid, slots * req, req, lambda p: p.ops >= 400, part)
    offs = reader.offsets
    # a read at 0 starts a sequential scan for a client's heuristics: never, given the room
    first = 1 if slots > 3 else 0
    assert len(offs) == 400 and set(offs) == {k * req for k in range(first, slots)}
    assert not [a for a, b in zip(offs, offs[1:]) if b == a + req]  # never sequential


def test_posix_direct_reads_bypass_the_page_cache(tmp_path: Path) -> None:
    s = PosixSession(str(tmp_path))
    data = os.urandom(64 * KiB)
    (tmp_path / "f").write_bytes(data)
    r: Any = s.open_read("f", direct=True)
    try:
        direct = bool(fcntl.fcntl(r.fd, fcntl.F_GETFL) & os.O_DIRECT)
        assert direct or r.evict  # O_DIRECT, or (where refused) eviction after every read
        import mmap

        buf = memoryview(mmap.mmap(-1, 64 * KiB))
        assert r.pread_into(buf, 0) == len(data) and bytes(buf) == data
    finally:
        r.close()
    plain: Any = s.open_read("f")
    try:
        assert not fcntl.fcntl(plain.fd, fcntl.F_GETFL) & os.O_DIRECT and not plain.evict
    finally:
        plain.close()
