"""A POSIX conformance suite in the style of pjdfstest, on a real mount: one class per syscall."""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import struct
import time

import pytest

pytestmark = pytest.mark.fuse

from .fuse_helpers import as_user

AT_FDCWD = -100
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2
_libc = ctypes.CDLL(None, use_errno=True)


def renameat2(old: str, new: str, flags: int) -> None:
    if _libc.renameat2(AT_FDCWD, old.encode(), AT_FDCWD, new.encode(), flags) != 0:
        no = ctypes.get_errno()
        raise OSError(no, os.strerror(no), old)


def errno_of(fn, *args) -> int:
    with pytest.raises(OSError) as info:
        fn(*args)
    return info.value.errno


def write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


class TestOpen:
    def test_create_excl_and_errnos(self, mdir: str) -> None:
        p = f"{mdir}/f"
        os.close(os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o640))
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o640 & ~_umask()
        assert errno_of(os.open, p, os.O_CREAT | os.O_EXCL | os.O_WRONLY) == errno.EEXIST
        assert errno_of(os.open, f"{mdir}/missing", os.O_RDONLY) == errno.ENOENT
        assert errno_of(os.open, f"{p}/x", os.O_RDONLY) == errno.ENOTDIR
        assert errno_of(os.open, mdir, os.O_WRONLY) == errno.EISDIR
        assert errno_of(os.open, f"{mdir}/" + "n" * 256, os.O_CREAT | os.O_WRONLY) == errno.ENAMETOOLONG
        os.close(os.open(f"{mdir}/" + "n" * 255, os.O_CREAT | os.O_WRONLY))

    def test_trunc_and_append(self, mdir: str) -> None:
        p = f"{mdir}/f"
        write(p, b"0123456789")
        fd = os.open(p, os.O_WRONLY | os.O_TRUNC)
        os.close(fd)
        assert os.stat(p).st_size == 0
        write(p, b"abc")
        fd = os.open(p, os.O_WRONLY | os.O_APPEND)
        os.write(fd, b"def")
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, b"ghi")  # O_APPEND writes at the end wherever the offset is
        os.close(fd)
        assert read(p) == b"abcdefghi"

    def test_read_write_offsets_and_holes(self, mdir: str) -> None:
        p = f"{mdir}/f"
        fd = os.open(p, os.O_CREAT | os.O_RDWR)
        os.pwrite(fd, b"tail", 1_000_000)
        os.pwrite(fd, b"head", 0)
        assert os.pread(fd, 4, 1_000_000) == b"tail"
        assert os.pread(fd, 8, 4) == bytes(8)
        assert os.fstat(fd).st_size == 1_000_004
        os.close(fd)
        data = read(p)
        assert len(data) == 1_000_004 and data[:4] == b"head" and data[-4:] == b"tail" and not any(data[4:-4])


class TestChmodChown:
    def test_chmod(self, mdir: str) -> None:
        p = f"{mdir}/f"
        write(p, b"x")
        before = os.stat(p).st_ctime_ns
        time.sleep(0.01)
        os.chmod(p, 0o4751)
        st = os.stat(p)
        assert stat.S_IMODE(st.st_mode) == 0o4751 and stat.S_ISREG(st.st_mode)
        assert st.st_ctime_ns > before
        fd = os.open(p, os.O_RDONLY)
        os.fchmod(fd, 0o600)
        os.close(fd)
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
        assert errno_of(os.chmod, f"{mdir}/missing", 0o600) == errno.ENOENT

    def test_chown(self, mdir: str) -> None:
        p = f"{mdir}/f"
        write(p, b"x")
        os.chown(p, 1234, 5678)
        st = os.stat(p)
        assert (st.st_uid, st.st_gid) == (1234, 5678)
        os.chown(p, -1, 42)
        assert (os.stat(p).st_uid, os.stat(p).st_gid) == (1234, 42)

    def test_permissions_enforced_for_other_users(self, mdir: str) -> None:
        os.chmod(mdir, 0o755)
        p = f"{mdir}/private"
        write(p, b"secret")
        os.chmod(p, 0o600)

        def read_it(d: int) -> None:
            os.close(os.open("private", os.O_RDONLY, dir_fd=d))

        def create_it(d: int) -> None:
            os.close(os.open("new", os.O_CREAT | os.O_WRONLY, dir_fd=d))

        assert as_user(65534, mdir, read_it) == errno.EACCES
        assert as_user(65534, mdir, create_it) == errno.EACCES
        assert as_user(65534, mdir, lambda d: os.chmod("private", 0o777, dir_fd=d)) == errno.EPERM
        os.chmod(p, 0o644)
        assert as_user(65534, mdir, read_it) == 0
        os.chmod(mdir, 0o777)
        assert as_user(65534, mdir, create_it) == 0
        assert os.stat(f"{mdir}/new").st_uid == 65534


