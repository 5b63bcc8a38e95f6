"""What attribute leases rest on: the keys a path walk depends on
(``Namespace.resolve(keys=...)``) and the keys a mutation writes (``SqliteStore.touched``),
and the service's lease table (granting, bounds, invalidation and the waits it causes).

The key property, table-driven over every kind of write: whenever a mutation changes what
a path resolves to (its attributes, or an error instead), the mutation wrote one of the
keys that resolution depended on -- so the lease on that answer is invalidated."""

from __future__ import annotations

import stat
from collections.abc import Callable
from typing import Any

import pytest
import trio
import trio.testing

from stripefs.metadata._leasetable import LeaseTable
from stripefs.metadata._namespace import RENAME_EXCHANGE, ROOT_INO, Namespace
from stripefs.metadata._sqlite import SqliteStore
from stripefs.wire._errors import StripefsError

CHAINS = [1, 2, 3]
PROBES = ["/", "/a", "/a/f", "/a/g", "/a/sub", "/a/sub/h", "/a/sub/..", "/a/sub/../f", "/b", "/lnk", "/lnk/x",
          "/dlnk", "/dlnk/h", "/a/new", "/b/f", "/b/moved", "/a/hard"]


@pytest.fixture
def ns(tmp_path) -> Any:
    store = SqliteStore(str(tmp_path / "meta.db"))
    ns = Namespace(store)
    ns.mkdir(ROOT_INO, "a", 0o755, 0, 0)
    ns.mkdir(ROOT_INO, "b", 0o755, 0, 0)
    ns.create_path("/a/f", 0o644, 0, 0, chains=CHAINS)
    ns.create_path("/a/g", 0o644, 0, 0, chains=CHAINS)
    sub = ns.mkdir(ns.resolve("/a").ino, "sub", 0o755, 0, 0)
    ns.create(sub.ino, "h", 0o644, 0, 0, chains=CHAINS)
    ns.symlink(ROOT_INO, "lnk", "/a/f", 0, 0)
    ns.symlink(ROOT_INO, "dlnk", "a/sub", 0, 0)
    _entries_and_inos(ns)
    yield ns
    store.close()


def _ino(ns: Namespace, path: str) -> int:
    return ns.resolve(path).ino


# Every kind of namespace write (the service's mutations map onto these).
_OPS: list[tuple[str, Callable[[Namespace], Any]]] = [
    ("create", lambda ns: ns.create(_ino(ns, "/a"), "new", 0o644, 0, 0, chains=CHAINS)),
    ("create truncate", lambda ns: ns.create(_ino(ns, "/a"), "f", 0o644, 0, 0, chains=CHAINS, truncate=True)),
    ("create_path", lambda ns: ns.create_path("/a/new", 0o644, 0, 0, chains=CHAINS)),
    ("create_many", lambda ns: ns.create_many(["/a/new", "/b/f"], 0o644, 0, 0, chains=CHAINS)),
    ("unlink_many", lambda ns: ns.unlink_many(["/a/f", "/a/sub/h"])),
    ("unlink", lambda ns: ns.unlink(_ino(ns, "/a"), "f")),
    ("unlink_path", lambda ns: ns.unlink_path("/a/g")),
    ("unlink symlink", lambda ns: ns.unlink(ROOT_INO, "lnk")),
    ("mkdir", lambda ns: ns.mkdir(_ino(ns, "/a"), "new", 0o755, 0, 0)),
    ("rmdir", lambda ns: (ns.unlink(_ino(ns, "/a/sub"), "h"), ns.rmdir(_ino(ns, "/a"), "sub"))),
    ("rename file", lambda ns: ns.rename(_ino(ns, "/a"), "f", _ino(ns, "/b"), "f")),
    ("rename over", lambda ns: ns.rename(_ino(ns, "/a"), "g", _ino(ns, "/a"), "f")),
    ("rename dir", lambda ns: ns.rename(_ino(ns, "/a"), "sub", _ino(ns, "/b"), "moved")),
    ("rename parent", lambda ns: ns.rename(ROOT_INO, "a", ROOT_INO, "c")),
    ("rename exchange", lambda ns: ns.rename(_ino(ns, "/a"), "f", _ino(ns, "/a"), "sub", RENAME_EXCHANGE)),
    ("link", lambda ns: ns.link(_ino(ns, "/a/f"), _ino(ns, "/a"), "hard")),
    ("symlink", lambda ns: ns.symlink(_ino(ns, "/a"), "new", "/b", 0, 0)),
    ("symlink_many replace", lambda ns: ns.symlink_many(ROOT_INO, ["lnk", "new"], ["/b", "/a"], 0, 0, replace=True)),
    ("mknod", lambda ns: ns.mknod(_ino(ns, "/a"), "new", stat.S_IFIFO | 0o644, 0, 0, 0, chains=[])),
    ("setattr mode", lambda ns: ns.setattr(_ino(ns, "/a/f"), mode=0o600)),
    ("setattr owner", lambda ns: ns.setattr(_ino(ns, "/a/sub"), uid=7, gid=8)),
    ("setattr times", lambda ns: ns.setattr(_ino(ns, "/a/f"), atime_ns=1, mtime_ns=2)),
    ("truncate", lambda ns: ns.setattr(_ino(ns, "/a/f"), size=5)),
    ("commit_length", lambda ns: ns.commit_length(_ino(ns, "/a/f"), 100)),
    ("setxattr", lambda ns: ns.setxattr(_ino(ns, "/a/f"), b"user.k", b"v")),
    ("removexattr", lambda ns: (ns.setxattr(_ino(ns, "/a/f"), b"user.k", b"v"),
                                ns.removexattr(_ino(ns, "/a/f"), b"user.k"))),
]


