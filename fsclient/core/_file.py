"""File objects of the native client.

Reads: large reads go straight from the servers into the caller's buffer in
parallel; small sequential reads are served from a readahead window that is
refilled in the background (double buffered); small random reads fetch exactly
the bytes asked for. ``read()`` returns ``bytes`` received in place (no
zero-fill, no extra copy). Writes: large writes stream
straight from the caller's buffer; small writes gather in a page-aligned
buffer that is sent in the background when full (write-behind, two buffers),
so a loop of small writes (``torch.save``, ``pickle``) keeps every server busy.

Consistency is close-to-open, as in 3FS and NFS: the file length is committed
to the metadata service at ``close()``/``fsync()``; other clients see the new
length after that. Errors of background writes surface at the next ``write``,
``flush``, ``fsync`` or ``close``, and stay: once a write failed, bytes that
were acknowledged to the caller are lost, so every later ``write``, ``flush``,
``fsync``, ``truncate`` and ``close`` of that file object fails too, and no
length is committed from it any more (a length over the lost range would show
zeros to readers as if they were the data).
"""

from __future__ import annotations

import io
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from stripefs.wire import Attr, ErrorCode, Layout, MAX_FILE_SIZE, Message, ReplyMessage, StripefsError, messages as m

from ._pending import DEFER_BYTES
from ._rawbytes import fill_bytes

if TYPE_CHECKING:
    from stripefs.rpc import BufferPool

    from ._pending import PendingCreate

R = TypeVar("R", bound=ReplyMessage)


class ChunkIO(Protocol):
    """What a :class:`StripeFile` needs from its client: :class:`fsclient.Client` provides it.

    Spelled out here (rather than importing ``Client``) so the file object
    depends on the narrow interface, not on the client that owns it.
    """

    @property
    def buffers(self) -> "BufferPool": ...

    def read_into(self, ino: int, layout: Layout, file_size: int, offset: int, dest: memoryview) -> int: ...

    def write_from(self, ino: int, layout: Layout, offset: int, data: memoryview) -> None: ...

    def submit_write(self, ino: int, layout: Layout, offset: int, data: memoryview) -> "Future[None]": ...

    def commit_length(self, ino: int, length: int, *, mtime_ns: int | None = None) -> Attr: ...

    def call(self, msg: Message[R], *, timeout: float = ...) -> R: ...

MAX_WINDOW = 32 << 20


