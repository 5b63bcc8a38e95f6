"""The file system namespace: one method per metadata operation, one transaction each.

Each public method of :class:`Namespace` opens exactly one store transaction, so
an operation is atomic: it either commits whole or, on any exception (including
the :class:`~wire._errors.StripefsError` it raises itself), leaves nothing.

File data never passes through here. A file's :class:`~wire._types.Layout` says
which storage chains hold its chunks; clients commit the file length at close or
fsync (:meth:`Namespace.commit_length`, the 3FS model), and removals/truncations
leave :class:`GarbageItem` work for the storage servers.

Caveats:

* No permission checks: uid/gid/mode are stored, enforcement is the caller's.
* ``atime`` is set at creation and by ``setattr`` only (``noatime``).
* ``create`` on an existing symlink raises ``EEXIST``; callers resolve symlinks
  first (``resolve``), as the kernel does before it calls FUSE ``create``.
* Unlinking the last name of an open file queues its removal at once: there is
  no "orphan while open" state.
"""

from __future__ import annotations

import copy
import dataclasses
import random
import stat
import time
from collections.abc import Callable

from stripefs.wire._errors import ErrorCode, StripefsError
from stripefs.wire._types import (MAX_CHUNK, MAX_FILE_SIZE, MAX_PATH, MAX_STRIPE, MAX_XATTR_NAME, MAX_XATTR_TOTAL,
                         MAX_XATTR_VALUE, MIN_CHUNK, XATTR_NAMESPACES, Attr, DirEntry, Layout, validate_name)

from stripefs.wire._build import positional_builder

from ._store import DirRow, GarbageItem, Store, Txn

__all__ = ["Namespace", "GarbageItem", "ROOT_INO", "RENAME_NOREPLACE", "RENAME_EXCHANGE", "XATTR_CREATE", "XATTR_REPLACE"]

ROOT_INO = 1
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
MAX_SYMLINKS = 40  # as Linux: ELOOP after 40 links in one resolution
MAX_READDIR = 10_000
# Paths per StatMany: 200 paths of 4 KiB, or 200 attributes with 4 KiB symlink targets, fit in
# one frame header (1 MiB).
MAX_STAT_MANY = 200
# Paths per CreateMany / UnlinkMany: the same bound (the request carries the paths, the reply
# one attribute per path).
MAX_CREATE_MANY = 200
# Names per ListNames page: 2000 names of 255 bytes fit in one frame header.
MAX_LIST_NAMES = 2000
# Directory entries a remembering reader keeps (see ``Namespace.reading``): ~200 bytes each.
DIRS_KEPT = 65536
XATTR_CREATE, XATTR_REPLACE = 1, 2  # setxattr(2) flags
# ``meta`` key prefix: the inode's ``truncations`` after its last late cut (``cuts_applied``);
# writers that saw an earlier count are refused their commit. One row per file ever cut late
# (a rare failure), never reused: inode numbers are not.
_LATE_CUT = "late_cut:"
_NODE_TYPES = frozenset({stat.S_IFIFO, stat.S_IFSOCK, stat.S_IFCHR, stat.S_IFBLK, stat.S_IFREG})


_new_attr = positional_builder(Attr)
_ATTR_FIELDS = tuple(f.name for f in dataclasses.fields(Attr))
_ATTR_NAMES = frozenset(_ATTR_FIELDS)


def _with(attr: Attr, **changes: object) -> Attr:
    """``dataclasses.replace(attr, **changes)``, the same value, without its per-field
    ``__init__`` of a frozen dataclass (the copies every create and length commit makes)."""
    if not changes.keys() <= _ATTR_NAMES:
        raise TypeError(f"Attr has no field {sorted(changes.keys() - _ATTR_NAMES)}")
    return _new_attr(*[changes[n] if n in changes else getattr(attr, n) for n in _ATTR_FIELDS])


def _err(code: ErrorCode, message: str) -> StripefsError:
    return StripefsError(code, message)


def _check_chunk_size(cs: int) -> int:
    if not isinstance(cs, int) or cs < MIN_CHUNK or cs > MAX_CHUNK or cs & (cs - 1):
        raise _err(ErrorCode.INVALID, f"chunk size must be a power of two in [{MIN_CHUNK}, {MAX_CHUNK}]")
    return cs


def _check_stripe(stripe: int) -> int:
    if not isinstance(stripe, int) or not 1 <= stripe <= MAX_STRIPE:
        raise _err(ErrorCode.INVALID, f"stripe must be 1..{MAX_STRIPE}")
    return stripe


