"""The store on PostgreSQL: the same transaction interface, for metadata that outgrows one machine.

The primitives are :class:`~metadata._sqltxn.SqlTxn`'s plain SQL (``%s`` markers);
this module adds the PostgreSQL schema (64-bit integers, ``BYTEA``), a connection in
pipeline mode, transactions at ``READ COMMITTED`` with explicit row locks, savepoints
for group commit, read-only connections for the reads (:meth:`PostgresStore.reader`),
and :meth:`PostgresStore.retryable` so the metadata service reruns a batch that lost
a race (a deadlock) with another metadata service on the same database.

**Isolation by explicit locks, not SERIALIZABLE.** Namespace operations read, then
write what they read (a create checks that a name is free, then bumps the directory's
times; a link bumps a count). Every such operation first reads the inode it will write
-- the directory whose entries it changes, the file whose link count it changes -- and
here, in a writing transaction, that read takes the row's lock
(``SELECT ... FOR UPDATE``, :meth:`PgTxn.get_inode`). So:

* two operations on one directory's entries run one after the other: the second waits
  for the first's commit, then (READ COMMITTED: each statement a new snapshot) reads
  what it left -- a name taken meanwhile is ``EEXIST``, an emptied directory is not
  empty any more, a removed one is gone;
* creates in different directories share no row: they never wait for each other, and
  never fail (inode numbers come from a sequence, in blocks: no counter row is hot);
* a directory's ``dirs`` row (parent pointer, layout) is written only under its
  inode's lock; the walk that keeps a directory out of its own subtree
  (``Namespace._inside``) reads the ``dirs`` rows on its way up ``FOR SHARE``, so a
  concurrent move of one of them waits for it, or it for the move (or, crossed, a
  deadlock that PostgreSQL breaks: the batch runs again);
* lease locks (:meth:`PgTxn.get_lock`) take a transaction advisory lock on their key
  first (the row may not exist yet); a reply recorded twice for one request (two
  services racing on a client's retry) violates ``replies``' primary key, and the
  batch runs again and finds the first record.

Names stay unique by the primary key ``(parent, name)`` in any case.

**Round trips and statements.** The connection runs in pipeline mode: a statement
whose result is not needed (``BEGIN``, a write) is sent without waiting, and only a
read waits, for everything sent before it too. Per operation of a batch:

* *reads ahead*: an operation names what it is about to read (``Txn.expect``: the
  directory, the entry, the inode the entry names); all of it is sent at once, in lock
  order, and the reads then take the answers -- one wait where there were three;
* *rows held*: an inode row read under its lock, or written, is answered from memory
  when the operation reads it again (nobody else can change it before the commit);
* *the result record's check* (``apply_once``) is sent and taken as "not applied yet"
  without waiting; before the commit (or when the batch failed) its answer, long in by
  then, is looked at, and a request applied already reruns the batch in safe mode,
  where the check waits and the record answers it;
* *writes held back*: an operation's writes are sent only before the next read or the
  commit, so one that reads nothing after its first write (a create, an unlink, a
  rename) needs no savepoint, and is undone by dropping them; the writes sent together
  go as one statement (data-modifying ``WITH`` parts), the commit's notifications with
  them;
* *prepared statements*: each statement is parsed and planned once per connection
  (:func:`_prepared_statements`).

A create is then 7 statements and 2 waits, the second of them the commit (see
docs/operations.md for the measurements). A write's failure may thus surface in a later
operation of the batch: then the batch (nothing of it committed) runs again in *safe
mode*, each operation waiting for its own statements (and its own savepoint, writes
sent as they come), so the failure is told to the operation that caused it alone.

Caveats:
    * Needs ``psycopg`` 3 (``pip install 'stripefs[postgres]'``) with pipeline support (libpq >= 14).
    * One writing connection per store: the metadata service runs one batch at a time
      per process; more throughput comes from more metadata processes.
    * Locks are held until the batch commits: a metadata service that stops (SIGSTOP)
      inside a batch keeps other services' operations on the same directories waiting
      until its connection goes.
"""

from __future__ import annotations

import stat
from collections import deque
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from stripefs.wire._errors import ErrorCode, StripefsError
from stripefs.wire._types import Attr, DirEntry, Layout

from ._sqltxn import _SCHEMA, SCHEMA_VERSION, SqlTxn, _chains_tuple, check_schema_version
from ._store import DirRow, GarbageItem, LockRow, Store, Txn, encode_name

__all__ = ["PostgresStore", "PG_SCHEMA"]

# The SQLite schema in PostgreSQL's types: every integer 64-bit (inode numbers, times in
# nanoseconds), byte strings as BYTEA, without SQLite's table options (WITHOUT ROWID). One
# schema, so a column added there is added here.
PG_SCHEMA = _SCHEMA.replace("INTEGER", "BIGINT").replace("BLOB", "BYTEA").replace(" WITHOUT ROWID", "")
# dentries' primary key (parent, name) is also the index readdir pages through, in
# byte order of name (BYTEA compares bytewise, as SQLite's BLOB does).