def _probe(ns: Namespace) -> dict[tuple[str, Any], tuple[Any, list[Any]]]:
    """Per probed path: what it resolves to (follow or not) and what its listing is, with
    the keys each answer depends on."""
    out: dict[tuple[str, Any], tuple[Any, list[Any]]] = {}
    for path in PROBES:
        for how in (True, False, "list"):
            keys: list[Any] = []
            try:
                found: Any = ns.list_names(path, "", 1000, keys) if how == "list" else ns.resolve(path, how, keys)
            except StripefsError as exc:
                found = exc.code
            out[(path, how)] = (found, keys)
    # Lookup(parent, name) and GetAttr(ino), by the numbers the probes had in the fixture.
    for parent, name in _ENTRIES:
        keys = []
        try:
            found = ns.lookup(parent, name, keys)
        except StripefsError as exc:
            found = exc.code
        out[((parent, name), "lookup")] = (found, keys)
    for ino in _INOS:
        keys = []
        try:
            found = ns.getattr(ino, keys)
        except StripefsError as exc:
            found = exc.code
        out[(ino, "getattr")] = (found, keys)
    return out


_ENTRIES: list[tuple[int, str]] = []  # (parent, name) pairs to look up: filled by the ``ns`` fixture
_INOS: list[int] = []  # inode numbers to get the attributes of


def _entries_and_inos(ns: Namespace) -> None:
    _ENTRIES.clear()
    _INOS.clear()
    for path in PROBES:
        parent, _, name = path.rpartition("/")
        try:
            _INOS.append(ns.resolve(path, False).ino)
            parent_ino = ns.resolve(parent or "/").ino
        except StripefsError:
            continue
        if name not in ("", "..") and (parent_ino, name) not in _ENTRIES:
            _ENTRIES.append((parent_ino, name))
    _ENTRIES.extend([(_ino(ns, "/a"), "new"), (_ino(ns, "/a"), "hard"), (_ino(ns, "/b"), "f"),
                     (_ino(ns, "/b"), "moved")])


@pytest.mark.parametrize("op", _OPS, ids=[o[0] for o in _OPS])
def test_a_write_that_changes_an_answer_touches_one_of_its_keys(ns: Namespace, op) -> None:
    before = _probe(ns)
    store = ns.store
    assert isinstance(store, SqliteStore)
    touched: set[Any] = set()
    store.touched = touched
    try:
        op[1](ns)
    finally:
        store.touched = None
    after = _probe(ns)
    changed = [k for k in before if before[k][0] != after[k][0]]
    assert changed, "the operation changed no probed answer: the case tests nothing"
    for k in changed:
        if isinstance(before[k][0], int) and not isinstance(before[k][0], bool):
            continue  # an error before (never cached, never leased)
        assert touched & set(before[k][1]), f"{k} changed, but none of its keys {before[k][1]} was written"


def test_resolve_keys_name_the_entries_and_inodes_walked(ns: Namespace) -> None:
    keys: list[Any] = []
    attr = ns.resolve("/lnk", True, keys)
    a = _ino(ns, "/a")
    lnk = ns.resolve("/lnk", False).ino
    assert keys == [(ROOT_INO, "lnk"), lnk, (ROOT_INO, "a"), (a, "f"), attr.ino]


