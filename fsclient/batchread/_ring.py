"""The read ring: prepare many reads, submit them at once, reap completions (3FS *ior*).

Each prepared read is cut at chunk boundaries; every piece goes to the storage
server at the head of its chain as one ``ReadChunk`` whose response payload the
connection's reader thread receives with ``recv_into`` straight into the
caller's buffer slice. Pieces to all servers are in flight together (up to
``max_inflight``); a read completes when its last piece does.

Threads: the caller's thread prepares, submits and waits (it also refills the
window and resubmits retried pieces inside :meth:`ReadRing.wait`); reader
threads of the connections only account completed pieces under one lock.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from wire import ErrorCode, Layout, StripefsError, messages as m

from ..core import ClusterConfig, split
from ._mounted import resolve_mounted

if TYPE_CHECKING:
    from rpc import Reply

    from ..core import Client

__all__ = ["ReadRing", "Completion", "RegisteredFile"]

RETRYABLE = (ErrorCode.UNAVAILABLE, ErrorCode.STALE_ROUTING)
RETRY_DELAY = 0.1
_read_reply = m.ReadChunkReply.from_header  # decoded once per piece: bind the fast path once


def _received(reply: "Reply") -> int:
    """Bytes a ``ReadChunk`` answer delivered, as its typed header announces them.

    Raises:
        StripefsError: PROTOCOL for a malformed header or one that disagrees
            with the payload received.
    """
    got = _read_reply(reply.header).length
    if got != reply.nbytes:
        raise StripefsError(ErrorCode.PROTOCOL, f"ReadChunk reply announces {got} bytes, its payload has {reply.nbytes}")
    return got


@dataclass(frozen=True, slots=True)
class RegisteredFile:
    """A file ready for ring reads: its inode, layout and size as of registration.

    Caveats:
        * ``size`` is a snapshot (close-to-open consistency): bytes appended after
          registration read as past-EOF until the file is registered again.
    """

    ino: int
    layout: Layout
    size: int
    path: str


@dataclass(slots=True)
class Completion:
    """One finished read: ``result`` is bytes read (short at EOF) or ``-errno``."""

    userdata: Any
    result: int
    error: StripefsError | None = None


class _Read:
    """A ring entry (slot). Reused; fields are cleared when its completion is reaped."""

    __slots__ = ("dest", "file", "offset", "length", "userdata", "n", "pending", "error")

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.dest: memoryview | None = None
        self.file: RegisteredFile | None = None
        self.offset = self.length = self.n = self.pending = 0
        self.userdata: Any = None
        self.error: StripefsError | None = None


def as_dest(buf: Any) -> memoryview:
    """A writable, contiguous byte view of ``buf`` (memoryview, bytearray, mmap, numpy, torch)."""
    if hasattr(buf, "numpy") and hasattr(buf, "is_contiguous"):  # torch.Tensor: shares memory
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise StripefsError(ErrorCode.INVALID, "destination tensor must be contiguous and on the CPU")
        buf = buf.numpy()
    try:
        view = memoryview(buf)
    except TypeError as exc:
        raise StripefsError(ErrorCode.INVALID, f"destination does not expose a buffer: {type(buf).__name__}") from exc
    if view.readonly:
        raise StripefsError(ErrorCode.INVALID, "destination buffer is read-only")
    if not view.c_contiguous:
        raise StripefsError(ErrorCode.INVALID, "destination buffer is not contiguous")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class ReadRing:
    """A submission/completion ring for batched zero-copy reads.

    Args:
        client: the :class:`fsclient.Client` whose connections carry the reads.
        entries: most reads prepared or in flight at once.
        max_inflight: most chunk requests on the wire at once (all servers).
        forbid_holes: fail a read that covers a hole (NO_DATA / ENODATA)
            instead of reading zeros (3FS ``HF3FS_IOR_FORBID_READ_HOLES``).
        retries: resubmissions of a piece whose server was unavailable, after a
            routing refresh (a restarted server moves to a new port).

    Caveats:
        * One thread drives a ring; several rings may share a client.
        * A ring belongs to the process that made it; after ``fork`` make a new one.
        * The window is refilled inside :meth:`wait`: a batch larger than
          ``max_inflight`` pieces progresses only while someone waits.
        * A server that hangs without closing its socket stalls its reads; use
          ``wait(timeout=)`` and drop the ring (its buffer views stay referenced).
    """

    def __init__(self, client: "Client", entries: int = 1024, *, max_inflight: int = 256,
                 forbid_holes: bool = False, retries: int = 2):
        if entries < 1 or max_inflight < 1:
            raise StripefsError(ErrorCode.INVALID, "entries and max_inflight must be >= 1")
        self.client = client
        self.entries = entries
        self.max_inflight = max_inflight
        self.forbid_holes = forbid_holes
        self.retries = retries
        self.pid = os.getpid()
        self._slots = [_Read() for _ in range(entries)]
        self._free = deque(range(entries))
        self._prepared: list[int] = []
        self._queue: deque[tuple[int, int, int, int, int, int]] = deque()  # slot, index, coff, k, pos, attempt
        self._retry: list[tuple[int, int, int, int, int, int]] = []
        self._done: deque[int] = deque()
        self._outstanding = 0  # submitted, not yet reaped
        self._inflight = 0
        self._cv = threading.Condition(threading.Lock())
        self._zeros = memoryview(b"")

    # -- files ------------------------------------------------------------------------------
    def open(self, path: str) -> RegisteredFile:
        """Register a stripefs file by path (one metadata round trip)."""
        attr = self.client.stat(path)
        if not attr.is_file or attr.layout is None:
            raise StripefsError(ErrorCode.IS_DIR if attr.is_dir else ErrorCode.INVALID, "not a regular file", path)
        return RegisteredFile(attr.ino, attr.layout, attr.size, path)

    def open_mounted(self, path: str, **kw: Any) -> RegisteredFile:
        """Register a file by its path under a stripefs FUSE mount (``hf3fs_reg_fd``).

        Raises:
            StripefsError: EXDEV when the mount belongs to another cluster than
                this ring's client; see :func:`resolve_mounted` for the rest.
        """
        mf = resolve_mounted(path, **kw)
        if ClusterConfig.from_file(mf.cluster_file).metadata != self.client.config.metadata:
            raise StripefsError(ErrorCode.CROSS_DEVICE, f"mount {mf.mountpoint} serves another cluster", path)
        attr = self.client.stat_inode(mf.ino)
        if not attr.is_file or attr.layout is None:
            raise StripefsError(ErrorCode.INVALID, "not a regular file", path)
        return RegisteredFile(attr.ino, attr.layout, attr.size, path)

    # -- submission -------------------------------------------------------------------------
    def prepare(self, dest: Any, file: RegisteredFile, offset: int, length: int, userdata: Any = None) -> None:
        """Queue a read of ``length`` bytes at ``offset`` of ``file`` into ``dest[:length]``.

        Raises:
            StripefsError: INVALID for a bad range or destination; BUSY when all
                ``entries`` slots are prepared or in flight.
        """
        self._check_pid()
        view = dest if isinstance(dest, memoryview) and dest.format == "B" and dest.ndim == 1 and not dest.readonly else as_dest(dest)
        if offset < 0 or length < 0:
            raise StripefsError(ErrorCode.INVALID, f"negative offset or length ({offset}, {length})", file.path)
        if len(view) < length:
            raise StripefsError(ErrorCode.INVALID, f"destination holds {len(view)} bytes, read wants {length}", file.path)
        if not self._free:
            raise StripefsError(ErrorCode.BUSY, f"ring full: {self.entries} reads prepared or in flight")
        i = self._free.popleft()
        s = self._slots[i]
        s.dest, s.file, s.offset, s.length, s.userdata = view, file, offset, length, userdata
        self._prepared.append(i)

    def submit(self) -> int:
        """Send every prepared read. Returns how many were submitted."""
        self._check_pid()
        count = len(self._prepared)
        for i in self._prepared:
            s = self._slots[i]
            assert s.file is not None
            s.n = max(0, min(s.length, s.file.size - s.offset))  # past EOF: short count
            s.pending = 0
            for index, coff, k, pos in split(s.file.layout, s.offset, s.n):
                self._queue.append((i, index, coff, k, pos, 0))
                s.pending += 1
            with self._cv:
                self._outstanding += 1
                if s.pending == 0:
                    self._done.append(i)
        self._prepared.clear()
        self._pump()
        return count

    def wait(self, min_completions: int = 1, timeout: float | None = None) -> list[Completion]:
        """Wait until at least ``min_completions`` reads are done (or ``timeout`` passes).

        Returns:
            Every completion available (possibly more than asked, fewer on timeout;
            ``min_completions=0`` polls). Their ring slots are free again.
        """
        self._check_pid()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._pump()
            with self._cv:
                want = min(min_completions, self._outstanding)
                if len(self._done) >= want:
                    break
                if self._retry or (self._queue and self._inflight < self.max_inflight):
                    continue
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._cv.wait(remaining)
        return self._reap()

    def read(self, reads: "list[tuple[Any, RegisteredFile, int, int]]", timeout: float | None = None) -> list[int]:
        """Convenience: read every ``(dest, file, offset, length)`` and wait for all.

        More reads than ``entries`` go through the ring in turns.

        Returns:
            Bytes read per read, in order.

        Raises:
            StripefsError: the first failed read's error (after all have finished);
                TIMEOUT when ``timeout`` passes with reads in flight.
        """
        out = [0] * len(reads)
        first: StripefsError | None = None
        nxt = 0
        left = len(reads)
        deadline = None if timeout is None else time.monotonic() + timeout
        while left:
            while nxt < len(reads) and self._free:
                dest, f, off, n = reads[nxt]
                self.prepare(dest, f, off, n, nxt)
                nxt += 1
            self.submit()
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            got = self.wait(1, remaining)
            if not got:
                raise StripefsError(ErrorCode.TIMEOUT, f"{left} reads still in flight after {timeout}s")
            for c in got:
                out[c.userdata] = c.result
                first = first or c.error
            left -= len(got)
        if first is not None:
            raise first
        return out

    @property
    def in_flight(self) -> int:
        """Reads submitted and not yet reaped."""
        return self._outstanding

    def close(self, timeout: float = 30.0) -> None:
        """Wait for reads in flight (so no reader thread writes into a freed buffer)."""
        end = time.monotonic() + timeout
        while self._outstanding and time.monotonic() < end and os.getpid() == self.pid:
            self.wait(self._outstanding, end - time.monotonic())

    def __enter__(self) -> "ReadRing":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------
    def _check_pid(self) -> None:
        if os.getpid() != self.pid:
            raise StripefsError(ErrorCode.INVALID, "a ReadRing belongs to the process that made it; make one per process")

    def _pump(self) -> None:
        """Refill the window (caller's thread only): new pieces first, then due retries."""
        if self._retry:
            with self._cv:
                retry, self._retry = self._retry, []
            time.sleep(RETRY_DELAY)
            try:
                self.client.routing(refresh=True)
            except StripefsError:
                pass  # the piece fails again below with the server's own error
            self._queue.extendleft(retry)
        while self._queue and self._inflight < self.max_inflight:
            piece = self._queue.popleft()
            i, index, coff, k, pos, _attempt = piece
            s = self._slots[i]
            assert s.file is not None and s.dest is not None
            sid = -1
            with self._cv:
                self._inflight += 1
            try:
                routing = self.client.routing()
                targets = routing.chains.get(s.file.layout.chain_of(index))
                if not targets:
                    raise StripefsError(ErrorCode.UNAVAILABLE, f"chain {s.file.layout.chain_of(index)} has no serving target")
                sid = targets[0]
                fut = self.client.data_connection(sid).submit(
                    m.ReadChunk(ino=s.file.ino, index=index, offset=coff, length=k, chain=s.file.layout.chain_of(index),
                                routing_version=routing.version),
                    dest=s.dest[pos : pos + k])
            except StripefsError as exc:
                fut = Future()
                fut.set_exception(exc)
            fut.add_done_callback(partial(self._on_piece, piece, sid))

    def _on_piece(self, piece: tuple[int, int, int, int, int, int], sid: int, fut: Future) -> None:
        """Account one finished piece (a reader thread, or the caller's on a local failure)."""
        i, index, coff, k, pos, attempt = piece
        s = self._slots[i]
        exc = fut.exception()
        err: StripefsError | None = None
        got = 0
        if exc is None:
            try:
                got = _received(fut.result())
            except StripefsError as bad:  # a malformed reply: fails like a server error
                exc = bad
        if exc is None:
            if got < k:  # within the file size (clipped at submit): a hole or short chunk
                if self.forbid_holes:
                    err = StripefsError(ErrorCode.NO_DATA, f"hole in {s.file.path} at chunk {index} "  # type: ignore[union-attr]
                                                           f"offset {coff + got} (forbid_holes)", s.file.path)  # type: ignore[union-attr]
                else:
                    self._zero(s.dest[pos + got : pos + k])  # type: ignore[index]
        else:
            code = exc.code if isinstance(exc, StripefsError) else ErrorCode.IO
            if code in RETRYABLE and attempt < self.retries:
                with self._cv:
                    self._inflight -= 1
                    self._retry.append((i, index, coff, k, pos, attempt + 1))
                    self._cv.notify()
                return
            msg = exc.message if isinstance(exc, StripefsError) else str(exc)
            where = f"server {sid}" if sid >= 0 else "no server"
            err = StripefsError(code, f"read of {s.file.path} [{s.offset}, +{s.length}): chunk {index} on {where}: {msg}",  # type: ignore[union-attr]
                                s.file.path)  # type: ignore[union-attr]
            err.__cause__ = exc
        with self._cv:
            self._inflight -= 1
            if err is not None and s.error is None:
                s.error = err
            s.pending -= 1
            if s.pending == 0:
                self._done.append(i)
            self._cv.notify()

    def _zero(self, view: memoryview) -> None:
        if len(self._zeros) < len(view):
            self._zeros = memoryview(bytes(max(len(view), 1 << 16)))  # grows to one chunk, once
        view[:] = self._zeros[: len(view)]

    def _reap(self) -> list[Completion]:
        out: list[Completion] = []
        with self._cv:
            while self._done:
                i = self._done.popleft()
                s = self._slots[i]
                err = s.error
                out.append(Completion(s.userdata, -err.errno if err is not None else s.n, err))
                s.clear()
                self._free.append(i)
                self._outstanding -= 1
        return out