_RETRY_SQLSTATES = frozenset({"40001", "40P01"})  # serialization failure, deadlock
# Counters taken from sequences: every create takes an inode number, and as a row of
# ``meta`` that number would make any two creates on different services conflict.
_SEQUENCES = ("next_ino", "next_garbage")
# Numbers taken from a sequence per round trip; kept in the store (a rolled-back
# transaction's number is skipped: gaps, as the sequence has anyway).
ALLOCATE_BLOCK = 64
# Reader connections for waits shorter than this are refused (see PostgresStore.reader).
_MIN_READER_WAIT = 0.5

_PG_SQL: dict[str, str] = {}


def _pg(sql: str) -> str:
    """``sql`` with ``%s`` markers for ``?`` (cached: the same few statements run all the time)."""
    out = _PG_SQL.get(sql)
    if out is None:
        out = _PG_SQL[sql] = sql.replace("?", "%s")
    return out


class _Unattributed(Exception):
    """A statement of the batch failed, and (pipelined) it is not known which operation's:
    the batch runs again (retryable), each operation then waiting for its own statements."""

    def __init__(self, cause: BaseException):
        super().__init__(f"a statement of the batch failed ({cause}); running it again statement by statement")


class PgTxn(SqlTxn):
    """:class:`SqlTxn` on a pipelined PostgreSQL connection.

    ``locking`` (a writing transaction): inode rows are read ``FOR UPDATE``, ``dirs``
    rows ``FOR SHARE`` (or with their inode's lock), garbage items ``FOR UPDATE``,
    lease locks under an advisory lock. ``savepoint``: the operation runs inside a
    batch; a ``SAVEPOINT`` is set before its first write (an operation that fails
    before writing has nothing to undo). Counters come from sequences, in blocks.
    """

    _GET_INODE_LOCKED = f"SELECT {SqlTxn._INODE_COLS} FROM inodes WHERE ino = %s FOR UPDATE"
    _GET_DIR = "SELECT ino, parent, chunk_size, stripe FROM dirs WHERE ino = %s"
    _GET_DIR_SHARED = _GET_DIR + " FOR SHARE"
    _GET_DENTRY = "SELECT ino, mode FROM dentries WHERE parent = %s AND name = %s"
    # The inode an entry names, locked (the entry read in the same statement).
    _GET_TARGET_LOCKED = (f"SELECT {SqlTxn._INODE_COLS} FROM inodes WHERE ino = "
                          "(SELECT ino FROM dentries WHERE parent = %s AND name = %s) FOR UPDATE")

    def __init__(self, store: "PostgresStore", conn: Any, *, locking: bool, savepoint: bool = False) -> None:
        self._store = store
        self._conn = conn
        self._fmt = True
        self._locking = locking
        self._want_savepoint = savepoint
        self.savepoint = False  # set: a SAVEPOINT of this operation was sent
        self.wrote = False
        # Store keys this operation writes, when the store publishes them (``publish_keys``).
        self.keys: set[Any] | None = set() if store._payloads is not None else None
        self.reply_for: bytes | None = None  # the client whose request's result this operation records
        # dirs rows read with (under the lock of) their inode, or written here: ino -> cursor | row | None
        self._dirs: dict[int, Any] = {}
        # Writes held back (see PostgresStore: deferred writes), while this operation has
        # read nothing since its first write: a batch's operation outside safe mode.
        self._defer = savepoint and not store._safe
        self.held: list[tuple[str, tuple[Any, ...]]] = []
        # Reads sent ahead by :meth:`expect`, taken by the first read of the same row (a write
        # to the row first drops them): inode number -> (inode cursor, dirs cursor or None);
        # (parent, name) -> (entry cursor, cursor of the inode it names, or None).
        self._ahead_inodes: dict[int, tuple[Any, Any]] = {}
        self._ahead_entries: dict[tuple[int, str], tuple[Any, Any]] = {}
        # Inode rows this operation holds the lock of, as it read or wrote them last (None:
        # deleted): nobody else changes them before the commit, so a read again is answered here.
        self._held_rows: dict[int, Attr | None] = {}

    def _q(self, sql: str, params: tuple[Any, ...] = ()) -> Any:
        conn = self._conn
        if sql[0] == "S":  # a read (SELECT): a cursor of its own, fetched by the caller
            self._before_read()
            cur = conn.cursor()
        else:
            self.wrote = True
            if self._defer:
                self.held.append((_pg(sql), params))
                return None  # (writes return nothing their callers use)
            if self._want_savepoint and not self.savepoint:
                conn.execute("SAVEPOINT op")
                self.savepoint = True
            cur = self._store._wcur
        cur.execute(_pg(sql), params)
        return cur

    def _before_read(self) -> None:
        """Send the writes held back before this read (it sees them): the batch's earlier
        operations' first, then this one's own inside its savepoint -- from now on it can
        fail after a write that reached the server, and its writes go out as they come."""
        store = self._store
        if self.held:
            store._flush()
            self._conn.execute("SAVEPOINT op")
            self.savepoint = True
            store._send(self.held)
            self.held = []
            self._defer = False
        elif store._deferred:
            store._flush()

    def expect(self, parent: int, name: str, target: bool = False) -> None:
        """Send now, without waiting, the locked reads the operation is about to make: the
        directory's inode (and ``dirs`` row), its entry ``name`` and, with ``target``, the
        inode the entry names -- in this order, so each runs once the lock before it is
        held (READ COMMITTED: each statement on a new snapshot), and answers what the same
        read made later would. A create then waits once for all of them, not three times."""
        if not self._locking:
            return
        self._before_read()
        if parent not in self._ahead_inodes:
            self._ahead_inodes[parent] = self._send_inode(parent)
        ecur = self._conn.cursor()
        ecur.execute(self._GET_DENTRY, (parent, encode_name(name)))
        tcur = None
        if target:
            tcur = self._conn.cursor()
            tcur.execute(self._GET_TARGET_LOCKED, (parent, encode_name(name)))
        self._ahead_entries[(parent, name)] = (ecur, tcur)

    def _send_inode(self, ino: int) -> tuple[Any, Any]:
        self._before_read()
        conn = self._conn
        cur = conn.cursor()
        cur.execute(self._GET_INODE_LOCKED, (ino,))
        # Sent with it (no wait of its own), run once the lock is held, on a new snapshot: the
        # dirs row as the last holder of the lock left it. Needed for directories only.
        dcur = conn.cursor()
        dcur.execute(self._GET_DIR, (ino,))
        return cur, dcur

    def get_inode(self, ino: int) -> Attr | None:
        if not self._locking:
            return super().get_inode(ino)
        held = self._held_rows.get(ino, False)
        if held is not False:
            return held
        ahead = self._ahead_inodes.pop(ino, None)
        cur, dcur = ahead if ahead is not None else self._send_inode(ino)
        row = cur.fetchone()
        if row is None:
            if dcur is None:  # an entry's inode read ahead, and the entry had gone: read it again
                return self.get_inode(ino)
            return None  # (no lock held: not remembered)
        if row[0] != ino:  # (read ahead for an entry that named another inode by then)
            return self.get_inode(ino)
        if dcur is not None and stat.S_ISDIR(row[1]):
            self._dirs[ino] = dcur
        self._held_rows[ino] = attr = self._attr(row)
        return attr

    def get_dentry(self, parent: int, name: str) -> DirEntry | None:
        ahead = self._ahead_entries.pop((parent, name), None)
        if ahead is None:
            return super().get_dentry(parent, name)
        ecur, tcur = ahead
        row = ecur.fetchone()
        if row is None:
            return None
        if tcur is not None and row[0] not in self._ahead_inodes:
            self._ahead_inodes[row[0]] = (tcur, None)
        return DirEntry(name, row[0], row[1])

    def get_dir(self, ino: int) -> DirRow | None:
        known = self._dirs.get(ino, False)
        if known is not False:
            if known is None or isinstance(known, DirRow):
                return known
            row = known.fetchone()
            self._dirs[ino] = found = DirRow(*row) if row else None
            return found
        if not self._locking:
            return super().get_dir(ino)
        row = self._q(self._GET_DIR_SHARED, (ino,)).fetchone()
        return DirRow(*row) if row else None

    # What an operation writes is recorded while the store publishes it (as ``_SqliteTxn``
    # does): an inode number per inode, directory row or xattr written, a ``(parent, name)``
    # pair per directory entry. Only more than changed, never less.
    def put_inode(self, a: Attr) -> None:
        if self.keys is not None:
            self.keys.add(a.ino)
        self._ahead_inodes.pop(a.ino, None)
        if a.layout is None or type(a.layout.chains) is tuple:  # (as a read would build it)
            self._held_rows[a.ino] = a
        else:
            self._held_rows.pop(a.ino, None)
        super().put_inode(a)

    def delete_inode(self, ino: int) -> None:
        if self.keys is not None:
            self.keys.add(ino)
        self._ahead_inodes.pop(ino, None)
        self._held_rows[ino] = None
        super().delete_inode(ino)

    def put_dir(self, r: DirRow) -> None:
        if self.keys is not None:
            self.keys.add(r.ino)
        super().put_dir(r)
        self._dirs[r.ino] = r

    def delete_dir(self, ino: int) -> None:
        if self.keys is not None:
            self.keys.add(ino)
        super().delete_dir(ino)
        self._dirs[ino] = None

    def put_dentry(self, parent: int, e: DirEntry) -> None:
        if self.keys is not None:
            self.keys.add((parent, e.name))
        self._ahead_entries.pop((parent, e.name), None)
        super().put_dentry(parent, e)

    def delete_dentry(self, parent: int, name: str) -> None:
        if self.keys is not None:
            self.keys.add((parent, name))
        self._ahead_entries.pop((parent, name), None)
        super().delete_dentry(parent, name)

    def put_xattr(self, ino: int, name: bytes, value: bytes) -> None:
        if self.keys is not None:
            self.keys.add(ino)
        super().put_xattr(ino, name, value)

    def delete_xattr(self, ino: int, name: bytes) -> None:
        if self.keys is not None:
            self.keys.add(ino)
        super().delete_xattr(ino, name)

    def get_reply(self, client: bytes, req: int) -> bytes | None:
        # A request's first look at its record (``_replay.apply_once``): what operations
        # wrote before it belongs to no request of a client.
        self._store._attribute(b"")
        if self._defer:
            # Sent, not waited for: taken as "not applied yet" (almost always true) and
            # checked before the batch commits (PostgresStore._check_guesses), its answer
            # fetched by then with the operation's next read.
            self._store._guesses.append(self._q("SELECT result FROM replies WHERE client = ? AND req = ?",
                                                (bytes(client), req)))
            return None
        found = super().get_reply(client, req)
        if found is not None and self._locking:
            if len(self._store.replayed) > 10_000:  # (each is taken by its request's answer)
                self._store.replayed.clear()
            self._store.replayed.add((bytes(client), req))
        return found

    def put_reply(self, client: bytes, req: int, created_ns: int, result: bytes) -> None:
        super().put_reply(client, req, created_ns, result)
        self.reply_for = bytes(client)

    def get_lock(self, key: str) -> LockRow | None:
        if self._locking:  # the row may not exist yet: lock its key (sent with the read below)
            self._q("SELECT pg_advisory_xact_lock(hashtextextended(?, 7400131))", ("stripefs lock " + key,))
        return super().get_lock(key)

    def get_garbage(self, item_id: int) -> GarbageItem | None:
        if not self._locking:
            return super().get_garbage(item_id)
        row = self._q("SELECT id, kind, ino, length, chunk_size, chains FROM garbage WHERE id = ? FOR UPDATE",
                      (item_id,)).fetchone()
        if row is None:
            return None
        i, k, n_ino, n, cs, ch = row
        return GarbageItem(i, k, n_ino, n, Layout(cs, _chains_tuple(ch)))

    def allocate(self, key: str) -> int:
        if key not in _SEQUENCES:
            return super().allocate(key)
        pool = self._store._numbers[key]
        if not pool:  # (a sequence ignores the transaction's writes: the held ones stay held)
            cur = self._conn.cursor()
            rows = cur.execute(f"SELECT nextval('{key}_seq') FROM generate_series(1, %s)", (ALLOCATE_BLOCK,)).fetchall()
            pool.extend(sorted(int(r[0]) for r in rows))
        return pool.popleft()


