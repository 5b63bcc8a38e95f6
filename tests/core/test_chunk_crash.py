"""Power loss in the middle of a chunk write or truncate: acknowledged bytes stay readable.

A model of a crash, not a real one: the chunk store's file system calls during one
operation are recorded (``pwrite``, ``ftruncate``, ``fdatasync``/``fsync``). A crash
after any prefix of them keeps everything issued before the last completed sync
and, of what came after it, any subset (the kernel writes dirty pages back in no
particular order). Every such outcome is rebuilt from a copy of the chunk file
taken before the operation, and a fresh store must read the bytes acknowledged
before the operation back, with their checksums passing.
"""

from __future__ import annotations

import itertools
import os
import shutil
from typing import Any, Callable, Iterator

import crc32c
import pytest

from stripefs.storage import BLOCK, ChunkStore
from stripefs.storage._chunks import BUCKET_GROUP, BUCKETS
from stripefs.wire import StripefsError

# The chunk-file engine's own layout (new small chunks in files, not container logs).
pytestmark = pytest.mark.usefixtures("file_engine")

CS = 4 << 20
INO = 0x5EED


def _write(store: ChunkStore, offset: int, data: bytes) -> None:
    store.write(INO, 0, offset, memoryview(data), crc32c.crc32c(data), CS)


def _read(store: ChunkStore, length: int) -> bytes:
    fd, off, n, data, _ = store.open_read(INO, 0, 0, length)
    if data is not None:
        return data
    try:
        return os.pread(fd, n, off)
    finally:
        os.close(fd)


class Recorder:
    """Records the chunk file's writes, truncations and syncs during one operation."""

    def __init__(self, path: str, monkeypatch: pytest.MonkeyPatch):
        self.path = os.path.realpath(path)
        self.log: list[tuple[Any, ...]] = []
        self._mp = monkeypatch
        self._real = {name: getattr(os, name) for name in ("pwrite", "ftruncate", "fdatasync", "fsync")}

    def _ours(self, fd: int) -> bool:
        try:
            return os.readlink(f"/proc/self/fd/{fd}") == self.path
        except OSError:
            return False

    def __enter__(self) -> "Recorder":
        real = self._real

        def pwrite(fd: int, data: Any, offset: int) -> int:
            if self._ours(fd):
                self.log.append(("pwrite", offset, bytes(data)))
            return real["pwrite"](fd, data, offset)

        def ftruncate(fd: int, length: int) -> None:
            if self._ours(fd):
                self.log.append(("ftruncate", length))
            real["ftruncate"](fd, length)

        def sync(name: str) -> Callable[[int], None]:
            def run(fd: int) -> None:
                real[name](fd)
                if self._ours(fd):
                    self.log.append(("sync",))
            return run

        self._mp.setattr(os, "pwrite", pwrite)
        self._mp.setattr(os, "ftruncate", ftruncate)
        self._mp.setattr(os, "fdatasync", sync("fdatasync"))
        self._mp.setattr(os, "fsync", sync("fsync"))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self._real.items():
            self._mp.setattr(os, name, fn)


def _outcomes(log: list[tuple[Any, ...]]) -> Iterator[tuple[int, list[tuple[Any, ...]]]]:
    """Every file state a crash can leave: ``(crash point, surviving operations in order)``."""
    for k in range(len(log) + 1):
        issued = log[:k]
        last_sync = max((i for i, op in enumerate(issued) if op[0] == "sync"), default=-1)
        durable = [op for op in issued[: last_sync + 1] if op[0] != "sync"]
        volatile = [op for op in issued[last_sync + 1 :] if op[0] != "sync"]
        for keep in itertools.product((False, True), repeat=len(volatile)):
            yield k, durable + [op for op, kept in zip(volatile, keep) if kept]


