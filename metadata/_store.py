"""Transactional storage for the namespace: the small primitive interface every backend implements.

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
  schema version (:data:`~metadata._sqltxn.SCHEMA_VERSION`);
* ``membership`` -- one row: the storage membership and chain table (a JSON document
  written by the leading metadata service, read by the others) and its routing version;
* ``replies``  -- results of mutations by ``(client id, request id)``, so a retry that
  reaches another metadata service is answered, not applied twice.

The backends live beside this module: ``_memstore.py`` (in memory, for tests),
``_sqltxn.py`` (the primitives in SQL and the schema, shared by the two SQL stores),
``_sqlite.py`` and ``_pgstore.py``.

Names are stored as bytes (UTF-8, ``surrogateescape``) so that listing order is
plain byte order in every backend; a text column would sort by the database's
collation and could not hold the lone surrogates a FUSE name may decode to.

Caveats:

* No store is thread-safe: the caller serialises transactions (the metadata
  server runs them one at a time from its event loop).
* Transactions do not nest.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

from stripefs.wire._types import Attr, DirEntry, Layout, ListingPage

__all__ = ["DirRow", "GarbageItem", "LockRow", "Txn", "Store"]


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
    ``length`` (``truncate``). A removal is acknowledged with ``Namespace.garbage_done(id)``;
    a cut stays queued until every storage server that held the bytes applied it
    (``Namespace.cut_done``, ``Namespace.cuts_applied``). A ``reserved`` item is an inode
    number handed to a client that writes a whole file's chunks before the file exists
    (``Namespace.reserve_files``): committing the file clears it (``commit_files``);
    otherwise it is a removal, due after ``RESERVE_GRACE``."""

    id: int
    kind: str  # "remove" | "truncate" | "reserved"
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

    def lookup_entry(self, parent: int, name: str) -> tuple[DirEntry, Attr | None] | None:
        """:meth:`get_dentry` with the inode the entry names (None if its row is missing),
        or None when there is no such entry; a store may read both in one query."""
        entry = self.get_dentry(parent, name)
        return None if entry is None else (entry, self.get_inode(entry.ino))

    def expect(self, parent: int, name: str, target: bool = False) -> None:
        """A hint: the operation is about to read directory ``parent``'s inode, its entry
        ``name`` and, with ``target``, the inode that entry names. A store whose reads are
        round trips may send them all at once now (the reads themselves still follow, and
        return what they would have returned). The default does nothing."""

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

    def list_plus_page(self, parent: int, after: str, limit: int) -> tuple[ListingPage, bool] | None:
        """``(page, more)``: :meth:`list_dentries_plus`'s page (with layouts) as a
        :class:`ListingPage` made from the store's own columns, or None where the store
        has no such path, or an entry has no inode row (the caller then lists entry by
        entry)."""
        return None

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
    def get_garbage(self, item_id: int) -> GarbageItem | None:
        """The item ``item_id``, while queued."""

    @abc.abstractmethod
    def list_cuts(self, ino: int) -> list[GarbageItem]:
        """The ``truncate`` items of inode ``ino`` still queued (cuts not applied yet), by id."""

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
