"""Small chunks in container logs (storage/_small.py): every change of a small chunk is a
whole new record; a reopened store serves the latest acknowledged state of every chunk;
damage reads as damage, never as a hole or as older bytes; space comes back.

The crash model at the end replays every prefix of the logs' write/sync calls during a
sequence of operations, with any subset (per 512-byte sector) of the writes after the last
sync on disk, and asks a fresh store for every chunk.
"""

from __future__ import annotations

import os
import random
import shutil
import threading
from typing import Any

import crc32c
import pytest

from stripefs.storage import BLOCK, ChunkStore, _small, chunk_files, chunk_places
from stripefs.storage._small import ALIGN, GROW_MAX, SMALL_MAX
from stripefs.wire import ErrorCode, StripefsError

from ..conftest import flip_byte

CS = 4 << 20


def _store(root: Any, **kw: Any) -> ChunkStore:
    return ChunkStore(str(root), small=True, **kw)


def write(store: ChunkStore, ino: int, index: int, offset: int, data: bytes, version: int | None = None):
    return store.write(ino, index, offset, memoryview(data), crc32c.crc32c(data), CS, version=version)


def read(store: ChunkStore, ino: int, index: int, offset: int = 0, length: int = CS, inline: int = 0) -> bytes:
    fd, off, n, data, _clen, crcs = store.open_read_checked(ino, index, offset, length, inline=inline)
    if data is None and fd >= 0:
        try:
            data = os.pread(fd, n, off)
        finally:
            os.close(fd)
    data = data or b""
    if data:  # the segment CRCs sent with a read match the bytes sent
        from stripefs.wire import segments

        assert [crc32c.crc32c(data[s - offset : e - offset]) for s, e in segments(offset, n)] == crcs
    return data


def _logs(root: Any) -> list[str]:
    d = os.path.join(str(root), "small")
    return sorted(os.path.join(d, n) for n in os.listdir(d) if n.endswith(".log"))


def test_a_small_chunk_is_a_record_not_a_file(tmp_path) -> None:
    s = _store(tmp_path)
    data = os.urandom(3000)
    meta = write(s, 7, 0, 0, data)
    assert meta.version == 1 and meta.length == 3000
    assert chunk_files(str(tmp_path), 7) == []  # no chunk file, no bucket directory
    assert read(s, 7, 0) == data  # through a descriptor (sendfile path)
    assert read(s, 7, 0, 100, 50, inline=1 << 20) == data[100:150]  # inline
    assert s.stat(7, 0).length == 3000 and s.chunks == 1 and s.used == 3000
    assert read(_store(tmp_path), 7, 0) == data  # the reopened store finds it in the log


def test_changes_are_new_records_and_the_latest_survives_a_restart(tmp_path) -> None:
    s = _store(tmp_path)
    model = bytearray(os.urandom(BLOCK + 500))
    write(s, 9, 2, 0, bytes(model))
    for offset, n in [(10, 20), (BLOCK - 5, 10), (len(model), 700), (len(model) + 800 + 700, 30)]:
        piece = os.urandom(n)
        if offset > len(model):
            model.extend(bytes(offset - len(model)))
        model[offset : offset + n] = piece
        meta = write(s, 9, 2, offset, piece)
        assert meta.length == len(model)
        assert read(s, 9, 2) == bytes(model)
    assert meta.version == 5
    s.truncate(9, 2, 1000)
    assert read(s, 9, 2) == bytes(model[:1000]) and s.stat(9, 2).version == 6
    again = _store(tmp_path)
    assert read(again, 9, 2) == bytes(model[:1000]) and again.stat(9, 2).version == 6
    assert again.used == 1000 and again.chunks == 1


