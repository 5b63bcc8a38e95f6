"""Errors of background writes stay reported, and never become a committed length.

A write that is acknowledged to the caller once buffered can fail later, in the
background. From then on every ``flush``/``fsync``/``close`` of that file object
must fail (not only the first one), and no length covering the lost bytes may be
committed: readers would get zeros where the writer's data should be.
"""

from __future__ import annotations

import errno
from concurrent.futures import Future
from typing import Any

import pytest

from stripefs.fsclient import Client
from tests.conftest import TEST_CHUNK
from stripefs.wire import ErrorCode, StripefsError


def _fail_chunk(client: Client, monkeypatch: pytest.MonkeyPatch, index: int) -> list[int]:
    """Make every write of chunk ``index`` fail with EIO (not retried); returns a hit counter."""
    core = client._core  # fault injection at the transport: wrap the data connections
    real = core.data_conn
    hits = [0]

    class Failing:
        def __init__(self, conn: Any):
            self.conn = conn

        def submit(self, msg: Any, **kw: Any) -> Any:
            if kw.get("payload") is not None and getattr(msg, "index", None) == index:
                hits[0] += 1
                fut: Future = Future()
                fut.set_exception(StripefsError(ErrorCode.IO, "injected disk error"))
                return fut
            return self.conn.submit(msg, **kw)

    monkeypatch.setattr(core, "data_conn", lambda sid: Failing(real(sid)))
    return hits


def test_background_write_error_is_sticky(client: Client, testdir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    path = f"{testdir}/sticky"
    client.write_bytes(path, b"")
    hits = _fail_chunk(client, monkeypatch, 1)
    f = client.open(path, "r+b")
    f.write(b"x" * (3 * TEST_CHUNK))  # buffered: acknowledged to the caller
    f.seek(10 * TEST_CHUNK)
    f.write(b"tail")  # sends the buffer in the background; chunk 1 fails there
    with pytest.raises(OSError) as first:
        f.fsync()
    assert first.value.errno == errno.EIO and hits[0] >= 1
    monkeypatch.undo()  # the disk is fine again: the lost bytes are still lost
    with pytest.raises(OSError):
        f.fsync()  # a second fsync must not report success
    with pytest.raises(OSError):
        f.flush()
    with pytest.raises(OSError):
        f.write(b"more")
    with pytest.raises(OSError):
        f.close()
    assert f.closed
    assert client.stat(path).size == 0  # no length over the lost chunk was committed


@pytest.mark.parametrize("defer", [False, True], ids=["made-at-open", "made-at-close"])
def test_close_after_error_commits_nothing(client: Client, testdir: str, monkeypatch: pytest.MonkeyPatch,
                                           defer: bool) -> None:
    """Error seen first by close: close fails, and nothing is committed (a new file whose
    name waits for its first fsync/close gets no name at all)."""
    path = f"{testdir}/close"
    _fail_chunk(client, monkeypatch, 0)
    f = client.open(path, "wb", defer=defer)
    f.write(b"y" * 1000)
    with pytest.raises(OSError):
        f.close()
    assert f.closed
    monkeypatch.undo()
    if defer:
        assert not client.exists(path)
    else:
        assert client.stat(path).size == 0
    f.close()  # closing again is a no-op, as for any file object


def test_failed_synchronous_write_is_sticky(client: Client, testdir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A large write sent straight from the caller's buffer fails in write() itself; some of
    its chunks may have landed. Later syncs fail too, so the caller cannot commit a length
    over the chunks that did not."""
    path = f"{testdir}/direct"
    _fail_chunk(client, monkeypatch, 2)
    f = client.open(path, "wb")
    with pytest.raises(OSError):
        f.write(b"z" * (8 * TEST_CHUNK))  # past the write-behind window: sent directly
    monkeypatch.undo()
    f.seek(9 * TEST_CHUNK)
    with pytest.raises(OSError):
        f.write(b"after")
    with pytest.raises(OSError):
        f.fsync()
    with pytest.raises(OSError):
        f.close()
    assert client.stat(path).size == 0


def test_truncate_racing_an_uncommitted_write(cluster, client: Client, testdir: str) -> None:
    """Writer A's bytes are on the servers but not committed; B truncates to 0 (the servers
    drop every chunk); A closes. A's commit must not bring back a length over the removed
    chunks: the truncate came after every byte A wrote, so the file is empty (as on a local
    disk), not 768 KiB of zeros."""
    path = f"{testdir}/raced"
    client.write_bytes(path, b"a" * (2 * TEST_CHUNK))
    other = cluster.client()
    try:
        f = client.open(path, "r+b")
        f.write(b"b" * (3 * TEST_CHUNK))
        f.flush()  # acknowledged by the storage servers, length not committed yet
        other.truncate(path, 0)
        f.close()
        assert other.stat(path).size == 0, "the writer's close resurrected a length over truncated chunks"
        # The file works normally afterwards, for both clients.
        with client.open(path, "r+b") as g:
            g.write(b"c" * 100)
        assert other.read_bytes(path) == b"c" * 100
        # A truncate this writer made itself does not stop its own commits.
        with client.open(path, "r+b") as g:
            g.truncate(10)
            g.seek(50)
            g.write(b"d" * 20)
        assert other.read_bytes(path) == b"c" * 10 + bytes(40) + b"d" * 20
    finally:
        other.close()
