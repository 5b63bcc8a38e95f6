"""The chunk store of one storage target: chunk files in a local directory, and small chunks
(up to 256 KiB) as records in container logs (storage/_small.py, storage/_small_store.py).

Layout: ``ROOT/chunks/<bucket as 3 hex>/<ino as 16 hex>.<index as 8 hex>``, the
bucket being the inode's low 12 bits (4,096 directories, made as needed and never
removed), so a new small file costs no directory of its own: no ``mkdir`` and no sync
of ``chunks/`` per file (an inode's chunks share its bucket, so removing the inode
lists one directory). A root in the layout before buckets (``chunks/<ino>/<index>``)
is moved over when the store opens (:meth:`ChunkStore._upgrade`). A chunk file is an
8 KiB header followed by the chunk's bytes (page-aligned, so reads can be
served with ``sendfile`` straight from the page cache)::

    0   8  magic  b"SFCHUNK1"
    8   8  version      bumped on every write (CRAQ-style versions build on it)
    16  8  length       bytes of data in the chunk
    24  4  block size   CRC32C granularity (64 KiB)
    28  4  blocks       number of CRCs that follow
    32  8  chain        the replication chain the chunk belongs to (resync works per chain)
    64  4n CRC32C of each block [i*B, min((i+1)*B, length))

Durability (``sync``, the default; ``--data-sync none`` turns every sync below off and
acknowledges writes from the page cache): a write is acknowledged only after ``fdatasync`` of the chunk file,
and after an ``fsync`` of its bucket directory when the file is new (and of ``chunks/``
once per bucket and process, for the bucket's own entry). Appends and writes
into holes go in place: bytes already acknowledged are never touched. When such
a write extends a partly filled block, that block's CRC covers acknowledged
bytes and new ones: the data is synced before the header that describes it,
so a crash leaves the old header (valid for the old bytes) or the new one over
bytes that are on disk. A truncate inside a block writes and syncs the
shortened header before it cuts the file, for the same reason. A write that
overlaps acknowledged bytes is copy-on-write (copy the chunk with
``copy_file_range``, patch, sync, rename), so a crash mid-write leaves the old
chunk or the new one, never a mix.

Checksums: every block has a CRC32C. Clients send the CRC of their payload and
the server checks it before writing. A read verifies the blocks it covers once;
later reads of verified blocks go straight to ``sendfile`` as long as the file
was not modified behind the server's back (its mtime is remembered).

Locks: one per chunk, made on demand (:class:`_ChunkLocks`), so a read never waits
for another chunk's write and its ``fdatasync``.

Small reads (``inline``) keep their chunk file open: a bounded cache of read
descriptors, ``FDS_PER_LOCK`` per slot of 256. Every change that replaces or removes
a chunk file (copy-on-write, a replica's copy, truncate, remove) closes the chunk's
cached descriptor under the chunk's lock, and a reader checks the link count of a
cached descriptor before using it, so a read never sees an old file's bytes; writes
in place keep it (same inode).

Caveats:
  * a chunk's header cache lives in this process; only one server may own a root.
"""

from __future__ import annotations

import errno
import functools
import os
import resource
import threading
from typing import Any

from stripefs.wire import ErrorCode, MAX_CHUNK, StripefsError, segments

from . import _stats
from ._crc import payload_crcs
from ._qos import BULK_PIECE, BULK_WRITE, idle_io
from ._header import BLOCK, HEADER_SIZE, ChunkMeta, _crc
from ._small import SMALL_MAX, SmallLog, block_crcs, locate, logs_hold
from ._small_store import SmallChunks

BUCKETS = 4096  # chunk directories: an inode's chunks live in bucket ``ino % BUCKETS``
BUCKET_GROUP = 64  # buckets made (and their entries synced) together
# Fault injection for tests (a slow disk): with ``STRIPEFS_SLOW_FSYNC_FILE`` set to a file
# name, every data sync of a store whose root holds that file first sleeps the seconds the
# file says (``fsclient.testing.faults``' "slow" fault). Unset (always, outside tests): nothing.
SLOW_FSYNC_FILE = os.environ.get("STRIPEFS_SLOW_FSYNC_FILE") or None
# Bulk writes (at least BULK_WRITE bytes, durable stores) go to the disk with O_DIRECT: the
# copy into the page cache and its writeback cost ~1 s of kernel CPU per GiB on a virtual
# machine, against ~0.1 s direct, at the same disk throughput. ``STRIPEFS_DIRECT_IO=0``: never.
DIRECT_IO = os.environ.get("STRIPEFS_DIRECT_IO", "1") != "0"
DIRECT_ALIGN = 4096  # file offsets, lengths and buffer addresses of a direct write
# Where new small chunks (at most SMALL_MAX bytes) go: ``container`` (records appended to
# the container logs of ROOT/small/, storage/_small.py) or ``files`` (a chunk file each).
# Either way a root's existing chunks of both kinds are served.
SMALL_CHUNKS = os.environ.get("STRIPEFS_SMALL_CHUNKS", "container")
FDS_PER_LOCK = 4  # chunk files kept open for small reads, per slot of the descriptor cache (256), at most