# Rows a write names, by table: how many of its first parameters are its row's key (the
# primary key's columns, or a prefix that covers more rows, never fewer). Writes to other
# tables, or naming rows otherwise (DELETE FROM replies WHERE created_ns < ...), stand alone.
_KEY_WIDTH = {"inodes": 1, "dirs": 1, "xattrs": 1, "dentries": 2, "garbage": 1, "locks": 1, "meta": 1}


def _row(sql: str, params: tuple[Any, ...]) -> Any:
    """What ``sql`` (an ``INSERT INTO t``/``DELETE FROM t ... WHERE <key> = ...``) writes,
    to tell two writes to one row apart from writes to different rows; None: unknown."""
    if sql[0] == "S":
        return ("select", id(params))  # a notification: no row
    words = sql.split(None, 3)
    table = words[2]
    if table == "replies" and words[0] == "INSERT":
        return (table, params[0], params[1])
    width = _KEY_WIDTH.get(table)
    if width is None or (words[0] == "DELETE" and "WHERE ino = " not in sql and "WHERE parent = " not in sql
                         and "WHERE id = " not in sql and "WHERE key = " not in sql):
        return None
    return (table, *params[:width])


# Every statement is prepared on the server at its first use (parsed and planned once per
# connection: planning one of these costs the backend about as much as running it), the
# least used deallocated past this many.
_PREPARED_MAX = 256


