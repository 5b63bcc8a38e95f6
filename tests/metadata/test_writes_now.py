"""Mutations under ``--metadata-sync normal`` commit on the trio loop when their commit
needs no fsync; anything that would (``full``, a counter's reserve running out, a
checkpoint) still goes through the writer thread."""

from __future__ import annotations

import functools
import os

import pytest
import trio

from stripefs.metadata import Namespace, SqliteStore
from stripefs.metadata._service import MetadataService
from stripefs.metadata._sqlite import RESERVE
from tests.metadata.conftest import sqlite_service
from stripefs.wire import StripefsError
from stripefs.wire import messages as m


def test_commit_unsynced_commits_what_needs_no_fsync_and_nothing_else(tmp_path) -> None:
    store = SqliteStore(tmp_path / "meta.db", synchronous="normal")
    ns = Namespace(store)
    ns.mkdir(1, "first", 0o755, 0, 0)  # the first number handed out moves the reserve: fsynced
    assert store.commit_unsynced(lambda: ns.mkdir(1, "a", 0o755, 0, 0)) == (False, None)  # autocheckpoints fsync
    store.take_checkpoints()
    done, made = store.commit_unsynced(lambda: ns.mkdir(1, "a", 0o755, 0, 0))
    assert done and ns.lookup(1, "a").ino == made.ino
    with pytest.raises(FileExistsError):  # the operation's own error, nothing kept
        store.commit_unsynced(lambda: ns.mkdir(1, "a", 0o755, 0, 0))
    # A counter reaching its reserved bound must be fsynced: refused, rolled back.
    with store.transaction() as txn:
        txn.put_meta("next_ino.reserved", txn.get_meta("next_ino") or "0")
    assert store.commit_unsynced(lambda: ns.mkdir(1, "b", 0o755, 0, 0)) == (False, None)
    with pytest.raises(FileNotFoundError):
        ns.lookup(1, "b")
    assert not store.durable_commit
    store.close()
    with SqliteStore(tmp_path / "full.db") as full:
        fns = Namespace(full)
        full.take_checkpoints()
        assert full.commit_unsynced(lambda: fns.mkdir(1, "a", 0o755, 0, 0)) == (False, None)
        with pytest.raises(FileNotFoundError):
            fns.lookup(1, "a")


def test_mutations_commit_on_the_loop_and_full_answers_after_the_log_fsync(tmp_path) -> None:
    async def mkdir_without_store_threads(svc: MetadataService) -> bool:
        # No store thread runs (nor the log's fsync thread): only a mutation applied on the
        # loop can finish, and under ``full`` it is not answered before the log is fsynced.
        with trio.move_on_after(0.5):
            await svc._dispatch(m.Mkdir(parent=1, name="e", mode=0o755, uid=0, gid=0))
            return True
        return False

    for sync in ("normal", "full"):
        os.makedirs(tmp_path / sync)
        svc, store = sqlite_service(tmp_path / sync, sync)
        try:
            with store.transaction() as txn:  # the next number handed out needs no durable commit
                txn.put_meta("next_ino.reserved", str(RESERVE))
            assert trio.run(mkdir_without_store_threads, svc) == (sync == "normal")
            assert svc.ns.lookup(svc.ns.resolve("/").ino, "e").is_dir  # committed on the loop either way
        finally:
            store.close()


def test_the_log_is_checkpointed_when_writes_commit_on_the_loop(tmp_path) -> None:
    svc, store = sqlite_service(tmp_path, "normal")
    wal = f"{tmp_path / 'meta.db'}-wal"

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(svc.commit.run)
            d = (await svc._dispatch(m.Resolve(path="/d"))).attr
            for k in range(3000):
                await svc._dispatch(m.Mkdir(parent=d.ino, name=f"f{k}", mode=0o755, uid=0, gid=0))
                if k % 100 == 0:
                    await trio.lowlevel.checkpoint()  # let the checkpoint task run
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
        # Without checkpoints 3,000 mkdirs grow the log past 40 MB; with them it is reused.
        assert os.path.getsize(wal) < 12 << 20, os.path.getsize(wal)
    finally:
        store.close()
    assert RESERVE > 3000  # no mkdir above needed a durable commit


