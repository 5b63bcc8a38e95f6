"""Issue #27 item 4: Linux reports a writeback error of a file to one fsync only (and a
descriptor opened after the error never sees it). ``SqliteStore.sync_log`` opens a fresh
descriptor per call, so once any path saw a failed fsync of the log, no later fsync may
be taken as proof that commits are durable: every later acknowledgement fails with EIO
until the service restarts."""

from __future__ import annotations

import errno
import os

import pytest
import trio

from stripefs.wire import ErrorCode, StripefsError
from stripefs.wire import messages as m
from tests.metadata.conftest import sqlite_service


class _FailOnce:
    """``os.fsync`` that fails the next call with EIO, then succeeds (as a descriptor
    opened after a writeback error does: the error was reported once)."""

    def __init__(self) -> None:
        self.armed = False
        self.real = os.fsync

    def __call__(self, fd: int) -> None:
        if self.armed:
            self.armed = False
            raise OSError(errno.EIO, "injected writeback error")
        self.real(fd)


def _mkdir(name: str) -> m.Mkdir:
    return m.Mkdir(parent=1, name=name, mode=0o755, uid=0, gid=0)


def test_a_log_fsync_error_seen_elsewhere_fails_every_later_acknowledgement(tmp_path, monkeypatch) -> None:
    svc, store = sqlite_service(tmp_path)
    fsync = _FailOnce()
    monkeypatch.setattr(os, "fsync", fsync)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(svc.commit.run)
            await svc._dispatch(_mkdir("warm"))
            # Another path (the writer thread's own sync of a commit) meets the error...
            fsync.armed = True
            with pytest.raises(OSError):
                await trio.to_thread.run_sync(store.sync_log)
            # ...and the group fsync that follows, on a new descriptor, would succeed.
            for name in ("lost", "refused"):
                with pytest.raises(StripefsError) as info, trio.fail_after(5):
                    await svc._dispatch(_mkdir(name))
                assert info.value.code == ErrorCode.IO
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        store.close()
