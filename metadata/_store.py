"""Transactional storage for the namespace: a small primitive interface, two backends.

Every namespace operation (see ``_namespace.py``) runs inside one
:meth:`Store.transaction` and touches the tables only through :class:`Txn`
primitives, the way 3FS ops run against an ``IReadWriteTransaction``. A new
backend (PostgreSQL, say) implements the primitives and nothing else:

* ``inodes``   -- one :class:`~wire._types.Attr` per inode number;
* ``dirs``     -- per-directory data: the parent pointer (a directory has
  exactly one name, so ``..`` and the rename subtree check need it) and the
  directory's default layout (chunk size, stripe), inherited by ``mkdir``;
* ``dentries`` -- ``(parent, name) -> (ino, type bits)``, listed in name order;
* ``garbage``  -- work left for storage servers (removed/truncated files);
* ``meta``     -- a string key/value table for counters (next inode number) and the
  schema version (:data:`SCHEMA_VERSION`);
* ``membership`` -- one row: the storage membership and chain table (a JSON document
  written by the leading metadata service, read by the others) and its routing version;
* ``replies``  -- results of mutations by ``(client id, request id)``, so a retry that
  reaches another metadata service is answered, not applied twice.

Names are stored as bytes (UTF-8, ``surrogateescape``) so that listing order is
plain byte order in every backend; a text column would sort by the database's
collation and could not hold the lone surrogates a FUSE name may decode to.

Caveats:

* Neither store is thread-safe: the caller serialises transactions (the metadata
  server runs them one at a time from its event loop).
* Transactions do not nest.
* One writing :class:`SqliteStore` per database: under a durable reserve its counters
  live in memory between reserve moves (``_SqliteTxn.allocate``), so a second writer
  process on the same file could hand out a number twice.
"""

from __future__ import annotations

import abc
import dataclasses
import fcntl
import os
import sqlite3
import stat
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from stripefs.wire._errors import ErrorCode, StripefsError
from stripefs.wire._build import positional_builder
from stripefs.wire._types import Attr, DirEntry, Layout

__all__ = ["DirRow", "GarbageItem", "Txn", "Store", "MemoryStore", "SqliteStore"]

T = TypeVar("T")

# Version 1: the tables before membership and replies moved into the store.
SCHEMA_VERSION = 2


@dataclass(frozen=True, slots=True)
class DirRow:
    """Directory-only data. ``None`` layout fields mean "use the service default"."""

    ino: int
    parent: int
    chunk_size: int | None = None
    stripe: int | None = None


@dataclass(frozen=True, slots=True)
class GarbageItem:
    """Work for storage servers: drop a file's chunks (``remove``) or the bytes past
    ``length`` (``truncate``). Acknowledged with ``Namespace.garbage_done(id)``."""

    id: int
    kind: str  # "remove" | "truncate"
    ino: int
    length: int
    layout: Layout


@dataclass(frozen=True, slots=True)
class LockRow:
    """An advisory lease lock: held by ``owner`` until ``expires_ns`` (server clock).

    ``token`` grows by one at every new holder (a fencing token: a storage write or
    commit that carries it can be refused once a newer holder exists)."""

    key: str
    owner: bytes
    token: int
    expires_ns: int


# Rows are already typed by the schema: build without the frozen dataclasses' per-field setattr.
_new_attr = positional_builder(Attr)
_new_dir_entry = positional_builder(DirEntry)


def encode_name(name: str) -> bytes:
    return name.encode("utf-8", "surrogateescape")


def decode_name(raw: bytes) -> str:
    if type(raw) is not bytes:  # a driver's memoryview
        raw = bytes(raw)
    return raw.decode("utf-8", "surrogateescape")


