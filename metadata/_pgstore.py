"""The store on PostgreSQL: the same transaction interface, for metadata that outgrows one machine.

The primitives are :class:`~metadata._sqltxn.SqlTxn`'s plain SQL (``%s`` markers);
this module adds the PostgreSQL schema (64-bit integers, ``BYTEA``), a connection,
transactions at ``SERIALIZABLE`` isolation, savepoints for group commit, and
:meth:`PostgresStore.retryable` so the metadata service reruns a batch that lost a
serialization race with another metadata service on the same database.

Why SERIALIZABLE: namespace operations read then write (a rename checks that the
target is not inside the source; a link bumps a count it read; names must stay
unique). Under weaker isolation two services could each pass their checks and both
commit; under SERIALIZABLE one of them fails with SQLSTATE 40001 and is rerun.

Caveats:
    * Needs ``psycopg`` 3 (``pip install 'stripefs[postgres]'``).
    * One connection per store: the metadata service runs one batch at a time per
      process; more throughput comes from more metadata processes.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from stripefs.wire._errors import ErrorCode, StripefsError

from ._sqltxn import _SCHEMA, SCHEMA_VERSION, SqlTxn, check_schema_version
from ._store import Store, Txn

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


class PgTxn(SqlTxn):
    """:class:`SqlTxn` with counters from PostgreSQL sequences (never rolled back: gaps)."""

    def allocate(self, key: str) -> int:
        if key not in _SEQUENCES:
            return super().allocate(key)
        return int(self._q(f"SELECT nextval('{key}_seq')").fetchone()[0])


def _where(url: str) -> str:
    """``host:port/db`` of a URL, never its password (the message goes to logs)."""
    from psycopg.conninfo import conninfo_to_dict

    try:
        info = conninfo_to_dict(url)
    except Exception:  # noqa: BLE001 - a malformed URL: say so without echoing it
        return "(unparsable URL)"
    return f"{info.get('host', 'localhost')}:{info.get('port', 5432)}/{info.get('dbname', '')}"


class PostgresStore(Store):
    """A :class:`~metadata._store.Store` on a PostgreSQL database.

    Args:
        url: a libpq connection string or URL (``postgresql://user:pw@127.0.0.1:5432/db``).
        connect_timeout: seconds to wait for the server.
    """

    def __init__(self, url: str, *, connect_timeout: float = 10.0) -> None:
        import psycopg
        from psycopg.conninfo import conninfo_to_dict

        self._psycopg = psycopg
        self.url = url
        self._timeout = int(connect_timeout)
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
        except BaseException:
            self._conn.close()
            raise
        self._open = False
        self._batching = False

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

    def _begin(self) -> None:
        if self._conn.broken or self._conn.closed:
            # The server restarted (or the network dropped us): a new session. What the old
            # one had not committed is gone, and its caller was told so.
            self._conn = self._psycopg.connect(self.url, autocommit=True, connect_timeout=self._timeout)
        self._conn.execute("BEGIN ISOLATION LEVEL SERIALIZABLE")

    def _end(self, ok: bool) -> None:
        if self._conn.broken:  # the session is gone, and with it the open transaction
            if ok:
                raise StripefsError(ErrorCode.IO, "lost the PostgreSQL connection before the commit")
            return
        if self._conn.info.transaction_status != self._psycopg.pq.TransactionStatus.IDLE:
            self._conn.execute("COMMIT" if ok else "ROLLBACK")

    @contextmanager
    def batch(self) -> Iterator[None]:
        """One transaction (one durable commit) around many operations, each in a savepoint."""
        if self._open or self._batching:
            raise RuntimeError("batches do not nest")
        self._batching = True
        try:
            self._begin()
            try:
                yield
            except BaseException:
                self._end(False)
                raise
            self._end(True)
        finally:
            self._batching = False

    @contextmanager
    def transaction(self) -> Iterator[Txn]:
        if self._open:
            raise RuntimeError("transactions do not nest")
        self._open = True
        try:
            if self._batching:
                self._conn.execute("SAVEPOINT op")
                try:
                    yield PgTxn(self._conn.cursor(), paramstyle="format")
                except BaseException as exc:
                    if not self.retryable(exc):  # a lost race aborts the whole batch
                        self._conn.execute("ROLLBACK TO SAVEPOINT op")
                        self._conn.execute("RELEASE SAVEPOINT op")
                    raise
                self._conn.execute("RELEASE SAVEPOINT op")
                return
            self._begin()
            try:
                yield PgTxn(self._conn.cursor(), paramstyle="format")
            except BaseException:
                self._end(False)
                raise
            self._end(True)
        finally:
            self._open = False

    def retryable(self, exc: BaseException) -> bool:
        seen: BaseException | None = exc
        while seen is not None:  # the driver error may be wrapped
            if getattr(seen, "sqlstate", None) in _RETRY_SQLSTATES:
                return True
            seen = seen.__cause__
        return False

    def close(self) -> None:
        self._conn.close()

    def __repr__(self) -> str:
        return f"PostgresStore({self._conn.info.host}:{self._conn.info.port}/{self._conn.info.dbname})"


