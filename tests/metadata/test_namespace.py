"""Namespace operation tests, run against every store backend (3FS tests/meta/store/ops style)."""

from __future__ import annotations

import dataclasses
import errno
import sqlite3
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from stripefs.metadata import _namespace
from stripefs.metadata._namespace import RENAME_EXCHANGE, RENAME_NOREPLACE, ROOT_INO, Namespace
from stripefs.metadata._memstore import MemoryStore
from stripefs.metadata._sqlite import SqliteStore
from stripefs.metadata._store import Store
from stripefs.wire._errors import ErrorCode, StripefsError
from stripefs.wire._types import MAX_PATH, MIN_CHUNK

CHAINS = list(range(100, 108))
FILE = 0o644
DIR = 0o755


@pytest.fixture
def ns(store: Store) -> Namespace:
    return Namespace(store)


@contextmanager
def raises(code: int) -> Iterator[None]:
    with pytest.raises(StripefsError) as info:
        yield
    assert info.value.errno == code, f"expected {errno.errorcode[code]}, got {info.value!r}"


def mkfile(ns: Namespace, parent: int, name: str, **kw: Any):
    attr, created = ns.create(parent, name, FILE, 1000, 1000, chains=CHAINS, **kw)
    return attr


def names(ns: Namespace, ino: int = ROOT_INO) -> list[str]:
    entries, more = ns.readdir(ino, limit=10_000)
    assert not more
    return [e.name for e in entries]


# ----------------------------------------------------------------------------- basics

def test_root_exists(ns: Namespace) -> None:
    root = ns.getattr(ROOT_INO)
    assert root.mode == stat.S_IFDIR | 0o755 and root.nlink == 2 and (root.uid, root.gid) == (0, 0)
    assert ns.resolve("") == ns.resolve("/") == root


def test_getattr_missing(ns: Namespace) -> None:
    with raises(errno.ENOENT):
        ns.getattr(999)


@pytest.mark.parametrize("bad", ["", ".", "..", "a/b", "a\x00b"])
def test_bad_names(ns: Namespace, bad: str) -> None:
    for op in (lambda: ns.lookup(ROOT_INO, bad), lambda: ns.mkdir(ROOT_INO, bad, DIR, 0, 0),
               lambda: mkfile(ns, ROOT_INO, bad), lambda: ns.unlink(ROOT_INO, bad)):
        with raises(errno.EINVAL):
            op()


def test_long_name(ns: Namespace) -> None:
    mkfile(ns, ROOT_INO, "x" * 255)
    with raises(errno.ENAMETOOLONG):
        mkfile(ns, ROOT_INO, "x" * 256)
    with raises(errno.ENAMETOOLONG):
        ns.mkdir(ROOT_INO, "é" * 128, DIR, 0, 0)  # 256 bytes in UTF-8


def test_lookup_errors(ns: Namespace) -> None:
    f = mkfile(ns, ROOT_INO, "f")
    assert ns.lookup(ROOT_INO, "f") == f
    with raises(errno.ENOENT):
        ns.lookup(ROOT_INO, "nope")
    with raises(errno.ENOENT):
        ns.lookup(999, "f")
    with raises(errno.ENOTDIR):
        ns.lookup(f.ino, "x")


def test_mkdir(ns: Namespace) -> None:
    before = ns.getattr(ROOT_INO)
    d = ns.mkdir(ROOT_INO, "d", 0o40700, 5, 6)
    assert d.mode == stat.S_IFDIR | 0o700 and d.nlink == 2 and (d.uid, d.gid) == (5, 6)
    root = ns.getattr(ROOT_INO)
    assert root.nlink == 3 and root.mtime_ns >= before.mtime_ns and root.ctime_ns == root.mtime_ns
    with raises(errno.EEXIST):
        ns.mkdir(ROOT_INO, "d", DIR, 0, 0)
    f = mkfile(ns, ROOT_INO, "f")
    with raises(errno.ENOTDIR):
        ns.mkdir(f.ino, "x", DIR, 0, 0)
    with raises(errno.ENOENT):
        ns.mkdir(999, "x", DIR, 0, 0)


def test_inode_numbers_never_reused(ns: Namespace) -> None:
    a = mkfile(ns, ROOT_INO, "a")
    ns.unlink(ROOT_INO, "a")
    b = mkfile(ns, ROOT_INO, "a")
    assert b.ino > a.ino


# ----------------------------------------------------------------------------- create

def test_create_new_and_existing(ns: Namespace) -> None:
    attr, created = ns.create(ROOT_INO, "f", 0o40644, 7, 8, chains=CHAINS)
    assert created and attr.mode == stat.S_IFREG | 0o644 and attr.nlink == 1 and attr.size == 0
    again, created = ns.create(ROOT_INO, "f", FILE, 0, 0, chains=CHAINS)
    assert not created and again == attr
    with raises(errno.EEXIST):
        ns.create(ROOT_INO, "f", FILE, 0, 0, chains=CHAINS, exclusive=True)


def test_create_over_dir(ns: Namespace) -> None:
    ns.mkdir(ROOT_INO, "d", DIR, 0, 0)
    with raises(errno.EISDIR):
        mkfile(ns, ROOT_INO, "d")
    with raises(errno.EEXIST):
        mkfile(ns, ROOT_INO, "d", exclusive=True)


def test_create_without_chains(ns: Namespace) -> None:
    with pytest.raises(StripefsError) as info:
        ns.create(ROOT_INO, "f", FILE, 0, 0, chains=[])
    assert info.value.code == ErrorCode.UNAVAILABLE
    assert names(ns) == []
    # Opening an existing file needs no chains.
    mkfile(ns, ROOT_INO, "g")
    assert ns.create(ROOT_INO, "g", FILE, 0, 0, chains=[])[1] is False


def test_create_truncate_queues_garbage(ns: Namespace) -> None:
    f = mkfile(ns, ROOT_INO, "f")
    ns.commit_length(f.ino, 5000)
    attr, created = ns.create(ROOT_INO, "f", FILE, 0, 0, chains=CHAINS, truncate=True)
    assert not created and attr.size == 0 and ns.getattr(f.ino).size == 0
    [item] = ns.garbage()
    assert (item.kind, item.ino, item.length, item.layout) == ("truncate", f.ino, 0, f.layout)


# ----------------------------------------------------------------------------- layouts

