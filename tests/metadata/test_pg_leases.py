"""Attribute leases with several metadata services on one PostgreSQL store (issue 35).

A client holding a lease through service A is told of a change made through service B
before B acknowledges it (``metadata/_leasebus.py``): the change's keys go out with
``pg_notify`` in its commit, A invalidates them in its own table and acknowledges back.
A service that cannot hear the others stops granting and ends the leases it granted.

Services run in-process (``serve_metadata`` in a trio nursery, as in
``test_multi_service.py``) and are spoken to over real loopback connections: a holder is
a raw client that keeps a ``WatchLeases`` in flight and records what it is told. Then:
``test_lease_keys.py``'s key property on what PostgreSQL publishes, the lease table's
per-key refusal, the payload split, and the native client's coherence cases
(``tests/core/test_attr_leases.py``) across two service processes of a real cluster.
"""

from __future__ import annotations

import itertools
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from stripefs.metadata import _leasebus
from stripefs.metadata._leasebus import FRESH, LeaseBus
from stripefs.metadata._service import serve_metadata
from stripefs.rpc import TrioConnection
from stripefs.wire import role_credential
from stripefs.wire import messages as m

SECRET = "pg-lease-test-secret-0123456789abcdef"
CLIENT = role_credential(SECRET, "client")
TTL = 1.5
_schemas = itertools.count()


@pytest.fixture
def pg_schema(request: pytest.FixtureRequest) -> Iterator[str]:
    """A URL whose search_path is a fresh, empty schema of the session's PostgreSQL."""
    import psycopg

    url = request.getfixturevalue("pg_url")
    schema = f"pl{os.getpid()}_{next(_schemas)}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    yield f"{url}?options=-csearch_path%3D{schema}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA {schema} CASCADE")


@pytest.fixture
def buses(monkeypatch: pytest.MonkeyPatch) -> list[LeaseBus]:
    """Every ``LeaseBus`` made during the test, in the order its service started."""
    made: list[LeaseBus] = []
    init = LeaseBus.__init__

    def record(self: LeaseBus, *args: Any, **kw: Any) -> None:
        init(self, *args, **kw)
        made.append(self)

    monkeypatch.setattr(LeaseBus, "__init__", record)
    return made


async def _call(conn: TrioConnection, msg: Any) -> Any:
    header, _ = await conn.call(msg)
    return m.decode_reply(msg, header)


async def _services(nursery: trio.Nursery, tmp_path: Path, url: str, n: int = 2,
                    ttl: float = TTL) -> list[tuple[str, int]]:
    out = []
    for i in range(n):
        out.append(await nursery.start(lambda task_status, i=i: serve_metadata(
            str(tmp_path / f"s{i}"), secret=SECRET, store_url=url, lease_ttl=ttl, task_status=task_status)))
    return out


class Holder:
    """A client of one service that holds leases: its watch (a connection of its own)
    records every lease id it is told of, and acknowledges unless ``acking`` is off."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.client = os.urandom(16)
        self.conn = TrioConnection(address, CLIENT, client_id=self.client)
        self._watch = TrioConnection(address, CLIENT, client_id=self.client)
        self.told: list[int] = []
        self.acking = True
        self.seq = 0
        self.asked_at = 0.0

    async def start(self, nursery: trio.Nursery) -> None:
        self.seq = (await _call(self._watch, m.WatchLeases(after=0, wait_ms=0))).seq
        nursery.start_soon(self._run)

    async def _run(self) -> None:
        while True:
            reply = await _call(self._watch, m.WatchLeases(after=self.seq, wait_ms=10_000))
            self.told += reply.lease_ids
            self.seq = reply.seq  # acknowledged by the next watch (none once acking is off)
            if not self.acking:
                return

    async def leased(self, path: str) -> m.AttrReply:
        """``path``'s attributes under a lease (asked again while the service is not granting yet)."""
        for _ in range(200):
            self.asked_at = trio.current_time()  # the lease ends TTL after its grant, later than this
            reply = await _call(self.conn, m.Resolve(path=path, lease=True))
            if reply.lease_id:
                return reply
            await trio.sleep(0.02)
        raise AssertionError(f"no lease on {path}")


async def _setup(address: tuple[str, int]) -> tuple[int, int]:
    """``/d/f``, a FIFO (no storage server here to hold a file's chunks; a file's length
    is the native client's case, at the end)."""
    c = TrioConnection(address, CLIENT)
    d = (await _call(c, m.Mkdir(parent=1, name="d", mode=0o755))).attr.ino
    return d, (await _call(c, m.Mknod(parent=d, name="f", mode=stat.S_IFIFO | 0o644, rdev=0))).attr.ino


