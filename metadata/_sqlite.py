"""The store on SQLite in WAL mode: one writing connection, readers beside it, durability by setting.

The primitives are :class:`~metadata._sqltxn.SqlTxn`'s; this module adds what only
SQLite needs: the ``--metadata-sync`` setting (:data:`SYNC_MODES`), counters handed
out below a durably reserved bound (:data:`RESERVE`), the record of what a
transaction wrote (``SqliteStore.touched``, for the metadata service's leases), the
log fsynced by the owner (group commit off the event loop), checkpoints, a writer
lock file, and query-only readers.

Caveats:

* One writing :class:`SqliteStore` per database: under a durable reserve its counters
  live in memory between reserve moves (``_SqliteTxn.allocate``), so a second writer
  process on the same file could hand out a number twice (``_lock_writer`` refuses one).
"""

from __future__ import annotations

import errno
import fcntl
import os
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, TypeVar

from stripefs.wire._build import positional_builder
from stripefs.wire._errors import ErrorCode, StripefsError
from stripefs.wire._types import Attr, DirEntry, Layout

from ._sqltxn import _SCHEMA, SCHEMA_VERSION, SqlTxn, _chains_tuple, _new_layout, check_schema_version
from ._store import DirRow, Store, Txn, encode_name

__all__ = ["RESERVE", "SYNC_MODES", "SqliteStore", "check_sync"]

T = TypeVar("T")

# ``--metadata-sync``: SQLite's ``synchronous`` setting for the namespace database (WAL mode).
SYNC_MODES = {"full": 2, "normal": 1}
# Under ``normal`` a power loss may take back the last commits, counters included. Numbers
# are handed out below a bound recorded durably (``<counter>.reserved``), this many at a
# time, and a store opens with its counters moved past their bounds: a number a lost file
# had (whose chunks storage servers may hold) never names another file.
RESERVE = 1 << 16
# Fault injection for tests (a slow disk): with ``STRIPEFS_SLOW_FSYNC_FILE`` set to a file
# name, every fsync of the log by :meth:`SqliteStore.sync_log` first sleeps the seconds that
# file, beside the database, says (``fsclient.testing.faults``' "slow" fault). Unset: nothing.
SLOW_FSYNC_FILE = os.environ.get("STRIPEFS_SLOW_FSYNC_FILE") or None


def check_sync(mode: str) -> str:
    """``mode`` if it is a known durability setting (``full``, ``normal``).

    Raises:
        StripefsError: INVALID naming the settings.
    """
    if mode not in SYNC_MODES:
        raise StripefsError(ErrorCode.INVALID, f"metadata sync {mode!r}: use full or normal")
    return mode


_new_attr = positional_builder(Attr)
_new_dir_entry = positional_builder(DirEntry)

# The point reads every path walk runs, as constants: SQLite's statement cache keeps each
# prepared once per connection.
_GET_INODE = f"SELECT {SqlTxn._INODE_COLS} FROM inodes WHERE ino = ?"
_GET_DENTRY = "SELECT ino, mode FROM dentries WHERE parent = ? AND name = ?"
# A directory entry and the inode it names, in one statement (``Txn.lookup_entry``).
_LOOKUP_ENTRY = (f"SELECT d.ino, d.mode, {', '.join('i.' + c for c in SqlTxn._INODE_COLS.split(', '))} "
                 "FROM dentries d LEFT JOIN inodes i ON i.ino = d.ino WHERE d.parent = ? AND d.name = ?")

# Layouts decoded from their columns, by ``(chunk_size, chains text)``: a pure function of
# the row's text (a Layout is immutable), so sharing one object between answers changes no
# answer. Bounded: emptied when full.
_LAYOUTS: dict[tuple[int, str], Layout] = {}
_LAYOUTS_KEPT = 4096


