"""Under ``--metadata-sync full`` a mutation commits on the trio loop (a write of the log
to the page cache) and is acknowledged once one fsync of the log, shared by every commit
made before it started, has returned: no hand-off to the writer thread per mutation, and
no reply before the commit is durable."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import threading
import time

import trio

from stripefs.fsclient.core import pid_alive
from stripefs.metadata import Namespace, SqliteStore
from tests.metadata.conftest import sqlite_service
from stripefs.wire import FrameHead
from stripefs.wire import messages as m


class _HeldFsync:
    """The store's log fsync, held back at ``gate`` while ``held`` is set (by the test, once
    the commits it watches are ordinary ones); ``syncing`` is set when one waits there."""

    def __init__(self) -> None:
        self.gate, self.syncing, self.held = threading.Event(), threading.Event(), False

    def __call__(self, store: SqliteStore) -> None:
        if self.held:
            self.syncing.set()
            self.gate.wait(10)
        SqliteStore.sync_log(store)

    async def waiting(self) -> None:
        """Until an fsync waits at the gate."""
        with trio.fail_after(5):
            while not self.syncing.is_set():
                await trio.sleep(0.005)


_req_ids = itertools.count(1)


def _head() -> FrameHead:
    """The frame head of a new request (only its id matters to the service)."""
    return FrameHead(0, next(_req_ids), 0, {}, 0)


def _mkdir(name: str) -> m.Mkdir:
    return m.Mkdir(parent=1, name=name, mode=0o755, uid=0, gid=0)


def test_full_mutations_commit_on_the_loop_without_a_writer_thread_hop(tmp_path) -> None:
    svc, store = sqlite_service(tmp_path)
    ran_before = svc.commit._writer.jobs_run

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(svc.commit.run)
            with trio.fail_after(20):
                for k in range(60):
                    await svc._dispatch(_mkdir(f"e{k}"))
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
        assert store.synchronous == "full"
        # At most the odd job (a counter's reserve moving is fsynced there), not one per mkdir.
        assert svc.commit._writer.jobs_run - ran_before <= 2, svc.commit._writer.jobs_run - ran_before
    finally:
        store.close()
    with SqliteStore(tmp_path / "meta.db") as again:
        assert len(Namespace(again).readdir(1)[0]) == 61


def test_a_full_mutation_is_answered_only_after_the_log_fsync(tmp_path) -> None:
    """The reply waits for the fsync of the log that covers its commit: with that fsync held
    back, the mutation is applied (visible on the loop) but not acknowledged."""
    fsync = _HeldFsync()
    svc, store = sqlite_service(tmp_path, sync_log=fsync)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(svc.commit.run)
            await svc._dispatch(_mkdir("warm"))  # the first number handed out moves the reserve
            fsync.held = True
            answered: list[object] = []

            async def one() -> None:
                answered.append(await svc._dispatch(_mkdir("held")))

            nursery.start_soon(one)
            await fsync.waiting()
            await trio.sleep(0.2)
            assert answered == []  # committed, not durable yet: no answer
            assert svc.ns.lookup(1, "held").is_dir  # committed here on the loop, no writer thread involved
            fsync.gate.set()
            with trio.fail_after(5):
                while not answered:
                    await trio.sleep(0.005)
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        fsync.gate.set()
        store.close()


def test_concurrent_full_mutations_share_one_log_fsync(tmp_path) -> None:
    svc, store = sqlite_service(tmp_path)
    n = 40

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(svc.commit.run)
            await svc._dispatch(_mkdir("warm"))
            before = svc.commit.log_syncs
            with trio.fail_after(20):
                async with trio.open_nursery() as creates:
                    for k in range(n):
                        creates.start_soon(svc._dispatch, _mkdir(f"c{k}"))
            # Every mkdir made before an fsync started shares it; those arriving during one join the next.
            assert 1 <= svc.commit.log_syncs - before <= n // 4, svc.commit.log_syncs - before
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        store.close()
    with SqliteStore(tmp_path / "meta.db") as again:
        assert len(Namespace(again).readdir(1)[0]) == n + 2


_CREATOR = """
import sys
from stripefs import fsclient
with fsclient.Client(sys.argv[1]) as c:
    c.makedirs("/k")
    for i in range(100000):
        c.open(f"/k/f{i:06d}", "wb").close()
        print(i, flush=True)  # acknowledged