async def _granting(address: tuple[str, int], want: bool, within: float) -> None:
    conn = TrioConnection(address, CLIENT)
    deadline = trio.current_time() + within
    while (await _call(conn, m.ClusterStatus())).metadata["leases_granted"] != want:
        assert trio.current_time() < deadline, f"leases_granted is not {want} after {within} s"
        await trio.sleep(0.02)


# (name, the mutation through the other service, what the holder then sees at the path)
async def _chmod(c: TrioConnection, d: int, ino: int) -> None:
    await _call(c, m.SetAttr(ino=ino, mode=0o600))


async def _rename(c: TrioConnection, d: int, ino: int) -> None:
    await _call(c, m.Rename(parent=d, name="f", new_parent=d, new_name="g"))


async def _utime(c: TrioConnection, d: int, ino: int) -> None:
    await _call(c, m.SetAttr(ino=ino, mtime_ns=123_000_000_000))


async def _unlink(c: TrioConnection, d: int, ino: int) -> None:
    await _call(c, m.Unlink(parent=d, name="f"))


_MUTATIONS = [("chmod", _chmod), ("rename", _rename), ("utime", _utime), ("unlink", _unlink)]


@pytest.mark.parametrize("name,mutate", _MUTATIONS, ids=[n for n, _ in _MUTATIONS])
def test_a_change_through_one_service_reaches_a_holder_of_another_first(tmp_path: Path, pg_schema: str,
                                                                        name: str, mutate: Any) -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            a, b = await _services(nursery, tmp_path, pg_schema)
            y = TrioConnection(b, CLIENT)
            d, ino = await _setup(a)
            x = Holder(a)
            await x.start(nursery)
            lease = await x.leased("/d/f")
            await mutate(y, d, ino)  # acknowledged by B: A's holder was told before
            assert lease.lease_id in x.told, f"{name}: acknowledged before the holder at A was told"
            try:  # what X's next stat would fetch, the lease gone
                now = (await _call(x.conn, m.Resolve(path="/d/f"))).attr
            except FileNotFoundError:
                now = None
            assert now != lease.attr
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_holder_that_does_not_acknowledge_delays_a_change_by_its_lease_only(tmp_path: Path,
                                                                              pg_schema: str) -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            a, b = await _services(nursery, tmp_path, pg_schema)
            y = TrioConnection(b, CLIENT)
            d, ino = await _setup(a)
            x = Holder(a)
            await x.start(nursery)
            x.acking = False  # its watch in flight answers once, and is never followed
            lease = await x.leased("/d/f")
            await _chmod(y, d, ino)
            held = trio.current_time() - x.asked_at  # (services and test share one trio clock)
            assert lease.lease_id in x.told
            assert TTL <= held < TTL + FRESH + 2.0, held
            # A holder elsewhere that is not told anything costs nothing.
            t0 = trio.current_time()
            await _call(y, m.Mknod(parent=d, name="other", mode=stat.S_IFIFO | 0o644, rdev=0))
            assert trio.current_time() - t0 < 0.5
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_service_that_cannot_listen_stops_granting_and_ends_its_leases(tmp_path: Path, pg_schema: str,
                                                                          buses: list[LeaseBus]) -> None:
    import psycopg

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            a, b = await _services(nursery, tmp_path, pg_schema)
            bus_a = buses[0]
            await _setup(a)
            x = Holder(a)
            await x.start(nursery)
            lease = await x.leased("/d/f")
            await _granting(a, True, 5.0)

            def refused() -> Any:
                raise psycopg.OperationalError("listening refused by the test")

            bus_a._listening = refused  # type: ignore[method-assign]
            with psycopg.connect(pg_schema, autocommit=True) as admin:
                cut = admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                    "WHERE application_name = %s", (f"{bus_a.channel} listen {bus_a.id}",)).fetchall()
            assert cut == [(True,)]
            await _granting(a, False, 2.0)
            with trio.fail_after(2.0):
                while lease.lease_id not in x.told:  # its leases ended: the holder was told
                    await trio.sleep(0.01)
            again = await _call(x.conn, m.Resolve(path="/d/f", lease=True))
            assert again.lease_id == 0 and again.attr == lease.attr
            await _granting(b, True, 1.0)  # the other service goes on granting
            del bus_a._listening  # connecting again: A grants again once its ping comes back
            await _granting(a, True, 5.0)
            assert (await x.leased("/d/f")).lease_id
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_service_whose_pings_stop_coming_back_stops_granting(tmp_path: Path, pg_schema: str,
                                                              buses: list[LeaseBus]) -> None:
    """A listening connection that is silently cut looks like one whose pings no longer
    come back: cut the pings instead (the connection that sends them, kept from reconnecting)."""
    import psycopg

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            a, _ = await _services(nursery, tmp_path, pg_schema)
            bus_a = buses[0]
            await _granting(a, True, 5.0)
            connect = bus_a._connect

            def no_sender(purpose: str) -> Any:
                if purpose == "send":
                    raise psycopg.OperationalError("sending refused by the test")
                return connect(purpose)

            bus_a._connect = no_sender  # type: ignore[method-assign]
            with psycopg.connect(pg_schema, autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
                              (f"{bus_a.channel} send {bus_a.id}",))
            t0 = trio.current_time()
            await _granting(a, False, FRESH + 1.0)
            assert trio.current_time() - t0 <= FRESH + 0.5
            del bus_a._connect
            await _granting(a, True, 5.0)
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_retry_answered_from_another_services_record_waits_for_a_barrier_only(tmp_path: Path,
                                                                                pg_schema: str) -> None:
    """The service that applied it may have died before its holders were told: the retry's
    service publishes a barrier, done everywhere once what was heard before it is."""
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            a, b = await _services(nursery, tmp_path, pg_schema)
            d, ino = await _setup(a)
            x = Holder(a)
            await x.start(nursery)
            lease = await x.leased("/d/f")
            client = os.urandom(16)
            first = await _call(TrioConnection(b, CLIENT, client_id=client), m.SetAttr(ino=ino, mode=0o600))
            assert lease.lease_id in x.told
            t0 = trio.current_time()
            again = await _call(TrioConnection(a, CLIENT, client_id=client), m.SetAttr(ino=ino, mode=0o600))
            assert again == first and trio.current_time() - t0 < FRESH  # not the whole bound
            nursery.cancel_scope.cancel()

    trio.run(main)