def test_commit_unsynced_refuses_what_would_need_a_savepoint(tmp_path) -> None:
    """One transaction runs without a savepoint; a failure caught inside ``fn``, or a
    second transaction, rolls everything back and is refused (the thread's batch, with
    savepoints, runs it)."""
    store = SqliteStore(tmp_path / "meta.db", synchronous="normal")
    ns = Namespace(store)
    ns.mkdir(1, "first", 0o755, 0, 0)
    store.take_checkpoints()
    statements: list[str] = []
    store._conn.set_trace_callback(statements.append)

    def caught() -> None:
        ns.mkdir(1, "kept?", 0o755, 0, 0)
        try:
            ns.mkdir(1, "first", 0o755, 0, 0)
        except FileExistsError:
            pass

    assert store.commit_unsynced(caught) == (False, None)
    assert store.commit_unsynced(lambda: [ns.mkdir(1, "x", 0o755, 0, 0), ns.mkdir(1, "y", 0o755, 0, 0)]) == (False, None)
    for name in ("kept?", "x", "y"):
        with pytest.raises(FileNotFoundError):
            ns.lookup(1, name)
    statements.clear()
    done, _ = store.commit_unsynced(lambda: ns.mkdir(1, "z", 0o755, 0, 0))
    assert done and not [s for s in statements if s.startswith(("SAVEPOINT", "RELEASE"))]
    store.close()


def test_a_write_whose_caller_gave_up_still_keeps_the_loop_off_the_connection(tmp_path) -> None:
    """A caller cancelled while its job waits for (or runs on) the writer thread does not
    free the writing connection: mutations go on queueing behind that job until it ran."""
    import threading

    svc, store = sqlite_service(tmp_path, "normal")
    gate, started = threading.Event(), threading.Event()

    def slow() -> None:
        started.set()
        gate.wait(10)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(svc.commit.run)
            with trio.move_on_after(0.2):
                await svc.commit.store_call(slow)  # the caller gives up; the job keeps running
            assert started.is_set()
            assert svc.commit._writing == 1  # counted until the job ran, not until its caller left
            made = None
            with trio.move_on_after(0.3):
                made = await svc._dispatch(m.Mkdir(parent=1, name="e", mode=0o755, uid=0, gid=0))
            assert made is None  # queued behind the job, not committed beside it on the loop
            gate.set()
            with trio.fail_after(5):
                while svc.commit._writing:
                    await trio.sleep(0.01)
                await svc._dispatch(m.Mkdir(parent=1, name="f", mode=0o755, uid=0, gid=0))
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        gate.set()
        store.close()