def _prepared_statements(conn: Any) -> None:
    """Prepare every statement ``conn`` runs on the server, at its first use, and keep
    them over rollbacks.

    Two things of psycopg's prepared statements go wrong in a pipeline, and are avoided:

    * it forgets every prepared statement when a ``ROLLBACK`` (``TO SAVEPOINT`` too)
      completes, and has them deallocated, while statements sent before that answer came
      use them: here they are kept, as the server keeps them (a prepared statement is the
      session's, not the transaction's);
    * a statement prepared on its n-th use (n > 1) whose ``Parse`` the server skipped (an
      error earlier in the pipeline) stays known as prepared, and every later use fails.
      Prepared at its *first* use, psycopg checks its answer and forgets the name of a
      statement that was not prepared.

    Without the hook used for the first (another psycopg) nothing is prepared."""
    manager = getattr(conn, "_prepared", None)
    discard = getattr(manager, "_should_discard", None)
    if discard is None:
        conn.prepare_threshold = None
        return

    def unless_rollback(prep: Any, results: Any) -> bool:
        if any((r.command_status or b"").startswith(b"ROLLBACK") for r in results):
            return False
        return bool(discard(prep, results))

    manager._should_discard = unless_rollback
    conn.prepare_threshold = 0
    conn.prepared_max = _PREPARED_MAX


