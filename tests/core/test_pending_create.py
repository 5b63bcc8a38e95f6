"""Files opened as new whose name is made at their first fsync/close (``fsclient/core/_pending.py``):
one metadata commit per small durable file, and still: visible to the process that made it at
once, an existing name written in place, no name over bytes that were not acknowledged, and
no reservation left to expire under an open file."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from stripefs.fsclient.core import _pending
from stripefs.wire import StripefsError


def _sent(client, monkeypatch) -> list[str]:
    """The metadata requests ``client`` sends from now on, by type name."""
    sent: list[str] = []
    core = client._core
    real = core.call
    monkeypatch.setattr(core, "call", lambda msg, *a, **kw: (sent.append(type(msg).__name__), real(msg, *a, **kw))[1])
    return sent


def test_a_new_small_durable_file_is_one_commit(client, other, testdir: str, monkeypatch) -> None:
    sent = _sent(client, monkeypatch)
    data = {f"{testdir}/f{k}": os.urandom(1000 + 4000 * k) for k in range(12)}
    for path, payload in data.items():
        with client.open(path, "wb") as f:
            f.write(payload)
            f.fsync()
    # One CommitFiles per file (name, inode and length), reservations a few at a time;
    # no create before the bytes and no length commit after them.
    assert sent.count("CommitFiles") == 12 and sent.count("ReserveFiles") <= 3, sent
    assert "CreatePath" not in sent and "CommitLength" not in sent, sent
    for path, payload in data.items():
        assert other.read_bytes(path) == payload and other.stat(path).size == len(payload)
    assert sorted(other.listdir(testdir)) == sorted(p.rsplit("/", 1)[1] for p in data)


@pytest.fixture
def other(cluster):
    """Another client of the same cluster (its own caches and connections)."""
    with cluster.client() as c:
        yield c


def test_what_a_process_made_it_sees_at_once(client, other, testdir: str) -> None:
    p = f"{testdir}/f"
    with client.open(p, "wb") as f:
        f.write(b"x" * 5000)
        assert client.exists(p) and client.stat(p).size == 0  # made, empty, as after open
        assert "f" in client.listdir(testdir)
        f.write(b"y" * 5000)
    assert client.read_bytes(p) == b"x" * 5000 + b"y" * 5000
    assert other.stat(p).size == 10_000


def test_a_name_made_by_another_thread_while_the_writer_writes(client, testdir: str) -> None:
    """Two threads look while a third writes: whichever makes a pending name, the other
    never finds it missing (a name taken by one thread is waited for by the next)."""
    paths = [f"{testdir}/t{k}" for k in range(40)]
    stop = threading.Event()
    opened: list[str] = []
    missing: list[str] = []
    looks = [0, 0]

    def look(i: int) -> None:
        while not stop.is_set():
            if opened:
                p = opened[-1]
                if not client.exists(p):
                    missing.append(p)
            looks[i] += 1

    threads = [threading.Thread(target=look, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    try:
        for k, p in enumerate(paths):
            with client.open(p, "wb") as f:
                opened.append(p)
                for _ in range(20):
                    f.write(bytes([k]) * 3000)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert all(looks) and not missing, missing
    for k, p in enumerate(paths):
        assert client.read_bytes(p) == bytes([k]) * 60_000


@pytest.mark.parametrize("size", [3000, 1_500_000], ids=["buffered", "sent-before-the-name"])
def test_a_name_that_exists_is_written_in_place(client, other, testdir: str, size: int) -> None:
    p = f"{testdir}/f"
    client.set_layout(testdir, stripe=1)  # a write-behind window of one chunk: bytes leave early
    other.write_bytes(p, b"old" * 100_000)
    ino = other.stat(p).ino
    new = os.urandom(size)
    with client.open(p, "wb") as f:
        for off in range(0, size, 100_000):
            f.write(new[off:off + 100_000])
    assert other.stat(p).ino == ino  # the same file: caches of the name stay right
    assert other.read_bytes(p) == new and other.stat(p).size == size


def test_a_name_made_elsewhere_between_open_and_close_is_written_in_place(client, other, testdir: str) -> None:
    p = f"{testdir}/race"
    with client.open(p, "wb") as f:
        f.write(b"mine")
        other.write_bytes(p, b"theirs, made first")
    ino = other.stat(p).ino
    assert other.read_bytes(p) == b"mine"  # open("wb") truncates: the later writer's bytes
    assert client.stat(p).ino == ino


def test_a_pending_name_is_made_before_its_reservation_could_expire(client, other, testdir: str, monkeypatch) -> None:
    monkeypatch.setattr(_pending, "DEFER_AGE", 0.2)
    p = f"{testdir}/slow"
    with client.open(p, "wb") as f:
        f.write(b"early")
        deadline = time.monotonic() + 10
        while not other.exists(p):
            assert time.monotonic() < deadline, "the timer never made the name"
            time.sleep(0.05)
        assert other.stat(p).size == 0  # made empty; the bytes are committed at close
        f.write(b" and late")
    assert other.read_bytes(p) == b"early and late"


def test_errors_about_the_name_come_at_close_and_nothing_appears(client, other, testdir: str) -> None:
    d = f"{testdir}/d"
    client.mkdir(d)
    client.write_bytes(f"{d}/first", b"1")  # the pool for d is filled
    other.remove(f"{d}/first")
    other.rmdir(d)
    with pytest.raises(FileNotFoundError):
        with client.open(f"{d}/late", "wb") as f:
            f.write(b"lost with its directory")
    other.mkdir(f"{testdir}/e")
    with pytest.raises(IsADirectoryError):
        with client.open(f"{testdir}/e", "wb") as f:
            f.write(b"x")
    assert other.isdir(f"{testdir}/e")
    # This client's own rmdir drops its pool: the error comes at open then.
    client.mkdir(d)
    client.write_bytes(f"{d}/first", b"1")
    client.remove(f"{d}/first")
    client.rmdir(d)
    with pytest.raises(FileNotFoundError):
        client.open(f"{d}/late", "wb")


def test_a_failed_write_makes_no_name(make_cluster) -> None:
    h = make_cluster(servers=2)
    with h.client(retry_for=1.0) as c:
        c.mkdir("/w")
        os.kill(c.status().servers[0].pid, signal.SIGKILL)
        failed = []
        for k in range(8):
            try:
                with c.open(f"/w/f{k}", "wb") as f:
                    f.write(os.urandom(600_000))  # chunks on both servers: every file meets the dead one
            except StripefsError:
                failed.append(f"f{k}")
        assert failed, "no write met the dead server: the test proves nothing"
        names = set(c.listdir("/w"))
        assert not names & set(failed), "a name was made over bytes that were not written"


def test_off_makes_the_name_at_open(client, other, testdir: str, monkeypatch) -> None:
    p = f"{testdir}/now"
    with client.open(p, "wb", defer=False) as f:
        assert other.exists(p)
        f.write(b"z")
    monkeypatch.setattr("stripefs.fsclient.core._client.DEFER", False)
    with client.open(f"{p}2", "wb"):
        assert other.exists(f"{p}2")
