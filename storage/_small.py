"""Small chunks in container logs: one append and one shared ``fdatasync`` per new chunk.

A chunk file costs a small chunk an inode, a ``.tmp`` create, an ``fdatasync``, a rename
and a sync of its bucket directory. Here a small chunk (at most ``SMALL_MAX`` bytes written whole, ``GROW_MAX`` grown by
appends, never a whole chunk of a striped file) is a
*record* appended to the active log of ``ROOT/small/``; every change of it (a rewrite, an
append, a cut, a replica's copy) appends a whole new record, so the old one stays valid
until the new one is durable (copy-on-write by construction). The writes that arrive
together share one ``fdatasync`` (group commit, :meth:`SmallLog._sync_to`). The index
(key -> where its latest record lies) lives in memory and is rebuilt at start by reading
the logs in order, later records winning. A chunk that grows past those moves to a
chunk file (:class:`~stripefs.storage._chunks.ChunkStore` does the move).

Record (at an offset that is a multiple of ``ALIGN``)::

    0    8  magic  b"SFSMALL1"
    8    8  the log's id (random, from its file header: a log's bytes stored as a
            chunk's data never parse as this log's records)
    16   1  kind: 1 a chunk's bytes, 2 the chunk is gone
    20   4  CRC32C of the header (this field zero) and the block CRCs
    24   8  ino; 32 8 index; 40 8 version; 48 8 chain
    56   4  length; 60 4 blocks; 64 8 durable: the log's length known synced at append
    72  4n  CRC32C of each 64 KiB block of the data, then the data
    end-32  trailer: b"SFSTAIL1", ino, index, CRC32C of (log id, ino, index)

Appends are serialised (one lock around each ``pwrite``), so a sync that started after a
record's write also covers every record before it: at start, a record that does not
parse is a torn append (never acknowledged) when it lies past every later record's
``durable`` mark, and is dropped; before such a mark it was acknowledged, so it is
damage: the trailer names the chunk, which reads as corrupt (scrub reports it, a replica
repairs it) instead of as a hole. The log is cut after its last good record.

Removal: a ``kind 2`` record, synced unless the inode's tombstone (synced first) already
says the chunk is gone: records of removed inodes are dropped at start.

Space: the active log is sealed at ``LOG_MAX``. When the sealed logs hold less than half
live bytes, the oldest is compacted (:meth:`SmallLog.compact`): its live records are
appended again (synced), then the file goes. Only the oldest log ever goes: a later log's
records supersede an earlier one's, which would come back if the later went first.
A record found damaged and moved by compaction, or in a log that went, is forgotten at the
next start (it reads as missing, and a replica's resync brings it back).
"""

from __future__ import annotations

import os
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import crc32c

from stripefs.wire import CRC_BLOCK, ErrorCode, StripefsError

from . import _stats

SMALL_MAX = 256 << 10  # chunks up to this size, written whole, live in container logs
# ... and a record that grows (a write past its end, not from byte 0) stays there only up to
# this size: every change rewrites the whole record, so a chunk grown by small appends costs
# O(size^2) bytes written; past this it moves to a chunk file.
GROW_MAX = 128 << 10
ALIGN = 512  # records start at multiples of this (a sector: a torn append spares its neighbours)
LOG_MAX = 64 << 20  # the active log is sealed past this size
LOG_MAGIC = b"SFSLOG02"  # new logs' format: records of up to 256 KiB
# A log's format -> the largest record it may hold. Version 1 held records of up to 128 KiB;
# a server that knows only version 1 refuses a version 2 log at start (not a log, it says)
# instead of reading its larger records as damage. The active log of version 1 found at
# start is left for a new one (its records stay readable where they are).
LOG_FORMATS = {b"SFSLOG01": 128 << 10, LOG_MAGIC: SMALL_MAX}
REC_MAGIC = b"SFSMALL1"
TAIL_MAGIC = b"SFSTAIL1"
PUT, DEAD = 1, 2
_HDR = struct.Struct("!8s8sBxxxIQQQQIIQ")  # 72 bytes
_TAIL = struct.Struct("!8sQQI4x")  # 32 bytes
_LOG_HEAD = struct.Struct("!8s8sQ")  # magic, id, created (ns); padded to ALIGN


def logs_hold(length: int, small_max: int, *, capped: bool = False) -> bool:
    """The one rule for where a chunk of ``length`` bytes lives: a record in the container
    logs (True) or a chunk file. Up to ``small_max`` (the store's ``SMALL_MAX``, 0 with the
    logs off); ``capped``: up to ``GROW_MAX`` only -- a record grown by a write past its end
    (each change rewrites it whole, so appends must not cost O(size^2)), a whole chunk of a
    file striped in chunks this small (bulk data), a copy whose place is not known."""
    return length <= (min(small_max, GROW_MAX) if capped else small_max)