def _record_clash(exc: BaseException) -> bool:
    """``exc`` is (or was caused by) a request's result recorded twice (``replies``' key)."""
    seen: BaseException | None = exc
    while seen is not None:
        if getattr(seen, "sqlstate", None) == "23505" and \
                getattr(getattr(seen, "diag", None), "constraint_name", None) == "replies_pkey":
            return True
        seen = seen.__cause__
    return False


def _where(url: str) -> str:
    """``host:port/db`` of a URL, never its password (the message goes to logs)."""
    from psycopg.conninfo import conninfo_to_dict

    try:
        info = conninfo_to_dict(url)
    except Exception:  # noqa: BLE001 - a malformed URL: say so without echoing it
        return "(unparsable URL)"
    return f"{info.get('host', 'localhost')}:{info.get('port', 5432)}/{info.get('dbname', '')}"


class _Pipelined:
    """A connection kept in pipeline mode (reconnected when it broke)."""

    def __init__(self, url: str, timeout: int) -> None:
        import psycopg

        self._psycopg = psycopg
        self.url = url
        self._timeout = timeout
        self._conn: Any = None
        self._pipe: Any = None
        self._pipe_cm: Any = None

    def _connect(self) -> None:
        self._conn = self._psycopg.connect(self.url, autocommit=True, connect_timeout=self._timeout)
        self._pipeline()

    def _pipeline(self) -> None:
        _prepared_statements(self._conn)
        self._pipe_cm = self._conn.pipeline()
        self._pipe = self._pipe_cm.__enter__()
        self._wcur = self._conn.cursor()

    def _usable(self) -> None:
        if self._conn is None or self._conn.broken or self._conn.closed:
            # The server restarted (or the network dropped us): a new session. What the old
            # one had not committed is gone, and its caller was told so.
            if self._conn is not None:
                self._conn.close()
            self._connect()

    def _recover(self) -> None:
        """After a failure: collect what is pending and leave no transaction open."""
        for _ in range(3):
            conn = self._conn
            if conn is None or conn.broken or conn.closed:
                return
            try:
                self._pipe.sync()  # the statements after a failure are skipped up to here
            except self._psycopg.Error:
                pass
            try:
                conn.execute("ROLLBACK")  # (outside a transaction only a warning)
                self._pipe.sync()
                return
            except self._psycopg.Error:
                continue

    def _close_conn(self) -> None:
        if self._conn is None:
            return
        try:
            if not self._conn.broken and not self._conn.closed:
                self._pipe_cm.__exit__(None, None, None)
        except Exception:  # noqa: BLE001 - closing anyway
            pass
        self._conn.close()


