"""A truncate whose cut fails never brings old bytes back, and never loses acknowledged writes.

Issue #27 item 1: the metadata service commits a truncate's new size, then has the storage
servers cut the bytes past it. When a server is down the client is told EIO, but the size
is committed; the cut used to be dropped from the queue unapplied, so extending the file
later showed the old bytes. Now the cut stays queued until it lands (the file may not grow
meanwhile), a server that missed it is held offline until it is cut, and writers whose
bytes a late cut may have dropped are refused their commit.

The cluster tests run real processes on 127.0.0.1 (two storage servers, one replica).
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import time
from pathlib import Path

import pytest

from stripefs.fsclient import Client
from stripefs.metadata import Namespace
from stripefs.metadata._membership import Membership
from stripefs.metadata._sqlite import SqliteStore
from stripefs.metadata._store import Store
from stripefs.wire import ErrorCode, StripefsError
from stripefs.wire import messages as m
from tests.conftest import TEST_CHUNK
from tests.replication.test_replication import server_pid, wait_all_serving

AB = b"\xab"
FILE = 0o100644


# ----------------------------------------------------------------------------- helpers

def _holder(c: Client, path: str, index: int = 0) -> int:
    """The storage server that holds chunk ``index`` of ``path`` (one replica)."""
    chain = c.stat(path).layout.chain_of(index)
    return c.routing(refresh=True).chains[chain][0]


def _other(c: Client, sid: int) -> int:
    return next(s.server_id for s in c.status().servers if s.server_id != sid)


def _kill(c: Client, h, sid: int) -> None:
    """kill -9 storage server ``sid``; returns once its port refuses connections."""
    info = next(s for s in c.status().servers if s.server_id == sid)
    os.kill(server_pid(h, sid), signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection((info.host, info.port), timeout=0.5).close()
        except OSError:
            return
        time.sleep(0.05)
    raise AssertionError(f"storage server {sid} still accepts connections")


def _state(c: Client, sid: int) -> str:
    return next(s.state for s in c.status().servers if s.server_id == sid)


def _wait(pred, timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _chunk_gone(c: Client, sid: int, ino: int, index: int) -> bool:
    try:
        c.call_storage(sid, m.StatChunk(ino=ino, index=index))
    except StripefsError as exc:
        if exc.code == ErrorCode.NOT_FOUND:
            return True
        raise
    return False


def _failed_truncate(h, size: int, *, kill_holder_of_chunk0: bool, write: bool = True) -> tuple[int, int, int]:
    """Write ``size`` bytes of 0xAB to /f (unless ``write`` is false: written already),
    kill one server, truncate /f to 0 (EIO). Returns ``(ino, killed server, live server)``.
    """
    with h.client() as c:
        if write:
            c.write_bytes("/f", AB * size)
        a = _holder(c, "/f")
        b = a if kill_holder_of_chunk0 else _other(c, a)
        live = _other(c, b)
        ino = c.stat("/f").ino
        _kill(c, h, b)
        with pytest.raises(OSError) as err:
            c.truncate("/f", 0)
        assert err.value.errno == errno.EIO
        assert c.stat("/f").size == 0  # the size was committed all the same
    return ino, b, live


# ----------------------------------------------------------------------------- the cluster

def test_failed_truncate_then_extend_reads_zeros(make_cluster) -> None:
    """The reproduction of issue #27: failed truncate, restart, extend, read."""
    size = 32 << 20
    h = make_cluster(servers=2, replicas=1)
    _ino, _b, _live = _failed_truncate(h, size, kill_holder_of_chunk0=True)
    h.up()  # the killed server comes back with its 0xAB chunks
    with h.client() as c:
        c.truncate("/f", size)
        data = c.read_bytes("/f")
    assert len(data) == size
    assert data.count(AB) == 0, f"{data.count(AB)} bytes cut by the failed truncate came back"


