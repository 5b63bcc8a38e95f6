"""One small durable file through the mount (issue #30): create, write, fsync, close.

What the daemon does per file, counted in-process (a :class:`StripeOperations` driven
directly, no kernel): the ``security.capability`` query of a file just created is answered
from memory, the FLUSH and RELEASE after an FSYNC that committed everything send nothing and
need no worker thread, and the last close takes the version of the kernel's pages from the
commit's answer instead of asking again. And that those shortcuts lose nothing: a kill -9
of the daemon, of a storage server or of the metadata service once ``fsync`` returned keeps
every byte and the length.
"""

from __future__ import annotations

import errno
import os
import signal
import stat
from types import SimpleNamespace
from typing import Any

import pyfuse3
import pytest
import trio

from stripefs.fsclient import Client
from stripefs.fsclient.fuse import main as fuse_main, mount_record
from stripefs.fsclient.fuse._operations import StripeOperations
from stripefs.wire import messages as m

from .conftest import do_mount, do_umount
from .fuse_helpers import wait_gone

pytestmark = pytest.mark.fuse

CREATE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
CTX = pyfuse3.RequestContext()  # uid 0, gid 0


class Counted:
    """What a :class:`StripeOperations` sends: metadata requests from the loop (``aio.call``,
    ``aio.call_header``), worker-thread hops (``aio.run``) and requests the blocking client
    sends on them."""

    def __init__(self, ops: StripeOperations) -> None:
        self.calls: list[str] = []
        self.hops = 0
        self.sync_calls: list[str] = []
        aio, core = ops.aio, ops.client._core
        call, call_header, run, core_call = aio.call, aio.call_header, aio.run, core.call

        async def counted_call(msg: Any) -> Any:
            self.calls.append(type(msg).__name__)
            return await call(msg)

        async def counted_call_header(msg: Any) -> Any:
            self.calls.append(type(msg).__name__)
            return await call_header(msg)

        async def counted_run(fn: Any, *args: Any, **kw: Any) -> Any:
            self.hops += 1
            return await run(fn, *args, **kw)

        def counted_core_call(msg: Any, *args: Any, **kw: Any) -> Any:
            self.sync_calls.append(type(msg).__name__)
            return core_call(msg, *args, **kw)

        aio.call, aio.call_header, aio.run = counted_call, counted_call_header, counted_run  # type: ignore[method-assign]
        core.call = counted_core_call  # type: ignore[method-assign]

    def reset(self) -> None:
        self.calls.clear()
        self.sync_calls.clear()
        self.hops = 0


@pytest.fixture
def ops(cluster, monkeypatch) -> Any:
    monkeypatch.setenv("STRIPEFS_LEASES", "0")
    client = cluster.client()
    try:
        yield StripeOperations(client)
    finally:
        client.close()


def _dir_ino(client: Client, path: str) -> int:
    return client.stat(path).ino


def test_durable_small_file_sends_create_write_and_one_commit(ops: StripeOperations, testdir: str) -> None:
    """create, getxattr(security.capability), write, fsync, flush, release: the Create, one
    chunk write and one CommitLength, and one worker-thread hop (the fsync). Before: a
    GetXattr, a hop for the flush, a hop and a GetAttr for the release."""
    parent = _dir_ino(ops.client, testdir)
    ops.client.routing()  # the chain table, fetched once per client
    counted = Counted(ops)
    data = os.urandom(20_000)

    async def one_file() -> None:
        fi, entry = await ops.create(parent, b"small", stat.S_IFREG | 0o644, CREATE, CTX)
        ino = entry.st_ino
        counted.reset()
        with pytest.raises(pyfuse3.FUSEError) as err:
            await ops.getxattr(ino, b"security.capability", CTX)
        assert err.value.errno == errno.ENODATA
        assert await ops.write(fi.fh, 0, data) == len(data)
        await ops.fsync(fi.fh, False)
        assert counted.hops == 1 and counted.sync_calls == ["CommitLength"] and counted.calls == []
        counted.reset()
        await ops.flush(fi.fh)
        await ops.release(fi.fh)
        assert (counted.hops, counted.calls, counted.sync_calls) == (0, [], [])

    trio.run(one_file)
    with ops.client.open(f"{testdir}/small", "rb") as f:
        assert f.read() == data


