"""The native client's opens of files read one after another from one directory: after
two, the directory's listing is fetched once with its files' attributes under one lease
(``Client._lease_files``, ``AttrCache.put_files``) and the other opens ask the metadata
service nothing; whatever another client changes there -- a file's bytes in place (same
size, the old mtime put back), its length, its mode, a removal, a rename, a new name -- is
seen by the next ``stat``/``open`` all the same (the change takes the lease back first)."""

from __future__ import annotations

from typing import Any

import pytest

from stripefs.fsclient.core import _attrcache, _client
from stripefs.wire import ErrorCode, StripefsError

from ..conftest import metadata_requests, change_files_elsewhere as _change_files, listing_body as _body
from .test_attr_leases import _watching

FILES = 60


@pytest.fixture
def dataset(metered_cluster: Any) -> Any:
    with metered_cluster.client() as c:
        c.makedirs("/data")
        for i in range(FILES):
            c.write_bytes(f"/data/f{i}", _body(i))
    return metered_cluster


def _read(c: Any, path: str) -> bytes:
    with c.open(path, "rb") as f:
        return f.read()


def test_opening_a_directory_file_by_file_costs_one_listing(dataset: Any) -> None:
    with dataset.client() as reader:
        resolves, listings = metadata_requests(dataset.file, "Resolve"), metadata_requests(dataset.file, "Readdir")
        for i in range(FILES):
            assert _read(reader, f"/data/f{i}") == _body(i)
        resolved = metadata_requests(dataset.file, "Resolve") - resolves
        listed = metadata_requests(dataset.file, "Readdir") - listings
    # Two opens resolve their files; the second fetches the listing (after a Resolve of
    # the directory), and the others are answered from it (a refetch if the 5 s lease ended).
    assert resolved <= 8, f"{resolved:.0f} Resolve requests for {FILES} files"
    assert 1 <= listed <= 3, listed


def test_batches_of_a_directorys_files_cost_one_listing(dataset: Any) -> None:
    """``stat_many`` (a ring's ``open_many``, a dataloader's batch): a batch that misses
    several files of one directory fetches its leased listing, and the batches after it
    ask nothing; what another client changes there is seen by the next batch all the same."""
    paths = [f"/data/f{i}" for i in range(FILES)]
    with dataset.client() as reader:
        _watching(reader)
        stats, listings = metadata_requests(dataset.file, "StatMany"), metadata_requests(dataset.file, "Readdir")
        got = []
        for start in range(0, FILES, 12):
            got += reader.stat_many(paths[start:start + 12])
        assert [a.size for a in got] == [len(_body(i)) for i in range(FILES)]
        assert all(a.layout is not None for a in got)  # what a ring needs to read them
        # One listing (again if its 5 s lease ran out on a slow machine; without this: 5 StatMany, 0 listings).
        assert metadata_requests(dataset.file, "StatMany") - stats <= 1
        assert 1 <= metadata_requests(dataset.file, "Readdir") - listings <= 2

        _change_files(dataset, 20)  # f20 rewritten in place (same size and mtime), f21 longer, f24 0600
        with dataset.client() as c:
            c.remove("/data/f30")
        again = reader.stat_many(paths)
        assert isinstance(again[30], FileNotFoundError)
        assert again[20].mtime_ns == got[20].mtime_ns and again[20].ctime_ns != got[20].ctime_ns
        assert again[21].size == len(_body(21)) + 6
        assert again[24].mode & 0o777 == 0o600
        assert [a.size for k, a in enumerate(again) if k not in (21, 30)] == \
            [len(_body(i)) for i in range(FILES) if i not in (21, 30)]


