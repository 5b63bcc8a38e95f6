"""The native client against a real local cluster: namespace, striping, data, consistency."""

from __future__ import annotations

import errno
import hashlib
import itertools
import os
import stat
import subprocess
import sys
import threading
import time
from typing import Callable, Iterator

import crc32c
import pytest

from stripefs.fsclient import Client
from stripefs.storage import chunk_files, chunk_path
from tests.conftest import TEST_CHUNK


@pytest.fixture
def umask() -> Iterator[Callable[[int], None]]:
    """Set the process umask for one test (restored afterwards); the servers are other processes."""
    old = os.umask(0o022)
    os.umask(old)
    yield os.umask
    os.umask(old)


def test_striping_lands_on_every_server(client: Client, cluster, testdir: str) -> None:
    data = os.urandom(TEST_CHUNK * 4 * 3 + 12345)  # > stripe x chunk
    path = f"{testdir}/big.bin"
    with client.open(path, "wb") as f:
        f.write(data)
    placement = client.placement(path)
    assert {p["server"] for p in placement} == {s.server_id for s in client.status().servers}
    attr = client.stat(path)
    assert attr.size == len(data) and attr.layout.stripe == min(16, len(client.routing().chains))
    holders = [s for s in cluster.data["servers"] if chunk_files(s["root"], attr.ino)]
    assert len(holders) == 4  # bytes really are on every server's disk
    assert hashlib.sha256(client.read_bytes(path)).digest() == hashlib.sha256(data).digest()


def test_small_and_unaligned_io(client: Client, testdir: str) -> None:
    path = f"{testdir}/small"
    pieces = [os.urandom(n) for n in (1, 7, 4096, 100_000, 3, TEST_CHUNK + 1)]
    with client.open(path, "wb") as f:
        for p in pieces:
            f.write(p)
    data = b"".join(pieces)
    with client.open(path, "rb") as f:
        assert f.read(5) == data[:5]
        f.seek(TEST_CHUNK - 3)
        assert f.read(10) == data[TEST_CHUNK - 3 : TEST_CHUNK + 7]
        assert f.pread(100, len(data) - 50) == data[-50:]
        f.seek(0)
        assert f.read() == data
        assert f.read(10) == b""


def test_modes(client: Client, testdir: str) -> None:
    p = f"{testdir}/m"
    client.write_bytes(p, b"hello")
    with client.open(p, "ab") as f:
        f.write(b" world")
    assert client.read_bytes(p) == b"hello world"
    with pytest.raises(FileExistsError):
        client.open(p, "xb")
    with client.open(p, "r+b") as f:
        f.seek(6)
        f.write(b"WORLD")
    assert client.read_bytes(p) == b"hello WORLD"
    with client.open(p, "w") as f:
        f.write("text ünïcode\n")
    with client.open(p, "r") as f:
        assert f.read() == "text ünïcode\n"
    with pytest.raises(FileNotFoundError):
        client.open(f"{testdir}/none", "rb")
    with pytest.raises(IsADirectoryError):
        client.open(testdir, "rb")
    with pytest.raises(ValueError):
        client.open(p, "rw")


def test_namespace_errnos(client: Client, testdir: str) -> None:
    client.mkdir(f"{testdir}/d")
    client.write_bytes(f"{testdir}/d/f", b"x")
    with pytest.raises(FileExistsError):
        client.mkdir(f"{testdir}/d")
    with pytest.raises(OSError) as exc:
        client.rmdir(f"{testdir}/d")
    assert exc.value.errno == errno.ENOTEMPTY
    with pytest.raises(NotADirectoryError):
        client.listdir(f"{testdir}/d/f")
    with pytest.raises(NotADirectoryError):
        client.open(f"{testdir}/d/f/g", "wb")
    with pytest.raises(IsADirectoryError):
        client.remove(f"{testdir}/d")
    with pytest.raises(OSError) as exc:
        client.mkdir(f"{testdir}/" + "n" * 256)
    assert exc.value.errno == errno.ENAMETOOLONG
    for bad in ("/a\x00b", "/../x"):
        with pytest.raises(OSError) as exc:
            client.stat(bad)
        assert exc.value.errno == errno.EINVAL
    with pytest.raises(OSError) as exc:
        client.rename(f"{testdir}/d", f"{testdir}/d/inside")
    assert exc.value.errno == errno.EINVAL
    assert sorted(client.listdir(testdir)) == ["d"]


