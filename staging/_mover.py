"""The mover: uploads staged checkpoints to the shared store and commits them atomically.

Upload of one checkpoint (idempotent, resumable):

1. if the final directory already holds a manifest with this checkpoint's id,
   an earlier run committed it and died before recording that: done;
2. files go into a hidden sibling ``.<name>.partial-<id>``, each from its
   journal offset (``file.done``), in 32 MiB pieces with two in flight; every
   piece read from local disk is checked against the CRC32Cs recorded at
   snapshot time, and the storage servers check each chunk's CRC32C again;
   a piece is journaled as done only once it is acknowledged (on the servers'
   disks) *and* the file's committed length covers it, so a resume never
   skips bytes that a reader could not see;
3. each file, once uploaded, is checked in the store (committed size and,
   unless ``MoverOptions.verify`` is off, every CRC32C: read back, overlapping
   the other files' uploads — or, while its bytes are still in memory, compared
   with every replica's stored block CRC32Cs, no read-back); a file that fails
   is sent again from its start, once;
4. the manifest is written last, then the directory is renamed to its final
   name with ``noreplace`` — one atomic metadata transaction, so readers see
   either nothing or the whole step.

Transient faults (server unreachable, timeouts) are retried with exponential
backoff from the last durable offset; a checksum mismatch or a different
checkpoint already committed under the URL fail the checkpoint for good.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import mmap
import os
import posixpath
import re
import shutil
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import crc32c

from stripefs.fsclient import Client, normpath
from stripefs.wire import ErrorCode, StripefsError

from . import _stats
from ._durable import process_umask
from ._format import MANIFEST, CheckpointConflict, CheckpointSuperseded, ChecksumError, manifest_with, parse_manifest
from ._journal import CkptRow, FileRow, Journal, fault_point
from ._replicas import Durability, durability_of
from ._verify import file_problems, stored_problem

__all__ = ["MoverOptions", "Uploader", "SnapshotViews", "checkpoint_path", "remote_paths", "remove_tree", "client_for",
           "transient", "with_retries"]

log = logging.getLogger("stripefs.staging")

PIECE = 32 << 20
DEPTH = 2  # pieces in flight per file
UPLOAD_QOS = "background"  # the mover's writes yield to every other writer's at the servers (storage/_qos.py)


@dataclass
class MoverOptions:
    """Knobs of the upload; the same for the in-process and the standalone mover."""

    concurrency: int = 2            # files uploaded at once
    bandwidth: float | None = None  # bytes/s cap over the whole checkpoint, None = unlimited
    retries: int = 5                # transient failures tolerated per checkpoint and attempt
    backoff: float = 0.5            # first retry delay (doubles, capped at 8 s)
    cluster: str | None = None      # overrides the cluster recorded in the journal
    piece: int = PIECE              # upload unit; the journal records progress per piece
    verify: bool = True             # before the commit, check every uploaded file's CRC32Cs: read back, or
                                    # (bytes still in memory) each replica's stored block CRC32Cs
                                    # (False: committed sizes only)
    qos: str = UPLOAD_QOS           # the upload's traffic class at the storage servers (storage/_qos.py)


_clients: dict[tuple[str, str], Client] = {}
_clients_lock = threading.Lock()


def client_for(cluster: str | None, qos: str = "interactive") -> Client:
    """A process-wide Client per cluster spec and traffic class (connections are reused
    across saves)."""
    key = (cluster or "", qos)
    with _clients_lock:
        c = _clients.get(key)
        if c is None or c.pid != os.getpid():
            c = _clients[key] = Client(cluster, qos=qos)
        return c


def drop_client(cluster: str | None) -> None:
    with _clients_lock:
        dropped = [_clients.pop(k) for k in [k for k in _clients if k[0] == (cluster or "")]]
    for c in dropped:
        _close_quietly(c)


def _close_quietly(c: Client) -> None:
    try:
        c.close()
    except OSError:
        pass


def checkpoint_path(url: Any) -> str:
    """The path in the file system of checkpoint ``url``: ``stripefs://run/step-100`` or an
    absolute path (``/run/step-100``).

    Raises:
        ValueError: not a string, or a URL of another scheme (``s3://``, ``file://``;
            ``stripefs:/x`` with one slash), which would otherwise become a directory of
            that name in the file system.
    """
    if not isinstance(url, str):
        raise ValueError(f"a checkpoint URL is a string such as 'stripefs://run/step-100', not {url!r}")
    scheme = _SCHEME.match(url)
    if scheme and not url.startswith("stripefs://"):
        raise ValueError(f"{url!r} is not a stripefs URL: use 'stripefs://path' or an absolute path '/path'")
    return normpath(url)


_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def remote_paths(url: str, ckpt_id: str) -> tuple[str, str]:
    """``(final, partial)`` paths of a checkpoint in the file system."""
    final = checkpoint_path(url)
    head, name = posixpath.split(final)
    if not name:
        raise StripefsError(ErrorCode.INVALID, "checkpoint URL must name a directory below the root", url)
    return final, posixpath.join(head, f".{name}.partial-{ckpt_id}")


def remove_tree(client: Client, path: str) -> None:
    """Delete a directory tree; missing paths are fine."""
    try:
        entries = list(client.scandir(path))
    except (FileNotFoundError, NotADirectoryError):
        return
    for e in entries:
        child = posixpath.join(path, e.name)
        if e.attr is not None and e.attr.is_dir:
            remove_tree(client, child)
        else:
            try:
                client.remove(child)
            except FileNotFoundError:
                pass
    try:
        client.rmdir(path)
    except FileNotFoundError:
        pass


def committed_id(client: Client, final: str) -> str | None:
    """Checkpoint id of the manifest committed at ``final``, or None when nothing is there."""
    try:
        raw = client.read_bytes(posixpath.join(final, MANIFEST))
    except (FileNotFoundError, NotADirectoryError):
        return None
    return str(parse_manifest(raw, final).get("id"))


def with_retries(fn: Callable[[], None], options: MoverOptions, what: str, cluster: str | None,
                 noted: Callable[[BaseException], None] | None = None) -> None:
    """``fn()``, again after each transient failure (the store unreachable, a timeout), up to
    ``options.retries`` times with exponential backoff; the client of ``cluster`` is dropped
    between tries (cluster.json is read again: the cluster may have moved).

    Raises:
        ChecksumError, CheckpointConflict: at once (never retried).
        OSError: the last failure, or one that is not transient.
    """
    delay = options.backoff
    for attempt in range(options.retries + 1):
        try:
            fn()
            return
        except (ChecksumError, CheckpointConflict):
            raise
        except (ConnectionError, TimeoutError, StripefsError, OSError) as exc:
            if not transient(exc) or attempt == options.retries:
                raise
            if noted is not None:
                noted(exc)
            drop_client(cluster)
            log.warning("checkpoint %s: upload failed (%s); retry %d in %.1fs", what, exc, attempt + 1, delay)
            time.sleep(delay)
            delay = min(delay * 2, 8.0)


class _Throttle:
    """The upload's pace: at most ``rate`` bytes/s over the checkpoint when set, and
    yielding to the servers' other writers. The mover writes in the background class
    (:data:`UPLOAD_QOS`, ``MoverOptions.qos``), so its writes wait for slots behind everyone else's and the
    servers say how long (:attr:`Client.queue_delay`); past :data:`QUEUE_TARGET` the
    upload waits as long again before its next piece (at most :data:`MAX_YIELD`): the
    busier the servers' bulk lanes, the more of them it leaves to a job's own burst."""

    QUEUE_TARGET = 0.005
    MAX_YIELD = 0.5

    def __init__(self, rate: float | None, client: Client | None = None):
        self.rate, self.t0, self.sent, self.lock = rate, time.monotonic(), 0, threading.Lock()
        self.client = client
        self.yielded = 0.0  # seconds waited for the servers' queues (tests, stats)

    def account(self, n: int) -> None:
        delay = self.client.queue_delay if self.client is not None else 0.0
        if delay > self.QUEUE_TARGET:
            wait = min(delay, self.MAX_YIELD)
            with self.lock:
                self.yielded += wait
            time.sleep(wait)
        if not self.rate:
            return
        with self.lock:
            self.sent += n
            ahead = self.sent / self.rate - (time.monotonic() - self.t0)
        if ahead > 0:
            time.sleep(ahead)


# The local copy is written (staging._save) and read back for the upload with O_DIRECT where
# its buffers allow: ``STRIPEFS_DIRECT_IO=0`` (the storage servers' knob too): never.
DIRECT_LOCAL = os.environ.get("STRIPEFS_DIRECT_IO", "1") != "0"


def open_direct(path: str, flags: int) -> int | None:
    """``path`` opened with ``flags | O_DIRECT``; None when direct I/O is off
    (:data:`DIRECT_LOCAL`) or the file system takes none (EINVAL: tmpfs)."""
    if not DIRECT_LOCAL:
        return None
    try:
        return os.open(path, flags | os.O_DIRECT)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return None


class _StagedFile:
    """A staged file read piece by piece into page-aligned buffers: with ``O_DIRECT`` where the
    file system takes it (the local copy was written so, and is not in the page cache: a
    buffered read would fill the cache with it and copy it once more), else buffered."""

    def __init__(self, path: str):
        self.name = path
        self.fd = os.open(path, os.O_RDONLY)
        try:
            self.direct = open_direct(path, os.O_RDONLY)
        except BaseException:
            os.close(self.fd)
            raise

    def read_into(self, buf: mmap.mmap, off: int, n: int) -> int:
        """Bytes ``[off, off + n)`` into the start of ``buf`` (a mapping of at least ``n`` bytes
        rounded up to a page); how many there were (fewer: the file is shorter)."""
        whole = -(-n // mmap.PAGESIZE) * mmap.PAGESIZE
        if self.direct is not None and off % mmap.PAGESIZE == 0 and whole <= len(buf):
            try:
                return min(n, _pread_all(self.direct, memoryview(buf)[:whole], off))
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                os.close(self.direct)
                self.direct = None
        return _pread_all(self.fd, memoryview(buf)[:n], off)

    def close(self) -> None:
        os.close(self.fd)
        if self.direct is not None:
            os.close(self.direct)


def _pread_all(fd: int, view: memoryview, off: int) -> int:
    """``preadv`` until ``view`` is full or the file ends; how many bytes were read."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], off + done)
        if got == 0:
            break
        done += got
    return done