def test_a_chunk_that_outgrows_the_logs_moves_to_a_file(tmp_path) -> None:
    s = _store(tmp_path)
    head = os.urandom(SMALL_MAX - 100)
    write(s, 5, 0, 0, head)
    tail = os.urandom(5000)
    meta = write(s, 5, 0, len(head), tail)
    assert meta.version == 2 and meta.length == len(head) + len(tail)
    assert len(chunk_files(str(tmp_path), 5)) == 1  # a chunk file now
    assert read(s, 5, 0) == head + tail
    again = _store(tmp_path)  # the log's removal record keeps the old copy from coming back
    assert read(again, 5, 0) == head + tail and again.stat(5, 0).version == 2 and again.chunks == 1


def test_a_chunk_written_whole_stays_a_record_up_to_small_max(tmp_path) -> None:
    """A dataset's file of 64-256 KiB written in one piece (or rewritten from byte 0) is a
    record: read back with no chunk file to open."""
    s = _store(tmp_path)
    data = os.urandom(SMALL_MAX - 1000)
    write(s, 6, 0, 0, data)
    assert chunk_files(str(tmp_path), 6) == [] and read(s, 6, 0) == data
    longer = os.urandom(SMALL_MAX)
    assert write(s, 6, 0, 0, longer).length == SMALL_MAX  # rewritten from byte 0, longer
    assert chunk_files(str(tmp_path), 6) == []
    assert read(_store(tmp_path), 6, 0) == longer
    # A whole chunk of a file striped in chunks of that size is bulk data: a chunk file.
    whole = os.urandom(SMALL_MAX)
    s.write(6, 1, 0, memoryview(whole), crc32c.crc32c(whole), SMALL_MAX)
    assert len(chunk_files(str(tmp_path), 6)) == 1 and read(s, 6, 1) == whole


def test_a_chunk_grown_by_appends_moves_to_a_file_past_grow_max(tmp_path) -> None:
    """Each change rewrites a record whole: appends keep a chunk in the logs only up to
    GROW_MAX, so a chunk grown 4 KiB at a time costs the logs at most ~GROW_MAX^2 / 8 KiB."""
    s = _store(tmp_path)
    model = b""
    while len(model) <= GROW_MAX:
        in_logs = chunk_files(str(tmp_path), 8) == []
        assert in_logs, f"moved to a file at {len(model)} bytes"
        piece = os.urandom(4096)
        write(s, 8, 0, len(model), piece)
        model += piece
    assert len(chunk_files(str(tmp_path), 8)) == 1  # the append past GROW_MAX moved it
    logged = sum(os.path.getsize(p) for p in _logs(tmp_path))
    assert logged < GROW_MAX * GROW_MAX // 8192 + 64 * ALIGN * (GROW_MAX // 4096 + 2)
    assert read(s, 8, 0) == model and read(_store(tmp_path), 8, 0) == model


def test_logs_of_the_previous_format_are_read_and_left_for_a_new_one(tmp_path) -> None:
    """A version 1 log (records of at most 128 KiB) still reads; new records go to a new
    log of this version's format; a log of an unknown format stops the store at start."""
    s = _store(tmp_path)
    write(s, 4, 0, 0, b"one" * 1000)
    s.close()
    (old,) = _logs(tmp_path)
    with open(old, "r+b") as f:
        assert f.read(8) == _small.LOG_MAGIC
        f.seek(0)
        f.write(b"SFSLOG01")
    again = _store(tmp_path)
    assert read(again, 4, 0) == b"one" * 1000
    big = os.urandom(SMALL_MAX - 10)
    write(again, 4, 1, 0, big)
    logs = _logs(tmp_path)
    assert len(logs) == 2 and logs[0] == old
    with open(logs[1], "rb") as f:
        assert f.read(8) == _small.LOG_MAGIC
    third = _store(tmp_path)
    assert read(third, 4, 0) == b"one" * 1000 and read(third, 4, 1) == big
    with open(logs[1], "r+b") as f:
        f.write(b"SFSLOG09")
    with pytest.raises(StripefsError, match="not a stripefs container log"):
        _store(tmp_path)