def test_links_and_symlinks(client: Client, testdir: str) -> None:
    client.write_bytes(f"{testdir}/a", b"data")
    client.link(f"{testdir}/a", f"{testdir}/b")
    assert client.stat(f"{testdir}/a").nlink == 2
    client.remove(f"{testdir}/a")
    assert client.read_bytes(f"{testdir}/b") == b"data"
    client.symlink("b", f"{testdir}/s")
    assert client.readlink(f"{testdir}/s") == "b"
    assert client.read_bytes(f"{testdir}/s") == b"data"
    assert client.lstat(f"{testdir}/s").is_symlink


def test_special_files_through_the_native_api_and_ls(client: Client, cluster, testdir: str,
                                                     umask: Callable[[int], None]) -> None:
    umask(0)  # the modes below as given (nodes are created under the umask, as os.mknod)
    client.mkfifo(f"{testdir}/fifo", 0o600)
    client.mknod(f"{testdir}/tty", stat.S_IFCHR | 0o620, os.makedev(4, 1))
    assert stat.S_ISFIFO(client.lstat(f"{testdir}/fifo").mode)
    assert client.lstat(f"{testdir}/tty").rdev == os.makedev(4, 1)
    with pytest.raises(OSError) as info:
        client.open(f"{testdir}/fifo", "rb")  # no bytes behind a node on the native route
    assert info.value.errno == errno.EINVAL
    with pytest.raises(FileExistsError):
        client.mkfifo(f"{testdir}/fifo")
    with pytest.raises(OSError) as info:
        client.mknod(f"{testdir}/d", stat.S_IFDIR | 0o755)
    assert info.value.errno == errno.EINVAL
    ls = subprocess.run([sys.executable, "-m", "stripefs", "ls", "-l", testdir, "--cluster", cluster.file],
                        capture_output=True, text=True, timeout=60, check=True).stdout
    assert "prw-------" in ls and "crw--w----" in ls and "4, 1" in ls


def test_xattrs_through_the_native_api(client: Client, testdir: str) -> None:
    p = f"{testdir}/f"
    client.write_bytes(p, b"x")
    client.setxattr(p, "user.checkpoint.step", b"1000")
    client.setxattr(p, b"user.raw", b"\xff")
    assert client.listxattr(p) == ["user.checkpoint.step", "user.raw"]
    assert client.getxattr(p, "user.checkpoint.step") == b"1000"
    with pytest.raises(FileExistsError):
        client.setxattr(p, "user.raw", b"", os.XATTR_CREATE)
    client.removexattr(p, "user.raw")
    with pytest.raises(OSError) as info:
        client.getxattr(p, "user.raw")
    assert info.value.errno == errno.ENODATA
    client.symlink(p, f"{testdir}/l")
    assert client.getxattr(f"{testdir}/l", "user.checkpoint.step") == b"1000"  # follows, as os does
    with pytest.raises(OSError) as info:
        client.getxattr(f"{testdir}/l", "user.checkpoint.step", follow_symlinks=False)
    assert info.value.errno == errno.ENODATA


def test_sparse_and_truncate(client: Client, testdir: str) -> None:
    p = f"{testdir}/sparse"
    with client.open(p, "wb") as f:
        f.seek(3 * TEST_CHUNK + 10)
        f.write(b"end")
    data = client.read_bytes(p)
    assert len(data) == 3 * TEST_CHUNK + 13 and data[:-3] == bytes(len(data) - 3) and data[-3:] == b"end"
    client.write_bytes(p, os.urandom(2 * TEST_CHUNK))
    client.truncate(p, 1000)
    kept = client.read_bytes(p)
    assert len(kept) == 1000
    client.truncate(p, TEST_CHUNK * 2)  # grow again: the cut bytes must not come back
    grown = client.read_bytes(p)
    assert grown[:1000] == kept and grown[1000:] == bytes(TEST_CHUNK * 2 - 1000)
    with client.open(p, "wb") as f:  # O_TRUNC then rewrite
        f.write(b"new")
    assert client.read_bytes(p) == b"new"