def _layout(chunk: int, chains: str | None) -> Layout:
    key = (chunk, chains or "")
    layout = _LAYOUTS.get(key)
    if layout is None:
        if len(_LAYOUTS) >= _LAYOUTS_KEPT:
            _LAYOUTS.clear()
        layout = _LAYOUTS[key] = _new_layout(chunk, _chains_tuple(chains))
    return layout


class _SqliteReads(SqlTxn):
    """The reads of a path walk with less Python per statement: SQLite's ``?`` markers only
    (no paramstyle rewrite), entries and layouts built without per-field checks, and
    :meth:`lookup_entry` in one statement. The same rows, the same values."""

    def _q(self, sql: str, params: tuple[Any, ...] = ()) -> Any:
        return self._cur.execute(sql, params)

    @staticmethod
    def _attr(row: Any) -> Attr:
        ino, _, mode, nlink, uid, gid, size, at, mt, ct, chunk, chains, target, rdev, truncations = row
        layout = _layout(chunk, chains) if chunk is not None else None
        return _new_attr(ino, mode, nlink, uid, gid, size, at, mt, ct, layout, target, rdev, truncations)

    def get_inode(self, ino: int) -> Attr | None:
        row = self._cur.execute(_GET_INODE, (ino,)).fetchone()
        return None if row is None else self._attr(row)

    def get_dentry(self, parent: int, name: str) -> DirEntry | None:
        row = self._cur.execute(_GET_DENTRY, (parent, encode_name(name))).fetchone()
        return None if row is None else _new_dir_entry(name, row[0], row[1], None)

    def lookup_entry(self, parent: int, name: str) -> tuple[DirEntry, Attr | None] | None:
        row = self._cur.execute(_LOOKUP_ENTRY, (parent, encode_name(name))).fetchone()
        if row is None:
            return None
        return _new_dir_entry(name, row[0], row[1], None), None if row[2] is None else self._attr(row[2:])


class _SqliteTxn(_SqliteReads):
    """:class:`SqlTxn` whose counters, under ``normal`` (or ``full`` with the log synced by
    its owner, see :meth:`SqliteStore.sync_log_by_owner`), stay below a durably recorded bound."""

    def __init__(self, cursor: Any, store: SqliteStore) -> None:
        super().__init__(cursor)
        self._store = store

    # What a transaction writes is recorded in ``store.touched`` while the caller sets one
    # (the metadata service's leases): an inode number per inode, directory row or xattr
    # written, a ``(parent, name)`` pair per directory entry. Only more than changed, never less.
    def put_inode(self, a: Attr) -> None:
        touched = self._store.touched
        if touched is not None:
            touched.add(a.ino)
        super().put_inode(a)

    def put_dir(self, r: DirRow) -> None:
        touched = self._store.touched
        if touched is not None:
            touched.add(r.ino)
        super().put_dir(r)

    def delete_dir(self, ino: int) -> None:
        touched = self._store.touched
        if touched is not None:
            touched.add(ino)
        super().delete_dir(ino)

    def put_dentry(self, parent: int, e: DirEntry) -> None:
        touched = self._store.touched
        if touched is not None:
            touched.add((parent, e.name))
        super().put_dentry(parent, e)

    def delete_dentry(self, parent: int, name: str) -> None:
        touched = self._store.touched
        if touched is not None:
            touched.add((parent, name))
        super().delete_dentry(parent, name)

    def delete_xattr(self, ino: int, name: bytes) -> None:
        touched = self._store.touched
        if touched is not None:
            touched.add(ino)
        super().delete_xattr(ino, name)

    def allocate(self, key: str) -> int:
        store = self._store
        if not store.reserving:
            return super().allocate(key)
        # Under a reserve the counter lives in memory between reserve moves: numbers below
        # the durable bound are never reused (an open moves every counter past its bound),
        # so writing the counter at each number would buy nothing. A number taken by a
        # transaction that rolls back is skipped (gaps are allowed).
        value = store.counters.get(key)
        if value is None:
            value = int(self.get_meta(key) or "1")
        bound = store.bounds.get(key)
        if bound is None:
            bound = store.bounds[key] = int(self.get_meta(f"{key}.reserved") or "0")
        store.counters[key] = value + 1
        if value >= bound:
            SqlTxn.put_meta(self, key, str(value + 1))
            SqlTxn.put_meta(self, f"{key}.reserved", str(value + RESERVE))
            del store.bounds[key]  # read again: this commit may yet roll back
            store.durable_commit = True  # this commit is fsynced before anyone hears of it
        return value

    def delete_inode(self, ino: int) -> None:
        touched = self._store.touched
        if touched is not None:
            touched.add(ino)
        if self._store.any_xattrs:
            super().delete_inode(ino)
        else:  # no inode has extended attributes: nothing of them to delete
            self._q("DELETE FROM inodes WHERE ino = ?", (ino,))

    def put_xattr(self, ino: int, name: bytes, value: bytes) -> None:
        touched = self._store.touched
        if touched is not None:
            touched.add(ino)
        self._store.any_xattrs = True  # before the row: a rollback leaves it set, which is safe
        super().put_xattr(ino, name, value)

    def put_meta(self, key: str, value: str) -> None:
        super().put_meta(key, value)
        counter = key.removesuffix(".reserved")  # set from outside allocate: read it again
        self._store.counters.pop(counter, None)
        self._store.bounds.pop(counter, None)


