"""Batched and path-addressed metadata requests: one round trip for many stats, for a
create or an unlink by path, with the per-inode requests' semantics."""

from __future__ import annotations

import errno
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from stripefs import wire
from stripefs.fsclient.core._client import CREATE_MANY_MAX
from stripefs.rpc import Connection
from stripefs.wire import ErrorCode, StripefsError, messages as m


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
    with pytest.raises(IsADirectoryError):  # at open, or at close when the name was made there (_pending)
        with client.open(testdir, "wb"):
            pass
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


# --- batched creates and unlinks -------------------------------------------------------------


def test_create_many_answers_each_path_and_the_files_work(client, testdir: str) -> None:
    client.write_bytes(f"{testdir}/old", b"kept")
    asked = [f"{testdir}/a", f"{testdir}/old", f"{testdir}/nodir/x", f"{testdir}/old/x", f"{testdir}/b"]
    got = client.create_many(asked)
    assert [type(r).__name__ for r in got] == ["Attr", "StripefsFileExistsError", "StripefsFileNotFoundError",
                                               "StripefsNotADirectoryError", "Attr"]
    assert got[1].filename == asked[1] and isinstance(got[2], FileNotFoundError)
    mask = os.umask(0)
    os.umask(mask)
    assert got[0].mode & 0o7777 == 0o644 & ~mask and got[0].uid == os.getuid()
    assert client.stat(asked[0]) == got[0]
    with client.open(asked[4], "r+b") as f:  # a created file takes data like any other
        f.write(b"written")
    assert client.read_bytes(asked[4]) == b"written" and client.read_bytes(asked[1]) == b"kept"
    again = client.create_many([asked[1], asked[0]], mode=0o600, exclusive=False)
    assert [a.ino for a in again] == [client.stat(asked[1]).ino, got[0].ino]
    assert client.read_bytes(asked[1]) == b"kept"  # opened, not truncated
    assert client.create_many([]) == []


def test_create_many_splits_long_lists(client, testdir: str) -> None:
    paths = [f"{testdir}/f{k:04d}" for k in range(2 * CREATE_MANY_MAX + 50)]  # three requests
    got = client.create_many(paths)
    assert all(isinstance(a, wire.Attr) for a in got) and len({a.ino for a in got}) == len(paths)
    assert client.listdir(testdir) == [p.rsplit("/", 1)[1] for p in paths]
    assert [a.ino for a in client.stat_many(paths)] == [a.ino for a in got]
    gone = client.unlink_many(paths + [f"{testdir}/f0000"])
    assert all(a.nlink == 0 for a in gone[:-1]) and isinstance(gone[-1], FileNotFoundError)
    assert client.listdir(testdir) == []


def test_create_many_refuses_bad_paths_before_sending_any(client, testdir: str) -> None:
    with pytest.raises(StripefsError) as info:
        client.create_many([f"{testdir}/ok"] * 300 + ["/../x"])
    assert info.value.errno == errno.EINVAL
    assert client.listdir(testdir) == []  # not even the first request went out


@pytest.mark.parametrize("msg", [m.CreateMany(paths=["/x"] * 201, mode=0o644), m.UnlinkMany(paths=["/x"] * 201),
                                 m.CreateMany(paths=["/x", 3], mode=0o644), m.UnlinkMany(paths=[None])])
def test_the_service_refuses_oversized_or_non_text_batches(client, msg) -> None:
    with pytest.raises(StripefsError) as info:
        client.call(msg)
    assert info.value.errno == errno.EINVAL


def test_names_too_long_fail_alone(client, testdir: str) -> None:
    got = client.create_many([f"{testdir}/{'n' * 256}", f"{testdir}/ok"])
    assert isinstance(got[0], StripefsError) and got[0].errno == errno.ENAMETOOLONG
    assert client.listdir(testdir) == ["ok"]


def test_a_retried_create_many_gets_the_first_answer(cluster, client, testdir: str) -> None:
    # A retry after a lost reply carries the same (client id, request id): whether the first
    # is still running or already answered, the batch is applied once and both get its answer.
    from stripefs.fsclient.core import find_cluster

    cfg = find_cluster(cluster.file)
    client_id = os.urandom(16)
    conns = [Connection(cfg.metadata, cfg.secret, client_id, expect_role="metadata") for _ in range(2)]
    try:
        for i in range(6):
            msg = m.CreateMany(paths=[f"{testdir}/r{i}-{k}" for k in range(20)], mode=0o644, exclusive=True)
            futs = [conn.submit(msg, req_id=5000 + i) for conn in conns]  # same ids, twice at once
            replies = [wire.decode_reply(msg, f.result(30).header) for f in futs]
            later = wire.decode_reply(msg, conns[0].submit(msg, req_id=5000 + i).result(30).header)
            assert replies[0] == replies[1] == later and not replies[0].failed, f"round {i}: {replies}"
            gone = m.UnlinkMany(paths=msg.paths)
            first = wire.decode_reply(gone, conns[1].submit(gone, req_id=6000 + i).result(30).header)
            again = wire.decode_reply(gone, conns[0].submit(gone, req_id=6000 + i).result(30).header)
            assert first == again and not first.failed  # not ENOENT: the retry was not reapplied
    finally:
        for conn in conns:
            conn.close()
    assert client.listdir(testdir) == []


def test_overlong_paths_fail_alone_however_many(client, testdir: str) -> None:
    long = f"{testdir}/" + "d/" * 3000 + "f"  # 6 KB: 200 of them would not fit in one frame
    got = client.create_many([long] * 250 + [f"{testdir}/ok"])
    assert all(isinstance(r, StripefsError) and r.errno == errno.ENAMETOOLONG and r.filename == long for r in got[:-1])
    assert client.stat(f"{testdir}/ok") == got[-1]
    gone = client.unlink_many([long] * 250 + [f"{testdir}/ok"])
    assert all(r.errno == errno.ENAMETOOLONG for r in gone[:-1]) and gone[-1].nlink == 0


def test_symlink_many_through_the_service(client, testdir: str) -> None:
    d = client.stat(testdir).ino
    client.write_bytes(f"{testdir}/file", b"x")
    reply = client.call(m.SymlinkMany(parent=d, names=["a", "b", "file"], targets=["/x/a", "/x/b", "/x/f"]))
    assert reply.failed == [2] and reply.codes == [ErrorCode.EXISTS] and len(reply.attrs) == 2
    assert client.readlink(f"{testdir}/a") == "/x/a"
    again = client.call(m.SymlinkMany(parent=d, names=["a", "file"], targets=["/y/a", "/y/f"], replace=True))
    assert again.failed == [1] and client.readlink(f"{testdir}/a") == "/y/a"
    assert client.read_bytes(f"{testdir}/file") == b"x"
    assert sorted(client.listdir(testdir)) == ["a", "b", "file"]
    with pytest.raises(OSError) as info:
        client.call(m.SymlinkMany(parent=d, names=["c"] * 201, targets=["/t"] * 201))
    assert info.value.errno == errno.EINVAL