def test_the_file_wins_when_a_move_was_cut_before_the_log_said_so(tmp_path, monkeypatch) -> None:
    """A crash between a promoted chunk's file (durable) and the log's removal record: the
    next start keeps the file (the newer copy) and records the old one gone."""
    s = _store(tmp_path)
    write(s, 5, 0, 0, b"a" * 100)
    assert s.small is not None
    monkeypatch.setattr(s.small, "kill", lambda keys, sync=True: None)  # the removal record never lands
    write(s, 5, 0, 100, b"b" * SMALL_MAX)
    monkeypatch.undo()
    again = _store(tmp_path)
    assert read(again, 5, 0) == b"a" * 100 + b"b" * SMALL_MAX and again.chunks == 1
    assert read(_store(tmp_path), 5, 0) == b"a" * 100 + b"b" * SMALL_MAX


def test_removed_chunks_stay_removed_after_a_restart(tmp_path) -> None:
    s = _store(tmp_path)
    for index in range(3):
        write(s, 11, index, 0, b"x" * 100)
    write(s, 12, 0, 0, b"y" * 100)
    assert s.remove(11, from_index=1) == 2  # a cut: synced removal records
    assert s.remove(12, forget=True) == 1  # a removed file: its tombstone says it
    again = _store(tmp_path)
    assert read(again, 11, 0) == b"x" * 100
    assert read(again, 11, 1) == b"" and read(again, 11, 2) == b""
    with pytest.raises(StripefsError) as err:
        read(again, 12, 0)
    assert err.value.code == ErrorCode.STALE_FILE
    assert again.chunks == 1 and again.used == 100
    with pytest.raises(StripefsError):  # a late write to the removed inode
        write(again, 12, 0, 0, b"z")


def test_replace_versions_and_expectations(tmp_path) -> None:
    s = _store(tmp_path)
    write(s, 3, 0, 0, b"old" * 10)
    assert s.replace(3, 0, 7, 1, b"older") .length == 30  # not newer: kept
    new = s.replace(3, 0, 7, 5, b"newer")
    assert new.version == 5 and read(s, 3, 0) == b"newer"
    cur = s.stat(3, 0)
    assert s.replace(3, 0, 7, 9, b"raced", expect=(4, 0)).version == 5  # expectation failed
    assert s.replace(3, 0, 7, 9, b"repair", expect=(cur.version, cur.digest)).version == 9
    big = os.urandom(SMALL_MAX + 1)
    assert s.replace(3, 0, 7, 10, big).length == len(big)  # too big for the logs: a file
    assert len(chunk_files(str(tmp_path), 3)) == 1
    again = _store(tmp_path)
    assert read(again, 3, 0) == big and again.stat(3, 0).version == 10
    assert again.chunks_by_chain()[7] == [(3, 0, 10, len(big), again.stat(3, 0).digest)]


def test_a_copy_lives_where_the_sources_does(tmp_path) -> None:
    """A resync's copy goes to the logs when its source holds it there (``logged``), to a
    file when the source holds a file; from a source that does not say, to the logs up to
    GROW_MAX only (a whole chunk of a striped file must not land there)."""
    s = _store(tmp_path)
    sample, small = os.urandom(SMALL_MAX - 10), os.urandom(1000)
    copies = {30: (sample, True), 31: (small, False), 32: (sample, None), 33: (small, None),
              34: (os.urandom(SMALL_MAX + 1), True)}
    for ino, (data, logged) in copies.items():
        assert s.replace(ino, 0, 7, 1, data, logged=logged).length == len(data)
    assert [len(chunk_files(str(tmp_path), ino)) for ino in copies] == [0, 1, 1, 0, 1]
    assert [s.logged(ino, 0) for ino in copies] == [True, False, False, True, False]
    again = _store(tmp_path)
    assert all(read(again, ino, 0) == data for ino, (data, _l) in copies.items())
    files = ChunkStore(str(tmp_path / "files"), small=False)  # no logs at all: every copy is a file
    for ino, data in [(35, b""), (36, b"abc")]:
        assert files.replace(ino, 0, 7, 1, data, logged=True).length == len(data)
        assert read(files, ino, 0) == data