def _check_every_crash(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, acked: bytes,
                       operation: Callable[[ChunkStore], None], keep: int | None = None) -> int:
    """Run ``operation`` on a chunk holding ``acked``; in every crash outcome the first
    ``keep`` bytes (default: all) of ``acked`` must read back. Returns the outcome count."""
    keep = len(acked) if keep is None else keep
    root = str(tmp_path / "target")
    store = ChunkStore(root)
    _write(store, 0, acked)
    path = store.path(INO, 0)
    with open(path, "rb") as f:
        before = f.read()
    with Recorder(path, monkeypatch) as rec:
        operation(store)
    assert rec.log, "nothing recorded: the recorder does not see the store's calls"
    n = 0
    for k, ops in _outcomes(rec.log):
        crashed = str(tmp_path / f"crash-{n}")
        shutil.copytree(root, crashed)
        with open(os.path.join(crashed, os.path.relpath(path, root)), "r+b") as f:
            f.write(before)
            f.truncate(len(before))
            for op in ops:
                if op[0] == "pwrite":
                    f.seek(op[1])
                    f.write(op[2])
                else:
                    f.truncate(op[1])
        try:
            got = _read(ChunkStore(crashed), keep)
        except StripefsError as exc:
            pytest.fail(f"crash after {k} of {_summary(rec.log)}, surviving {_summary(ops)}: "
                        f"acknowledged bytes unreadable ({exc})")
        assert got == acked[:keep], f"crash after {k} of {_summary(rec.log)}, surviving {_summary(ops)}: bytes changed"
        shutil.rmtree(crashed)
        n += 1
    return n


def _summary(ops: list[tuple[Any, ...]]) -> str:
    return "[" + ", ".join(f"{op[0]}@{op[1]}" if len(op) > 1 else op[0] for op in ops) + "]"


def test_append_into_a_partly_filled_block(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The new bytes share a 64 KiB block (and so a CRC) with acknowledged ones."""
    acked = os.urandom(BLOCK // 2 + 123)
    assert _check_every_crash(tmp_path, monkeypatch, acked,
                              lambda s: _write(s, len(acked), os.urandom(BLOCK))) > 3


def test_write_past_a_hole_in_a_partly_filled_block(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    acked = os.urandom(1000)
    assert _check_every_crash(tmp_path, monkeypatch, acked, lambda s: _write(s, 5000, os.urandom(300))) > 3


def test_truncate_inside_a_block(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cutting a chunk inside a block changes that block's CRC; the bytes before the cut
    were acknowledged and must survive a crash at any point of the truncate."""
    data = os.urandom(2 * BLOCK + 500)
    keep = BLOCK + 777
    assert _check_every_crash(tmp_path, monkeypatch, data, lambda s: s.truncate(INO, 0, keep), keep=keep) > 2


def test_new_bucket_directory_is_synced_in_its_parent(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first chunk in a bucket creates ``chunks/<bucket>`` (with the other buckets of its
    group): the entry of that directory in ``chunks/`` must be made durable (fsync of
    ``chunks/``) before the write is acknowledged, not only the chunk file's entry in its
    bucket. Later chunks in the bucket or its group (of this inode or another) sync only
    their bucket; a restarted store syncs ``chunks/`` again at its first chunk in a group."""
    store = ChunkStore(str(tmp_path))
    synced: list[str] = []
    real = ChunkStore._fsync_dir
    monkeypatch.setattr(ChunkStore, "_fsync_dir", staticmethod(lambda p: (synced.append(os.path.realpath(p)), real(p))))
    _write(store, 0, b"first")
    assert os.path.realpath(store.chunk_root) in synced, f"chunks/ never synced: {synced}"
    assert os.path.realpath(os.path.dirname(store.path(INO, 0))) in synced
    synced.clear()
    neighbour = INO // BUCKET_GROUP * BUCKET_GROUP + (INO + 1) % BUCKET_GROUP  # another bucket of INO's group
    store.write(INO, 1, 0, memoryview(b"x"), crc32c.crc32c(b"x"), CS)  # the directory exists already
    store.write(INO + BUCKETS, 0, 0, memoryview(b"x"), crc32c.crc32c(b"x"), CS)  # another inode, same bucket
    store.write(neighbour, 0, 0, memoryview(b"x"), crc32c.crc32c(b"x"), CS)
    assert os.path.realpath(store.chunk_root) not in synced
    assert os.path.realpath(os.path.dirname(store.path(INO + BUCKETS, 0))) in synced
    assert os.path.realpath(os.path.dirname(store.path(neighbour, 0))) in synced
    synced.clear()
    again = ChunkStore(str(tmp_path))
    again.write(neighbour, 1, 0, memoryview(b"x"), crc32c.crc32c(b"x"), CS)
    assert os.path.realpath(store.chunk_root) in synced