"""


def test_full_keeps_every_acknowledged_create_across_kill_9_mid_stream(tmp_path) -> None:
    """A client creates files as fast as the service answers; the service is killed -9 in
    the middle of the stream. Every name whose create was answered is there afterwards."""
    from stripefs.fsclient.testing import LocalCluster

    with LocalCluster.start(str(tmp_path / "c"), servers=1, metadata_sync="full") as cluster:
        proc = subprocess.Popen([sys.executable, "-c", _CREATOR, cluster.file], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
        acked: list[int] = []
        reader = threading.Thread(target=lambda: acked.extend(int(line) for line in proc.stdout), daemon=True)
        reader.start()
        try:
            deadline = time.monotonic() + 60
            while len(acked) < 300 and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(acked) >= 300, "the creates did not get going"
            pid = cluster.data["metadata"]["pid"]
            os.kill(pid, signal.SIGKILL)  # mid-stream: creates are in flight
            time.sleep(0.5)  # answers that left before the kill are read (and counted) meanwhile
        finally:
            proc.kill()
            proc.wait(30)
            reader.join(10)
        deadline = time.monotonic() + 10
        while pid_alive(pid) and time.monotonic() < deadline:  # a zombie counts as gone
            time.sleep(0.05)
        cluster.up()
        with cluster.client() as c:
            names = set(c.listdir("/k"))
        missing = [i for i in acked if f"f{i:06d}" not in names]
        assert not missing, f"{len(missing)} acknowledged creates lost, first {missing[:5]}"



def test_a_failed_log_fsync_fails_the_mutation_and_refuses_later_ones(tmp_path) -> None:
    import errno

    import pytest

    from stripefs.wire import ErrorCode, StripefsError

    failing = False

    def sync(store: SqliteStore) -> None:
        if failing:
            raise OSError(errno.EIO, "injected")
        SqliteStore.sync_log(store)

    svc, store = sqlite_service(tmp_path, sync_log=sync)

    async def main() -> None:
        nonlocal failing
        async with trio.open_nursery() as nursery:
            nursery.start_soon(svc.commit.run)
            await svc._dispatch(_mkdir("warm"))
            failing = True
            for name in ("lost", "refused"):
                with pytest.raises(StripefsError) as info, trio.fail_after(5):
                    await svc._dispatch(_mkdir(name))
                assert info.value.code == ErrorCode.IO and "durable" in info.value.message
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
        with pytest.raises(FileNotFoundError):
            svc.ns.lookup(1, "refused")  # refused before it was applied
    finally:
        store.close()


def test_every_answered_mutation_is_in_what_the_last_log_fsync_covered(tmp_path) -> None:
    """A power loss keeps what was fsynced. Each fsync of the log here also copies the
    database and its log aside (what the disk held at that moment, at least); after a stream
    of concurrent creates, the last copy, opened as SQLite recovers it, holds every create
    that was answered. No checkpoint runs meanwhile (fewer than 256 commits), so the
    database file itself does not change under the copy."""
    import shutil

    disk = tmp_path / "disk"
    disk.mkdir()
    db = tmp_path / "meta.db"

    def sync_and_copy(store: SqliteStore) -> None:
        SqliteStore.sync_log(store)
        for suffix in ("", "-wal"):
            shutil.copyfile(f"{db}{suffix}", disk / f"next.db{suffix}")
        for suffix in ("", "-wal"):
            os.replace(disk / f"next.db{suffix}", disk / f"meta.db{suffix}")

    svc, store = sqlite_service(tmp_path, sync_log=sync_and_copy)
    answered: list[str] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(svc.commit.run)

            async def creator(k: int) -> None:
                for i in range(25):
                    name = f"c{k}-{i}"
                    await svc._dispatch(_mkdir(name))
                    answered.append(name)

            with trio.fail_after(30):
                async with trio.open_nursery() as creators:
                    for k in range(6):
                        creators.start_soon(creator, k)
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        store.close()
    assert len(answered) == 150
    with SqliteStore(disk / "meta.db") as copy:
        names = {e.name for e in Namespace(copy).readdir(1, limit=1000)[0]}
    missing = sorted(set(answered) - names)
    assert not missing, f"{len(missing)} answered creates were not on disk, e.g. {missing[:5]}"


class _Peer:
    """The service's end of one client's connection: what was sent back on it."""

    def __init__(self, name: bytes):
        self.client_id = name.ljust(16, b"-")
        self.sent: list[dict] = []

    async def send(self, head: object, header: dict) -> None:
        self.sent.append(header)


def test_under_full_no_answer_tells_of_a_mutation_before_it_is_durable(tmp_path) -> None:
    """A's ``mkdir /q`` commits on the loop and waits for its fsync (held back). Meanwhile B
    asks for ``/q`` (stat, listing, its own mkdir): under ``full`` none of them is answered
    before A's mkdir is durable -- a power loss then would undo what B was told (that /q
    exists, EEXIST). Once the fsync returns, B's answers show /q."""
    fsync = _HeldFsync()
    svc, store = sqlite_service(tmp_path, sync_log=fsync)
    a, b = _Peer(b"a"), _Peer(b"b")
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(svc.commit.run)
            await svc._dispatch(_mkdir("warm"))
            fsync.held = True
            nursery.start_soon(svc.handle, a, _head(), _mkdir("q"), None)
            await fsync.waiting()
            assert svc.ns.lookup(1, "q").is_dir  # committed on the loop, not durable
            assert svc.answer_now(b, _head(), m.Resolve(path="/q")) is None  # not answered on the loop
            refused: list[BaseException] = []

            async def b_mkdir() -> None:
                try:
                    await svc.handle(b, _head(), _mkdir("q"), None)
                except Exception as exc:  # noqa: BLE001 -- EEXIST, checked below
                    refused.append(exc)

            nursery.start_soon(svc.handle, b, _head(), m.Resolve(path="/q"), None)
            nursery.start_soon(svc.handle, b, _head(), m.Readdir(ino=1), None)
            nursery.start_soon(b_mkdir)
            await trio.sleep(0.3)
            assert b.sent == [] and refused == [] and a.sent == []  # nobody told of /q yet
            fsync.gate.set()
            with trio.fail_after(5):
                while len(b.sent) < 2 or not refused or not a.sent:
                    await trio.sleep(0.005)
            assert isinstance(refused[0], FileExistsError)
            stat_reply, listing = sorted(b.sent, key=lambda h: "columns" in h)
            assert m.Resolve.Reply.from_header(stat_reply).attr.is_dir
            assert "q" in [e.name for e in m.Readdir.Reply.from_header(listing).entries]
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        fsync.gate.set()
        store.close()