class SnapshotViews:
    """The snapshot buffer's file views (file index -> memoryview), lent to an upload.

    The upload borrows a piece's view while the piece is in flight; :meth:`revoke` (called
    once the local copy is durable) stops further loans and waits for the pieces in flight,
    after which the buffer may be reused by the next save and the upload reads the staged
    files instead. Holding the buffer for the whole upload would make the next save wait
    for the upload — the stall asynchronous checkpointing exists to avoid. A piece's loan
    ends as soon as its write is acknowledged or fails (:class:`_Loan`), not when the upload
    loop gets to it: a revoke never waits out the bandwidth cap's pause between pieces.
    """

    def __init__(self, views: list[memoryview]):
        self._views: list[memoryview] | None = views
        self._loans = 0
        self._cond = threading.Condition()

    def borrow(self, index: int, off: int, n: int) -> memoryview | None:
        """``n`` bytes of file ``index`` at ``off``, or None once revoked (read the staged file)."""
        with self._cond:
            if self._views is None:
                return None
            self._loans += 1
            return self._views[index][off : off + n]

    def give_back(self) -> None:
        """A borrowed piece is no longer read by anyone (its write completed or failed)."""
        with self._cond:
            self._loans -= 1
            self._cond.notify_all()

    def revoke(self) -> None:
        """No more loans; returns once every borrowed piece is given back. Idempotent."""
        with self._cond:
            self._views = None
            while self._loans:
                self._cond.wait()