def test_rename_is_atomic_for_readers(client: Client, cluster, testdir: str) -> None:
    target = f"{testdir}/current"
    versions = [bytes([i]) * (TEST_CHUNK * 2 + 17) for i in range(1, 9)]
    client.write_bytes(target, versions[0])
    stop = threading.Event()
    seen: list[bytes] = []
    errors: list[BaseException] = []

    def reader() -> None:
        with cluster.client() as c:
            while not stop.is_set():
                try:
                    seen.append(c.read_bytes(target))
                except BaseException as exc:  # noqa: BLE001 - collected and asserted below
                    errors.append(exc)

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i, v in enumerate(versions[1:], 1):
            client.write_bytes(f"{testdir}/tmp{i}", v)
            client.rename(f"{testdir}/tmp{i}", target)
    finally:
        stop.set()
        t.join(30)
    assert not errors
    assert seen and all(s in versions for s in seen)  # never a mix, never partial
    assert client.read_bytes(target) == versions[-1]


def test_concurrent_clients_see_each_other_after_close(cluster, testdir: str) -> None:
    payloads = {i: os.urandom(TEST_CHUNK * 3 + i) for i in range(4)}
    errors: list[BaseException] = []

    def writer(i: int) -> None:
        try:
            with cluster.client() as c:
                with c.open(f"{testdir}/w{i}", "wb") as f:
                    f.write(payloads[i])
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    with cluster.client() as other:
        for i, p in payloads.items():
            assert other.read_bytes(f"{testdir}/w{i}") == p


@pytest.mark.parametrize("defer", [False, True], ids=["made-at-open", "made-at-close"])
def test_close_to_open_length(cluster, testdir: str, defer: bool) -> None:
    with cluster.client() as a, cluster.client() as b:
        f = a.open(f"{testdir}/grow", "wb", defer=defer)
        f.write(b"x" * 1000)
        f.flush()  # bytes are on the servers, length not yet committed
        if defer:  # a new file's name comes with its length (fsclient/core/_pending.py)
            assert not b.exists(f"{testdir}/grow")
        else:
            assert b.stat(f"{testdir}/grow").size == 0
        f.close()
        assert b.read_bytes(f"{testdir}/grow") == b"x" * 1000


def test_fork_safety(client: Client, testdir: str) -> None:
    client.write_bytes(f"{testdir}/parent", b"from parent")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: use the inherited client, write a file
        code = 1
        try:
            data = client.read_bytes(f"{testdir}/parent")
            client.write_bytes(f"{testdir}/child", data + b" via child")
            code = 0
        finally:
            os.write(w, bytes([code]))
            os._exit(code)
    os.close(w)
    assert os.read(r, 1) == b"\x00"
    os.waitpid(pid, 0)
    # the parent's connections still work after the child exited
    assert client.read_bytes(f"{testdir}/child") == b"from parent via child"


def test_layout_per_directory(client: Client, testdir: str) -> None:
    client.mkdir(f"{testdir}/narrow")
    client.set_layout(f"{testdir}/narrow", chunk_size=128 * 1024, stripe=2)
    client.write_bytes(f"{testdir}/narrow/f", os.urandom(1 << 20))
    attr = client.stat(f"{testdir}/narrow/f")
    assert attr.layout.chunk_size == 128 * 1024 and attr.layout.stripe == 2
    assert len({p["server"] for p in client.placement(f"{testdir}/narrow/f")}) == 2
    with pytest.raises(OSError) as exc:
        client.set_layout(f"{testdir}/narrow", chunk_size=1000)
    assert exc.value.errno == errno.EINVAL


def test_unlink_reclaims_chunks(client: Client, cluster, testdir: str) -> None:
    import time

    p = f"{testdir}/gone"
    client.write_bytes(p, os.urandom(TEST_CHUNK * 4))
    ino = client.stat(p).ino
    client.remove(p)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        left = [s for s in cluster.data["servers"] if chunk_files(s["root"], ino)]
        if not left:
            break
        time.sleep(0.1)
    assert not left