def test_lookup_and_getattr_keys_name_the_entry_and_the_inode(ns: Namespace) -> None:
    a, f = _ino(ns, "/a"), _ino(ns, "/a/f")
    keys: list[Any] = []
    assert ns.lookup(a, "f", keys).ino == f
    assert keys == [(a, "f"), f]
    keys = []
    assert ns.getattr(f, keys).ino == f
    assert keys == [f]


def test_nothing_is_recorded_unless_asked(ns: Namespace) -> None:
    store = ns.store
    assert isinstance(store, SqliteStore) and store.touched is None
    ns.setattr(_ino(ns, "/a/f"), mode=0o600)
    assert store.touched is None


# -- the lease table -------------------------------------------------------------------------
A, B = b"a" * 16, b"b" * 16


def _run(fn: Callable[[], Any]) -> None:
    trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))


def test_grants_only_to_a_watching_client_and_within_its_cap() -> None:
    async def main() -> None:
        table = LeaseTable(5.0, max_per_client=2)
        assert table.grant(B, [1]) == (0, 0)  # no watch yet
        assert (await table.watch(B, 0, 10))[1:] == ([], False)
        first = table.grant(B, [1, (1, "x")])
        assert first[0] and first[1] == 5000
        assert table.grant(B, [2])[0]
        assert table.grant(B, [3]) == (0, 0)  # the cap: refused, nothing evicted
        assert len(table) == 2
        since = table.changes
        table.invalidate({99}, A)
        assert table.grant(B, [4], since) == (0, 0)  # an invalidation during the read
        assert LeaseTable(0).grant(B, [1]) == (0, 0)

    _run(main)


def test_a_key_changed_under_other_holders_is_not_leased_while_hot() -> None:
    """A key whose change had another holder to wait for gets no lease for ``hot`` seconds
    (longer while it keeps changing so), then again; a change that nobody else held, or the
    mutator's own, leaves it leasable. A directory that many readers list and a writer keeps
    creating in then costs each create no acknowledgements."""
    async def main() -> None:
        table = LeaseTable(5.0, hot=1.0)
        await table.watch(A, 0, 10)
        await table.watch(B, 0, 10)
        assert table.grant(B, [7])[0]
        assert table.invalidate({7}, A)  # B held it: waited for, and 7 is hot now
        assert table.grant(B, [7]) == (0, 0)
        assert table.grant(B, [8])[0]  # other keys are not
        await trio.sleep(0.6)
        assert table.invalidate({7}, A) == []  # nobody holds it, but it is still changing: hot on
        await trio.sleep(0.6)
        assert table.grant(B, [7]) == (0, 0)
        await trio.sleep(0.5)
        lease, _ = table.grant(B, [7])
        assert lease  # quiet for a second: leased again
        table.grant(A, [9])
        assert table.invalidate({9}, A) == []  # the mutator's own lease: not hot
        assert table.grant(B, [9])[0]
        assert LeaseTable(5.0, hot=0).hot == 0

    _run(main)


def test_a_change_waits_for_the_holders_ack() -> None:
    async def main() -> None:
        table = LeaseTable(5.0)
        seq, _, _ = await table.watch(B, 0, 10)
        lease, _ = table.grant(B, [7, (1, "f")])
        table.grant(A, [7])  # the mutator's own lease: removed, never waited for
        got: list[Any] = []

        async def holder() -> None:
            got.append(await table.watch(B, seq, 10))
            await trio.sleep(0.3)  # the client drops its entries, then acknowledges
            got.append(trio.current_time())
            await table.watch(B, got[0][0], 0)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(holder)
            await trio.sleep(0.1)
            waits = table.invalidate({(1, "f")}, A)
            assert len(waits) == 1 and len(table) == 0
            await table.wait(waits)
            done = trio.current_time()
        assert got[0][1] == [lease] and not got[0][2]
        assert done >= got[1]  # not before the acknowledgement
        assert done < 1.0  # nor until the lease ran out

    _run(main)


def test_the_mutators_own_lease_lives_on_and_hears_of_the_next_change() -> None:
    """A client's own change neither waits for it nor ends its lease: the next change by
    someone else to the same keys is told to it (a FUSE kernel keeps what it was told)."""
    async def main() -> None:
        table = LeaseTable(5.0)
        seq, _, _ = await table.watch(A, 0, 10)
        await table.watch(B, 0, 10)
        lease, _ = table.grant(A, [7, (1, "f")])
        assert lease
        assert table.invalidate({7}, A) == []  # its own change: nobody waited for
        assert len(table) == 1
        waits = table.invalidate({(1, "f")}, B)
        assert [w[0].client for w in waits] == [A]
        assert (await table.watch(A, seq, 10))[1] == [lease]
        assert len(table) == 0

    _run(main)