def _open_when_free(path: str, timeout: float = 10.0) -> SqliteStore:
    """The store, once the stopped service's writer lock is gone (a process stopped a
    moment ago may still be closing its files; seen once on a loaded CI machine)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return SqliteStore(path)
        except StripefsError as exc:
            if exc.code != ErrorCode.BUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_cut_queued_by_a_dead_metadata_service_lands_at_restart(make_cluster) -> None:
    """The service commits the truncate and dies before any storage server cut a byte
    (simulated: the cluster is stopped and the truncate committed on its store alone).
    The restarted service's first collector pass applies the cut."""
    size = 4 << 20
    h = make_cluster(servers=2, replicas=1)
    with h.client() as c:
        c.write_bytes("/f", AB * size)
        ino = c.stat("/f").ino
        last = size // TEST_CHUNK - 1
        holders = {i: _holder(c, "/f", i) for i in (0, last)}
    h.down()
    store = _open_when_free(os.path.join(h.root, "meta", "meta.db"))
    try:
        assert Namespace(store).setattr(ino, size=0).size == 0  # the commit, and no cut
    finally:
        store.close()
    h.up()
    with h.client() as c:
        wait_all_serving(c, 2)
        for index, sid in holders.items():
            _wait(lambda: _chunk_gone(c, sid, ino, index), 10, f"chunk {index} cut on server {sid}")
        c.truncate("/f", size)
        assert c.read_bytes("/f") == bytes(size)


def test_writers_during_a_pending_cut_are_told(make_cluster) -> None:
    """Writers that opened after a failed truncate and wrote past its cut get an error
    (at fsync while the cut is pending; at close when it landed after their bytes), never
    a success over bytes the cut dropped; a writer after the cut landed is unaffected."""
    size = 4 << 20
    h = make_cluster(servers=2, replicas=1)
    ino, b, live = _failed_truncate(h, size, kill_holder_of_chunk0=False)
    with h.client() as c:
        assert _holder(c, "/f") == live
        early = c.open("/f", "r+b")  # writes chunk 0, on the live server, while the cut is pending
        early.write(b"e" * 1000)
        with pytest.raises(OSError) as err:
            early.fsync()
        assert err.value.errno == errno.EIO
        with pytest.raises(OSError):
            early.close()  # and stays failed: no later success commits a length
        assert c.stat("/f").size == 0

        late = c.open("/f", "r+b")
        late.write(b"w" * 1000)
        late.flush()  # on the server, not committed: the late cut will drop it
        seen = c.stat("/f").truncations
        h.up()  # the killed server returns; the cut lands on it, and on chunk 0 again
        _wait(lambda: c.stat("/f").truncations > seen, 15, "the late cut")
        assert _chunk_gone(c, live, ino, 0)
        with pytest.raises(OSError) as err:
            late.close()
        assert err.value.errno == errno.EIO
        assert c.stat("/f").size == 0

        wait_all_serving(c, 2)
        with c.open("/f", "r+b") as after:  # opened after the cut landed: nothing to tell
            after.write(b"n" * 1000)
        assert c.read_bytes("/f") == b"n" * 1000
        c.truncate("/f", 5000)
        assert c.read_bytes("/f") == b"n" * 1000 + bytes(4000)


def test_a_server_that_missed_a_cut_serves_only_once_cut(make_cluster) -> None:
    """With one replica nothing else would ever cut the killed server's copy: it is held
    offline at once, and serves again only after the cut reached it. A reader that opened
    before the truncate (it knows the old size) never reads the old bytes from it."""
    size = 4 << 20
    h = make_cluster(servers=2, replicas=1)
    reader = h.client()
    try:
        reader.write_bytes("/f", AB * size)
        stale = reader.open("/f", "rb")
        ino, b, _live = _failed_truncate(h, size, kill_holder_of_chunk0=True, write=False)
        with h.client() as c:
            assert _state(c, b) == "offline"  # at once, not after failure detection's 5 s
            assert b in c.status().metadata["held"]
            h.up()  # back with its old chunks: admitted, but kept offline until cut
            deadline = time.monotonic() + 30
            while _state(c, b) != "serving":
                assert time.monotonic() < deadline, c.status()
                time.sleep(0.02)
            assert _chunk_gone(c, b, ino, 0)  # serving only once cut
            assert c.status().metadata["held"] == []
            wait_all_serving(c, 2)
        data = stale.read()
        assert len(data) <= size and data.count(AB) == 0, "old bytes served after the failed truncate"
        stale.close()
    finally:
        reader.close()


