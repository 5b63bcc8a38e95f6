"""Through the mount: a write that fails in the background is reported by close(), and the
daemon's later release() does not commit a length over the lost bytes."""

from __future__ import annotations

import os
import time

import pytest

from stripefs.fsclient import Client

from .fuse_helpers import chunk_writes_fail

pytestmark = pytest.mark.fuse


def test_release_commits_nothing_after_close_failed(cluster, mdir: str, client: Client, testdir: str) -> None:
    path = f"{testdir}/lost"
    client.write_bytes(path, b"")
    ino = client.stat(path).ino
    with chunk_writes_fail(cluster.data["servers"], ino):
        fd = os.open(f"{mdir}/lost", os.O_WRONLY)
        # A whole first chunk (the tests' 256 KiB): a chunk file, blocked here (a file's small
        # chunks go to the container logs, and only its whole chunks to chunk files).
        assert os.write(fd, b"x" * 300_000) == 300_000  # buffered in the daemon: acknowledged
        with pytest.raises(OSError):
            os.close(fd)  # FUSE flush: the background write failed
    # release() follows close() asynchronously: give it time to (wrongly) commit.
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        assert client.stat(path).size == 0, "release() committed a length over bytes that were never written"
        time.sleep(0.1)
    # The daemon and the file are fine afterwards: a new open starts from a clean state.
    with open(f"{mdir}/lost", "wb") as f:
        f.write(b"ok" * 1000)
    assert client.read_bytes(path) == b"ok" * 1000


def test_truncate_by_another_client_while_written_through_the_mount(mdir: str, client: Client, testdir: str) -> None:
    """Bytes written through the mount, not committed yet; another client truncates the file
    to 0; the mount's close must not commit a length over the truncated range."""
    path = f"{testdir}/raced"
    client.write_bytes(path, b"a" * 1000)
    fd = os.open(f"{mdir}/raced", os.O_RDWR)
    try:
        assert os.pwrite(fd, b"b" * 700_000, 0) == 700_000
        assert os.pread(fd, 10, 0) == b"b" * 10  # a read flushes the daemon's buffers to the servers
        client.truncate(path, 0)
    finally:
        os.close(fd)
    assert client.stat(path).size == 0
    assert client.read_bytes(path) == b""