def test_a_silent_holder_delays_a_change_until_its_lease_expires() -> None:
    async def main() -> None:
        table = LeaseTable(2.0)
        await table.watch(B, 0, 10)
        table.grant(B, [7])
        start = trio.current_time()
        await table.wait(table.invalidate([7], A))
        assert 1.9 <= trio.current_time() - start <= 2.1
        assert table.invalidate([7], A) == []  # nothing left to tell

    _run(main)


def test_a_watch_the_table_never_saw_is_told_to_reset() -> None:
    async def main() -> None:
        table = LeaseTable(2.0)
        assert await table.watch(B, 57, 10) == (1, [], True)  # a restarted service
        assert (await table.watch(B, 0, 10))[2] is False
        with trio.move_on_after(1):
            assert await table.watch(B, 1, 0.5) == (1, [], False)  # nothing to say: answered after the wait

    _run(main)


def test_expired_leases_are_purged() -> None:
    async def main() -> None:
        table = LeaseTable(1.0)
        await table.watch(B, 0, 10)
        table.grant(B, [1])
        table.purge()
        assert len(table) == 1
        await trio.sleep(1.1)
        table.purge()
        assert len(table) == 0 and table.invalidate([1], A) == []

    _run(main)


def test_a_service_grants_leases_where_it_sees_every_mutation(store) -> None:
    """SQLite: one service sees every mutation. PostgreSQL: services hear each other's
    (``_leasebus.py``; ``test_pg_leases.py``) and grant once they do -- not here, where
    the bus is not run: the watch is accepted, a Resolve carries no lease. The in-memory
    store records no keys: the watch is refused."""
    from stripefs.metadata._membership import Membership
    from stripefs.metadata._memstore import MemoryStore
    from stripefs.metadata._service import MetadataService
    from stripefs.wire import ErrorCode
    from stripefs.wire import messages as m

    ns = Namespace(store)
    ns.mkdir(ROOT_INO, "d", 0o755, 0, 0)
    svc = MetadataService(ns, lambda doc, restarted: Membership(None, 1, doc=doc, restarted=restarted), "s" * 32)
    grants = isinstance(store, SqliteStore)
    watches = not isinstance(store, MemoryStore)
    assert svc.lease_table.enabled is watches

    class Conn:
        client_id = B

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(svc.commit.run)
            if watches:
                assert (await svc.grants.watch(Conn(), m.WatchLeases(after=0))).reset is False
            else:
                with pytest.raises(StripefsError) as info:
                    await svc.grants.watch(Conn(), m.WatchLeases(after=0))
                assert info.value.code == ErrorCode.NOT_SUPPORTED
            f = ns.create(ROOT_INO, "f", 0o644, 0, 0, chains=CHAINS)[0].ino
            for ask in (m.Resolve(path="/", lease=True), m.Lookup(parent=ROOT_INO, name="d", lease=True),
                        m.GetAttr(ino=f, lease=True)):
                reply = await svc.grants.reply(Conn(), ask)
                assert (reply.lease_ms > 0) is grants, ask
                assert (reply.lease_id > 0) is grants, ask
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_lease_asked_only_when_true_on_the_wire() -> None:
    """A client that does not ask sends what it always did (older services understand it)."""
    from stripefs.wire import messages as m

    assert m.Lookup(parent=1, name="x").to_header() == {"parent": 1, "name": "x"}
    assert m.Lookup(parent=1, name="x", lease=True).to_header() == {"parent": 1, "name": "x", "lease": True}
    assert m.GetAttr(ino=3).to_header() == {"ino": 3}
    assert m.GetAttr(ino=3, lease=True).to_header() == {"ino": 3, "lease": True}