class Namespace:
    """POSIX-like namespace operations over a :class:`~metadata._store.Store`.

    Args:
        store: the backend; the namespace does not close it.
        default_chunk_size: chunk size for files whose directories set none.
        max_stripe: most chains one file is striped over, unless a directory says.
    """

    def __init__(self, store: Store, *, default_chunk_size: int = 4 * 1024 * 1024,
                 max_stripe: int = 16) -> None:
        self._store = store
        self._dirs: dict[tuple[int, str], DirEntry] | None = None  # see reading(remember_dirs=True)
        self.default_chunk_size = _check_chunk_size(default_chunk_size)
        self.max_stripe = _check_stripe(max_stripe)
        with store.transaction() as txn:
            if txn.get_meta("next_ino") is None:
                txn.put_meta("next_ino", str(ROOT_INO + 1))
            if txn.get_inode(ROOT_INO) is None:
                now = time.time_ns()
                txn.put_inode(Attr(ROOT_INO, stat.S_IFDIR | 0o755, 2, 0, 0, 0, now, now, now))
                txn.put_dir(DirRow(ROOT_INO, ROOT_INO))

    # ------------------------------------------------------------------ helpers

    def _inode(self, txn: Txn, ino: int) -> Attr:
        attr = txn.get_inode(ino)
        if attr is None:
            raise _err(ErrorCode.NOT_FOUND, f"no inode {ino}")
        return attr

    def _dir(self, txn: Txn, ino: int) -> Attr:
        attr = self._inode(txn, ino)
        if not attr.is_dir:
            raise _err(ErrorCode.NOT_DIR, f"inode {ino} is not a directory")
        return attr

    def _entry(self, txn: Txn, parent: int, name: str) -> DirEntry:
        entry = txn.get_dentry(parent, name)
        if entry is None:
            raise _err(ErrorCode.NOT_FOUND, f"no such file or directory: {name!r}")
        return entry

    @staticmethod
    def _counter(txn: Txn, key: str) -> int:
        return txn.allocate(key)

    def _touch_dir(self, txn: Txn, ino: int, now: int, nlink_delta: int = 0, *, dir_attr: Attr | None = None) -> None:
        """A directory's entries changed: bump mtime/ctime (and nlink for subdirs).
        ``dir_attr``: the directory's attributes as this transaction read them, if it did."""
        d = dir_attr if dir_attr is not None else self._inode(txn, ino)
        txn.put_inode(_with(d, nlink=d.nlink + nlink_delta, mtime_ns=now, ctime_ns=now))

    def _queue(self, txn: Txn, kind: str, attr: Attr, length: int) -> None:
        if attr.layout is not None:  # symlinks and dirs hold no chunks
            txn.put_garbage(GarbageItem(self._counter(txn, "next_garbage"), kind, attr.ino, length, attr.layout))

    def _drop_link(self, txn: Txn, attr: Attr, now: int) -> Attr:
        """One name of a non-directory went away: nlink--, and at 0 the inode goes."""
        attr = _with(attr, nlink=attr.nlink - 1, ctime_ns=now)
        if attr.nlink > 0:
            txn.put_inode(attr)
        else:
            txn.delete_inode(attr.ino)
            self._queue(txn, "remove", attr, 0)
        return attr

    def _drop_dir(self, txn: Txn, attr: Attr) -> None:
        txn.delete_inode(attr.ino)
        txn.delete_dir(attr.ino)

    def _new_inode(self, txn: Txn, parent: int, name: str, mode: int, uid: int, gid: int, *,
                   nlink: int = 1, size: int = 0, layout: Layout | None = None,
                   target: str | None = None, rdev: int = 0) -> Attr:
        now = time.time_ns()
        attr = Attr(self._counter(txn, "next_ino"), mode, nlink, uid, gid, size, now, now, now, layout, target, rdev)
        txn.put_inode(attr)
        txn.put_dentry(parent, DirEntry(name, attr.ino, mode))
        return attr

    def _new_parent_checked(self, txn: Txn, parent: int, name: str) -> None:
        validate_name(name)
        txn.expect(parent, name)
        self._dir(txn, parent)
        if txn.get_dentry(parent, name) is not None:
            raise _err(ErrorCode.EXISTS, f"file exists: {name!r}")

    def _inside(self, txn: Txn, ino: int, ancestor: int) -> bool:
        """Is directory ``ino`` the directory ``ancestor`` or below it?"""
        while True:
            if ino == ancestor:
                return True
            if ino == ROOT_INO:
                return False
            ino = self._dirrow(txn, ino).parent

    # ------------------------------------------------------------------ lookups

    @property
    def store(self) -> Store:
        return self._store

    def reading(self, store: Store, *, remember_dirs: bool = False) -> "Namespace":
        """The same namespace over ``store`` (e.g. ``self.store.reader()``), for read
        operations only: ``getattr``, ``lookup``, ``resolve``, ``readdir``, ``readlink``,
        the xattr reads, ``get_layout``, ``garbage``, ``counts``.

        ``remember_dirs``: path walks remember the directory entries they meet (up to
        ``DIRS_KEPT``; a stat of ``/a/b/f`` then reads one entry, not three). For a
        caller that calls :meth:`forget_dirs` whenever a directory may have been
        renamed or removed (only those change what a directory's name leads to), once
        that change committed and before anyone hears of it.
        """
        other = copy.copy(self)
        other._store = store
        other._dirs = {} if remember_dirs else None
        return other

    def forget_dirs(self) -> None:
        """Drop the directory entries :meth:`reading` (or :meth:`remember_dirs`) remembers."""
        if self._dirs is not None:
            self._dirs.clear()

    def remember_dirs(self) -> None:
        """From now on this namespace's path walks, those of writes included, remember the
        directory entries they meet (as :meth:`reading` with ``remember_dirs``); its own
        renames and rmdirs forget them. For the one owner of the store's writes, which also
        calls :meth:`forget_dirs` whenever a batch of its transactions is rolled back as a
        whole (a directory renamed and walked through in it would be remembered under
        its new name)."""
        if self._dirs is None:
            self._dirs = {}

    def getattr(self, ino: int, keys: list[object] | None = None) -> Attr:
        """The attributes of inode ``ino``; ``keys`` as :meth:`resolve`'s (the inode)."""
        with self._store.transaction() as txn:
            attr = self._inode(txn, ino)
        if keys is not None:
            keys.append(ino)
        return attr

    def lookup(self, parent: int, name: str, keys: list[object] | None = None) -> Attr:
        """The attributes of ``name`` in directory ``parent``; ``keys`` as :meth:`resolve`'s
        (the entry and the inode it names)."""
        validate_name(name)
        with self._store.transaction() as txn:
            self._dir(txn, parent)
            found = txn.lookup_entry(parent, name)  # the entry and its inode, in one read where the store can
            if found is None:
                raise _err(ErrorCode.NOT_FOUND, f"no such file or directory: {name!r}")
            entry, attr = found
            if attr is None:
                attr = self._inode(txn, entry.ino)  # its row is missing: the error ``_inode`` gives
        if keys is not None:
            keys.extend(((parent, name), attr.ino))
        return attr

    def resolve(self, path: str, follow: bool = True, keys: list[object] | None = None) -> Attr:
        """Walk an absolute path (a missing leading ``/`` is allowed) from the root.

        Args:
            path: like ``"/a/b"``; ``""`` and ``"/"`` are the root.
            follow: follow a symlink in the last component too. A trailing ``/``
                always follows, and demands a directory.
            keys: if given, what the answer depends on is appended to it: the inode
                numbers read (the answer, symlinks followed, directories ``..`` left)
                and a ``(parent, name)`` pair per directory entry followed. A store write
                of any of them may change the answer (see ``metadata._leasetable``).

        Raises:
            StripefsError: ENOENT, ENOTDIR (a non-directory in the middle),
                ELOOP (more than 40 symlinks), ENAMETOOLONG, EINVAL (NUL).
        """
        self._check_path(path)
        with self._store.transaction() as txn:
            return self._walk(txn, path, follow, keys)

    def _walk(self, txn: Txn, path: str, follow: bool, keys: list[object] | None = None) -> Attr:
        # "/f/" and "/f/." name a directory: a non-directory there is ENOTDIR.
        parts = path.split("/")
        must_be_dir = any(parts) and parts[-1] in ("", ".", "..")
        todo = [c for c in parts if c not in ("", ".")][::-1]  # a stack: last pops first
        # The way down goes by entries alone (an entry holds its inode's type bits): only
        # the inode the path ends at, and symlinks to follow, are read.
        ino, is_dir = ROOT_INO, True
        links = 0
        # The last name's entry is read with its inode, in one statement where the store can
        # (``Txn.lookup_entry``): ``cur`` is then the inode the walk ends at, read in this
        # same transaction (None: read it at the end, as before).
        cur: Attr | None = None
        dirs = self._dirs
        while todo:
            comp = todo.pop()
            if not is_dir:
                raise _err(ErrorCode.NOT_DIR, f"not a directory on the way to {comp!r}")
            cur = None
            if comp == "..":
                if keys is not None:
                    keys.append(ino)  # its parent is in its directory row (written with its inode key)
                row = txn.get_dir(ino)
                ino = row.parent if row else ROOT_INO
                continue
            entry = dirs.get((ino, comp)) if dirs is not None else None
            if entry is None:  # (a remembered name was checked when it was remembered)
                validate_name(comp)
                if todo:
                    entry = self._entry(txn, ino, comp)
                else:
                    found = txn.lookup_entry(ino, comp)
                    if found is None:
                        raise _err(ErrorCode.NOT_FOUND, f"no such file or directory: {comp!r}")
                    entry, cur = found
                if dirs is not None and stat.S_ISDIR(entry.mode):
                    if len(dirs) >= DIRS_KEPT:
                        dirs.clear()
                    dirs[(ino, comp)] = entry
            if keys is not None:
                keys.append((ino, comp))
            if stat.S_ISLNK(entry.mode) and (todo or follow or must_be_dir):
                links += 1
                if links > MAX_SYMLINKS:
                    raise _err(ErrorCode.LOOP, "too many levels of symbolic links")
                if keys is not None:
                    keys.append(entry.ino)
                target = (cur if cur is not None else self._inode(txn, entry.ino)).target or ""
                cur = None
                todo.extend(c for c in reversed(target.split("/")) if c not in ("", "."))
                if target.startswith("/"):
                    ino = ROOT_INO
                continue  # a relative target resolves from the link's directory, `ino`
            ino, is_dir = entry.ino, stat.S_ISDIR(entry.mode)
        if cur is None:
            cur = self._inode(txn, ino)
        if keys is not None:
            keys.append(ino)
        if must_be_dir and not cur.is_dir:
            raise _err(ErrorCode.NOT_DIR, f"not a directory: {path!r}")
        return cur

    def resolve_many(self, paths: list[str], follow: bool = True,
                     keys: list[list[object]] | None = None) -> list[Attr | StripefsError]:
        """:meth:`resolve` of each path, in one transaction (one snapshot). ``keys``: if
        given, one list per path is appended to it, as :meth:`resolve`'s ``keys``.

        Returns:
            Per path, its attributes or the error resolving it raised.

        Raises:
            StripefsError: EINVAL for more than ``MAX_STAT_MANY`` paths or a path that is not text.
        """
        if len(paths) > MAX_STAT_MANY:
            raise _err(ErrorCode.INVALID, f"at most {MAX_STAT_MANY} paths per request")
        if not all(isinstance(p, str) for p in paths):
            raise _err(ErrorCode.INVALID, "paths must be text")
        out: list[Attr | StripefsError] = []
        with self._store.transaction() as txn:
            for path in paths:
                walked: list[object] | None = [] if keys is not None else None
                try:
                    self._check_path(path)
                    out.append(self._walk(txn, path, follow, walked))
                except StripefsError as exc:
                    out.append(exc)
                if keys is not None:
                    keys.append(walked)  # type: ignore[arg-type]
        return out

    @staticmethod
    def _check_path(path: str) -> None:
        if "\x00" in path:
            raise _err(ErrorCode.INVALID, "path contains NUL")
        # (A character is at most 4 bytes of UTF-8: most paths need no encoding to know.)
        if len(path) * 4 > MAX_PATH and len(path.encode("utf-8", "surrogateescape")) > MAX_PATH:
            raise _err(ErrorCode.NAME_TOO_LONG, f"path longer than {MAX_PATH} bytes")

    def parent_of(self, path: str) -> tuple[int, str]:
        """The directory inode holding the last component of ``path``, and that name.

        Raises:
            StripefsError: EINVAL (the root, or a path ending in ``/``, ``.``, ``..``),
                ENOENT/ENOTDIR on the way, ENOTDIR if the head is not a directory.
        """
        head, name = self._split(path)
        parent = self.resolve(head)
        if not parent.is_dir:
            raise _err(ErrorCode.NOT_DIR, "parent is not a directory")
        return parent.ino, name

    def _split(self, path: str) -> tuple[str, str]:
        """``(directory path, last name)`` of ``path``, for the ``*_path`` operations."""
        head, _, name = path.rpartition("/")
        if name in ("", ".", ".."):
            raise _err(ErrorCode.INVALID, f"no file name at the end of {path!r}")
        return head or "/", name

    def _parent_dir(self, txn: Txn, path: str) -> tuple[Attr, str]:
        """The directory holding the last component of ``path``, and that name (see :meth:`parent_of`)."""
        head, name = self._split(path)
        self._check_path(path)
        parent = self._walk(txn, head, True)
        if not parent.is_dir:
            raise _err(ErrorCode.NOT_DIR, "parent is not a directory")
        validate_name(name)
        return parent, name

    def readlink(self, ino: int) -> str:
        with self._store.transaction() as txn:
            attr = self._inode(txn, ino)
        if not attr.is_symlink:
            raise _err(ErrorCode.INVALID, f"inode {ino} is not a symlink")
        return attr.target or ""

    def readdir(self, ino: int, after: str = "", limit: int = 1000,
                plus: bool = False, layouts: bool = True) -> tuple[list[DirEntry], bool]:
        """One page of a directory, in name (UTF-8 byte) order.

        Args:
            after: continue after this name (the last one of the previous page).
            limit: page size, capped at 10000.
            plus: also fill ``DirEntry.attr`` (and the full ``mode``).
            layouts: with ``plus``, files' attributes carry their layouts (False: None).

        Returns:
            ``(entries, more)``; ``more`` says a further page exists.
        """
        if limit < 1:
            raise _err(ErrorCode.INVALID, "readdir limit must be positive")
        limit = min(limit, MAX_READDIR)
        with self._store.transaction() as txn:
            self._dir(txn, ino)
            if not plus:
                rows = txn.list_dentries(ino, after, limit + 1)
                return rows[:limit], len(rows) > limit
            found = txn.list_dentries_plus(ino, after, limit + 1, layouts)  # entries and inodes in one query
        out = []
        for e, a in found[:limit]:
            if a is None:
                raise _err(ErrorCode.NOT_FOUND, f"no inode {e.ino}")
            out.append(e if e.attr is a else DirEntry(e.name, e.ino, a.mode, a))
        return out, len(found) > limit

    def readdir_page(self, ino: int, after: str = "", limit: int = 1000) -> tuple[list[DirEntry], bool]:
        """:meth:`readdir` with ``plus`` and layouts, its entries a ``wire.ListingPage``
        made from the store's columns where the store can (``Txn.list_plus_page``: no
        ``Attr`` or ``DirEntry`` per entry, the listing a client fetches whole to answer
        its lookups from), the same page otherwise."""
        if limit < 1:
            raise _err(ErrorCode.INVALID, "readdir limit must be positive")
        with self._store.transaction() as txn:
            self._dir(txn, ino)
            page = txn.list_plus_page(ino, after, min(limit, MAX_READDIR))
        if page is None:
            return self.readdir(ino, after, limit, True, True)
        return page  # type: ignore[return-value]

    def list_names(self, path: str, after: str = "", limit: int = 1000,
                   keys: list[object] | None = None) -> tuple[list[str], bool]:
        """One page of the names in the directory ``path`` resolves to, in name order.

        Args:
            after: continue after this name.
            limit: page size, capped at ``MAX_LIST_NAMES``.
            keys: as :meth:`resolve`'s, for the walk to the directory (a change to its
                entries writes its inode too: its times, and its link count for a subdirectory).

        Returns:
            ``(names, more)``.

        Raises:
            StripefsError: as :meth:`resolve`; ENOTDIR if it is not a directory.
        """
        if limit < 1:
            raise _err(ErrorCode.INVALID, "listing limit must be positive")
        limit = min(limit, MAX_LIST_NAMES)
        self._check_path(path)
        with self._store.transaction() as txn:
            d = self._walk(txn, path, True, keys)
            if not d.is_dir:
                raise _err(ErrorCode.NOT_DIR, f"not a directory: {path!r}")
            names = txn.list_names(d.ino, after, limit + 1)
        return names[:limit], len(names) > limit

    # ------------------------------------------------------------------ creation

    def _pick_layout(self, txn: Txn, parent: int, chains: list[int]) -> Layout:
        pool = sorted(set(chains))
        if not pool:
            raise _err(ErrorCode.UNAVAILABLE, "no storage servers")
        row = txn.get_dir(parent)
        chunk = (row.chunk_size if row else None) or self.default_chunk_size
        stripe = min((row.stripe if row else None) or self.max_stripe, len(pool))
        # Each file gets its own window of consecutive chains from a random start,
        # shuffled (3FS ChainAllocator): chunk 0 of every file lands somewhere else,
        # and since consecutive chains sit on different servers, a stripe of k
        # chains spreads over min(k, servers) servers.
        # The module's generator: seeded from the OS and again in a forked child.
        start = random.randrange(len(pool))
        window = [pool[(start + i) % len(pool)] for i in range(stripe)]
        random.shuffle(window)
        return Layout(chunk, tuple(window)).validate()

    def create(self, parent: int, name: str, mode: int, uid: int, gid: int, *, chains: list[int],
               exclusive: bool = False, truncate: bool = False) -> tuple[Attr, bool]:
        """Create a regular file, or open an existing one.

        Args:
            chains: the chain ids a new file may be striped over.
            exclusive: ``O_EXCL``: an existing name is EEXIST.
            truncate: ``O_TRUNC``: an existing file's size becomes 0.

        Returns:
            ``(attr, created)``.

        Raises:
            StripefsError: EEXIST, EISDIR, ENOENT/ENOTDIR (parent),
                UNAVAILABLE (no chains to place a new file on).
        """
        validate_name(name)
        with self._store.transaction() as txn:
            txn.expect(parent, name)
            return self._create(txn, self._dir(txn, parent), name, mode, uid, gid, chains, exclusive, truncate)

    def create_path(self, path: str, mode: int, uid: int, gid: int, *, chains: list[int],
                    exclusive: bool = False, truncate: bool = False) -> tuple[Attr, bool]:
        """:meth:`create` of the last component of ``path`` in the directory the rest
        resolves to (symlinks followed), in one transaction.

        Raises:
            StripefsError: as :meth:`parent_of` and :meth:`create`.
        """
        with self._store.transaction() as txn:
            parent, name = self._parent_dir(txn, path)
            return self._create(txn, parent, name, mode, uid, gid, chains, exclusive, truncate)

    def _create(self, txn: Txn, parent: Attr, name: str, mode: int, uid: int, gid: int, chains: list[int],
                exclusive: bool, truncate: bool) -> tuple[Attr, bool]:
        entry = txn.get_dentry(parent.ino, name)
        if entry is not None:
            return self._open_existing(txn, entry, exclusive, truncate), False
        layout = self._pick_layout(txn, parent.ino, chains)
        attr = self._new_inode(txn, parent.ino, name, stat.S_IFREG | (mode & 0o7777), uid, gid, layout=layout)
        self._touch_dir(txn, parent.ino, attr.ctime_ns, dir_attr=parent)
        return attr, True

    def create_many(self, paths: list[str], mode: int, uid: int, gid: int, *, chains: list[int],
                    exclusive: bool = True) -> list[Attr | StripefsError]:
        """:meth:`create_path` of each path (empty files, never truncated), in one transaction.

        Each path has the single create's semantics and fails alone (a failing path
        writes nothing); a file made earlier in the batch exists for the later paths.
        Each parent that gained a file has its mtime/ctime stamped once, with the time
        of its last creation.

        Returns:
            Per path, the file's attributes (an existing one's when not ``exclusive``)
            or the error creating it raised.

        Raises:
            StripefsError: EINVAL for more than ``MAX_CREATE_MANY`` paths or a path that is not text.
        """
        def one(txn: Txn, heads: _Heads, path: str) -> Attr:
            parent, name = heads.parent(path)
            entry = txn.get_dentry(parent.ino, name)
            if entry is not None:
                return self._open_existing(txn, entry, exclusive, False)
            layout = self._pick_layout(txn, parent.ino, chains)
            attr = self._new_inode(txn, parent.ino, name, stat.S_IFREG | (mode & 0o7777), uid, gid, layout=layout)
            heads.changed(parent, attr.ctime_ns)
            return attr

        return self._each_path(paths, one)

    def reserve_files(self, parent: str | int, count: int, *, chains: list[int]) -> list[GarbageItem]:
        """Reserve ``count`` inode numbers for whole files a client writes before they exist,
        each with the layout a new file in directory ``parent`` (a path, or an inode) would get.

        A reservation is a ``reserved`` garbage item: the file's commit clears it
        (:meth:`commit_files`); a client that dies first leaves it to the collector,
        which drops whatever chunks it wrote and tombstones the number after
        ``RESERVE_GRACE`` (a late write then fails STALE, a late commit ESTALE).

        Raises:
            StripefsError: EINVAL (count outside 1..``MAX_CREATE_MANY``); ENOENT/ENOTDIR
                (parent); UNAVAILABLE (no chains).
        """
        if not 1 <= count <= MAX_CREATE_MANY:
            raise _err(ErrorCode.INVALID, f"reserve 1..{MAX_CREATE_MANY} files at a time, not {count}")
        with self._store.transaction() as txn:
            directory = self._dir(txn, parent) if isinstance(parent, int) else self._walk(txn, parent, True)
            if not directory.is_dir:
                raise _err(ErrorCode.NOT_DIR, f"{parent!r} is not a directory")
            out = []
            for _ in range(count):
                item = GarbageItem(self._counter(txn, "next_garbage"), "reserved", self._counter(txn, "next_ino"), 0,
                                   self._pick_layout(txn, directory.ino, chains))
                txn.put_garbage(item)
                out.append(item)
            return out

    def commit_files(self, paths: list[str], inos: list[int], ids: list[int], lengths: list[int], mode: int,
                     uid: int, gid: int, *, mtime_ns: int = 0, exclusive: bool = False,
                     parent_ino: int = 0) -> list[Attr | StripefsError]:
        """Make whole files from reservations (:meth:`reserve_files`), in one transaction:
        ``paths[i]`` becomes the regular file ``inos[i]``, ``lengths[i]`` bytes long, with
        the reservation's layout (``parent_ino``, not 0: ``paths[i]`` is a name in that
        directory). The caller wrote those bytes, durably, before: the length
        covers nothing that is not on the storage servers.

        A name that exists is never replaced: EEXIST (EISDIR for a directory unless
        ``exclusive``); the client writes an existing file in place instead, so that no
        cache mapping the name to its inode goes stale. Each path fails alone: ESTALE
        when its reservation is gone (expired and collected: its chunks went with it),
        ENOENT/ENOTDIR for the parent, EINVAL/EFBIG for a bad length; a failed path's
        reservation stays, to expire.

        Raises:
            StripefsError: EINVAL for a batch over ``MAX_CREATE_MANY`` or lists of unequal lengths.
        """
        if not len(paths) == len(inos) == len(ids) == len(lengths):
            raise _err(ErrorCode.INVALID, "paths, inos, ids and lengths must have one entry per file")
        todo = iter(zip(inos, ids, lengths))

        def one(txn: Txn, heads: _Heads, path: str) -> Attr:
            ino, rid, length = next(todo)
            parent, name = heads.parent_of(parent_ino, path) if parent_ino else heads.parent(path)
            if not 0 <= length <= MAX_FILE_SIZE:
                raise _err(ErrorCode.FILE_TOO_BIG if length > 0 else ErrorCode.INVALID, f"bad length {length}")
            item = txn.get_garbage(rid)
            if item is None or item.kind != "reserved" or item.ino != ino:
                raise _err(ErrorCode.STALE_FILE, f"reservation {rid} of inode {ino} is gone (expired): write again")
            now = time.time_ns()
            entry = txn.get_dentry(parent.ino, name)
            if entry is not None:
                # Never replaced here: a new inode under an old name would strand every cache
                # that maps the name to the old one (a mount's dentries). The client writes an
                # existing file in place instead (``open(path, "wb")``).
                if stat.S_ISDIR(entry.mode) and not exclusive:
                    raise _err(ErrorCode.IS_DIR, f"is a directory: {name!r}")
                raise _err(ErrorCode.EXISTS, f"file exists: {name!r}")
            file_mode = stat.S_IFREG | (mode & 0o7777)
            attr = Attr(ino, file_mode, 1, uid, gid, length, now, mtime_ns or now, now, item.layout)
            txn.put_inode(attr)
            txn.put_dentry(parent.ino, DirEntry(name, ino, file_mode))
            txn.delete_garbage(rid)
            heads.changed(parent, now)
            return attr

        return self._each_path(paths, one)

    def unlink_many(self, paths: list[str]) -> list[Attr | StripefsError]:
        """:meth:`unlink_path` of each path, in one transaction; each fails alone, parents
        are stamped once (see :meth:`create_many`).

        Returns:
            Per path, the attributes with the new link count (0: removal queued) or the error.

        Raises:
            StripefsError: EINVAL for more than ``MAX_CREATE_MANY`` paths or a path that is not text.
        """
        def one(txn: Txn, heads: _Heads, path: str) -> Attr:
            parent, name = heads.parent(path)
            attr = self._inode(txn, self._entry(txn, parent.ino, name).ino)
            if attr.is_dir:
                raise _err(ErrorCode.IS_DIR, f"is a directory: {name!r}")
            now = time.time_ns()
            txn.delete_dentry(parent.ino, name)
            if attr.is_symlink:
                heads.forget()  # a head resolved through it must not resolve again
            heads.changed(parent, now)
            return self._drop_link(txn, attr, now)

        return self._each_path(paths, one)

    def _each_path(self, paths: list[str], one: Callable[[Txn, _Heads, str], Attr]) -> list[Attr | StripefsError]:
        """``one(txn, heads, path)`` for each path of a checked batch in one transaction;
        a path's error is its result; parents are stamped once at the end."""
        self.check_batch(paths)
        out: list[Attr | StripefsError] = []
        with self._store.transaction() as txn:
            heads = _Heads(self, txn)
            for path in paths:
                try:
                    out.append(one(txn, heads, path))
                except StripefsError as exc:
                    out.append(exc)
            heads.stamp()
        return out

    @staticmethod
    def check_batch(paths: list[str]) -> None:
        """Refuse a batch of paths as a whole: more than ``MAX_CREATE_MANY``, or one not text.

        Raises:
            StripefsError: EINVAL.
        """
        if len(paths) > MAX_CREATE_MANY:
            raise _err(ErrorCode.INVALID, f"at most {MAX_CREATE_MANY} paths per request, got {len(paths)}")
        if not all(isinstance(p, str) for p in paths):
            raise _err(ErrorCode.INVALID, "paths must be text")

    def _open_existing(self, txn: Txn, entry: DirEntry, exclusive: bool, truncate: bool) -> Attr:
        attr = self._inode(txn, entry.ino)
        if exclusive or attr.is_symlink:
            raise _err(ErrorCode.EXISTS, f"file exists: {entry.name!r}")
        if attr.is_dir:
            raise _err(ErrorCode.IS_DIR, f"is a directory: {entry.name!r}")
        if truncate:
            # Queued even at size 0: servers may hold bytes of a length not yet committed.
            now = time.time_ns()
            attr = dataclasses.replace(attr, size=0, mtime_ns=now, ctime_ns=now, truncations=attr.truncations + 1)
            txn.put_inode(attr)
            self._queue(txn, "truncate", attr, 0)
        return attr

    def mkdir(self, parent: int, name: str, mode: int, uid: int, gid: int) -> Attr:
        """Make a directory; it inherits the parent's default layout."""
        with self._store.transaction() as txn:
            self._new_parent_checked(txn, parent, name)
            attr = self._new_inode(txn, parent, name, stat.S_IFDIR | (mode & 0o7777), uid, gid, nlink=2)
            prow = txn.get_dir(parent)
            txn.put_dir(DirRow(attr.ino, parent, prow.chunk_size if prow else None, prow.stripe if prow else None))
            self._touch_dir(txn, parent, attr.ctime_ns, nlink_delta=1)
            return attr

    def symlink(self, parent: int, name: str, target: str, uid: int, gid: int) -> Attr:
        size = _symlink_size(target)
        with self._store.transaction() as txn:
            self._new_parent_checked(txn, parent, name)
            attr = self._new_inode(txn, parent, name, stat.S_IFLNK | 0o777, uid, gid, size=size, target=target)
            self._touch_dir(txn, parent, attr.ctime_ns)
            return attr

    def symlink_many(self, parent: int, names: list[str], targets: list[str], uid: int, gid: int, *,
                     replace: bool = False) -> list[Attr | StripefsError]:
        """:meth:`symlink` of each name in directory ``parent``, in one transaction; each
        fails alone. ``replace``: a name that is a symlink already gets the new one (the old
        inode goes in the same transaction: a reader resolves the old target or the new one).

        Raises:
            StripefsError: EINVAL for more than ``MAX_CREATE_MANY`` names, names and targets
                of unequal lengths or not text; ENOENT/ENOTDIR (parent).
        """
        self.check_batch(names)
        if len(names) != len(targets) or not all(isinstance(t, str) for t in targets):
            raise _err(ErrorCode.INVALID, "one text target per name")
        out: list[Attr | StripefsError] = []
        with self._store.transaction() as txn:
            self._dir(txn, parent)
            last = 0
            for name, target in zip(names, targets):
                try:
                    validate_name(name)
                    size = _symlink_size(target)
                    entry = txn.get_dentry(parent, name)
                    if entry is not None:
                        old = self._inode(txn, entry.ino)
                        if not (replace and old.is_symlink):
                            raise _err(ErrorCode.EXISTS, f"file exists: {name!r}")
                        txn.delete_dentry(parent, name)
                        self._drop_link(txn, old, time.time_ns())
                    attr = self._new_inode(txn, parent, name, stat.S_IFLNK | 0o777, uid, gid, size=size, target=target)
                    last = attr.ctime_ns
                    out.append(attr)
                except StripefsError as exc:
                    out.append(exc)
            if last:
                self._touch_dir(txn, parent, last)
        return out

    def mknod(self, parent: int, name: str, mode: int, rdev: int, uid: int, gid: int, *,
              chains: list[int]) -> Attr:
        """Make a FIFO, socket, character or block device node, or an empty regular file.

        The namespace stores the node (type, permission bits, owner, ``rdev`` for
        devices); what it does when opened is the kernel's business.

        Args:
            mode: type bits and permission bits (``S_IFIFO | 0o644``...).
            rdev: the device number; kept for ``S_IFCHR``/``S_IFBLK`` only.
            chains: where a regular file may be striped.

        Raises:
            StripefsError: EINVAL (a directory, symlink or unknown type: those have
                their own calls), EEXIST, ENOENT/ENOTDIR (parent).
        """
        kind = stat.S_IFMT(mode)
        if kind not in _NODE_TYPES:
            raise _err(ErrorCode.INVALID, f"mknod makes fifos, sockets, devices and regular files, not type {kind:o}")
        if not 0 <= rdev < 1 << 64:
            raise _err(ErrorCode.INVALID, "rdev out of range")
        with self._store.transaction() as txn:
            self._new_parent_checked(txn, parent, name)
            layout = self._pick_layout(txn, parent, chains) if kind == stat.S_IFREG else None
            attr = self._new_inode(txn, parent, name, kind | (mode & 0o7777), uid, gid, layout=layout,
                                   rdev=rdev if kind in (stat.S_IFCHR, stat.S_IFBLK) else 0)
            self._touch_dir(txn, parent, attr.ctime_ns)
            return attr

    def link(self, ino: int, new_parent: int, new_name: str) -> Attr:
        """Add a hard link. Directories cannot be linked (EPERM)."""
        with self._store.transaction() as txn:
            attr = self._inode(txn, ino)
            if attr.is_dir:
                raise _err(ErrorCode.PERMISSION, "hard links to directories are not allowed")
            self._new_parent_checked(txn, new_parent, new_name)
            now = time.time_ns()
            attr = dataclasses.replace(attr, nlink=attr.nlink + 1, ctime_ns=now)
            txn.put_inode(attr)
            txn.put_dentry(new_parent, DirEntry(new_name, ino, attr.mode))
            self._touch_dir(txn, new_parent, now)
            return attr

    # ------------------------------------------------------------------ removal

    def unlink(self, parent: int, name: str) -> Attr:
        """Remove a non-directory name. Returns the inode's attr with its new nlink
        (0: the inode is gone and a ``remove`` garbage item is queued)."""
        validate_name(name)
        with self._store.transaction() as txn:
            txn.expect(parent, name, target=True)
            return self._unlink(txn, self._dir(txn, parent), name)

    def unlink_path(self, path: str) -> Attr:
        """:meth:`unlink` of the last component of ``path`` (see :meth:`create_path`), in one transaction."""
        with self._store.transaction() as txn:
            parent, name = self._parent_dir(txn, path)
            return self._unlink(txn, parent, name)

    def _unlink(self, txn: Txn, parent: Attr, name: str) -> Attr:
        attr = self._inode(txn, self._entry(txn, parent.ino, name).ino)
        if attr.is_dir:
            raise _err(ErrorCode.IS_DIR, f"is a directory: {name!r}")
        now = time.time_ns()
        txn.delete_dentry(parent.ino, name)
        self._touch_dir(txn, parent.ino, now, dir_attr=parent)
        return self._drop_link(txn, attr, now)

    def rmdir(self, parent: int, name: str) -> None:
        validate_name(name)
        self.forget_dirs()  # committed or not, what a name leads to may change
        with self._store.transaction() as txn:
            txn.expect(parent, name, target=True)
            self._dir(txn, parent)
            attr = self._inode(txn, self._entry(txn, parent, name).ino)
            if not attr.is_dir:
                raise _err(ErrorCode.NOT_DIR, f"not a directory: {name!r}")
            if txn.list_dentries(attr.ino, "", 1):
                raise _err(ErrorCode.NOT_EMPTY, f"directory not empty: {name!r}")
            txn.delete_dentry(parent, name)
            self._drop_dir(txn, attr)
            self._touch_dir(txn, parent, time.time_ns(), nlink_delta=-1)

    # ------------------------------------------------------------------ rename

    def rename(self, parent: int, name: str, new_parent: int, new_name: str, flags: int = 0) -> None:
        """Atomically rename, with POSIX (``renameat2``) semantics.

        Raises:
            StripefsError: ENOENT, ENOTDIR, EISDIR, ENOTEMPTY, EEXIST (NOREPLACE),
                EINVAL (a directory into its own subtree, or bad flags).
        """
        if flags & ~(RENAME_NOREPLACE | RENAME_EXCHANGE) or flags == RENAME_NOREPLACE | RENAME_EXCHANGE:
            raise _err(ErrorCode.INVALID, f"bad rename flags {flags:#x}")
        self.forget_dirs()  # committed or not, what a name leads to may change
        validate_name(name)
        validate_name(new_name)
        with self._store.transaction() as txn:
            txn.expect(parent, name, target=True)
            txn.expect(new_parent, new_name, target=True)
            self._dir(txn, parent)
            self._dir(txn, new_parent)
            src = self._inode(txn, self._entry(txn, parent, name).ino)
            dentry = txn.get_dentry(new_parent, new_name)
            dst = self._inode(txn, dentry.ino) if dentry else None
            if flags & RENAME_NOREPLACE and dst is not None:
                raise _err(ErrorCode.EXISTS, f"file exists: {new_name!r}")
            if flags & RENAME_EXCHANGE:
                if dst is None:
                    raise _err(ErrorCode.NOT_FOUND, f"no such file or directory: {new_name!r}")
                self._exchange(txn, (parent, name, src), (new_parent, new_name, dst))
                return
            if dst is not None and dst.ino == src.ino:
                return  # both names are links to one inode: POSIX says do nothing
            if src.is_dir and self._inside(txn, new_parent, src.ino):
                raise _err(ErrorCode.INVALID, "cannot move a directory into itself")
            now = time.time_ns()
            if dst is not None:
                self._check_replace(txn, src, dst, new_name)
                if dst.is_dir:
                    self._drop_dir(txn, dst)
                    self._touch_dir(txn, new_parent, now, nlink_delta=-1)
                else:
                    self._drop_link(txn, dst, now)
            txn.delete_dentry(parent, name)
            txn.put_dentry(new_parent, DirEntry(new_name, src.ino, src.mode))
            txn.put_inode(dataclasses.replace(src, ctime_ns=now))
            moved_dir = src.is_dir and parent != new_parent
            if moved_dir:
                txn.put_dir(dataclasses.replace(self._dirrow(txn, src.ino), parent=new_parent))
            self._touch_dir(txn, parent, now, nlink_delta=-1 if moved_dir else 0)
            if new_parent != parent:
                self._touch_dir(txn, new_parent, now, nlink_delta=1 if moved_dir else 0)

    def _check_replace(self, txn: Txn, src: Attr, dst: Attr, new_name: str) -> None:
        if src.is_dir and not dst.is_dir:
            raise _err(ErrorCode.NOT_DIR, f"not a directory: {new_name!r}")
        if not src.is_dir and dst.is_dir:
            raise _err(ErrorCode.IS_DIR, f"is a directory: {new_name!r}")
        if dst.is_dir and txn.list_dentries(dst.ino, "", 1):
            raise _err(ErrorCode.NOT_EMPTY, f"directory not empty: {new_name!r}")

    def _dirrow(self, txn: Txn, ino: int) -> DirRow:
        row = txn.get_dir(ino)
        assert row is not None, f"directory {ino} has no dirs row"
        return row

    def _exchange(self, txn: Txn, a: tuple[int, str, Attr], b: tuple[int, str, Attr]) -> None:
        (pa, na, ia), (pb, nb, ib) = a, b
        if ia.ino == ib.ino:
            return
        if (ia.is_dir and self._inside(txn, pb, ia.ino)) or (ib.is_dir and self._inside(txn, pa, ib.ino)):
            raise _err(ErrorCode.INVALID, "cannot move a directory into itself")
        now = time.time_ns()
        txn.put_dentry(pa, DirEntry(na, ib.ino, ib.mode))
        txn.put_dentry(pb, DirEntry(nb, ia.ino, ia.mode))
        for attr, new_parent in ((ia, pb), (ib, pa)):
            txn.put_inode(dataclasses.replace(attr, ctime_ns=now))
            if attr.is_dir and pa != pb:
                txn.put_dir(dataclasses.replace(self._dirrow(txn, attr.ino), parent=new_parent))
        # A directory that changes parent moves one ".." link with it.
        shift = int(ia.is_dir) - int(ib.is_dir) if pa != pb else 0
        self._touch_dir(txn, pa, now, nlink_delta=-shift)
        if pb != pa:
            self._touch_dir(txn, pb, now, nlink_delta=shift)

    # ------------------------------------------------------------------ attributes

    def setattr(self, ino: int, *, mode: int | None = None, uid: int | None = None,
                gid: int | None = None, atime_ns: int | None = None, mtime_ns: int | None = None,
                size: int | None = None) -> Attr:
        """Change attributes; ``mode`` changes permission bits only (type bits stay).

        A size change sets the exact size (and mtime, unless given); shrinking
        queues a ``truncate`` garbage item so servers drop the bytes beyond. It
        stays queued until the cut was applied (:meth:`cut_done`, :meth:`cuts_applied`).

        Raises:
            StripefsError: ENOENT, EISDIR (size of a directory), EINVAL (size of a
                symlink, negative size), EFBIG (size over 1 PiB); CUT_PENDING (EIO) for
                a size that grows while a cut of the file is queued: the caller applies
                the cut first (``Collector.cut_pending``), nothing changed here.
        """
        with self._store.transaction() as txn:
            old = self._inode(txn, ino)
            now = time.time_ns()
            new = dataclasses.replace(old, ctime_ns=now)
            if mode is not None:
                new = dataclasses.replace(new, mode=stat.S_IFMT(old.mode) | (mode & 0o7777))
            if uid is not None:
                new = dataclasses.replace(new, uid=uid)
            if gid is not None:
                new = dataclasses.replace(new, gid=gid)
            if atime_ns is not None:
                new = dataclasses.replace(new, atime_ns=atime_ns)
            if size is not None:
                self._check_size(old, size)
                # The servers drop every byte past ``size`` (uncommitted ones too), even
                # when the size does not change: count it, so a writer's stale commit
                # cannot bring those bytes' range back (commit_length).
                new = dataclasses.replace(new, truncations=old.truncations + 1)
            if size is not None and size > old.size and old.layout is not None and txn.list_cuts(ino):
                raise _err(ErrorCode.CUT_PENDING, f"inode {ino} has a cut not applied on every storage server "
                           "yet: it cannot grow over the bytes the cut drops")
            if size is not None and size != old.size:
                new = dataclasses.replace(new, size=size, mtime_ns=now)
                if size < old.size:
                    self._queue(txn, "truncate", new, size)
            if mtime_ns is not None:
                new = dataclasses.replace(new, mtime_ns=mtime_ns)
            txn.put_inode(new)
            return new

    @staticmethod
    def _check_size(attr: Attr, size: int) -> None:
        if attr.is_dir:
            raise _err(ErrorCode.IS_DIR, f"inode {attr.ino} is a directory")
        if not attr.is_file or size < 0:
            raise _err(ErrorCode.INVALID, "size applies to regular files only, and is >= 0")
        if size > MAX_FILE_SIZE:
            raise _err(ErrorCode.FILE_TOO_BIG, f"size {size} over {MAX_FILE_SIZE}")

    def commit_length(self, ino: int, length: int, mtime_ns: int | None = None,
                      truncations: int | None = None) -> Attr:
        """Record a client's file length at close/fsync: ``size = max(size, length)``.

        The max makes concurrent and retried commits safe; shrinking is ``setattr``'s job.

        Args:
            ino: the file.
            length: the writer's length.
            mtime_ns: the modification time to record (default: now, when the size grows).
            truncations: ``Attr.truncations`` as the writer last saw it. If the file was
                truncated since, the servers dropped the writer's bytes past the new
                size: the size is not extended (it would show zeros as file data).

        Returns:
            The new attributes (the writer compares ``truncations`` to learn of a truncate).

        Raises:
            StripefsError: ENOENT, EINVAL (not a regular file), EFBIG; CUT_PENDING (EIO)
                when the size would grow while a cut of the file is queued, or when a cut
                was applied late (:meth:`cuts_applied`) since the writer's ``truncations``:
                its bytes past the cut may be gone, and no length may cover them.
        """
        with self._store.transaction() as txn:
            old = self._inode(txn, ino)
            self._check_size(old, length)
            if truncations is not None and truncations != old.truncations:
                late = txn.get_meta(_LATE_CUT + str(ino))
                if late is not None and truncations < int(late):
                    # A cut landed after the truncate that asked for it had been answered: the
                    # writer may have written past it before, and those bytes are gone.
                    raise _err(ErrorCode.CUT_PENDING, f"inode {ino} was cut after this writer's bytes "
                               "(a truncate that failed was applied late): they may be lost")
                length = min(length, old.size)
            if length > old.size and txn.list_cuts(ino):
                # The cut may land after these bytes were written and take some of them.
                raise _err(ErrorCode.CUT_PENDING, f"inode {ino} has a cut not applied on every storage "
                           "server yet: its length cannot grow until then")
            if length <= old.size and mtime_ns is None:
                return old
            now = time.time_ns()
            new = _with(old, size=max(old.size, length), ctime_ns=now,
                        mtime_ns=mtime_ns if mtime_ns is not None else now)
            txn.put_inode(new)
            return new

    # ------------------------------------------------------------------ extended attributes

    @staticmethod
    def _check_xattr_name(name: bytes) -> None:
        if not name or len(name) > MAX_XATTR_NAME or b"\x00" in name:
            raise _err(ErrorCode.RANGE if len(name) > MAX_XATTR_NAME else ErrorCode.INVALID,
                       f"extended attribute names are 1-{MAX_XATTR_NAME} bytes without NUL")
        if not name.startswith(XATTR_NAMESPACES) or name in XATTR_NAMESPACES:
            raise _err(ErrorCode.NOT_SUPPORTED, f"extended attribute namespace of {name!r} is not supported")

    def setxattr(self, ino: int, name: bytes, value: bytes, flags: int = 0) -> Attr:
        """Set an extended attribute (``XATTR_CREATE``/``XATTR_REPLACE`` in ``flags``).

        Caveats:
            ``user.*`` attributes belong to regular files and directories only (EPERM
            elsewhere, as Linux); the caller is trusted for ``trusted.*``/``security.*``.

        Raises:
            StripefsError: ENOENT; EEXIST (CREATE, present); ENODATA (REPLACE, absent);
                ERANGE (name over 255 bytes); E2BIG (value over 64 KiB); ENOSPC (the
                inode's attributes would pass 1 MiB); EOPNOTSUPP (unknown namespace).
        """
        self._check_xattr_name(name)
        if flags & ~(XATTR_CREATE | XATTR_REPLACE) or flags == XATTR_CREATE | XATTR_REPLACE:
            raise _err(ErrorCode.INVALID, f"bad setxattr flags {flags}")
        if len(value) > MAX_XATTR_VALUE:
            raise _err(ErrorCode.ARG_TOO_BIG, f"extended attribute values are at most {MAX_XATTR_VALUE} bytes")
        with self._store.transaction() as txn:
            attr = self._inode(txn, ino)
            if name.startswith(b"user.") and not (attr.is_file or attr.is_dir):
                raise _err(ErrorCode.PERMISSION, "user.* attributes are for regular files and directories")
            present = dict(txn.list_xattrs(ino))
            if flags & XATTR_CREATE and name in present:
                raise _err(ErrorCode.EXISTS, f"extended attribute {name!r} exists")
            if flags & XATTR_REPLACE and name not in present:
                raise _err(ErrorCode.NO_DATA, f"no extended attribute {name!r}")
            total = sum(len(n) + size for n, size in present.items() if n != name) + len(name) + len(value)
            if total > MAX_XATTR_TOTAL:
                raise _err(ErrorCode.NO_SPACE, f"extended attributes of inode {ino} would pass {MAX_XATTR_TOTAL} bytes")
            txn.put_xattr(ino, name, value)
            attr = dataclasses.replace(attr, ctime_ns=time.time_ns())
            txn.put_inode(attr)
            return attr

    def getxattr(self, ino: int, name: bytes) -> bytes:
        """The value of an extended attribute. Raises ENOENT, ENODATA."""
        self._check_xattr_name(name)
        with self._store.transaction() as txn:
            self._inode(txn, ino)
            value = txn.get_xattr(ino, name)
            if value is None:
                raise _err(ErrorCode.NO_DATA, f"no extended attribute {name!r}")
            return value

    def listxattr(self, ino: int) -> list[bytes]:
        """Names of the inode's extended attributes, sorted."""
        with self._store.transaction() as txn:
            self._inode(txn, ino)
            return [name for name, _ in txn.list_xattrs(ino)]

    def removexattr(self, ino: int, name: bytes) -> Attr:
        """Remove an extended attribute. Raises ENOENT, ENODATA."""
        self._check_xattr_name(name)
        with self._store.transaction() as txn:
            attr = self._inode(txn, ino)
            if txn.get_xattr(ino, name) is None:
                raise _err(ErrorCode.NO_DATA, f"no extended attribute {name!r}")
            txn.delete_xattr(ino, name)
            attr = dataclasses.replace(attr, ctime_ns=time.time_ns())
            txn.put_inode(attr)
            return attr

    # ------------------------------------------------------------------ layouts

    def set_layout(self, dir_ino: int, chunk_size: int | None = None, stripe: int | None = None) -> None:
        """Set a directory's default layout for new files and subdirectories.
        ``None`` leaves that field as it is."""
        if chunk_size is not None:
            _check_chunk_size(chunk_size)
        if stripe is not None:
            _check_stripe(stripe)
        with self._store.transaction() as txn:
            self._dir(txn, dir_ino)
            row = self._dirrow(txn, dir_ino)
            txn.put_dir(dataclasses.replace(row, chunk_size=chunk_size if chunk_size is not None else row.chunk_size,
                                            stripe=stripe if stripe is not None else row.stripe))

    def get_layout(self, dir_ino: int) -> dict[str, int]:
        """The effective defaults of a directory: ``{"chunk_size": ..., "stripe": ...}``
        (``stripe`` is the most; a file gets fewer when fewer chains exist)."""
        with self._store.transaction() as txn:
            self._dir(txn, dir_ino)
            row = self._dirrow(txn, dir_ino)
        return {"chunk_size": row.chunk_size or self.default_chunk_size, "stripe": row.stripe or self.max_stripe}

    # ------------------------------------------------------------------ garbage, status

    def garbage(self, limit: int = 100) -> list[GarbageItem]:
        """The oldest pending garbage items (they stay until ``garbage_done``)."""
        with self._store.transaction() as txn:
            return txn.list_garbage(max(1, min(limit, MAX_READDIR)))

    def garbage_done(self, id: int) -> None:
        """Acknowledge an item; an unknown id is fine (a retried acknowledgement)."""
        with self._store.transaction() as txn:
            txn.delete_garbage(id)

    def cuts(self, ino: int) -> tuple[Attr | None, list[GarbageItem]]:
        """The inode (None once removed) and its queued cuts, oldest first."""
        with self._store.transaction() as txn:
            return txn.get_inode(ino), txn.list_cuts(ino)

    def cut_done(self, ino: int, length: int, truncations: int) -> Attr | None:
        """The truncate that set ``truncations`` had its cut to ``length`` applied before
        it was answered: its queued cuts are cleared (those of earlier truncates that
        failed too, when they cut at ``length`` or beyond: this cut covers them).

        Nothing is cleared when another truncate committed since (``truncations``
        moved): its own cut clears them, or the collector does. Returns the inode
        (None once removed).
        """
        with self._store.transaction() as txn:
            attr = txn.get_inode(ino)
            if attr is not None and attr.truncations == truncations:
                for item in txn.list_cuts(ino):
                    if item.length >= length:
                        txn.delete_garbage(item.id)
            return attr

    def cuts_applied(self, ino: int, ids: list[int], cut: bool) -> None:
        """Clear cuts applied after their truncate was answered (``cut``), or found moot.

        A late cut may have dropped bytes a writer wrote after that truncate: the
        inode's ``truncations`` moves on, and every writer that last saw an earlier
        count is refused its next commit (:meth:`commit_length`), instead of
        committing a length over bytes that are gone.
        """
        with self._store.transaction() as txn:
            for item_id in ids:
                txn.delete_garbage(item_id)
            attr = txn.get_inode(ino) if cut else None
            if attr is not None:
                attr = dataclasses.replace(attr, truncations=attr.truncations + 1)
                txn.put_inode(attr)
                txn.put_meta(_LATE_CUT + str(ino), str(attr.truncations))

    def counts(self) -> dict[str, int]:
        with self._store.transaction() as txn:
            by_type = txn.count_inodes()
        return {
            "inodes": sum(n for n, _ in by_type.values()),
            "files": by_type.get(stat.S_IFREG, (0, 0))[0],
            "dirs": by_type.get(stat.S_IFDIR, (0, 0))[0],
            "bytes": by_type.get(stat.S_IFREG, (0, 0))[1],
        }


