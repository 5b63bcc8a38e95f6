"""Batched and path-addressed metadata requests: one round trip for many stats, for a
create or an unlink by path, with the per-inode requests' semantics."""

from __future__ import annotations

import errno
from concurrent.futures import ThreadPoolExecutor

import pytest

from wire import StripefsError, messages as m


def test_stat_many_answers_each_path_in_order(client, testdir: str) -> None:
    names = [f"{testdir}/f{k}" for k in range(25)]
    for k, p in enumerate(names):
        client.write_bytes(p, b"x" * k)
    client.mkdir(f"{testdir}/sub")
    client.symlink(f"{testdir}/f3", f"{testdir}/link")
    asked = names + [f"{testdir}/missing", f"{testdir}/f1/below", f"{testdir}/sub", f"{testdir}/link"]
    got = client.stat_many(asked)
    assert len(got) == len(asked)
    for k, p in enumerate(names):
        assert got[k].size == k and got[k].ino == client.stat(p).ino
    assert isinstance(got[25], FileNotFoundError) and got[25].filename == f"{testdir}/missing"
    assert isinstance(got[26], NotADirectoryError)
    assert got[27].is_dir
    assert got[28].ino == client.stat(f"{testdir}/f3").ino  # followed
    assert client.stat_many([f"{testdir}/link"], follow=False)[0].is_symlink
    assert client.stat_many([]) == []


def test_stat_many_splits_long_lists(client, testdir: str) -> None:
    client.write_bytes(f"{testdir}/a", b"abc")
    got = client.stat_many([f"{testdir}/a"] * 1001)  # more than one request holds
    assert len(got) == 1001 and all(a.size == 3 for a in got)


def test_the_service_refuses_too_many_paths(client) -> None:
    with pytest.raises(StripefsError) as info:
        client.call(m.StatMany(paths=["/"] * 201))
    assert info.value.errno == errno.EINVAL


def test_create_and_unlink_by_path_keep_their_errors(client, testdir: str) -> None:
    with client.open(f"{testdir}/f", "wb") as f:
        f.write(b"data")
    with pytest.raises(FileExistsError):
        client.open(f"{testdir}/f", "xb")
    with pytest.raises(FileNotFoundError) as info:
        client.open(f"{testdir}/nodir/f", "wb")
    assert info.value.filename == f"{testdir}/nodir/f"
    with pytest.raises(NotADirectoryError):
        client.open(f"{testdir}/f/g", "wb")
    with pytest.raises(IsADirectoryError):
        client.open(testdir, "wb")
    with pytest.raises(OSError) as info:
        client.remove("/")
    assert info.value.errno == errno.EINVAL
    with pytest.raises(StripefsError) as info:
        client.call(m.UnlinkPath(path=f"{testdir}/.."))
    assert info.value.errno == errno.EINVAL
    with client.open(f"{testdir}/f", "wb") as f:  # truncates
        f.write(b"x")
    assert client.read_bytes(f"{testdir}/f") == b"x"
    client.mkdir(f"{testdir}/d")
    with pytest.raises(IsADirectoryError):
        client.remove(f"{testdir}/d")
    client.remove(f"{testdir}/f")
    with pytest.raises(FileNotFoundError):
        client.remove(f"{testdir}/f")
    assert client.listdir(testdir) == ["d"]


def test_create_by_path_through_a_symlinked_directory(client, testdir: str) -> None:
    client.mkdir(f"{testdir}/real")
    client.symlink(f"{testdir}/real", f"{testdir}/alias")
    client.write_bytes(f"{testdir}/alias/f", b"via link")
    assert client.read_bytes(f"{testdir}/real/f") == b"via link"
    client.remove(f"{testdir}/alias/f")
    assert client.listdir(f"{testdir}/real") == []


def test_listdir_pages_names_in_order(client, testdir: str) -> None:
    names = sorted(f"n{k:05d}" for k in range(2105))  # more than one page of 2000
    for n in names[:5]:
        client.write_bytes(f"{testdir}/{n}", b"")
    assert client.listdir(testdir) == names[:5]
    with ThreadPoolExecutor(16) as pool:  # concurrent mkdirs share group commits: seconds, not 2000 fsyncs
        list(pool.map(lambda n: client.mkdir(f"{testdir}/{n}"), names[5:]))
    assert client.listdir(testdir) == names
    assert client.listdir(testdir + "/") == names
    client.symlink(testdir, f"{testdir}/../{testdir.rsplit('/', 1)[1]}-alias")
    assert client.listdir(f"{testdir}-alias") == names  # a symlink to a directory is followed
    with pytest.raises(NotADirectoryError):
        client.listdir(f"{testdir}/{names[0]}")
    with pytest.raises(FileNotFoundError) as info:
        client.listdir(f"{testdir}/missing")
    assert info.value.filename == f"{testdir}/missing"
    page = client.call(m.ListNames(path=testdir, after=names[10], limit=3))
    assert page.names == names[11:14] and page.more
