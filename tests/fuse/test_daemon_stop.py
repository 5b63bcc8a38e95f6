"""Stopping the mount daemon keeps what was written, and only the daemon itself is stopped.

* any stop signal, and a lazy unmount, drains every open file first (write-behind
  buffers sent, lengths committed);
* liveness of a daemon (orphan clean-up, ``umount``) is judged by the pid *and* its
  start time, not by a command line, so a ``--foreground`` daemon keeps its orphans
  and a recycled pid is never signalled.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from stripefs.fsclient import Client
from stripefs.fsclient.fuse import _daemon, main as fuse_main, mount_record, mounted_fstype

from .conftest import do_mount, do_umount
from .fuse_helpers import wait_gone

pytestmark = pytest.mark.fuse

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_stop_signal_drains_open_files(sig: int, cluster, client: Client, testdir: str, tmp_path) -> None:
    """A file held open and written (no close, no fsync) keeps its bytes when the daemon is stopped."""
    mp = str(tmp_path / "m")
    do_mount(mp, cluster.file)
    pid = mount_record(mp)["pid"]
    data = os.urandom(300_000)  # smaller than a write-behind window: it sits in the daemon's buffer
    fd = os.open(f"{mp}{testdir}/log", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        assert os.write(fd, data) == len(data)
        os.kill(pid, sig)
        wait_gone(pid)
    finally:
        _close_quietly(fd)
        do_umount(mp)
    assert client.stat(f"{testdir}/log").size == len(data)
    assert client.read_bytes(f"{testdir}/log") == data


def test_lazy_umount_drains_open_files(cluster, client: Client, testdir: str, tmp_path, monkeypatch) -> None:
    """``umount --lazy`` with a file still open and written: the bytes survive the daemon's exit."""
    monkeypatch.setattr(_daemon, "UMOUNT_WAIT", 1.0)
    mp = str(tmp_path / "m")
    do_mount(mp, cluster.file)
    pid = mount_record(mp)["pid"]
    data = os.urandom(200_000)
    fd = os.open(f"{mp}{testdir}/held", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        assert os.write(fd, data) == len(data)
        assert fuse_main(["umount", mp, "--lazy"]) == 0
        assert os.write(fd, data) == len(data)  # still served after umount returned (#37 item 6)
    finally:
        _close_quietly(fd)
    wait_gone(pid)  # the last close ends the mount; the daemon commits and exits by itself
    assert mounted_fstype(mp) is None
    assert client.read_bytes(f"{testdir}/held") == data + data


def test_lazy_umount_waits_for_the_last_handle(cluster, client: Client, testdir: str, tmp_path, capsys) -> None:
    """``umount --lazy`` returns once the last handle closed and the daemon committed it and
    exited by itself: no signal needed."""
    import threading

    mp = str(tmp_path / "m")
    do_mount(mp, cluster.file)
    pid = mount_record(mp)["pid"]
    data = os.urandom(100_000)
    fd = os.open(f"{mp}{testdir}/late", os.O_CREAT | os.O_WRONLY, 0o644)
    assert os.write(fd, data) == len(data)
    closer = threading.Timer(1.0, os.close, (fd,))
    closer.start()
    try:
        assert fuse_main(["umount", mp, "--lazy"]) == 0
    finally:
        closer.join()
    err = capsys.readouterr().err
    assert "waiting up to" in err and "stopping it" not in err
    wait_gone(pid, timeout=1.0)  # umount returned after the daemon's exit
    assert client.read_bytes(f"{testdir}/late") == data


def test_foreground_daemon_keeps_its_orphans(cluster, client: Client, testdir: str, tmp_path) -> None:
    """A second mount's clean-up leaves the orphans of a live ``stripefs mount --foreground``."""
    fg, second = str(tmp_path / "fg"), str(tmp_path / "second")
    os.makedirs(fg)
    proc = subprocess.Popen([sys.executable, "-m", "stripefs", "mount", fg, "--foreground", "--cluster", cluster.file],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while mount_record(fg) is None or mounted_fstype(fg) is None:
            assert proc.poll() is None and time.monotonic() < deadline, "foreground mount did not come up"
            time.sleep(0.05)
        os.listdir(fg)
        path = f"{fg}{testdir}/victim"
        with open(path, "wb") as f:
            f.write(b"kept" * 1000)
        held = open(path, "rb")
        try:
            os.unlink(path)
            orphans = client.listdir("/.stripefs-orphans")
            assert any(name.startswith(f"{os.fstat(held.fileno()).st_ino}@") for name in orphans)
            do_mount(second, cluster.file)  # its start-up removes orphans of dead daemons only
            try:
                assert client.listdir("/.stripefs-orphans") == orphans
                assert held.read() == b"kept" * 1000
            finally:
                do_umount(second)
        finally:
            held.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        do_umount(fg)


def test_umount_never_signals_a_recycled_pid(cluster, tmp_path, monkeypatch) -> None:
    """The daemon died; its pid now belongs to an unrelated process: ``umount`` leaves that alone."""
    monkeypatch.setattr(_daemon, "UMOUNT_WAIT", 1.0)
    mp = str(tmp_path / "m")
    do_mount(mp, cluster.file)
    record = mount_record(mp)
    os.kill(record["pid"], signal.SIGKILL)
    wait_gone(record["pid"])
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        # Simulate pid reuse: the record now names a live process that is not the daemon.
        from stripefs.fsclient.fuse._mounts import write_mount_record

        write_mount_record(mp, {**record, "pid": bystander.pid})
        assert fuse_main(["umount", mp]) == 0
        assert mounted_fstype(mp) is None
        time.sleep(0.2)
        assert bystander.poll() is None, "umount signalled a process that is not the daemon"
    finally:
        bystander.kill()
        bystander.wait()
        do_umount(mp)