class TestLinkUnlink:
    def test_link(self, mdir: str) -> None:
        a, b = f"{mdir}/a", f"{mdir}/b"
        write(a, b"data")
        os.link(a, b)
        assert os.stat(a).st_nlink == 2 and os.stat(a).st_ino == os.stat(b).st_ino
        assert read(b) == b"data"
        assert errno_of(os.link, a, b) == errno.EEXIST
        assert errno_of(os.link, mdir, f"{mdir}/d") == errno.EPERM
        os.unlink(a)
        assert os.stat(b).st_nlink == 1 and read(b) == b"data"

    def test_unlink_errnos(self, mdir: str) -> None:
        os.mkdir(f"{mdir}/d")
        assert errno_of(os.unlink, f"{mdir}/missing") == errno.ENOENT
        assert errno_of(os.unlink, f"{mdir}/d") == errno.EISDIR

    def test_open_unlinked_file_lives_until_last_close(self, mdir: str, mnt: str) -> None:
        p = f"{mdir}/f"
        write(p, b"A" * 300_000)
        fd = os.open(p, os.O_RDWR)
        os.unlink(p)
        assert not os.path.exists(p)
        assert os.fstat(fd).st_nlink == 0
        os.pwrite(fd, b"B" * 1000, 299_000)
        assert os.pread(fd, 300_000, 0) == b"A" * 299_000 + b"B" * 1000
        assert ".stripefs-orphans" not in os.listdir(mnt)
        os.close(fd)
        deadline = time.monotonic() + 5  # release is asynchronous to close()
        while os.listdir(f"{mnt}/.stripefs-orphans") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.listdir(f"{mnt}/.stripefs-orphans") == []


class TestMkdirRmdir:
    def test_mkdir(self, mdir: str) -> None:
        d = f"{mdir}/d"
        os.mkdir(d, 0o750)
        st = os.stat(d)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o750 & ~_umask()
        assert st.st_nlink == 2
        n = os.stat(mdir).st_nlink
        os.mkdir(f"{d}/sub")
        assert os.stat(d).st_nlink == 3 and os.stat(mdir).st_nlink == n
        assert errno_of(os.mkdir, d) == errno.EEXIST
        assert errno_of(os.mkdir, f"{mdir}/missing/x") == errno.ENOENT

    def test_rmdir(self, mdir: str) -> None:
        d = f"{mdir}/d"
        os.makedirs(f"{d}/sub")
        write(f"{mdir}/f", b"")
        assert errno_of(os.rmdir, d) == errno.ENOTEMPTY
        assert errno_of(os.rmdir, f"{mdir}/f") == errno.ENOTDIR
        assert errno_of(os.rmdir, f"{mdir}/missing") == errno.ENOENT
        os.rmdir(f"{d}/sub")
        os.rmdir(d)
        assert not os.path.exists(d)

    def test_readdir_many_entries(self, mdir: str, client, testdir: str) -> None:
        names = {f"e{i:05d}" for i in range(1100)}  # more than one server page of 1000
        for n in names:  # made by the native client: one round trip each, not five
            client.open(f"{testdir}/{n}", "wb").close()
        assert sorted(os.listdir(mdir)) == sorted(names)
        with os.scandir(mdir) as it:
            assert all(e.is_file() and e.stat().st_size == 0 for e in it)


