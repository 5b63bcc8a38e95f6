"""Small operations through the mount (create, stat, unlink, close): what the daemon answers
from what it already knows must be what the metadata service would have answered, and no
staler than the attribute timeout allows (docs/fuse.md, "Small operations")."""

from __future__ import annotations

import os
import stat
import time

import pytest

from stripefs.fsclient import Client

pytestmark = pytest.mark.fuse

ATTR_TIMEOUT = 1.0  # the shared mount's (the default)


def _touch(path: str) -> None:
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))


def test_directory_times_after_own_create_and_unlink_are_the_services(mdir: str, client: Client, testdir: str) -> None:
    """The kernel asks for the directory's attributes again after each create and unlink
    (its permission check); the answer shows this mount's change, exactly as stored."""
    before = os.stat(mdir)
    for step in range(3):
        time.sleep(0.002)
        _touch(f"{mdir}/f{step}")
        st, want = os.stat(mdir), client.stat(testdir)
        assert (st.st_mtime_ns, st.st_ctime_ns, st.st_nlink) == (want.mtime_ns, want.ctime_ns, want.nlink)
        assert st.st_mtime_ns > before.st_mtime_ns
        before = st
        time.sleep(0.002)
        os.unlink(f"{mdir}/f{step}")
        st, want = os.stat(mdir), client.stat(testdir)
        assert (st.st_mtime_ns, st.st_ctime_ns, st.st_nlink) == (want.mtime_ns, want.ctime_ns, want.nlink)
        assert st.st_mtime_ns > before.st_mtime_ns
        before = st
    os.mkdir(f"{mdir}/sub")  # a subdirectory changes the link count too
    st, want = os.stat(mdir), client.stat(testdir)
    assert (st.st_mtime_ns, st.st_nlink) == (want.mtime_ns, want.nlink) and st.st_nlink == before.st_nlink + 1
    assert os.listdir(mdir) == ["sub"]  # the listing hands the kernel (and the daemon) sub's attributes
    for step in range(2):
        _touch(f"{mdir}/sub/g{step}")
        sub, want = os.stat(f"{mdir}/sub"), client.stat(f"{testdir}/sub")
        assert (sub.st_mtime_ns, sub.st_ctime_ns) == (want.mtime_ns, want.ctime_ns)
        os.unlink(f"{mdir}/sub/g{step}")
    os.rmdir(f"{mdir}/sub")
    st, want = os.stat(mdir), client.stat(testdir)
    assert (st.st_mtime_ns, st.st_nlink) == (want.mtime_ns, want.nlink)


def test_another_clients_chmod_of_a_directory_shows_while_this_mount_keeps_changing_it(
        mdir: str, client: Client, testdir: str) -> None:
    """Creating and removing names here does not keep the directory's other attributes
    cached past the attribute timeout: another client's chmod shows within it. (Through
    a directory fd: no path lookup refreshes the directory's attributes on the way.)"""
    os.mkdir(f"{mdir}/d", 0o755)
    dfd = os.open(f"{mdir}/d", os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name in ("warm1", "warm2"):  # the second create makes the kernel ask for d's attributes
            os.close(os.open(name, os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=dfd))
        assert stat.S_IMODE(os.fstat(dfd).st_mode) == 0o755
        client.chmod(f"{testdir}/d", 0o700)
        changed = time.monotonic()
        seen, k = False, 0
        while not seen and time.monotonic() - changed < ATTR_TIMEOUT + 3.0:
            os.close(os.open(f"n{k}", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=dfd))
            os.unlink(f"n{k}", dir_fd=dfd)
            k += 1
            seen = stat.S_IMODE(os.fstat(dfd).st_mode) == 0o700
        assert seen, f"the chmod of another client never showed ({k} create/unlink rounds)"
    finally:
        os.close(dfd)


def test_reopen_after_another_client_rewrote_a_file_read_here(mdir: str, client: Client, testdir: str) -> None:
    """Close-to-open: bytes read into the kernel's page cache before another client's
    rewrite (same size) are not served to an open after the rewrite, even when the
    rewrite happened while the file was open here."""
    path = f"{testdir}/f"
    client.write_bytes(path, b"old." * 50_000)
    with open(f"{mdir}/f", "rb") as f:
        assert f.read() == b"old." * 50_000  # the kernel caches these pages
        client.write_bytes(path, b"NEW!" * 50_000)
    time.sleep(0.2)  # release is asynchronous to close()
    with open(f"{mdir}/f", "rb") as f:
        assert f.read() == b"NEW!" * 50_000


def test_create_close_reopen_and_unlink_of_untouched_files(mdir: str, client: Client, testdir: str) -> None:
    """Files created and closed without a write: empty, listed, and gone after unlink, as
    the service sees them too; a write after the reopen lands."""
    names = [f"e{k:03d}" for k in range(30)]
    for n in names:
        _touch(f"{mdir}/{n}")
    assert sorted(os.listdir(mdir)) == names
    assert all(os.stat(f"{mdir}/{n}").st_size == 0 for n in names)
    with open(f"{mdir}/{names[0]}", "r+b") as f:
        assert f.read() == b""
        f.write(b"data")
    assert client.read_bytes(f"{testdir}/{names[0]}") == b"data"
    for n in names:
        os.unlink(f"{mdir}/{n}")
    assert os.listdir(mdir) == [] and client.listdir(testdir) == []
