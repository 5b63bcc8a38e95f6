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

**Round trips.** The connection runs in pipeline mode: a statement whose result is
not needed (every write, ``BEGIN``, ``SAVEPOINT``) is sent without waiting, and only a
read waits, for everything sent before it too. A create costs three waits (the
reply record check, the directory's row with its lock and ``dirs`` row, the name)
plus the batch's commit; see docs/operations.md for the measurements. A write's
failure may thus surface in a later operation of the batch: then the batch (nothing
of it committed) runs again in *safe mode*, each operation waiting for its own
statements, so the failure is told to the operation that caused it alone, as before.

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
from ._store import DirRow, GarbageItem, LockRow, Store, Txn

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

    def _q(self, sql: str, params: tuple[Any, ...] = ()) -> Any:
        conn = self._conn
        if sql[0] == "S":  # a read (SELECT): a cursor of its own, fetched by the caller
            cur = conn.cursor()
        else:
            if self._want_savepoint and not self.savepoint:
                conn.execute("SAVEPOINT op")
                self.savepoint = True
            self.wrote = True
            cur = self._store._wcur
        cur.execute(_pg(sql), params)
        return cur

    def get_inode(self, ino: int) -> Attr | None:
        if not self._locking:
            return super().get_inode(ino)
        conn = self._conn
        cur = conn.cursor()
        cur.execute(self._GET_INODE_LOCKED, (ino,))
        # Sent with it (no wait of its own), run once the lock is held, on a new snapshot: the
        # dirs row as the last holder of the lock left it. Needed for directories only.
        dcur = conn.cursor()
        dcur.execute(self._GET_DIR, (ino,))
        row = cur.fetchone()
        if row is None:
            return None
        if stat.S_ISDIR(row[1]):
            self._dirs[ino] = dcur
        return self._attr(row)

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
        super().put_inode(a)

    def delete_inode(self, ino: int) -> None:
        if self.keys is not None:
            self.keys.add(ino)
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
        super().put_dentry(parent, e)

    def delete_dentry(self, parent: int, name: str) -> None:
        if self.keys is not None:
            self.keys.add((parent, name))
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
        if not pool:
            rows = self._q(f"SELECT nextval('{key}_seq') FROM generate_series(1, ?)", (ALLOCATE_BLOCK,)).fetchall()
            pool.extend(sorted(int(r[0]) for r in rows))
        return pool.popleft()


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
        # No server-side prepared statements here: psycopg forgets them all at every ROLLBACK
        # (TO SAVEPOINT too) and, pipelined, may then use a name whose PREPARE was skipped.
        self._conn.prepare_threshold = None
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
        """Send the batch's keys with its commit (pipelined: no wait of their own); the
        publication's number, 0 for none."""
        self._attribute(b"")
        groups, self._groups = self._groups, []
        barrier, self._barrier = self._barrier, False
        if not (groups or barrier) or self._payloads is None:
            return 0
        self._sent += 1
        for payload in self._payloads(self._sent, groups, barrier):
            self._conn.execute("SELECT pg_notify(%s, %s)", (self.lease_channel, payload))
        return self._sent

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
            number = self._publish()
            cur = self._conn.execute("COMMIT")
            self._pipe.sync()
            if cur.statusmessage != "COMMIT":  # PostgreSQL answers a failed transaction's COMMIT with ROLLBACK
                raise StripefsError(ErrorCode.IO, f"the metadata transaction was rolled back ({cur.statusmessage})")
            if number:
                self.published = number
        except BaseException as exc:
            broken = self._conn.broken
            self._recover()
            if broken:
                raise StripefsError(ErrorCode.IO, f"lost the PostgreSQL connection before the commit: {exc}") from exc
            if self._batching and not self._safe and isinstance(exc, self._psycopg.Error) \
                    and not self.retryable(exc):
                self._safe_next = True
                raise _Unattributed(exc) from exc
            raise

    def _rollback(self) -> None:
        self._recover()  # (a lost session took its open transaction with it)

    @contextmanager
    def batch(self) -> Iterator[None]:
        """One transaction (one durable commit) around many operations, each in a savepoint."""
        if self._open or self._batching:
            raise RuntimeError("batches do not nest")
        self._batching = True
        self._safe, self._safe_next = self._safe_next, False
        self._pending, self._groups, self._barrier = set(), [], False  # (a batch run again records them again)
        try:
            self._begin()
            try:
                yield
            except BaseException:
                self._rollback()
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
            if code == "23505" and getattr(getattr(seen, "diag", None), "constraint_name", None) == "replies_pkey":
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
                yield SqlTxn(self._conn.cursor(), paramstyle="format")
            finally:
                if not self._conn.broken and \
                        self._conn.info.transaction_status != self._psycopg.pq.TransactionStatus.IDLE:
                    self._conn.execute("COMMIT")  # nothing to keep: it only read (a failed one rolls back)
        finally:
            self._open = False

    def close(self) -> None:
        self._conn.close()
