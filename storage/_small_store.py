"""The chunk store's side of small chunks in container logs (storage/_small.py): how a
write, a read, a cut and a removal of a chunk held in a log go. Mixed into
:class:`~stripefs.storage._chunks.ChunkStore`, whose chunk lock every method here runs under."""

from __future__ import annotations

from stripefs.wire import ErrorCode, StripefsError

from . import _stats
from ._header import BLOCK, ChunkMeta, _crc
from ._qos import BULK_WRITE, idle_io
from ._small import Record, SmallLog


class SmallChunks:
    """Small-chunk methods of :class:`~stripefs.storage._chunks.ChunkStore`."""

    small: SmallLog | None
    small_max: int
    used: int
    chunks: int
    _meta: dict[tuple[int, int], ChunkMeta]

    @staticmethod
    def _small_meta(ino: int, index: int, rec: Record) -> ChunkMeta:
        if rec.bad:
            raise StripefsError(ErrorCode.CHECKSUM, f"chunk {ino}:{index} is damaged in its container log")
        return ChunkMeta(rec.version, rec.length, rec.crcs, (1 << len(rec.crcs)) - 1, chain=rec.chain)

    def _small_bytes(self, ino: int, index: int, rec: Record) -> bytes:
        """A small chunk's whole bytes, checked against its CRCs (a change rewrites the whole
        record: unchecked old bytes would get fresh CRCs and their damage would go unseen)."""
        assert self.small is not None
        meta = self._small_meta(ino, index, rec)
        data = self.small.read(rec, 0, rec.length)
        self._verify(ino, index, meta, data)
        return data

    def _write_small(self, ino: int, index: int, offset: int, data: memoryview, chain: int,
                     rec: Record | None, segment_crcs: list[int]) -> ChunkMeta:
        """A write to a small chunk: its whole new bytes appended as one record (caller holds
        the chunk's lock). The blocks the write touches get new CRCs (the write's own for
        blocks it covers whole); the others keep theirs, as in a chunk file."""
        assert self.small is not None
        end = offset + len(data)
        if rec is None:
            if self.is_removed(ino):  # a late write must not bring back chunks nobody collects
                raise self._stale(ino)
            old = ChunkMeta()
            buf = bytearray(end)
        else:
            old = self._small_meta(ino, index, rec)
            buf = bytearray(self._small_bytes(ino, index, rec))
            if end > len(buf):
                buf.extend(bytes(end - len(buf)))
        buf[offset:end] = data
        length = len(buf)
        crcs = old.crcs[:] + [0] * (-(-length // BLOCK) - len(old.crcs))
        for b in range(min(old.length, offset) // BLOCK, (end - 1) // BLOCK + 1):
            bstart, bend = b * BLOCK, min((b + 1) * BLOCK, length)
            if bstart >= offset and bend <= end:
                crcs[b] = segment_crcs[b - offset // BLOCK]
            else:
                crcs[b] = _crc(memoryview(buf)[bstart:bend])
        self.small.put((ino, index), old.version + 1, chain, buf, crcs)
        self.used += length - old.length
        self.chunks += rec is None
        new = self._meta[(ino, index)] = ChunkMeta(old.version + 1, length, crcs, (1 << len(crcs)) - 1, chain=chain)
        return new

    def _promote(self, ino: int, index: int, rec: Record) -> None:
        """Move a small chunk from its log to a chunk file (same version and bytes): the
        file is made durable first, then the log records the chunk gone. A crash in
        between leaves both; the next start keeps the file (see __init__)."""
        assert self.small is not None
        meta = self._small_meta(ino, index, rec)
        self._install_file(ino, index, meta, self._small_bytes(ino, index, rec))
        self.small.kill([(ino, index)])

    def _read_small(self, ino: int, index: int, rec: Record, offset: int,
                    length: int) -> tuple[int, int, int, bytes | None, int, list[int]]:
        """The read of ``open_read_checked`` from a container log (caller holds the lock):
        always the bytes themselves (a small chunk's), with the blocks they cover checked
        against their CRCs on every read (one pass of at most 256 KiB: the log changes at
        every append, so no file time can say that its bytes did not change since)."""
        assert self.small is not None
        meta = self._small_meta(ino, index, rec)
        n = max(0, min(length, meta.length - offset))
        if n == 0:
            return -1, 0, 0, None, meta.length, []
        first, last = offset // BLOCK, (offset + n - 1) // BLOCK
        bstart = first * BLOCK
        raw = self.small.read(rec, bstart, min((last + 1) * BLOCK, meta.length) - bstart)
        view = memoryview(raw)
        for b in range(first, last + 1):
            if _crc(view[b * BLOCK - bstart : min((b + 1) * BLOCK, meta.length) - bstart]) != meta.crcs[b]:
                _stats.CHECKSUM_READ.inc()
                raise StripefsError(ErrorCode.CHECKSUM, f"chunk {ino}:{index} block {b} fails its checksum")
        crcs = self._segment_crcs(meta, offset, n, lambda s, e: view[s - bstart : e - bstart])
        data = raw if bstart == offset and len(raw) == n else raw[offset - bstart : offset - bstart + n]
        return -1, 0, n, data, meta.length, crcs

    def compact_small(self) -> int:
        """Reclaim container-log space when the sealed logs are mostly dead records: the
        oldest log's live records move forward and the log goes. Records moved."""
        if self.small is None or (number := self.small.compactable()) is None:
            return 0
        with idle_io(BULK_WRITE):  # background work: the disk's idle time only
            return self.small.compact(number, lambda key: self._lock(*key))

    def _unlink_small(self, ino: int, index: int, chain: int = 0, older_than: float | None = None,
                      sync: bool = True) -> int:
        """:meth:`_unlink_chunk` of a chunk in a container log."""
        assert self.small is not None
        with self._lock(ino, index):
            rec = self.small.get((ino, index))
            if rec is None or (older_than is not None and rec.written >= older_than):
                return 0
            if chain and not rec.bad and rec.chain not in (0, chain):
                return 0
            self.small.kill([(ino, index)], sync=sync)
            self._meta.pop((ino, index), None)
            self.used -= rec.length
            self.chunks -= 1
            return 1

    def _truncate_small(self, ino: int, index: int, length: int, rec: Record) -> None:
        """:meth:`truncate` of a chunk in a container log: a record of the shorter bytes (the
        kept whole blocks keep their CRCs; the cut block's is computed)."""
        assert self.small is not None
        if rec.bad:  # damaged: cutting it off is what was asked (as a corrupt chunk file)
            self.small.kill([(ino, index)])
            self._meta.pop((ino, index), None)
            self.chunks -= 1
            return
        if length >= rec.length:
            return
        data = self.small.read(rec, 0, length)
        nblocks = -(-length // BLOCK)
        crcs = rec.crcs[:nblocks]
        if length % BLOCK:
            crcs[-1] = _crc(memoryview(data)[(nblocks - 1) * BLOCK :])
        self.small.put((ino, index), rec.version + 1, rec.chain, data, crcs)
        self._meta[(ino, index)] = ChunkMeta(rec.version + 1, length, crcs, (1 << nblocks) - 1, chain=rec.chain)
        self.used -= rec.length - length
