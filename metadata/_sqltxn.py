"""What the two SQL stores share: the primitives in plain SQL, the schema and its version.

:class:`SqlTxn` implements every :class:`~metadata._store.Txn` primitive in SQL that
SQLite (``_sqlite.py``) and PostgreSQL (``_pgstore.py``) both accept; each store
subclasses it only where it differs (SQLite's reserved counters and written-key
record, PostgreSQL's sequences). ``_SCHEMA`` is written in SQLite's types;
``_pgstore.py`` derives its own from it, so a column is added in one place.
"""

from __future__ import annotations

import stat
from typing import Any

from stripefs.wire._build import positional_builder
from stripefs.wire._errors import ErrorCode, StripefsError
from stripefs.wire._types import Attr, DirEntry, Layout, ListingPage

from ._store import DirRow, GarbageItem, LockRow, Txn, decode_name, encode_name

__all__ = ["SCHEMA_VERSION", "SqlTxn", "check_schema_version"]

# Version 1: the tables before membership and replies moved into the store.
SCHEMA_VERSION = 2


# Rows are already typed by the schema: build without the frozen dataclasses' per-field setattr.
_new_attr = positional_builder(Attr)
_new_dir_entry = positional_builder(DirEntry)
_new_layout = positional_builder(Layout)


def _chains_text(chains: tuple[int, ...]) -> str:
    return ",".join(map(str, chains))


def _chains_tuple(text: str | None) -> tuple[int, ...]:
    return tuple(map(int, text.split(","))) if text else ()


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

    def list_plus_page(self, parent: int, after: str, limit: int) -> tuple[ListingPage, bool] | None:
        """``(page, more)``: :meth:`list_dentries_plus`'s entries with their layouts as a
        page by columns, made straight from the rows (no ``Attr`` or ``DirEntry`` per entry:
        the page a client fetches to answer its lookups from, thousands of entries). None
        when an entry has no inode row (the namespace reports it)."""
        rows = self._q(self._LIST_PLUS, (parent, encode_name(after), limit + 1)).fetchall()
        more = len(rows) > limit
        if not rows:
            return ListingPage.of_rows([], [], [], [], [], []), more
        cols = list(zip(*rows[:limit]))
        if None in cols[3]:
            return None
        # name, ino, mode (of the entry), then the inode's: ino, ftype, mode, nlink, uid, gid,
        # size, atime, mtime, ctime, chunk_size, chains, target, rdev, truncations. Each file
        # has a layout of its own (a shuffled window of chains, Namespace._pick_layout).
        layouts = [None if chunk is None else _new_layout(chunk, _chains_tuple(chains))
                   for chunk, chains in zip(cols[13], cols[14])]
        ints = [list(cols[i]) for i in (6, 7, 8, 9, 10, 11, 12, 16, 17)]  # nlink .. ctime, rdev, truncations
        return ListingPage.of_rows(list(map(decode_name, cols[0])), list(cols[1]), list(cols[5]), ints, layouts,
                                   list(cols[15])), more

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

    def get_garbage(self, item_id: int) -> GarbageItem | None:
        row = self._q("SELECT id, kind, ino, length, chunk_size, chains FROM garbage WHERE id = ?",
                      (item_id,)).fetchone()
        if row is None:
            return None
        i, k, ino, n, cs, ch = row
        return GarbageItem(i, k, ino, n, Layout(cs, _chains_tuple(ch)))

    def list_cuts(self, ino: int) -> list[GarbageItem]:
        rows = self._q("SELECT id, kind, ino, length, chunk_size, chains FROM garbage "
                       "WHERE kind = 'truncate' AND ino = ? ORDER BY id", (ino,)).fetchall()
        return [GarbageItem(i, k, n_ino, n, Layout(cs, _chains_tuple(ch))) for i, k, n_ino, n, cs, ch in rows]

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
-- Pending cuts of one file, looked up by every commit that would grow it (normally empty).
CREATE INDEX IF NOT EXISTS garbage_cuts ON garbage (ino) WHERE kind = 'truncate';
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
