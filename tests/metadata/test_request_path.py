"""The metadata request path: reads do not wait behind the write batch, and still see
every acknowledged write."""

from __future__ import annotations

import threading

import pytest
import trio

from stripefs.metadata import Namespace, SqliteStore
from stripefs.metadata._membership import Membership
from stripefs.metadata._service import MetadataService
from stripefs.wire import messages as m


def _service(tmp_path) -> tuple[MetadataService, SqliteStore]:
    store = SqliteStore(tmp_path / "meta.db")
    ns = Namespace(store)
    ns.mkdir(1, "d", 0o755, 0, 0)
    def members(doc: str | None, restarted: bool) -> Membership:
        return Membership(None, doc=doc, restarted=restarted)

    return MetadataService(ns, members, "secret"), store


def test_reads_are_answered_while_a_write_batch_is_running(tmp_path) -> None:
    svc, store = _service(tmp_path)
    gate = threading.Event()
    started = threading.Event()

    def slow_write() -> None:  # stands in for a batch stuck in a long durable commit
        started.set()
        gate.wait(10)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(svc.commit.run)
            nursery.start_soon(svc.commit.apply, slow_write)
            while not started.is_set():
                await trio.sleep(0.01)
            try:
                with trio.fail_after(3):
                    reply = await svc._dispatch(m.Resolve(path="/d"))
                    listing = await svc._dispatch(m.Readdir(ino=1, after="", limit=10, plus=True))
                assert reply.attr.is_dir
                assert [e.name for e in listing.entries] == ["d"]
                assert not gate.is_set()  # answered while the write still held the batch
            finally:
                gate.set()
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        store.close()


def test_a_read_after_an_acknowledged_write_sees_it(tmp_path) -> None:
    svc, store = _service(tmp_path)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(svc.commit.run)
            d = (await svc._dispatch(m.Resolve(path="/d"))).attr
            for k in range(60):
                made = await svc._dispatch(m.Mkdir(parent=d.ino, name=f"f{k}", mode=0o755, uid=0, gid=0))
                seen = (await svc._dispatch(m.Lookup(parent=d.ino, name=f"f{k}"))).attr
                assert seen.ino == made.attr.ino
                await svc._dispatch(m.Rmdir(parent=d.ino, name=f"f{k}"))
                with pytest.raises(FileNotFoundError):
                    await svc._dispatch(m.Resolve(path=f"/d/f{k}"))
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        store.close()


def test_a_full_page_of_young_removals_does_not_make_every_unlink_rescan(tmp_path) -> None:
    """With more removals queued than one GC page holds, all of them within the grace
    period, the next pass is due when the oldest one's grace ends -- not at once: before,
    every unlink's wake-up listed (and skipped) a thousand rows."""
    import time

    from stripefs.metadata._store import GarbageItem
    from stripefs.wire import Layout

    store = SqliteStore(tmp_path / "meta.db")
    svc = MetadataService(Namespace(store), lambda doc, restarted: Membership(None, doc=doc, restarted=restarted),
                          "secret", gc_grace=60.0)
    with store.transaction() as txn:
        for k in range(1, 1202):
            txn.put_garbage(GarbageItem(k, "remove", 1000 + k, 0, Layout(1 << 20, (1,))))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(svc.commit.run)
            before = time.monotonic()
            await svc.collector.collect()
            # nothing was due: the next pass waits for the first grace to end
            assert svc.collector.due >= before + 59, svc.collector.due - before
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        store.close()