def test_a_batch_fetches_a_few_listings_at_most(metered_cluster: Any) -> None:
    """A batch spread over many directories fetches the listings of those it misses most,
    ``BATCH_LISTINGS`` at most, and asks the service for the rest in one ``StatMany``."""
    dirs = _client.BATCH_LISTINGS + 3
    with metered_cluster.client() as c:
        for d in range(dirs):
            c.makedirs(f"/many/d{d}")
            for i in range(d + 2):  # d0 holds 2 files, the last d{dirs-1} the most
                c.write_bytes(f"/many/d{d}/f{i}", _body(i))
            c.write_bytes(f"/many/d{d}/unasked", b"u")
    paths = [f"/many/d{d}/f{i}" for d in range(dirs) for i in range(d + 2)]
    with metered_cluster.client() as reader:
        _watching(reader)
        stats, listings = metadata_requests(metered_cluster.file, "StatMany"), metadata_requests(metered_cluster.file, "Readdir")
        got = reader.stat_many(paths)
        assert [a.size for a in got] == [len(_body(int(p.rsplit("f", 1)[1]))) for p in paths]
        assert metadata_requests(metered_cluster.file, "Readdir") - listings == _client.BATCH_LISTINGS
        assert metadata_requests(metered_cluster.file, "StatMany") - stats == 1  # the 3 directories with fewest
        cache = reader._core.lease_cache()  # a file no one asked for is known from its listing only
        known = [d for d in range(dirs) if cache.get(f"/many/d{d}/unasked", leased=True) is not None]
        assert known == list(range(dirs - _client.BATCH_LISTINGS, dirs))


def test_a_listing_of_several_pages_is_kept_page_by_page(metered_cluster: Any) -> None:
    """A directory of three pages (``LISTING_PAGE`` entries each): its opens are answered
    from the listing, each page under its own lease, and another client's change to a file
    of the last page is seen by the next open."""
    big = 2 * _attrcache.LISTING_PAGE + 40
    with metered_cluster.client() as c:
        c.makedirs("/data")
        for i in range(big):
            c.write_bytes(f"/data/f{i}", _body(i))
    with metered_cluster.client() as reader:
        resolves = metadata_requests(metered_cluster.file, "Resolve")
        listings = metadata_requests(metered_cluster.file, "Readdir")
        for i in range(big):
            assert _read(reader, f"/data/f{i}") == _body(i)
        resolved = metadata_requests(metered_cluster.file, "Resolve") - resolves
        listed = metadata_requests(metered_cluster.file, "Readdir") - listings
        assert resolved <= big // 10, f"{resolved:.0f} Resolve requests for {big} files"
        assert 3 <= listed <= 30, listed  # 3 pages (again if a 5 s lease ran out)
        last = sorted(f"f{i}" for i in range(big))[-1]  # on the last page: "f999"
        k = int(last[1:]) - 4
        _change_files(metered_cluster, k)  # f{k}, f{k+1}, f{k+4} ("f995", "f996", "f999")
        assert _read(reader, f"/data/f{k}") == _body(k).upper()
        assert reader.stat(f"/data/f{k + 1}").size == len(_body(k + 1)) + 6
        assert reader.stat(f"/data/f{k + 4}").mode & 0o777 == 0o600


def test_another_clients_changes_show_at_once(dataset: Any) -> None:
    half = FILES // 2
    with dataset.client() as reader:
        for i in range(half):  # the listing is leased: the other half is known, never opened
            assert _read(reader, f"/data/f{i}") == _body(i)
        resolves = metadata_requests(dataset.file, "Resolve")
        assert reader.stat(f"/data/f{half + 3}").size == len(_body(half + 3))
        assert metadata_requests(dataset.file, "Resolve") == resolves  # answered from the listing

        # Files changed in place (no name changes: the files' keys alone take it back).
        for k in (half + 3, 3):
            _change_files(dataset, k)
            assert _read(reader, f"/data/f{k}") == _body(k).upper()
            assert reader.stat(f"/data/f{k + 1}").size == len(_body(k + 1)) + 6
            assert _read(reader, f"/data/f{k + 1}") == _body(k + 1) + b"longer"
            assert reader.stat(f"/data/f{k + 4}").mode & 0o777 == 0o600

        for i in range(FILES):  # the listing leased again
            reader.stat(f"/data/f{i}")
        with dataset.client() as c:  # then names
            c.remove("/data/f5")
            c.rename("/data/f6", "/data/f6b")
            c.write_bytes("/data/new", b"new")
        for path in ("/data/f5", "/data/f6"):
            with pytest.raises(StripefsError) as e:
                reader.stat(path)
            assert e.value.code == ErrorCode.NOT_FOUND
        assert _read(reader, "/data/f6b") == _body(6)
        assert _read(reader, "/data/new") == b"new"
        for i in range(FILES):  # the others, unchanged
            if i % half not in (3, 4, 5, 6, 7):
                assert _read(reader, f"/data/f{i}") == _body(i)