class Txn(abc.ABC):
    """The primitives one transaction offers. Rows are immutable values."""

    @abc.abstractmethod
    def get_inode(self, ino: int) -> Attr | None: ...

    @abc.abstractmethod
    def put_inode(self, attr: Attr) -> None:
        """Insert or replace the inode row ``attr.ino``."""

    @abc.abstractmethod
    def delete_inode(self, ino: int) -> None: ...

    @abc.abstractmethod
    def get_dir(self, ino: int) -> DirRow | None: ...

    @abc.abstractmethod
    def put_dir(self, row: DirRow) -> None: ...

    @abc.abstractmethod
    def delete_dir(self, ino: int) -> None: ...

    @abc.abstractmethod
    def get_dentry(self, parent: int, name: str) -> DirEntry | None: ...

    @abc.abstractmethod
    def put_dentry(self, parent: int, entry: DirEntry) -> None:
        """Insert or replace ``(parent, entry.name)``; ``entry.mode`` keeps type bits only."""

    @abc.abstractmethod
    def delete_dentry(self, parent: int, name: str) -> None: ...

    @abc.abstractmethod
    def list_dentries(self, parent: int, after: str, limit: int) -> list[DirEntry]:
        """Up to ``limit`` entries of ``parent`` with name > ``after``, in name (byte) order."""

    def list_names(self, parent: int, after: str, limit: int) -> list[str]:
        """The names :meth:`list_dentries` would return (a store may skip building entries)."""
        return [e.name for e in self.list_dentries(parent, after, limit)]

    def list_dentries_plus(self, parent: int, after: str, limit: int,
                           layouts: bool = True) -> list[tuple[DirEntry, Attr | None]]:
        """:meth:`list_dentries` with each entry's inode (None if its row is missing);
        a store may fetch both in one query. ``layouts=False``: the attributes carry no
        layout (a store may skip reading and decoding them)."""
        out = [(e, self.get_inode(e.ino)) for e in self.list_dentries(parent, after, limit)]
        if not layouts:
            out = [(e, a if a is None or a.layout is None else dataclasses.replace(a, layout=None)) for e, a in out]
        return out

    @abc.abstractmethod
    def get_meta(self, key: str) -> str | None: ...

    @abc.abstractmethod
    def put_meta(self, key: str, value: str) -> None: ...

    @abc.abstractmethod
    def put_garbage(self, item: GarbageItem) -> None: ...

    @abc.abstractmethod
    def list_garbage(self, limit: int) -> list[GarbageItem]:
        """The oldest ``limit`` items, by id."""

    @abc.abstractmethod
    def delete_garbage(self, item_id: int) -> None: ...

    @abc.abstractmethod
    def count_inodes(self) -> dict[int, tuple[int, int]]:
        """``{file type bits: (inode count, sum of sizes)}``."""

    @abc.abstractmethod
    def get_lock(self, key: str) -> LockRow | None: ...

    @abc.abstractmethod
    def put_lock(self, row: LockRow) -> None:
        """Insert or replace the lock ``row.key``."""

    @abc.abstractmethod
    def delete_lock(self, key: str) -> None: ...

    @abc.abstractmethod
    def get_xattr(self, ino: int, name: bytes) -> bytes | None: ...

    @abc.abstractmethod
    def put_xattr(self, ino: int, name: bytes, value: bytes) -> None:
        """Insert or replace the extended attribute ``name`` of ``ino``."""

    @abc.abstractmethod
    def delete_xattr(self, ino: int, name: bytes) -> None: ...

    @abc.abstractmethod
    def list_xattrs(self, ino: int) -> list[tuple[bytes, int]]:
        """``(name, value size)`` of every extended attribute of ``ino``, by name.

        ``delete_inode`` removes an inode's extended attributes with it."""

    def allocate(self, key: str) -> int:
        """The next number of counter ``key`` (inode numbers, garbage ids): unique, and
        larger than any this store handed out before. Kept in ``meta`` by default; a
        store shared by several services may hand numbers out without making every
        transaction that takes one conflict with the others (a sequence, with gaps)."""
        value = int(self.get_meta(key) or "1")
        self.put_meta(key, str(value + 1))
        return value

    @abc.abstractmethod
    def get_membership(self) -> tuple[int, str] | None:
        """``(routing version, JSON document)`` of the membership row, if written."""

    @abc.abstractmethod
    def put_membership(self, version: int, doc: str) -> None: ...

    @abc.abstractmethod
    def get_reply(self, client: bytes, req: int) -> bytes | None:
        """The recorded result of request ``req`` of ``client``, if it was applied."""

    @abc.abstractmethod
    def put_reply(self, client: bytes, req: int, created_ns: int, result: bytes) -> None: ...

    @abc.abstractmethod
    def delete_replies(self, before_ns: int) -> None:
        """Forget results recorded before ``before_ns`` (no retry comes that late)."""