def _crc(data: Any) -> int:
    return crc32c.crc32c(data)


def _span(length: int, nblocks: int) -> int:
    raw = _HDR.size + 4 * nblocks + length + _TAIL.size
    return -(-raw // ALIGN) * ALIGN


def block_crcs(data: Any) -> list[int]:
    view = memoryview(data)
    return [_crc(view[b : b + CRC_BLOCK]) for b in range(0, len(view), CRC_BLOCK)]


@dataclass(slots=True)
class Record:
    """Where a small chunk's latest record lies, and what it says."""

    log: int  # the log's number
    data: int  # offset of the chunk's first byte in the log
    version: int
    length: int
    chain: int
    crcs: list[int]
    written: float  # time.time() of the append
    span: int  # bytes the record occupies (for compaction's accounting)
    bad: bool = False  # damaged on disk: reads fail with CHECKSUM until repaired


class _Log:
    def __init__(self, number: int, path: str, fd: int, ident: bytes, size: int, current: bool = True):
        self.number, self.path, self.fd, self.ident, self.size = number, path, fd, ident, size
        self.current = current  # of this version's format (LOG_MAGIC): new records may go here
        self.live = 0  # bytes of live records


def _parse(view: memoryview, pos: int, ident: bytes, most: int) -> tuple[Any, ...] | None:
    """The record at ``pos`` as its header's fields and its block CRCs, if the whole record
    checks (header CRC, every block's CRC, trailer, at most ``most`` bytes of data: its
    log format's limit); None otherwise."""
    try:
        h = _HDR.unpack_from(view, pos)
    except struct.error:
        return None
    magic, lid, kind, hcrc, ino, index, version, chain, length, nblocks, durable = h
    if magic != REC_MAGIC or lid != ident or kind not in (PUT, DEAD) or length > most:
        return None
    if nblocks != -(-length // CRC_BLOCK):
        return None
    span = _span(length, nblocks)
    if pos + span > len(view):
        return None
    crc_end = pos + _HDR.size + 4 * nblocks
    zeroed = _HDR.pack(magic, lid, kind, 0, ino, index, version, chain, length, nblocks, durable)
    if crc32c.crc32c(view[pos + _HDR.size : crc_end], crc32c.crc32c(zeroed)) != hcrc:
        return None
    crcs = list(struct.unpack_from(f"!{nblocks}I", view, pos + _HDR.size))
    data = view[crc_end : crc_end + length]
    for b, c in enumerate(crcs):
        if _crc(data[b * CRC_BLOCK : (b + 1) * CRC_BLOCK]) != c:
            return None
    tail = _TAIL.unpack_from(view, pos + span - _TAIL.size)
    if tail[0] != TAIL_MAGIC or tail[1] != ino or tail[2] != index:
        return None
    return (*h[:2], kind, hcrc, ino, index, version, chain, length, nblocks, durable, crcs)


def _trailer_key(view: memoryview, start: int, stop: int, ident: bytes) -> tuple[int, int] | None:
    """The chunk a damaged region held, from a trailer at one of its sector ends."""
    for end in range(stop, start, -ALIGN):
        magic, ino, index, crc = _TAIL.unpack_from(view, end - _TAIL.size)
        if magic == TAIL_MAGIC and crc == _crc(ident + struct.pack("!QQ", ino, index)):
            return ino, index
    return None


def read_log(raw: bytes, number: int, path: str = "") -> tuple[bytes, list[tuple[int, tuple[int, int], Record | None]], int, int]:
    """Parse a whole log: ``(its id, [(offset, key, record or None for a removal)] in log
    order, the end of its last good record, regions found damaged)``. Pure (no I/O)."""
    head = raw[:_LOG_HEAD.size]
    most = LOG_FORMATS.get(head[:8]) if len(head) == _LOG_HEAD.size else None
    if most is None:
        raise StripefsError(ErrorCode.CHECKSUM, f"{path or 'log'} is not a stripefs container log "
                            "(or one of a newer format)")
    ident = head[8:16]
    view = memoryview(raw)
    good: list[tuple[int, tuple[Any, ...], int]] = []  # (offset, header, span)
    gaps: list[tuple[int, int]] = []  # [start, end) that did not parse, before a good record
    pos, gap_start = ALIGN, None
    while pos + _HDR.size <= len(raw):
        h = _parse(view, pos, ident, most)
        if h is None:
            if gap_start is None:
                gap_start = pos
            pos += ALIGN
            continue
        if gap_start is not None:
            gaps.append((gap_start, pos))
            gap_start = None
        good.append((pos, h, _span(h[8], h[9])))
        pos += good[-1][2]
    end = good[-1][0] + good[-1][2] if good else ALIGN
    # A gap that lies before a later record's ``durable`` mark held acknowledged records:
    # damage, not a torn append.
    events: list[tuple[int, tuple[int, int], Record | None]] = []
    damaged = latest_mark = 0
    gaps.sort(reverse=True)
    for off, h, span in reversed(good):
        latest_mark = max(latest_mark, h[10])
        while gaps and gaps[0][1] >= off:
            start, stop = gaps.pop(0)
            if latest_mark > start:
                damaged += 1
                key = _trailer_key(view, start, stop, ident)
                if key is not None:
                    events.append((start, key, Record(number, 0, 0, 0, 0, [], 0.0, 0, bad=True)))
        kind, ino, index, version, chain, length, crcs = h[2], h[4], h[5], h[6], h[7], h[8], h[11]
        rec = None if kind == DEAD else Record(number, off + _HDR.size + 4 * len(crcs), version, length,
                                              chain, crcs, 0.0, span)
        events.append((off, (ino, index), rec))
    events.sort(key=lambda e: e[0])
    return ident, events, end, damaged


def locate(root: str) -> dict[tuple[int, int], tuple[str, int, int]]:
    """Where each small chunk's bytes lie under a storage root: ``{(ino, index): (log path,
    offset, length)}`` (reads the logs; changes nothing: for operators and tests)."""
    d = os.path.join(root, "small")
    out: dict[tuple[int, int], tuple[str, int, int]] = {}
    try:
        names = sorted(n for n in os.listdir(d) if n.endswith(".log"))
    except FileNotFoundError:
        return out
    for name in names:
        path = os.path.join(d, name)
        with open(path, "rb") as f:
            _ident, events, _end, _damaged = read_log(f.read(), int(name[:-4], 16), path)
        for _off, key, rec in events:
            if rec is None or rec.bad:
                out.pop(key, None)
            else:
                out[key] = (path, rec.data, rec.length)
    return out


class SmallLog:
    """The container logs of one storage target. Thread-safe; methods block (disk I/O).

    Callers (the chunk store) hold the chunk's own lock around every change of a key and
    every read of its record, as for chunk files.
    """

    def __init__(self, root: str, sync: bool = True, removed: Callable[[int], bool] | None = None,
                 before_sync: Callable[[], None] | None = None):
        """``removed(ino)``: was the inode removed for good (its records are dropped at start);
        ``before_sync``: called before each shared ``fdatasync`` (a test's slow disk)."""
        self.root = root
        self.sync = sync
        self._before_sync = before_sync
        os.makedirs(root, exist_ok=True)
        self.index: dict[tuple[int, int], Record] = {}
        self.by_ino: dict[int, set[int]] = {}
        self._logs: dict[int, _Log] = {}
        self._append = threading.Lock()  # serialises appends (see the module's docstring) and log changes
        self._ilock = threading.Lock()
        self._cv = threading.Condition(threading.Lock())
        self._written = 0  # (log, end) of the last append, as one number: log * 2**40 + end
        self._synced = 0
        self._syncing = False
        self.damaged = 0  # records found damaged at start (counted, named when a trailer says whose)
        for name in [n for n in os.listdir(root) if n.endswith(".tmp")]:
            os.unlink(os.path.join(root, name))  # a log whose header was not synced yet
        names = sorted(n for n in os.listdir(root) if n.endswith(".log"))
        for name in names:
            self._replay(int(name[:-4], 16))
        if removed is not None:  # records of removed inodes whose removal records were not synced
            for ino in [i for i in self.by_ino if removed(i)]:
                for index in list(self.by_ino.get(ino, ())):
                    self._drop((ino, index))
        newest = self._logs[max(self._logs)] if self._logs else None
        if newest is not None and newest.current:
            self._active = newest
        else:  # none yet, or the newest is of an older format (it keeps its records, sealed)
            self._active = self._new_log(newest.number + 1 if newest is not None else 1)
        self._written = self._synced = self._mark(self._active, self._active.size)

    # -- logs ------------------------------------------------------------------------------
    @staticmethod
    def _mark(log: _Log, end: int) -> int:
        return log.number << 40 | end

    def _new_log(self, number: int) -> _Log:
        path = os.path.join(self.root, f"{number:08x}.log")
        ident = os.urandom(8)
        tmp = path + ".tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.pwrite(fd, _LOG_HEAD.pack(LOG_MAGIC, ident, time.time_ns()).ljust(ALIGN, b"\0"), 0)
        if self.sync:
            os.fdatasync(fd)
        os.rename(tmp, path)
        self._sync_dir()
        log = _Log(number, path, fd, ident, ALIGN)
        self._logs[number] = log
        return log

    def _sync_dir(self) -> None:
        if self.sync:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def close(self) -> None:
        """Close the logs' descriptors (the log is unusable after)."""
        for log in self._logs.values():
            os.close(log.fd)
        self._logs.clear()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110 -- at interpreter exit, or a half-built log
            pass

    # -- start: replay ---------------------------------------------------------------------
    def _replay(self, number: int) -> None:
        path = os.path.join(self.root, f"{number:08x}.log")
        fd = os.open(path, os.O_RDWR)
        try:
            with open(fd, "rb", closefd=False) as f:
                raw = f.read()
            ident, events, end, damaged = read_log(raw, number, path)
        except BaseException:
            os.close(fd)
            raise
        log = _Log(number, path, fd, ident, end, current=raw[:8] == LOG_MAGIC)
        self._logs[number] = log
        self.damaged += damaged
        for _off, key, rec in events:
            if rec is None:
                self._drop(key)
            else:
                self._set(key, rec)
        if end < len(raw):  # a torn tail: cut it, so the next append does not sit after garbage
            os.ftruncate(fd, end)
            if self.sync:
                os.fdatasync(fd)

    # -- the index -------------------------------------------------------------------------
    # The index, ``by_ino`` and the logs' live counts change under ``_ilock`` (writers of
    # different chunks run on different threads; a lost update of a live count could let a
    # log with live records go).
    def _set(self, key: tuple[int, int], rec: Record) -> None:
        with self._ilock:
            old = self.index.get(key)
            if old is not None and old.log in self._logs:
                self._logs[old.log].live -= old.span
            self.index[key] = rec
            self.by_ino.setdefault(key[0], set()).add(key[1])
            if rec.log in self._logs:
                self._logs[rec.log].live += rec.span

    def _drop(self, key: tuple[int, int]) -> Record | None:
        with self._ilock:
            old = self.index.pop(key, None)
            if old is None:
                return None
            if old.log in self._logs:
                self._logs[old.log].live -= old.span
            indexes = self.by_ino.get(key[0])
            if indexes is not None:
                indexes.discard(key[1])
                if not indexes:
                    del self.by_ino[key[0]]
            return old

    def get(self, key: tuple[int, int]) -> Record | None:
        return self.index.get(key)

    def keys(self) -> list[tuple[int, int]]:
        with self._ilock:
            return list(self.index)

    def indexes(self, ino: int) -> list[int]:
        with self._ilock:
            return sorted(self.by_ino.get(ino, ()))

    # -- append ----------------------------------------------------------------------------
    def _record(self, log: _Log, kind: int, key: tuple[int, int], version: int, chain: int,
                data: Any, crcs: list[int], durable: int) -> bytes:
        ino, index = key
        head = _HDR.pack(REC_MAGIC, log.ident, kind, 0, ino, index, version, chain, len(data), len(crcs), durable)
        packed_crcs = struct.pack(f"!{len(crcs)}I", *crcs)
        hcrc = crc32c.crc32c(packed_crcs, crc32c.crc32c(head))
        head = _HDR.pack(REC_MAGIC, log.ident, kind, hcrc, ino, index, version, chain, len(data), len(crcs), durable)
        span = _span(len(data), len(crcs))
        tail = _TAIL.pack(TAIL_MAGIC, ino, index, _crc(log.ident + struct.pack("!QQ", ino, index)))
        pad = span - _HDR.size - len(packed_crcs) - len(data) - _TAIL.size
        return b"".join((head, packed_crcs, data, b"\0" * pad, tail))  # (join takes a memoryview as is)

    def _append_records(self, items: Iterable[tuple[int, tuple[int, int], int, int, Any, list[int]]],
                        sync: bool = True) -> list[tuple[_Log, int, int]]:
        """Append records (kind, key, version, chain, data, crcs); durable on return when
        ``sync``. Returns (log, offset, span) of each."""
        out = []
        with self._append:
            for kind, key, version, chain, data, crcs in items:
                log = self._active
                if log.size >= LOG_MAX:
                    log = self._active = self._new_log(log.number + 1)
                raw = self._record(log, kind, key, version, chain, data, crcs, self._synced & ((1 << 40) - 1)
                                   if self._synced >> 40 == log.number else 0)
                done = 0
                while done < len(raw):
                    done += os.pwrite(log.fd, raw[done:] if done else raw, log.size + done)
                out.append((log, log.size, len(raw)))
                log.size += len(raw)
                mark = self._written = self._mark(log, log.size)
        if sync and self.sync:
            self._sync_to(mark)
        return out

    def _sync_to(self, mark: int) -> None:
        """Group commit: return once the logs are synced up to ``mark``; one thread syncs
        for all that wait meanwhile."""
        with self._cv:
            while self._synced < mark:
                if self._syncing:
                    self._cv.wait()
                    continue
                self._syncing = True
                target = self._written
                self._cv.release()
                try:
                    # Every log from the last synced one up to the target's (a seal in between).
                    if self._before_sync is not None:
                        self._before_sync()
                    with _stats.FSYNC_DATA.time():
                        for number in range(self._synced >> 40, (target >> 40) + 1):
                            log = self._logs.get(number)
                            if log is not None:
                                os.fdatasync(log.fd)
                finally:
                    self._cv.acquire()
                    self._syncing = False
                    self._cv.notify_all()
                self._synced = max(self._synced, target)

    def put(self, key: tuple[int, int], version: int, chain: int, data: Any, crcs: list[int]) -> Record:
        """Store a small chunk's whole bytes durably (the caller holds the chunk's lock)."""
        ((log, off, span),) = self._append_records([(PUT, key, version, chain, data, crcs)])
        rec = Record(log.number, off + _HDR.size + 4 * len(crcs), version, len(data), chain, crcs, time.time(), span)
        self._set(key, rec)
        return rec

    def kill(self, keys: list[tuple[int, int]], sync: bool = True) -> None:
        """Record that chunks are gone (durable on return when ``sync``)."""
        live = [k for k in keys if k in self.index]
        if not live:
            return
        self._append_records([(DEAD, k, 0, 0, b"", []) for k in live], sync)
        for k in live:
            self._drop(k)
        self._maybe_unlink_empty()

    # -- read ------------------------------------------------------------------------------
    def read(self, rec: Record, offset: int, n: int) -> bytes:
        raw = os.pread(self._logs[rec.log].fd, n, rec.data + offset)
        if len(raw) != n:
            raise StripefsError(ErrorCode.CHECKSUM, "a container log is shorter than its index says")
        return raw

    # -- space -----------------------------------------------------------------------------
    def _maybe_unlink_empty(self) -> None:
        """Remove the oldest logs while they hold nothing live. Only the oldest: a later
        log's records (a removal, a newer copy) supersede an earlier log's, which would
        come back at the next start if the later log went first."""
        with self._append, self._ilock:
            while len(self._logs) > 1:
                oldest = self._logs[min(self._logs)]
                if oldest is self._active or oldest.live > 0 or any(r.log == oldest.number for r in self.index.values()):
                    return
                self._unlink(oldest)

    def _unlink(self, log: _Log) -> None:
        del self._logs[log.number]
        os.unlink(log.path)
        self._sync_dir()
        os.close(log.fd)

    def compactable(self) -> int | None:
        """The oldest log, when the sealed logs hold less than half live records (then
        moving its live records forward and removing it reclaims space); else None."""
        with self._append:
            sealed = [g for g in self._logs.values() if g is not self._active]
        if not sealed or sum(g.live for g in sealed) * 2 >= sum(g.size for g in sealed):
            return None
        return min(g.number for g in sealed)

    def compact(self, number: int, lock: Callable[[tuple[int, int]], Any]) -> int:
        """Move the oldest log's live records to the active log, then remove the log.
        ``lock(key)``: the chunk's lock (a context manager). Returns records moved."""
        log = self._logs.get(number)
        if log is None or log is self._active or number != min(self._logs):
            return 0
        moved = 0
        with self._ilock:
            keys = [k for k, r in self.index.items() if r.log == number]
        for key in keys:
            with lock(key):
                rec = self.index.get(key)
                if rec is None or rec.log != number or rec.bad:
                    continue
                data = self.read(rec, 0, rec.length)
                if block_crcs(data) != rec.crcs:
                    rec.bad = True  # scrub reports it; a replica's copy replaces it
                    continue
                ((new_log, off, span),) = self._append_records([(PUT, key, rec.version, rec.chain, data, rec.crcs)])
                self._set(key, Record(new_log.number, off + _HDR.size + 4 * len(rec.crcs), rec.version, rec.length,
                                      rec.chain, rec.crcs, rec.written, span))
                moved += 1
        self._maybe_unlink_empty()
        return moved

    def usage(self) -> tuple[int, int]:
        """(bytes of data, chunks) held."""
        with self._ilock:
            return sum(r.length for r in self.index.values()), len(self.index)
