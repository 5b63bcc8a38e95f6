"""The state of a file open in the FUSE mount (:class:`OpenFile`): one per inode per
mount, shared by all of the inode's handles.

It holds the native client's :class:`~fsclient.StripeFile` (write-behind buffers,
sequential readahead), this mount's view of the file's length and mode, what was done
through it (written, read), and the stamp of the file version it started from. The
stamp is what close-to-open rests on between handles of one mount: a new open commits
this mount's writes and compares the stamp with fresh attributes; a file changed
elsewhere starts its state over (:meth:`OpenFile.revalidate`). When to call what, and
on which thread, is the kernel operations' business (``_operations.py``); the mount's
bound on write-behind bytes in flight is ``_writebehind.py``'s.
"""

from __future__ import annotations

import io
import mmap
from typing import Any

import trio

from stripefs.wire import Attr

from ..core import Client, StripeFile

__all__ = ["OpenFile"]


class OpenFile:
    """The state of one inode open in this mount, shared by all its handles.

    Every method is blocking and runs on a worker thread while the caller holds
    ``lock`` (StripeFile is not thread-safe).
    """

    def __init__(self, client: Client, file: StripeFile):
        self.client = client
        self.file = file
        self.stamp = stamp_of(file.attr)  # the version of the file this state started from
        self.mode = file.attr.mode  # as this mount last saw it: writes clear setuid/setgid from it
        self.handles = 0
        self.lock = trio.Lock()
        self.orphan: str | None = None  # name in ORPHAN_DIR once silly-renamed
        self.dirty = False  # writes buffered since the last sync
        self.written = False  # ever written or truncated through this state
        self.read_from = False  # ever read through the file object (readahead may be in flight)
        self.seq_end = 0
        self._buf: mmap.mmap | None = None
        # A small file's bytes, read whole at its first read (``_operations._read_whole``);
        # gone at the first write, truncate or refresh.
        self.whole: memoryview | None = None
        self.whole_buf: mmap.mmap | None = None  # the buffer ``whole`` views (the mount's pool lends it)
        # A small file's whole read, sent at a read-only OPEN (``_operations._read_ahead``) into
        # ``whole_buf`` and taken by the first READ: (future, finish, the StripeFile it was
        # sent for, the view it lands in). Taken only if this state is still of that file
        # and nothing was written through it meanwhile.
        self.ahead: tuple[Any, Any, StripeFile, memoryview] | None = None

    def length(self) -> int:
        """This mount's view of the length (buffered writes included)."""
        return self.file.seek(0, io.SEEK_END)

    def read(self, offset: int, size: int) -> memoryview:
        """Read into this inode's reused page-aligned buffer and return a view of it.

        The view is valid until the next read of this inode: pyfuse3 copies it
        into the reply before any other task of the loop runs.
        """
        f = self.file
        self.read_from = True
        f.flush()  # reads see this mount's buffered writes
        dest = self._dest(max(0, min(size, self.length() - offset)))
        if not len(dest):
            return dest
        self.dirty = False
        # StripeFile picks the path: readahead windows when sequential, exact fetches otherwise.
        got = f.pread_into(dest, offset)
        self.seq_end = offset + got
        return dest[:got]

    def _dest(self, n: int) -> memoryview:
        """This inode's reused page-aligned reply buffer, at least ``n`` bytes."""
        if self._buf is None or len(self._buf) < n:
            self._buf = mmap.mmap(-1, max(n, 1 << 20))
        return memoryview(self._buf)[:n]

    def read_cached(self, offset: int, size: int) -> memoryview | None:
        """Serve a read from an already filled readahead window, on the trio loop
        (no worker-thread hop, no copy: a view of the window, which pyfuse3 copies into
        the reply before any other task runs); None when the bytes are not in memory yet."""
        view = self.file.buffered_view(offset, size)
        if view is None:
            return None
        self.seq_end = offset + len(view)
        return view

    def write(self, offset: int, data: bytes) -> int:
        self.dirty = self.written = True
        self.whole = None
        return self.file.pwrite(data, offset)

    def write_buffered(self, offset: int, data: bytes) -> int:
        """:meth:`write` on the trio loop, for a write that ``file.buffered_fits`` (a copy
        into the write-behind buffer; a full one is sent in the background)."""
        self.dirty = self.written = True
        self.whole = None
        return self.file.write_buffered(data, offset)

    def sync(self) -> None:
        """Wait for buffered writes and commit the length (flush and fsync)."""
        self.file.fsync()
        self.dirty = False

    def append(self, data: bytes) -> tuple[int, int]:
        """Write ``data`` at the end of the file as the cluster knows it now (``O_APPEND``).

        The kernel picks an append's offset from its cached size, which may predate
        another client's committed appends; this asks the metadata service instead, at
        every write, and writes after both the committed length and this mount's own
        bytes not committed yet. Returns (bytes written, the offset they went to).
        """
        attr = self.client.stat_inode(self.file.ino)
        if attr.truncations != self.stamp[3]:  # stamp_of: (size, mtime, ctime, truncations)
            # Truncated since this state started (here or elsewhere): its idea of the
            # length is stale. Commit what is ours and start over from the fresh attributes.
            self.sync()
            self.refresh(self.client.stat_inode(self.file.ino))
            attr = self.file.attr
        at = max(attr.size, self.length())
        return self.write(at, data), at

    def refresh(self, attr: Attr) -> None:
        """Start over from ``attr``, fresh from the metadata service: another client may
        have rewritten or grown the file. A new :class:`StripeFile` takes the fresh size,
        truncate count and layout; the old one's readahead windows are dropped with it.

        Only after :meth:`sync` succeeded: nothing is buffered or uncommitted, so closing
        the old file object commits nothing and only releases its buffers.
        """
        old, self.file = self.file, self.client.open_inode(attr, readable=True, writable=True)
        self.whole = None
        self.stamp = stamp_of(attr)
        self.mode = attr.mode
        self.seq_end = 0
        self.dirty = False
        old.close()

    def revalidate(self) -> Attr | None:
        """Commit this state's writes, fetch fresh attributes, start over if the file changed.

        Called when the file is opened again while open here. Runs on a worker thread
        under ``lock``. Returns the fresh attributes, or None when a write of the state
        failed earlier: the state is kept then, so its handles keep reporting the error
        (no length is committed over lost bytes).
        """
        try:
            self.sync()
        except OSError:
            return None
        attr = self.client.stat_inode(self.file.ino)
        if stamp_of(attr) != self.stamp:
            self.refresh(attr)
        self.mode = attr.mode  # a chmod elsewhere changes neither size nor mtime
        return attr

    def truncate(self, size: int) -> None:
        self.written = True
        self.whole = None
        self.file.truncate(size)
        self.seq_end = 0

    @property
    def untouched(self) -> bool:
        """Neither written nor read, its name made (``_newfiles``): closing sends, commits
        and waits for nothing, so it may run on the trio loop (no worker-thread hop)."""
        return not (self.written or self.read_from or self.lock.locked() or self.file.pending)

    @property
    def settled(self) -> bool:
        """Nothing was written through this state, or everything was and is on the storage
        servers with its length committed, with no failure pending; and no thread is busy
        with it: a flush or fsync has nothing to send, wait for or commit."""
        return not self.lock.locked() and not self.file.pending and (not self.written or self.file.settled)

    @property
    def closes_at_once(self) -> bool:
        """Closing sends, commits and waits for nothing (no readahead either), so it may run
        on the trio loop (no worker-thread hop): `touch`, a stat-like open, or the last close
        of a file whose writes an fsync already committed."""
        return self.untouched or (self.settled and not self.read_from)

    def close(self) -> None:
        try:
            self.file.close()
        finally:
            self._buf = None  # not closed: pyfuse3 may still hold a view of it


Stamp = tuple[int, int, int, int]


def stamp_of(attr: Attr, size: int | None = None) -> Stamp:
    """What tells one version of a file's contents from another, as far as a mount can see:
    ``(size, mtime, ctime, truncations)``, ``size`` overriding the cluster's (this mount's
    writes not yet committed). Not ``(size, mtime)`` alone: ``cp -p``, ``rsync -a`` and ``tar``
    rewrite a file at the same size and set its mtime back; no client can set the ctime back
    (every write's length commit, truncate and utime moves it to the service's clock), and a
    rewrite through ``O_TRUNC`` also counts a truncation."""
    return (attr.size if size is None else size, attr.mtime_ns, attr.ctime_ns, attr.truncations)
