"""Sequential writes through the mount are buffered on the daemon's trio loop.

A write that continues the file's write-behind buffer is copied there on the loop and
acknowledged with no worker-thread hop; a full buffer is sent in the background, the
mount's in-flight bytes bounded by ``write_buffer_mb``. The daemon here is the real
one, run by tests/fuse/loop_probe.py, which counts the hops of write requests.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Iterator

import pytest

from stripefs.fsclient import Client
from stripefs.fsclient.fuse import main as fuse_main
from stripefs.fsclient.testing.differential import LocalRoute, MountRoute, run_seed
from tests.fuse.conftest import do_umount
from tests.fuse.fuse_helpers import chunk_writes_fail

pytestmark = pytest.mark.fuse

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIG_CHUNK = 4 << 20  # the default layout's chunks: a window of several MiB, bigger than a kernel request
MiB = 1 << 20


@contextlib.contextmanager
def probe_mount(cluster, where: str, *opts: str) -> Iterator[tuple[str, dict[str, int]]]:
    """Mount the cluster with the counting daemon; yields (mount point, counts), the
    counts filled in once the daemon exited at unmount."""
    mp, out = os.path.join(where, "probe-mnt"), os.path.join(where, "probe.json")
    os.makedirs(mp, exist_ok=True)
    args = [sys.executable, "-m", "tests.fuse.loop_probe", mp, cluster.file, out]
    for o in opts:
        args += ["-o", o]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=open(os.path.join(where, "probe.log"), "wb"))
    counts: dict[str, int] = {}
    try:
        deadline = time.monotonic() + 30
        while not os.path.ismount(mp):
            assert proc.poll() is None, f"the probe daemon exited ({proc.returncode})"
            assert time.monotonic() < deadline, "the probe mount did not come up"
            time.sleep(0.05)
        yield mp, counts
    finally:
        do_umount(mp)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    with open(out) as f:
        counts.update(json.load(f))


def _big_chunk_dir(client: Client, testdir: str) -> str:
    client.makedirs(f"{testdir}/big")
    client.set_layout(f"{testdir}/big", chunk_size=BIG_CHUNK)
    return f"{testdir}/big"


def test_sequential_writes_take_no_worker_thread_hop(cluster, client: Client, testdir: str, tmp_path) -> None:
    d = _big_chunk_dir(client, testdir)
    data = os.urandom(48 * MiB)
    with probe_mount(cluster, str(tmp_path)) as (mp, counts):
        fd = os.open(f"{mp}{d}/seq", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for off in range(0, len(data), MiB):
                assert os.write(fd, data[off : off + MiB]) == MiB
            os.fsync(fd)
        finally:
            os.close(fd)
    assert client.read_bytes(f"{d}/seq") == data
    assert counts["write_requests"] >= len(data) // MiB
    # Every request lands in a buffer on the loop; a full one is sent by the client's own
    # threads, not by a worker-thread hop of the request.
    assert counts["write_hops"] == 0, counts
    assert counts["max_sending"] > 0, counts


def test_in_flight_bytes_bounded_per_mount(cluster, client: Client, testdir: str, tmp_path) -> None:
    """Three fast writers; the mount keeps at most ``write_buffer_mb`` in flight."""
    d = _big_chunk_dir(client, testdir)
    with client.open(f"{d}/probe", "wb") as f:
        window = f.window
    budget = window // MiB  # one window: writers of the other files wait on the loop for room
    blobs = [os.urandom(3 * window) for _ in range(3)]
    errors: list[BaseException] = []

    def writer(mp: str, i: int) -> None:
        try:
            with open(f"{mp}{d}/w{i}", "wb", buffering=0) as f:
                view = memoryview(blobs[i])
                for off in range(0, len(view), MiB):
                    f.write(view[off : off + MiB])
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    with probe_mount(cluster, str(tmp_path), f"write_buffer_mb={budget}") as (mp, counts):
        threads = [threading.Thread(target=writer, args=(mp, i)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a writer is stuck"
    assert not errors, errors
    for i, blob in enumerate(blobs):
        assert client.read_bytes(f"{d}/w{i}") == blob
    assert 0 < counts["max_sending"] <= budget * MiB, counts


def test_background_send_failure_reported_at_fsync(cluster, mdir: str, client: Client, testdir: str) -> None:
    """Buffers sent in the background from the loop fail: the next write or the fsync
    reports it (the errno a failed write gets on the thread path), close reports it
    again, and no length is committed over the lost bytes."""
    d = _big_chunk_dir(client, testdir)
    client.write_bytes(f"{d}/lost", b"")
    ino = client.stat(f"{d}/lost").ino
    with client.open(f"{d}/lost", "rb") as f:
        window = f.window
    reported: list[int] = []
    with chunk_writes_fail(cluster.data["servers"], ino):
        fd = os.open(f"{mdir}/big/lost", os.O_WRONLY)
        try:
            try:
                for off in range(0, 3 * window, MiB):
                    os.write(fd, b"x" * MiB)  # acknowledged once buffered; a later one may report
                os.fsync(fd)
            except OSError as exc:
                reported.append(exc.errno)
            with pytest.raises(OSError) as again:
                os.fsync(fd)  # sticky: the bytes are lost for good
            reported.append(again.value.errno)
        finally:
            with pytest.raises(OSError):
                os.close(fd)
        # The same failure through the thread path (a write past the buffer, not contiguous).
        fd = os.open(f"{mdir}/big/lost", os.O_WRONLY)
        try:
            with pytest.raises(OSError) as direct:
                os.pwrite(fd, b"y" * (2 * window), 0)
                os.fsync(fd)
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
    assert len(reported) == 2 and reported[0] == reported[1] == direct.value.errno, (reported, direct.value)
    time.sleep(0.5)  # release() follows close() asynchronously
    assert client.stat(f"{d}/lost").size == 0


@pytest.mark.parametrize("seed", range(4))
def test_differential_with_loop_buffered_writes(mdir: str, client: Client, testdir: str, tmp_path, seed: int) -> None:
    """Interleaved writes, reads, seek-back patches and truncates through the mount, in a
    directory whose window is larger than the files: every sequential write is buffered
    on the loop. The file must match a local one at every check."""
    d = _big_chunk_dir(client, testdir)
    with client.open(f"{d}/probe", "wb") as f:
        window = f.window
    run_seed(MountRoute(f"{mdir}/big", client, d), LocalRoute(str(tmp_path)), f"f{seed}", seed, ops=100,
             chunk=BIG_CHUNK, window=window, max_size=4 * MiB)


def test_storage_server_killed_mid_write(make_cluster, tmp_path, monkeypatch) -> None:
    """A storage server dies while buffers are being sent from the loop: the next write,
    the fsync or the close reports it (EHOSTUNREACH, as a native client's write gets),
    and no length is committed over the lost bytes."""
    h = make_cluster(servers=2)
    with h.client() as c:
        c.makedirs("/big")
        c.set_layout("/big", chunk_size=BIG_CHUNK)
        c.write_bytes("/big/f", b"")
        victim = c.status().servers[0]
    mp = str(tmp_path / "m")
    os.makedirs(mp)
    monkeypatch.setenv("STRIPEFS_RETRY_FOR", "3")  # the daemon's chunk writes give up after 3 s
    assert fuse_main(["mount", mp, "--cluster", h.file]) == 0
    try:
        fd = os.open(f"{mp}/big/f", os.O_WRONLY)
        reported: list[int] = []
        t0 = time.monotonic()
        try:
            try:
                for i in range(64):
                    if i == 8:
                        os.kill(victim.pid, signal.SIGKILL)
                    os.write(fd, b"z" * MiB)
                os.fsync(fd)
            except OSError as exc:
                reported.append(exc.errno)
        finally:
            try:
                os.close(fd)
            except OSError as exc:
                reported.append(exc.errno)
        assert reported and set(reported) == {errno.EHOSTUNREACH}, reported
        assert time.monotonic() - t0 < 30
    finally:
        do_umount(mp)
    with h.client() as c:
        assert c.stat("/big/f").size == 0


def test_concurrent_sequential_readers_get_their_bytes(mdir: str, client: Client, testdir: str) -> None:
    """Reads answered from views of readahead windows (no copy in the daemon): two files
    read at once, windows recycled between them, each reader gets exactly its bytes."""
    d = _big_chunk_dir(client, testdir)
    blobs = [os.urandom(40 * MiB + 12345) for _ in range(2)]
    for i, blob in enumerate(blobs):
        client.write_bytes(f"{d}/r{i}", blob)
    got: dict[int, bytes] = {}
    errors: list[BaseException] = []

    def reader(i: int) -> None:
        try:
            with open(f"{mdir}/big/r{i}", "rb", buffering=0) as f:
                parts = []
                while chunk := f.read(MiB):
                    parts.append(chunk)
                got[i] = b"".join(parts)
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    for _ in range(2):  # the second round from the kernel's page cache or fresh, either way exact
        got.clear()
        threads = [threading.Thread(target=reader, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        for i, blob in enumerate(blobs):
            assert got[i] == blob, f"reader {i}: wrong bytes"