def test_layout_stripe_capped_by_chains_and_max(store: Store) -> None:
    ns = Namespace(store, max_stripe=4, default_chunk_size=1 << 20)
    a = ns.create(ROOT_INO, "a", FILE, 0, 0, chains=CHAINS)[0].layout
    assert a is not None and a.chunk_size == 1 << 20 and a.stripe == 4
    assert set(a.chains) <= set(CHAINS) and len(set(a.chains)) == 4
    b = ns.create(ROOT_INO, "b", FILE, 0, 0, chains=[3, 1, 3])[0].layout
    assert b is not None and sorted(b.chains) == [1, 3]


def test_layout_shuffled_per_file(ns: Namespace) -> None:
    layouts = [mkfile(ns, ROOT_INO, f"f{i}").layout for i in range(20)]
    assert all(lay is not None and sorted(lay.chains) == CHAINS for lay in layouts)
    assert len({lay.chains for lay in layouts if lay}) > 1


def test_directory_layout_defaults(ns: Namespace) -> None:
    d = ns.mkdir(ROOT_INO, "d", DIR, 0, 0)
    assert ns.get_layout(d.ino) == {"chunk_size": 4 << 20, "stripe": 16}
    ns.set_layout(d.ino, chunk_size=1 << 20, stripe=2)
    ns.set_layout(d.ino, stripe=3)  # None leaves chunk_size alone
    assert ns.get_layout(d.ino) == {"chunk_size": 1 << 20, "stripe": 3}
    lay = mkfile(ns, d.ino, "f").layout
    assert lay is not None and lay.chunk_size == 1 << 20 and lay.stripe == 3
    sub = ns.mkdir(d.ino, "sub", DIR, 0, 0)
    assert ns.get_layout(sub.ino) == {"chunk_size": 1 << 20, "stripe": 3}
    assert ns.get_layout(ROOT_INO) == {"chunk_size": 4 << 20, "stripe": 16}