def test_front_end_interface_by_inode(client: Client, testdir: str) -> None:
    """The by-inode interface front ends use (docs/architecture.md): typed replies, no core."""
    from stripefs.wire import messages as m

    assert not hasattr(client, "core")  # the core is private: front ends use the interface
    path = f"{testdir}/iface"
    data = os.urandom(TEST_CHUNK * 2 + 777)
    created = client.call(m.Create(parent=client.stat(testdir).ino, name="iface", mode=0o644))
    assert isinstance(created, m.CreateReply) and created.created and created.attr.size == 0
    attr = created.attr
    buf = client.buffers.get(len(data))
    try:
        buf[: len(data)] = data
        client.submit_write(attr.ino, attr.layout, 0, memoryview(buf)[: TEST_CHUNK]).result(60)
        client.write_from(attr.ino, attr.layout, TEST_CHUNK, memoryview(buf)[TEST_CHUNK : len(data)])
    finally:
        client.buffers.put(buf)
    assert client.stat_inode(attr.ino).size == 0  # nothing is visible before the commit
    committed = client.commit_length(attr.ino, len(data))
    assert committed.size == len(data) == client.stat(path).size
    dest = bytearray(len(data) + 10)
    assert client.read_into(attr.ino, attr.layout, committed.size, 0, memoryview(dest)) == len(data)
    assert bytes(dest[: len(data)]) == data
    with client.open_inode(client.stat_inode(attr.ino)) as f:
        assert f.read() == data and f.name == f"<inode {attr.ino}>"
    chain = attr.layout.chain_of(0)
    sid = client.routing(refresh=True).chains[chain][0]
    stat = client.call_storage(sid, m.StatChunk(ino=attr.ino, index=0))
    assert isinstance(stat, m.StatChunkReply) and stat.length == TEST_CHUNK and stat.version >= 1
    reply = client.data_connection(sid).call(m.ReadChunk(ino=attr.ino, index=0, offset=0, length=10, chain=chain))
    assert m.decode_reply(m.ReadChunk, reply.header) == m.ReadChunkReply(
        length=10, chunk_length=TEST_CHUNK, crcs=[crc32c.crc32c(data[:10])])
    assert reply.payload == data[:10]
    assert client.pid == os.getpid()
    listing = client.call(m.Readdir(ino=client.stat(testdir).ino))
    assert [e.name for e in listing.entries] == ["iface"] and listing.more is False
    assert isinstance(client.statfs(), m.StatfsReply) and client.statfs().files >= 1