# -- the keys a PostgreSQL transaction publishes -----------------------------------------------

def _pg_ops() -> list[Any]:
    from tests.metadata.test_lease_keys import _OPS

    return _OPS


@pytest.mark.parametrize("op", _pg_ops(), ids=[o[0] for o in _pg_ops()])
def test_a_write_that_changes_an_answer_publishes_one_of_its_keys(tmp_path: Path, request: pytest.FixtureRequest,
                                                                  op: Any) -> None:
    """``test_lease_keys.py``'s property on the PostgreSQL store: what it publishes
    (``PostgresStore.publish_keys``, captured here instead of sent) covers every
    answer the write changed."""
    from stripefs.metadata._namespace import ROOT_INO, Namespace
    from tests.metadata.conftest import make_store
    from tests.metadata.test_lease_keys import CHAINS, _entries_and_inos, _probe

    store: Any = make_store("postgresql", tmp_path, request)
    try:
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
        before = _probe(ns)
        published: list[tuple[bytes, set[Any]]] = []
        store.publish_keys(lambda number, groups, barrier: published.extend(groups) or [])
        op[1](ns)
        store.publish_keys(lambda number, groups, barrier: [])
        touched = set().union(*(keys for _, keys in published))
        after = _probe(ns)
        changed = [k for k in before if before[k][0] != after[k][0]]
        assert changed, "the operation changed no probed answer: the case tests nothing"
        for k in changed:
            if isinstance(before[k][0], int) and not isinstance(before[k][0], bool):
                continue  # an error before (never cached, never leased)
            assert touched & set(before[k][1]), f"{k} changed, but none of its keys {before[k][1]} was published"
    finally:
        store.close()


def test_a_read_on_a_thread_is_refused_only_for_a_change_to_its_own_keys() -> None:
    """Services sharing a store hear every service's changes: a read that overlapped one
    on other keys is still granted (``LeaseTable.track_keys``); SQLite's table refuses it."""
    import trio.testing

    from stripefs.metadata._leasetable import LeaseTable

    async def main() -> None:
        for tracked in (True, False):
            table = LeaseTable(5.0)
            if tracked:
                table.track_keys()
            await table.watch(b"x" * 16, 0, 0.0)  # a new watch: answered at once, live since
            since = table.changes
            table.invalidate([7, (1, "other")], b"y" * 16)
            assert bool(table.grant(b"x" * 16, [3, (1, "f")], since)[0]) is tracked
            since = table.changes
            table.invalidate([3], b"y" * 16)
            assert table.grant(b"x" * 16, [3, (1, "f")], since) == (0, 0)
            since = table.changes
            table.revoke_all()
            assert table.grant(b"x" * 16, [99], since) == (0, 0)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_large_publications_are_split_under_the_payload_limit() -> None:
    groups = [(b"\x01" * 16, {(7, f"name-{i:05d}-" + "x" * 40) for i in range(500)} | set(range(1000, 1300)))]
    groups += [(bytes([k]) * 16, {k, (k, "\udcff-é")}) for k in range(2, 256)]  # many clients, odd names
    parts = _leasebus.payloads("ab" * 8, 3, groups, True)
    assert len(parts) > 1 and all(len(p.encode()) < 8000 for p in parts)
    import json

    found: dict[bytes, set[Any]] = {}
    for i, p in enumerate(parts):
        msg = json.loads(p)
        assert msg["n"] == 3 and msg["last"] == (i == len(parts) - 1) and msg.get("b", False) == msg["last"]
        for client, ks in msg["g"]:
            found.setdefault(bytes.fromhex(client), set()).update(tuple(k) if isinstance(k, list) else k for k in ks)
    assert found == dict(groups)


