"""Batched namespace operations (``create_many``, ``unlink_many``, ``symlink_many``) against every store backend:
one transaction for many paths, each path with the single operation's semantics."""

from __future__ import annotations

import errno
import stat

import pytest

from stripefs.metadata._namespace import MAX_CREATE_MANY, ROOT_INO, Namespace
from stripefs.metadata._store import Store
from stripefs.wire._errors import StripefsError
from stripefs.wire._types import MAX_NAME, MAX_PATH

CHAINS = list(range(100, 108))


@pytest.fixture
def ns(store: Store) -> Namespace:
    n = Namespace(store)
    n.mkdir(ROOT_INO, "d", 0o755, 0, 0)
    return n


def codes(found: list) -> list[int | None]:
    """Per path: None for attributes, the errno for an error."""
    return [r.errno if isinstance(r, StripefsError) else None for r in found]


def create_many(ns: Namespace, paths: list, **kw):
    kw.setdefault("exclusive", True)
    return ns.create_many(paths, 0o640, 1000, 1001, chains=CHAINS, **kw)


def test_create_many_makes_empty_files_with_the_mode_and_owner(ns: Namespace) -> None:
    found = create_many(ns, [f"/d/f{k}" for k in range(30)])
    assert codes(found) == [None] * 30
    assert len({a.ino for a in found}) == 30
    for k, a in enumerate(found):
        assert a.mode == stat.S_IFREG | 0o640 and (a.uid, a.gid, a.size, a.nlink) == (1000, 1001, 0, 1)
        assert a.layout is not None and set(a.layout.chains) <= set(CHAINS)
        assert ns.resolve(f"/d/f{k}") == a