def test_a_directorys_lookup_lease_leaves_its_attributes_to_the_listing_lease(tmp_path) -> None:
    """A create or unlink in a directory changes its attributes: a mount that only looked
    the directory up (walked through it) must not hold a lease on them, only on its entry;
    a mount that listed it in full holds one on them (the names it keeps depend on them)."""
    from stripefs.metadata._membership import Membership
    from stripefs.metadata._service import MetadataService
    from stripefs.wire import messages as m

    store = SqliteStore(str(tmp_path / "meta.db"))
    ns = Namespace(store)
    d = ns.mkdir(ROOT_INO, "d", 0o755, 0, 0).ino
    f = ns.create(d, "f", 0o644, 0, 0, chains=CHAINS)[0].ino
    svc = MetadataService(ns, lambda doc, restarted: Membership(None, 1, doc=doc, restarted=restarted), "s" * 32)
    svc.lease_table.hot = 0  # which keys each lease covers: keys told here are asked for again at once

    class Conn:
        client_id = B

    def told(keys: set[Any]) -> bool:
        return bool(svc.lease_table.invalidate(keys, A))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(svc.commit.run)
            await svc.grants.watch(Conn(), m.WatchLeases(after=0))
            looked = await svc.grants.reply(Conn(), m.Lookup(parent=ROOT_INO, name="d", lease=True))
            assert looked.lease_id and looked.attr.ino == d
            assert not told({d}), "a create in d waits for a mount that only walked through it"
            assert told({(ROOT_INO, "d")}), "a rename or rmdir of d must still take the entry back"
            nothing = await svc.grants.reply(Conn(), m.GetAttr(ino=d, lease=True))
            assert (nothing.lease_id, nothing.lease_ms) == (0, 0)
            assert (await svc.grants.reply(Conn(), m.Lookup(parent=d, name="f", lease=True))).lease_id
            assert told({f})  # a file's lookup lease still covers its attributes
            assert (await svc.grants.reply(Conn(), m.Resolve(path="/d", lease=True))).lease_id
            assert told({d})  # a native stat of the directory asked for its attributes
            for read in (svc._read_reply, lambda c, q: _now(svc, c, q)):
                listed = await read(Conn(), m.Readdir(ino=d, limit=10, plus=True, lease=True))  # short: on the loop too
                assert [e.name for e in listed.entries] == ["f"] and listed.lease_id and listed.lease_ms
                assert told({d}), "a listing lease covers the directory's attributes"
            partial = await svc._read_reply(Conn(), m.Readdir(ino=d, limit=1, after="", lease=True))
            assert partial.lease_id  # one page that is the whole listing
            g = ns.create(d, "g", 0o644, 0, 0, chains=CHAINS)[0].ino
            first = await svc._read_reply(Conn(), m.Readdir(ino=d, limit=1, lease=True))
            assert first.more and (first.lease_id, first.lease_ms) == (0, 0)
            rest = await svc._read_reply(Conn(), m.Readdir(ino=d, after="f", lease=True))
            assert not rest.more and (rest.lease_id, rest.lease_ms) == (0, 0)
            unasked = await svc._read_reply(Conn(), m.Readdir(ino=d))
            assert (unasked.lease_id, unasked.lease_ms) == (0, 0)
            # Asked for each page (a listing fetched page by page): every page is leased,
            # on the directory and, with attributes and layouts, on the page's files.
            paged = dict(limit=1, plus=True, lease=True, lease_each_page=True)
            first = await svc._read_reply(Conn(), m.Readdir(ino=d, **paged))
            assert first.more and first.lease_id and first.lease_ms
            assert told({d})
            first = await svc._read_reply(Conn(), m.Readdir(ino=d, **paged))
            rest = await svc._read_reply(Conn(), m.Readdir(ino=d, after="f", **paged))
            assert [e.name for e in rest.entries] == ["g"] and not rest.more and rest.lease_id
            assert told({g}), "a page's lease covers its files' attributes"
            assert told({f}), "... and the other page's, which that did not take back, its own"
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        store.close()


async def _now(svc: Any, conn: Any, msg: Any) -> Any:
    """``msg`` answered on the loop (``answer_now``), as a reply."""
    header = svc.answer_now(conn, None, msg)
    assert header is not None
    return type(msg).Reply.from_header(header)


def test_readdir_lease_fields_are_off_the_wire_at_their_defaults() -> None:
    from stripefs.wire import messages as m

    assert "lease" not in m.Readdir(ino=3).to_header()
    assert "lease_each_page" not in m.Readdir(ino=3, lease=True).to_header()
    each = m.Readdir(ino=3, lease=True, lease_each_page=True)
    assert m.decode_message(m.Readdir.MSG_ID, each.to_header()) == each
    assert m.Readdir(ino=3, lease=True).to_header()["lease"] is True
    assert m.decode_message(m.Readdir.MSG_ID, m.Readdir(ino=3, lease=True).to_header()) == m.Readdir(ino=3, lease=True)
    empty = {"name": [], "ino": [], "mode": []}
    assert m.ReaddirReply(entries=[], more=False).to_header() == {"columns": empty, "more": False}
    leased = m.ReaddirReply(entries=[], more=False, lease_id=7, lease_ms=2000)
    assert leased.to_header() == {"columns": empty, "more": False, "lease_id": 7, "lease_ms": 2000}
    assert m.ReaddirReply.from_header(leased.to_header()) == leased
    assert m.ReaddirReply.from_header({"entries": [], "more": True}) == m.ReaddirReply(entries=[], more=True)