class _ChunkLock:
    """The lock of one chunk, from :class:`_ChunkLocks` (a lock object while held)."""

    __slots__ = ("_locks", "_key", "_entry")

    def __init__(self, locks: "_ChunkLocks", key: tuple[int, int]) -> None:
        self._locks, self._key, self._entry = locks, key, None

    def acquire(self) -> None:
        self._entry = self._locks.enter(self._key)
        self._entry[0].acquire()

    def release(self) -> None:
        entry, self._entry = self._entry, None
        assert entry is not None
        entry[0].release()
        self._locks.leave(self._key, entry)

    def __enter__(self) -> None:
        self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class _ChunkLocks:
    """One lock per chunk, made while someone wants it and dropped after. A fixed table of
    striped locks made unrelated chunks wait for each other: a dataloader's small read
    waited behind a checkpoint chunk's write and ``fdatasync`` (tens of milliseconds)
    whenever their keys shared a stripe."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._held: dict[tuple[int, int], list[Any]] = {}  # key -> [lock, wanted by]

    def __call__(self, key: tuple[int, int]) -> _ChunkLock:
        return _ChunkLock(self, key)

    def enter(self, key: tuple[int, int]) -> list[Any]:
        with self._mutex:
            entry = self._held.get(key)
            if entry is None:
                entry = self._held[key] = [threading.Lock(), 0]
            entry[1] += 1
            return entry

    def leave(self, key: tuple[int, int], entry: list[Any]) -> None:
        with self._mutex:
            entry[1] -= 1
            if not entry[1]:
                del self._held[key]


class VersionGap(Exception):
    """A replica was asked to apply version ``want`` but holds ``have`` < want - 1."""

    def __init__(self, have: int, want: int):
        super().__init__(f"chunk at version {have}, write is version {want}")
        self.have, self.want = have, want


def _bucket_name(ino: int) -> str:
    return f"{ino % BUCKETS:03x}"


def _chunk_name(ino: int, index: int) -> str:
    return f"{ino:016x}.{index:08x}"


def _parse_chunk_name(name: str) -> tuple[int, int] | None:
    """``(ino, index)`` of a chunk file's name; None for anything else (a ``.tmp``)."""
    ino, dot, index = name.partition(".")
    if not dot or len(ino) != 16 or len(index) != 8:
        return None
    try:
        return int(ino, 16), int(index, 16)
    except ValueError:
        return None


def chunk_path(root: str, ino: int, index: int) -> str:
    """Where chunk ``index`` of inode ``ino`` lives under the storage target ``root``
    (operators and tests that look at a target's files; the server uses :meth:`ChunkStore.path`)."""
    return os.path.join(root, "chunks", _bucket_name(ino), _chunk_name(ino, index))


def chunk_files(root: str, ino: int) -> list[str]:
    """The files of inode ``ino``'s chunks held under the storage target ``root``."""
    bucket = os.path.join(root, "chunks", _bucket_name(ino))
    try:
        names = os.listdir(bucket)
    except FileNotFoundError:
        return []
    prefix = f"{ino:016x}."
    return sorted(os.path.join(bucket, n) for n in names if n.startswith(prefix) and _parse_chunk_name(n))


def chunk_places(root: str, ino: int) -> list[tuple[int, str, int]]:
    """Where inode ``ino``'s chunks lie under the storage target ``root``, in either engine:
    ``[(index, file, offset of the chunk's first byte in it)]`` (a chunk file, or the
    container log holding its latest record). For operators and tests that look at, or
    damage, a target's bytes; reads the files and changes nothing."""
    out = [(key[1], path, HEADER_SIZE) for path in chunk_files(root, ino)
           if (key := _parse_chunk_name(os.path.basename(path))) is not None]
    out += [(index, path, offset) for (i, index), (path, offset, _n) in locate(root).items() if i == ino]
    return sorted(out)