def test_small_reads_are_answered_on_the_loop_and_big_listings_on_the_reader_thread(tmp_path) -> None:
    """A point read (stat, lookup, a short listing) is answered at once from the loop's own
    read connection, even while the reader thread is busy; a listing too big to run on the
    loop still waits for the reader thread."""
    svc, store = _service(tmp_path)
    gate = threading.Event()
    started = threading.Event()
    assert svc.commit._reader is not None

    def slow_read() -> None:  # stands in for a long listing holding the reader thread
        started.set()
        gate.wait(10)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(svc.commit.run)
            nursery.start_soon(svc.commit._reader.submit, slow_read)
            while not started.is_set():
                await trio.sleep(0.01)
            try:
                with trio.fail_after(3):
                    d = (await svc._dispatch(m.Resolve(path="/d"))).attr
                    assert (await svc._dispatch(m.Lookup(parent=1, name="d"))).attr.ino == d.ino
                    assert (await svc._dispatch(m.GetAttr(ino=d.ino))).attr.is_dir
                    names = await svc._dispatch(m.ListNames(path="/", after="", limit=100))
                    assert names.names == ["d"]
                big = None
                with trio.move_on_after(0.3):
                    big = await svc._dispatch(m.Readdir(ino=1, after="", limit=10_000, plus=True))
                assert big is None  # queued behind the busy reader thread, not run on the loop
            finally:
                gate.set()
            with trio.fail_after(3):
                big = await svc._dispatch(m.Readdir(ino=1, after="", limit=10_000, plus=True))
            assert [e.name for e in big.entries] == ["d"]
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        store.close()


def test_answer_now_takes_short_reads_and_leaves_the_rest_to_tasks(tmp_path) -> None:
    svc, store = _service(tmp_path)
    try:
        stat = m.Resolve(path="/d")
        assert m.decode_reply(stat, svc.answer_now(None, None, stat)).attr.is_dir  # type: ignore[arg-type]
        names = m.ListNames(path="/", after="", limit=2000)
        assert m.decode_reply(names, svc.answer_now(None, None, names)).names == ["d"]  # type: ignore[arg-type]
        with pytest.raises(FileNotFoundError):
            svc.answer_now(None, None, m.Resolve(path="/nothing"))  # type: ignore[arg-type]
        for later in (m.Mkdir(parent=1, name="e", mode=0o755, uid=0, gid=0),
                      m.Readdir(ino=1, after="", limit=10_000, plus=True), m.Ping()):
            assert svc.answer_now(None, None, later) is None  # type: ignore[arg-type]
        with pytest.raises(FileNotFoundError):  # the Mkdir was left alone, not applied
            svc.answer_now(None, None, m.Resolve(path="/e"))  # type: ignore[arg-type]
    finally:
        store.close()


@pytest.mark.parametrize("sync", ["full", "normal"])
def test_reads_on_the_loop_follow_renamed_and_replaced_directories(tmp_path, sync: str) -> None:
    """Directories met on the way are remembered by the loop's reads (fewer statements per
    stat); a rename or rmdir is seen by the very next read."""
    store = SqliteStore(tmp_path / "meta.db", synchronous=sync)
    ns = Namespace(store)
    a = ns.mkdir(1, "a", 0o755, 0, 0)
    ns.mkdir(a.ino, "x", 0o755, 0, 0)
    svc = MetadataService(ns, lambda doc, restarted: Membership(None, doc=doc, restarted=restarted), "secret",
                          sync=sync)
    statements: list[str] = []
    svc.commit._lns.store._conn.set_trace_callback(statements.append)  # type: ignore[union-attr]

    def stat(path: str) -> int:
        return m.decode_reply(m.Resolve(path=path), svc.answer_now(None, None, m.Resolve(path=path))).attr.ino  # type: ignore[arg-type]

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(svc.commit.run)
            x = stat("/a/x")
            statements.clear()
            assert stat("/a/x") == x
            assert len([s for s in statements if s.startswith("SELECT")]) == 1  # the entries from memory: the inode
            await svc._dispatch(m.Rename(parent=1, name="a", new_parent=1, new_name="b", flags=0))
            with pytest.raises(FileNotFoundError):
                stat("/a/x")
            assert stat("/b/x") == x
            await svc._dispatch(m.Rmdir(parent=a.ino, name="x"))
            with pytest.raises(FileNotFoundError):
                stat("/b/x")
            again = (await svc._dispatch(m.Mkdir(parent=a.ino, name="x", mode=0o755, uid=0, gid=0))).attr
            assert stat("/b/x/.") == again.ino != x
            # a directory replaced by a rename over it
            await svc._dispatch(m.Mkdir(parent=1, name="c", mode=0o755, uid=0, gid=0))
            stat("/c")
            await svc._dispatch(m.Rename(parent=1, name="b", new_parent=1, new_name="c", flags=0))
            assert stat("/c/x") == again.ino
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        store.close()