class Store(abc.ABC):
    """A backend: hands out transactions that commit on success, roll back on exception."""

    @abc.abstractmethod
    def transaction(self) -> AbstractContextManager[Txn]:
        """A context manager yielding a :class:`Txn`."""

    def retryable(self, exc: BaseException) -> bool:
        """Whether ``exc`` means "run the whole transaction (or batch) again": a
        serialization failure or deadlock between concurrent writers. Single-writer
        backends never raise one."""
        return False

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Group commit: transactions opened inside commit together at the end.

        Each one still succeeds or fails on its own (a savepoint in SQL stores);
        the batch costs one durable commit instead of one per transaction. The
        default does nothing special (stores whose commits are cheap).
        """
        yield

    def reader(self, *, busy_timeout_s: float = 5.0) -> "Store | None":
        """A new store for read-only transactions on another thread, or None.

        Its transactions may run while this store's writes (batches) are in
        progress, and see only committed state: a read that starts after a
        write was acknowledged sees it. Each call opens another one (its own
        connection: one per thread that reads); :meth:`close` closes them all.
        None (the default) means reads must go through this store, serialised
        with the writes. ``busy_timeout_s``: how long a read waits out a lock
        (a WAL reader meets one only while a connection recovers the log).
        """
        return None

    def close(self) -> None:
        pass

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- memory

_MISSING = object()


class _MemoryTxn(Txn):
    """Writes straight into the store's dicts and keeps an undo log for rollback."""

    def __init__(self, store: "MemoryStore") -> None:
        self._s = store
        self.undo: list[tuple[dict[Any, Any], Any, Any]] = []

    def _set(self, table: dict[Any, Any], key: Any, value: Any) -> None:
        self.undo.append((table, key, table.get(key, _MISSING)))
        table[key] = value

    def _del(self, table: dict[Any, Any], key: Any) -> None:
        if key in table:
            self.undo.append((table, key, table.pop(key)))

    def get_inode(self, ino: int) -> Attr | None:
        return self._s.inodes.get(ino)

    def put_inode(self, attr: Attr) -> None:
        self._set(self._s.inodes, attr.ino, attr)

    def delete_inode(self, ino: int) -> None:
        self._del(self._s.inodes, ino)
        for key in [k for k in self._s.xattrs if k[0] == ino]:
            self._del(self._s.xattrs, key)

    def get_dir(self, ino: int) -> DirRow | None:
        return self._s.dirs.get(ino)

    def put_dir(self, row: DirRow) -> None:
        self._set(self._s.dirs, row.ino, row)

    def delete_dir(self, ino: int) -> None:
        self._del(self._s.dirs, ino)

    def get_dentry(self, parent: int, name: str) -> DirEntry | None:
        return self._s.dentries.get(parent, {}).get(encode_name(name))

    def put_dentry(self, parent: int, entry: DirEntry) -> None:
        row = DirEntry(entry.name, entry.ino, stat.S_IFMT(entry.mode))
        # Per-parent dicts are never removed, so undo entries stay valid.
        self._set(self._s.dentries.setdefault(parent, {}), encode_name(entry.name), row)

    def delete_dentry(self, parent: int, name: str) -> None:
        self._del(self._s.dentries.get(parent, {}), encode_name(name))

    def list_dentries(self, parent: int, after: str, limit: int) -> list[DirEntry]:
        table = self._s.dentries.get(parent, {})
        start = encode_name(after)
        return [table[k] for k in sorted(k for k in table if k > start)[:limit]]

    def get_meta(self, key: str) -> str | None:
        return self._s.meta.get(key)

    def put_meta(self, key: str, value: str) -> None:
        self._set(self._s.meta, key, value)

    def put_garbage(self, item: GarbageItem) -> None:
        self._set(self._s.garbage, item.id, item)

    def list_garbage(self, limit: int) -> list[GarbageItem]:
        return [self._s.garbage[k] for k in sorted(self._s.garbage)[:limit]]

    def delete_garbage(self, item_id: int) -> None:
        self._del(self._s.garbage, item_id)

    def count_inodes(self) -> dict[int, tuple[int, int]]:
        out: dict[int, tuple[int, int]] = {}
        for attr in self._s.inodes.values():
            n, size = out.get(stat.S_IFMT(attr.mode), (0, 0))
            out[stat.S_IFMT(attr.mode)] = (n + 1, size + attr.size)
        return out

    def get_lock(self, key: str) -> LockRow | None:
        return self._s.locks.get(key)

    def put_lock(self, row: LockRow) -> None:
        self._set(self._s.locks, row.key, row)

    def delete_lock(self, key: str) -> None:
        self._del(self._s.locks, key)

    def get_xattr(self, ino: int, name: bytes) -> bytes | None:
        return self._s.xattrs.get((ino, name))

    def put_xattr(self, ino: int, name: bytes, value: bytes) -> None:
        self._set(self._s.xattrs, (ino, name), bytes(value))

    def delete_xattr(self, ino: int, name: bytes) -> None:
        self._del(self._s.xattrs, (ino, name))

    def list_xattrs(self, ino: int) -> list[tuple[bytes, int]]:
        return sorted((name, len(v)) for (i, name), v in self._s.xattrs.items() if i == ino)

    def get_membership(self) -> tuple[int, str] | None:
        return self._s.membership.get(1)

    def put_membership(self, version: int, doc: str) -> None:
        self._set(self._s.membership, 1, (version, doc))

    def get_reply(self, client: bytes, req: int) -> bytes | None:
        row = self._s.replies.get((bytes(client), req))
        return row[1] if row else None

    def put_reply(self, client: bytes, req: int, created_ns: int, result: bytes) -> None:
        self._set(self._s.replies, (bytes(client), req), (created_ns, bytes(result)))

    def delete_replies(self, before_ns: int) -> None:
        for key in [k for k, (t, _) in self._s.replies.items() if t < before_ns]:
            self._del(self._s.replies, key)