def _symlink_size(target: str) -> int:
    """A symlink's size (its target's bytes).

    Raises:
        StripefsError: EINVAL (empty, or a NUL), ENAMETOOLONG (over ``MAX_PATH`` bytes).
    """
    if not target or "\x00" in target:
        raise _err(ErrorCode.INVALID, "symlink target must be non-empty without NUL")
    size = len(target.encode("utf-8", "surrogateescape"))
    if size > MAX_PATH:
        raise _err(ErrorCode.NAME_TOO_LONG, f"symlink target longer than {MAX_PATH} bytes")
    return size


class _Heads:
    """The parent directories of one batch's paths inside its transaction: each head path
    walked once, and each parent that changed stamped once at the end.

    A head resolved to a directory stays valid while the batch only adds and removes
    non-directories, except through a symlink the batch removes (:meth:`forget`).
    """

    def __init__(self, ns: Namespace, txn: Txn):
        self._ns, self._txn = ns, txn
        self._dirs: dict[str | int, Attr] = {}  # head path (or directory inode) -> directory
        self._changed: dict[int, tuple[Attr, int]] = {}  # ino -> (attr as read, latest change)

    def parent(self, path: str) -> tuple[Attr, str]:
        """As ``Namespace._parent_dir``: the directory and the last name, validated."""
        ns = self._ns
        head, name = ns._split(path)
        ns._check_path(path)
        parent = self._dirs.get(head)
        if parent is None:
            parent = ns._walk(self._txn, head, True)
            if not parent.is_dir:
                raise _err(ErrorCode.NOT_DIR, "parent is not a directory")
            self._dirs[head] = parent
        validate_name(name)
        return parent, name

    def parent_of(self, ino: int, name: str) -> tuple[Attr, str]:
        """As :meth:`parent`, for ``name`` in the directory inode ``ino``."""
        parent = self._dirs.get(ino)
        if parent is None:
            parent = self._dirs[ino] = self._ns._dir(self._txn, ino)
        validate_name(name)
        return parent, name

    def forget(self) -> None:
        self._dirs.clear()

    def changed(self, parent: Attr, now: int) -> None:
        self._changed[parent.ino] = (parent, now)

    def stamp(self) -> None:
        for parent, now in self._changed.values():
            self._ns._touch_dir(self._txn, parent.ino, now, dir_attr=parent)
