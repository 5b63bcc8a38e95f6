"""Through the mount, with another client changing the same files: close-to-open with handles
already open in this mount, O_APPEND at the committed length, readdir cursors that survive
changes, setuid/setgid clearing by writers, and statfs in usable (not raw) bytes."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import time
import stat
from concurrent.futures import ThreadPoolExecutor

import pytest

from stripefs.fsclient import Client

from .conftest import do_mount, do_umount
from .fuse_helpers import as_user

pytestmark = pytest.mark.fuse


# -- close-to-open with a handle already open in this mount -----------------------------------
def test_new_open_sees_another_clients_rewrite_while_open_here(mdir: str, client: Client, testdir: str) -> None:
    """``less f`` keeps f open in mount A; B rewrites f; ``cat f`` on A shows B's bytes."""
    path = f"{testdir}/f"
    client.write_bytes(path, b"old." * 100_000)
    with open(f"{mdir}/f", "rb") as held:  # `less f`: open, read, keep open
        assert held.read() == b"old." * 100_000
        client.write_bytes(path, b"NEW!" * 100_000)  # same size, new bytes and mtime
        with open(f"{mdir}/f", "rb") as f:  # `cat f`
            assert f.read() == b"NEW!" * 100_000
        with client.open(path, "ab") as f:  # B appends
            f.write(b"tail")
        with open(f"{mdir}/f", "rb") as f:
            assert f.read() == b"NEW!" * 100_000 + b"tail"


@pytest.mark.parametrize("held", [True, False], ids=["another-handle-open", "listed-by-ls-l"])
@pytest.mark.parametrize("how", ["wb", "in-place"])
def test_a_rewrite_at_the_same_size_with_the_mtime_set_back_is_seen(mdir: str, client: Client, testdir: str,
                                                                     held: bool, how: str) -> None:
    """``cp -p``, ``rsync -a`` and ``tar`` rewrite a file at the same size and set its mtime back:
    the mount must not keep its pages of the old bytes (the version it checks includes the
    ctime and the truncation count, which no client can set back)."""
    path = f"{testdir}/f"
    client.write_bytes(path, b"old." * 262_144)  # 1 MiB
    before = client.stat(path)
    keep = open(f"{mdir}/f", "rb") if held else None
    try:
        if not held:
            os.listdir(mdir)  # the mount learns the entry from a listing (readdirplus)
            os.stat(f"{mdir}/f")
        with open(f"{mdir}/f", "rb") as f:  # the kernel's page cache now holds the old bytes
            assert f.read() == b"old." * 262_144
        if how == "wb":
            client.write_bytes(path, b"NEW!" * 262_144)
        else:
            with client.open(path, "r+b") as f:
                f.write(b"NEW!" * 262_144)
        client.utime(path, (before.atime_ns, before.mtime_ns))  # the mtime set back, as `cp -p` does
        assert (client.stat(path).size, client.stat(path).mtime_ns) == (before.size, before.mtime_ns)
        with open(f"{mdir}/f", "rb") as f:
            assert f.read() == b"NEW!" * 262_144
    finally:
        if keep is not None:
            keep.close()


@pytest.mark.parametrize("size", [4096, 300_000, 3 << 20], ids=["page", "small", "large"])
def test_an_open_right_after_a_lookup_sees_a_rewrite_made_between(mdir: str, client: Client, testdir: str,
                                                                    size: int) -> None:
    """A read-only open takes its attributes from the leased lookup before it; another
    client's rewrite between the two must not be read past (its lease is invalidated first),
    nor must a small file's whole-file read serve the old bytes."""
    path = f"{testdir}/g"
    client.write_bytes(path, b"a" * size)
    with open(f"{mdir}/g", "rb") as f:
        assert f.read() == b"a" * size
    for round_ in range(3):
        os.stat(f"{mdir}/g")  # a lookup (leased): the open below may take its attributes
        new = bytes([ord("b") + round_]) * (size + 10 * round_)
        client.write_bytes(path, new)  # another client's rewrite, in between
        with open(f"{mdir}/g", "rb") as f:
            assert f.read() == new, round_


# -- O_APPEND across clients ------------------------------------------------------------------
def test_o_append_lands_at_the_committed_length(mdir: str, client: Client, testdir: str) -> None:
    """Within the attribute timeout, appends through the mount never overwrite another
    client's committed appends (the kernel's cached size is stale)."""
    path = f"{testdir}/log"
    fd = os.open(f"{mdir}/log", os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o644)
    os.write(fd, b"a1")
    os.close(fd)
    with client.open(path, "ab") as f:
        f.write(b"b1")
    fd = os.open(f"{mdir}/log", os.O_WRONLY | os.O_APPEND)  # no lseek: the kernel alone picks the offset
    try:
        os.write(fd, b"a2")
        os.fsync(fd)
        with client.open(path, "ab") as f:  # another node appends while the log is held open here
            f.write(b"b2")
        os.write(fd, b"a3")
        assert os.fstat(fd).st_size == 10  # the kernel's size follows the appends' real offsets
    finally:
        os.close(fd)
    assert client.read_bytes(path) == b"a1b1a2b2a3"