class MemoryStore(Store):
    """An in-process store for tests and fakes; same semantics as :class:`SqliteStore`."""

    def __init__(self) -> None:
        self.inodes: dict[int, Attr] = {}
        self.dirs: dict[int, DirRow] = {}
        self.dentries: dict[int, dict[bytes, DirEntry]] = {}
        self.meta: dict[str, str] = {}
        self.garbage: dict[int, GarbageItem] = {}
        self.xattrs: dict[tuple[int, bytes], bytes] = {}
        self.locks: dict[str, LockRow] = {}
        self.membership: dict[int, tuple[int, str]] = {}
        self.replies: dict[tuple[bytes, int], tuple[int, bytes]] = {}
        self._open = False

    @contextmanager
    def transaction(self) -> Iterator[Txn]:
        if self._open:
            raise RuntimeError("transactions do not nest")
        self._open = True
        txn = _MemoryTxn(self)
        try:
            yield txn
        except BaseException:
            for table, key, old in reversed(txn.undo):
                if old is _MISSING:
                    table.pop(key, None)
                else:
                    table[key] = old
            raise
        finally:
            self._open = False


# --------------------------------------------------------------------------- SQL

def _chains_text(chains: tuple[int, ...]) -> str:
    return ",".join(map(str, chains))


def _chains_tuple(text: str | None) -> tuple[int, ...]:
    return tuple(int(c) for c in text.split(",")) if text else ()


