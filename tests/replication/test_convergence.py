"""Replicas converge by content, not by version number alone (issue 14).

Claim 1: a head that applied a write and died before forwarding it comes back
holding bytes its chain never acknowledged, at a version the serving replica
also reached (or passed) with other bytes. The test forges that state on the
stopped server's disk (a :class:`storage.ChunkStore` over its root), which is
what the crash leaves, instead of racing a kill -9 against a forward.

Claim 2 (``SyncDone`` from a donor) runs on :class:`metadata._membership.Membership`
directly with a fake clock. Claim 3: truncation and removal with a replica
offline, which drops what it missed once back. Claim 4: ``ListChunks`` pages.
Claim 5: CRAQ reads, with the tail paused (SIGSTOP, well under the failure
timeout) while a write sits applied on the head only.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import crc32c
import trio

from stripefs.fsclient import Client
from stripefs.fsclient.testing.procs import pause
from stripefs.metadata._membership import Membership
from stripefs.storage import ChunkStore, chunk_files
from stripefs.storage import _replication
from stripefs.storage._replication import Replicator
from tests.conftest import TEST_CHUNK
from tests.membership.test_chain_moves import Clock, _beat, _join
from tests.replication.test_replication import server_pid, wait_all_serving
from stripefs.wire import messages as m

BLOCK = 64 * 1024


def _block_crcs(data: bytes) -> list[int]:
    return [crc32c.crc32c(data[b : b + BLOCK]) for b in range(0, len(data), BLOCK)]


def _wait_state(c: Client, sid: int, state: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(s.server_id == sid and s.state == state for s in c.status().servers):
            return
        time.sleep(0.2)
    raise AssertionError(f"server {sid} never became {state}: {c.status().servers}")


def _forge(root: str, ino: int, data: bytes, offset: int = 0) -> None:
    """What a head that died before forwarding leaves: a write applied only here."""
    store = ChunkStore(root)
    meta = store.stat(ino, 0)
    assert meta is not None
    store.write(ino, 0, offset, memoryview(data), crc32c.crc32c(data), TEST_CHUNK, meta.chain)


def test_replicas_converge_by_content_after_a_head_dies_before_forwarding(make_cluster) -> None:
    h = make_cluster(servers=2, replicas=2)
    base = os.urandom(TEST_CHUNK)
    with h.client() as c:
        c.write_bytes("/same", base)  # the forged write and the chain's write share a version
        c.write_bytes("/ahead", base)  # the forged write is one version ahead of the chain
        ino_same, ino_ahead = c.stat("/same").ino, c.stat("/ahead").ino
        victim = c.status().servers[0].server_id
        other = next(s.server_id for s in c.status().servers if s.server_id != victim)
        root = c.call_storage(victim, m.TargetInfo()).root
    os.kill(server_pid(h, victim), signal.SIGKILL)
    with h.client() as c:
        _wait_state(c, victim, "offline")
        lost1, lost2 = os.urandom(BLOCK), os.urandom(BLOCK)  # never acknowledged to anyone
        _forge(root, ino_same, lost1)
        _forge(root, ino_ahead, lost2, BLOCK)
        w2 = os.urandom(BLOCK)
        with c.open("/same", "r+b") as f:  # acknowledged by the surviving replica alone
            f.write(w2)
    h.up()  # restarts the victim: it resyncs and serves again
    with h.client() as c:
        wait_all_serving(c, 2)
        w3 = os.urandom(1000)
        with c.open("/ahead", "r+b") as f:  # a write forwarded to (or from) the returned server
            f.write(w3)
        expect = {ino_same: w2 + base[BLOCK:], ino_ahead: w3 + base[1000:]}
        for ino, data in expect.items():
            stats = {sid: c.call_storage(sid, m.StatChunk(ino=ino, index=0)) for sid in (victim, other)}
            for sid, st in stats.items():
                assert st.crcs == _block_crcs(data), f"server {sid} holds other bytes for inode {ino}"
            assert stats[victim].version == stats[other].version
        assert c.read_bytes("/same") == expect[ino_same]
        assert c.read_bytes("/ahead") == expect[ino_ahead]
    # ListChunks pages (claim 4): one chunk a page gives what one unpaged reply gives.
    # ListChunks is for servers of the cluster: asked with the server credential.
    with Client(os.path.join(h.root, "server.json")) as c:
        for chain in (ch["chain_id"] for ch in c.status().chains):
            whole = c.call_storage(other, m.ListChunks(chain=chain))
            assert not whole.more and whole.digests is not None and len(whole.digests) == len(whole.chunks)
            paged: list[list[int]] = []
            digests: list[int] = []
            after = None
            while True:
                page = c.call_storage(other, m.ListChunks(chain=chain, after=after, limit=1))
                assert len(page.chunks) <= 1 and page.digests is not None
                paged += page.chunks
                digests += page.digests
                if not page.more:
                    break
                after = page.chunks[-1][:2]
            assert paged == whole.chunks and digests == whole.digests


def test_sync_done_from_a_donor_does_not_drop_its_chains(tmp_path: Path) -> None:
    clock = Clock()
    mb = Membership(str(tmp_path / "servers.json"), replicas=2, admit_after=0.0, move_interval=0.0, clock=clock)
    a, b = _join(mb, 9001), _join(mb, 9002)
    mb.freeze()
    new = _join(mb, 9003)
    clock.t += 1.0
    for sid, port in ((a, 9001), (b, 9002), (new, 9003)):
        _beat(mb, sid, port)
    mb.sweep()
    assert mb.leaving and mb.servers[new].state == "syncing"
    leaving = dict(mb.leaving)
    donor = next(iter(leaving.values()))
    # The donor blips and comes back syncing (it may have missed writes), then catches up
    # before the newcomer has copied anything: it must keep donating.
    mb._set(donor, state="syncing")
    mb.sync_done(donor)
    for chain, d in leaving.items():
        assert d in mb.table[chain], f"chain {chain} lost donor {d} before the newcomer synced"
        assert mb.leaving.get(chain) == d
    assert mb.servers[new].state == "syncing"
    mb.sync_done(new)
    for chain, d in leaving.items():
        assert d not in mb.table[chain] and new in mb.table[chain]


def test_digest_list_pages_and_conditional_replace(tmp_path: Path) -> None:
    store = ChunkStore(str(tmp_path))
    for ino in (3, 1, 2):
        for index in (1, 0):
            data = bytes([ino, index]) * 100
            store.write(ino, index, 0, memoryview(data), crc32c.crc32c(data), TEST_CHUNK, chain=7)
    items = store.list_chain(7)
    assert [(i, x) for i, x, *_ in items] == sorted((i, x) for i in (1, 2, 3) for x in (0, 1))
    assert store.list_chain(7, (1, 1), 2) == items[2:4] and store.list_chain(7, (3, 1), 2) == []
    meta = store.stat(1, 0)
    assert meta is not None and items[0][4] == meta.digest
    # Same version, other bytes: other digest; the same bytes elsewhere: the same digest.
    other = ChunkStore(str(tmp_path / "other"))
    data = b"x" * 200
    other.write(1, 0, 0, memoryview(data), crc32c.crc32c(data), TEST_CHUNK, chain=7)
    theirs = other.stat(1, 0)
    assert theirs is not None and theirs.version == meta.version and theirs.digest != meta.digest
    # A conditional replace leaves a chunk that changed since the caller looked at it.
    assert store.replace(1, 0, 7, 1, data, expect=(meta.version, meta.digest + 1)) is meta
    new = store.replace(1, 0, 7, 1, data, expect=(meta.version, meta.digest))
    assert new is not None and new.digest == theirs.digest


def test_truncate_and_remove_skip_an_offline_replica_which_catches_up(make_cluster) -> None:
    h = make_cluster(servers=2, replicas=2)
    old = os.urandom(TEST_CHUNK * 3)
    with h.client() as c:
        c.write_bytes("/t", old)
        c.write_bytes("/gone", old)
        ino_t, ino_gone = c.stat("/t").ino, c.stat("/gone").ino
        victim = c.status().servers[0].server_id
    pid = server_pid(h, victim)
    root = next(s["root"] for s in h.data["servers"] if s["pid"] == pid)
    os.kill(pid, signal.SIGKILL)
    new = os.urandom(TEST_CHUNK // 2)
    sample, bulk = os.urandom(TEST_CHUNK - 50_000), os.urandom(TEST_CHUNK)
    with h.client() as c:
        _wait_state(c, victim, "offline")
        c.write_bytes("/t", new)  # truncates the existing file first: the offline replica is skipped
        c.unlink("/gone")
        assert c.read_bytes("/t") == new
        # Written while it was away, copied by its resync: a sample the serving replica holds
        # in its container logs, a whole chunk it holds as a file.
        c.write_bytes("/sample", sample)
        c.write_bytes("/bulk", bulk)
        ino_sample, ino_bulk = c.stat("/sample").ino, c.stat("/bulk").ino
    h.up()
    with h.client() as c:
        wait_all_serving(c, 2)
        # The copies live where the source's do: the sample a log record, the chunk a file.
        for ino, data, files in [(ino_sample, sample, 0), (ino_bulk, bulk, 1)]:
            assert c.call_storage(victim, m.StatChunk(ino=ino, index=0)).crcs == _block_crcs(data)
            assert len(chunk_files(root, ino)) == files, ino
        # The returned replica dropped what was cut or removed while it was away.
        st = c.call_storage(victim, m.StatChunk(ino=ino_t, index=0))
        assert st.crcs == _block_crcs(new)
        for ino, index in [(ino_t, 1), (ino_t, 2), (ino_gone, 0)]:
            deadline = time.monotonic() + 15
            while True:
                try:
                    c.call_storage(victim, m.StatChunk(ino=ino, index=index))
                except OSError:
                    break
                assert time.monotonic() < deadline, f"server {victim} still holds chunk {ino}:{index}"
                time.sleep(0.2)


def test_resync_listing_follows_pages_and_old_servers(tmp_path: Path, monkeypatch) -> None:
    """A chain listed page by page (claim 4); a server without digests still lists by version."""
    store = ChunkStore(str(tmp_path))
    for index in range(7):
        data = bytes([index]) * 10
        store.write(5, index, 0, memoryview(data), crc32c.crc32c(data), TEST_CHUNK, chain=2)
    asked: list[m.ListChunks] = []

    async def answer(self: Replicator, sid: int, msg: m.ListChunks, payload: bytes = b"") -> tuple:
        asked.append(msg)
        after = tuple(msg.after) if msg.after is not None else None
        page = store.list_chain(msg.chain, after, msg.limit + 1)  # type: ignore[arg-type]
        more = len(page) > msg.limit
        page = page[: msg.limit]
        return m.ListChunksReply(chunks=[list(c[:4]) for c in page], digests=[c[4] for c in page], more=more), b""

    monkeypatch.setattr(_replication, "LIST_PAGE", 3)
    monkeypatch.setattr(Replicator, "call_peer", answer)
    repl = Replicator(store, "secret", None)  # type: ignore[arg-type]
    listed = trio.run(repl.list_chunks, 1, 2)
    assert listed == {(i, x): (v, d) for i, x, v, _n, d in store.list_chain(2)} and len(listed) == 7
    assert [q.after for q in asked] == [None, [5, 2], [5, 5]] and all(q.limit == 3 for q in asked)

    async def old(self: Replicator, sid: int, msg: m.ListChunks, payload: bytes = b"") -> tuple:
        return m.ListChunksReply(chunks=[list(c[:4]) for c in store.list_chain(msg.chain)]), b""

    monkeypatch.setattr(Replicator, "call_peer", old)
    assert trio.run(repl.list_chunks, 1, 2) == {(i, x): (v, None) for i, x, v, _n, _d in store.list_chain(2)}


def test_a_replica_never_serves_bytes_its_chain_has_not_acknowledged(make_cluster) -> None:
    """CRAQ reads (claim 5): the tail paused, a write sits applied on the head only."""
    import threading

    h = make_cluster(servers=2, replicas=2)
    old, new = os.urandom(BLOCK), os.urandom(BLOCK)
    with h.client() as c:
        c.write_bytes("/craq", old)
        ino = c.stat("/craq").ino
        place = c.placement("/craq")[0]
        head, tail = place["replicas"][0], place["replicas"][-1]
        chain = place["chain"]
    tail_pid = server_pid(h, tail)
    done = threading.Event()

    def write() -> None:
        with h.client() as w, w.open("/craq", "r+b") as f:
            f.write(new)
        done.set()

    pause(tail_pid)  # well under the failure timeout: the chain stays as it is
    writer = threading.Thread(target=write)
    try:
        writer.start()
        seen: list[list[int] | None] = []

        def read() -> None:
            with h.client() as r:
                seen.append(r.call_storage(head, m.ReadChunk(ino=ino, index=0, offset=0, length=BLOCK, chain=chain)).crcs)

        reader = threading.Thread(target=read, daemon=True)
        time.sleep(0.5)  # the write reaches the head, which applies it and waits on the tail
        reader.start()
        reader.join(1.0)
        assert not done.is_set()
        assert seen in ([], [_block_crcs(old)]), "the head served bytes its tail had not acknowledged"
    finally:
        os.kill(tail_pid, signal.SIGCONT)
    writer.join(30)
    assert done.is_set()
    with h.client() as c:
        assert c.read_bytes("/craq") == new