# ----------------------------------------------------------------------------- the parts

def test_membership_holds_a_server_until_released(tmp_path: Path) -> None:
    from stripefs.metadata._admission import token_hash

    clock = [100.0]
    members = Membership(str(tmp_path / "servers.json"), 1, clock=lambda: clock[0])
    token = "ab" * 16
    reg = m.RegisterServer(host="127.0.0.1", port=9000, root="/srv/a", server_id=None, capacity=1, used=0,
                           pid=1, token=token)
    sid, _ = members.register(reg)
    members.admit(sid)
    members.freeze()
    beat = m.Heartbeat(server_id=sid, capacity=1, used=0, chunks=0, token=token)
    assert members.heartbeat(beat) == "serving"
    members.hold(sid)
    assert members.servers[sid].state == "offline" and members.held == {sid}
    clock[0] += 1
    assert members.heartbeat(beat) == "offline"  # alive, yet kept out
    assert members.servers[sid].last_seen == clock[0]  # (the collector may call it)
    again = Membership(str(tmp_path / "servers.json"), 1, clock=lambda: clock[0])  # persisted
    assert again.held == {sid}
    again.register(reg)
    assert again.admit(sid) == "offline"  # a restarted server too
    assert again.tokens[sid] == token_hash(token)
    again.release(sid)
    assert again.heartbeat(beat) == "serving" and again.held == set()


@pytest.fixture
def ns(store: Store) -> Namespace:
    return Namespace(store)


def test_queued_cut_blocks_growth_and_late_cut_refuses_older_writers(ns: Namespace) -> None:
    f, _ = ns.create(1, "f", FILE, 0, 0, chains=[1, 2])
    ns.commit_length(f.ino, 5000)
    cut = ns.setattr(f.ino, size=100)  # queued; its cut not applied yet
    [item] = ns.cuts(f.ino)[1]
    with pytest.raises(StripefsError) as err:
        ns.commit_length(f.ino, 9000, truncations=cut.truncations)  # would grow over it
    assert err.value.code == ErrorCode.CUT_PENDING and err.value.errno == errno.EIO
    with pytest.raises(StripefsError) as err:
        ns.setattr(f.ino, size=9000, mode=0o600)
    assert err.value.code == ErrorCode.CUT_PENDING
    assert ns.getattr(f.ino).size == 100 and ns.getattr(f.ino).mode & 0o777 == 0o644  # nothing changed
    assert ns.commit_length(f.ino, 50, truncations=cut.truncations).size == 100  # no growth: fine
    ns.cuts_applied(f.ino, [item.id], True)  # applied late
    now = ns.getattr(f.ino)
    assert now.truncations == cut.truncations + 1 and ns.cuts(f.ino)[1] == []
    for seen in (cut.truncations, cut.truncations - 1):  # wrote before it landed: refused
        with pytest.raises(StripefsError) as err:
            ns.commit_length(f.ino, 50, truncations=seen)
        assert err.value.code == ErrorCode.CUT_PENDING
    assert ns.commit_length(f.ino, 9000, truncations=now.truncations).size == 9000
    again = ns.setattr(f.ino, size=10)
    assert ns.commit_length(f.ino, 9000, truncations=now.truncations).size == 10  # a plain truncate clamps
    assert ns.cut_done(f.ino, 10, again.truncations) is not None and ns.cuts(f.ino)[1] == []
    assert ns.commit_length(f.ino, 9000, truncations=again.truncations).size == 9000
