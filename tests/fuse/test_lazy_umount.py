"""``stripefs umount --lazy`` detaches the name only (issue #37, item 6).

Files opened through the mount before the lazy unmount keep working -- reads, writes,
fsync -- for as long as they stay open, however long that is; the daemon exits by
itself after the last one is closed, having committed them. Before the fix, ``umount
--lazy`` waited ``UMOUNT_WAIT`` (15 s) for the last close and then stopped the daemon, so
every open file answered ``ENOTCONN`` from then on.

The test shortens ``UMOUNT_WAIT`` to 1 s and keeps using the open files for three times
as long, so it exercises the old limit without waiting 15 s.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from stripefs.cli import main as cli_main
from stripefs.fsclient import Client
from stripefs.fsclient.fuse import _daemon, mount_record, mounted_fstype
from stripefs.fsclient.fuse._mounts import daemon_alive

from .conftest import do_mount, do_umount

pytestmark = pytest.mark.fuse

WAIT = 1.0  # UMOUNT_WAIT for the test
USE_FOR = 3 * WAIT + 1.0  # how long the open files are used after the detach: well past WAIT


def _wait_gone(pid: int, start: int | None, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while daemon_alive(pid, start):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_lazy_umount_keeps_open_files_working(cluster, client: Client, testdir: str, tmp_path, monkeypatch,
                                              capsys) -> None:
    monkeypatch.setattr(_daemon, "UMOUNT_WAIT", WAIT)
    mp = str(tmp_path / "m")
    do_mount(mp, cluster.file)
    record = mount_record(mp)
    pid, start = record["pid"], record["start"]
    data = os.urandom(600_000)
    client.write_bytes(f"{testdir}/data", data)
    reader = os.open(f"{mp}{testdir}/data", os.O_RDONLY)
    writer = os.open(f"{mp}{testdir}/log", os.O_CREAT | os.O_WRONLY, 0o644)
    written = bytearray()
    result: list[int] = []
    try:
        os.write(writer, b"before the unmount\n")
        written += b"before the unmount\n"
        umount = threading.Thread(target=lambda: result.append(cli_main(["umount", mp, "--lazy"])))
        umount.start()
        deadline = time.monotonic() + USE_FOR
        n = 0
        while time.monotonic() < deadline:  # reads, writes and fsyncs go on through the old limit
            off = (n * 77_777) % (len(data) - 4096)
            assert os.pread(reader, 4096, off) == data[off : off + 4096], f"read {n} at {off}"
            line = f"line {n} at {time.monotonic():.3f}\n".encode()
            assert os.write(writer, line) == len(line)
            written += line
            if n % 10 == 0:
                os.fsync(writer)
            n += 1
            time.sleep(0.02)
        umount.join(timeout=30)
        assert not umount.is_alive() and result == [0]
        assert mounted_fstype(mp) is None  # the name is gone at once...
        assert daemon_alive(pid, start), "the daemon stopped while files were open"  # ...the daemon is not
        err = capsys.readouterr().err
        assert "keeps serving" in err and "stopping it" not in err
        assert os.pread(reader, 100, 0) == data[:100]
        # The mount point is free: a new mount there is not disturbed when the old daemon exits.
        do_mount(mp, cluster.file)
        new_pid = mount_record(mp)["pid"]
    finally:
        os.close(reader)
        os.close(writer)
    try:
        # The last close ends the old mount: its daemon commits the file and exits by itself,
        # leaving the new mount and its record alone.
        assert _wait_gone(pid, start, 20.0), "the daemon still runs after the last open file was closed"
        assert mounted_fstype(mp) is not None and mount_record(mp)["pid"] == new_pid
        assert sorted(os.listdir(f"{mp}{testdir}")) == ["data", "log"]
    finally:
        do_umount(mp)
    assert mount_record(mp) is None
    assert client.read_bytes(f"{testdir}/log") == bytes(written)