class StripeFile(io.RawIOBase):
    """A file opened with :meth:`fsclient.Client.open` or :meth:`~fsclient.Client.open_inode`.

    Binary; not thread-safe.

    Args:
        client: what the file reads, writes and commits through (a :class:`fsclient.Client`).
        path: the name shown in errors and ``repr``.
        attr: the inode's attributes at open (a regular file: it has a layout).
        readable, writable, append: the open mode.
        pending: the file was opened as new and its name is made at its first ``fsync``
            or ``close`` (see ``_pending``); ``attr`` is then its reserved inode's.

    Raises:
        StripefsError: INVALID when ``attr`` is not a regular file.
    """

    def __init__(self, client: ChunkIO, path: str, attr: Attr, *, readable: bool, writable: bool, append: bool = False,
                 pending: "PendingCreate | None" = None):
        super().__init__()
        if attr.layout is None:
            raise StripefsError(ErrorCode.INVALID, "not a regular file", path)
        self._client = client
        self._pending = pending
        self.name = path
        self.attr = attr
        self._ino = attr.ino
        self._layout = attr.layout
        self.size = attr.size
        self._truncations = attr.truncations  # the file's truncate count as this object last saw it
        self._readable, self._writable, self._append = readable, writable, append
        self._pos = self.size if append else 0
        window = min(self._layout.chunk_size * min(self._layout.stripe, 8), MAX_WINDOW)
        self.window = max(window, self._layout.chunk_size)
        # write-behind state
        self._wbuf: Any = None
        self._wstart = 0
        self._wlen = 0
        self._inflight: list[tuple[Any, list[Future]]] = []
        self._spare: list[Any] = []
        self._dirty = False
        self._written_end = 0
        self._error: BaseException | None = None  # the first failed write: sticky until close
        self._shut = False  # close() is releasing the buffers: IOBase's own flush must not run
        # readahead state: (start, length, buffer, future|None); only for sequential access
        self._ra: list[list[Any]] = []
        self._seq_end = self._pos
        # The attributes the metadata service answered this object's last length commit or
        # truncate with, while nothing was written since (None otherwise): see :attr:`committed`.
        self._committed: Attr | None = None

    @property
    def ino(self) -> int:
        """The inode number. A file opened as new makes its name first (``_pending``): the
        number is final then (a name that existed is another inode)."""
        if self._pending is not None:
            self._make_name()
        return self._ino

    @property
    def layout(self) -> Layout:
        """The file's layout (final, as :attr:`ino`)."""
        if self._pending is not None:
            self._make_name()
        return self._layout

    # -- io plumbing --------------------------------------------------------------------
    def readable(self) -> bool:
        return self._readable

    def writable(self) -> bool:
        return self._writable

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._check_open()
        if whence == io.SEEK_SET:
            pos = offset
        elif whence == io.SEEK_CUR:
            pos = self._pos + offset
        elif whence == io.SEEK_END:
            pos = self._length() + offset
        else:
            raise ValueError(f"invalid whence {whence}")
        if pos < 0:
            raise StripefsError(ErrorCode.INVALID, "negative seek position", self.name)
        self._pos = pos
        return pos

    @property
    def settled(self) -> bool:
        """Nothing buffered, in flight or uncommitted, and no failure to report: ``flush``
        and ``fsync`` would send, wait for and commit nothing. For event-loop code (the FUSE
        daemon), which then answers them without a worker thread. (``close`` may still wait
        for a readahead fetch in flight.)"""
        return (not self.closed and not self._wlen and not self._inflight and not self._dirty
                and self._error is None and self._pending is None)

    @property
    def pending(self) -> bool:
        """Opened as new, its name not made yet (``_pending``): its first ``fsync``,
        ``close`` or anything asking for its inode makes it (a metadata request)."""
        return self._pending is not None

    @property
    def committed(self) -> Attr | None:
        """The inode's attributes as the metadata service answered this object's last length
        commit (or truncate), when nothing was written through it since; else None. The
        version of the file this object's writes made, without asking again."""
        return self._committed

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("I/O operation on closed file")

    def _length(self) -> int:
        return max(self.size, self._written_end, self._wstart + self._wlen if self._wlen else 0)

    # -- reading ------------------------------------------------------------------------
    def readinto(self, b: Any) -> int:
        self._check_open()
        if not self._readable:
            raise io.UnsupportedOperation("file not open for reading")
        n = self.pread_into(memoryview(b).cast("B"), self._pos)
        self._pos += n
        return n

    def read(self, size: int | None = -1) -> bytes:
        self._check_open()
        if size is None or size < 0:
            size = max(0, self._length() - self._pos)
        if not self._readable:
            raise io.UnsupportedOperation("file not open for reading")
        size = max(0, min(size, self._length() - self._pos))
        start = self._pos
        data = fill_bytes(size, lambda view, pos: self.pread_into(view, start + pos))
        self._pos += len(data)
        return data

    def readall(self) -> bytes:
        return self.read(-1)

    def pread(self, size: int, offset: int) -> bytes:
        n = max(0, min(size, self._length() - offset))
        return fill_bytes(n, lambda view, pos: self.pread_into(view, offset + pos))

    def pread_into(self, dest: memoryview, offset: int) -> int:
        """Read at ``offset`` into ``dest`` without moving the file position."""
        self._check_open()
        if self._wlen or self._inflight:
            self._drain()
        length = self._length()
        want = max(0, min(len(dest), length - offset))
        if want == 0:
            return 0
        sequential = offset == self._seq_end
        self._seq_end = offset + want
        if want >= self.window // 2 or ((not sequential or offset + want == length) and not self._in_window(offset)):
            # Big reads go straight into the caller's buffer; small random reads fetch
            # exactly what was asked (no window of readahead for a dataloader's 4 KiB sample),
            # and so does a read to the end of the file (a small file read whole: nothing
            # follows to read ahead, and a window would only cost a copy).
            return self._client.read_into(self._ino, self._layout, length, offset, dest[:want])
        done = 0
        while done < want:
            buf, start, blen = self._window_for(offset + done, length)
            k = min(want - done, start + blen - (offset + done))
            src = offset + done - start
            dest[done : done + k] = memoryview(buf)[src : src + k]
            done += k
        return done

    def read_buffered(self, dest: memoryview, offset: int) -> int | None:
        """Copy ``dest``'s bytes at ``offset`` from a readahead window already filled.

        Never blocks (a memory copy; the next window's fetch is started on a
        thread), so event-loop code (the FUSE daemon) can call it directly.
        Returns the byte count, or None when the bytes are not in memory yet or
        writes are pending -- then use :meth:`pread_into`.
        """
        if self._wlen or self._inflight:
            return None
        length = self._length()
        n = max(0, min(len(dest), length - offset))
        for start, blen, buf, fut in self._ra:
            if not (start <= offset and offset + n <= start + blen and (fut is None or fut.done())):
                continue
            if fut is not None and fut.exception() is not None:
                return None  # pread_into raises it
            dest[:n] = memoryview(buf)[offset - start : offset - start + n]
            self._seq_end = offset + n
            if all(w[3] is None or w[3].done() for w in self._ra):
                self._prefetch(start + blen, length)  # keep the next window coming
            return n
        return None

    def buffered_view(self, offset: int, size: int) -> memoryview | None:
        """Like :meth:`read_buffered`, without the copy: a view of up to ``size`` bytes
        at ``offset`` inside a filled readahead window, or None.

        The view is valid until the next call on this file object (that may recycle
        the window), so the caller must be done with it first: an event loop that
        copies it into a reply before any other task runs (the FUSE daemon).
        """
        if self._wlen or self._inflight:
            return None
        length = self._length()
        n = max(0, min(size, length - offset))
        w = self._filled(offset, n)
        if w is not None and all(x[3] is None or x[3].done() for x in self._ra):
            self._prefetch(w[0] + w[1], length)  # keep the next window coming
            w = self._filled(offset, n)  # (it may recycle windows: look again)
        if w is None:
            return None
        self._seq_end = offset + n
        return memoryview(w[2])[offset - w[0] : offset - w[0] + n]

    def _filled(self, offset: int, n: int) -> list[Any] | None:
        """The filled readahead window holding ``n`` bytes at ``offset``; None when there is
        none, or when its fetch failed (:meth:`pread_into` raises that)."""
        for w in self._ra:
            start, blen, _, fut = w
            if start <= offset and offset + n <= start + blen and (fut is None or fut.done()):
                return None if fut is not None and fut.exception() is not None else w
        return None

    def in_window(self, offset: int) -> bool:
        """Is ``offset`` inside a readahead window (filled or being filled)?"""
        return self._in_window(offset)

    def _in_window(self, offset: int) -> bool:
        return any(w[0] <= offset < w[0] + w[1] for w in self._ra)

    def _window_for(self, offset: int, length: int) -> tuple[Any, int, int]:
        for w in self._ra:
            start, blen, buf, fut = w
            if start <= offset < start + blen:
                if fut is not None:
                    fut.result()
                    w[3] = None
                self._prefetch(start + blen, length)
                return buf, start, blen
        self._ra.clear()
        start = offset - offset % self._layout.chunk_size
        blen = min(self.window, length - start)
        buf = self._client.buffers.get(self.window)
        self._client.read_into(self._ino, self._layout, length, start, memoryview(buf)[:blen])
        self._ra.append([start, blen, buf, None])
        self._prefetch(start + blen, length)
        return buf, start, blen

    def _prefetch(self, start: int, length: int) -> None:
        if start >= length or any(w[0] == start for w in self._ra):
            return
        while len(self._ra) > 1:
            old = self._ra.pop(0)
            if old[3] is not None:
                old[3].result()
            self._client.buffers.put(old[2])
        blen = min(self.window, length - start)
        buf = self._client.buffers.get(self.window)
        fut: Future = Future()

        def run() -> None:
            try:
                fut.set_result(self._client.read_into(self._ino, self._layout, length, start, memoryview(buf)[:blen]))
            except BaseException as exc:
                fut.set_exception(exc)

        threading.Thread(target=run, daemon=True, name="stripefs-readahead").start()
        self._ra.append([start, blen, buf, fut])

    # -- writing ------------------------------------------------------------------------
    def write(self, b: Any) -> int:
        self._check_open()
        if not self._writable:
            raise io.UnsupportedOperation("file not open for writing")
        view = memoryview(b).cast("B")
        if self._append:
            self._pos = self._length()
        n = self.pwrite(view, self._pos)
        self._pos += n
        return n

    def pwrite(self, data: Any, offset: int) -> int:
        """Write at ``offset`` without moving the file position."""
        self._check_open()
        view = memoryview(data).cast("B")
        n = len(view)
        if offset + n > MAX_FILE_SIZE:
            raise StripefsError(ErrorCode.FILE_TOO_BIG, "write beyond the maximum file size", self.name)
        self._check_error()
        if n == 0:
            return 0
        if self._pending is not None and offset + n > DEFER_BYTES:
            self._make_name()  # before these bytes leave: a name that exists gets them directly
        self._ra.clear()
        self._dirty = True
        self._committed = None
        if self._wlen and offset != self._wstart + self._wlen:
            self._submit_buffer()
            self._check_error()
        if not self._wlen and n >= self.window:
            self._reap(block=False)
            self._check_error()
            try:
                self._client.write_from(self._ino, self._layout, offset, view)
            except Exception as exc:
                # Some chunks of this write may have landed and others not: no length
                # may be committed over them from now on.
                self._error = self._error or exc
                raise
            self._written_end = max(self._written_end, offset + n)
            return n
        self._fill_buffers(view, offset)
        self._check_error()  # a background write failed: report it at this write already
        return n

    def _fill_buffers(self, view: memoryview, offset: int, block: bool = True) -> None:
        """Copy ``view`` (at file ``offset``, continuing the write buffer) into write
        buffers, sending each one that fills (``block``: see :meth:`_submit_buffer`)."""
        n, done = len(view), 0
        while done < n:
            if self._wbuf is None:
                self._wbuf = self._spare.pop() if self._spare else self._client.buffers.get(self.window)
                self._wstart, self._wlen = offset + done, 0
            k = min(n - done, self.window - self._wlen)
            self._wbuf[self._wlen : self._wlen + k] = view[done : done + k]
            self._wlen += k
            done += k
            if self._wlen == self.window:
                self._submit_buffer(block=block)

    def buffered_fits(self, offset: int, n: int) -> bool | None:
        """Can a write of ``n`` bytes at ``offset`` be taken by :meth:`write_buffered`?

        True: it lands in the current write-behind buffer, which stays short of
        full (a memory copy, nothing sent). False: it continues the buffer and
        fills it, so a full buffer is sent in the background -- without blocking
        only once :meth:`send_blocker` is None. None: any other write (not
        contiguous with the buffer, as large as a window, an error pending, a
        window of one chunk, which the client would send inline): use
        :meth:`pwrite`.
        """
        if self.closed or not self._writable or n <= 0 or n >= self.window or offset + n > MAX_FILE_SIZE:
            return None
        self._reap(block=False)
        if self._error is not None or (self._wlen and offset != self._wstart + self._wlen):
            return None
        if self._wlen + n < self.window:
            return True
        # Sending a full buffer must start threads, not send inline (one chunk and free).
        return False if self.window > self._layout.chunk_size else None

    def send_blocker(self) -> "Future[None] | None":
        """The background write a full buffer would wait for before it is sent (at most
        two are in flight); None when one may be sent now without blocking."""
        self._reap(block=False)
        if len(self._inflight) < 2:
            return None
        return next((f for f in self._inflight[0][1] if not f.done()), None)

    def sending(self) -> list["Future[None]"]:
        """The futures of the write-behind buffers in flight, oldest first."""
        return [f for _, futs in self._inflight for f in futs]

    def write_buffered(self, data: Any, offset: int) -> int:
        """Take a write that :meth:`buffered_fits` (True, or False with no
        :meth:`send_blocker`) without blocking: a memory copy into the write-behind
        buffer, and a full buffer sent in the background. For event-loop code
        (the FUSE daemon) that acknowledges writes once buffered.

        Raises:
            StripefsError: a background write of this file object failed.
        """
        view = memoryview(data).cast("B")
        n = len(view)
        self._check_error()
        self._ra.clear()
        self._dirty = True
        self._committed = None
        self._fill_buffers(view, offset, block=False)
        return n

    def _submit_buffer(self, block: bool = True) -> None:
        if not self._wlen:
            return
        buf, start, n = self._wbuf, self._wstart, self._wlen
        self._wbuf, self._wlen = None, 0
        futs = [self._client.submit_write(self._ino, self._layout, start, memoryview(buf)[:n])]
        self._inflight.append((buf, futs))
        self._written_end = max(self._written_end, start + n)
        self._reap(block=block and len(self._inflight) >= 2)

    def _reap(self, block: bool) -> None:
        """Collect finished background writes; with ``block`` wait for the oldest.

        Never raises: a failure is kept in ``_error`` (see :meth:`_check_error`), so a
        caller can still wait for the other writes before it reports it.
        """
        while self._inflight:
            buf, futs = self._inflight[0]
            if not block and not all(f.done() for f in futs):
                return
            self._inflight.pop(0)
            try:
                for f in futs:
                    f.result()
            except Exception as exc:
                self._error = self._error or exc
            finally:
                self._spare.append(buf)
            block = False

    def _check_error(self) -> None:
        """Raise again, on every call, the failure of an earlier write of this file object.

        Raises:
            StripefsError: with the failed write's error code (EIO for anything else).
        """
        exc = self._error
        if exc is not None:
            code = exc.code if isinstance(exc, StripefsError) else ErrorCode.IO
            raise StripefsError(code, f"an earlier write to this file failed, its bytes are lost ({exc})",
                                self.name) from exc

    def _drain(self) -> None:
        """Send the buffered bytes, wait for every write in flight, report a failure.

        Raises:
            StripefsError: a write of this file object failed (now or earlier).
        """
        if self._error is None:
            self._submit_buffer()
        else:
            self._wlen = 0  # these bytes can never be committed: do not send them
        while self._inflight:  # all of them, even after a failure: no thread may still use a buffer
            self._reap(block=True)
        self._check_error()

    def flush(self) -> None:
        """Send buffered bytes and wait until the storage servers acknowledged them.

        Raises:
            StripefsError: a write of this file object failed (now or earlier).
        """
        if self.closed or self._shut:
            return
        self._drain()

    def fsync(self) -> None:
        """Flush, then commit the file length to the metadata service.

        Raises:
            StripefsError: a write of this file object failed (now or earlier);
                nothing is committed then.
        """
        self._check_open()
        self._drain()
        self._commit()

    def _commit(self) -> None:
        self._check_error()  # never commit a length over bytes that were lost
        if self._pending is not None:
            self._make_name(self._length())
        if self._dirty:
            try:
                attr = self._client.commit_length(self._ino, self._length(), mtime_ns=time.time_ns(),
                                                  truncations=self._truncations)
            except StripefsError as exc:
                if exc.code == ErrorCode.CUT_PENDING:
                    # A truncate's cut has not landed yet (or landed after our bytes): when it
                    # does, some of our bytes are gone, so no later fsync or close may succeed
                    # and commit a length that leaves them out unnoticed.
                    self._error = self._error or exc
                raise
            if attr.truncations != self._truncations:
                # Truncated by someone else since we last looked: the servers dropped our
                # bytes past the new size, and the commit did not extend over them.
                self._written_end = min(self._written_end, attr.size)
                self._truncations = attr.truncations
            self.size = attr.size
            self._dirty = False
            self._committed = attr

    def _make_name(self, length: int | None = None) -> None:
        """Make this file's pending name (``_pending``). ``length`` (``fsync``/``close``,
        every write acknowledged): the one commit carries it, and nothing is left to
        commit; None: the name is made empty. When the name existed, the bytes written so
        far move to that file (truncated by the make), which the file goes on with.

        Raises:
            StripefsError: the name could not be made (the file stays pending: a later
                ``fsync``/``close`` tries again and reports it again).
        """
        p = self._pending
        assert p is not None
        with p.lock:
            ours = p.made is None
            made = p.make(length or 0, time.time_ns() if length is not None else 0) if ours else p.made
        assert made is not None
        p.table.done(p)
        self._pending = None
        if made.ino != self._ino:
            self._move_to(made)
        elif ours and length is not None:
            self.attr, self.size, self._dirty, self._committed = made, made.size, False, made
        else:
            self.attr = made

    def _move_to(self, attr: Attr) -> None:
        """Go on with the existing file ``attr`` (a pending name that existed), the bytes
        written so far under the reserved inode copied over (none when nothing was sent
        yet: the buffer goes to the new inode)."""
        old_ino, old_layout, end = self._ino, self._layout, self._written_end
        if end or self._inflight:
            self._drain()
            end = self._written_end
        assert attr.layout is not None
        self.attr, self._ino, self._layout, self.size = attr, attr.ino, attr.layout, 0
        self._truncations = attr.truncations
        self._dirty = True
        if not end:
            return
        step = self.window
        buf = self._client.buffers.get(step)
        view = memoryview(buf)
        try:
            for off in range(0, end, step):
                n = min(step, end - off)
                self._client.read_into(old_ino, old_layout, end, off, view[:n])
                self._client.write_from(self._ino, self._layout, off, view[:n])
        except Exception as exc:
            self._error = self._error or exc
            raise
        finally:
            view.release()
            self._client.buffers.put(buf)

    def truncate(self, size: int | None = None) -> int:
        self._check_open()
        if not self._writable:
            raise io.UnsupportedOperation("file not open for writing")
        size = self._pos if size is None else size
        self._drain()
        if self._pending is not None:
            self._make_name()
        attr = self._client.call(m.SetAttr(ino=self._ino, size=size)).attr
        self.size = attr.size
        self._truncations = attr.truncations
        self._committed = None if self._dirty else attr
        self._written_end = min(self._written_end, size)
        self._ra.clear()
        return size

    def close(self) -> None:
        """Flush, commit the length, release the buffers.

        Raises:
            StripefsError: a write of this file object failed; the file is closed
                anyway, and no length was committed.
        """
        if self.closed:
            return
        try:
            if self._writable:
                self._drain()
                self._commit()
        finally:
            self._shut = True
            if self._pending is not None:  # its writes or its name failed: no name is made
                self._pending.table.drop(self._pending)
            for w in self._ra:
                if w[3] is not None:
                    try:
                        w[3].result()
                    except StripefsError:
                        pass
                self._client.buffers.put(w[2])
            self._ra.clear()
            for buf in self._spare + ([self._wbuf] if self._wbuf is not None else []):
                self._client.buffers.put(buf)
            self._spare, self._wbuf = [], None
            super().close()

    def fileno(self) -> int:
        raise io.UnsupportedOperation("stripefs files have no OS file descriptor")

    def __repr__(self) -> str:
        return f"<StripeFile {self.name!r} ino={self._ino} size={self._length()}>"


def mode_flags(mode: str) -> dict[str, bool]:
    """Parse an ``open`` mode into flags; raises ValueError like the builtin."""
    kinds = set(mode) - {"b", "t", "+"}
    if len(kinds) != 1 or not kinds <= {"r", "w", "a", "x"} or ("b" in mode and "t" in mode) or len(set(mode)) != len(mode):
        raise ValueError(f"invalid mode: {mode!r}")
    kind = kinds.pop()
    plus = "+" in mode
    return {
        "read": kind == "r" or plus,
        "write": kind != "r" or plus,
        "create": kind in "wax",
        "exclusive": kind == "x",
        "truncate": kind == "w",
        "append": kind == "a",
        "must_exist": kind == "r",
        "text": "b" not in mode,
    }