def test_pages_kept_only_for_the_version_this_mount_committed(ops: StripeOperations, testdir: str) -> None:
    """The last close takes the version of the kernel's pages from the commit's answer: a
    reopen keeps them; a change made elsewhere after the close drops them; a write without
    fsync (committed by the close itself) and a truncate after the fsync are versions too."""
    parent = _dir_ino(ops.client, testdir)
    path = f"{testdir}/f"

    async def run() -> None:
        fi, entry = await ops.create(parent, b"f", stat.S_IFREG | 0o644, CREATE, CTX)
        ino = entry.st_ino
        await ops.write(fi.fh, 0, b"a" * 5000)
        await ops.fsync(fi.fh, False)
        await ops.flush(fi.fh)
        await ops.release(fi.fh)
        fi = await ops.open(ino, os.O_RDONLY, CTX)
        assert fi.keep_cache  # nothing changed since this mount's commit
        await ops.release(fi.fh)

        fi = await ops.open(ino, os.O_WRONLY, CTX)
        await ops.write(fi.fh, 5000, b"b" * 100)  # committed by the close, no fsync
        await ops.flush(fi.fh)
        await ops.release(fi.fh)
        fi = await ops.open(ino, os.O_RDONLY, CTX)
        assert fi.keep_cache
        await ops.release(fi.fh)

        fi = await ops.open(ino, os.O_WRONLY, CTX)
        await ops.write(fi.fh, 0, b"c" * 10)
        await ops.fsync(fi.fh, False)
        attr = pyfuse3.EntryAttributes()
        attr.st_size = 3
        fields = SimpleNamespace(update_size=True, update_mode=False, update_uid=False, update_gid=False,
                                 update_atime=False, update_mtime=False)  # ftruncate after the fsync: a version too
        await ops.setattr(ino, attr, fields, fi.fh, CTX)
        await ops.flush(fi.fh)
        await ops.release(fi.fh)
        fi = await ops.open(ino, os.O_RDONLY, CTX)
        assert fi.keep_cache
        await ops.release(fi.fh)

        with ops.client.open(path, "r+b") as f:  # another client rewrites it, same size
            f.write(b"zzz")
        fi = await ops.open(ino, os.O_RDONLY, CTX)
        assert not fi.keep_cache
        await ops.release(fi.fh)

    trio.run(run)
    assert ops.client.read_bytes(path) == b"zzz"


def test_flush_after_a_failed_fsync_still_reports(ops: StripeOperations, testdir: str, monkeypatch) -> None:
    """A commit that failed leaves the file unsettled: the flush tries again (and reports)."""
    parent = _dir_ino(ops.client, testdir)
    client = ops.client
    real = client.commit_length
    fail = [True]

    def flaky(*args: Any, **kw: Any) -> Any:
        if fail[0]:
            raise OSError(errno.EIO, "injected")
        return real(*args, **kw)

    monkeypatch.setattr(client, "commit_length", flaky)

    async def run() -> None:
        fi, _ = await ops.create(parent, b"g", stat.S_IFREG | 0o644, CREATE, CTX)
        await ops.write(fi.fh, 0, b"x" * 3000)
        with pytest.raises(pyfuse3.FUSEError):
            await ops.fsync(fi.fh, False)
        with pytest.raises(pyfuse3.FUSEError):
            await ops.flush(fi.fh)
        fail[0] = False
        await ops.flush(fi.fh)  # committed now
        await ops.release(fi.fh)

    trio.run(run)
    assert client.read_bytes(f"{testdir}/g") == b"x" * 3000


# -- crashes once fsync returned -----------------------------------------------------------------
def _write_durably(directory: str, count: int, close: bool) -> tuple[dict[str, bytes], list[int]]:
    """``count`` files of 4-64 KiB: create, write, fsync (and close)."""
    made, fds = {}, []
    for k in range(count):
        data = os.urandom(4096 * (1 + k % 16) - k)
        fd = os.open(f"{directory}/f{k}", CREATE, 0o644)
        os.write(fd, data)
        os.fsync(fd)
        if close:
            os.close(fd)
        else:
            fds.append(fd)
        made[f"f{k}"] = data
    return made, fds


def _check(c: Client, directory: str, made: dict[str, bytes]) -> None:
    for name, data in made.items():
        assert c.stat(f"{directory}/{name}").size == len(data), name
        assert c.read_bytes(f"{directory}/{name}") == data, name


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    wait_gone(pid, timeout=10)


def test_kill_9_of_the_daemon_after_fsync_and_close_keeps_the_files(make_cluster, tmp_path) -> None:
    """fsync returned (and close, whose FLUSH and RELEASE send nothing now): kill -9 of the
    daemon at once loses nothing, whether the files were closed or are still open."""
    h = make_cluster(servers=2)
    mp = str(tmp_path / "m")
    do_mount(mp, h.file)
    try:
        os.mkdir(f"{mp}/d")
        closed, _ = _write_durably(f"{mp}/d", 12, close=True)
        os.mkdir(f"{mp}/e")
        held, fds = _write_durably(f"{mp}/e", 6, close=False)
        _kill(mount_record(mp)["pid"])
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
        assert fuse_main(["umount", mp]) == 0
        with h.client() as c:
            _check(c, "/d", closed)
            _check(c, "/e", held)
    finally:
        do_umount(mp)


@pytest.mark.parametrize("victim", ["storage", "metadata"])
def test_kill_9_of_a_service_after_fsync_and_close_keeps_the_files(make_cluster, tmp_path, victim: str) -> None:
    """kill -9 of a storage server or of the metadata service as soon as the files were
    fsynced and closed: restarted, they hold every byte and every length."""
    h = make_cluster(servers=2)
    mp = str(tmp_path / "m")
    do_mount(mp, h.file)
    try:
        os.mkdir(f"{mp}/d")
        made, _ = _write_durably(f"{mp}/d", 12, close=True)
        with h.client() as c:
            st = c.status()
            pid = st.servers[0].pid if victim == "storage" else int(st.metadata["pid"])
        _kill(pid)
        h.up()  # restarts the dead process
        with h.client() as c:
            _check(c, "/d", made)
    finally:
        do_umount(mp)