def test_entries_and_counters_are_one_btree_each_and_older_databases_still_work(tmp_path) -> None:
    """A new database keeps directory entries and counters without a rowid (one B-tree each:
    an entry written or looked up touches one tree, not a table and its key index); one
    made with the older tables works on unchanged."""
    import sqlite3

    with SqliteStore(tmp_path / "new.db") as store:
        tables = dict(store._conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table'").fetchall())
    assert "WITHOUT ROWID" in tables["dentries"] and "WITHOUT ROWID" in tables["meta"]

    old = sqlite3.connect(tmp_path / "old.db")
    old.executescript("""
        CREATE TABLE dentries (parent INTEGER NOT NULL, name BLOB NOT NULL, ino INTEGER NOT NULL,
                               mode INTEGER NOT NULL, PRIMARY KEY (parent, name));
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    """)
    old.close()
    with SqliteStore(tmp_path / "old.db", synchronous="normal") as store:
        ns = Namespace(store)
        d = ns.mkdir(1, "d", 0o755, 0, 0)
        made, _ = ns.create_path("/d/f", 0o644, 0, 0, chains=[1])
        assert ns.resolve("/d/f").ino == made.ino and ns.list_names("/d") == (["f"], False)
        ns.unlink_path("/d/f")
        assert ns.readdir(d.ino) == ([], False)
        tables = dict(store._conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table'").fetchall())
        assert "WITHOUT ROWID" not in tables["dentries"]  # left as it was


def test_a_checkpoint_starts_the_log_again_itself(tmp_path) -> None:
    """The first commit into a log started again fsyncs its new header: that commit is made
    by the checkpoint (on the writer thread), so the next commit on the loop needs no fsync."""
    import struct

    for sync in ("normal", "full"):
        path = tmp_path / f"{sync}.db"
        store = SqliteStore(path, synchronous=sync)
        store.sync_log_by_owner()
        ns = Namespace(store)
        for k in range(20):
            ns.mkdir(1, f"d{k}", 0o755, 0, 0)

        def restarts(wal: str = f"{path}-wal") -> int:  # the log header's checkpoint sequence: +1 per restart
            with open(wal, "rb") as f:
                return struct.unpack(">I", f.read(16)[12:16])[0]

        before = restarts()
        store.checkpoint()
        assert restarts() == before + 1
        done, _ = store.commit_unsynced(functools.partial(ns.mkdir, 1, "after", 0o755, 0, 0))
        assert done and restarts() == before + 1
        store.close()


def test_a_create_or_unlink_on_the_loop_reads_and_writes_no_counter_row(tmp_path) -> None:
    """Under a durably recorded reserve the counters live in memory between reserve moves:
    a create or an unlink touches no ``meta`` row, and numbers stay unique across a reopen."""
    for sync in ("normal", "full"):
        path = tmp_path / f"{sync}.db"
        store = SqliteStore(path, synchronous=sync)
        store.sync_log_by_owner()
        ns = Namespace(store)
        for warm in ("/first", "/second"):  # the first moves the reserves (durable commits)
            ns.create_path(warm, 0o644, 0, 0, chains=[1])
            ns.unlink_path(warm)
        statements: list[str] = []
        store._conn.set_trace_callback(statements.append)
        made = []
        for k in range(5):
            done, (attr, _) = store.commit_unsynced(functools.partial(ns.create_path, f"/f{k}", 0o644, 0, 0,
                                                                      chains=[1]))
            assert done
            made.append(attr.ino)
        done, _ = store.commit_unsynced(functools.partial(ns.unlink_path, "/f0"))
        assert done
        store._conn.set_trace_callback(None)
        assert not [s for s in statements if " meta " in s], [s for s in statements if " meta " in s]
        assert made == sorted(set(made))
        store.close()
        with SqliteStore(path, synchronous=sync) as again:  # a restart moves past the reserve
            again.sync_log_by_owner()
            assert Namespace(again).create_path("/after", 0o644, 0, 0, chains=[1])[0].ino > max(made)


def test_writes_on_the_loop_remember_the_directories_they_walk_until_one_changes(tmp_path) -> None:
    """A create or unlink by path walks the parent's path by entries it remembers (one dentry
    lookup, the new name's, per create in a known directory); a rename or rmdir forgets them,
    so a path then leads where the namespace says, not where it led before."""
    svc, store = sqlite_service(tmp_path, "full")
    svc.members.table, svc.members.frozen = {1: [1]}, True  # one chain: files can be made

    def create(path: str) -> m.CreatePath:
        return m.CreatePath(path=path, mode=0o644, uid=0, gid=0)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(svc.commit.run)
            a = (await svc._dispatch(m.Mkdir(parent=1, name="a", mode=0o755, uid=0, gid=0))).attr
            b = (await svc._dispatch(m.Mkdir(parent=a.ino, name="b", mode=0o755, uid=0, gid=0))).attr
            await svc._dispatch(create("/a/b/f0"))
            await svc._dispatch(m.UnlinkPath(path="/a/b/f0"))  # the first removal moves a reserve: on the thread
            statements: list[str] = []
            store._conn.set_trace_callback(statements.append)
            await svc._dispatch(create("/a/b/f1"))
            await svc._dispatch(m.UnlinkPath(path="/a/b/f1"))
            store._conn.set_trace_callback(None)
            assert len([s for s in statements if s.startswith("SELECT ino, mode FROM dentries")]) == 2, "\n".join(statements)
            # A rename: the old path leads nowhere, the new one to the same directory.
            await svc._dispatch(m.Rename(parent=a.ino, name="b", new_parent=a.ino, new_name="c", flags=0))
            with pytest.raises(FileNotFoundError):
                await svc._dispatch(create("/a/b/f2"))
            made = (await svc._dispatch(create("/a/c/f2"))).attr
            assert svc.ns.lookup(b.ino, "f2").ino == made.ino
            # An rmdir and a new directory of the same name: the path leads into the new one.
            x = (await svc._dispatch(m.Mkdir(parent=a.ino, name="x", mode=0o755, uid=0, gid=0))).attr
            await svc._dispatch(create("/a/x/f"))
            await svc._dispatch(m.UnlinkPath(path="/a/x/f"))
            await svc._dispatch(m.Rmdir(parent=a.ino, name="x"))
            y = (await svc._dispatch(m.Mkdir(parent=a.ino, name="x", mode=0o755, uid=0, gid=0))).attr
            made = (await svc._dispatch(create("/a/x/g"))).attr
            assert y.ino != x.ino and svc.ns.lookup(y.ino, "g").ino == made.ino
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        store.close()


def test_a_failed_batch_leaves_no_remembered_directory_behind(tmp_path) -> None:
    """A directory renamed and walked through in a batch that then fails to commit is not
    remembered under its new name: a later create there is ENOENT, not a file in the
    directory that kept its old name."""
    svc, store = sqlite_service(tmp_path, "full")
    svc.members.table, svc.members.frozen = {1: [1]}, True  # one chain: files can be made
    ns = svc.ns

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(svc.commit.run)
            d = ns.resolve("/d")
            await svc._dispatch(m.Mkdir(parent=d.ino, name="old", mode=0o755, uid=0, gid=0))
            await svc._dispatch(m.CreatePath(path="/d/old/warm", mode=0o644, uid=0, gid=0))

            def renamed_then_failed() -> None:
                ns.rename(d.ino, "old", d.ino, "new")
                ns.create_path("/d/new/f", 0o644, 0, 0, chains=[1])
                # SQLite rolls a batch back by itself on some errors (SQLITE_FULL, an I/O
                # error): then the batch's COMMIT fails and nothing of it exists.
                store._conn.execute("ROLLBACK")

            with pytest.raises(StripefsError):
                await svc.commit.store_call(renamed_then_failed)
            with pytest.raises(FileNotFoundError):
                await svc._dispatch(m.CreatePath(path="/d/new/g", mode=0o644, uid=0, gid=0))
            await svc._dispatch(m.CreatePath(path="/d/old/g", mode=0o644, uid=0, gid=0))
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        store.close()


def test_an_unlink_skips_the_xattr_cleanup_only_while_no_file_has_any(tmp_path) -> None:
    with SqliteStore(tmp_path / "meta.db") as store:
        ns = Namespace(store)
        ns.create_path("/plain", 0o644, 0, 0, chains=[1])
        statements: list[str] = []
        store._conn.set_trace_callback(statements.append)
        ns.unlink_path("/plain")
        store._conn.set_trace_callback(None)
        assert not [s for s in statements if "xattrs" in s]
        tagged = ns.create_path("/tagged", 0o644, 0, 0, chains=[1])[0]
        ns.setxattr(tagged.ino, b"user.k", b"v", 0)
        ns.unlink_path("/tagged")
        assert store._conn.execute("SELECT COUNT(*) FROM xattrs").fetchone()[0] == 0
    with SqliteStore(tmp_path / "meta.db") as again:  # a database holding xattrs: known at open
        ns = Namespace(again)
        kept = ns.create_path("/kept", 0o644, 0, 0, chains=[1])[0]
        ns.setxattr(kept.ino, b"user.k", b"v", 0)
    with SqliteStore(tmp_path / "meta.db") as third:
        Namespace(third).unlink_path("/kept")
        assert third._conn.execute("SELECT COUNT(*) FROM xattrs").fetchone()[0] == 0


def test_a_bound_moved_by_a_commit_rolled_back_is_moved_again(tmp_path) -> None:
    """A loop commit that takes a counter's first numbers moves its reserved bound, and is
    rolled back (it needs an fsync) to run on the thread. The bound it wrote must not stay
    remembered: else no commit ever records it, and after a restart the counter starts
    below numbers already handed out (a reopened service failed its next removal with
    ``UNIQUE constraint failed: garbage.id``)."""
    path = str(tmp_path / "meta.db")
    store = SqliteStore(path)
    store.sync_log_by_owner()
    ns = Namespace(store)
    with store.batch():
        ns.mkdir(1, "d", 0o755, 0, 0)
    done, _ = store.commit_unsynced(lambda: ns.reserve_files("/d", 3, chains=[1]))
    assert not done  # the first garbage numbers move next_garbage's bound: refused, rolled back
    with store.batch():
        given = [g.id for g in ns.reserve_files("/d", 3, chains=[1])]
    store.sync_log()
    store.close()
    store = SqliteStore(path)  # a restart
    try:
        again = Namespace(store).reserve_files("/d", 1, chains=[1])[0].id
    finally:
        store.close()
    assert again > max(given)
