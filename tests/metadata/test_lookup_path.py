"""Path lookups with fewer statements (issues #29, #30): the last name's entry and its inode
in one read (``Txn.lookup_entry``), the same answers, errors and lease keys as before, and
nothing remembered across requests that a rename or rmdir could leave stale."""

from __future__ import annotations

import stat

import pytest

from stripefs.fsclient.testing import LocalCluster
from stripefs.metadata import Namespace, SqliteStore
from stripefs.metadata._memstore import MemoryStore
from stripefs.metadata._namespace import ROOT_INO
from stripefs.wire import Attr, DirEntry, StripefsError

PATHS = ["/", "", "/d", "/d/", "/d/.", "/d/f", "d/f", "/d/./f", "/d/e/../f", "/d/e/..", "/d/e/g", "/d/f/",
         "/d/f/x", "/d/nothing", "/nothing/f", "/d/ln", "/d/ln/", "/d/ln/g", "/d/abs", "/d/abs/f", "/d/loop",
         "/d/dangling", "/d/e/up", "/d/e/up/f", "/..", "/d/../d/f", "/d/lnf", "/d/lnf/"]


def _fill(ns: Namespace) -> dict[str, int]:
    d = ns.mkdir(ROOT_INO, "d", 0o755, 0, 0)
    e = ns.mkdir(d.ino, "e", 0o755, 0, 0)
    f, _ = ns.create(d.ino, "f", 0o644, 0, 0, chains=[1, 2, 3])
    g, _ = ns.create(e.ino, "g", 0o600, 0, 0, chains=[2])
    ns.commit_length(f.ino, 1234)
    ns.symlink(d.ino, "ln", "e", 0, 0)
    ns.symlink(d.ino, "abs", "/d", 0, 0)
    ns.symlink(d.ino, "loop", "loop", 0, 0)
    ns.symlink(d.ino, "dangling", "nowhere", 0, 0)
    ns.symlink(e.ino, "up", "..", 0, 0)
    ns.symlink(d.ino, "lnf", "f", 0, 0)
    return {"d": d.ino, "e": e.ino, "f": f.ino, "g": g.ino}


def _answers(ns: Namespace, inos: dict[str, int]) -> list[object]:
    """Every read answer over the tree (attributes with the times left out: two stores
    made them at different instants), errors as (code, message), with the lease keys."""
    def shown(found: object) -> object:
        if isinstance(found, StripefsError):
            return ("error", found.code, found.message)
        assert isinstance(found, Attr)
        return (found.ino, found.mode, found.nlink, found.size, found.layout and found.layout.chunk_size,
                found.layout and len(found.layout.chains), found.target, found.truncations)

    def run(fn, *args) -> object:  # type: ignore[no-untyped-def]
        keys: list[object] = []
        try:
            found = fn(*args, keys)
        except StripefsError as exc:
            found = exc
        return shown(found), keys

    out: list[object] = []
    for follow in (True, False):
        for path in PATHS:
            out.append(("resolve", path, follow, run(ns.resolve, path, follow)))
        many_keys: list[list[object]] = []
        many = ns.resolve_many(PATHS, follow, many_keys)
        out.append(("many", follow, [shown(a) for a in many], many_keys))
    for parent in (ROOT_INO, inos["d"], inos["e"], inos["f"], 999_999):
        for name in ("d", "e", "f", "g", "ln", "up", "nothing"):
            out.append(("lookup", parent, name, run(ns.lookup, parent, name)))
    return out


def _inos_as_names(found: object, inos: dict[str, int]) -> object:
    """Inode numbers differ between stores only if they allocate differently: map them to names."""
    names = {v: k for k, v in inos.items()}
    if isinstance(found, (list, tuple)):
        return type(found)(_inos_as_names(x, inos) for x in found)
    if isinstance(found, int) and found in names:
        return names[found]
    return found


def test_sqlite_reads_answer_as_the_memory_store_does(tmp_path) -> None:
    """The joined lookup (SQLite) and the primitive one (the memory store's default)
    give the same attributes, errors and lease keys, on the writer's namespace, a
    reader's, and a remembering reader's (the loop's), each asked twice."""
    mem = Namespace(MemoryStore())
    mem_inos = _fill(mem)
    expected = _inos_as_names(_answers(mem, mem_inos), mem_inos)
    store = SqliteStore(tmp_path / "meta.db")
    try:
        ns = Namespace(store)
        inos = _fill(ns)
        readers = [ns, ns.reading(store.reader()), ns.reading(store.reader(), remember_dirs=True)]
        for reader in readers:
            for _ in range(2):  # the second time through remembered directories
                assert _inos_as_names(_answers(reader, inos), inos) == expected
    finally:
        store.close()