def test_a_corrupted_read_payload_is_an_error_never_data(client: Client, cluster, testdir: str) -> None:
    # Bytes that change after the server verified them (bit rot under its page cache, a
    # torn payload) go out by sendfile with the block's stored CRC: the client's end-to-end
    # check must refuse them. The file's mtime is put back so the server keeps trusting it.
    path = f"{testdir}/torn"
    data = os.urandom(3 * TEST_CHUNK)
    client.write_bytes(path, data)
    assert client.read_bytes(path) == data  # the servers have verified every block now
    ino = client.stat(path).ino
    chunk = next(p for s in cluster.data["servers"]
                 if os.path.exists(p := chunk_path(s["root"], ino, 1)))
    st = os.stat(chunk)
    with open(chunk, "r+b") as f:
        f.seek(8192 + 7)  # past the 8 KiB header: a data byte of chunk 1
        byte = f.read(1)
        f.seek(8192 + 7)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(chunk, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(OSError) as info:
        client.read_bytes(path)
    assert info.value.errno == errno.EIO



def test_a_removed_file_reads_stale_never_zeros(client: Client, testdir: str) -> None:
    # Open handles outlive an unlink for the GC grace period; after it, the bytes are gone
    # and a read must say so (ESTALE), not return zeros, and a write must not recreate
    # chunks that nothing would ever collect.
    path = f"{testdir}/gone"
    data = os.urandom(2 * TEST_CHUNK)
    client.write_bytes(path, data)
    reader = client.open(path, "rb")
    writer = client.open(path, "r+b")
    client.remove(path)
    deadline = time.monotonic() + 30
    for i in itertools.count(1):  # never offset 0: a read there would start a readahead window
        off = (i * 4099) % (len(data) - 100)  # a new small range each time: no client cache
        try:
            got = reader.pread(100, off)
        except OSError as exc:
            assert exc.errno == errno.ESTALE, exc
            break
        assert got == data[off : off + 100], "a removed file read as something else"
        assert time.monotonic() < deadline, "chunks of a removed file were never collected"
        time.sleep(0.3)
    writer.pwrite(b"late", 0)
    with pytest.raises(OSError) as info:
        writer.flush()
    assert info.value.errno == errno.ESTALE
    reader.close()


def test_creation_modes_apply_the_process_umask(client: Client, testdir: str, umask: Callable[[int], None]) -> None:
    umask(0o027)
    # As os.open/os.mkdir/os.mknod do: the requested mode minus the umask bits.
    with client.open(f"{testdir}/f", "wb") as f:
        f.write(b"x")
    client.write_bytes(f"{testdir}/x", b"x", exclusive=True)
    with client.open(f"{testdir}/t", "w") as t:
        t.write("text")
    client.mkdir(f"{testdir}/d")
    client.mkdir(f"{testdir}/d700", 0o700)
    client.makedirs(f"{testdir}/a/b/c")
    client.mkfifo(f"{testdir}/fifo")
    client.mknod(f"{testdir}/node", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    client.mknod(f"{testdir}/empty")
    perms = {name: stat.S_IMODE(client.lstat(f"{testdir}/{name}").mode)
             for name in ("f", "x", "t", "d", "d700", "a", "a/b", "a/b/c", "fifo", "node", "empty")}
    assert perms == {"f": 0o640, "x": 0o640, "t": 0o640, "d": 0o750, "d700": 0o700, "a": 0o750, "a/b": 0o750,
                     "a/b/c": 0o750, "fifo": 0o640, "node": 0o640, "empty": 0o640}
    # An existing file keeps its mode when opened for writing again; chmod is not masked.
    client.chmod(f"{testdir}/f", 0o666)
    with client.open(f"{testdir}/f", "wb") as f:
        f.write(b"y")
    assert stat.S_IMODE(client.stat(f"{testdir}/f").mode) == 0o666
    client.symlink("f", f"{testdir}/s")  # links are always 0777
    assert stat.S_IMODE(client.lstat(f"{testdir}/s").mode) == 0o777


def test_statfs_reports_usable_space_not_raw_capacity(client: Client, cluster, make_cluster) -> None:
    # Every byte is stored once per replica: usable capacity, usage and free space are the raw
    # figures over R; the servers of a test cluster share one disk, which counts once.
    r2 = make_cluster(servers=3, replicas=2)
    for c, r, root in ((client, 1, cluster.root), (r2.client(), 2, r2.root)):
        disk = os.statvfs(root)
        size, free = disk.f_blocks * disk.f_frsize, disk.f_bavail * disk.f_frsize
        deadline = time.monotonic() + 10  # the servers report their disk with their heartbeats
        while (st := c.statfs()).capacity != size // r and time.monotonic() < deadline:
            time.sleep(0.2)
        servers = [s for s in c.status().servers if s.state == "serving"]
        raw_used = sum(s.used for s in servers)
        assert st.capacity == size // r
        assert abs(st.used - raw_used // r) <= 256 << 20  # usage moves with heartbeats (shared disk)
        assert 0 < st.free <= min(free // r + (256 << 20), st.capacity - st.used)
        if r > 1:
            c.close()


def test_the_umask_is_read_afresh_and_per_process(umask: Callable[[int], None]) -> None:
    """The client reads the umask through a descriptor it keeps: every change shows, and a
    forked child reads its own, not its parent's."""
    from stripefs.fsclient.core._client import _umask

    for mask in (0o027, 0o002, 0o077):
        umask(mask)
        assert _umask() == mask
    umask(0o022)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: another mask than its parent's
        os.umask(0o037)
        os.write(w, b"%o" % _umask())
        os._exit(0)
    os.close(w)
    try:
        assert os.read(r, 16) == b"37"
        assert _umask() == 0o022  # the parent's own, unchanged
    finally:
        os.close(r)
        os.waitpid(pid, 0)
