"""What a client leaves behind and what its caches hold (issue #28, "also seen").

* A ``Client`` dropped without ``close()`` is closed once collected: its watch thread,
  connections (sockets, reader and sender threads) and service-side holder go; a process
  that exits without ``close()`` gives its leases back.
* The client's own removal of a symlink drops the cached paths that resolved through it
  (the service tells other clients only).
* The attribute cache is bounded in bytes, whole listings included, and expired entries
  are purged.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from typing import Any

import pytest

from stripefs.fsclient import Client
from stripefs.fsclient.core import _attrcache
from stripefs.fsclient.core._attrcache import AttrCache
from stripefs.fsclient.testing import LocalCluster
from stripefs.wire import Attr
from tests.core.test_attr_leases import _watching


def _usage() -> tuple[int, int]:
    """(open fds, live threads) of this process."""
    return len(os.listdir("/proc/self/fd")), threading.active_count()


def _settled(baseline: tuple[int, int], timeout: float = 15.0) -> tuple[int, int]:
    """This process's usage once back at ``baseline`` (or what it is after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        now = _usage()
        if (now[0] <= baseline[0] and now[1] <= baseline[1]) or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


# -- an unclosed client ------------------------------------------------------------------------
def test_an_unclosed_client_leaves_no_thread_or_socket(cluster: LocalCluster, client: Client, testdir: str) -> None:
    path = f"{testdir}/f"
    client.write_bytes(path, os.urandom(600_000))  # stripes over every server: data connections too

    def use_and_drop() -> None:
        c = _watching(cluster.client())  # the lease watch: a thread and a connection of its own
        assert c.stat(path).size == 600_000
        assert len(c.read_bytes(path)) == 600_000
        assert c.listdir(testdir) == ["f"]

    with cluster.client() as warm:  # whatever a first client loads once (imports, buffers) is in the baseline
        _watching(warm).read_bytes(path)
    baseline = _settled(_usage(), timeout=2.0)
    for _ in range(20):
        use_and_drop()  # never closed
        gc.collect()
    fds, threads = _settled(baseline)
    assert fds <= baseline[0] and threads <= baseline[1], (
        f"20 unclosed clients left {fds - baseline[0]} fds and {threads - baseline[1]} threads behind")


def test_a_held_lease_lock_keeps_its_client_open(cluster: LocalCluster, client: Client, testdir: str) -> None:
    """``Client(...).lease(key)``: the client is not collected (and the lease not given
    back) while the lease is held; released, the client goes."""
    key = f"{testdir}/lock"
    lease = cluster.client().lease(key, ttl=5.0)
    gc.collect()
    time.sleep(0.2)
    assert lease.held
    with pytest.raises(BlockingIOError):
        client.lease(key, wait=False)
    lease.release()
    client.lease(key, wait=False).release()