class TestRename:
    def test_rename_file_replaces(self, mdir: str) -> None:
        a, b = f"{mdir}/a", f"{mdir}/b"
        write(a, b"new")
        write(b, b"old")
        ino = os.stat(a).st_ino
        os.rename(a, b)
        assert not os.path.exists(a) and read(b) == b"new" and os.stat(b).st_ino == ino

    def test_rename_errnos(self, mdir: str) -> None:
        os.makedirs(f"{mdir}/d1/sub")
        os.mkdir(f"{mdir}/d2")
        os.mkdir(f"{mdir}/full")
        write(f"{mdir}/full/x", b"")
        write(f"{mdir}/f", b"")
        assert errno_of(os.rename, f"{mdir}/d1", f"{mdir}/full") == errno.ENOTEMPTY
        assert errno_of(os.rename, f"{mdir}/d1", f"{mdir}/f") == errno.ENOTDIR
        assert errno_of(os.rename, f"{mdir}/f", f"{mdir}/d2") == errno.EISDIR
        assert errno_of(os.rename, f"{mdir}/d1", f"{mdir}/d1/sub/in") == errno.EINVAL
        assert errno_of(os.rename, f"{mdir}/missing", f"{mdir}/z") == errno.ENOENT
        os.rename(f"{mdir}/d1", f"{mdir}/d2")  # over an empty directory
        assert os.path.isdir(f"{mdir}/d2/sub")

    def test_rename_across_directories_never_exdev(self, mdir: str, mnt: str) -> None:
        os.makedirs(f"{mdir}/a/b")
        write(f"{mdir}/a/b/f", b"payload")
        os.rename(f"{mdir}/a/b/f", f"{mdir}/f")
        os.rename(f"{mdir}/a/b", f"{mdir}/b")
        assert read(f"{mdir}/f") == b"payload" and os.path.isdir(f"{mdir}/b")
        assert os.stat(f"{mdir}/a").st_nlink == 2

    def test_renameat2_flags(self, mdir: str) -> None:
        a, b = f"{mdir}/a", f"{mdir}/b"
        write(a, b"A")
        write(b, b"B")
        with pytest.raises(OSError) as info:
            renameat2(a, b, RENAME_NOREPLACE)
        assert info.value.errno == errno.EEXIST
        renameat2(a, b, RENAME_EXCHANGE)
        assert read(a) == b"B" and read(b) == b"A"
        renameat2(a, f"{mdir}/c", RENAME_NOREPLACE)
        assert read(f"{mdir}/c") == b"B" and not os.path.exists(a)

    def test_rename_over_open_file_keeps_its_data(self, mdir: str) -> None:
        a, b = f"{mdir}/a", f"{mdir}/b"
        write(a, b"new")
        write(b, b"old contents")
        with open(b, "rb") as f:
            os.rename(a, b)
            assert f.read() == b"old contents"
        assert read(b) == b"new"


class TestSymlink:
    def test_symlink_readlink(self, mdir: str) -> None:
        write(f"{mdir}/target", b"t")
        os.symlink("target", f"{mdir}/l")
        assert os.readlink(f"{mdir}/l") == "target"
        assert read(f"{mdir}/l") == b"t"
        assert stat.S_ISLNK(os.lstat(f"{mdir}/l").st_mode) and stat.S_ISREG(os.stat(f"{mdir}/l").st_mode)
        os.symlink("nowhere", f"{mdir}/dangling")
        assert errno_of(os.stat, f"{mdir}/dangling") == errno.ENOENT
        assert errno_of(os.symlink, "x", f"{mdir}/l") == errno.EEXIST
        os.symlink("loop2", f"{mdir}/loop1")
        os.symlink("loop1", f"{mdir}/loop2")
        assert errno_of(os.stat, f"{mdir}/loop1") == errno.ELOOP
        assert errno_of(os.readlink, f"{mdir}/target") == errno.EINVAL