class SqlTxn(Txn):
    """The primitives in plain SQL (``INSERT ... ON CONFLICT`` upserts, ``LIMIT``), which
    SQLite >= 3.24 and PostgreSQL both accept. ``paramstyle`` adapts the ``?`` markers
    for drivers that use ``%s`` (psycopg)."""

    _INODE_COLS = ("ino, ftype, mode, nlink, uid, gid, size, atime_ns, mtime_ns, ctime_ns, chunk_size, chains, target, "
                   "rdev, truncations")

    _PUT_INODE = (f"INSERT INTO inodes ({_INODE_COLS}) VALUES ({', '.join('?' * len(_INODE_COLS.split(', ')))}) "
                  "ON CONFLICT (ino) DO UPDATE SET "
                  + ", ".join(f"{c} = excluded.{c}" for c in _INODE_COLS.split(", ")[1:]))

    def __init__(self, cursor: Any, paramstyle: str = "qmark") -> None:
        self._cur = cursor
        self._fmt = paramstyle == "format"

    def _q(self, sql: str, params: tuple[Any, ...] = ()) -> Any:
        self._cur.execute(sql.replace("?", "%s") if self._fmt else sql, params)
        return self._cur

    _LIST_PLUS = (f"SELECT d.name, d.ino, d.mode, {', '.join('i.' + c for c in _INODE_COLS.split(', '))} "
                  "FROM dentries d LEFT JOIN inodes i ON i.ino = d.ino "
                  "WHERE d.parent = ? AND d.name > ? ORDER BY d.name LIMIT ?")
    # The same without the layout columns (NULLs in their place: no layout is decoded).
    _LIST_PLUS_BARE = _LIST_PLUS.replace("i.chunk_size, i.chains,", "NULL, NULL,")

    def get_inode(self, ino: int) -> Attr | None:
        row = self._q(f"SELECT {self._INODE_COLS} FROM inodes WHERE ino = ?", (ino,)).fetchone()
        return None if row is None else self._attr(row)

    @staticmethod
    def _attr(row: Any) -> Attr:
        """An inode row (``_INODE_COLS``, in order) as an :class:`Attr`."""
        ino, _, mode, nlink, uid, gid, size, at, mt, ct, chunk, chains, target, rdev, truncations = row
        layout = Layout(chunk, _chains_tuple(chains)) if chunk is not None else None
        return _new_attr(ino, mode, nlink, uid, gid, size, at, mt, ct, layout, target, rdev, truncations)

    def put_inode(self, a: Attr) -> None:
        chunk = a.layout.chunk_size if a.layout else None
        chains = _chains_text(a.layout.chains) if a.layout else None
        values = (a.ino, stat.S_IFMT(a.mode), a.mode, a.nlink, a.uid, a.gid, a.size,
                  a.atime_ns, a.mtime_ns, a.ctime_ns, chunk, chains, a.target, a.rdev, a.truncations)
        self._q(self._PUT_INODE, values)

    def delete_inode(self, ino: int) -> None:
        self._q("DELETE FROM inodes WHERE ino = ?", (ino,))
        self._q("DELETE FROM xattrs WHERE ino = ?", (ino,))

    def get_dir(self, ino: int) -> DirRow | None:
        row = self._q("SELECT ino, parent, chunk_size, stripe FROM dirs WHERE ino = ?", (ino,)).fetchone()
        return DirRow(*row) if row else None

    def put_dir(self, r: DirRow) -> None:
        self._q("INSERT INTO dirs (ino, parent, chunk_size, stripe) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (ino) DO UPDATE SET parent = excluded.parent, "
                "chunk_size = excluded.chunk_size, stripe = excluded.stripe",
                (r.ino, r.parent, r.chunk_size, r.stripe))

    def delete_dir(self, ino: int) -> None:
        self._q("DELETE FROM dirs WHERE ino = ?", (ino,))

    def get_dentry(self, parent: int, name: str) -> DirEntry | None:
        row = self._q("SELECT ino, mode FROM dentries WHERE parent = ? AND name = ?",
                      (parent, encode_name(name))).fetchone()
        return DirEntry(name, row[0], row[1]) if row else None

    def put_dentry(self, parent: int, e: DirEntry) -> None:
        self._q("INSERT INTO dentries (parent, name, ino, mode) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (parent, name) DO UPDATE SET ino = excluded.ino, mode = excluded.mode",
                (parent, encode_name(e.name), e.ino, stat.S_IFMT(e.mode)))

    def delete_dentry(self, parent: int, name: str) -> None:
        self._q("DELETE FROM dentries WHERE parent = ? AND name = ?", (parent, encode_name(name)))

    def list_dentries(self, parent: int, after: str, limit: int) -> list[DirEntry]:
        rows = self._q("SELECT name, ino, mode FROM dentries WHERE parent = ? AND name > ? "
                       "ORDER BY name LIMIT ?", (parent, encode_name(after), limit)).fetchall()
        return [DirEntry(decode_name(name), ino, mode) for name, ino, mode in rows]

    def list_dentries_plus(self, parent: int, after: str, limit: int,
                           layouts: bool = True) -> list[tuple[DirEntry, Attr | None]]:
        rows = self._q(self._LIST_PLUS if layouts else self._LIST_PLUS_BARE,
                       (parent, encode_name(after), limit)).fetchall()
        out: list[tuple[DirEntry, Attr | None]] = []
        for row in rows:
            if row[3] is None:  # an entry without its inode row: the namespace reports it
                out.append((_new_dir_entry(decode_name(row[0]), row[1], row[2], None), None))
            else:  # the entry as a plus page gives it: the inode's full mode, with the attributes
                attr = self._attr(row[3:])
                out.append((_new_dir_entry(decode_name(row[0]), row[1], attr.mode, attr), attr))
        return out

    def list_names(self, parent: int, after: str, limit: int) -> list[str]:
        rows = self._q("SELECT name FROM dentries WHERE parent = ? AND name > ? ORDER BY name LIMIT ?",
                       (parent, encode_name(after), limit)).fetchall()
        return [decode_name(name) for name, in rows]

    def get_meta(self, key: str) -> str | None:
        row = self._q("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def put_meta(self, key: str, value: str) -> None:
        self._q("INSERT INTO meta (key, value) VALUES (?, ?) "
                "ON CONFLICT (key) DO UPDATE SET value = excluded.value", (key, value))

    def put_garbage(self, g: GarbageItem) -> None:
        self._q("INSERT INTO garbage (id, kind, ino, length, chunk_size, chains) VALUES (?, ?, ?, ?, ?, ?)",
                (g.id, g.kind, g.ino, g.length, g.layout.chunk_size, _chains_text(g.layout.chains)))

    def list_garbage(self, limit: int) -> list[GarbageItem]:
        rows = self._q("SELECT id, kind, ino, length, chunk_size, chains FROM garbage "
                       "ORDER BY id LIMIT ?", (limit,)).fetchall()
        return [GarbageItem(i, k, ino, n, Layout(cs, _chains_tuple(ch))) for i, k, ino, n, cs, ch in rows]

    def delete_garbage(self, item_id: int) -> None:
        self._q("DELETE FROM garbage WHERE id = ?", (item_id,))

    def count_inodes(self) -> dict[int, tuple[int, int]]:
        rows = self._q("SELECT ftype, COUNT(*), COALESCE(SUM(size), 0) FROM inodes GROUP BY ftype").fetchall()
        return {ftype: (int(n), int(size)) for ftype, n, size in rows}  # PostgreSQL's SUM is NUMERIC

    def get_lock(self, key: str) -> LockRow | None:
        row = self._q("SELECT key, owner, token, expires_ns FROM locks WHERE key = ?", (key,)).fetchone()
        return LockRow(row[0], bytes(row[1]), row[2], row[3]) if row else None

    def put_lock(self, r: LockRow) -> None:
        self._q("INSERT INTO locks (key, owner, token, expires_ns) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (key) DO UPDATE SET owner = excluded.owner, token = excluded.token, "
                "expires_ns = excluded.expires_ns", (r.key, r.owner, r.token, r.expires_ns))

    def delete_lock(self, key: str) -> None:
        self._q("DELETE FROM locks WHERE key = ?", (key,))

    def get_xattr(self, ino: int, name: bytes) -> bytes | None:
        row = self._q("SELECT value FROM xattrs WHERE ino = ? AND name = ?", (ino, name)).fetchone()
        return bytes(row[0]) if row else None

    def put_xattr(self, ino: int, name: bytes, value: bytes) -> None:
        self._q("INSERT INTO xattrs (ino, name, value) VALUES (?, ?, ?) "
                "ON CONFLICT (ino, name) DO UPDATE SET value = excluded.value", (ino, name, bytes(value)))

    def delete_xattr(self, ino: int, name: bytes) -> None:
        self._q("DELETE FROM xattrs WHERE ino = ? AND name = ?", (ino, name))

    def list_xattrs(self, ino: int) -> list[tuple[bytes, int]]:
        rows = self._q("SELECT name, LENGTH(value) FROM xattrs WHERE ino = ? ORDER BY name", (ino,)).fetchall()
        return [(bytes(name), n) for name, n in rows]

    def get_membership(self) -> tuple[int, str] | None:
        row = self._q("SELECT version, doc FROM membership WHERE id = 1").fetchone()
        return (int(row[0]), row[1]) if row else None

    def put_membership(self, version: int, doc: str) -> None:
        self._q("INSERT INTO membership (id, version, doc) VALUES (1, ?, ?) "
                "ON CONFLICT (id) DO UPDATE SET version = excluded.version, doc = excluded.doc", (version, doc))

    def get_reply(self, client: bytes, req: int) -> bytes | None:
        row = self._q("SELECT result FROM replies WHERE client = ? AND req = ?", (bytes(client), req)).fetchone()
        return bytes(row[0]) if row else None

    def put_reply(self, client: bytes, req: int, created_ns: int, result: bytes) -> None:
        self._q("INSERT INTO replies (client, req, created_ns, result) VALUES (?, ?, ?, ?)",
                (bytes(client), req, created_ns, bytes(result)))

    def delete_replies(self, before_ns: int) -> None:
        self._q("DELETE FROM replies WHERE created_ns < ?", (before_ns,))


# Directory entries and counters are written by every create and unlink: WITHOUT ROWID keeps
# each in one B-tree (a table with a separate key index writes two pages per change; measured
# in the store alone: create 101 -> 93 us, unlink 81 -> 72). Databases made before keep their
# tables: the same statements work on both.
_SCHEMA = """
CREATE TABLE IF NOT EXISTS inodes (
    ino INTEGER PRIMARY KEY, ftype INTEGER NOT NULL, mode INTEGER NOT NULL,
    nlink INTEGER NOT NULL, uid INTEGER NOT NULL, gid INTEGER NOT NULL, size INTEGER NOT NULL,
    atime_ns INTEGER NOT NULL, mtime_ns INTEGER NOT NULL, ctime_ns INTEGER NOT NULL,
    chunk_size INTEGER, chains TEXT, target TEXT, rdev INTEGER NOT NULL DEFAULT 0,
    truncations INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS dirs (
    ino INTEGER PRIMARY KEY, parent INTEGER NOT NULL, chunk_size INTEGER, stripe INTEGER);
CREATE TABLE IF NOT EXISTS dentries (
    parent INTEGER NOT NULL, name BLOB NOT NULL, ino INTEGER NOT NULL, mode INTEGER NOT NULL,
    PRIMARY KEY (parent, name)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS garbage (
    id INTEGER PRIMARY KEY, kind TEXT NOT NULL, ino INTEGER NOT NULL, length INTEGER NOT NULL,
    chunk_size INTEGER NOT NULL, chains TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS xattrs (
    ino INTEGER NOT NULL, name BLOB NOT NULL, value BLOB NOT NULL, PRIMARY KEY (ino, name));
CREATE TABLE IF NOT EXISTS locks (
    key TEXT PRIMARY KEY, owner BLOB NOT NULL, token INTEGER NOT NULL, expires_ns INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS membership (id INTEGER PRIMARY KEY, version INTEGER NOT NULL, doc TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS replies (
    client BLOB NOT NULL, req INTEGER NOT NULL, created_ns INTEGER NOT NULL, result BLOB NOT NULL,
    PRIMARY KEY (client, req));
CREATE INDEX IF NOT EXISTS replies_by_age ON replies (created_ns);
"""


def check_schema_version(found: str | None, where: str) -> None:
    """Refuse a database written by another schema version (before touching it).

    Args:
        found: the ``schema_version`` row of ``meta`` (None when absent).
        where: the database, for the message.

    Raises:
        StripefsError: INVALID naming both versions.
    """
    if found is None:
        return  # a new database, or one from version 1 (before the row existed): migrated here
    if not found.isdigit() or int(found) != SCHEMA_VERSION:
        raise StripefsError(ErrorCode.INVALID,
                            f"{where} holds a stripefs namespace of schema version {found}; this stripefs "
                            f"reads version {SCHEMA_VERSION} (use the matching release, or a new database)")


# ``--metadata-sync``: SQLite's ``synchronous`` setting for the namespace database (WAL mode).
SYNC_MODES = {"full": 2, "normal": 1}
# Under ``normal`` a power loss may take back the last commits, counters included. Numbers
# are handed out below a bound recorded durably (``<counter>.reserved``), this many at a
# time, and a store opens with its counters moved past their bounds: a number a lost file
# had (whose chunks storage servers may hold) never names another file.
RESERVE = 1 << 16


def check_sync(mode: str) -> str:
    """``mode`` if it is a known durability setting (``full``, ``normal``).

    Raises:
        StripefsError: INVALID naming the settings.
    """
    if mode not in SYNC_MODES:
        raise StripefsError(ErrorCode.INVALID, f"metadata sync {mode!r}: use full or normal")
    return mode


class _SqliteTxn(SqlTxn):
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
        # ``full`` with the log fsynced by the owner (:meth:`sync_log_by_owner`).
        self.log_by_owner = False
        self._dir_synced = False
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
        self._conn.execute("BEGIN IMMEDIATE")
        self._changes = self._conn.total_changes

    def _commit(self) -> None:
        self._conn.execute("COMMIT")
        self.unchecked += 1
        if self.durable_commit or (self.log_by_owner and self._conn.total_changes != self._changes):
            self.durable_commit = False
            # SQLite's NORMAL wrote the commit to the WAL without an fsync: do that one now.
            self.sync_log()

    def sync_log(self) -> None:
        """Make every commit that returned before this call durable: fsync the log (WAL).

        Safe on any thread while the writing connection commits (its own descriptor; the
        fsync covers at least every write that completed before it started). The first
        call also fsyncs the directory, so the log's own name is durable.

        Raises:
            OSError: the fsync failed (what the log holds may not be on disk).
        """
        try:
            fd = os.open(self.path + "-wal", os.O_RDONLY)
        except FileNotFoundError:
            return  # an in-memory database: nothing is durable anyway
        try:
            os.fsync(fd)
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
        self._conn.execute(f"PRAGMA synchronous={SYNC_MODES['normal']}")
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
            self._conn.execute("BEGIN IMMEDIATE")
            result = fn()
            # A reserve bound moved (that commit is fsynced, on a thread), or a transaction
            # without its savepoint failed or had company: roll back, the thread reruns it.
            if self.durable_commit or not all(self._bare):
                self.durable_commit = False
                self._conn.execute("ROLLBACK")
                return False, None
            self._conn.execute("COMMIT")
            self.unchecked += 1
            return True, result
        except BaseException:
            self.durable_commit = False
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
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
            raise
        finally:
            self._batching = False

    @contextmanager
    def transaction(self) -> Iterator[Txn]:
        if self._open:
            raise RuntimeError("transactions do not nest")
        if self._batching:
            if self._bare is not None:  # commit_unsynced: its one transaction needs no savepoint
                with self._unsaved() as txn:
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
            raise
        finally:
            self._open = False

    @contextmanager
    def _unsaved(self) -> Iterator[Txn]:
        """A transaction of :meth:`commit_unsynced`, with no savepoint of its own: one that
        fails (or a second one) makes the whole batch roll back (``_bare``)."""
        bare = self._bare
        assert bare is not None
        self._open = True
        try:
            if bare:
                bare.append(False)  # a second transaction: it could need its savepoint
            bare.append(True)
            try:
                yield _SqliteTxn(self._conn.cursor(), self)
            except BaseException:
                bare.append(False)
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


class _SqliteReader(Store):
    """A second, query-only connection to a WAL database: each transaction reads one
    committed snapshot and never waits for the writer (WAL readers do not block)."""

    def __init__(self, path: str, busy_timeout_s: float = 5.0) -> None:
        self._conn = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
        self._conn.execute("PRAGMA query_only=1")
        self._open = False

    @contextmanager
    def transaction(self) -> Iterator[Txn]:
        if self._open:
            raise RuntimeError("transactions do not nest")
        self._open = True
        try:
            self._conn.execute("BEGIN")  # deferred: the first read takes the snapshot
            yield SqlTxn(self._conn.cursor())
        finally:
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")  # nothing to keep: it only read
            self._open = False

    def close(self) -> None:
        self._conn.close()
