"""Group commit: operations in one batch share a durable commit but fail alone."""

from __future__ import annotations

import errno
import os
import stat

import pytest

from stripefs.metadata import MemoryStore, Namespace, SqliteStore


@pytest.mark.parametrize("kind", ["sqlite", "memory"])
def test_batch_ops_fail_alone_and_commit_together(tmp_path, kind: str) -> None:
    path = os.path.join(tmp_path, "meta.db")
    store = SqliteStore(path) if kind == "sqlite" else MemoryStore()
    ns = Namespace(store)
    results: list[object] = []
    with store.batch():
        for name in ("a", "b", "a", "c"):  # the second "a" fails with EEXIST, alone
            try:
                results.append(ns.mkdir(1, name, 0o755, 0, 0).ino)
            except OSError as exc:
                results.append(exc.errno)
    assert results[2] == errno.EEXIST
    assert len({results[0], results[1], results[3]}) == 3  # three new inodes
    entries, _ = ns.readdir(1)
    assert sorted(e.name for e in entries) == ["a", "b", "c"]
    if kind == "sqlite":
        store.close()
        again = Namespace(SqliteStore(path))  # durable after the batch's one commit
        assert sorted(e.name for e in again.readdir(1)[0]) == ["a", "b", "c"]
        assert stat.S_ISDIR(again.resolve("/c").mode)


def test_a_failed_batch_commits_nothing(tmp_path) -> None:
    path = os.path.join(tmp_path, "meta.db")
    store = SqliteStore(path)
    ns = Namespace(store)
    with pytest.raises(RuntimeError):
        with store.batch():
            ns.mkdir(1, "x", 0o755, 0, 0)
            raise RuntimeError("crash before the commit")
    assert [e.name for e in ns.readdir(1)[0]] == []


def test_stopping_waits_for_the_batch_in_hand(tmp_path) -> None:
    """Once ``CommitPath.run`` returns no store thread uses the store any more (the service
    closes it next): a cancelled run waits for the batch in hand."""
    import threading
    import time

    import trio

    from stripefs.metadata._membership import Membership
    from stripefs.metadata._service import MetadataService

    store = SqliteStore(tmp_path / "meta.db")
    svc = MetadataService(Namespace(store), lambda doc, restarted: Membership(None, doc=doc, restarted=restarted),
                          "secret")
    started, finished = threading.Event(), threading.Event()

    def slow() -> None:
        started.set()
        time.sleep(0.3)
        finished.set()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(svc.commit.run)
            nursery.start_soon(svc.commit.store_call, slow)
            while not started.is_set():
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        assert finished.is_set()

    try:
        trio.run(main)
    finally:
        store.close()