def test_damaged_bytes_fail_reads_scrub_and_changes(tmp_path) -> None:
    s = _store(tmp_path)
    data = os.urandom(BLOCK + 10)
    write(s, 21, 0, 0, data)
    write(s, 22, 0, 0, b"fine" * 100)
    rec = s.small.get((21, 0))  # type: ignore[union-attr]
    flip_byte(_logs(tmp_path)[0], rec.data + BLOCK + 3)
    again = _store(tmp_path)  # the record no longer parses: damage before a durable mark
    for attempt in (lambda: read(again, 21, 0), lambda: write(again, 21, 0, 0, b"q"),
                    lambda: again.read_whole(21, 0)):
        with pytest.raises(StripefsError) as err:
            attempt()
        assert err.value.code == ErrorCode.CHECKSUM
    checked, bad = again.scrub()
    assert bad == [(21, 0, 0)] and checked == 1
    assert read(again, 22, 0) == b"fine" * 100
    repaired = again.replace(21, 0, 4, 3, data, force=True)  # what a resync does
    assert repaired.version == 3 and read(again, 21, 0) == data
    assert read(_store(tmp_path), 21, 0) == data


def test_damage_after_a_start_fails_reads_and_is_found_by_scrub(tmp_path) -> None:
    s = _store(tmp_path)
    write(s, 23, 0, 0, b"k" * 5000)
    (_index, log, at), = chunk_places(str(tmp_path), 23)
    flip_byte(log, at + 4000)
    for inline in (0, 1 << 20):  # every read checks a small chunk's blocks
        with pytest.raises(StripefsError) as err:
            read(s, 23, 0, 4000, 10, inline=inline)
        assert err.value.code == ErrorCode.CHECKSUM
    checked, bad = s.scrub()
    assert bad == [(23, 0, 0)]
    with pytest.raises(StripefsError):  # a change must not give the damaged bytes fresh CRCs
        write(s, 23, 0, 5000, b"more")


def test_a_torn_tail_is_dropped_and_cut(tmp_path) -> None:
    s = _store(tmp_path)
    write(s, 30, 0, 0, b"a" * 1000)
    (log,) = _logs(tmp_path)
    size = os.path.getsize(log)
    write(s, 31, 0, 0, b"b" * 3000)  # then "the power goes" with this append half on disk
    with open(log, "r+b") as f:
        f.seek(size + 1024)
        f.write(b"\0" * 1024)
    again = _store(tmp_path)
    assert read(again, 30, 0) == b"a" * 1000
    assert read(again, 31, 0) == b""  # never acknowledged: gone, not damaged
    assert again.small.damaged == 0 and os.path.getsize(log) == size  # type: ignore[union-attr]
    write(again, 32, 0, 0, b"c" * 10)
    assert read(_store(tmp_path), 32, 0) == b"c" * 10