def test_the_clients_own_changes_show_at_once(dataset: Any) -> None:
    with dataset.client() as c:
        for i in range(FILES):
            assert _read(c, f"/data/f{i}") == _body(i)
        with c.open("/data/f10", "r+b") as f:
            f.write(b"REWRITTEN")
        c.rename("/data/f11", "/data/f11b")
        c.remove("/data/f12")
        assert _read(c, "/data/f10") == b"REWRITTEN" + _body(10)[9:]
        assert not c.exists("/data/f11") and _read(c, "/data/f11b") == _body(11)
        assert not c.exists("/data/f12")
        for i in range(FILES):  # leased again
            if i not in (10, 11, 12):
                c.stat(f"/data/f{i}")
        with dataset.client() as other:
            other.write_bytes("/data/f13", b"changed elsewhere")
        assert _read(c, "/data/f13") == b"changed elsewhere"


def test_a_directory_is_listed_again_no_sooner_than_its_lease_could_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory whose files keep changing elsewhere loses its listing's lease at once
    (or gets none): it is fetched again at most once per REFETCH_AFTER, not every 2 opens."""
    now = [1000.0]
    monkeypatch.setattr(_attrcache.time, "monotonic", lambda: now[0])
    streaks = _attrcache.DirStreaks()
    assert [streaks.hit("/d") for _ in range(2)] == [False, True]
    assert not streaks.hit("/d")  # in flight
    streaks.done("/d")
    assert [streaks.hit("/d") for _ in range(4)] == [False] * 4  # too soon
    now[0] += _attrcache.REFETCH_AFTER
    assert [streaks.hit("/d") for _ in range(2)] == [False, True]
    streaks.done("/d", too_big=True)
    now[0] += _attrcache.REFETCH_AFTER
    assert [streaks.hit("/d") for _ in range(3)] == [False] * 3  # more than a page: left alone longer
    assert [streaks.hit("/e") for _ in range(2)] == [False, True]  # each directory on its own


def test_a_parent_renamed_elsewhere_takes_the_files_of_a_listing_back(dataset: Any) -> None:
    """The listing's lease is on inodes; the paths its files are kept under also rest on
    every name on the way to the directory (the directory's own entry's lease)."""
    with dataset.client() as c:
        c.makedirs("/top/data")
        for i in range(8):
            c.write_bytes(f"/top/data/g{i}", _body(i))
    with dataset.client() as reader:
        for i in range(4):  # the listing is leased: g4..g7 are known, never opened
            assert _read(reader, f"/top/data/g{i}") == _body(i)
        resolves = metadata_requests(dataset.file, "Resolve")
        assert reader.stat("/top/data/g5").size == len(_body(5))
        assert metadata_requests(dataset.file, "Resolve") == resolves  # from the listing
        with dataset.client() as c:
            c.rename("/top", "/moved")
        for path in ("/top/data/g5", "/top/data/g6", "/top/data/g1"):
            with pytest.raises(StripefsError) as e:
                reader.stat(path)
            assert e.value.code == ErrorCode.NOT_FOUND, path
        assert _read(reader, "/moved/data/g6") == _body(6)
