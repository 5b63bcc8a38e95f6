"""The client's attribute cache (``Client(attr_timeout=...)``): a ``stat`` of a path
nobody changed is answered locally; this client's own changes show at once; other
clients' changes show after ``attr_timeout`` seconds, or at ``open`` (close-to-open)."""

from __future__ import annotations

import time

import pytest


@pytest.fixture
def cached(cluster):
    from stripefs.fsclient import Client

    c = Client(cluster.file, attr_timeout=0.5, leases=False)
    yield c
    c.close()


def test_others_changes_show_after_the_timeout_or_at_open(cached, client, testdir: str) -> None:
    p = f"{testdir}/f"
    client.write_bytes(p, b"abc")
    assert cached.stat(p).size == 3
    client.write_bytes(p, b"abcdef")  # another client rewrites it
    assert cached.stat(p).size == 3  # answered from the cache: no round trip
    with cached.open(p, "rb") as f:  # open revalidates (close-to-open)
        assert f.read() == b"abcdef"
    assert cached.stat(p).size == 6
    client.write_bytes(p, b"x")
    time.sleep(0.6)
    assert cached.stat(p).size == 1  # the documented bound passed
    client.remove(p)
    time.sleep(0.6)
    with pytest.raises(FileNotFoundError):
        cached.stat(p)


def test_own_changes_show_at_once(cached, testdir: str) -> None:
    p = f"{testdir}/f"
    cached.write_bytes(p, b"abc")
    first = cached.stat(p)
    assert first.size == 3
    with cached.open(p, "ab") as f:
        f.write(b"de")
    assert cached.stat(p).size == 5
    cached.chmod(p, 0o600)
    assert cached.stat(p).mode & 0o777 == 0o600
    cached.link(p, f"{testdir}/g")
    assert cached.stat(p).nlink == 2
    cached.remove(f"{testdir}/g")
    assert cached.stat(p).nlink == 1
    cached.rename(p, f"{testdir}/h")
    with pytest.raises(FileNotFoundError):
        cached.stat(p)
    assert cached.stat(f"{testdir}/h").ino == first.ino
    cached.remove(f"{testdir}/h")
    with pytest.raises(FileNotFoundError):
        cached.stat(f"{testdir}/h")
    with cached.open(p, "wb"):
        pass
    again = cached.stat(p)
    assert again.ino != first.ino and again.size == 0
    assert cached.exists(p) and cached.isfile(p)


def test_a_link_to_a_changed_file_is_not_stale(cached, testdir: str) -> None:
    p = f"{testdir}/f"
    cached.write_bytes(p, b"abc")
    cached.symlink(p, f"{testdir}/l")
    assert cached.stat(f"{testdir}/l").size == 3
    cached.write_bytes(p, b"abcdefg")  # truncate + write + commit by path p, not l
    assert cached.stat(f"{testdir}/l").size == 7
    assert cached.lstat(f"{testdir}/l").is_symlink


def test_no_cache_by_default(client, cluster, testdir: str) -> None:
    from stripefs.fsclient import Client

    p = f"{testdir}/f"
    client.write_bytes(p, b"abc")
    with Client(cluster.file) as other:
        assert other.stat(p).size == 3
        client.write_bytes(p, b"abcdef")
        assert other.stat(p).size == 6


def test_the_environment_sets_the_default_and_a_bad_value_is_refused(cluster, client, testdir: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from stripefs.fsclient import Client
    from stripefs.wire import StripefsError

    p = f"{testdir}/env"
    client.write_bytes(p, b"abc")
    monkeypatch.setenv("STRIPEFS_ATTR_TIMEOUT", "30")
    with Client(cluster.file) as c:
        assert c.stat(p).size == 3
        client.write_bytes(p, b"abcdef")
        assert c.stat(p).size == 3  # cached: the variable turned the cache on
    with Client(cluster.file, attr_timeout=0) as c:  # an argument wins over the variable
        client.write_bytes(p, b"x")
        assert c.stat(p).size == 1
    monkeypatch.setenv("STRIPEFS_ATTR_TIMEOUT", "soon")
    with pytest.raises(StripefsError, match="attr_timeout must be a number") as err:
        Client(cluster.file)
    assert isinstance(err.value, OSError)
    with pytest.raises(StripefsError, match="attr_timeout must be >= 0"):
        Client(cluster.file, attr_timeout=-1)


def test_a_lifetime_without_a_lease_id_is_not_kept_as_a_lease() -> None:
    """A ``StatMany`` answer carries one ``lease_ms`` for the batch; a path the service gave no
    lease (id 0: past its per-client bound) must not be kept for that lifetime, since nothing
    on the service would invalidate it."""
    from stripefs.fsclient.core._attrcache import AttrCache
    from stripefs.wire import Attr

    cache = AttrCache(0.0)  # no timed entries: only leases are kept
    cache.leasing = True
    attr = Attr(ino=7, mode=0o100644, nlink=1, uid=0, gid=0, size=3, atime_ns=0, mtime_ns=0, ctime_ns=0)
    cache.put("/unleased", attr, cache.token(), 0, 60_000, time.monotonic())
    cache.put("/leased", attr, cache.token(), 42, 60_000, time.monotonic())
    cache.put_names("/d-unleased", ["a"], cache.token(), 0, 60_000, time.monotonic())
    assert cache.get("/unleased") is None
    assert cache.get("/leased") == attr
    assert cache.get_names("/d-unleased") is None