def test_a_process_exiting_without_close_gives_its_leases_back(cluster: LocalCluster, client: Client,
                                                               testdir: str) -> None:
    """A lease lock (TTL 60 s) taken by a process that exits without ``close()`` is free at
    once; a change to a path it held an attribute lease on does not wait for it."""
    key, path = f"{testdir}/lock", f"{testdir}/f"
    client.write_bytes(path, b"abc")
    child = textwrap.dedent(f"""
        import sys, time
        from stripefs.fsclient import Client
        c = Client({cluster.file!r})
        c.lease({key!r}, ttl=60.0)
        deadline = time.monotonic() + 10
        while c._core.attrs.get({path!r}, leased=True) is None and time.monotonic() < deadline:
            c.stat({path!r})
            time.sleep(0.01)
        print("held", flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60, cwd=os.getcwd())
    assert out.returncode == 0 and out.stdout.strip() == "held", out.stderr
    client.lease(key, wait=False).release()  # not held for its 60 s
    t0 = time.monotonic()
    client.chmod(path, 0o600)
    # A holder left behind would hold the change for its lease (the service's TTL, 5 s here);
    # a given-back one costs milliseconds: 3 s tells them apart on a loaded machine.
    assert time.monotonic() - t0 < 3.0


# -- the client's own changes ------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["leased", "timed"])
def test_removing_a_symlink_drops_the_paths_through_it(cluster: LocalCluster, testdir: str, kind: str) -> None:
    c = _watching(cluster.client()) if kind == "leased" else cluster.client(leases=False, attr_timeout=30.0)
    try:
        c.makedirs(f"{testdir}/target")
        c.write_bytes(f"{testdir}/target/x", b"abc")
        c.symlink(f"{testdir}/target", f"{testdir}/link")
        c.symlink(f"{testdir}/link", f"{testdir}/link2")  # through it, by another name
        through = [f"{testdir}/link/x", f"{testdir}/link2/x", f"{testdir}/link2"]
        cache = c._core.attrs
        assert cache is not None
        for p in through:
            for _ in range(100):  # until it is held (a lookup racing an invalidation is not kept)
                assert c.stat(p).ino
                if cache.get(p) is not None:
                    break
                time.sleep(0.01)
            assert cache.get(p) is not None, p
        c.remove(f"{testdir}/link")
        for p in through:
            with pytest.raises(FileNotFoundError):
                c.stat(p)
        assert c.stat(f"{testdir}/target/x").size == 3
    finally:
        c.close()


def test_removing_a_file_keeps_unrelated_entries(cluster: LocalCluster, testdir: str) -> None:
    """The removal of a file stays selective: an unrelated file's entry is kept."""
    c = _watching(cluster.client())
    try:
        c.write_bytes(f"{testdir}/a", b"a")
        c.write_bytes(f"{testdir}/b", b"b")
        cache = c._core.attrs
        assert cache is not None
        for _ in range(100):
            c.stat(f"{testdir}/a")
            if cache.get(f"{testdir}/a") is not None:
                break
            time.sleep(0.01)
        c.remove(f"{testdir}/b")
        assert cache.get(f"{testdir}/a") is not None
    finally:
        c.close()


# -- bounds ------------------------------------------------------------------------------------
def _listing_bytes(cache: AttrCache) -> int:
    """What the cached listings' names hold, counted independently of the cache's own books."""
    return sum(sys.getsizeof(names) + sum(map(sys.getsizeof, names)) for _, names, _ in cache._lists.values())


def test_listing_many_large_directories_stays_within_the_byte_bound(cluster: LocalCluster, client: Client,
                                                                   testdir: str) -> None:
    """50 whole listings of 2,000 names (about 6 MiB) under a 1 MiB bound."""
    big = f"{testdir}/big"
    client.makedirs(big)
    names = [f"sample-{i:06d}.bin" for i in range(2000)]
    assert not [r for r in client.create_many([f"{big}/{n}" for n in names]) if isinstance(r, Exception)]
    links = [f"{testdir}/via{i}" for i in range(50)]  # each a path of its own to the same listing
    for link in links:
        client.symlink(big, link)
    c = _watching(cluster.client())
    try:
        cache = c._core.attrs
        assert cache is not None
        cache.max_bytes = 1 << 20
        for link in links:
            assert len(c.listdir(link)) == 2000
        held = _listing_bytes(cache)
        assert held <= 1 << 20, f"the listings hold {held / 2**20:.1f} MiB past a 1 MiB bound"
        assert 0 < cache.nbytes <= 1 << 20
        assert cache._lists and held <= cache.nbytes  # the estimate counts at least the names
        assert c.listdir(links[-1]) == sorted(names)  # the newest is kept (the oldest went first)
        assert cache.get_names(links[-1]) is not None
    finally:
        c.close()


def _attr(ino: int) -> Attr:
    return Attr(ino=ino, mode=0o100644, nlink=1, uid=0, gid=0, size=3, atime_ns=0, mtime_ns=0, ctime_ns=0)


def test_entries_are_bounded_in_bytes() -> None:
    cache = AttrCache(60.0, max_bytes=1 << 20)
    for i in range(20_000):
        cache.put(f"/some/rather/long/directory/path/file-{i:08d}", _attr(i + 10), cache.token())
    assert 0 < cache.nbytes <= 1 << 20
    assert 0 < len(cache) < 20_000
    assert cache.get("/some/rather/long/directory/path/file-00019999") is not None  # the newest stay
    assert cache.get("/some/rather/long/directory/path/file-00000000") is None  # the oldest went
    assert _attrcache.MAX_BYTES == 64 << 20 and AttrCache(0.0).max_bytes == _attrcache.MAX_BYTES


def test_expired_entries_and_listings_are_purged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_attrcache, "PURGE_EVERY", 0.5)
    cache = AttrCache(0.0)
    cache.leasing = True
    names = [f"name-{k}" for k in range(2000)]
    now = time.monotonic()
    for i in range(100):  # leases of 1 s
        cache.put_names(f"/d{i}", names, cache.token(), i + 1, 1000, now)
        cache.put(f"/f{i}", _attr(i + 10), cache.token(), 1000 + i, 1000, now)
    cache.put_names("/long", ["a"], cache.token(), 5000, 60_000, now)
    assert len(cache._lists) == 101 and len(cache) == 100
    time.sleep(1.1)
    cache.purge()  # what the watch thread does after each answer, and a store when due
    assert list(cache._lists) == ["/long"] and len(cache) == 0
    assert cache.nbytes == cache._sizes[("l", "/long")]
    assert cache.get_names("/long") == ["a"]


def test_a_watch_keeps_no_reference_to_its_client(cluster: LocalCluster) -> None:
    c = _watching(cluster.client())
    watch: Any = c._core._watch
    assert watch is not None
    ref = weakref.ref(c._core)
    del c
    gc.collect()
    deadline = time.monotonic() + 10
    while ref() is not None or watch._thread.is_alive():
        assert time.monotonic() < deadline, "the client's core or its watch thread outlived it"
        gc.collect()
        time.sleep(0.05)