# -- readdir ------------------------------------------------------------------------------------
class _Dirent(ctypes.Structure):
    _fields_ = [("d_ino", ctypes.c_uint64), ("d_off", ctypes.c_int64), ("d_reclen", ctypes.c_ushort),
                ("d_type", ctypes.c_ubyte), ("d_name", ctypes.c_char * 256)]


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.opendir.restype = ctypes.c_void_p
    libc.opendir.argtypes = [ctypes.c_char_p]
    libc.readdir.restype = ctypes.POINTER(_Dirent)
    libc.readdir.argtypes = [ctypes.c_void_p]
    libc.telldir.restype = ctypes.c_long
    libc.telldir.argtypes = [ctypes.c_void_p]
    libc.seekdir.restype = None
    libc.seekdir.argtypes = [ctypes.c_void_p, ctypes.c_long]
    libc.closedir.argtypes = [ctypes.c_void_p]
    return libc


def test_seekdir_back_across_a_page_while_the_directory_changes(mdir: str, client: Client, testdir: str) -> None:
    """telldir/seekdir back over more than one daemon page, after a name was added in front:
    the listing resumes right after the remembered entry (no duplicate, nothing skipped)."""
    names = [f"f{i:05d}" for i in range(1100)]  # more than one metadata Readdir page (1000)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda n: client.mknod(f"{testdir}/{n}"), names))
    libc = _libc()
    dirp = libc.opendir(os.fsencode(f"{mdir}"))
    assert dirp
    try:
        seen: list[str] = []
        marks: list[int] = []
        while len(seen) < 1050:
            ent = libc.readdir(dirp)
            assert ent, "listing ended early"
            name = ent.contents.d_name.decode()
            if name in (".", ".."):
                continue
            seen.append(name)
            marks.append(libc.telldir(dirp))
        client.mknod(f"{testdir}/a-early")  # sorts before every other name
        libc.seekdir(dirp, marks[499])  # back to just after the 500th entry
        rest = []
        while True:
            ent = libc.readdir(dirp)
            if not ent:
                break
            rest.append(ent.contents.d_name.decode())
    finally:
        libc.closedir(dirp)
    assert seen == names[:1050]
    assert rest == names[500:]


# -- setuid/setgid --------------------------------------------------------------------------
@pytest.mark.parametrize("opts", ["", "direct_io"])
def test_write_and_truncate_by_another_user_clear_setuid_setgid(opts: str, cluster, client: Client, testdir: str,
                                                                tmp_path) -> None:
    """A non-root writer clears setuid/setgid on write(2) and ftruncate(2), also when the bits were
    set by another client (the kernel's cached mode does not show them) and with direct_io."""
    mp = str(tmp_path / "m")
    do_mount(mp, cluster.file, *([opts] if opts else []))
    try:
        mdir, path = mp + testdir, f"{testdir}/suid"
        os.chmod(mdir, 0o777)
        with open(f"{mdir}/suid", "wb") as f:
            f.write(b"program")
        for action in ("write", "truncate", "append"):
            client.chmod(path, 0o6777)  # owned by root, writable by all, setuid + setgid (group exec)

            def act(d: int, action: str = action) -> None:
                fd = os.open("suid", os.O_WRONLY | (os.O_APPEND if action == "append" else 0), dir_fd=d)
                try:
                    if action == "truncate":
                        os.ftruncate(fd, 3)
                    else:
                        os.write(fd, b"P")
                finally:
                    os.close(fd)

            assert as_user(1001, mdir, act) == 0
            assert stat.S_IMODE(client.stat(path).mode) == 0o777, f"{action} kept setuid/setgid"
    finally:
        do_umount(mp)


# -- statfs ------------------------------------------------------------------------------------
def test_statfs_reports_usable_space_after_replication(make_cluster, tmp_path) -> None:
    c = make_cluster(servers=2, replicas=2)
    mp = str(tmp_path / "m")
    do_mount(mp, c.file)
    try:
        disk = os.statvfs(c.root)  # both servers' targets are on it: it counts once
        with c.client() as cl:
            deadline = time.monotonic() + 10  # the servers report their disk with their heartbeats
            while (usable := cl.statfs()).capacity != disk.f_blocks * disk.f_frsize // 2 and time.monotonic() < deadline:
                time.sleep(0.2)  # the metadata service answers in usable bytes
        assert usable.capacity == disk.f_blocks * disk.f_frsize // 2
        st = os.statvfs(mp)
        assert abs(st.f_blocks * st.f_frsize - usable.capacity) <= st.f_frsize  # not divided twice
        assert abs(st.f_bavail * st.f_frsize - usable.free) <= 64 << 20  # free space moves a little
    finally:
        do_umount(mp)