def _lock_writer(path: str) -> int:
    """Hold ``path``'s writer lock (``flock`` on ``path.lock``) for as long as the store is open.

    One writing store per database: counters live in its memory between durable
    reserve bounds, so a second writer could hand out the same inode numbers. A
    process that dies drops its lock with it. Returns -1 for an in-memory database.

    Raises:
        StripefsError: BUSY when another store (this process or another) holds it.
    """
    if path == ":memory:" or path.startswith("file:"):
        return -1
    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StripefsError(ErrorCode.BUSY, f"{path} is in use by another metadata service (it holds {path}.lock)") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _slow_fsync(path: str) -> None:
    """Sleep the seconds ``path`` holds, if it exists (a test's slow disk; at most 5 s)."""
    import time

    try:
        with open(path, "rb") as f:
            delay = float(f.read().strip() or b"0")
    except (OSError, ValueError):
        return
    time.sleep(min(max(delay, 0.0), 5.0))


class SqliteStore(Store):
    """SQLite in WAL mode.

    Args:
        path: database file (``":memory:"`` works, without durability).
        busy_timeout_s: how long to wait for another process's write lock.
        synchronous: ``full`` (the default): every returned commit was fsynced and
            survives power loss. ``normal``: commits are written to the WAL without
            an fsync; a returned commit survives a kill -9 of any process (the
            operating system holds the WAL) but the last ones may be lost on power
            loss or a kernel crash. Checkpoints still fsync, so the database is
            never corrupted, only possibly older.

    One connection, opened with ``check_same_thread=False`` so a worker thread may
    run transactions; the caller serialises them.
    """

    def __init__(self, path: str | Any, *, busy_timeout_s: float = 10.0, synchronous: str = "full") -> None:
        check_sync(synchronous)
        self.path = str(path)
        self.synchronous_mode = synchronous
        self.durable_commit = False  # set by a commit that must be fsynced even under ``normal``
        self.touched: set[object] | None = None  # keys written, while a caller records them (_SqliteTxn)
        self._sync_now = synchronous  # SQLite's ``synchronous`` on the writing connection now
        # ``full`` with the log fsynced by the owner (:meth:`sync_log_by_owner`).
        self.log_by_owner = False
        self._dir_synced = False
        # The first failed write-back of the log, from any path: sticky (see sync_log).
        self.log_failed: OSError | None = None
        self._lock_fd = _lock_writer(self.path)
        try:
            self._open_database(busy_timeout_s, synchronous)
        except BaseException:
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
            raise
        self._open = False
        self._batching = False
        self._readers: list[_SqliteReader] = []
        self._bare: list[bool] | None = None  # commit_unsynced's transactions: False = needed a savepoint
        self._unsaved_scope = _UnsavedScope(self)
        self._changes = 0  # total_changes when the open transaction began: a commit that wrote nothing needs no fsync
        # Counters kept in memory under a reserve (``_SqliteTxn.allocate``): next numbers, durable bounds.
        self.counters: dict[str, int] = {}
        self.bounds: dict[str, int] = {}
        # Commits since the last checkpoint, once the owner runs them (:meth:`take_checkpoints`).
        self.unchecked = 0
        self._checkpoints_by_owner = False

    def _open_database(self, busy_timeout_s: float, synchronous: str) -> None:
        # isolation_level=None: we issue BEGIN/COMMIT ourselves, so a transaction's
        # boundaries are exactly the `with` block.
        self._conn = sqlite3.connect(self.path, timeout=busy_timeout_s,
                                     isolation_level=None, check_same_thread=False)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute(f"PRAGMA synchronous={SYNC_MODES[synchronous]}")
        self._conn.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            names = {r[0] for r in self._conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            found = None
            if "meta" in names:
                row = self._conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
                found = row[0] if row else None
            check_schema_version(found, self.path)
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    self._conn.execute(statement)
            self._migrate()
            self._skip_reserved()
            # Whether any inode may have extended attributes (an unlink then deletes them too).
            self.any_xattrs = self._conn.execute("SELECT 1 FROM xattrs LIMIT 1").fetchone() is not None
            self._conn.execute("INSERT INTO meta (key, value) VALUES ('schema_version', ?) "
                               "ON CONFLICT (key) DO UPDATE SET value = excluded.value", (str(SCHEMA_VERSION),))
            self._conn.execute("COMMIT")
        except BaseException:
            self._conn.execute("ROLLBACK")
            self._conn.close()
            raise

    @property
    def reserving(self) -> bool:
        """Whether counters are handed out below a durably recorded bound: under ``normal``,
        and under ``full`` once the owner fsyncs the log (:meth:`sync_log_by_owner`)."""
        return self.synchronous_mode == "normal" or self.log_by_owner

    @property
    def synchronous(self) -> str:
        """The durability setting in force on the writing connection (``full`` or ``normal``)."""
        if self.log_by_owner:
            return "full"  # SQLite's own setting is NORMAL: the owner fsyncs (sync_log_by_owner)
        level = self._conn.execute("PRAGMA synchronous").fetchone()[0]
        return next(name for name, value in SYNC_MODES.items() if value == level)

    def reader(self, *, busy_timeout_s: float = 5.0) -> "Store | None":
        if self.path == ":memory:" or self.path.startswith("file:"):
            return None  # a private in-memory database has no second connection
        reader = _SqliteReader(self.path, busy_timeout_s)
        self._readers.append(reader)
        return reader

    def _skip_reserved(self) -> None:
        """Move every counter past its reserved bound (numbers below it may have been
        handed out by commits a power loss took back)."""
        rows = self._conn.execute("SELECT key, value FROM meta WHERE key LIKE '%.reserved'").fetchall()
        for key, bound in rows:
            counter = key.removesuffix(".reserved")
            row = self._conn.execute("SELECT value FROM meta WHERE key = ?", (counter,)).fetchone()
            if row is None or int(row[0]) < int(bound):
                self._conn.execute("INSERT INTO meta (key, value) VALUES (?, ?) "
                                   "ON CONFLICT (key) DO UPDATE SET value = excluded.value", (counter, str(bound)))

    def _begin(self) -> None:
        # A commit made here (on a thread) must not be seen before it is durable: under the
        # owner's log sync SQLite runs at NORMAL, which shows a commit to every reader as soon
        # as its frames are written and fsyncs nothing. At FULL it fsyncs the log first and
        # only then publishes the commit (the WAL index), so durable comes before visible.
        self._synchronous("full" if self.log_by_owner else None)
        self._conn.execute("BEGIN IMMEDIATE")
        self._changes = self._conn.total_changes

    def _commit(self) -> None:
        try:
            self._conn.execute("COMMIT")
        except sqlite3.Error as exc:
            if getattr(exc, "sqlite_errorcode", 0) & 0xFF == sqlite3.SQLITE_IOERR:
                # SQLite's own write or fsync of the log failed: pages of commits made before
                # may be gone, and a later fsync on another descriptor would not say so.
                self.log_failed = self.log_failed or OSError(errno.EIO, f"metadata log write failed: {exc}")
            raise
        self.unchecked += 1
        if self.durable_commit or (self.log_by_owner and self._conn.total_changes != self._changes
                                   and not self._dir_synced):
            self.durable_commit = False
            # The log's own name is durable only once its directory is (sync_log's first call).
            self.sync_log()

    def _synchronous(self, mode: str | None) -> None:
        """Set SQLite's ``synchronous`` for the next commits (None: leave it)."""
        if mode is not None and mode != self._sync_now:
            self._conn.execute(f"PRAGMA synchronous={SYNC_MODES[mode]}")
            self._sync_now = mode

    def sync_log(self) -> None:
        """Make every commit that returned before this call durable: fsync the log (WAL).

        Safe on any thread while the writing connection commits (its own descriptor; the
        fsync covers at least every write that completed before it started). The first
        call also fsyncs the directory, so the log's own name is durable.

        Linux reports a write-back error to one fsync only, and never to a descriptor
        opened after it: once any fsync of the log failed (here, on any thread, or
        SQLite's own in a commit), every later call raises EIO too, until the store is
        opened again (the service restarts and SQLite recovers the log).

        Raises:
            OSError: the fsync failed, now or before (what the log holds may not be on disk).
        """
        if self.log_failed is not None:
            raise OSError(errno.EIO, f"an earlier fsync of the metadata log failed ({self.log_failed}); "
                          "restart the metadata service")
        if SLOW_FSYNC_FILE is not None:
            _slow_fsync(os.path.join(os.path.dirname(os.path.abspath(self.path)), SLOW_FSYNC_FILE))
        try:
            fd = os.open(self.path + "-wal", os.O_RDONLY)
        except FileNotFoundError:
            return  # an in-memory database: nothing is durable anyway
        try:
            os.fsync(fd)
        except OSError as exc:
            self.log_failed = self.log_failed or exc
            raise
        finally:
            os.close(fd)
        if not self._dir_synced:
            dfd = os.open(os.path.dirname(os.path.abspath(self.path)), os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
            self._dir_synced = True

    def sync_log_by_owner(self) -> None:
        """Under ``full``: let the owner make commits durable, many at a time.

        SQLite then runs at NORMAL (a commit writes the log to the page cache; checkpoints
        still fsync the log first and the database after, and a reused log's header is
        fsynced): :meth:`commit_unsynced` commits and the owner acknowledges those
        commits only after a :meth:`sync_log` that started after them returned. Every
        other commit (:meth:`transaction`, :meth:`batch`) calls :meth:`sync_log` itself
        before it returns, as ``full`` did. Also :meth:`take_checkpoints`. Does nothing
        under ``normal``.
        """
        self.take_checkpoints()
        if self.synchronous_mode != "full":
            return
        self._synchronous("normal")
        self.log_by_owner = True

    def _migrate(self) -> None:
        """Bring a database written by an older version up to this schema (idempotent)."""
        cols = {row[1] for row in self._conn.execute("PRAGMA table_info(inodes)")}
        if "rdev" not in cols:  # device nodes: added after the first release
            self._conn.execute("ALTER TABLE inodes ADD COLUMN rdev INTEGER NOT NULL DEFAULT 0")
        if "truncations" not in cols:  # the truncate count writers' commits are checked against
            self._conn.execute("ALTER TABLE inodes ADD COLUMN truncations INTEGER NOT NULL DEFAULT 0")

    def commit_unsynced(self, fn: Callable[[], T]) -> tuple[bool, T | None]:
        """Run ``fn`` (whose transactions join one batch) and commit it, if that commit
        needs no fsync: under ``normal`` with no counter crossing its reserved bound and
        :meth:`take_checkpoints` in force (a checkpoint fsyncs). Under ``full`` only after
        :meth:`sync_log_by_owner`: the commit is durable once a :meth:`sync_log` that
        started after this call returned has returned. For callers that must not wait on
        the disk (the metadata service's event loop).

        Returns:
            ``(True, result)`` once committed; ``(False, None)`` with nothing applied when
            the commit would need an fsync (run it in :meth:`batch` on a thread).

        Raises:
            Exception: what ``fn`` raised (nothing of it kept).
        """
        if not self._checkpoints_by_owner or (self.synchronous_mode != "normal" and not self.log_by_owner):
            return False, None
        if self._open or self._batching:
            raise RuntimeError("batches do not nest")
        self._batching = True
        self._bare = []
        try:
            self._synchronous("normal" if self.log_by_owner else None)  # the owner fsyncs (LogSync)
            self._conn.execute("BEGIN IMMEDIATE")
            result = fn()
            # A reserve bound moved (that commit is fsynced, on a thread), or a transaction
            # without its savepoint failed or had company: roll back, the thread reruns it.
            if self.durable_commit or not all(self._bare):
                self.durable_commit = False
                self._conn.execute("ROLLBACK")
                self.bounds.clear()  # a bound this transaction moved is undone: read it again
                return False, None
            self._conn.execute("COMMIT")
            self.unchecked += 1
            return True, result
        except BaseException:
            self.durable_commit = False
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
                self.bounds.clear()  # a bound this transaction moved is undone: read it again
            raise
        finally:
            self._batching = False
            self._bare = None

    def take_checkpoints(self) -> None:
        """Stop SQLite's automatic checkpoints (run at a commit, they fsync): the owner
        calls :meth:`checkpoint` instead, off its event loop, every so many commits
        (:attr:`unchecked` counts them)."""
        self._conn.execute("PRAGMA wal_autocheckpoint=0")
        self._checkpoints_by_owner = True

    def checkpoint(self) -> None:
        """Copy the log into the database (as far as no reader still needs it), so the
        log is written from its start again; fsyncs. Outside any transaction.

        When the whole log was copied, one small commit follows here: the first commit
        into a log started again fsyncs its new header (SQLite, at ``NORMAL``), and that
        fsync belongs on the caller's thread, not in the next :meth:`commit_unsynced`."""
        busy, logged, copied = self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        self.unchecked = 0
        if not busy and logged == copied and logged > 0:
            self._begin()
            try:
                self._conn.execute("INSERT INTO meta (key, value) VALUES ('log_restarts', '1') "
                                   "ON CONFLICT (key) DO UPDATE SET value = CAST(value AS INTEGER) + 1")
                self._commit()
            except BaseException:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                raise
            self.unchecked = 0

    @contextmanager
    def batch(self) -> Iterator[None]:
        if self._open or self._batching:
            raise RuntimeError("batches do not nest")
        self._batching = True
        try:
            self._begin()
            yield
            self._commit()  # one fsync for every transaction of the batch (under ``full``)
        except BaseException:
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
                self.bounds.clear()  # a bound this transaction moved is undone: read it again
            raise
        finally:
            self._batching = False

    def transaction(self) -> AbstractContextManager[Txn]:
        if self._bare is not None and self._batching:  # commit_unsynced: its one transaction needs no savepoint
            return self._unsaved_scope
        return self._transaction()

    @contextmanager
    def _transaction(self) -> Iterator[Txn]:
        if self._open:
            raise RuntimeError("transactions do not nest")
        if self._batching:
            if self._bare is not None:  # commit_unsynced (began while this waited to be entered)
                with self._unsaved_scope as txn:
                    yield txn
                return
            with self._savepoint() as txn:
                yield txn
            return
        self._open = True
        try:
            # IMMEDIATE takes the write lock up front: a read-then-write transaction
            # cannot then fail half way with SQLITE_BUSY on lock upgrade.
            self._begin()
            yield _SqliteTxn(self._conn.cursor(), self)
            self._commit()
        except BaseException:
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
                self.bounds.clear()  # a bound this transaction moved is undone: read it again
            raise
        finally:
            self._open = False

    @contextmanager
    def _savepoint(self) -> Iterator[Txn]:
        self._open = True
        try:
            self._conn.execute("SAVEPOINT op")
            try:
                yield _SqliteTxn(self._conn.cursor(), self)
            except BaseException:
                self._conn.execute("ROLLBACK TO op")  # undo this transaction only
                self.bounds.clear()  # a bound this transaction moved is undone: read it again
                self._conn.execute("RELEASE op")
                raise
            self._conn.execute("RELEASE op")
        finally:
            self._open = False

    def close(self) -> None:
        for reader in self._readers:
            reader.close()
        self._conn.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # the lock goes with the descriptor
            self._lock_fd = -1


class _UnsavedScope:
    """A transaction of :meth:`SqliteStore.commit_unsynced`, with no savepoint of its own: one
    that fails (or a second one) makes the whole batch roll back (``_bare``). A plain context
    manager, reused (no generator per mutation); its :class:`Txn` is reused too (transactions
    do not nest, and only the loop commits this way)."""

    __slots__ = ("_store", "_txn")

    def __init__(self, store: SqliteStore) -> None:
        self._store = store
        self._txn: _SqliteTxn | None = None

    def __enter__(self) -> Txn:
        store = self._store
        if store._open:
            raise RuntimeError("transactions do not nest")
        bare = store._bare
        assert bare is not None
        if bare:
            bare.append(False)  # a second transaction: it could need its savepoint
        bare.append(True)
        store._open = True
        txn = self._txn
        if txn is None:
            txn = self._txn = _SqliteTxn(store._conn.cursor(), store)
        return txn

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        store = self._store
        try:
            if exc_type is not None:
                bare = store._bare
                assert bare is not None
                bare.append(False)
        finally:
            store._open = False


class _SqliteReader(Store):
    """A second, query-only connection to a WAL database: each transaction reads one
    committed snapshot and never waits for the writer (WAL readers do not block).

    Used by one thread at a time (the caller's): :meth:`transaction` hands out the same
    :class:`_ReadScope` every time (one cursor, one :class:`Txn`, no generator per read)."""

    def __init__(self, path: str, busy_timeout_s: float = 5.0) -> None:
        self._conn = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
        self._conn.execute("PRAGMA query_only=1")
        self._scope = _ReadScope(self._conn)

    def transaction(self) -> "_ReadScope":  # type: ignore[override]
        return self._scope

    def close(self) -> None:
        self._conn.close()


class _ReadScope:
    """One read transaction at a time on a reader's connection: ``with`` begins it (deferred:
    the first read takes the snapshot) and rolls it back (nothing to keep: it only read)."""

    __slots__ = ("_conn", "_cur", "_txn", "_open")

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn
        self._cur = conn.cursor()
        self._txn = _SqliteReads(self._cur)
        self._open = False

    def __enter__(self) -> Txn:
        if self._open:
            raise RuntimeError("transactions do not nest")
        self._open = True
        try:
            self._cur.execute("BEGIN")
        except BaseException:
            self._end()
            raise
        return self._txn

    def __exit__(self, *exc: object) -> None:
        self._end()

    def _end(self) -> None:
        try:
            if self._conn.in_transaction:
                self._cur.execute("ROLLBACK")
        finally:
            self._open = False