def test_one_batch_mixes_successes_and_typed_failures(ns: Namespace) -> None:
    create_many(ns, ["/d/old"])
    ns.symlink(ns.resolve("/d").ino, "link", "/d/old", 0, 0)
    paths = ["/d/a", "/d/old", "/missing/x", "/d/old/x", "/d", "/", "/d/link", "/d/b",
             "/d/" + "n" * (MAX_NAME + 1), "/d/nul\x00", "/d/" + "p/" * (MAX_PATH // 2) + "f", "/d/a"]
    found = create_many(ns, paths)
    assert codes(found) == [None, errno.EEXIST, errno.ENOENT, errno.ENOTDIR, errno.EEXIST, errno.EINVAL,
                            errno.EEXIST, None, errno.ENAMETOOLONG, errno.EINVAL, errno.ENAMETOOLONG,
                            errno.EEXIST]  # the second "/d/a": made earlier in the same batch
    assert sorted(e.name for e in ns.readdir(ns.resolve("/d").ino)[0]) == ["a", "b", "link", "old"]
    assert ns.resolve("/d/a") == found[0] and ns.resolve("/d/b") == found[7]


def test_not_exclusive_answers_an_existing_file_untouched(ns: Namespace) -> None:
    [old] = create_many(ns, ["/d/old"])
    ns.commit_length(old.ino, 100)
    ns.mkdir(ns.resolve("/d").ino, "sub", 0o755, 0, 0)
    found = create_many(ns, ["/d/old", "/d/new", "/d/sub"], exclusive=False)
    assert codes(found) == [None, None, errno.EISDIR]
    assert found[0].ino == old.ino and found[0].size == 100  # opened, not truncated
    assert found[1].size == 0 and found[1].ino != old.ino


def test_parents_are_stamped_once_per_batch_and_only_when_changed(ns: Namespace) -> None:
    ns.mkdir(ns.resolve("/d").ino, "e", 0o755, 0, 0)
    before_d, before_e, before_root = ns.resolve("/d"), ns.resolve("/d/e"), ns.getattr(ROOT_INO)
    found = create_many(ns, ["/d/x", "/d/e/y", "/d/y", "/d/e/z"])
    d, e = ns.resolve("/d"), ns.resolve("/d/e")
    for after, before, made in ((d, before_d, [found[0], found[2]]), (e, before_e, [found[1], found[3]])):
        assert after.mtime_ns == after.ctime_ns == max(a.ctime_ns for a in made)  # the last creation's time
        assert after.nlink == before.nlink and after.mtime_ns > before.mtime_ns
    assert ns.getattr(ROOT_INO) == before_root  # nothing created there
    untouched = ns.resolve("/d")
    assert codes(create_many(ns, ["/d/x"])) == [errno.EEXIST]
    assert ns.resolve("/d") == untouched


def test_parents_resolve_through_symlinks_and_dotdot(ns: Namespace) -> None:
    ns.symlink(ROOT_INO, "alias", "/d", 0, 0)
    found = create_many(ns, ["/alias/a", "/d/../d/b", "/alias/../c"])
    assert codes(found) == [None, None, None]
    assert sorted(e.name for e in ns.readdir(ns.resolve("/d").ino)[0]) == ["a", "b"]
    assert ns.resolve("/c") == found[2]


def test_a_file_made_earlier_in_the_batch_is_no_directory_later(ns: Namespace) -> None:
    assert codes(create_many(ns, ["/d/f/x", "/d/f", "/d/f/y"])) == [errno.ENOENT, None, errno.ENOTDIR]


def test_the_batch_limit_and_non_text_paths_refuse_the_whole_request(ns: Namespace) -> None:
    for bad in (["/d/x"] * (MAX_CREATE_MANY + 1), ["/d/x", 7], ["/d/x", b"/d/y"]):
        with pytest.raises(StripefsError) as info:
            create_many(ns, bad)
        assert info.value.errno == errno.EINVAL
        with pytest.raises(StripefsError):
            ns.unlink_many(bad)
    assert ns.readdir(ns.resolve("/d").ino)[0] == []  # nothing of a refused batch
    assert create_many(ns, []) == [] and ns.unlink_many([]) == []
    assert codes(create_many(ns, [f"/d/{k}" for k in range(MAX_CREATE_MANY)])) == [None] * MAX_CREATE_MANY


def test_without_chains_every_new_file_fails_and_existing_ones_open(ns: Namespace) -> None:
    create_many(ns, ["/d/old"])
    found = ns.create_many(["/d/old", "/d/new"], 0o644, 0, 0, chains=[], exclusive=False)
    assert codes(found) == [None, errno.EHOSTUNREACH]
    assert [e.name for e in ns.readdir(ns.resolve("/d").ino)[0]] == ["old"]


def test_unlink_many_removes_each_and_queues_its_garbage(ns: Namespace) -> None:
    made = create_many(ns, [f"/d/f{k}" for k in range(5)])
    d = ns.resolve("/d").ino
    ns.link(made[0].ino, d, "second")
    ns.symlink(d, "link", "/d/f1", 0, 0)
    ns.mkdir(d, "sub", 0o755, 0, 0)
    before = ns.resolve("/d")
    found = ns.unlink_many(["/d/f0", "/d/f1", "/d/link", "/d/sub", "/d/none", "/d/f2/x", "/d/f2", "/d/f2",
                            "/d/..", "/d/f3"])
    assert codes(found) == [None, None, None, errno.EISDIR, errno.ENOENT, errno.ENOTDIR, None, errno.ENOENT,
                            errno.EINVAL, None]
    assert found[0].nlink == 1 and found[1].nlink == 0 and found[6].nlink == 0
    assert sorted(e.name for e in ns.readdir(d)[0]) == ["f4", "second", "sub"]
    gone = {g.ino for g in ns.garbage()}
    assert {made[1].ino, made[2].ino, made[3].ino} <= gone and made[0].ino not in gone
    after = ns.resolve("/d")
    assert after.nlink == before.nlink and after.mtime_ns > before.mtime_ns
    assert after.mtime_ns == after.ctime_ns == max(found[i].ctime_ns for i in (0, 1, 2, 6, 9))


def test_unlink_many_sees_a_symlink_it_removed_as_gone(ns: Namespace) -> None:
    d = ns.resolve("/d").ino
    create_many(ns, ["/d/f", "/d/g"])
    ns.symlink(ROOT_INO, "alias", "/d", 0, 0)
    found = ns.unlink_many(["/alias/f", "/alias", "/alias/g"])
    assert codes(found) == [None, None, errno.ENOENT]
    assert [e.name for e in ns.readdir(d)[0]] == ["g"]


# -- whole files from reservations (reserve_files + commit_files) ---------------------------

def test_reservations_are_unique_queued_and_committed_whole(ns: Namespace) -> None:
    items = ns.reserve_files("/d", 3, chains=CHAINS)
    assert len({i.ino for i in items}) == 3 and all(i.kind == "reserved" for i in items)
    assert {g.id for g in ns.garbage()} >= {i.id for i in items}  # garbage until committed
    made = ns.create_many(["/d/other"], 0o644, 0, 0, chains=CHAINS)[0]
    assert made.ino not in {i.ino for i in items}  # nobody else gets a reserved number
    found = ns.commit_files(["/d/a", "/d/b"], [items[0].ino, items[1].ino], [items[0].id, items[1].id],
                            [5, 70_000], 0o640, 1000, 1001, mtime_ns=123)
    assert codes(found) == [None, None]
    a = ns.resolve("/d/a")
    assert (a.ino, a.size, a.mode, a.uid, a.gid, a.mtime_ns, a.nlink) == \
        (items[0].ino, 5, stat.S_IFREG | 0o640, 1000, 1001, 123, 1)
    assert a.layout == items[0].layout and ns.resolve("/d/b").size == 70_000
    left = {g.id for g in ns.garbage() if g.kind == "reserved"}
    assert left == {items[2].id}  # the uncommitted one stays garbage


def test_a_reservation_commits_once_and_never_after_it_is_gone(ns: Namespace) -> None:
    (item,) = ns.reserve_files("/d", 1, chains=CHAINS)
    assert codes(ns.commit_files(["/d/a"], [item.ino], [item.id], [1], 0o644, 0, 0)) == [None]
    again = ns.commit_files(["/d/b"], [item.ino], [item.id], [1], 0o644, 0, 0)
    assert codes(again) == [errno.ESTALE]  # committed already: its id is spent
    (other,) = ns.reserve_files("/d", 1, chains=CHAINS)
    ns.garbage_done(other.id)  # what the collector does once the grace ran out
    assert codes(ns.commit_files(["/d/c"], [other.ino], [other.id], [1], 0o644, 0, 0)) == [errno.ESTALE]
    wrong = ns.reserve_files("/d", 1, chains=CHAINS)[0]
    assert codes(ns.commit_files(["/d/c"], [wrong.ino + 1], [wrong.id], [1], 0o644, 0, 0)) == [errno.ESTALE]
    with pytest.raises(StripefsError):
        ns.lookup(ns.resolve("/d").ino, "c")


def test_reservations_and_commits_by_directory_inode(ns: Namespace) -> None:
    """A mount knows directories by inode: ``parent`` an inode, the paths names in it."""
    d = ns.resolve("/d")
    items = ns.reserve_files(d.ino, 3, chains=CHAINS)
    assert len({i.ino for i in items}) == 3
    found = ns.commit_files(["a", "b", "c/d"], [i.ino for i in items], [i.id for i in items], [3, 4, 5], 0o600, 0, 0,
                            parent_ino=d.ino)
    assert codes(found)[:2] == [None, None] and codes(found)[2] == errno.EINVAL  # a name, not a path
    assert (ns.resolve("/d/a").ino, ns.resolve("/d/b").size) == (items[0].ino, 4)
    after = ns.resolve("/d")
    assert after.mtime_ns > d.mtime_ns  # the directory is stamped as for any create
    f = ns.resolve("/d/a").ino
    for parent, code in ((f, errno.ENOTDIR), (987654, errno.ENOENT)):
        with pytest.raises(StripefsError) as info:
            ns.reserve_files(parent, 1, chains=CHAINS)
        assert info.value.errno == code
        assert codes(ns.commit_files(["x"], [items[2].ino], [items[2].id], [1], 0o644, 0, 0, parent_ino=parent)) \
            == [code]


def test_commit_never_replaces_a_name(ns: Namespace) -> None:
    """A new inode under an old name would strand every cache that maps the name to the old
    one (a mount's dentries): the client writes an existing file in place instead."""
    old = ns.create_many(["/d/f"], 0o600, 7, 8, chains=CHAINS)[0]
    (item,) = ns.reserve_files("/d", 1, chains=CHAINS)
    assert codes(ns.commit_files(["/d/f"], [item.ino], [item.id], [9], 0o644, 0, 0)) == [errno.EEXIST]
    assert ns.resolve("/d/f") == old
    assert item.id in {g.id for g in ns.garbage() if g.kind == "reserved"}  # left to expire


def test_commit_refuses_names_that_exist_and_keeps_the_reservation(ns: Namespace) -> None:
    ns.symlink(ns.resolve("/d").ino, "link", "/d/x", 0, 0)
    ns.mkdir(ns.resolve("/d").ino, "sub", 0o755, 0, 0)
    ns.create_many(["/d/f"], 0o644, 0, 0, chains=CHAINS)
    items = ns.reserve_files("/d", 5, chains=CHAINS)
    found = ns.commit_files(["/d/link", "/d/sub", "/nope/f", "/d/f", "/d/ok"], [i.ino for i in items],
                            [i.id for i in items], [1] * 5, 0o644, 0, 0, exclusive=True)
    assert codes(found) == [errno.EEXIST, errno.EEXIST, errno.ENOENT, errno.EEXIST, None]
    left = {g.id for g in ns.garbage() if g.kind == "reserved"}
    assert left == {i.id for i in items[:4]}  # a failed path leaves its reservation to expire
    found = ns.commit_files(["/d/link", "/d/sub"], [items[0].ino, items[1].ino], [items[0].id, items[1].id],
                            [1, 1], 0o644, 0, 0)
    assert codes(found) == [errno.EEXIST, errno.EISDIR]
    with pytest.raises(StripefsError) as info:
        ns.reserve_files("/d/f", 1, chains=CHAINS)
    assert info.value.errno == errno.ENOTDIR
    with pytest.raises(StripefsError) as info:
        ns.reserve_files("/d", 0, chains=CHAINS)
    assert info.value.errno == errno.EINVAL


def test_symlink_many_makes_and_replaces_links_each_failing_alone(ns: Namespace) -> None:
    d = ns.resolve("/d").ino
    create_many(ns, ["/d/file"])
    found = ns.symlink_many(d, ["a", "b", "file", "c", "n" * (MAX_NAME + 1), "e"],
                            ["/t/a", "/t/b", "/t/f", "", "/t/x", "x" * (MAX_PATH + 1)], 7, 8)
    assert codes(found) == [None, None, errno.EEXIST, errno.EINVAL, errno.ENAMETOOLONG, errno.ENAMETOOLONG]
    a = found[0]
    assert stat.S_ISLNK(a.mode) and (a.uid, a.gid, a.size) == (7, 8, len("/t/a"))
    assert ns.readlink(a.ino) == "/t/a" and ns.resolve("/d/file").is_file
    # Without replace an existing link is EEXIST; with it, the link points anew (a new
    # inode, the old one gone with its name) and a regular file stays and fails alone.
    again = ns.symlink_many(d, ["a"], ["/t/a2"], 0, 0)
    assert codes(again) == [errno.EEXIST]
    mtime = ns.resolve("/d").mtime_ns
    swapped = ns.symlink_many(d, ["a", "file", "new"], ["/t/a2", "/t/f2", "/t/n"], 0, 0, replace=True)
    assert codes(swapped) == [None, errno.EEXIST, None]
    assert ns.readlink(ns.lookup(d, "a").ino) == "/t/a2" and swapped[0].ino != a.ino
    with pytest.raises(StripefsError) as info:
        ns.readlink(a.ino)
    assert info.value.errno == errno.ENOENT
    assert ns.resolve("/d/file").is_file and ns.resolve("/d").mtime_ns > mtime


def test_symlink_many_refuses_a_bad_batch_whole(ns: Namespace) -> None:
    d = ns.resolve("/d").ino
    for names, targets in ([f"l{k}" for k in range(MAX_CREATE_MANY + 1)], ["/t"] * (MAX_CREATE_MANY + 1)), \
                          (["a", "b"], ["/t"]), (["a"], [b"/t"]):
        with pytest.raises(StripefsError) as info:
            ns.symlink_many(d, names, targets, 0, 0)
        assert info.value.errno == errno.EINVAL
    assert ns.readdir(d)[0] == []  # nothing was made
    with pytest.raises(StripefsError) as info:
        ns.symlink_many(ns.resolve("/d").ino + 10_000, ["a"], ["/t"], 0, 0)
    assert info.value.errno == errno.ENOENT