def test_under_full_a_renamed_directory_is_never_seen_under_its_old_name_after_the_new_one(tmp_path) -> None:
    """B walks /r1 (the loop's reads remember the directory), A renames /r1 to /r2 with the
    log fsync held back, B asks for /r2/f and then /r1/f: once answered, /r2/f exists and
    /r1/f does not -- never the new name and then the old one."""
    fsync = _HeldFsync()
    svc, store = sqlite_service(tmp_path, sync_log=fsync)
    a, b = _Peer(b"a"), _Peer(b"b")
    answers: dict[str, object] = {}

    async def ask(path: str) -> None:
        peer = _Peer(path.encode())
        try:
            await svc.handle(peer, _head(), m.Resolve(path=path), None)
            answers[path] = m.Resolve.Reply.from_header(peer.sent[0]).attr.ino
        except FileNotFoundError:
            answers[path] = None

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(svc.commit.run)
            r1 = (await svc._dispatch(_mkdir("r1"))).attr.ino
            await svc._dispatch(m.Mkdir(parent=r1, name="f", mode=0o755, uid=0, gid=0))
            assert svc.answer_now(b, _head(), m.Resolve(path="/r1/f")) is not None  # remembered now
            fsync.held = True
            nursery.start_soon(svc.handle, a, _head(), m.Rename(parent=1, name="r1", new_parent=1, new_name="r2"), None)
            await fsync.waiting()
            await ask_both(nursery)
            fsync.gate.set()
            with trio.fail_after(5):
                while len(answers) < 2 or not a.sent:
                    await trio.sleep(0.005)
            assert answers["/r2/f"] is not None and answers["/r1/f"] is None, answers
            nursery.cancel_scope.cancel()

    async def ask_both(nursery: trio.Nursery) -> None:
        nursery.start_soon(ask, "/r2/f")
        await trio.sleep(0.01)
        nursery.start_soon(ask, "/r1/f")
        await trio.sleep(0.1)
        assert answers == {}  # neither told before the rename is durable

    try:
        trio.run(main)
    finally:
        fsync.gate.set()
        store.close()