@pytest.mark.parametrize("kind", ["sqlite", "memory"])
def test_lookup_entry_is_the_entry_and_its_inode(tmp_path, kind: str) -> None:
    store = SqliteStore(tmp_path / "meta.db") if kind == "sqlite" else MemoryStore()
    try:
        ns = Namespace(store)
        inos = _fill(ns)
        with store.transaction() as txn:
            entry, attr = txn.lookup_entry(inos["d"], "f")  # type: ignore[misc]
            assert entry == txn.get_dentry(inos["d"], "f") == DirEntry("f", inos["f"], stat.S_IFREG)
            assert attr == txn.get_inode(inos["f"]) and attr.size == 1234 and attr.layout is not None
            entry, attr = txn.lookup_entry(inos["d"], "ln")  # type: ignore[misc]
            assert stat.S_ISLNK(entry.mode) and attr is not None and attr.target == "e"
            assert txn.lookup_entry(inos["d"], "nothing") is None
            assert txn.lookup_entry(999_999, "f") is None
            txn.delete_inode(inos["g"])  # an entry whose inode row is gone (a damaged store)
            assert txn.lookup_entry(inos["e"], "g") == (DirEntry("g", inos["g"], stat.S_IFREG), None)
        for fn, args in ((ns.resolve, ("/d/e/g",)), (ns.lookup, (inos["e"], "g"))):
            with pytest.raises(StripefsError) as info:
                fn(*args)
            assert info.value.message == f"no inode {inos['g']}"
    finally:
        store.close()


def test_a_stat_through_remembered_directories_is_one_statement(tmp_path) -> None:
    """The loop's reads: with the directories of a path remembered, a stat of a file reads its
    entry and inode in one SELECT (two before); a lookup by parent and name two (three before)."""
    store = SqliteStore(tmp_path / "meta.db")
    try:
        ns = Namespace(store)
        inos = _fill(ns)
        reader = store.reader()
        assert reader is not None
        lns = ns.reading(reader, remember_dirs=True)
        statements: list[str] = []
        reader._conn.set_trace_callback(statements.append)  # type: ignore[attr-defined]
        lns.resolve("/d/e/g")
        statements.clear()
        assert lns.resolve("/d/e/g").ino == inos["g"]
        assert [s.split()[0] for s in statements] == ["BEGIN", "SELECT", "ROLLBACK"]
        statements.clear()
        assert lns.lookup(inos["d"], "f").size == 1234
        assert [s.split()[0] for s in statements] == ["BEGIN", "SELECT", "SELECT", "ROLLBACK"]
        statements.clear()
        assert lns.resolve("/d/lnf").ino == inos["f"]  # the link's entry and target in one read, then f's
        assert [s.split()[0] for s in statements] == ["BEGIN", "SELECT", "SELECT", "ROLLBACK"]
    finally:
        store.close()


def test_a_renamed_or_removed_directory_is_not_found_at_once_by_another_client(tmp_path) -> None:
    """The service remembers directories between requests (the loop's reads) and clients
    cache under leases: a rename or rmdir by one client is seen by the very next lookup of
    another through the old path, and a new directory under the old name is the new one."""
    with LocalCluster.start(str(tmp_path / "c"), servers=1) as cluster:
        a, b = cluster.client(), cluster.client()
        try:
            a.makedirs("/top/sub")
            with a.open("/top/sub/f", "wb") as f:
                f.write(b"data")
            assert b.stat("/top/sub/f").size == 4  # b's walk goes through /top and /top/sub
            with b.open("/top/sub/f", "rb") as f:
                assert f.read() == b"data"
            a.rename("/top/sub", "/top/moved")
            with pytest.raises(FileNotFoundError):
                b.stat("/top/sub/f")
            with pytest.raises(FileNotFoundError):
                b.open("/top/sub/f", "rb")
            assert b.stat("/top/moved/f").size == 4
            a.makedirs("/top/sub")  # the old name again, another directory
            assert b.stat("/top/sub").ino != b.stat("/top/moved").ino
            with pytest.raises(FileNotFoundError):
                b.stat("/top/sub/f")
            a.remove("/top/moved/f")
            a.rmdir("/top/moved")
            with pytest.raises(FileNotFoundError):
                b.stat("/top/moved/f")
            with pytest.raises(FileNotFoundError):
                b.stat("/top/moved")
        finally:
            a.close()
            b.close()