class PostgresStore(_Pipelined, Store):
    """A :class:`~metadata._store.Store` on a PostgreSQL database.

    Args:
        url: a libpq connection string or URL (``postgresql://user:pw@127.0.0.1:5432/db``).
        connect_timeout: seconds to wait for the server.
    """

    def __init__(self, url: str, *, connect_timeout: float = 10.0) -> None:
        import psycopg
        from psycopg.conninfo import conninfo_to_dict

        _Pipelined.__init__(self, url, int(connect_timeout))
        try:
            conninfo_to_dict(url)
        except psycopg.ProgrammingError as exc:  # not a connection string libpq accepts
            raise StripefsError(ErrorCode.INVALID, f"malformed PostgreSQL URL: {str(exc).strip()}") from exc
        try:
            self._conn = psycopg.connect(url, autocommit=True, connect_timeout=int(connect_timeout))
        except psycopg.Error as exc:
            raise StripefsError(ErrorCode.UNAVAILABLE, f"cannot connect to PostgreSQL at {_where(url)}: "
                                f"{str(exc).strip()}") from exc
        try:
            self._init_schema()
            self._pipeline()
        except BaseException:
            self._conn.close()
            raise
        self._open = False
        self._batching = False
        self._safe = False  # this batch: every operation waits for its own statements
        self._safe_next = False
        self._numbers: dict[str, deque[int]] = {key: deque() for key in _SEQUENCES}
        self._readers: list[_PgReader] = []
        # Lease invalidations (``publish_keys``): the keys of this batch's operations, by
        # the client whose request wrote them (b"": none known), published with its commit.
        self._payloads: Callable[[int, list[tuple[bytes, set[Any]]], bool], list[str]] | None = None
        self._barrier = False  # this batch publishes even with no keys (:meth:`barrier`)
        self._pending: set[Any] = set()  # keys of finished operations, no request known yet
        self._groups: list[tuple[bytes, set[Any]]] = []
        self._sent = 0  # the last publication number handed to a commit (never reused)
        self.published = 0  # the last publication number committed (read on the service's loop)
        self.replayed: set[tuple[bytes, int]] = set()  # requests whose record a mutation found (apply_once)
        # Writes of the batch's finished operations not sent yet: sent, combined, before
        # the next read or the commit (PgTxn._before_read, _flush).
        self._deferred: list[tuple[str, tuple[Any, ...]]] = []
        # The batch's reply-record reads taken as "none" without waiting (PgTxn.get_reply).
        self._guesses: list[Any] = []

    def _init_schema(self) -> None:
        """Create or check the tables in one transaction: all of them or none."""
        where = f"PostgreSQL database at {_where(self.url)}"
        with self._conn.transaction():
            # Several services may start at once: one of them creates the tables.
            self._conn.execute("SELECT pg_advisory_xact_lock(7400131)")
            found = None
            if (self._conn.execute("SELECT to_regclass('meta')").fetchone() or (None,))[0] is not None:
                row = self._conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
                found = row[0] if row else None
            check_schema_version(found, where)
            self._conn.execute(PG_SCHEMA)
            for key in _SEQUENCES:
                # Start past what the meta row handed out (a database from before the
                # sequences), and past the root's inode number (1) in a new one; later
                # opens leave a sequence that is already ahead alone.
                self._conn.execute(f"CREATE SEQUENCE IF NOT EXISTS {key}_seq")
                self._conn.execute(
                    f"SELECT setval('{key}_seq', GREATEST(COALESCE((SELECT value::bigint FROM meta WHERE key = %s), 2), "
                    f"(SELECT CASE WHEN is_called THEN last_value + 1 ELSE last_value END FROM {key}_seq)), false)",
                    (key,))
            self._conn.execute("INSERT INTO meta (key, value) VALUES ('schema_version', %s) "
                               "ON CONFLICT (key) DO UPDATE SET value = excluded.value", (str(SCHEMA_VERSION),))
            # Channels are the database's, tables a schema's: one channel per store, named
            # for its inodes table (stores in other schemas of one database stay apart).
            oid = self._conn.execute("SELECT 'inodes'::regclass::oid").fetchone()[0]
        self.lease_channel = f"stripefs_leases_{oid}"

    def publish_keys(self, payloads: Callable[[int, list[tuple[bytes, set[Any]]], bool], list[str]]) -> None:
        """From now on every commit that wrote store keys also sends, inside its transaction,
        ``pg_notify(lease_channel, p)`` for each ``p`` of ``payloads(number, groups, barrier)``:
        ``groups`` the keys written, by the client whose request wrote them, ``number`` one
        per publishing commit, growing. PostgreSQL delivers them to every session listening
        on the channel, only if the transaction commits and only after it did, in commit
        order (``_leasebus.py``). :attr:`published` is the number of the last one committed."""
        self._payloads = payloads

    def barrier(self) -> None:
        """Run in a batch: it publishes, keys or not, marked as a barrier (``_leasebus.py``)."""
        self._barrier = True

    def _attribute(self, client: bytes) -> None:
        """The keys of the operations finished since the last call were written for ``client``."""
        if self._pending:
            self._groups.append((client, self._pending))
            self._pending = set()

    def _op_done(self, txn: PgTxn) -> None:
        """``txn`` finished without error: its keys go with the batch's commit."""
        if txn.keys:
            self._pending |= txn.keys
        if txn.reply_for is not None:  # apply_once recorded a request's result: what came before is its
            self._attribute(txn.reply_for)

    def _publish(self) -> int:
        """Send the batch's keys with its commit (pipelined: no wait of their own), the
        writes still held back with them; the publication's number, 0 for none."""
        self._attribute(b"")
        groups, self._groups = self._groups, []
        barrier, self._barrier = self._barrier, False
        if not (groups or barrier) or self._payloads is None:
            self._flush()
            return 0
        self._sent += 1
        self._deferred.extend(("SELECT pg_notify(%s, %s)", (self.lease_channel, payload))
                              for payload in self._payloads(self._sent, groups, barrier))
        self._flush()
        return self._sent

    def _flush(self) -> None:
        """Send the writes held back for the batch's finished operations."""
        if self._deferred:
            writes, self._deferred = self._deferred, []
            self._send(writes)

    def _send(self, writes: list[tuple[str, tuple[Any, ...]]]) -> None:
        """Send ``writes`` (in order) in as few statements as keep their meaning: each run
        of writes to different rows is one statement, the others as data-modifying
        ``WITH`` parts of the last -- one parse, one execution, one answer instead of
        several. They see the same snapshot and not each other's changes, so a write to a
        row already written in the run (or to rows that cannot be told apart, ``_row``)
        starts the next one; a ``SELECT`` (a notification) can only end a run."""
        run: list[tuple[str, tuple[Any, ...]]] = []
        rows: set[Any] = set()
        for sql, params in writes:
            row = _row(sql, params)
            if run and (row is None or row in rows):
                self._execute(run)
                run, rows = [], set()
            run.append((sql, params))
            rows.add(row)
            if row is None or sql[0] == "S":
                self._execute(run)
                run, rows = [], set()
        if run:
            self._execute(run)

    def _execute(self, run: list[tuple[str, tuple[Any, ...]]]) -> None:
        if len(run) == 1:
            self._wcur.execute(*run[0])
            return
        parts = ", ".join(f"w{i} AS ({sql})" for i, (sql, _) in enumerate(run[:-1]))
        self._wcur.execute(f"WITH {parts} {run[-1][0]}", tuple(p for _, params in run for p in params))

    def _guessed_wrong(self, exc: BaseException) -> bool:
        """The batch failed with ``exc``: was a request of it applied already (its record
        found by a read taken as "none", or clashing with the record it wrote)? Then it
        runs again in safe mode (:meth:`_check_guesses`), else it would apply the request
        again, fail again, and so on."""
        guesses, self._guesses = self._guesses, []
        wrong = _record_clash(exc)
        for cur in guesses:
            if wrong or self._conn.broken:
                break
            try:
                wrong = cur.fetchone() is not None  # (answered before the failure, or not at all)
            except self._psycopg.Error:
                break
        if wrong:
            self._safe_next = True
        return wrong

    def _check_guesses(self) -> None:
        """Before the commit: did a reply-record read taken as "none" find one? Then the
        batch (nothing of it committed) runs again in safe mode, where that read waits,
        and the request is answered from its record, not applied twice."""
        guesses, self._guesses = self._guesses, []
        for cur in guesses:
            if cur.fetchone() is not None:
                self._safe_next = True
                raise _Unattributed(RuntimeError("a request of the batch was applied already"))

    def _begin(self) -> None:
        self._usable()
        try:
            self._conn.execute("BEGIN ISOLATION LEVEL READ COMMITTED")  # sent with the first read
        except self._psycopg.Error:
            if not self._conn.broken:
                raise
            # The session ended while idle (a server restart: its last words were waiting in
            # the socket): a new one, or the reason there is none ("connection failed").
            self._usable()
            self._conn.execute("BEGIN ISOLATION LEVEL READ COMMITTED")

    def _commit(self) -> None:
        """COMMIT and wait for it (and for every statement before it), the keys written
        published with it (:meth:`publish_keys`)."""
        try:
            self._check_guesses()
            number = self._publish()
            cur = self._conn.execute("COMMIT")
            self._pipe.sync()
            if cur.statusmessage != "COMMIT":  # PostgreSQL answers a failed transaction's COMMIT with ROLLBACK
                raise StripefsError(ErrorCode.IO, f"the metadata transaction was rolled back ({cur.statusmessage})")
            if number:
                self.published = number
        except BaseException as exc:
            broken = self._conn.broken
            self._guessed_wrong(exc)
            self._recover()
            if broken:
                raise StripefsError(ErrorCode.IO, f"lost the PostgreSQL connection before the commit: {exc}") from exc
            if self._batching and not self._safe and isinstance(exc, self._psycopg.Error) \
                    and not self.retryable(exc):
                self._safe_next = True
                raise _Unattributed(exc) from exc
            raise

    def _rollback(self) -> None:
        self._deferred, self._guesses = [], []
        self._recover()  # (a lost session took its open transaction with it)

    @contextmanager
    def batch(self) -> Iterator[None]:
        """One transaction (one durable commit) around many operations, each in a savepoint."""
        if self._open or self._batching:
            raise RuntimeError("batches do not nest")
        self._batching = True
        self._safe, self._safe_next = self._safe_next, False
        self._pending, self._groups, self._barrier = set(), [], False  # (a batch run again records them again)
        self._deferred, self._guesses = [], []
        try:
            self._begin()
            try:
                yield
            except BaseException as exc:
                wrong = self._guessed_wrong(exc)
                self._rollback()
                if wrong and not self.retryable(exc):  # (its failure may come from applying it twice)
                    raise _Unattributed(exc) from exc
                raise
            self._commit()
        finally:
            self._batching = False

    @contextmanager
    def transaction(self) -> Iterator[Txn]:
        if self._open:
            raise RuntimeError("transactions do not nest")
        self._open = True
        try:
            if self._batching:
                txn = PgTxn(self, self._conn, locking=True, savepoint=True)
                if self._safe:  # as every statement waited: the savepoint first, the op's errors its own
                    self._conn.execute("SAVEPOINT op")
                    txn.savepoint = True
                try:
                    yield txn
                    if txn.held:  # (no savepoint: it read nothing after writing) sent with the next
                        self._deferred += txn.held
                    if txn.savepoint:  # (sent, not waited for) nested savepoints slow every later statement
                        self._conn.execute("RELEASE SAVEPOINT op")
                    if self._safe:
                        self._pipe.sync()
                except BaseException as exc:
                    self._op_failed(txn, exc)
                    raise
                self._op_done(txn)
                return
            self._begin()
            self._pending, self._groups = set(), []
            txn = PgTxn(self, self._conn, locking=True)
            try:
                yield txn
            except BaseException:
                self._rollback()
                raise
            self._op_done(txn)
            self._commit()
        finally:
            self._open = False

    def _op_failed(self, txn: PgTxn, exc: BaseException) -> None:
        """An operation of the batch raised ``exc``: undo what it wrote (it fails alone), or
        raise what fails the batch (a lost race; a statement error that may be another's)."""
        txn.held = []  # never sent: nothing to undo
        db_error = isinstance(exc, self._psycopg.Error)
        if self.retryable(exc) or self._conn.broken:
            return  # the batch fails (and runs again, when retryable)
        if db_error and not self._safe:
            self._safe_next = True
            raise _Unattributed(exc) from exc
        if db_error:
            try:
                self._pipe.sync()  # collect the failure; the transaction waits for the rollback below
            except self._psycopg.Error:
                pass
        if txn.savepoint:
            self._conn.execute("ROLLBACK TO SAVEPOINT op")
            self._conn.execute("RELEASE SAVEPOINT op")
            if self._safe:
                self._pipe.sync()

    def retryable(self, exc: BaseException) -> bool:
        seen: BaseException | None = exc
        while seen is not None:  # the driver error may be wrapped
            if isinstance(seen, _Unattributed):
                return True
            code = getattr(seen, "sqlstate", None)
            if code in _RETRY_SQLSTATES:
                return True
            if _record_clash(seen):
                return True  # another service recorded this request's result first: run again, find it
            seen = seen.__cause__
        return False

    def reader(self, *, busy_timeout_s: float = 5.0) -> "Store | None":
        """A read-only store on a connection of its own (REPEATABLE READ snapshots).

        Refused (None) for ``busy_timeout_s`` under half a second: that is the metadata
        service's read on its event loop, which would block the loop for every round trip
        and remember directory entries that another service may rename."""
        if busy_timeout_s < _MIN_READER_WAIT:
            return None
        reader = _PgReader(self.url, self._timeout)
        self._readers.append(reader)
        return reader

    def close(self) -> None:
        for reader in self._readers:
            reader.close()
        self._close_conn()

    def __repr__(self) -> str:
        return f"PostgresStore({self._conn.info.host}:{self._conn.info.port}/{self._conn.info.dbname})"


