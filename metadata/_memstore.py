"""The in-memory store: the :class:`~metadata._store.Store` interface over plain dicts.

For tests and fakes: the namespace tests run against it as against the SQL stores,
with the same semantics and nothing durable. A transaction writes straight into the
tables and undoes its writes on an exception.

Caveats:

* Not thread-safe, and transactions do not nest (as every store).
* Listing sorts a directory's names at each call: fine for tests, not for large trees.
"""

from __future__ import annotations

import stat
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from stripefs.wire._types import Attr, DirEntry

from ._store import DirRow, GarbageItem, LockRow, Store, Txn, encode_name

__all__ = ["MemoryStore"]

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

    def get_garbage(self, item_id: int) -> GarbageItem | None:
        return self._s.garbage.get(item_id)

    def list_cuts(self, ino: int) -> list[GarbageItem]:
        return [g for _, g in sorted(self._s.garbage.items()) if g.kind == "truncate" and g.ino == ino]

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
    """An in-process store for tests and fakes; same semantics as :class:`~metadata._sqlite.SqliteStore`."""

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