@pytest.mark.parametrize("kw", [{"chunk_size": 3 * MIN_CHUNK}, {"chunk_size": MIN_CHUNK // 2},
                                {"chunk_size": 1 << 30}, {"stripe": 0}, {"stripe": 257}])
def test_set_layout_invalid(ns: Namespace, kw: dict) -> None:
    with raises(errno.EINVAL):
        ns.set_layout(ROOT_INO, **kw)


def test_set_layout_on_file(ns: Namespace) -> None:
    f = mkfile(ns, ROOT_INO, "f")
    with raises(errno.ENOTDIR):
        ns.set_layout(f.ino, stripe=2)
    with raises(errno.ENOTDIR):
        ns.get_layout(f.ino)


# ----------------------------------------------------------------------------- symlinks, resolve

def test_symlink_and_readlink(ns: Namespace) -> None:
    s = ns.symlink(ROOT_INO, "s", "a/b", 1, 2)
    assert s.is_symlink and s.size == 3 and ns.readlink(s.ino) == "a/b"
    f = mkfile(ns, ROOT_INO, "f")
    with raises(errno.EINVAL):
        ns.readlink(f.ino)
    with raises(errno.EEXIST):
        ns.symlink(ROOT_INO, "s", "x", 0, 0)
    with raises(errno.EINVAL):
        ns.symlink(ROOT_INO, "t", "", 0, 0)


def test_resolve_paths(ns: Namespace) -> None:
    a = ns.mkdir(ROOT_INO, "a", DIR, 0, 0)
    b = ns.mkdir(a.ino, "b", DIR, 0, 0)
    f = mkfile(ns, b.ino, "f")
    assert ns.resolve("/a/b/f") == f
    assert ns.resolve("a/b/f") == f
    assert ns.resolve("/a/./b//f") == f
    assert ns.resolve("/a/b/../b/f") == f
    assert ns.resolve("/..").ino == ROOT_INO
    assert ns.resolve("/a/b/").ino == b.ino
    with raises(errno.ENOENT):
        ns.resolve("/a/x")
    with raises(errno.ENOTDIR):
        ns.resolve("/a/b/f/g")
    with raises(errno.ENOTDIR):
        ns.resolve("/a/b/f/")
    with raises(errno.EINVAL):
        ns.resolve("/a\x00")
    with raises(errno.ENAMETOOLONG):
        ns.resolve("/a" * (MAX_PATH // 2 + 1))
    with raises(errno.ENAMETOOLONG):
        ns.resolve("/" + "x" * 256)


@pytest.mark.parametrize("kind", [stat.S_IFIFO, stat.S_IFSOCK, stat.S_IFCHR, stat.S_IFBLK])
def test_special_files_are_stored_with_type_mode_owner_and_rdev(ns: Namespace, kind: int) -> None:
    dev = (8 << 8) | 1
    node = ns.mknod(ROOT_INO, "node", kind | 0o640, dev, 1000, 1001, chains=CHAINS)
    assert stat.S_IFMT(node.mode) == kind and stat.S_IMODE(node.mode) == 0o640
    assert (node.uid, node.gid, node.layout, node.size) == (1000, 1001, None, 0)
    assert node.rdev == (dev if kind in (stat.S_IFCHR, stat.S_IFBLK) else 0)
    assert ns.lookup(ROOT_INO, "node") == node
    entry = ns.readdir(ROOT_INO, plus=True)[0][0]
    assert stat.S_IFMT(entry.mode) == kind and entry.attr == node
    with raises(errno.EEXIST):
        ns.mknod(ROOT_INO, "node", kind | 0o640, 0, 0, 0, chains=CHAINS)
    with raises(errno.EEXIST):
        ns.mkdir(ROOT_INO, "node", DIR, 0, 0)
    with raises(errno.EINVAL):
        ns.setattr(node.ino, size=10)  # a node has no bytes of its own
    ns.link(node.ino, ROOT_INO, "hard")
    ns.rename(ROOT_INO, "hard", ROOT_INO, "moved")
    assert ns.setattr(node.ino, mode=0o600).mode == kind | 0o600  # type bits stay
    ns.unlink(ROOT_INO, "node")
    assert ns.unlink(ROOT_INO, "moved").nlink == 0
    assert names(ns) == [] and ns.garbage() == []  # nothing for the storage servers to remove


def test_mknod_regular_file_gets_a_layout_and_other_types_are_refused(ns: Namespace) -> None:
    f = ns.mknod(ROOT_INO, "f", stat.S_IFREG | 0o600, 123, 0, 0, chains=CHAINS)
    assert f.is_file and f.layout is not None and f.rdev == 0
    for bad in (stat.S_IFDIR | 0o755, stat.S_IFLNK | 0o777, 0o644):
        with raises(errno.EINVAL):
            ns.mknod(ROOT_INO, "x", bad, 0, 0, 0, chains=CHAINS)


def test_sqlite_store_gains_rdev_on_an_old_database(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    old = sqlite3.connect(path)
    old.executescript(
        "CREATE TABLE inodes (ino INTEGER PRIMARY KEY, ftype INTEGER NOT NULL, mode INTEGER NOT NULL,"
        " nlink INTEGER NOT NULL, uid INTEGER NOT NULL, gid INTEGER NOT NULL, size INTEGER NOT NULL,"
        " atime_ns INTEGER NOT NULL, mtime_ns INTEGER NOT NULL, ctime_ns INTEGER NOT NULL,"
        " chunk_size INTEGER, chains TEXT, target TEXT);"
        "INSERT INTO inodes VALUES (7, 32768, 33188, 1, 0, 0, 5, 1, 2, 3, 65536, '1,2', NULL);")
    old.commit()
    old.close()
    with SqliteStore(path) as store, store.transaction() as txn:
        attr = txn.get_inode(7)
        assert attr is not None and (attr.size, attr.rdev) == (5, 0)


def test_xattrs_set_get_list_remove_with_flags_and_limits(ns: Namespace) -> None:
    f = mkfile(ns, ROOT_INO, "f")
    before = ns.getattr(f.ino).ctime_ns
    assert ns.setxattr(f.ino, b"user.a", b"1").ctime_ns >= before
    ns.setxattr(f.ino, b"trusted.t", b"\x00binary\xff")
    assert ns.getxattr(f.ino, b"user.a") == b"1" and ns.getxattr(f.ino, b"trusted.t") == b"\x00binary\xff"
    assert ns.listxattr(f.ino) == [b"trusted.t", b"user.a"]
    with raises(errno.EEXIST):
        ns.setxattr(f.ino, b"user.a", b"2", _namespace.XATTR_CREATE)
    with raises(errno.ENODATA):
        ns.setxattr(f.ino, b"user.b", b"2", _namespace.XATTR_REPLACE)
    ns.setxattr(f.ino, b"user.a", b"22", _namespace.XATTR_REPLACE)
    assert ns.getxattr(f.ino, b"user.a") == b"22"
    ns.removexattr(f.ino, b"user.a")
    with raises(errno.ENODATA):
        ns.getxattr(f.ino, b"user.a")
    with raises(errno.ENODATA):
        ns.removexattr(f.ino, b"user.a")
    with raises(errno.ERANGE):
        ns.setxattr(f.ino, b"user." + b"n" * 251, b"")
    with raises(errno.E2BIG):
        ns.setxattr(f.ino, b"user.big", b"v" * (64 * 1024 + 1))
    with raises(errno.EOPNOTSUPP):
        ns.setxattr(f.ino, b"system.posix_acl_access", b"")
    with raises(errno.EOPNOTSUPP):
        ns.setxattr(f.ino, b"nonamespace", b"")
    for i in range(15):
        ns.setxattr(f.ino, f"user.k{i}".encode(), b"v" * (64 * 1024))
    with raises(errno.ENOSPC):  # 1 MiB per inode
        ns.setxattr(f.ino, b"user.k15", b"v" * (64 * 1024))
    link = ns.symlink(ROOT_INO, "l", "f", 0, 0)
    with raises(errno.EPERM):
        ns.setxattr(link.ino, b"user.a", b"1")
    ns.setxattr(link.ino, b"trusted.a", b"1")


def test_xattrs_go_with_their_inode(ns: Namespace, store: Store) -> None:
    f = mkfile(ns, ROOT_INO, "f")
    ns.setxattr(f.ino, b"user.a", b"1")
    ns.link(f.ino, ROOT_INO, "g")
    ns.unlink(ROOT_INO, "f")
    assert ns.getxattr(f.ino, b"user.a") == b"1"  # still linked as g
    ns.unlink(ROOT_INO, "g")
    with store.transaction() as txn:
        assert txn.list_xattrs(f.ino) == []


def test_resolve_symlinks(ns: Namespace) -> None:
    a = ns.mkdir(ROOT_INO, "a", DIR, 0, 0)
    b = ns.mkdir(a.ino, "b", DIR, 0, 0)
    f = mkfile(ns, b.ino, "f")
    rel = ns.symlink(a.ino, "rel", "b/f", 0, 0)
    ns.symlink(a.ino, "up", "../a/b", 0, 0)
    ns.symlink(ROOT_INO, "abs", "/a/b", 0, 0)
    assert ns.resolve("/a/rel") == f
    assert ns.resolve("/a/rel", follow=False) == rel
    assert ns.resolve("/a/up/f", follow=False) == f  # intermediate links always followed
    assert ns.resolve("/abs/f") == f
    assert ns.resolve("/abs/../b/f") == f  # ".." is physical: the parent of /a/b
    assert ns.resolve("/abs/", follow=False).ino == b.ino


def test_resolve_loops(ns: Namespace) -> None:
    ns.symlink(ROOT_INO, "x", "y", 0, 0)
    ns.symlink(ROOT_INO, "y", "/x", 0, 0)
    ns.symlink(ROOT_INO, "self", "self", 0, 0)
    for path in ("/x", "/self", "/x/z"):
        with raises(errno.ELOOP):
            ns.resolve(path)
    assert ns.resolve("/x", follow=False).is_symlink


def test_resolve_forty_links(ns: Namespace) -> None:
    f = mkfile(ns, ROOT_INO, "l0")
    for i in range(1, 42):
        ns.symlink(ROOT_INO, f"l{i}", f"l{i - 1}", 0, 0)
    assert ns.resolve("/l40") == f
    with raises(errno.ELOOP):
        ns.resolve("/l41")


# ----------------------------------------------------------------------------- link, unlink, rmdir

def test_hard_links(ns: Namespace) -> None:
    d = ns.mkdir(ROOT_INO, "d", DIR, 0, 0)
    f = mkfile(ns, ROOT_INO, "f")
    linked = ns.link(f.ino, d.ino, "g")
    assert linked.ino == f.ino and linked.nlink == 2
    assert ns.lookup(d.ino, "g") == ns.lookup(ROOT_INO, "f") == ns.getattr(f.ino)
    with raises(errno.EEXIST):
        ns.link(f.ino, d.ino, "g")
    with raises(errno.EPERM):
        ns.link(d.ino, ROOT_INO, "d2")
    with raises(errno.ENOENT):
        ns.link(999, ROOT_INO, "z")
    assert ns.unlink(ROOT_INO, "f").nlink == 1
    assert ns.garbage() == [] and ns.getattr(f.ino).nlink == 1
    assert ns.unlink(d.ino, "g").nlink == 0
    with raises(errno.ENOENT):
        ns.getattr(f.ino)
    [item] = ns.garbage()
    assert (item.kind, item.ino, item.layout) == ("remove", f.ino, f.layout)


def test_unlink(ns: Namespace) -> None:
    d = ns.mkdir(ROOT_INO, "d", DIR, 0, 0)
    f = mkfile(ns, ROOT_INO, "f")
    ns.symlink(ROOT_INO, "s", "f", 0, 0)
    with raises(errno.EISDIR):
        ns.unlink(ROOT_INO, "d")
    with raises(errno.ENOENT):
        ns.unlink(ROOT_INO, "nope")
    with raises(errno.ENOTDIR):
        ns.unlink(f.ino, "x")
    before = ns.getattr(ROOT_INO)
    ns.unlink(ROOT_INO, "s")
    assert ns.garbage() == []  # a symlink holds no chunks
    ns.unlink(ROOT_INO, "f")
    assert names(ns) == ["d"] and ns.getattr(ROOT_INO).mtime_ns >= before.mtime_ns
    assert [g.ino for g in ns.garbage()] == [f.ino]
    assert d.ino


def test_create_path_and_unlink_path_resolve_in_the_same_transaction(ns: Namespace) -> None:
    a = ns.mkdir(ROOT_INO, "a", DIR, 0, 0)
    b = ns.mkdir(a.ino, "b", DIR, 0, 0)
    ns.symlink(ROOT_INO, "l", "a/b", 0, 0)
    before = ns.getattr(b.ino)
    attr, created = ns.create_path("/l/f", FILE, 7, 8, chains=CHAINS)
    assert created and ns.lookup(b.ino, "f") == attr and attr.uid == 7 and attr.layout is not None
    assert ns.getattr(b.ino).mtime_ns >= before.mtime_ns and ns.getattr(b.ino).nlink == before.nlink
    again, created = ns.create_path("/a/b/f", FILE, 0, 0, chains=CHAINS)
    assert not created and again.ino == attr.ino
    with raises(errno.EEXIST):
        ns.create_path("/a/b/f", FILE, 0, 0, chains=CHAINS, exclusive=True)
    with raises(errno.EISDIR):
        ns.create_path("/a/b", FILE, 0, 0, chains=CHAINS)
    for bad, code in (("/", errno.EINVAL), ("/a/", errno.EINVAL), ("/a/..", errno.EINVAL),
                      ("/nope/f", errno.ENOENT), ("/a/b/f/x", errno.ENOTDIR), ("/a/b/f/", errno.EINVAL)):
        with raises(code):
            ns.create_path(bad, FILE, 0, 0, chains=CHAINS)
        with raises(code):
            ns.unlink_path(bad)
    assert names(ns, b.ino) == ["f"]
    with raises(errno.EISDIR):
        ns.unlink_path("/a/b")
    gone = ns.unlink_path("/l/f")
    assert gone.ino == attr.ino and gone.nlink == 0 and [g.ino for g in ns.garbage()] == [attr.ino]
    assert names(ns, b.ino) == []
    with raises(errno.ENOENT):
        ns.unlink_path("/a/b/f")


def test_walk_by_entries_matches_the_inodes(ns: Namespace) -> None:
    """Directories on the way are known by their entries' type bits: a file, a symlink
    and ".." in the middle of a path behave as when every inode was read."""
    a = ns.mkdir(ROOT_INO, "a", DIR, 0, 0)
    f = mkfile(ns, a.ino, "f")
    ns.symlink(a.ino, "tofile", "f", 0, 0)
    ns.symlink(a.ino, "toroot", "/", 0, 0)
    with raises(errno.ENOTDIR):
        ns.resolve("/a/f/x")
    with raises(errno.ENOTDIR):
        ns.resolve("/a/tofile/x")
    with raises(errno.ENOTDIR):
        ns.resolve("/a/f/")
    assert ns.resolve("/a/toroot/a/f") == f
    assert ns.resolve("/a/../a/./f") == f
    assert ns.resolve("/..") == ns.getattr(ROOT_INO)
    assert ns.resolve("/a/tofile") == f
    assert ns.resolve("/a/tofile", follow=False).ino != f.ino


def test_list_names_pages_like_readdir(ns: Namespace) -> None:
    d = ns.mkdir(ROOT_INO, "d", DIR, 0, 0)
    for n in ("b", "a", "\udcff", "c"):
        mkfile(ns, d.ino, n)
    first, more = ns.list_names("/d", "", 2)
    rest, more2 = ns.list_names("/d", first[-1], 10)
    assert more and not more2 and first + rest == [e.name for e in ns.readdir(d.ino)[0]]
    with raises(errno.ENOTDIR):
        ns.list_names("/d/a")


def test_rmdir(ns: Namespace) -> None:
    d = ns.mkdir(ROOT_INO, "d", DIR, 0, 0)
    mkfile(ns, d.ino, "f")
    with raises(errno.ENOTEMPTY):
        ns.rmdir(ROOT_INO, "d")
    with raises(errno.ENOTDIR):
        ns.rmdir(d.ino, "f")
    with raises(errno.ENOENT):
        ns.rmdir(ROOT_INO, "nope")
    ns.unlink(d.ino, "f")
    ns.rmdir(ROOT_INO, "d")
    assert names(ns) == [] and ns.getattr(ROOT_INO).nlink == 2
    with raises(errno.ENOENT):
        ns.getattr(d.ino)


def test_garbage_done(ns: Namespace) -> None:
    for i in range(3):
        mkfile(ns, ROOT_INO, f"f{i}")
        ns.unlink(ROOT_INO, f"f{i}")
    items = ns.garbage()
    assert [g.id for g in items] == sorted(g.id for g in items) and len(items) == 3
    assert len(ns.garbage(limit=2)) == 2
    ns.garbage_done(items[0].id)
    ns.garbage_done(items[0].id)  # a retried acknowledgement is fine
    assert ns.garbage() == items[1:]


# ----------------------------------------------------------------------------- readdir

def test_readdir_pagination(ns: Namespace) -> None:
    d = ns.mkdir(ROOT_INO, "d", DIR, 0, 0)
    want = sorted(f"e{i:05d}" for i in range(2500))
    for name in reversed(want):
        mkfile(ns, d.ino, name)
    got, after, pages = [], "", []
    while True:
        page, more = ns.readdir(d.ino, after=after, limit=1000)
        pages.append(len(page))
        got += [e.name for e in page]
        if not more:
            break
        after = page[-1].name
    assert pages == [1000, 1000, 500] and got == want


def test_readdir_plus_and_errors(ns: Namespace, monkeypatch: pytest.MonkeyPatch) -> None:
    f = mkfile(ns, ROOT_INO, "b")
    ns.mkdir(ROOT_INO, "a", DIR, 0, 0)
    ns.symlink(ROOT_INO, "c", "b", 0, 0)
    plain, more = ns.readdir(ROOT_INO)
    assert not more and [(e.name, stat.S_IFMT(e.mode), e.attr) for e in plain] == [
        ("a", stat.S_IFDIR, None), ("b", stat.S_IFREG, None), ("c", stat.S_IFLNK, None)]
    plus, _ = ns.readdir(ROOT_INO, plus=True)
    assert plus[1].attr == f and plus[1].mode == f.mode
    assert f.layout is not None
    bare, _ = ns.readdir(ROOT_INO, plus=True, layouts=False)  # what a FUSE daemon asks: no layouts
    assert bare[1].attr == dataclasses.replace(f, layout=None)
    assert [(e.name, e.attr) for e in bare[::2]] == [(e.name, e.attr) for e in plus[::2]]  # the dir, the symlink
    assert ns.readdir(ROOT_INO, after="a", limit=1) == ([plain[1]], True)
    with raises(errno.ENOTDIR):
        ns.readdir(f.ino)
    with raises(errno.EINVAL):
        ns.readdir(ROOT_INO, limit=0)
    monkeypatch.setattr(_namespace, "MAX_READDIR", 2)
    assert len(ns.readdir(ROOT_INO, limit=1000)[0]) == 2


def test_a_listing_page_by_columns_is_the_plus_page(ns: Namespace) -> None:
    """``readdir_page`` (a store's rows made into columns, no objects per entry) gives the
    entries ``readdir(plus=True)`` gives, and the same wire form: files with layouts, a
    directory, a symlink, a device, names in byte order, pages and their ``more``."""
    from stripefs.wire._types import ListingPage, dir_columns

    for name in ("b", "é", "\udcff", "a1"):
        mkfile(ns, ROOT_INO, name)
    ns.mkdir(ROOT_INO, "a", DIR, 0, 0)
    ns.symlink(ROOT_INO, "c", "b", 0, 0)
    ns.mknod(ROOT_INO, "dev", stat.S_IFCHR | 0o600, 7, 0, 0, chains=CHAINS)
    for after, limit in (("", 100), ("", 3), ("a1", 2), ("\udcff", 5)):
        plus, more = ns.readdir(ROOT_INO, after=after, limit=limit, plus=True)
        page, page_more = ns.readdir_page(ROOT_INO, after=after, limit=limit)
        assert list(page) == plus and page_more == more
        # the SQL stores make it from their rows; the in-memory one lists entry by entry
        assert isinstance(page, ListingPage) or isinstance(ns._store, MemoryStore)
        assert (page.wire if isinstance(page, ListingPage) else dir_columns(page)) == dir_columns(plus)
    with raises(errno.ENOTDIR):
        ns.readdir_page(mkfile(ns, ROOT_INO, "f").ino)
    with raises(errno.EINVAL):
        ns.readdir_page(ROOT_INO, limit=0)


def test_readdir_byte_order(ns: Namespace) -> None:
    for name in ["é", "z", "Z", "a", "\udcff"]:  # a surrogate-escaped byte sorts last
        mkfile(ns, ROOT_INO, name)
    assert names(ns) == ["Z", "a", "z", "é", "\udcff"]


# ----------------------------------------------------------------------------- rename

@pytest.fixture
def tree(ns: Namespace) -> dict[str, int]:
    """/a/{f, sub/}, /b/{g, empty/}, /h -- returns name -> ino."""
    a = ns.mkdir(ROOT_INO, "a", DIR, 0, 0).ino
    b = ns.mkdir(ROOT_INO, "b", DIR, 0, 0).ino
    return {"a": a, "b": b, "f": mkfile(ns, a, "f").ino, "sub": ns.mkdir(a, "sub", DIR, 0, 0).ino,
            "g": mkfile(ns, b, "g").ino, "empty": ns.mkdir(b, "empty", DIR, 0, 0).ino,
            "h": mkfile(ns, ROOT_INO, "h").ino}


def test_rename_file_within_dir(ns: Namespace, tree: dict[str, int]) -> None:
    before = ns.getattr(tree["a"])
    ns.rename(tree["a"], "f", tree["a"], "f2")
    assert names(ns, tree["a"]) == ["f2", "sub"] and ns.lookup(tree["a"], "f2").ino == tree["f"]
    after = ns.getattr(tree["a"])
    assert after.nlink == before.nlink and after.mtime_ns >= before.mtime_ns
    assert ns.getattr(tree["f"]).ctime_ns >= before.mtime_ns


def test_rename_dir_across_parents(ns: Namespace, tree: dict[str, int]) -> None:
    ns.rename(tree["a"], "sub", tree["b"], "moved")
    assert ns.getattr(tree["a"]).nlink == 2 and ns.getattr(tree["b"]).nlink == 4
    assert ns.resolve("/b/moved/..").ino == tree["b"]  # the parent pointer moved too


def test_rename_same_inode_is_noop(ns: Namespace, tree: dict[str, int]) -> None:
    ns.link(tree["f"], tree["b"], "f_link")
    ns.rename(tree["a"], "f", tree["b"], "f_link")
    assert "f" in names(ns, tree["a"]) and "f_link" in names(ns, tree["b"])
    assert ns.getattr(tree["f"]).nlink == 2
    ns.rename(tree["a"], "f", tree["a"], "f")
    assert "f" in names(ns, tree["a"])


def test_rename_into_own_subtree(ns: Namespace, tree: dict[str, int]) -> None:
    with raises(errno.EINVAL):
        ns.rename(ROOT_INO, "a", tree["sub"], "x")
    with raises(errno.EINVAL):
        ns.rename(ROOT_INO, "a", tree["a"], "x")
    with raises(errno.EINVAL):
        ns.rename(ROOT_INO, "a", tree["a"], "x", RENAME_NOREPLACE)


def test_rename_file_over_file(ns: Namespace, tree: dict[str, int]) -> None:
    g = ns.getattr(tree["g"])
    ns.rename(tree["a"], "f", tree["b"], "g")
    assert ns.lookup(tree["b"], "g").ino == tree["f"] and "f" not in names(ns, tree["a"])
    with raises(errno.ENOENT):
        ns.getattr(g.ino)
    assert [(i.kind, i.ino, i.layout) for i in ns.garbage()] == [("remove", g.ino, g.layout)]


def test_rename_over_hard_linked_file(ns: Namespace, tree: dict[str, int]) -> None:
    ns.link(tree["g"], ROOT_INO, "g2")
    ns.rename(tree["a"], "f", tree["b"], "g")
    assert ns.getattr(tree["g"]).nlink == 1 and ns.garbage() == []


def test_rename_dir_over_empty_dir(ns: Namespace, tree: dict[str, int]) -> None:
    ns.rename(tree["a"], "sub", tree["b"], "empty")
    assert ns.lookup(tree["b"], "empty").ino == tree["sub"]
    with raises(errno.ENOENT):
        ns.getattr(tree["empty"])
    assert ns.getattr(tree["a"]).nlink == 2 and ns.getattr(tree["b"]).nlink == 3
    ns.mkdir(ROOT_INO, "c", DIR, 0, 0)
    ns.rename(ROOT_INO, "c", tree["b"], "empty")  # and within the same parent's scope
    assert ns.getattr(ROOT_INO).nlink == 4


def test_rename_type_conflicts(ns: Namespace, tree: dict[str, int]) -> None:
    with raises(errno.ENOTEMPTY):
        ns.rename(tree["b"], "empty", ROOT_INO, "a")
    with raises(errno.ENOTDIR):
        ns.rename(tree["b"], "empty", ROOT_INO, "h")
    with raises(errno.EISDIR):
        ns.rename(ROOT_INO, "h", tree["b"], "empty")
    with raises(errno.ENOENT):
        ns.rename(ROOT_INO, "nope", ROOT_INO, "x")
    with raises(errno.ENOENT):
        ns.rename(ROOT_INO, "h", 999, "x")
    with raises(errno.ENOTDIR):
        ns.rename(ROOT_INO, "h", tree["h"], "x")
    with raises(errno.EINVAL):
        ns.rename(ROOT_INO, "h", ROOT_INO, "x", RENAME_NOREPLACE | RENAME_EXCHANGE)
    with raises(errno.EINVAL):
        ns.rename(ROOT_INO, "h", ROOT_INO, "x", 4)


def test_rename_noreplace(ns: Namespace, tree: dict[str, int]) -> None:
    with raises(errno.EEXIST):
        ns.rename(tree["a"], "f", tree["b"], "g", RENAME_NOREPLACE)
    ns.rename(tree["a"], "f", tree["b"], "new", RENAME_NOREPLACE)
    assert ns.lookup(tree["b"], "new").ino == tree["f"]


def test_rename_exchange(ns: Namespace, tree: dict[str, int]) -> None:
    ns.rename(tree["a"], "sub", tree["b"], "g", RENAME_EXCHANGE)
    assert ns.lookup(tree["a"], "sub").ino == tree["g"] and ns.lookup(tree["b"], "g").ino == tree["sub"]
    assert ns.getattr(tree["a"]).nlink == 2 and ns.getattr(tree["b"]).nlink == 4
    assert ns.resolve("/b/g/..").ino == tree["b"]
    with raises(errno.ENOENT):
        ns.rename(tree["a"], "f", tree["b"], "nope", RENAME_EXCHANGE)
    with raises(errno.EINVAL):
        ns.rename(ROOT_INO, "a", tree["a"], "f", RENAME_EXCHANGE)
    ns.rename(tree["a"], "f", tree["a"], "sub", RENAME_EXCHANGE)
    assert ns.lookup(tree["a"], "f").ino == tree["g"]


# ----------------------------------------------------------------------------- setattr, lengths

def test_setattr(ns: Namespace, tree: dict[str, int]) -> None:
    f = ns.getattr(tree["f"])
    new = ns.setattr(f.ino, mode=0o40600, uid=3, gid=4, atime_ns=10, mtime_ns=20)
    assert new.mode == stat.S_IFREG | 0o600 and (new.uid, new.gid, new.atime_ns, new.mtime_ns) == (3, 4, 10, 20)
    assert new.ctime_ns >= f.ctime_ns and ns.getattr(f.ino) == new
    assert ns.setattr(tree["a"], mode=0o1777).mode == stat.S_IFDIR | 0o1777
    with raises(errno.EISDIR):
        ns.setattr(tree["a"], size=0)
    with raises(errno.EFBIG):
        ns.setattr(f.ino, size=(1 << 50) + 1)
    with raises(errno.EINVAL):
        ns.setattr(f.ino, size=-1)
    with raises(errno.ENOENT):
        ns.setattr(999, uid=1)


def test_setattr_size_and_truncate_garbage(ns: Namespace, tree: dict[str, int]) -> None:
    f = ns.getattr(tree["f"])
    assert ns.setattr(f.ino, size=10_000).size == 10_000 and ns.garbage() == []
    assert ns.setattr(f.ino, size=123).size == 123
    [item] = ns.garbage()
    assert (item.kind, item.ino, item.length, item.layout) == ("truncate", f.ino, 123, f.layout)


def test_commit_length(ns: Namespace, tree: dict[str, int]) -> None:
    ino = tree["f"]
    assert ns.commit_length(ino, 500).size == 500
    assert ns.commit_length(ino, 100).size == 500  # max(): a stale commit never shrinks
    assert ns.commit_length(ino, 900, mtime_ns=42).mtime_ns == 42
    with raises(errno.EISDIR):
        ns.commit_length(tree["a"], 1)
    with raises(errno.EFBIG):
        ns.commit_length(ino, 1 << 51)


def test_commit_after_a_truncate_does_not_extend(ns: Namespace, tree: dict[str, int]) -> None:
    """Setting the size (truncate, O_TRUNC) drops the servers' bytes past it, committed or
    not; a writer that has not seen that truncate may not extend the size over them."""
    ino = tree["f"]
    seen = ns.commit_length(ino, 500).truncations
    assert ns.setattr(ino, size=500).truncations == seen + 1  # counted even when the size stays
    stale = ns.commit_length(ino, 9000, truncations=seen)
    assert stale.size == 500 and stale.truncations == seen + 1  # the writer learns of the truncate
    assert ns.commit_length(ino, 9000, truncations=seen + 1).size == 9000  # then commits again
    assert ns.commit_length(ino, 9500).size == 9500  # a commit naming no count is not checked
    assert ns.create(tree["a"], "f", 0o644, 0, 0, chains=[1], truncate=True)[0].truncations == seen + 2
    assert ns.commit_length(ino, 100, truncations=seen + 1).size == 0
    assert ns.setattr(ino, mode=0o600).truncations == seen + 2  # only size changes count


def test_truncations_column_added_to_an_old_database(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as db:  # the inodes table as it was before the column
        db.execute("CREATE TABLE inodes (ino INTEGER PRIMARY KEY, ftype INTEGER NOT NULL, mode INTEGER NOT NULL, "
                   "nlink INTEGER NOT NULL, uid INTEGER NOT NULL, gid INTEGER NOT NULL, size INTEGER NOT NULL, "
                   "atime_ns INTEGER NOT NULL, mtime_ns INTEGER NOT NULL, ctime_ns INTEGER NOT NULL, "
                   "chunk_size INTEGER, chains TEXT, target TEXT)")
        db.execute("INSERT INTO inodes VALUES (7, ?, ?, 1, 0, 0, 42, 1, 2, 3, 65536, '1,2', NULL)",
                   (stat.S_IFREG, stat.S_IFREG | 0o644))
    store = SqliteStore(path)
    try:
        with store.transaction() as txn:
            attr = txn.get_inode(7)
        assert attr is not None and (attr.size, attr.truncations) == (42, 0)
    finally:
        store.close()


def test_counts(ns: Namespace, tree: dict[str, int]) -> None:
    ns.commit_length(tree["f"], 100)
    ns.commit_length(tree["g"], 23)
    ns.symlink(ROOT_INO, "s", "h", 0, 0)
    assert ns.counts() == {"inodes": 9, "files": 3, "dirs": 5, "bytes": 123}


# ----------------------------------------------------------------------------- durability, atomicity

def dump(ns: Namespace, ino: int = ROOT_INO, path: str = "") -> dict[str, Any]:
    """Every path with its attr, plus the garbage queue and counts."""
    out: dict[str, Any] = {path or "/": ns.getattr(ino)}
    for e in ns.readdir(ino, limit=10_000)[0]:
        if stat.S_ISDIR(e.mode):
            out.update(dump(ns, e.ino, f"{path}/{e.name}"))
        else:
            out[f"{path}/{e.name}"] = ns.getattr(e.ino)
    if ino == ROOT_INO:
        out["garbage"], out["counts"] = ns.garbage(), ns.counts()
    return out


def test_sqlite_persistence(tmp_path: Path) -> None:
    path = tmp_path / "meta.db"
    with SqliteStore(path) as store:
        ns = Namespace(store)
        d = ns.mkdir(ROOT_INO, "d", DIR, 0, 0)
        ns.set_layout(d.ino, stripe=2)
        ns.commit_length(mkfile(ns, d.ino, "f").ino, 77)
        ns.symlink(ROOT_INO, "s", "d/f", 0, 0)
        mkfile(ns, ROOT_INO, "gone")
        ns.unlink(ROOT_INO, "gone")
        before = dump(ns)
        last = ns.counts()["inodes"]
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    with SqliteStore(path) as store:
        ns = Namespace(store)
        assert dump(ns) == before and ns.get_layout(d.ino)["stripe"] == 2
        assert ns.resolve("/s").size == 77
        assert mkfile(ns, ROOT_INO, "new").ino > last + 1  # the counter survived too


class _FaultyTxn:
    """Delegates to a real Txn; the ``nth`` call of method ``name`` raises."""

    def __init__(self, txn: Any, name: str, nth: int) -> None:
        self._txn, self._name, self._left = txn, name, nth

    def __getattr__(self, attr: str) -> Any:
        real = getattr(self._txn, attr)
        if attr != self._name:
            return real

        def call(*args: Any) -> Any:
            self._left -= 1
            if self._left == 0:
                raise RuntimeError("injected fault")
            return real(*args)
        return call


class _FaultyStore:
    def __init__(self, store: Store, name: str, nth: int) -> None:
        self._store, self._name, self._nth = store, name, nth

    @contextmanager
    def transaction(self) -> Iterator[Any]:
        with self._store.transaction() as txn:
            yield _FaultyTxn(txn, self._name, self._nth)


@pytest.mark.parametrize("op, fault", [
    (lambda ns, t: ns.rename(t["a"], "sub", t["b"], "empty"), ("put_inode", 3)),
    (lambda ns, t: ns.rename(t["a"], "f", t["b"], "g"), ("put_dentry", 1)),
    (lambda ns, t: ns.rename(t["a"], "sub", t["b"], "g", RENAME_EXCHANGE), ("put_inode", 2)),
    (lambda ns, t: ns.create(t["a"], "new", FILE, 0, 0, chains=CHAINS), ("put_dentry", 1)),
    (lambda ns, t: ns.mkdir(t["a"], "new", DIR, 0, 0), ("put_dir", 1)),
    (lambda ns, t: ns.unlink(t["a"], "f"), ("put_garbage", 1)),
    (lambda ns, t: ns.rmdir(t["b"], "empty"), ("put_inode", 1)),
    (lambda ns, t: ns.setattr(t["f"], size=0, uid=9), ("put_inode", 1)),
])
def test_failed_op_leaves_no_partial_state(store: Store, tree: dict[str, int], op: Any, fault: Any) -> None:
    ns = Namespace(store)
    ns.commit_length(tree["f"], 10)
    before = dump(ns)
    with store.transaction() as txn:
        next_ino = txn.get_meta("next_ino")
    with pytest.raises(RuntimeError, match="injected"):
        op(Namespace(_FaultyStore(store, *fault)), tree)  # type: ignore[arg-type]
    assert dump(ns) == before
    with store.transaction() as txn:
        assert txn.get_meta("next_ino") == next_ino
    op(ns, tree)  # and the same op still works afterwards


# ----------------------------------------------------------------------------- model-based

Path_ = tuple[str, ...]


def _draw_op(data: st.DataObject, tree: dict[Path_, str]) -> tuple:
    """An op on paths drawn mostly from the current tree, so that most ops can succeed."""
    existing = sorted(tree)
    some = st.sampled_from(existing[1:] or [("a",)])  # an existing non-root path
    child = st.builds(lambda p, n: p + (n,), st.sampled_from(existing), st.sampled_from("abc"))
    anywhere = st.lists(st.sampled_from("abc"), min_size=1, max_size=3).map(tuple)
    path = st.one_of(some, child, anywhere)
    kind = data.draw(st.sampled_from(["mkdir", "mkdir", "create", "create", "unlink", "rmdir",
                                      "rename", "rename", "rename"]))
    if kind in ("mkdir", "create"):
        p = data.draw(st.one_of(child, anywhere))
        return (kind, p, data.draw(st.booleans())) if kind == "create" else (kind, p)
    if kind in ("unlink", "rmdir"):
        return (kind, data.draw(path))
    flags = data.draw(st.sampled_from([0, 0, RENAME_NOREPLACE, RENAME_EXCHANGE]))
    return ("rename", data.draw(some), data.draw(path), flags)


class Model:
    """The expected tree: path tuple -> "d" | "f", and the errno each op should give."""

    def __init__(self) -> None:
        self.tree: dict[Path_, str] = {(): "d"}

    def walk_err(self, p: Path_) -> int | None:
        """What ``resolve`` of ``p`` raises."""
        for i in range(len(p)):
            if p[: i + 1] not in self.tree:
                return errno.ENOENT
            if self.tree[p[: i + 1]] != "d" and i < len(p) - 1:
                return errno.ENOTDIR
        return None

    def children(self, p: Path_) -> list[Path_]:
        return [q for q in self.tree if len(q) == len(p) + 1 and q[: len(p)] == p]

    def subtree(self, p: Path_) -> list[Path_]:
        return [q for q in self.tree if q[: len(p)] == p]

    def move(self, moves: list[tuple[Path_, Path_]]) -> None:
        """Move several subtrees at once (EXCHANGE swaps two)."""
        taken = {(q, src, dst) for src, dst in moves for q in self.subtree(src)}
        kinds = {q: self.tree.pop(q) for q, _, _ in taken}
        for q, src, dst in taken:
            self.tree[dst + q[len(src):]] = kinds[q]

    def apply(self, op: tuple) -> int | None:
        kind, p = op[0], op[1]
        if kind == "rename":
            return self.rename(p, op[2], op[3])
        err = self.walk_err(p[:-1]) or (errno.ENOTDIR if self.tree[p[:-1]] != "d" else None)
        if err:
            return err
        have = self.tree.get(p)
        if kind == "mkdir" or (kind == "create" and have is None):
            if have:
                return errno.EEXIST
            self.tree[p] = "d" if kind == "mkdir" else "f"
        elif kind == "create":
            return errno.EEXIST if op[2] else errno.EISDIR if have == "d" else None
        elif have is None:
            return errno.ENOENT
        elif kind == "unlink":
            if have == "d":
                return errno.EISDIR
            del self.tree[p]
        elif kind == "rmdir":
            if have != "d":
                return errno.ENOTDIR
            if self.children(p):
                return errno.ENOTEMPTY
            del self.tree[p]
        return None

    def rename(self, s: Path_, d: Path_, flags: int) -> int | None:
        err = self.walk_err(s[:-1]) or self.walk_err(d[:-1])
        err = err or next((errno.ENOTDIR for q in (s[:-1], d[:-1]) if self.tree[q] != "d"), None)
        if err or s not in self.tree:
            return err or errno.ENOENT
        dst = self.tree.get(d)
        if flags == RENAME_NOREPLACE and dst:
            return errno.EEXIST
        if flags == RENAME_EXCHANGE and not dst:
            return errno.ENOENT
        if s == d:
            return None
        if (self.tree[s] == "d" and d[: len(s)] == s) or (flags == RENAME_EXCHANGE and dst == "d"
                                                          and s[: len(d)] == d):
            return errno.EINVAL
        if flags == RENAME_EXCHANGE:
            self.move([(s, d), (d, s)])
            return None
        if dst:
            if self.tree[s] == "d" and dst != "d":
                return errno.ENOTDIR
            if self.tree[s] != "d" and dst == "d":
                return errno.EISDIR
            if self.children(d):
                return errno.ENOTEMPTY
            del self.tree[d]
        self.move([(s, d)])
        return None


def _run(ns: Namespace, op: tuple) -> int | None:
    def parent(p: Path_) -> int:
        return ns.resolve("/" + "/".join(p[:-1])).ino
    kind, p = op[0], op[1]
    try:
        if kind == "mkdir":
            ns.mkdir(parent(p), p[-1], DIR, 0, 0)
        elif kind == "create":
            mkfile(ns, parent(p), p[-1], exclusive=op[2])
        elif kind == "unlink":
            ns.unlink(parent(p), p[-1])
        elif kind == "rmdir":
            ns.rmdir(parent(p), p[-1])
        else:
            src_parent, dst_parent = parent(p), parent(op[2])
            ns.rename(src_parent, p[-1], dst_parent, op[2][-1], op[3])
    except StripefsError as exc:
        return exc.errno
    return None


def _tree(ns: Namespace, ino: int = ROOT_INO, path: Path_ = ()) -> dict[Path_, str]:
    out = {path: "d"}
    entries = ns.readdir(ino, limit=10_000)[0]
    assert ns.getattr(ino).nlink == 2 + sum(stat.S_ISDIR(e.mode) for e in entries)
    for e in entries:
        if stat.S_ISDIR(e.mode):
            out.update(_tree(ns, e.ino, path + (e.name,)))
        else:
            out[path + (e.name,)] = "f"
    return out


@pytest.mark.parametrize("backend", ["sqlite", "memory"])
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_matches_model(backend: str, data: st.DataObject) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        store: Store = SqliteStore(Path(tmp) / "m.db") if backend == "sqlite" else MemoryStore()
        with store:
            ns, model = Namespace(store), Model()
            for _ in range(data.draw(st.integers(1, 40), label="steps")):
                op = _draw_op(data, model.tree)
                note(repr(op))
                assert _run(ns, op) == model.apply(op), op
            assert _tree(ns) == model.tree
            counts = ns.counts()
            assert counts["dirs"] == sum(k == "d" for k in model.tree.values())
            assert counts["files"] == sum(k == "f" for k in model.tree.values())
