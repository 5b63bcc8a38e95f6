"""Whole files written bytes-first (``Client.write_bytes``, ``Client.write_files``): each new
file appears whole or not at all, an existing one is written in place, and no name is
ever committed over bytes the storage servers did not acknowledge."""

from __future__ import annotations

import errno
import os
import signal
import stat

import pytest

from stripefs.wire import StripefsError


def test_write_bytes_makes_new_files_whole_and_rewrites_old_ones_in_place(client, testdir: str) -> None:
    p = f"{testdir}/f"
    client.write_bytes(p, b"first")
    assert client.read_bytes(p) == b"first"
    ino = client.stat(p).ino
    client.chmod(p, 0o600)
    client.link(p, f"{testdir}/hard")
    big = os.urandom(700_000)  # several chunks, over more than one server
    client.write_bytes(p, big)
    assert client.read_bytes(p) == big and client.stat(p).size == len(big)
    assert client.stat(p).ino == ino  # in place: caches of the name stay right
    assert stat.S_IMODE(client.stat(p).mode) == 0o600
    assert client.read_bytes(f"{testdir}/hard") == big  # the same file
    client.write_bytes(f"{testdir}/empty", b"")
    assert client.stat(f"{testdir}/empty").size == 0
    with pytest.raises(FileExistsError):
        client.write_bytes(p, b"x", exclusive=True)
    with pytest.raises(FileNotFoundError):
        client.write_bytes(f"{testdir}/nodir/f", b"x")
    client.mkdir(f"{testdir}/d")
    with pytest.raises(IsADirectoryError):
        client.write_bytes(f"{testdir}/d", b"x")


def test_write_files_commits_many_files_and_keeps_each_error(client, testdir: str) -> None:
    client.mkdir(f"{testdir}/a")
    client.mkdir(f"{testdir}/b")
    files = {f"{testdir}/{'ab'[k % 2]}/f{k}": os.urandom(k * 97) for k in range(250)}
    files[f"{testdir}/missing/x"] = b"lost"
    client.write_bytes(f"{testdir}/a/f0", b"old")
    got = client.write_files(files)
    assert len(got) == 251
    assert isinstance(got[-1], FileNotFoundError) and got[-1].filename == f"{testdir}/missing/x"
    for (path, data), attr in zip(list(files.items())[:250], got):
        assert attr.size == len(data)
        assert client.read_bytes(path) == data
    assert sorted(client.listdir(f"{testdir}/a")) == sorted(f"f{k}" for k in range(0, 250, 2))
    with pytest.raises(OSError) as info:
        client.write_files([(f"{testdir}/a/f0", b"1"), (f"{testdir}/a/../a/f0", b"2")])
    assert info.value.errno == errno.EINVAL  # the same path twice
    again = client.write_files({f"{testdir}/a/f0": b"x"}, exclusive=True)
    assert isinstance(again[0], FileExistsError)
    ino = client.stat(f"{testdir}/a/f0").ino
    mixed = client.write_files({f"{testdir}/a/f0": b"rewritten", f"{testdir}/a/new": b"fresh"})
    assert [a.size for a in mixed] == [9, 5]
    assert client.stat(f"{testdir}/a/f0").ino == ino and client.read_bytes(f"{testdir}/a/f0") == b"rewritten"
    assert client.read_bytes(f"{testdir}/a/new") == b"fresh"


def test_a_file_whose_bytes_were_not_written_never_appears(make_cluster) -> None:
    """One storage server of two is dead (one replica): files with chunks there fail
    alone, and none of them appears; the others appear whole."""
    h = make_cluster(servers=2)
    with h.client(retry_for=1.0) as c:
        c.mkdir("/w")
        victim = c.status().servers[0]
        os.kill(victim.pid, signal.SIGKILL)
        files = {f"/w/f{k}": os.urandom(300_000) for k in range(12)}  # 2 chunks each: most meet the dead server
        got = c.write_files(files)
        failed = [p for p, r in zip(files, got) if isinstance(r, StripefsError)]
        assert failed, "every file avoided the dead server: the test proves nothing"
        names = set(c.listdir("/w"))
        for path, r in zip(files, got):
            name = path.rsplit("/", 1)[1]
            if isinstance(r, StripefsError):
                assert name not in names, f"{path} was committed although its bytes were not written"
            else:
                assert c.read_bytes(path) == files[path]


def test_rewriting_a_name_the_client_knows_spends_no_reservation(client, testdir: str, monkeypatch) -> None:
    """A name this client's cache holds as a file is written in place at once: no
    reservation taken and no commit refused for it (the collector would remove each
    wasted one later); an unknown name still goes bytes-first."""
    known, unknown = f"{testdir}/known", f"{testdir}/unknown"
    client.write_bytes(known, b"one")
    client.stat(known)  # in the cache now
    sent: list[str] = []
    real = client.call
    monkeypatch.setattr(client, "call", lambda msg, **kw: (sent.append(type(msg).__name__), real(msg, **kw))[1])
    pool_before = len(client._reservations._pools.get(testdir, ()))
    client.write_bytes(known, b"two, longer")
    assert client.read_bytes(known) == b"two, longer"
    assert "CommitFiles" not in sent and len(client._reservations._pools.get(testdir, ())) == pool_before
    (got,) = client.write_files([(known, b"three")])
    assert got.size == 5 and client.read_bytes(known) == b"three"
    assert "CommitFiles" not in sent and "ReserveFiles" not in sent
    client.write_bytes(unknown, b"new")
    assert "CommitFiles" in sent and client.read_bytes(unknown) == b"new"
