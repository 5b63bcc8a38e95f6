"""The read ring: prepare many reads, submit them at once, reap completions (3FS *ior*).

Each prepared read is cut at chunk boundaries; every piece goes as one
``ReadChunk`` to a serving replica of its chain, chosen as the native client
chooses (:meth:`fsclient.Client.read_target`: spread by chunk, the next replica
on a retry), and the connection's reader thread receives its payload with
``recv_into`` straight into the caller's buffer slice. Pieces to all servers are
in flight together (up to ``max_inflight``); a read completes when its last
piece does. A piece whose replica fails its checksum is read again from the next
replica; one whose server is unavailable is retried after a routing refresh.

Threads: the caller's thread prepares, submits and waits (it also refills the
window and resubmits retried pieces inside :meth:`ReadRing.wait`); reader
threads of the connections only account completed pieces under one lock.

Generations: every :meth:`ReadRing.submit` starts a generation, and each piece
carries the generation of its read. A read given up on (``read(timeout=)``
expiring, :meth:`ReadRing.cancel`) has its pieces abandoned (their connections
closed, so no late answer lands in a buffer the caller reuses) and its slot
freed at once; answers still arriving for it carry an old generation and are
dropped, so they never count for, or write zeros into, the read that reuses
the slot.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Sequence

from stripefs.rpc import abandon
from stripefs.wire import Attr, ErrorCode, Layout, StripefsError, check_segments, messages as m

from ..core import ClusterConfig, split
from ._mounted import resolve_mounted

if TYPE_CHECKING:
    from stripefs.rpc import Reply

    from ..core import Client

__all__ = ["ReadRing", "Completion", "RegisteredFile"]

# Retried after a backoff and a routing refresh. BUSY: a server over its load bounds (for
# reads, one that refuses this client another connection while it holds none).
RETRYABLE = (ErrorCode.UNAVAILABLE, ErrorCode.STALE_ROUTING, ErrorCode.BUSY)
RETRY_DELAY = 0.1
CANCELLED = -1  # the generation of a slot given up on: matches no piece
# A piece: slot, generation, chunk index, offset in the chunk, length, position in the read, attempt.
Piece = tuple[int, int, int, int, int, int, int]
_read_reply = m.ReadChunkReply.from_header  # decoded once per piece: bind the fast path once


def _received(reply: "Reply", dest: memoryview, coff: int) -> int:
    """Bytes a ``ReadChunk`` answer delivered into ``dest``, checked end to end.

    Raises:
        StripefsError: PROTOCOL for a malformed header or one that disagrees
            with the payload received; CHECKSUM when the payload differs from the
            segment checksums the server sent (retried on another replica).
    """
    rr = _read_reply(reply.header)
    got = rr.length
    if got != reply.nbytes:
        raise StripefsError(ErrorCode.PROTOCOL, f"ReadChunk reply announces {got} bytes, its payload has {reply.nbytes}")
    if rr.crcs is not None:
        check_segments(dest[:got], coff, rr.crcs)
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
    """One finished read: ``result`` is bytes read (short at EOF) or ``-errno``.

    ``generation`` numbers the :meth:`ReadRing.submit` call that sent the read
    (1, 2, ... per ring), so a caller can tell batches apart.
    """

    userdata: Any
    result: int
    error: StripefsError | None = None
    generation: int = field(default=0, compare=False)  # which batch, not what was read


class _Read:
    """A ring entry (slot). Reused; fields are cleared when its completion is reaped.

    ``gen``: 0 while free or prepared, the submission's generation once
    submitted, ``CANCELLED`` while it is being given up on. ``owner``: the
    ``read()`` call that prepared it (None: the caller's ``prepare``). ``futs``:
    its pieces on the wire (abandoned on cancel).
    """

    __slots__ = ("dest", "file", "offset", "length", "userdata", "n", "pending", "error", "gen", "owner", "futs")

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.dest: memoryview | None = None
        self.file: RegisteredFile | None = None
        self.offset = self.length = self.n = self.pending = self.gen = 0
        self.userdata: Any = None
        self.owner: object | None = None
        self.error: StripefsError | None = None
        self.futs: set[Future] = set()


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


def _registered(attr: Attr, path: str) -> RegisteredFile:
    if not attr.is_file or attr.layout is None:
        raise StripefsError(ErrorCode.IS_DIR if attr.is_dir else ErrorCode.INVALID, "not a regular file", path)
    return RegisteredFile(attr.ino, attr.layout, attr.size, path)


class ReadRing:
    """A submission/completion ring for batched zero-copy reads.

    Args:
        client: the :class:`fsclient.Client` whose connections carry the reads.
        entries: most reads prepared or in flight at once.
        max_inflight: most chunk requests on the wire at once (all servers).
        forbid_holes: fail a read that covers a hole (NO_DATA / ENODATA)
            instead of reading zeros (3FS ``HF3FS_IOR_FORBID_READ_HOLES``).
        retries: resubmissions of a piece whose server was unavailable, after a
            routing refresh (a restarted server moves to a new port); each goes
            to the next replica of the chain. None (the default): the native
            client's budget instead -- retried for ``retry_for`` seconds after the
            piece first failed (a chain with no serving target while a server
            returns), as :meth:`Client.read_into <fsclient.Client.read_into>` does.

    Caveats:
        * One thread drives a ring; several rings may share a client.
        * A ring belongs to the process that made it; after ``fork`` make a new one.
        * The window is refilled inside :meth:`wait`: a batch larger than
          ``max_inflight`` pieces progresses only while someone waits.
        * A server that hangs without closing its socket stalls its reads; use
          ``wait(timeout=)`` and then :meth:`cancel` (or ``read(timeout=)``, which
          cancels its own reads when it gives up). Cancelling closes the
          connections that carried the abandoned pieces; other requests on them
          fail over as after any lost connection.
    """

    def __init__(self, client: "Client", entries: int = 1024, *, max_inflight: int = 256,
                 forbid_holes: bool = False, retries: int | None = None):
        if entries < 1 or max_inflight < 1:
            raise StripefsError(ErrorCode.INVALID, "entries and max_inflight must be >= 1")
        self.client = client
        self.entries = entries
        self.max_inflight = max_inflight
        self.forbid_holes = forbid_holes
        self.retries = retries
        self._since: dict[tuple[int, int, int, int], float] = {}  # piece -> when it first failed
        self.pid = os.getpid()
        self._slots = [_Read() for _ in range(entries)]
        self._free = deque(range(entries))
        self._prepared: list[int] = []
        self._queue: deque[Piece] = deque()
        self._retry: list[Piece] = []
        self._refresh = False  # a retried piece waits for a routing refresh (its server was unavailable)
        self._done: deque[int] = deque()
        self._stash: list[Completion] = []  # the caller's completions that a read() call reaped
        self._outstanding = 0  # submitted, not yet reaped
        self._inflight = 0
        self._generation = 0
        self._cv = threading.Condition(threading.Lock())
        # Completed reads the waiting caller needs before it can return (0: none waits, or it
        # wants every completion): a piece wakes it only then, or when it has pieces to send.
        self._wake_at = 0
        self._zeros = memoryview(b"")

    # -- files ------------------------------------------------------------------------------
    def open(self, path: str) -> RegisteredFile:
        """Register a stripefs file by path (one metadata round trip)."""
        return _registered(self.client.stat(path), path)

    def open_many(self, paths: Sequence[str]) -> list[RegisteredFile]:
        """Register many files by path, 200 per metadata round trip (``StatMany``).

        Raises:
            StripefsError: the first path, in order, that is missing or not a regular file.
        """
        found = self.client.stat_many(paths)
        for path, attr in zip(paths, found):
            if isinstance(attr, StripefsError):
                raise attr
        return [_registered(attr, path) for path, attr in zip(paths, found)]  # type: ignore[arg-type]

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
        self._prepare(dest, file, offset, length, userdata, None)

    @staticmethod
    def _dest(dest: Any, file: RegisteredFile, offset: int, length: int) -> memoryview:
        """``dest`` as a writable byte view, checked against the read of ``length`` at ``offset``."""
        view = dest if isinstance(dest, memoryview) and dest.format == "B" and dest.ndim == 1 and not dest.readonly else as_dest(dest)
        if offset < 0 or length < 0:
            raise StripefsError(ErrorCode.INVALID, f"negative offset or length ({offset}, {length})", file.path)
        if len(view) < length:
            raise StripefsError(ErrorCode.INVALID, f"destination holds {len(view)} bytes, read wants {length}", file.path)
        return view

    def _prepare(self, dest: Any, file: RegisteredFile, offset: int, length: int, userdata: Any,
                 owner: object | None) -> None:
        self._check_pid()
        view = self._dest(dest, file, offset, length)
        if not self._free:
            raise StripefsError(ErrorCode.BUSY, f"ring full: {self.entries} reads prepared or in flight")
        i = self._free.popleft()
        s = self._slots[i]
        s.dest, s.file, s.offset, s.length, s.userdata, s.owner = view, file, offset, length, userdata, owner
        self._prepared.append(i)

    def submit(self) -> int:
        """Send every prepared read (one new generation). Returns how many were submitted."""
        self._check_pid()
        count = len(self._prepared)
        if not count:
            self._pump()
            return 0
        self._generation += 1
        gen = self._generation
        for i in self._prepared:
            s = self._slots[i]
            assert s.file is not None
            s.n = max(0, min(s.length, s.file.size - s.offset))  # past EOF: short count
            s.pending = 0
            for index, coff, k, pos in split(s.file.layout, s.offset, s.n):
                self._queue.append((i, gen, index, coff, k, pos, 0))
                s.pending += 1
            with self._cv:
                s.gen = gen
                self._outstanding += 1
                if s.pending == 0:
                    self._done.append(i)
        self._prepared.clear()
        self._pump()
        return count

    def wait(self, min_completions: int = 1, timeout: float | None = None) -> list[Completion]:
        """Wait until at least ``min_completions`` reads are done (or ``timeout`` passes).

        A timeout gives up on nothing: the reads stay in flight and a later
        ``wait`` reaps them. To give up on them, call :meth:`cancel`.

        Returns:
            Every completion available (possibly more than asked, fewer on timeout;
            ``min_completions=0`` polls). Their ring slots are free again.
        """
        self._check_pid()
        stash, self._stash = self._stash, []
        return stash + [c for _owner, c in self._wait(max(0, min_completions - len(stash)), timeout)]

    def _wait(self, min_completions: int, timeout: float | None) -> list[tuple[object | None, Completion]]:
        """:meth:`wait` without the stash: completions with the ``read()`` call owning each."""
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
                self._wake_at = want
                try:
                    self._cv.wait(remaining)
                finally:
                    self._wake_at = 0
        return self._reap()

    def read(self, reads: "list[tuple[Any, RegisteredFile, int, int]]", timeout: float | None = None) -> list[int]:
        """Convenience: read every ``(dest, file, offset, length)`` and wait for all.

        More reads than ``entries`` go through the ring in turns. When it raises,
        none of its reads is left in flight: they are cancelled (nothing lands in
        their destinations afterwards) and the ring is ready for reuse.

        Returns:
            Bytes read per read, in order.

        Raises:
            StripefsError: the first failed read's error (after all have finished);
                TIMEOUT when ``timeout`` passes with reads in flight.
        """
        if (len(reads) == 1 and timeout is None and not (self.forbid_holes or self.retries is not None)
                and not (self._prepared or self._outstanding or self._stash)):
            n = self._read_one(*reads[0])
            if n is not None:
                return [n]
        out = [0] * len(reads)
        first: StripefsError | None = None
        nxt = 0
        left = len(reads)
        deadline = None if timeout is None else time.monotonic() + timeout
        token = object()  # marks this call's slots: completions of the caller's own reads are kept aside
        try:
            while left:
                while nxt < len(reads) and self._free:
                    dest, f, off, n = reads[nxt]
                    self._prepare(dest, f, off, n, nxt, token)
                    nxt += 1
                self.submit()
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                # Every read in: nothing to wait for but all of them (one wake-up, not one each).
                got = self._wait(1 if nxt < len(reads) else left, remaining)
                mine = [c for owner, c in got if owner is token]
                self._stash.extend(c for owner, c in got if owner is not token)
                if not mine and deadline is not None and time.monotonic() >= deadline:
                    raise StripefsError(ErrorCode.TIMEOUT, f"{left} reads still in flight after {timeout}s")
                for c in mine:
                    out[c.userdata] = c.result
                    first = first or c.error
                left -= len(mine)
        except BaseException:
            self._drop(lambda s: s.owner is token)
            raise
        if first is not None:
            raise first
        return out

    def _read_one(self, dest: Any, file: RegisteredFile, offset: int, length: int) -> int | None:
        """A batch of one read within one chunk, with the ring idle and its reads as the
        client's (holes read as zeros, the client's retry budget): the client's blocking read
        (``Client.read_into``: straight into ``dest``, the calling thread receives its
        answer, no completion to hand over from a reader thread). None: the ring's way."""
        self._check_pid()
        view = self._dest(dest, file, offset, length)
        n = max(0, min(length, file.size - offset))
        cs = file.layout.chunk_size
        if n == 0 or offset // cs != (offset + n - 1) // cs:
            return None
        return self.client.read_into(file.ino, file.layout, file.size, offset, view[:n])

    def cancel(self) -> int:
        """Give up on every read submitted and not yet reaped.

        Their pieces on the wire are abandoned (the connections carrying them
        are closed, and this returns only once no reader thread is copying into
        their destinations), their completions are never returned, and their
        slots are free at once. Prepared reads that were not submitted stay.

        Returns:
            How many reads were given up on.
        """
        self._check_pid()
        return self._drop(lambda s: s.owner is None)

    @property
    def in_flight(self) -> int:
        """Reads submitted and not yet reaped."""
        return self._outstanding + len(self._stash)

    def close(self, timeout: float = 30.0) -> None:
        """Wait for reads in flight, then cancel what is left, so no reader thread
        writes into a buffer the caller frees after this returns."""
        end = time.monotonic() + timeout
        if os.getpid() != self.pid:
            return
        while self._outstanding and time.monotonic() < end:
            self.wait(self._outstanding, end - time.monotonic())
        self._stash.clear()
        if self._outstanding:
            self._drop(lambda s: True)

    def __enter__(self) -> "ReadRing":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------
    def _check_pid(self) -> None:
        if os.getpid() != self.pid:
            raise StripefsError(ErrorCode.INVALID, "a ReadRing belongs to the process that made it; make one per process")

    def _drop(self, which: "Callable[[_Read], bool]") -> int:
        """Give up on the submitted-not-reaped (and prepared) reads ``which`` selects.

        Returns:
            How many submitted reads were given up on.
        """
        with self._cv:
            victims = [i for i, s in enumerate(self._slots) if s.gen > 0 and which(s)]
            futs = []
            for i in victims:
                s = self._slots[i]
                s.gen = CANCELLED  # from here on, answers for its pieces are stale
                futs.extend(s.futs)
        for fut in futs:
            abandon(fut)  # closes the connection; returns once nothing is copied into the slot's buffer
        prepared = [i for i in self._prepared if self._slots[i].gen == 0 and which(self._slots[i])]
        with self._cv:
            gone = set(victims)
            self._done = deque(i for i in self._done if i not in gone)
            for i in victims + prepared:
                self._slots[i].clear()
                self._free.append(i)
            self._outstanding -= len(victims)
            self._cv.notify_all()
        if prepared:
            self._prepared = [i for i in self._prepared if i not in set(prepared)]
        return len(victims)

    def _pump(self) -> None:
        """Refill the window (caller's thread only): new pieces first, then due retries."""
        if self._retry:
            with self._cv:
                retry, self._retry = self._retry, []
                refresh, self._refresh = self._refresh, False
            if refresh:
                # Back off with the attempts, up to a second: a chain may wait for a server to return.
                time.sleep(min(RETRY_DELAY * max(p[6] for p in retry), 1.0))
                try:
                    self.client.routing(refresh=True)
                except StripefsError:
                    pass  # the piece fails again below with the server's own error
            self._queue.extendleft(retry)
        while self._queue and self._inflight < self.max_inflight:
            piece = self._queue.popleft()
            i, gen, index, coff, k, pos, attempt = piece
            s = self._slots[i]
            if s.gen != gen:  # its read was cancelled
                continue
            assert s.file is not None and s.dest is not None
            sid = -1
            chain = s.file.layout.chain_of(index)
            try:
                routing = self.client.routing()
                sid = self.client.read_target(s.file.ino, s.file.layout, index, attempt)
                fut = self.client.data_connection(sid).submit(
                    m.ReadChunk(ino=s.file.ino, index=index, offset=coff, length=k, chain=chain,
                                routing_version=routing.version),
                    dest=s.dest[pos : pos + k])
            except StripefsError as exc:
                fut = Future()
                fut.set_exception(exc)
            with self._cv:
                self._inflight += 1
                s.futs.add(fut)
            fut.add_done_callback(partial(self._on_piece, piece, sid))

    def _on_piece(self, piece: Piece, sid: int, fut: Future) -> None:
        """Account one finished piece (a reader thread, or the caller's on a local failure).

        Never raises: a failure here would be lost in the future's callback
        machinery and leave its read pending forever (``wait`` would hang), so
        any unexpected error fails the read instead.
        """
        i, gen, index, coff, k, pos, attempt = piece
        s = self._slots[i]
        exc = fut.exception()
        got = 0
        if exc is None:
            try:
                got = _received(fut.result(), s.dest[pos : pos + k], coff)
            except StripefsError as bad:  # a malformed reply: fails like a server error
                exc = bad
        code = (exc.code if isinstance(exc, StripefsError) else ErrorCode.IO) if exc is not None else None
        replicas = 1
        if code == ErrorCode.CHECKSUM and s.file is not None:
            try:
                replicas = len(self.client.routing().chains.get(s.file.layout.chain_of(index), ()))
            except Exception:  # noqa: BLE001 - no failover then; the checksum error stands
                pass
        with self._cv:
            self._inflight -= 1
            s.futs.discard(fut)
            if s.gen != gen:  # given up on: the slot may already hold another read
                self._cv.notify()
                return
            err: StripefsError | None = None
            try:
                if exc is None:
                    if got < k:  # within the file size (clipped at submit): a hole or short chunk
                        if self.forbid_holes:
                            err = StripefsError(ErrorCode.NO_DATA, f"hole in {s.file.path} at chunk {index} "  # type: ignore[union-attr]
                                                                   f"offset {coff + got} (forbid_holes)", s.file.path)  # type: ignore[union-attr]
                        else:
                            # Under the lock: a cancel cannot free (and a new read reuse) the slot meanwhile.
                            self._zero(s.dest[pos + got : pos + k])  # type: ignore[index]
                else:
                    # The native client's failover (fsclient/core/_core.py): a bad checksum is read
                    # from the next replica at once; an unavailable server after a routing refresh.
                    again = code == ErrorCode.CHECKSUM and attempt + 1 < replicas
                    if again or (code in RETRYABLE and self._may_retry((i, gen, index, pos), attempt)):
                        self._retry.append((i, gen, index, coff, k, pos, attempt + 1))
                        self._refresh = self._refresh or not again
                        self._cv.notify()
                        return
                    msg = exc.message if isinstance(exc, StripefsError) else str(exc)
                    where = f"server {sid}" if sid >= 0 else "no server"
                    err = StripefsError(code, f"read of {s.file.path} [{s.offset}, +{s.length}): chunk {index} on {where}: {msg}",  # type: ignore[arg-type, union-attr]
                                        s.file.path)  # type: ignore[union-attr]
                    err.__cause__ = exc
            except Exception as bug:  # noqa: BLE001 - see the docstring
                path = s.file.path if s.file is not None else None
                err = StripefsError(ErrorCode.IO, f"read of {path} [{s.offset}, +{s.length}): chunk {index}: {bug!r}", path)
                err.__cause__ = bug
            if err is not None and s.error is None:
                s.error = err
            s.pending -= 1
            if s.pending == 0:
                self._done.append(i)
            if len(self._done) >= self._wake_at or self._queue:  # else the waiter would only wait again
                self._cv.notify()

    def _may_retry(self, key: tuple[int, int, int, int], attempt: int) -> bool:
        """Within the retry budget: ``retries`` attempts, or by default the client's ``retry_for``."""
        if self.retries is not None:
            return attempt < self.retries
        now = time.monotonic()
        if len(self._since) > 4 * self.entries:  # pieces that finished since: forget them
            self._since = {k: t for k, t in self._since.items() if now - t <= 2 * self.client.retry_for}
        return now - self._since.setdefault(key, now) <= self.client.retry_for

    def _zero(self, view: memoryview) -> None:
        """Fill ``view`` with zeros from one shared zero buffer, grown to the largest hole seen.

        The buffer is read once into a local: another thread growing it at the
        same time may replace it with a smaller one, and slicing the attribute
        again would then come up short.
        """
        zeros = self._zeros
        if len(zeros) < len(view):
            zeros = memoryview(bytes(max(len(view), 1 << 16)))  # grows to one chunk
            self._zeros = zeros
        view[:] = zeros[: len(view)]

    def _reap(self) -> list[tuple[object | None, Completion]]:
        out: list[tuple[object | None, Completion]] = []
        with self._cv:
            while self._done:
                i = self._done.popleft()
                s = self._slots[i]
                err = s.error
                out.append((s.owner, Completion(s.userdata, -err.errno if err is not None else s.n, err, s.gen)))
                s.clear()
                self._free.append(i)
                self._outstanding -= 1
        return out