class TestTruncate:
    def test_truncate(self, mdir: str) -> None:
        p = f"{mdir}/f"
        write(p, b"x" * 1000)
        os.truncate(p, 10)
        assert read(p) == b"x" * 10
        os.truncate(p, 600_000)
        data = read(p)
        assert len(data) == 600_000 and data[:10] == b"x" * 10 and not any(data[10:])
        assert errno_of(os.truncate, mdir, 0) == errno.EISDIR

    def test_ftruncate_with_buffered_writes(self, mdir: str) -> None:
        p = f"{mdir}/f"
        with open(p, "wb", buffering=0) as f:
            f.write(b"y" * 500_000)
            os.ftruncate(f.fileno(), 100)
            f.seek(0, os.SEEK_END)
            f.write(b"z")
        assert read(p) == b"y" * 100 + b"z"


class TestUtimens:
    def test_utimens(self, mdir: str) -> None:
        p = f"{mdir}/f"
        write(p, b"x")
        os.utime(p, ns=(1_000_000_123, 2_000_000_456))
        st = os.stat(p)
        assert (st.st_atime_ns, st.st_mtime_ns) == (1_000_000_123, 2_000_000_456)
        os.utime(p)
        assert abs(os.stat(p).st_mtime - time.time()) < 5

    def test_mtime_after_write_then_utime(self, mdir: str) -> None:
        p = f"{mdir}/f"
        with open(p, "wb") as f:
            f.write(b"data")
            f.flush()
            os.utime(p, ns=(5_000_000_000, 5_000_000_000))
        assert os.stat(p).st_mtime_ns == 5_000_000_000


class TestFileSystem:
    def test_statfs(self, mnt: str) -> None:
        st = os.statvfs(mnt)
        assert st.f_blocks > 0 and st.f_bavail <= st.f_blocks and st.f_namemax == 255

    def test_xattrs(self, mdir: str, client, testdir: str) -> None:
        p = f"{mdir}/f"
        write(p, b"")
        os.setxattr(p, "user.k", b"v")
        assert os.getxattr(p, "user.k") == b"v" and os.listxattr(p) == ["user.k"]
        assert client.getxattr(f"{testdir}/f", "user.k") == b"v"  # stored in the cluster
        assert errno_of(os.setxattr, p, "user.k", b"w", os.XATTR_CREATE) == errno.EEXIST
        assert errno_of(os.setxattr, p, "user.new", b"w", os.XATTR_REPLACE) == errno.ENODATA
        os.setxattr(p, "user.new", b"now")  # a remembered "absent" must not outlive a set
        assert os.getxattr(p, "user.new") == b"now"
        os.removexattr(p, "user.new")
        os.setxattr(p, "user.k", b"w" * 65536, os.XATTR_REPLACE)
        assert os.getxattr(p, "user.k") == b"w" * 65536
        os.removexattr(p, "user.k")
        assert errno_of(os.getxattr, p, "user.k") == errno.ENODATA and os.listxattr(p) == []
        os.setxattr(p, "trusted.t", b"root may")  # the tests run as root
        acl = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", tag, perm, 0xFFFFFFFF)
                                              for tag, perm in ((0x01, 6), (0x04, 4), (0x20, 4)))
        assert errno_of(os.setxattr, p, "system.posix_acl_access", acl) == errno.EOPNOTSUPP  # ACLs: not enforced, refused
        os.symlink("f", f"{mdir}/l")
        with pytest.raises(OSError) as info:
            os.setxattr(f"{mdir}/l", "user.k", b"v", follow_symlinks=False)
        assert info.value.errno == errno.EPERM