def test_a_directory_listing_lease_is_told_of_a_create_elsewhere(tmp_path: Path, pg_schema: str) -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            a, b = await _services(nursery, tmp_path, pg_schema)
            y = TrioConnection(b, CLIENT)
            d = (await _call(y, m.Mkdir(parent=1, name="d", mode=0o755))).attr.ino
            x = Holder(a)
            await x.start(nursery)
            for _ in range(200):
                names = await _call(x.conn, m.ListNames(path="/d", lease=True))
                if names.lease_id:
                    break
                await trio.sleep(0.02)
            assert names.lease_id and names.names == []
            await _call(y, m.Mknod(parent=d, name="fifo", mode=stat.S_IFIFO | 0o644, rdev=0))
            assert names.lease_id in x.told
            nursery.cancel_scope.cancel()

    trio.run(main)


# -- the native client, two service processes ------------------------------------------------

@pytest.fixture(scope="module")
def pg_two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from stripefs.fsclient.testing import LocalCluster, LocalPostgres, postgres_bin
    from tests.conftest import TEST_CHUNK

    if postgres_bin("initdb") is None:
        pytest.skip("PostgreSQL server binaries are not installed (apt-get install postgresql)")
    root = tmp_path_factory.mktemp("pgleases")
    try:
        with LocalCluster.start(str(root), servers=2, metadata_store="postgresql", metadata_services=2,
                                chunk_size=TEST_CHUNK, lease_ttl=2.0) as cluster:
            leader = next(i for i in range(2) if _status(cluster, i)["leader"])
            with _at(cluster, leader) as c:
                c.write_bytes("/first", b"x")  # the first file freezes the chain table, on the leader
            yield cluster
    finally:
        LocalPostgres(str(root)).destroy()


def _at(cluster: Any, i: int, **kw: Any) -> Any:
    from stripefs.fsclient import Client

    s = cluster.data["metadata_services"][i]
    return Client(f"{s['host']}:{s['port']}", secret=role_credential(cluster.data["secret"], "client"), **kw)


def _status(cluster: Any, i: int) -> dict[str, Any]:
    with _at(cluster, i) as c:
        return c.status().metadata


def _case_ids() -> list[str]:
    from tests.core.test_attr_leases import _CASES

    return [c[0] for c in _CASES]


@pytest.mark.parametrize("case", _case_ids())
def test_the_native_clients_changes_cross_services(pg_two: Any, case: str) -> None:
    """``tests/core/test_attr_leases.py``'s table: the holder on one service, the writer
    (and the uncached oracle) on the other."""
    from tests.core.test_attr_leases import _CASES, _cached, _fresh, _leased, _watching

    _name, setup, rels, mutate = next(c for c in _CASES if c[0] == case)
    holder, writer, plain = _watching(_at(pg_two, 0)), _at(pg_two, 1), _at(pg_two, 1, leases=False)
    try:
        d = f"/x{os.urandom(4).hex()}"
        writer.makedirs(d)
        setup(writer, d)
        paths = [d + r for r in rels]
        before = {p: _leased(holder, p) for p in paths}
        mutate(writer, d)
        after = {p: _cached(holder, p) for p in paths}
        assert after == {p: _fresh(plain, p) for p in paths}
        assert after != before
    finally:
        for c in (holder, writer, plain):
            c.close()


def test_a_repeated_stat_through_a_shared_store_is_answered_from_the_lease(pg_two: Any) -> None:
    from stripefs.fsclient.testing.procs import while_paused
    from tests.core.test_attr_leases import _leased, _watching

    holder, writer = _watching(_at(pg_two, 0)), _at(pg_two, 1)
    try:
        path = f"/r{os.urandom(4).hex()}"
        writer.write_bytes(path, b"abc")
        first = _leased(holder, path)
        pid = int(pg_two.data["metadata_services"][0]["pid"])
        got = while_paused(pid, lambda: [holder.stat(path) for _ in range(50)], 2.0)
        assert got == [first] * 50
    finally:
        holder.close()
        writer.close()
