"""New files through the mount: the name is made with the length at the first fsync or
close (``fsclient/fuse/_newfiles.py``), and until then this mount shows the file while
other clients do not."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from stripefs.fsclient import Client
from stripefs.wire import StripefsError

from .conftest import do_umount


def _names(client: Client, path: str) -> list[str]:
    return sorted(client.listdir(path))


def test_a_new_file_is_named_at_its_fsync_with_its_length(mdir: str, testdir: str, client: Client) -> None:
    data = os.urandom(40_000)
    fd = os.open(f"{mdir}/f", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
    try:
        os.write(fd, data)
        assert _names(client, testdir) == []  # other clients see it at fsync/close (close-to-open)
        os.fsync(fd)
        st = client.stat(f"{testdir}/f")
        assert (st.size, st.mode & 0o777) == (len(data), 0o640)
        assert client.read_bytes(f"{testdir}/f") == data
    finally:
        os.close(fd)
    with open(f"{mdir}/f", "rb") as f:
        assert f.read() == data
    assert os.stat(f"{mdir}/f").st_ino == client.stat(f"{testdir}/f").ino  # the kernel's inode is the file's


def test_this_mount_sees_a_new_file_at_once(mdir: str, testdir: str, client: Client) -> None:
    """A listing, a stat by name, a rename: each makes the pending name first."""
    fd = os.open(f"{mdir}/a", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, b"x" * 100)
        assert os.listdir(mdir) == ["a"]  # a listing makes the name (empty, then the length at close)
        assert _names(client, testdir) == ["a"]
        os.write(fd, b"y" * 100)
    finally:
        os.close(fd)
    assert client.read_bytes(f"{testdir}/a") == b"x" * 100 + b"y" * 100
    fd = os.open(f"{mdir}/b", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, b"b")
        os.rename(f"{mdir}/b", f"{mdir}/c")
    finally:
        os.close(fd)
    assert _names(client, testdir) == ["a", "c"]
    assert client.read_bytes(f"{testdir}/c") == b"b"


def test_touch_makes_an_empty_file_and_o_excl_still_fails_at_once(mdir: str, testdir: str, client: Client) -> None:
    open(f"{mdir}/empty", "wb").close()
    assert client.stat(f"{testdir}/empty").size == 0
    with pytest.raises(FileExistsError):
        os.open(f"{mdir}/empty", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    client.write_bytes(f"{testdir}/other", b"theirs")
    with pytest.raises(FileExistsError):  # known to another client only: the service says so at once
        os.open(f"{mdir}/other", os.O_WRONLY | os.O_CREAT | os.O_EXCL)


def test_read_back_through_the_new_files_handle(mdir: str, testdir: str, client: Client) -> None:
    fd = os.open(f"{mdir}/rw", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, b"hello world")
        assert os.pread(fd, 5, 6) == b"world"
    finally:
        os.close(fd)
    assert client.read_bytes(f"{testdir}/rw") == b"hello world"


def test_a_name_made_elsewhere_meanwhile_gets_the_bytes(mdir: str, testdir: str, client: Client) -> None:
    """Another client makes the name between this mount's lookup and its commit: the file
    there is truncated and written (as a create of an existing name would), not replaced."""
    fd = os.open(f"{mdir}/race", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, b"ours" * 1000)
        client.write_bytes(f"{testdir}/race", b"theirs, longer than ours " * 400)
        theirs = client.stat(f"{testdir}/race").ino
        os.fsync(fd)
    finally:
        os.close(fd)
    assert client.stat(f"{testdir}/race").ino == theirs
    assert client.read_bytes(f"{testdir}/race") == b"ours" * 1000
    with open(f"{mdir}/race", "rb") as f:  # the kernel's entry for the reserved inode went
        assert f.read() == b"ours" * 1000


def test_a_parent_removed_meanwhile_fails_the_close_and_makes_no_name(mdir: str, testdir: str,
                                                                       client: Client) -> None:
    os.mkdir(f"{mdir}/sub")
    fd = os.open(f"{mdir}/sub/f", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, b"lost")
    client.rmdir(f"{testdir}/sub")
    with pytest.raises(FileNotFoundError):
        os.fsync(fd)
    with pytest.raises(FileNotFoundError):  # close reports it again: the name is still not made
        os.close(fd)
    with pytest.raises(StripefsError):
        client.stat(f"{testdir}/sub/f")


def test_off_switch_creates_at_once(cluster, client: Client, testdir: str, tmp_path) -> None:
    """``STRIPEFS_DEFER_CREATE=0``: the name exists from the CREATE on (as before)."""
    mp = str(tmp_path / "m")
    env = dict(os.environ, STRIPEFS_DEFER_CREATE="0")
    code = ("import sys; from stripefs.fsclient.fuse import main; "
            f"sys.exit(main(['mount', {mp!r}, '--cluster', {cluster.file!r}]))")
    os.makedirs(mp)
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=60).returncode == 0
    try:
        fd = os.open(f"{mp}{testdir}/now", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            assert _names(client, testdir) == ["now"]
        finally:
            os.close(fd)
    finally:
        do_umount(mp)