class TestSpecialFiles:
    def test_fifo_is_stored_and_works_as_a_pipe(self, mdir: str, client, testdir: str) -> None:
        p = f"{mdir}/fifo"
        os.mkfifo(p, 0o640)
        st = os.lstat(p)
        assert stat.S_ISFIFO(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o640 & ~_umask()
        assert stat.S_ISFIFO(client.lstat(f"{testdir}/fifo").mode)  # stored in the namespace
        # The kernel gives the node its behaviour: bytes pass through, nothing is stored.
        fd_r = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
        fd_w = os.open(p, os.O_WRONLY)
        os.write(fd_w, b"through the pipe")
        assert os.read(fd_r, 100) == b"through the pipe"
        os.close(fd_w)
        os.close(fd_r)
        assert os.lstat(p).st_size == 0
        assert errno_of(os.mkfifo, p) == errno.EEXIST
        assert errno_of(os.mkdir, p) == errno.EEXIST
        assert errno_of(os.symlink, "x", p) == errno.EEXIST

    @pytest.mark.parametrize("kind", [stat.S_IFCHR, stat.S_IFBLK])
    def test_device_nodes_keep_rdev(self, mdir: str, kind: int) -> None:
        p = f"{mdir}/dev"
        os.mknod(p, kind | 0o600, os.makedev(7, 42))
        st = os.lstat(p)
        assert stat.S_IFMT(st.st_mode) == kind and (os.major(st.st_rdev), os.minor(st.st_rdev)) == (7, 42)
        os.chmod(p, 0o644)
        os.chown(p, 1234, 5678)
        os.rename(p, f"{mdir}/dev2")
        os.link(f"{mdir}/dev2", f"{mdir}/dev3")
        st = os.lstat(f"{mdir}/dev3")
        assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_nlink, st.st_rdev) == (
            0o644, 1234, 5678, 2, os.makedev(7, 42))
        os.unlink(f"{mdir}/dev2")
        os.unlink(f"{mdir}/dev3")
        assert os.listdir(mdir) == []

    def test_socket_node_and_regular_mknod(self, mdir: str) -> None:
        os.mknod(f"{mdir}/sock", stat.S_IFSOCK | 0o600)
        assert stat.S_ISSOCK(os.lstat(f"{mdir}/sock").st_mode)
        os.mknod(f"{mdir}/plain", stat.S_IFREG | 0o600)
        write(f"{mdir}/plain", b"data")
        assert read(f"{mdir}/plain") == b"data"


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


UTIME_NOW, UTIME_OMIT = (1 << 30) - 1, (1 << 30) - 2


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def utimensat(path: str, atime: tuple[int, int], mtime: tuple[int, int]) -> None:
    times = (_Timespec * 2)(_Timespec(*atime), _Timespec(*mtime))
    if _libc.utimensat(AT_FDCWD, path.encode(), times, 0) != 0:
        no = ctypes.get_errno()
        raise OSError(no, os.strerror(no), path)


