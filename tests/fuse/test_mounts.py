"""Mount life cycle: two daemons on one cluster, kill -9 and remount, clear errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from .conftest import do_mount, do_umount
from .fuse_helpers import alive
from stripefs.fsclient.fuse import main as fuse_main, mount_record, mounted_fstype

pytestmark = pytest.mark.fuse


def test_two_mounts_close_to_open(mnt: str, cluster, testdir: str, tmp_path) -> None:
    second = str(tmp_path / "second")
    do_mount(second, cluster.file)
    try:
        a, b = mnt + testdir, second + testdir
        with open(f"{a}/shared", "wb") as f:
            f.write(b"one")
        assert open(f"{b}/shared", "rb").read() == b"one"
        os.stat(f"{b}/shared")  # mount B now holds attributes of the short file
        with open(f"{a}/shared", "ab") as f:
            f.write(b" two three")
        with open(f"{b}/shared", "rb") as f:  # open after close: sees the new length
            assert f.read() == b"one two three"
        with open(f"{b}/shared", "r+b") as f:
            f.write(b"ONE")
        with open(f"{a}/shared", "rb") as f:
            assert f.read() == b"ONE two three"
        os.mkdir(f"{b}/made-in-b")
        assert os.path.isdir(f"{a}/made-in-b")
        os.rename(f"{a}/shared", f"{a}/moved")
        assert open(f"{b}/moved", "rb").read() == b"ONE two three"
    finally:
        do_umount(second)


def test_kill_9_then_remount_keeps_closed_files(make_cluster, tmp_path) -> None:
    c = make_cluster(servers=2)
    mp = str(tmp_path / "m")
    do_mount(mp, c.file)
    payload = {f"f{i}": os.urandom(100_000 * (i + 1)) for i in range(4)}
    os.mkdir(f"{mp}/d")
    for name, data in payload.items():
        with open(f"{mp}/d/{name}", "wb") as f:
            f.write(data)
    held = open(f"{mp}/d/open-at-crash", "wb")
    held.write(b"unflushed?")
    record = mount_record(mp)
    assert record is not None
    os.kill(record["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while alive(record["pid"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(OSError):
        os.listdir(mp)  # ENOTCONN: the mount is dead
    try:
        held.close()
    except OSError:
        pass
    assert fuse_main(["umount", mp]) == 0
    assert mounted_fstype(mp) is None
    do_mount(mp, c.file)
    try:
        for name, data in payload.items():
            assert open(f"{mp}/d/{name}", "rb").read() == data
    finally:
        do_umount(mp)


def test_stale_orphans_of_a_dead_daemon_are_removed(make_cluster, tmp_path) -> None:
    c = make_cluster(servers=1)
    mp = str(tmp_path / "m")
    do_mount(mp, c.file)
    with open(f"{mp}/victim", "wb") as f:
        f.write(b"x" * 1000)
    held = open(f"{mp}/victim", "rb")
    os.unlink(f"{mp}/victim")
    assert len(os.listdir(f"{mp}/.stripefs-orphans")) == 1
    os.kill(mount_record(mp)["pid"], signal.SIGKILL)
    time.sleep(0.3)
    try:
        held.close()
    except OSError:
        pass
    fuse_main(["umount", mp])
    do_mount(mp, c.file)
    try:
        assert os.listdir(f"{mp}/.stripefs-orphans") == []
    finally:
        do_umount(mp)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stripefs", *args], capture_output=True, text=True, timeout=60,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_mount_errors_are_clear(mnt: str, cluster, tmp_path) -> None:
    r = _cli("mount", mnt, "--cluster", cluster.file)
    assert r.returncode == 1 and "busy" in r.stderr
    r = _cli("mount", str(tmp_path / "missing"), "--cluster", cluster.file)
    assert r.returncode == 1 and "not an existing directory" in r.stderr
    (tmp_path / "m").mkdir()
    r = _cli("mount", str(tmp_path / "m"), "--cluster", "127.0.0.1:1", "-o", "attr_timeout=1")
    env_secret = "STRIPEFS_SECRET" in os.environ
    assert r.returncode == 1 and ("unreachable" in r.stderr or not env_secret)
    r = _cli("mount", str(tmp_path / "m"), "--cluster", cluster.file, "-o", "attr_timeout=soon")
    assert r.returncode == 1 and "bad mount option" in r.stderr
    r = _cli("mount", str(tmp_path / "m"), "--cluster", cluster.file, "-o", "write_buffer_mb=0")
    assert r.returncode == 1 and "bad mount option" in r.stderr
    r = _cli("umount", str(tmp_path / "m"))
    assert r.returncode == 1 and "not mounted" in r.stderr


def test_batch_reads_of_files_under_the_mount(mnt: str, mdir: str, cluster) -> None:
    """The zero-copy ring resolves a mounted path to its cluster and inode (USRBIO's reg_fd)."""
    from stripefs.fsclient import Client
    from stripefs.fsclient.batchread import ReadRing, SharedBuffer

    data = os.urandom(3 << 20)
    path = os.path.join(mdir, "samples.bin")
    with open(path, "wb") as f:
        f.write(data)
    with Client(cluster.file) as client:
        ring = ReadRing(client)
        f = ring.open_mounted(path)
        buf = SharedBuffer(64 << 10)
        offsets = [0, 1 << 20, (3 << 20) - 100]
        for i, off in enumerate(offsets):
            ring.prepare(buf.view[i * 4096 : (i + 1) * 4096], f, off, 4096, userdata=i)
        assert ring.submit() == len(offsets)
        done = ring.wait(len(offsets), timeout=30)
        got = {c.userdata: c.result for c in done}
        assert got == {0: 4096, 1: 4096, 2: 100}  # a short count at EOF
        for i, off in enumerate(offsets):
            n = got[i]
            assert bytes(buf.view[i * 4096 : i * 4096 + n]) == data[off : off + n]
        buf.close()


def test_a_read_only_mount_reads_refuses_changes_and_needs_no_flush(cluster, testdir: str, tmp_path) -> None:
    """``-o ro``: files read as in any mount; every change fails with EROFS; after the first
    close the kernel sends the daemon no FLUSH (it was told the mount needs none), so a
    dataloader's file costs one request fewer -- and the access log shows it."""
    import errno

    from stripefs.fsclient.core._accesslog import parse_line

    with cluster.client() as c:
        made = {f"f{k}": os.urandom(1000 + k) for k in range(5)}
        for name, data in made.items():
            c.write_bytes(f"{testdir}/{name}", data)
    mp, log = str(tmp_path / "ro"), str(tmp_path / "access.log")
    os.makedirs(mp)
    assert fuse_main(["mount", mp, "--cluster", cluster.file, "-o", "ro", "--access-log", log]) == 0
    try:
        for _ in range(3):
            for name, data in made.items():
                with open(f"{mp}{testdir}/{name}", "rb") as f:
                    assert f.read() == data
        for change in (lambda: open(f"{mp}{testdir}/new", "wb"), lambda: open(f"{mp}{testdir}/f0", "r+b"),
                       lambda: os.unlink(f"{mp}{testdir}/f1"), lambda: os.mkdir(f"{mp}{testdir}/d")):
            with pytest.raises(OSError) as exc:
                change()
            assert exc.value.errno == errno.EROFS
    finally:
        do_umount(mp)
    with open(log) as f:
        ops = [a.op for line in f if (a := parse_line(line)) is not None]
    assert ops.count("open") == 15 and ops.count("read") >= 5  # later opens: the kept pages
    assert ops.count("flush") <= 1  # the first close's, answered ENOSYS
    with cluster.client() as c:  # nothing changed
        assert sorted(c.listdir(testdir)) == sorted(made)


def test_ro_and_rw_options() -> None:
    from stripefs.fsclient.fuse._daemon import parse_options

    cfg, opts = parse_options(["ro"])
    assert cfg.read_only and "ro" in opts
    cfg, opts = parse_options(["ro,attr_timeout=2", "rw"])  # the last one counts, as for mount(8)
    assert not cfg.read_only and "rw" in opts and "ro" not in opts
    assert not parse_options([])[0].read_only


def test_a_read_only_daemon_refuses_changes_itself(cluster, testdir: str) -> None:
    """Even if the kernel let one through (a remount read-write), a daemon mounted ``ro``
    answers every change and every open for writing with EROFS; reads still work."""
    import errno

    import pyfuse3
    import trio

    from stripefs.fsclient.fuse._operations import CHANGES, FuseConfig, StripeOperations

    client = cluster.client()
    try:
        client.write_bytes(f"{testdir}/f", b"data")
        ino = client.stat(f"{testdir}/f").ino
        ops = StripeOperations(client, FuseConfig(read_only=True))
        ctx = pyfuse3.RequestContext()

        async def errno_of(call: Any) -> int:
            try:
                await call
            except pyfuse3.FUSEError as exc:
                return exc.errno
            return 0

        async def main() -> None:
            for op in CHANGES:  # whatever the arguments: nothing reaches the cluster
                assert await errno_of(getattr(ops, op)(ino, b"x", 0o644, ctx)) == errno.EROFS, op
            for flags in (os.O_WRONLY, os.O_RDWR, os.O_RDONLY | os.O_TRUNC):
                assert await errno_of(ops.open(ino, flags, ctx)) == errno.EROFS
            fi = await ops.open(ino, os.O_RDONLY, ctx)
            assert bytes(await ops.read(fi.fh, 0, 100)) == b"data"
            assert await errno_of(ops.flush(fi.fh)) == errno.ENOSYS
            await ops.release(fi.fh)

        trio.run(main)
        assert client.read_bytes(f"{testdir}/f") == b"data"
    finally:
        client.close()