def test_space_comes_back_and_the_oldest_log_goes(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(_small, "LOG_MAX", 64 << 10)
    s = _store(tmp_path)
    keep = {}
    for ino in range(100, 160):
        data = os.urandom(3000)
        write(s, ino, 0, 0, data)
        if ino % 6 == 0:
            keep[ino] = data
    for ino in range(100, 160):
        if ino not in keep:
            s.remove(ino, forget=ino % 2 == 1)
    logs_before = _logs(tmp_path)
    assert len(logs_before) > 2
    moved = 0
    while (n := s.compact_small()):
        moved += n
    assert moved >= 1 and len(_logs(tmp_path)) < len(logs_before)
    assert logs_before[0] not in _logs(tmp_path)
    for ino, data in keep.items():
        assert read(s, ino, 0) == data
    again = _store(tmp_path)
    assert again.chunks == len(keep)
    for ino in range(100, 160):
        if ino in keep:
            assert read(again, ino, 0) == keep[ino]
        elif ino % 2:  # removed with its inode: a tombstone answers
            with pytest.raises(StripefsError):
                read(again, ino, 0)
        else:
            assert read(again, ino, 0) == b""


def test_concurrent_writers_share_syncs_and_all_land(tmp_path, monkeypatch) -> None:
    s = _store(tmp_path)
    syncs = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (syncs.append(fd), real(fd))[1])
    datas = {i: os.urandom(1000 + i) for i in range(64)}

    def run(part: list[int]) -> None:
        for i in part:
            write(s, 1000 + i, 0, 0, datas[i])

    threads = [threading.Thread(target=run, args=(list(range(k, 64, 8)),)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(syncs) <= 64
    again = _store(tmp_path)
    for i, data in datas.items():
        assert read(again, 1000 + i, 0) == data


def test_files_mode_still_serves_a_root_with_logs(tmp_path) -> None:
    s = _store(tmp_path)
    write(s, 40, 0, 0, b"log" * 10)
    files = ChunkStore(str(tmp_path), small=False)
    assert read(files, 40, 0) == b"log" * 10
    write(files, 41, 0, 0, b"file")
    assert len(chunk_files(str(tmp_path), 41)) == 1
    write(files, 40, 0, 30, b"!")  # a change moves it to a file
    assert read(ChunkStore(str(tmp_path), small=False), 40, 0) == b"log" * 10 + b"!"
    assert read(_store(tmp_path), 40, 0) == b"log" * 10 + b"!"


def test_a_dropped_store_closes_its_logs(tmp_path) -> None:
    import gc

    before = len(os.listdir("/proc/self/fd"))
    s = _store(tmp_path)
    write(s, 1, 0, 0, b"x")
    del s
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= before


# -- the crash model ------------------------------------------------------------------------


class LogRecorder:
    """Records the container logs' writes, cuts and syncs during a sequence of operations."""

    def __init__(self, root: str, monkeypatch: pytest.MonkeyPatch):
        self.root = os.path.realpath(os.path.join(root, "small"))
        self.log: list[tuple[Any, ...]] = []
        self._real = {name: getattr(os, name) for name in ("pwrite", "ftruncate", "fdatasync")}
        mp = monkeypatch

        def ours(fd: int) -> str | None:
            try:
                path = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                return None
            return path if os.path.dirname(path) == self.root else None

        def pwrite(fd: int, data: Any, offset: int) -> int:
            if (path := ours(fd)) is not None:
                self.log.append(("pwrite", path, offset, bytes(data)))
            return self._real["pwrite"](fd, data, offset)

        def ftruncate(fd: int, length: int) -> None:
            if (path := ours(fd)) is not None:
                self.log.append(("ftruncate", path, length))
            self._real["ftruncate"](fd, length)

        def fdatasync(fd: int) -> None:
            self._real["fdatasync"](fd)
            if ours(fd) is not None:
                self.log.append(("sync",))

        mp.setattr(os, "pwrite", pwrite)
        mp.setattr(os, "ftruncate", ftruncate)
        mp.setattr(os, "fdatasync", fdatasync)

    def mark(self, what: Any) -> None:
        self.log.append(("ack", what))


def _outcomes(log: list[tuple[Any, ...]], cut: int, rng: random.Random, samples: int) -> list[list[tuple[Any, ...]]]:
    """The writes a crash after ``log[:cut]`` may leave: all before the last sync, then any
    subset of the later writes' sectors (every one of them, and ``samples`` random subsets)."""
    prefix = log[:cut]
    last_sync = max((i for i, e in enumerate(prefix) if e[0] == "sync"), default=-1)
    durable = [e for e in prefix[: last_sync + 1] if e[0] in ("pwrite", "ftruncate")]
    pending = []
    for e in prefix[last_sync + 1 :]:
        if e[0] == "pwrite":
            _op, path, offset, data = e
            for s in range(0, len(data), ALIGN):  # a write reaches the disk sector by sector
                pending.append(("pwrite", path, offset + s, data[s : s + ALIGN]))
        elif e[0] == "ftruncate":
            pending.append(e)
    subsets = [pending, []]
    for _ in range(samples if pending else 0):
        subsets.append([p for p in pending if rng.random() < 0.5])
    return [durable + sub for sub in subsets]


def _rebuild(base: str, target: str, writes: list[tuple[Any, ...]]) -> None:
    shutil.copytree(base, target)
    for e in writes:
        path = os.path.join(target, "small", os.path.basename(e[1]))
        with open(path, "r+b") as f:
            if e[0] == "pwrite":
                f.seek(e[2])
                f.write(e[3])
            else:
                f.truncate(e[2])


def test_crash_at_any_point_keeps_every_acknowledged_chunk(tmp_path, monkeypatch) -> None:
    """Operations in sequence (each acknowledged when it returns): new chunks, rewrites,
    appends, cuts, removals, a replica's copy. A crash after any prefix of the logs'
    calls, with any subset of the unsynced sectors on disk: a fresh store must serve, for
    every chunk, its last acknowledged state or the state of the operation then in flight,
    and its CRCs must pass."""
    root = tmp_path / "store"
    s = _store(root)
    base = str(tmp_path / "base")
    shutil.copytree(root, base)  # the logs as they were (the first log's header is synced)
    rng = random.Random(7)
    blob = lambda n: bytes(rng.getrandbits(8) for _ in range(n))  # noqa: E731
    ops = [
        ("write", 1, 0, blob(3000)),
        ("write", 2, 0, blob(BLOCK + 77)),
        ("write", 1, 1000, blob(500)),  # rewrite inside
        ("write", 2, BLOCK + 77, blob(900)),  # append into the partly filled block
        ("truncate", 1, 1200),
        ("write", 3, 0, blob(100)),
        ("remove", 3),
        ("replace", 4, blob(2000)),
        ("write", 1, 5000, blob(10)),  # past a hole
        ("write", 5, 0, rng.randbytes(SMALL_MAX - 3000)),  # a sample written whole: the largest records
        ("replace", 6, rng.randbytes(GROW_MAX + 5000)),  # a copy of one the source holds in its logs
    ]
    rec = LogRecorder(str(root), monkeypatch)
    model: dict[int, bytes] = {}
    states: list[dict[int, bytes]] = [{}]  # after each acknowledged operation
    for op in ops:
        kind, ino = op[0], op[1]
        if kind == "write":
            _k, _i, offset, data = op
            cur = bytearray(model.get(ino, b""))
            if offset > len(cur):
                cur.extend(bytes(offset - len(cur)))
            cur[offset : offset + len(data)] = data
            write(s, ino, 0, offset, data)
            model[ino] = bytes(cur)
        elif kind == "truncate":
            s.truncate(ino, 0, op[2])
            model[ino] = model[ino][: op[2]]
        elif kind == "remove":
            s.remove(ino, from_index=0)
            model.pop(ino)
        else:
            s.replace(ino, 0, 0, 1, op[2], logged=True)
            model[ino] = op[2]
        rec.mark(len(states))
        states.append(dict(model))
    monkeypatch.undo()
    log = rec.log
    cases = 0
    for cut in range(len(log) + 1):
        acked = max((e[1] for e in log[:cut] if e[0] == "ack"), default=0)
        allowed = [states[acked]] + ([states[acked + 1]] if acked + 1 < len(states) else [])
        for n, writes in enumerate(_outcomes(log, cut, rng, samples=6)):
            target = str(tmp_path / f"crash-{cut}-{n}")
            _rebuild(base, target, [w for w in writes if w[0] != "ack"])
            fresh = _store(target)
            for ino in range(1, 7):
                got = read(fresh, ino, 0)
                options = {st.get(ino, b"") for st in allowed}
                assert got in options, f"crash after call {cut} of {len(log)} (outcome {n}): chunk {ino} wrong"
            fresh.small.close()  # type: ignore[union-attr]
            shutil.rmtree(target)
            cases += 1
    assert cases > 3 * len(log)


def test_a_cluster_written_with_chunk_files_serves_them_after_the_upgrade(make_cluster, monkeypatch) -> None:
    """An old root (every chunk a file) keeps serving its files when its servers restart
    with the container logs; rewrites of old chunks and new small files go on from there,
    and a restart back to files mode serves both kinds."""
    monkeypatch.setenv("STRIPEFS_SMALL_CHUNKS", "files")
    h = make_cluster(servers=2)
    rng = random.Random(3)
    files = {f"/old{i}": rng.randbytes(rng.randrange(1, 300_000)) for i in range(12)}
    with h.client() as c:
        for path, data in files.items():
            c.write_bytes(path, data)
    roots = [s["root"] for s in h.data["servers"]]
    assert not any(os.path.isdir(os.path.join(r, "small")) for r in roots)
    monkeypatch.setenv("STRIPEFS_SMALL_CHUNKS", "container")
    h.restart()
    with h.client() as c:
        for path, data in files.items():
            assert c.read_bytes(path) == data
        for i in range(12):
            files[f"/new{i}"] = rng.randbytes(rng.randrange(1, 60_000))
            c.write_bytes(f"/new{i}", files[f"/new{i}"])
        files["/old0"] = rng.randbytes(5000)  # an old chunk rewritten
        c.write_bytes("/old0", files["/old0"])
    assert all(_logs(r) for r in roots)
    monkeypatch.setenv("STRIPEFS_SMALL_CHUNKS", "files")
    h.restart()
    with h.client() as c:
        for path, data in files.items():
            assert c.read_bytes(path) == data


def test_writers_removers_and_compaction_at_once_agree_with_a_model(tmp_path, monkeypatch) -> None:
    """Threads change their own chunks at random (new, rewrite, append, cut, remove, move to
    a file) while another compacts the logs (sealed every 32 KiB): each thread's model
    matches the store during the run, after it, and after a restart."""
    monkeypatch.setattr(_small, "LOG_MAX", 32 << 10)
    s = _store(tmp_path)
    models: list[dict[int, bytes]] = [{} for _ in range(4)]
    errors: list[BaseException] = []
    stop = threading.Event()

    def worker(t: int) -> None:
        rng = random.Random(t)
        model = models[t]
        try:
            for _ in range(150):
                ino = 10_000 * (t + 1) + rng.randrange(12)
                op = rng.random()
                cur = model.get(ino, b"")
                if op < 0.45:
                    offset = rng.randrange(len(cur) + 1)
                    data = rng.randbytes(rng.randrange(1, 6000))
                    write(s, ino, 0, offset, data)
                    model[ino] = cur[:offset] + data + cur[offset + len(data) :]
                elif op < 0.6 and cur:
                    cut = rng.randrange(len(cur))
                    s.truncate(ino, 0, cut)
                    model[ino] = cur[:cut]
                elif op < 0.75 and cur:
                    s.remove(ino, from_index=0)
                    model.pop(ino)
                elif op < 0.78 and cur:
                    extra = rng.randbytes(SMALL_MAX)  # outgrows the logs: a chunk file
                    write(s, ino, 0, len(cur), extra)
                    model[ino] = cur + extra
                assert read(s, ino, 0) == model.get(ino, b"")
        except BaseException as exc:  # noqa: BLE001 -- reported by the test
            errors.append(exc)

    def compactor() -> None:
        try:
            while not stop.is_set():
                s.compact_small()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    comp = threading.Thread(target=compactor)
    comp.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    comp.join()
    assert not errors, errors
    while s.compact_small():
        pass
    for store in (s, _store(tmp_path)):
        for t, model in enumerate(models):
            for ino in range(10_000 * (t + 1), 10_000 * (t + 1) + 12):
                assert read(store, ino, 0) == model.get(ino, b"")
        assert store.chunks == sum(len(m) for m in models)
        assert store.used == sum(len(v) for m in models for v in m.values())