class TestPjdfstestCategories:
    """What pjdfstest checks, category by category, in our own words (it passes in full
    by hand; these keep the behaviours in `make test`)."""

    def test_sticky_directory_protects_other_users_files(self, mdir: str) -> None:
        os.chmod(mdir, 0o1777)
        assert as_user(1001, mdir, lambda d: os.close(os.open("mine", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=d))) == 0
        assert as_user(1002, mdir, lambda d: os.unlink("mine", dir_fd=d)) == errno.EPERM
        assert as_user(1002, mdir, lambda d: os.rename("mine", "taken", src_dir_fd=d, dst_dir_fd=d)) == errno.EPERM
        assert as_user(1001, mdir, lambda d: os.rename("mine", "moved", src_dir_fd=d, dst_dir_fd=d)) == 0
        assert as_user(1001, mdir, lambda d: os.unlink("moved", dir_fd=d)) == 0

    def test_name_too_long_and_symlink_loops(self, mdir: str) -> None:
        long = "n" * 256
        write(f"{mdir}/ok", b"")
        for fn, args in ((os.mkdir, (f"{mdir}/{long}",)), (os.symlink, ("ok", f"{mdir}/{long}")),
                         (os.rename, (f"{mdir}/ok", f"{mdir}/{long}")), (os.link, (f"{mdir}/ok", f"{mdir}/{long}")),
                         (os.mkfifo, (f"{mdir}/{long}",))):
            assert errno_of(fn, *args) == errno.ENAMETOOLONG, fn
        os.mkdir(f"{mdir}/" + "m" * 255)  # 255 bytes is the limit, not past it
        os.symlink("b", f"{mdir}/a")
        os.symlink("a", f"{mdir}/b")
        assert errno_of(os.open, f"{mdir}/a", os.O_RDONLY) == errno.ELOOP
        assert errno_of(os.stat, f"{mdir}/a/x") == errno.ELOOP

    def test_ctime_and_mtime_updates(self, mdir: str) -> None:
        p = f"{mdir}/f"
        write(p, b"x")

        def changed(fn, path: str, field: str) -> bool:
            before = getattr(os.lstat(path), field)
            time.sleep(0.01)
            fn()
            return getattr(os.lstat(path), field) > before

        assert changed(lambda: os.chmod(p, 0o600), p, "st_ctime_ns")
        assert changed(lambda: os.chown(p, 7, 7), p, "st_ctime_ns")
        assert changed(lambda: os.link(p, f"{mdir}/g"), p, "st_ctime_ns")
        assert changed(lambda: os.link(p, f"{mdir}/h"), mdir, "st_mtime_ns")
        assert changed(lambda: os.truncate(p, 100), p, "st_mtime_ns")
        assert changed(lambda: os.unlink(f"{mdir}/h"), mdir, "st_ctime_ns")
        assert changed(lambda: os.setxattr(p, "user.a", b"1"), p, "st_ctime_ns")

    def test_utimensat_now_omit_and_nanoseconds(self, mdir: str) -> None:
        p = f"{mdir}/f"
        write(p, b"x")
        utimensat(p, (1_000, 123_456_789), (2_000, 987_654_321))
        st = os.stat(p)
        assert (st.st_atime_ns, st.st_mtime_ns) == (1_000_123_456_789, 2_000_987_654_321)
        utimensat(p, (0, UTIME_OMIT), (3_000, 5))
        st = os.stat(p)
        assert (st.st_atime_ns, st.st_mtime_ns) == (1_000_123_456_789, 3_000_000_000_005)
        before = time.time_ns()
        utimensat(p, (0, UTIME_NOW), (0, UTIME_OMIT))
        st = os.stat(p)
        assert st.st_atime_ns >= before - 1_000_000_000 and st.st_mtime_ns == 3_000_000_000_005

    def test_chown_clears_setuid_and_setgid(self, mdir: str) -> None:
        p = f"{mdir}/f"
        write(p, b"x")
        os.chmod(p, 0o6755)
        os.chown(p, 1234, 1234)
        assert stat.S_IMODE(os.stat(p).st_mode) & 0o6000 == 0
        os.mkdir(f"{mdir}/d")
        os.chmod(f"{mdir}/d", 0o2755)
        os.chown(f"{mdir}/d", 1234, 1234)
        assert os.stat(f"{mdir}/d").st_mode & stat.S_ISGID  # directories keep setgid

    def test_posix_fallocate_extends_with_zeros(self, mdir: str) -> None:
        p = f"{mdir}/f"
        write(p, b"head")
        fd = os.open(p, os.O_RDWR)
        try:
            os.posix_fallocate(fd, 0, 1 << 20)
        finally:
            os.close(fd)
        assert read(p) == b"head" + b"\0" * ((1 << 20) - 4)