class ChunkStore(SmallChunks):
    """Chunk files of one target. Methods block (disk I/O): call them from worker threads."""

    def __init__(self, root: str, sync: bool = True, small: bool | None = None):
        self.root = os.path.abspath(root)
        # False (``--data-sync none``): no fdatasync or directory fsync at all; a write is
        # acknowledged once in the page cache (it survives a kill of this process, not a
        # power loss or a kernel crash). The order of the writes stays as with syncs.
        self.sync = sync
        self.chunk_root = os.path.join(self.root, "chunks")
        os.makedirs(self.chunk_root, exist_ok=True)
        # One empty file per removed inode (inode numbers are never reused): late reads
        # and writes of a removed file fail with STALE_FILE instead of meeting a hole.
        self.tomb_root = os.path.join(self.root, "removed")
        os.makedirs(self.tomb_root, exist_ok=True)
        self._meta: dict[tuple[int, int], ChunkMeta] = {}
        self._chunk_locks = _ChunkLocks()
        # Read descriptors of recently read chunks, in 256 slots by key, each dict changed
        # under its slot's lock (held for dict operations only, never across I/O). A cached
        # descriptor may outlive its file (replaced by a copy-on-write rename, removed):
        # a reader checks its link count before using it (see open_read_checked).
        self._fd_locks = [threading.Lock() for _ in range(256)]
        self._fds: list[dict[tuple[int, int], int]] = [{} for _ in range(256)]
        # At most a quarter of the process's descriptor limit (connections need the rest).
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self._fds_per_lock = FDS_PER_LOCK if soft == resource.RLIM_INFINITY else min(FDS_PER_LOCK, soft // 1024)
        self._mlock = threading.Lock()
        # Buckets whose directory exists (made here or found) and whose entry in ``chunks/``
        # this process has fsynced: a first chunk in any other bucket makes the directory
        # and fsyncs ``chunks/`` before it is acknowledged (see _bucket_ready).
        self._synced_buckets: set[str] = set()
        self.used = 0
        self.chunks = 0
        self.direct = DIRECT_IO and sync  # False once the file system refused O_DIRECT (tmpfs)
        self.direct_bytes = 0  # written with O_DIRECT (see _write_data)
        self._upgrade()
        files = self._scan_usage()
        # Small chunks in container logs (storage/_small.py): new ones when ``small`` (default
        # from STRIPEFS_SMALL_CHUNKS); a root that has logs is always read.
        self.small_max = SMALL_MAX if (SMALL_CHUNKS == "container" if small is None else small) else 0
        self.small: SmallLog | None = None
        small_root = os.path.join(self.root, "small")
        if self.small_max or os.path.isdir(small_root):
            gone = {int(n, 16) for n in os.listdir(self.tomb_root) if len(n) == 16}
            slow = functools.partial(_slow_fsync, self.root) if SLOW_FSYNC_FILE is not None else None
            self.small = SmallLog(small_root, sync, removed=gone.__contains__, before_sync=slow)
            # A chunk moved to a file (it outgrew the logs) whose removal record was not
            # synced yet when the server stopped: the file is the newer copy.
            self.small.kill([k for k in self.small.keys() if k in files])
            used, count = self.small.usage()
            self.used += used
            self.chunks += count

    # -- paths and bookkeeping ----------------------------------------------------------
    def _dir(self, ino: int) -> str:
        """The inode's bucket directory."""
        return os.path.join(self.chunk_root, _bucket_name(ino))

    def path(self, ino: int, index: int) -> str:
        return os.path.join(self.chunk_root, _bucket_name(ino), _chunk_name(ino, index))

    def _upgrade(self) -> None:
        """Move the chunks of a root written before buckets (``chunks/<ino>/<index>``)
        into their buckets. Each move is a rename; the buckets are synced before an
        emptied inode directory is removed, so a crash at any point leaves every chunk
        under one of its two names, and the next start goes on from there."""
        old = [d for d in os.listdir(self.chunk_root) if len(d) == 16]
        for d in old:
            try:
                ino = int(d, 16)
                names = os.listdir(os.path.join(self.chunk_root, d))
            except (ValueError, NotADirectoryError):
                continue
            self._bucket_ready(ino)
            for name in names:
                src = os.path.join(self.chunk_root, d, name)
                try:
                    index = int(name, 16)
                except ValueError:  # an interrupted write's .tmp: never acknowledged
                    os.unlink(src)
                    continue
                os.rename(src, self.path(ino, index))
            self._sync_dir(self._dir(ino))
            os.rmdir(os.path.join(self.chunk_root, d))
        if old:
            self._sync_dir(self.chunk_root)

    def _lock(self, ino: int, index: int) -> _ChunkLock:
        """The chunk's own lock: every change of its file and header, and every read that
        loads its header, holds it."""
        return self._chunk_locks((ino, index))

    def _forget_fd(self, ino: int, index: int) -> None:
        """Close the chunk's cached read descriptor (caller holds the chunk's lock): its
        file is being replaced, cut or removed."""
        slot = hash((ino, index)) & 255
        with self._fd_locks[slot]:
            fd = self._fds[slot].pop((ino, index), None)
        if fd is not None:
            os.close(fd)

    def _forget_ino_fds(self, ino: int) -> None:
        """Close every cached read descriptor of an inode (its directory is going)."""
        for lock, fds in zip(self._fd_locks, self._fds):
            with lock:
                gone = [fds.pop(k) for k in [k for k in fds if k[0] == ino]]
            for fd in gone:
                os.close(fd)

    def close(self) -> None:
        """Close the cached read descriptors (the store stays usable)."""
        for lock, fds in zip(self._fd_locks, self._fds):
            with lock:
                gone = list(fds.values())
                fds.clear()
            for fd in gone:
                os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110 -- at interpreter exit, or a half-built store
            pass

    def _scan_usage(self) -> set[tuple[int, int]]:
        """Count the chunk files' bytes; sweep interrupted writes. Returns the files' keys."""
        used = chunks = 0
        keys = set()
        for dirpath, _dirs, files in os.walk(self.chunk_root):
            for name in files:
                if name.endswith(".tmp"):
                    os.unlink(os.path.join(dirpath, name))  # an interrupted copy-on-write
                    continue
                try:
                    used += max(0, os.stat(os.path.join(dirpath, name)).st_size - HEADER_SIZE)
                    chunks += 1
                except FileNotFoundError:
                    continue
                if (key := _parse_chunk_name(name)) is not None:
                    keys.add(key)
        self.used, self.chunks = used, chunks
        return keys

    def capacity(self) -> tuple[int, int]:
        """(total bytes, free bytes) of the file system holding the target."""
        st = os.statvfs(self.root)
        return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize

    @functools.cached_property
    def fsid(self) -> str:
        """The file system holding the target, as an id that targets sharing it share (its
        device and the kernel's file system id): the metadata service counts it once.
        Found once (a root does not move to another file system under a running server)."""
        return f"{os.stat(self.root).st_dev:x}:{os.statvfs(self.root).f_fsid:x}"

    def _load(self, ino: int, index: int, fd: int | None = None) -> ChunkMeta | None:
        """The chunk's header, from the cache or its file. The caller holds the chunk's lock:
        a header read from the file a copy-on-write write is replacing, and cached after the
        write cached the new one, would be taken for the new file's (the next append then
        writes the old block CRCs over new bytes: a permanent CHECKSUM error)."""
        key = (ino, index)
        meta = self._meta.get(key)
        if meta is not None:
            return meta
        if self.small is not None and (rec := self.small.get(key)) is not None:
            meta = self._small_meta(ino, index, rec)
            self._meta[key] = meta
            return meta
        own = fd is None
        try:
            if own:
                fd = os.open(self.path(ino, index), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            meta = ChunkMeta.unpack(os.pread(fd, HEADER_SIZE, 0))  # type: ignore[arg-type]
            meta.mtime_ns = os.fstat(fd).st_mtime_ns  # type: ignore[arg-type]
        finally:
            if own:
                os.close(fd)  # type: ignore[arg-type]
        with self._mlock:
            if len(self._meta) > 200_000:
                self._meta.clear()
            self._meta[key] = meta
        return meta

    # -- write ----------------------------------------------------------------------------
    def write(self, ino: int, index: int, offset: int, data: memoryview, crc: int, chunk_size: int,
              chain: int = 0, version: int | None = None, qos: int = 0) -> ChunkMeta:
        """Write ``data`` at ``offset`` of a chunk, durably. Returns the new meta.

        ``qos``: the write's traffic class (storage/_qos.py): bulk ones at idle I/O priority.

        ``version``: the chunk version this write creates (replicas get it from the
        chain head); None means "the next one". A write whose version is already
        applied is acknowledged without writing (idempotent retry); a replica that
        missed versions gets :class:`VersionGap` and must fetch the whole chunk.

        Raises:
            StripefsError: CHECKSUM if ``crc`` does not match the payload, INVALID
            for ranges beyond the chunk size, NO_SPACE when the disk is full.
        """
        end = offset + len(data)
        if offset < 0 or chunk_size > MAX_CHUNK or end > chunk_size:
            raise StripefsError(ErrorCode.INVALID, f"write [{offset}, {end}) outside a chunk of {chunk_size}")
        # One pass: the blocks' CRCs (kept in the header) and the whole payload's from them.
        segment_crcs, whole = payload_crcs(data, offset)
        if whole != crc:
            _stats.CHECKSUM_TRANSIT.inc()
            raise StripefsError(ErrorCode.CHECKSUM, "payload checksum mismatch (corrupted in transit)")
        with self._lock(ino, index):
            if not len(data):
                return self._load(ino, index) or ChunkMeta()
            if version is not None:
                cur = self._load(ino, index) or ChunkMeta()
                if cur.version >= version:
                    return cur
                if cur.version != version - 1:
                    raise VersionGap(cur.version, version)
            try:
                with idle_io(len(data), qos):
                    return self._write_locked(ino, index, offset, data, chain, segment_crcs, chunk_size)
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    raise StripefsError(ErrorCode.NO_SPACE, "storage target is full") from exc
                raise

    def _write_locked(self, ino: int, index: int, offset: int, data: memoryview, chain: int,
                      segment_crcs: list[int] | None = None, chunk_size: int = 0) -> ChunkMeta:
        if segment_crcs is None:  # a caller that has not checked the payload yet
            segment_crcs = payload_crcs(data, offset)[0]
        path = self.path(ino, index)
        rec = self.small.get((ino, index)) if self.small is not None else None
        # A chunk in the logs has no file (a move to a file ends with its removal from them,
        # under the chunk's lock): only a chunk not there may be one.
        fresh = rec is not None or not os.path.exists(path)
        if self.small is not None and fresh:
            end = offset + len(data)
            length = max(rec.length, end) if rec is not None else end
            # Capped (logs_hold): a whole chunk of a striped file (``chunk_size`` bytes), a
            # record grown by a write past its end; one written from byte 0 is written whole.
            capped = (0 < chunk_size <= end) or (rec is not None and length > rec.length and offset > 0)
            if logs_hold(length, self.small_max, capped=capped):
                return self._write_small(ino, index, offset, data, chain, rec, segment_crcs)
            if rec is not None:  # outgrown: a chunk file from now on
                self._promote(ino, index, rec)
                fresh = False
        target = path + ".tmp" if fresh else path
        if fresh:
            if self.is_removed(ino):  # a late write must not bring back chunks nobody collects
                raise self._stale(ino)
            self._bucket_ready(ino)
            # A new chunk appears under its name only with its header written: a server
            # killed in between leaves a .tmp (swept at start), never a chunk whose
            # header is zeros, which would read as corrupt until a resync replaced it.
            fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            meta = ChunkMeta()
        else:
            fd = os.open(path, os.O_RDWR)
            meta = self._load(ino, index, fd) or ChunkMeta()
        meta.chain = chain
        try:
            if offset < meta.length:
                os.close(fd)
                fd = -1
                return self._write_cow(ino, index, offset, data, meta, segment_crcs)
            if offset > meta.length and not fresh and os.fstat(fd).st_size > HEADER_SIZE + meta.length:
                # Bytes past the header's length are not data: an append killed between
                # its data and its header, a truncate killed between its header and its
                # cut. A gap this write leaves must read as zeros, not as those bytes
                # (the CRCs below are computed over what is on disk).
                os.ftruncate(fd, HEADER_SIZE + meta.length)
            self._write_data(target, fd, data, HEADER_SIZE + offset)
            if meta.length % BLOCK:
                # The last block holds acknowledged bytes and gets a CRC over old and
                # new ones: the new bytes must be on disk before a header that says so.
                self._datasync(fd)
            new = self._commit_meta(fd, meta, offset, len(data), segment_crcs)
            self._datasync(fd)
            new.mtime_ns = os.fstat(fd).st_mtime_ns
        finally:
            if fd >= 0:
                os.close(fd)
        if fresh:
            os.rename(path + ".tmp", path)
            self._sync_dir(self._dir(ino))
            self.chunks += 1
        self.used += new.length - meta.length
        self._meta[(ino, index)] = new
        return new

    def _install_file(self, ino: int, index: int, meta: ChunkMeta, view: Any) -> None:
        """Write a whole chunk file (header, bytes), durably, under its final name."""
        self._bucket_ready(ino)
        path = self.path(ino, index)
        tmp = path + ".tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.pwrite(fd, meta.pack(), 0)
            with idle_io(len(view)):  # a resync's copy is background work
                self._write_pieces(fd, memoryview(view).cast("B"), HEADER_SIZE)
                self._datasync(fd)
            meta.mtime_ns = os.fstat(fd).st_mtime_ns
        finally:
            os.close(fd)
        self._forget_fd(ino, index)
        os.rename(tmp, path)
        self._sync_dir(self._dir(ino))
        self._meta[(ino, index)] = meta

    def _write_cow(self, ino: int, index: int, offset: int, data: memoryview, meta: ChunkMeta,
                   segment_crcs: list[int]) -> ChunkMeta:
        path = self.path(ino, index)
        tmp = path + ".tmp"
        src = os.open(path, os.O_RDONLY)
        dst = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            size = os.fstat(src).st_size
            copied = 0
            while copied < size:
                n = os.copy_file_range(src, dst, size - copied, copied, copied)
                if n == 0:
                    break
                copied += n
            os.pwrite(dst, data, HEADER_SIZE + offset)
            new = self._commit_meta(dst, meta, offset, len(data), segment_crcs)
            self._datasync(dst)
            new.mtime_ns = os.fstat(dst).st_mtime_ns
        finally:
            os.close(src)
            os.close(dst)
        self._forget_fd(ino, index)
        os.rename(tmp, path)
        self._sync_dir(self._dir(ino))
        self.used += new.length - meta.length
        self._meta[(ino, index)] = new
        return new

    def _write_data(self, path: str, fd: int, data: memoryview, pos: int) -> None:
        """Write ``data`` at byte ``pos`` of the chunk file ``path`` (open as ``fd``), past
        the bytes the header counts (an append, or a new chunk): a bulk write's whole
        4 KiB blocks with ``O_DIRECT`` (see :data:`DIRECT_IO`) through a descriptor of its
        own, the rest through the page cache. The caller's ``fdatasync`` then makes both
        durable (a direct write may sit in the disk's cache until that flush).

        Direct I/O needs the file offset, the length and the buffer's address aligned: a
        payload received into a pooled page-aligned buffer is; any other buffer is
        refused by the kernel (EINVAL, nothing written) and goes through the page cache.
        Coherent with buffered reads of the same file: the kernel writes back and drops
        the cached pages of the range first (none, past the header's length).

        A bulk write goes in pieces of :data:`~stripefs.storage._qos.BULK_PIECE` bytes, each
        flushed before the next is written (all but the last: the caller's sync covers it),
        so that a read of the same disk never waits behind more than one piece's flush
        (storage/_qos.py). A kill between pieces leaves bytes past the header's length,
        which are not data (see :meth:`_write_locked`)."""
        done = 0
        if self.direct and len(data) >= BULK_WRITE and pos % DIRECT_ALIGN == 0:
            try:
                dfd = os.open(path, os.O_WRONLY | os.O_DIRECT)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct = False  # the file system takes no direct I/O
            else:
                try:  # refused at the first piece if at all (every piece is aligned alike)
                    done = self._write_pieces(dfd, data[:len(data) - len(data) % DIRECT_ALIGN], pos)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                finally:
                    os.close(dfd)
                with self._mlock:
                    self.direct_bytes += done
        self._write_pieces(fd, data, pos, done)

    def _piece(self, nbytes: int) -> int:
        """How many bytes of a write of ``nbytes`` go to the disk between two flushes."""
        if nbytes >= BULK_WRITE and self.sync and BULK_PIECE > 0:
            return max(DIRECT_ALIGN, BULK_PIECE - BULK_PIECE % DIRECT_ALIGN)
        return max(nbytes, 1)

    def _write_pieces(self, fd: int, data: Any, pos: int, done: int = 0) -> int:
        """``pwrite`` ``data[done:]`` at byte ``pos + done`` of ``fd``; a bulk write in
        pieces, each flushed before the next but the last (see :meth:`_write_data`).
        Returns ``len(data)``."""
        piece = self._piece(len(data))
        while done < len(data):
            done += os.pwrite(fd, data[done:done + piece], pos + done)
            if done < len(data) and piece < len(data):
                self._datasync(fd)
        return done

    def _commit_meta(self, fd: int, meta: ChunkMeta, offset: int, n: int, segment_crcs: list[int]) -> ChunkMeta:
        """The CRCs of the blocks a write touched (those it covers whole: its segments'
        CRCs, from :func:`payload_crcs`); write the header (no sync)."""
        end = offset + n
        length = max(meta.length, end)
        crcs = meta.crcs[:]
        nblocks = -(-length // BLOCK)
        crcs.extend([0] * (nblocks - len(crcs)))
        first = min(meta.length, offset) // BLOCK
        verified = meta.verified
        for b in range(first, (end - 1) // BLOCK + 1):
            bstart, bend = b * BLOCK, min((b + 1) * BLOCK, length)
            if bstart >= offset and bend <= end:  # the write's segment b covers it exactly
                crcs[b] = segment_crcs[b - offset // BLOCK]
            else:  # partly old bytes, partly new, or a hole: read back what is on disk now
                crcs[b] = _crc(os.pread(fd, bend - bstart, HEADER_SIZE + bstart))
            verified |= 1 << b
        new = ChunkMeta(meta.version + 1, length, crcs, verified, chain=meta.chain)
        os.pwrite(fd, new.pack(), 0)
        return new

    def _bucket_ready(self, ino: int) -> None:
        """Make the inode's bucket directory, and its entry in ``chunks/`` durable, before
        a new chunk in it is written. Not only the thread whose ``mkdir`` made it: a first
        write to another chunk of the bucket, at the same time, finds the directory there
        but its entry maybe not on disk yet. Once per bucket and process (a restarted
        server syncs again: a killed predecessor may have left an entry only cached).

        The buckets are made :data:`BUCKET_GROUP` at a time, with one sync of ``chunks/``
        for the group: the first chunk of each new inode no longer pays a ``mkdir`` and a
        second directory sync (it did for each of the first 4,096 inodes a process saw)."""
        bucket = _bucket_name(ino)
        if bucket in self._synced_buckets:
            return
        first = ino % BUCKETS // BUCKET_GROUP * BUCKET_GROUP
        group = [f"{b:03x}" for b in range(first, first + BUCKET_GROUP)]
        for name in group:
            try:
                os.mkdir(os.path.join(self.chunk_root, name))
            except FileExistsError:
                pass
        self._sync_dir(self.chunk_root)
        with self._mlock:
            self._synced_buckets.update(group)

    def _datasync(self, fd: int) -> None:
        if self.sync:
            if SLOW_FSYNC_FILE is not None:
                _slow_fsync(self.root)
            with _stats.FSYNC_DATA.time():
                os.fdatasync(fd)

    def _sync_dir(self, path: str) -> None:
        if self.sync:
            self._fsync_dir(path)

    @staticmethod
    def _fsync_dir(path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with _stats.FSYNC_DIR.time():
                os.fsync(fd)
        finally:
            os.close(fd)

    # -- read -----------------------------------------------------------------------------
    def open_read(self, ino: int, index: int, offset: int, length: int) -> tuple[int, int, int, bytes | None, int]:
        """:meth:`open_read_checked` without the segment checksums."""
        return self.open_read_checked(ino, index, offset, length)[:5]  # type: ignore[return-value]

    def open_read_checked(self, ino: int, index: int, offset: int, length: int,
                          inline: int = 0) -> tuple[int, int, int, bytes | None, int, list[int]]:
        """Prepare a read: ``(fd, file_offset, n, data, chunk_length, crcs)``.

        ``crcs`` are the CRC32C of the payload's segments (``wire.segments``): the
        stored CRC for a whole block, computed for the partial blocks at the ends.

        When the covered blocks are already verified, ``data`` is None and the
        caller sends ``n`` bytes from ``fd`` at ``file_offset`` with sendfile and
        closes ``fd``. Otherwise the blocks are read and verified here and
        ``data`` holds the bytes (``fd`` is -1). ``n == 0`` for a missing chunk
        (a hole) or a read at/after the chunk's end.

        ``inline``: a read of at most this many bytes always comes back as ``data``
        (one ``pread`` of the chunk file, kept open in the descriptor cache; the bytes
        the CRCs were computed over are the bytes sent).

        Raises:
            StripefsError: CHECKSUM (EIO) when stored data does not match its CRC.
        """
        if offset < 0 or length < 0 or offset + length > MAX_CHUNK:
            raise StripefsError(ErrorCode.INVALID, "read range outside a chunk")
        key = (ino, index)
        slot = hash(key) & 255
        with self._lock(ino, index):
            # Opened under the lock: a copy-on-write rename between the open and the lock would
            # leave fd on the old file, and reloading the header from it would cache the old
            # meta for the new file (its CRCs then fail reads, and the next write builds on it).
            cached = length <= inline
            if self.small is not None and (rec := self.small.get(key)) is not None:
                return self._read_small(ino, index, rec, offset, length)
            fds, fd_lock = self._fds[slot], self._fd_locks[slot]
            fd = -1
            if cached:
                with fd_lock:
                    fd = fds.pop(key, -1)
                if fd >= 0 and os.fstat(fd).st_nlink == 0:
                    os.close(fd)  # its file was replaced or removed since it was cached
                    fd = -1
            if fd < 0:
                try:
                    fd = os.open(self.path(ino, index), os.O_RDONLY)
                except FileNotFoundError:
                    if self.is_removed(ino):
                        raise self._stale(ino) from None
                    return -1, 0, 0, None, 0, []  # a hole
            try:
                out = self._open_read_locked(ino, index, offset, length, fd, cached)
            except BaseException:
                os.close(fd)
                raise
            if cached and self._fds_per_lock:
                with fd_lock:
                    evicted = [fds.pop(next(iter(fds))) for _ in range(len(fds) - self._fds_per_lock + 1)]
                    fds[key] = fd  # last: the most recently read
                for old in evicted:  # the least recently read go
                    os.close(old)
            elif out[0] < 0:
                os.close(fd)
            return out

    def _open_read_locked(self, ino: int, index: int, offset: int, length: int, fd: int,
                          inline: bool = False) -> tuple[int, int, int, bytes | None, int, list[int]]:
        """The read of ``open_read_checked`` on ``fd``; the caller closes ``fd`` unless it
        is returned (``inline``: never returned)."""
        meta = self._load(ino, index, fd)
        assert meta is not None
        st = os.fstat(fd)
        if st.st_mtime_ns != meta.mtime_ns:  # changed behind our back: trust nothing
            self._meta.pop((ino, index), None)
            meta = self._load(ino, index, fd)
            assert meta is not None
        n = max(0, min(length, meta.length - offset))
        if n == 0:
            return -1, 0, 0, None, meta.length, []
        first, last = offset // BLOCK, (offset + n - 1) // BLOCK
        mask = ((1 << (last + 1)) - 1) ^ ((1 << first) - 1)
        if meta.verified & mask == mask:
            if inline:
                raw = os.pread(fd, n, HEADER_SIZE + offset)
                if len(raw) != n:
                    raise StripefsError(ErrorCode.CHECKSUM, f"chunk {ino}:{index} is shorter than its header says")
                view = memoryview(raw)
                crcs = self._segment_crcs(meta, offset, n, lambda s, e: view[s - offset : e - offset])
                return -1, 0, n, raw, meta.length, crcs
            crcs = self._segment_crcs(meta, offset, n, lambda s, e: os.pread(fd, e - s, HEADER_SIZE + s))
            return fd, HEADER_SIZE + offset, n, None, meta.length, crcs
        bstart = first * BLOCK
        raw = os.pread(fd, min((last + 1) * BLOCK, meta.length) - bstart, HEADER_SIZE + bstart)
        view = memoryview(raw)
        for b in range(first, last + 1):
            s, e = b * BLOCK - bstart, min((b + 1) * BLOCK, meta.length) - bstart
            if _crc(view[s:e]) != meta.crcs[b]:
                _stats.CHECKSUM_READ.inc()
                raise StripefsError(ErrorCode.CHECKSUM, f"chunk {ino}:{index} block {b} fails its checksum")
        meta.verified |= mask
        crcs = self._segment_crcs(meta, offset, n, lambda s, e: view[s - bstart : e - bstart])
        return -1, 0, n, raw[offset - bstart : offset - bstart + n], meta.length, crcs

    @staticmethod
    def _segment_crcs(meta: "ChunkMeta", offset: int, n: int, read: Any) -> list[int]:
        """CRC32C per payload segment: the stored CRC of a whole block, else ``read(s, e)``'s."""
        out = []
        for s, e in segments(offset, n):
            b = s // BLOCK
            if s == b * BLOCK and e == min((b + 1) * BLOCK, meta.length):
                out.append(meta.crcs[b])  # verified block: its stored CRC, no pass over the data
            else:
                out.append(_crc(read(s, e)))
        return out

    # -- remove / truncate / stat -------------------------------------------------------
    def _tombstone(self, ino: int) -> str:
        return os.path.join(self.tomb_root, f"{ino:016x}")

    def is_removed(self, ino: int) -> bool:
        """Was the inode removed for good (``remove(..., forget=True)``)?"""
        return os.path.exists(self._tombstone(ino))

    def _stale(self, ino: int) -> StripefsError:
        return StripefsError(ErrorCode.STALE_FILE, f"inode {ino} was removed")

    def remove(self, ino: int, from_index: int = 0, forget: bool = False, chain: int = 0) -> int:
        """Remove chunks ``>= from_index`` of an inode. Returns how many went.

        ``forget`` (the file is gone): the tombstone is made durable first, so no
        crash can leave a removed inode without chunks and without a tombstone.
        ``chain``: only chunks of that chain (a cut ordered through one chain; the
        other chains' chunks here are cut by theirs). One whose header names no chain,
        or is unreadable, goes.
        """
        if forget:
            fd = os.open(self._tombstone(ino), os.O_WRONLY | os.O_CREAT, 0o600)
            os.close(fd)
            self._sync_dir(self.tomb_root)
        removed = 0
        if self.small is not None:
            for index in self.small.indexes(ino):
                if index >= from_index:
                    # Synced, unless the tombstone (synced above) already says it all.
                    removed += self._unlink_small(ino, index, chain, sync=not forget)
        # Twice for a whole inode: a chunk whose write passed its tombstone check just
        # before the tombstone was made may appear after the first listing.
        for _ in range(2 if from_index == 0 else 1):
            for index in self._indexes(ino):
                if index >= from_index:
                    removed += self._unlink_chunk(ino, index, chain)
        if from_index == 0:
            self._forget_ino_fds(ino)
        return removed

    def _indexes(self, ino: int) -> list[int]:
        """The indexes of the inode's chunks held here (one listing of its bucket)."""
        prefix = f"{ino:016x}."
        try:
            names = os.listdir(self._dir(ino))
        except FileNotFoundError:
            return []
        out = []
        for name in names:
            if name.startswith(prefix) and (key := _parse_chunk_name(name)) is not None:
                out.append(key[1])
        return out

    def _unlink_chunk(self, ino: int, index: int, chain: int = 0, older_than: float | None = None) -> int:
        """Remove one chunk file under its lock (of ``chain`` only, if set; only if its file
        was last written before ``older_than``, a ``time.time()``, if set): 1 if it went, else 0."""
        if self.small is not None and (ino, index) in self.small.index:
            return self._unlink_small(ino, index, chain, older_than=older_than)
        with self._lock(ino, index):
            if older_than is not None:
                try:
                    if os.stat(self.path(ino, index)).st_mtime >= older_than:
                        return 0
                except FileNotFoundError:
                    return 0
            try:
                meta = self._load(ino, index)
            except StripefsError:  # a corrupt header must not keep garbage alive
                meta = None
            if chain and meta is not None and meta.chain not in (0, chain):  # (0: no chain recorded)
                return 0
            self._forget_fd(ino, index)
            try:
                os.unlink(self.path(ino, index))
            except FileNotFoundError:
                return 0
            self._meta.pop((ino, index), None)
            self.used -= meta.length if meta else 0
            self.chunks -= 1
            return 1

    def truncate(self, ino: int, index: int, length: int) -> None:
        """Cut one chunk to ``length`` bytes (the chunk holding a file's new end).

        Raises:
            StripefsError: INVALID for a length outside ``0..MAX_CHUNK`` (checked before
                the file is touched: a negative length would cut into the header).
        """
        if not 0 <= length <= MAX_CHUNK:
            raise StripefsError(ErrorCode.INVALID, f"chunk length {length} outside 0..{MAX_CHUNK}")
        with self._lock(ino, index):
            if self.small is not None and (rec := self.small.get((ino, index))) is not None:
                return self._truncate_small(ino, index, length, rec)
            self._forget_fd(ino, index)
            try:
                fd = os.open(self.path(ino, index), os.O_RDWR)
            except FileNotFoundError:
                return
            try:
                try:
                    meta = self._load(ino, index, fd)
                except StripefsError:  # corrupt header: cutting it off is what was asked
                    os.ftruncate(fd, 0)
                    os.unlink(self.path(ino, index))
                    self._meta.pop((ino, index), None)
                    return
                if meta is None or length >= meta.length:
                    return
                nblocks = -(-length // BLOCK)
                crcs = meta.crcs[:nblocks]
                if length % BLOCK:  # the bytes before the cut do not change: their CRC now
                    b = nblocks - 1
                    crcs[b] = _crc(os.pread(fd, length - b * BLOCK, HEADER_SIZE + b * BLOCK))
                new = ChunkMeta(meta.version + 1, length, crcs, meta.verified & ((1 << nblocks) - 1), chain=meta.chain)
                # Header first, synced, then the cut: a crash in between leaves a header
                # that is right for the bytes it covers (the old one, or the new one
                # over a file not cut yet), never an old CRC over a cut block.
                os.pwrite(fd, new.pack(), 0)
                self._datasync(fd)
                os.ftruncate(fd, HEADER_SIZE + length)
                self._datasync(fd)
                new.mtime_ns = os.fstat(fd).st_mtime_ns
                self.used -= meta.length - length
                self._meta[(ino, index)] = new
            finally:
                os.close(fd)

    def stat(self, ino: int, index: int) -> ChunkMeta | None:
        with self._lock(ino, index):
            return self._load(ino, index)

    # -- replication support ---------------------------------------------------------------
    def replace(self, ino: int, index: int, chain: int, version: int, data: bytes | bytearray | memoryview, *, force: bool = False,
                expect: tuple[int, int] | None = None, logged: bool | None = None) -> ChunkMeta | None:
        """Install a whole chunk copied from a replica.

        Installed if newer than ours (a replica catching up), with ``force`` (repair, a
        diverged copy) or, with ``expect`` = ``(version, digest)``, only while our copy
        is still exactly that (``(-1, 0)``: none): a resync decided to replace what it
        saw, and a write forwarded meanwhile must not be overwritten by an older copy.
        ``logged``: whether the source holds it in its container logs (None: a source that
        does not say); the copy lives where the source's does, as far as this store can.
        Returns the chunk's meta now (None: no chunk, left so because ``expect`` failed).
        """
        with self._lock(ino, index):
            try:
                cur = self._load(ino, index)
            except StripefsError:  # our copy's header is corrupt: replace it
                cur = None
            if expect is not None:
                seen = (cur.version, cur.digest) if cur is not None else (-1, 0)
                if seen != expect:
                    return cur
            elif cur is not None and cur.version >= version and not force:
                return cur
            if self.is_removed(ino):  # a copy from a peer that has not collected it yet
                raise self._stale(ino)
            view = memoryview(data)
            crcs = block_crcs(view)
            new = ChunkMeta(version, len(view), crcs, (1 << len(crcs)) - 1, chain=chain)
            key = (ino, index)
            in_log = self.logged(ino, index)
            # Where the source holds it; from a source that does not say, a copy of more than
            # GROW_MAX goes to the logs only when the chunk is there already (the chunk size,
            # which tells a sample from a striped file's whole chunk, is not known here).
            goes = logged is not False and logs_hold(len(view), self.small_max, capped=logged is None and not in_log)
            if self.small is not None and goes and (in_log or not os.path.exists(self.path(ino, index))):
                self.small.put(key, version, chain, view, crcs)
                self._meta[key] = new
                self.used += new.length - (cur.length if cur else 0)
                self.chunks += cur is None
                return new
            self._install_file(ino, index, new, view)
            if in_log:
                assert self.small is not None
                self.small.kill([key])  # the file is durable: the log's copy goes
            self.used += new.length - (cur.length if cur else 0)
            self.chunks += cur is None
            return new

    def remove_one(self, ino: int, index: int, older_than: float | None = None) -> bool:
        """Remove one chunk; with ``older_than`` only if its file was last written before
        that time, checked under the chunk's lock (a write landing meanwhile keeps it).
        Whether it went."""
        return bool(self._unlink_chunk(ino, index, older_than=older_than))

    def drop_chain(self, chain: int) -> int:
        """Delete every chunk of ``chain`` held here (the chain moved to another server)."""
        items = self.list_chain(chain)
        for ino, index, *_rest in items:
            self.remove_one(ino, index)
        return len(items)

    def logged(self, ino: int, index: int) -> bool:
        """Whether the chunk is a record of the container logs now (a hint for where a copy
        goes: it may move to a file a moment later)."""
        return self.small is not None and (ino, index) in self.small.index

    def read_whole(self, ino: int, index: int) -> tuple[ChunkMeta, bytes] | None:
        """A whole chunk, verified against its CRCs (for copying to a replica)."""
        with self._lock(ino, index):
            if self.small is not None and (rec := self.small.get((ino, index))) is not None:
                return self._small_meta(ino, index, rec), self._small_bytes(ino, index, rec)
            meta = self._load(ino, index)
            if meta is None:
                return None
            with open(self.path(ino, index), "rb") as f:
                f.seek(HEADER_SIZE)
                data = f.read(meta.length)
        self._verify(ino, index, meta, data)
        return meta, data

    def _verify(self, ino: int, index: int, meta: ChunkMeta, data: bytes) -> None:
        view = memoryview(data)
        if len(view) != meta.length:
            raise StripefsError(ErrorCode.CHECKSUM, f"chunk {ino}:{index} is shorter than its header says")
        for b, crc in enumerate(meta.crcs):
            if _crc(view[b * BLOCK : (b + 1) * BLOCK]) != crc:
                raise StripefsError(ErrorCode.CHECKSUM, f"chunk {ino}:{index} block {b} fails its checksum")

    def all_chunks(self) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        for d in os.listdir(self.chunk_root):
            try:
                names = os.listdir(os.path.join(self.chunk_root, d))
            except (NotADirectoryError, FileNotFoundError):
                continue
            out.extend(key for n in names if (key := _parse_chunk_name(n)) is not None)
        if self.small is not None:
            out.extend(self.small.keys())
        return out

    def chunks_by_chain(self) -> dict[int, list[tuple[int, int, int, int, int]]]:
        """Every chunk held here, grouped by chain: ``{chain: [(ino, index, version, length, digest)]}``.

        One directory walk (headers come from the in-memory cache after the first
        read); each chain's list is in (ino, index) order, so it can be paged.
        """
        out: dict[int, list[tuple[int, int, int, int, int]]] = {}
        for ino, index in sorted(self.all_chunks()):
            try:
                with self._lock(ino, index):
                    meta = self._load(ino, index)
            except StripefsError:
                meta = None  # a corrupt header: scrub reports it
            if meta is not None:
                out.setdefault(meta.chain, []).append((ino, index, meta.version, meta.length, meta.digest))
        return out

    def list_chain(self, chain: int, after: tuple[int, int] | None = None,
                   limit: int = 0) -> list[tuple[int, int, int, int, int]]:
        """``(ino, index, version, length, digest)`` of the chunks of ``chain`` held here.

        ``after``/``limit``: a page, the first ``limit`` (> 0) chunks past ``after``.
        """
        items = self.chunks_by_chain().get(chain, [])
        if after is not None:
            items = [c for c in items if (c[0], c[1]) > after]
        return items[:limit] if limit > 0 else items

    def scrub(self) -> tuple[int, list[tuple[int, int, int]]]:
        """Re-read and verify every chunk from disk: ``(checked, [(ino, index, chain)] bad)``.

        Each chunk is read under its lock, header and bytes from one descriptor: a write
        racing the scrub neither gets an old header cached over its new one nor makes a
        half-written chunk look corrupt, and a chunk removed meanwhile is skipped."""
        checked, bad = 0, []
        for ino, index in self.all_chunks():
            meta = None
            try:
                with self._lock(ino, index):
                    if self.small is not None and (rec := self.small.get((ino, index))) is not None:
                        try:
                            self._small_bytes(ino, index, rec)
                        except StripefsError:
                            _stats.CHECKSUM_SCRUB.inc()
                            bad.append((ino, index, rec.chain))
                        else:
                            checked += 1
                        continue
                    try:
                        fd = os.open(self.path(ino, index), os.O_RDONLY)
                    except FileNotFoundError:
                        continue  # removed since the listing
                    try:
                        self._meta.pop((ino, index), None)  # trust nothing cached
                        meta = self._load(ino, index, fd)
                        if meta is None:
                            continue
                        self._verify(ino, index, meta, os.pread(fd, meta.length, HEADER_SIZE))
                    finally:
                        os.close(fd)
                checked += 1
            except StripefsError:
                _stats.CHECKSUM_SCRUB.inc()
                chain = meta.chain if meta is not None else 0
                bad.append((ino, index, chain))
        return checked, bad


def _slow_fsync(root: str) -> None:
    """Sleep what ``root/$STRIPEFS_SLOW_FSYNC_FILE`` says, if it exists (a test's slow disk; at most 5 s)."""
    import time

    try:
        with open(os.path.join(root, SLOW_FSYNC_FILE or ""), "rb") as f:
            delay = float(f.read().strip() or b"0")
    except (OSError, ValueError):
        return
    time.sleep(min(max(delay, 0.0), 5.0))