class _Loan:
    """One borrowed piece: given back exactly once, by whichever sees its write end first (the
    write's completion callback, or the upload loop)."""

    __slots__ = ("_views", "_lock")

    def __init__(self, views: SnapshotViews):
        self._views: SnapshotViews | None = views
        self._lock = threading.Lock()

    def end(self, _fut: Any = None) -> None:
        with self._lock:
            views, self._views = self._views, None
        if views is not None:
            views.give_back()


@dataclass
class Uploader:
    """Uploads one checkpoint; ``buffers`` (the snapshot, while lent) skips re-reading local files.

    ``manifest`` (returns the manifest's bytes; called at the commit, so it may wait for them)
    is for a checkpoint with no local copy (``keep_local=0``); otherwise the commit reads the
    staged manifest.
    """

    journal: Journal
    row: CkptRow
    options: MoverOptions = field(default_factory=MoverOptions)
    buffers: SnapshotViews | None = None
    manifest: Callable[[], bytes] | None = None
    on_progress: Callable[[int], None] | None = None
    uploaded: int = 0  # bytes sent by this uploader (tests check resume skips done bytes)
    durability: Durability | None = None  # the store's replication at the commit, once committed
    # One rank of a save by several ranks (``_ranks``): its files go into the checkpoint's
    # partial directory (``partial_id``: the checkpoint's id, not this rank's row's), and
    # ``finish(client, final, partial)`` replaces the commit (the rank writes its part record).
    partial_id: str | None = None
    finish: Callable[[Client, str, str], None] | None = None

    def run(self, wait_local: Callable[[], None] | None = None) -> None:
        """Upload with retries, then commit. ``wait_local`` blocks until the local copy is durable.

        Raises:
            ChecksumError: a staged file does not match its recorded checksums.
            CheckpointConflict: another checkpoint is committed under the URL.
            OSError: the store stayed unreachable through every retry.
        """
        with_retries(lambda: self._attempt(wait_local), self.options, self.row.url, self.options.cluster or self.row.cluster,
                     lambda exc: self.journal.note_error(self.row.id, f"{type(exc).__name__}: {exc}"))

    def _attempt(self, wait_local: Callable[[], None] | None) -> None:
        client = client_for(self.options.cluster or self.row.cluster, self.options.qos)
        final, partial = remote_paths(self.row.url, self.partial_id or self.row.id)
        existing = committed_id(client, final)
        if existing == self.row.id:  # committed by an earlier attempt whose journal update was lost
            self.durability = _recorded_durability(client, final)
            self.journal.set_state(self.row.id, "committed",
                                   durability=self.durability.to_json() if self.durability else None)
            remove_tree(client, partial)  # what a commit that replaced an earlier save left there
            return
        if existing is not None and not self._replaces(existing):
            raise CheckpointConflict(f"{final} already holds checkpoint {existing} (another writer saved this step)", final)
        files = self.journal.files(self.row.id)
        if not client.isdir(partial):
            if any(f.done for f in files):
                self.journal.reset_progress(self.row.id)  # the partial upload is gone: start over
                files = self.journal.files(self.row.id)
            client.makedirs(partial, 0o777 & ~process_umask())  # the parents it creates too
        throttle = _Throttle(self.options.bandwidth, client)
        with ThreadPoolExecutor(max(1, self.options.concurrency), thread_name_prefix="stripefs-mover") as pool:
            for fut in [pool.submit(self._upload_checked, client, partial, f, throttle) for f in files]:
                fut.result()
        if wait_local is not None:
            wait_local()
        (self.finish or self._commit)(client, final, partial)

    def _upload_checked(self, client: Client, partial: str, f: FileRow, throttle: _Throttle) -> None:
        """Upload what is left of ``f``, then check it in the store (its read-back overlaps the
        other files' uploads).

        What the rename publishes must be whole: a file the journal calls done but whose
        committed size or bytes differ (a journal written by an older mover, a lost chunk) is
        sent again from its start; a second failure fails the checkpoint.

        Raises:
            ChecksumError: the file still fails its checks after being sent again.
        """
        if f.done < f.size or f.size == 0:
            self._upload_file(client, partial, f, throttle)
        bad = self._problem(client, partial, f)
        if not bad:
            return
        log.warning("checkpoint %s: re-uploading %s (%s)", self.row.url, f.name, bad)
        self.journal.progress(self.row.id, f.name, 0)
        self._upload_file(client, partial, dataclasses.replace(f, done=0), throttle)
        bad = self._problem(client, partial, f)
        if bad:
            raise ChecksumError(f"uploaded file {f.name} fails its checks: {bad}", partial)

    def _problem(self, client: Client, partial: str, f: FileRow) -> str | None:
        """What is wrong with uploaded file ``f``, or None.

        Sizes only without ``options.verify``. With it: while the bytes are still in memory
        (``keep_local=0``), every replica's stored CRC32Cs are compared with theirs (no
        read-back); otherwise the file is read back and checked against its recorded CRC32Cs.
        """
        if self.options.verify and self.buffers is not None:
            data = self.buffers.borrow(_file_index(f.name), 0, f.size)
            if data is not None:
                try:
                    return stored_problem(client, partial, f, data)
                finally:
                    self.buffers.give_back()
        return file_problems(client, partial, [f], checksums=self.options.verify).get(f.name)

    def _upload_file(self, client: Client, partial: str, f: FileRow, throttle: _Throttle) -> None:
        path = posixpath.join(partial, f.name)
        index = _file_index(f.name) if self.buffers is not None else -1
        piece = max(f.chunk, self.options.piece // f.chunk * f.chunk)  # whole checksum chunks per piece
        start_at = f.done if f.done and _committed_size(client, path) >= f.done else 0
        with client.open(path, "r+b" if start_at else "wb") as sf:
            _apply_umask(client, path, 0o666)
            local = None  # the staged file, opened once a piece is not served from the snapshot
            spare: list[Any] = []
            inflight: deque[tuple[int, int, Any, _Loan | None, Future]] = deque()
            try:
                off = start_at
                while off < f.size or inflight:
                    while off < f.size and len(inflight) < DEPTH:
                        n = min(piece, f.size - off)
                        view = self.buffers.borrow(index, off, n) if self.buffers is not None else None
                        loan, buf = (_Loan(self.buffers) if view is not None else None), None  # type: ignore[arg-type]
                        if view is None:
                            if local is None:
                                local = _StagedFile(os.path.join(self.row.local_dir, f.name))
                            buf = spare.pop() if spare else mmap.mmap(-1, piece)
                            view = memoryview(buf)[:n]
                            if local.read_into(buf, off, n) != n:
                                raise ChecksumError(f"staged file {f.name} is shorter than recorded", local.name)
                            _verify(view, off, f, local.name)
                        try:
                            fut = client.submit_write(sf.ino, sf.layout, off, view)
                        except BaseException:
                            if loan is not None:
                                loan.end()
                            raise
                        if loan is not None:
                            # The sender reads the view until the write ends: the loan ends then,
                            # even while this loop waits out the bandwidth cap (throttle below).
                            fut.add_done_callback(loan.end)
                        inflight.append((off, n, buf, loan, fut))
                        off += n
                    start, n, buf, loan, fut = inflight.popleft()
                    try:
                        fut.result()  # acknowledged: the bytes are on the servers' disks
                    finally:
                        if loan is not None:
                            loan.end()
                    if buf is not None:
                        spare.append(buf)
                    fault_point("piece_written")
                    # Readers see only up to the committed length: commit it before the journal
                    # calls the piece done, or a resume would skip bytes no reader can see.
                    # Pieces complete in order, so every byte below start + n is acknowledged.
                    client.commit_length(sf.ino, start + n, mtime_ns=time.time_ns())
                    self.journal.progress(self.row.id, f.name, start + n)
                    self.uploaded += n
                    _stats.UPLOADED.inc(n)
                    if self.on_progress:
                        self.on_progress(n)
                    fault_point("upload_piece")
                    throttle.account(n)
            finally:
                while inflight:  # never free a buffer the sender may still read
                    _, _, _, loan, fut = inflight.popleft()
                    try:
                        fut.result()
                    except BaseException:
                        pass
                    if loan is not None:
                        loan.end()
                if local is not None:
                    local.close()

    def _commit(self, client: Client, final: str, partial: str) -> None:
        if self.manifest is not None:
            raw = self.manifest()
        else:
            with open(os.path.join(self.row.local_dir, MANIFEST), "rb") as fh:
                raw = fh.read()
        # What the step is durable on: every file is acknowledged by now, by every serving
        # target of its chain; the manifest, the journal and the handle say how many those were.
        self.durability = durability_of(client)
        if self.durability is not None:
            raw = manifest_with(raw, "durability", self.durability.record())
            if not self.durability.full:
                log.warning("checkpoint %s commits with %s: a chain lost a storage server, so the step is not "
                            "yet stored with every replica", self.row.url, self.durability)
        client.write_bytes(posixpath.join(partial, MANIFEST), raw)
        _apply_umask(client, posixpath.join(partial, MANIFEST), 0o666)
        fault_point("before_rename")
        replaced: CkptRow | None = None
        try:
            client.rename(partial, final, noreplace=True)
        except FileExistsError:
            other = committed_id(client, final)
            if other != self.row.id:
                if other is None or not self._replaces(other):
                    remove_tree(client, partial)
                    raise CheckpointConflict(f"{final} was committed by another writer (checkpoint {other})",
                                             final) from None
                # An earlier save of this step from this staging directory (a run that died and
                # was resumed): this one takes its place in one step, the old one moves to the
                # partial name and goes.
                client.rename(partial, final, exchange=True)
                replaced = self.journal.get(other)
        fault_point("after_rename")
        self.journal.set_state(self.row.id, "committed",
                               durability=self.durability.to_json() if self.durability else None)
        if replaced is not None:
            remove_tree(client, partial)
            shutil.rmtree(replaced.local_dir, ignore_errors=True)
            self.journal.delete(replaced.id)

    def _replaces(self, other: str) -> bool:
        """Whether this checkpoint may replace checkpoint ``other``, committed at its URL: an
        earlier save of the same step recorded in this staging directory's journal (the
        leftover of a run that died, finished by a mover, then saved again by the resumed
        run: its own state wins). A checkpoint of another writer never is.

        Raises:
            CheckpointConflict: ``other`` is a later save of this step from this journal:
                this one is superseded.
        """
        row = self.journal.get(other)
        if row is None or row.url != self.row.url:
            return False
        if (row.created, row.id) > (self.row.created, self.row.id):
            raise CheckpointSuperseded(f"checkpoint {self.row.id} of {self.row.url} was superseded by a later save "
                                       f"of the same step (checkpoint {other})", self.row.url)
        return True


def _recorded_durability(client: Client, final: str) -> Durability | None:
    """The durability the committed manifest at ``final`` records (None: it records none)."""
    try:
        return Durability.from_record(parse_manifest(client.read_bytes(posixpath.join(final, MANIFEST)),
                                                     final).get("durability"))
    except (OSError, ValueError):
        return None


def _file_index(name: str) -> int:
    """The snapshot view of data file ``data-NNNNN.bin``: ``NNNNN``."""
    return int(name.split("-")[-1].split(".")[0])


def _apply_umask(client: Client, path: str, mode: int) -> None:
    """Give a file the store created the mode a local ``open`` would: ``mode`` less the umask.

    The client creates files 0666 whatever the process umask is; a checkpoint must not be
    group- or world-writable when the trainer's umask says otherwise.
    """
    want = mode & ~process_umask()
    if client.stat(path).mode & 0o7777 != want:
        client.chmod(path, want)


def _committed_size(client: Client, path: str) -> int:
    """The length readers of ``path`` see; -1 when the file does not exist."""
    try:
        return client.stat(path).size
    except FileNotFoundError:
        return -1


def _verify(view: memoryview, off: int, f: FileRow, where: str) -> None:
    for k in range(0, len(view), f.chunk):  # the file's own checksum chunk, recorded with it
        idx = (off + k) // f.chunk
        if crc32c.crc32c(view[k : k + f.chunk]) != f.chunk_crcs[idx]:
            raise ChecksumError(f"staged file {f.name} is corrupt at offset {off + k} (CRC32C mismatch)", where)


def transient(exc: BaseException) -> bool:
    if isinstance(exc, StripefsError):
        return exc.code in (ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT, ErrorCode.IO, ErrorCode.STALE_ROUTING,
                            ErrorCode.BUSY, ErrorCode.NO_SPACE)
    return isinstance(exc, (ConnectionError, TimeoutError))