class _PgReads(SqlTxn):
    """A read-only transaction's primitives: :meth:`lookup_entry` in one statement (a
    path walk's last name and its inode: one round trip, not two)."""

    _LOOKUP_ENTRY = (f"SELECT d.ino, d.mode, {', '.join('i.' + c for c in SqlTxn._INODE_COLS.split(', '))} "
                     "FROM dentries d LEFT JOIN inodes i ON i.ino = d.ino WHERE d.parent = %s AND d.name = %s")

    def lookup_entry(self, parent: int, name: str) -> tuple[DirEntry, Attr | None] | None:
        row = self._cur.execute(self._LOOKUP_ENTRY, (parent, encode_name(name))).fetchone()
        if row is None:
            return None
        return DirEntry(name, row[0], row[1]), None if row[2] is None else self._attr(row[2:])


class _PgReader(Store):
    """A read-only connection: each transaction one REPEATABLE READ snapshot taken at its
    first read (it sees every commit acknowledged before). Not pipelined: every read
    waits for its answer anyway, and on a nearby server a pipelined read costs more CPU
    than a plain one."""

    def __init__(self, url: str, timeout: int) -> None:
        import psycopg

        self._psycopg = psycopg
        self.url = url
        self._timeout = timeout
        self._conn = psycopg.connect(url, autocommit=True, connect_timeout=timeout)
        self._open = False

    @contextmanager
    def transaction(self) -> Iterator[Txn]:
        if self._open:
            raise RuntimeError("transactions do not nest")
        self._open = True
        try:
            for attempt in range(2):
                if self._conn.broken or self._conn.closed:
                    self._conn.close()
                    self._conn = self._psycopg.connect(self.url, autocommit=True, connect_timeout=self._timeout)
                try:
                    self._conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
                    break
                except self._psycopg.Error:
                    if attempt or not self._conn.broken:
                        raise  # (a session that ended while idle, a server restart: once more on a new one)
            try:
                yield _PgReads(self._conn.cursor(), paramstyle="format")
            finally:
                if not self._conn.broken and \
                        self._conn.info.transaction_status != self._psycopg.pq.TransactionStatus.IDLE:
                    self._conn.execute("COMMIT")  # nothing to keep: it only read (a failed one rolls back)
        finally:
            self._open = False

    def close(self) -> None:
        self._conn.close()
