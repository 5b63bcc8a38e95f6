"""The loop's reads remember directory entries (``Namespace.reading(remember_dirs=True)``);
a rename committed by the writer thread must not be walked past under the old name."""

from __future__ import annotations

import threading

import pytest
import trio

from stripefs.metadata import Namespace, SqliteStore
from stripefs.metadata._commit import CommitPath
from stripefs.wire import ErrorCode, StripefsError


def test_a_directory_renamed_on_the_writer_thread_is_not_walked_under_its_old_name(tmp_path) -> None:
    """The writer thread's commit shows to the loop's read connection before the loop hears
    of it (the job's result comes back later). A read in between saw the commit's other
    changes, yet walked ``/d`` through the entry it remembered: ``/d/x`` was found after
    ``/d`` was renamed (a stale read, seen by the crash model under load as a resolve of
    the old path answered after a readdir showed the same commit's new name)."""
    store = SqliteStore(tmp_path / "meta.db", synchronous="full")
    ns = Namespace(store)
    d = ns.mkdir(1, "d", 0o755, 0, 0)
    x = ns.mkdir(d.ino, "x", 0o755, 0, 0)
    cp = CommitPath(ns, shared=False)
    real = store._commit
    committed, go = threading.Event(), threading.Event()
    loop_thread = threading.current_thread()

    def commit() -> None:
        real()
        if threading.current_thread() is not loop_thread:  # the writer thread's batch: hold it after COMMIT
            committed.set()
            go.wait(10)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(cp.run)
            done, attr = cp.read_now(Namespace.resolve, ("/d/x",), 1)  # remembers /d
            assert done and attr.ino == x.ino
            store._commit = commit  # type: ignore[method-assign]
            cp._writing += 1  # a batch is on the writer thread: the rename goes there too
            try:
                async with trio.open_nursery() as inner:
                    inner.start_soon(lambda: cp.apply(ns.rename, 1, "d", 1, "e", 0, _committed=cp.forget_dirs))
                    await trio.to_thread.run_sync(committed.wait, 10)
                    try:
                        done, attr = cp.read_now(Namespace.resolve, ("/e/x",), 1)
                        assert done and attr.ino == x.ino  # the commit shows here already
                        with pytest.raises(StripefsError) as err:
                            cp.read_now(Namespace.resolve, ("/d/x",), 1)
                        assert err.value.code == ErrorCode.NOT_FOUND
                    finally:
                        go.set()
            finally:
                cp._writing -= 1
                store._commit = real  # type: ignore[method-assign]
            with pytest.raises(StripefsError):
                cp.read_now(Namespace.resolve, ("/d/x",), 1)
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        store.close()
