"""Lookups answered from a leased listing (``fsclient/fuse/_leaseddirs.py``): files read
one after another from one directory cost the metadata service a listing, not a lookup
each; and whatever another client changes there -- a file's bytes (same size, mtime put
back, as ``cp -p`` does), its length, a removal, a rename, a new name -- is seen through
the mount at once all the same (the change takes the listing's lease back first)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from ..conftest import metadata_requests as _requests, change_files_elsewhere as _change_files, listing_body as _body
from stripefs.fsclient.fuse._leaseddirs import PAGE

from .conftest import do_mount, do_umount, until_mount_leases

FILES = 60
BIG = 2 * PAGE + 40


@pytest.fixture
def dataset(metered_cluster: Any, tmp_path: Any) -> Iterator[tuple[Any, str]]:
    """A metered one-server cluster with ``/data/f0..`` made by a native client, mounted
    with no kernel caching of unleased answers (``attr_timeout=0,entry_timeout=0``), once
    the mount's lease watch is live: whatever the kernel answers by itself here, it holds
    under a lease, so "seen at once" checks the leases and nothing else (with the default
    1 s timeouts, an answer given before the watch was live, under a loaded machine, may
    be kept stale for that second by design)."""
    yield from _mounted(metered_cluster, tmp_path, FILES)


@pytest.fixture
def big_dataset(metered_cluster: Any, tmp_path: Any) -> Iterator[tuple[Any, str]]:
    """As ``dataset``, with a listing of three pages (``_leaseddirs.PAGE`` entries each)."""
    yield from _mounted(metered_cluster, tmp_path, BIG)


def _mounted(cluster: Any, tmp_path: Any, files: int) -> Iterator[tuple[Any, str]]:
    with cluster.client() as c:
        c.makedirs("/data")
        c.makedirs("/data/sub")
        for i in range(files):
            c.write_bytes(f"/data/f{i}", _body(i))
    mp = str(tmp_path / "mnt")
    do_mount(mp, cluster.file, "attr_timeout=0", "entry_timeout=0")
    try:
        until_mount_leases(cluster.file, f"{mp}/data/sub")
        yield cluster, mp
    finally:
        do_umount(mp)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_reading_a_directory_file_by_file_costs_one_listing(dataset: Any) -> None:
    cluster, mp = dataset
    lookups, listings = _requests(cluster.file, "Lookup"), _requests(cluster.file, "Readdir")
    for i in range(FILES):
        assert _read(f"{mp}/data/f{i}") == _body(i)
    looked_up = _requests(cluster.file, "Lookup") - lookups
    listed = _requests(cluster.file, "Readdir") - listings
    # Two lookups find files; the third fetches the directory's listing under a lease and
    # every other file's lookup is answered from it (a refetch if the 5 s lease ran out).
    assert looked_up <= 6, f"{looked_up:.0f} lookups for {FILES} files"
    assert 1 <= listed <= 3, listed
    assert os.path.isdir(f"{mp}/data/sub")  # a directory's lookup still asks the service


def test_another_clients_changes_show_at_once_through_a_leased_listing(dataset: Any) -> None:
    cluster, mp = dataset
    half = FILES // 2
    for i in range(half):  # the listing is leased; these entries are told to the kernel from it
        assert _read(f"{mp}/data/f{i}") == _body(i)
    lookups = _requests(cluster.file, "Lookup")
    for i in range(half):  # served again: the kernel's cache
        assert _read(f"{mp}/data/f{i}") == _body(i)
    assert _requests(cluster.file, "Lookup") - lookups <= 2

    # Files the kernel was not told of, whose lookups the daemon would answer from its
    # listing (half+3, ...), then files it was told of (3, ...): each change must show at
    # once. Changes to files only first (no name in the directory changes: the directory's
    # own key stays, the files' keys alone take the listing's lease back).
    for k in (half + 3, 3):
        _change_files(cluster, k)
        assert _read(f"{mp}/data/f{k}") == _body(k).upper()
        assert os.stat(f"{mp}/data/f{k + 1}").st_size == len(_body(k + 1)) + 6
        assert _read(f"{mp}/data/f{k + 1}") == _body(k + 1) + b"longer"
        assert os.stat(f"{mp}/data/f{k + 4}").st_mode & 0o777 == 0o600

    for i in range(half, FILES):  # the listing leased again
        if i != half + 3 and i != half + 4:
            _read(f"{mp}/data/f{i}")
    with cluster.client() as c:  # then names
        for k in (5, half + 5):
            c.remove(f"/data/f{k}")
        for k in (6, half + 6):
            c.rename(f"/data/f{k}", f"/data/f{k}b")
        c.write_bytes("/data/new", b"new")
    for k in (5, half + 5):
        assert not os.path.exists(f"{mp}/data/f{k}")
    for k in (6, half + 6):
        assert not os.path.exists(f"{mp}/data/f{k}")
        assert _read(f"{mp}/data/f{k}b") == _body(k)
    assert _read(f"{mp}/data/new") == b"new"
    for i in range(FILES):  # the others, unchanged
        if i % half not in (3, 4, 5, 6, 7):
            assert _read(f"{mp}/data/f{i}") == _body(i)


def test_a_listing_of_several_pages_is_fetched_and_taken_back_page_by_page(big_dataset: Any) -> None:
    """A directory of three pages: its files' lookups are answered from the listing, one
    page at a time under a lease each, and another client's change to a file of the second
    or the last page shows at once (that page's lease, which the kernel's entries of its
    files were told under, is taken back)."""
    cluster, mp = big_dataset
    lookups, listings = _requests(cluster.file, "Lookup"), _requests(cluster.file, "Readdir")
    for i in range(BIG):
        assert _read(f"{mp}/data/f{i}") == _body(i)
    looked_up = _requests(cluster.file, "Lookup") - lookups
    listed = _requests(cluster.file, "Readdir") - listings
    # The listing's 3 pages take a while to fetch, and the lookups meanwhile ask the service;
    # a 5 s lease that runs out on a slow machine costs a refetch, and its lookups, again.
    assert looked_up <= BIG // 10, f"{looked_up:.0f} lookups for {BIG} files"
    assert 3 <= listed <= 30, listed
    at = {name: i for i, name in enumerate(sorted(f"f{i}" for i in range(BIG)))}  # the listing's order

    def on_page(page: int) -> int:  # a k whose files f{k}, f{k+1} and f{k+4} are all on that page
        return next(k for k in range(BIG - 4)
                    if all(page * PAGE <= at[f"f{k + j}"] < (page + 1) * PAGE for j in (0, 1, 4)))

    for k in (on_page(1), on_page(2)):  # the second page, the last
        _change_files(cluster, k)
        assert _read(f"{mp}/data/f{k}") == _body(k).upper()
        assert os.stat(f"{mp}/data/f{k + 1}").st_size == len(_body(k + 1)) + 6
        assert os.stat(f"{mp}/data/f{k + 4}").st_mode & 0o777 == 0o600


def test_the_mounts_own_changes_show_at_once(dataset: Any) -> None:
    cluster, mp = dataset
    for i in range(FILES):
        assert _read(f"{mp}/data/f{i}") == _body(i)
    with open(f"{mp}/data/f10", "wb") as f:
        f.write(b"rewritten here")
    os.rename(f"{mp}/data/f11", f"{mp}/data/f11b")
    os.unlink(f"{mp}/data/f12")
    assert _read(f"{mp}/data/f10") == b"rewritten here"
    assert not os.path.exists(f"{mp}/data/f11") and _read(f"{mp}/data/f11b") == _body(11)
    assert not os.path.exists(f"{mp}/data/f12")
    with cluster.client() as c:  # and another client sees them too
        assert c.read_bytes("/data/f10") == b"rewritten here"
        c.write_bytes("/data/f11b", b"changed elsewhere")  # the renamed entry is taken back as well
    assert _read(f"{mp}/data/f11b") == b"changed elsewhere"


async def _leasing(ops: Any, nursery: Any) -> None:
    """Start the daemon's operations ``ops`` (not mounted: called directly) in ``nursery``,
    and wait until its client's lease watch is live."""
    import trio

    ops.attach(nursery)
    kl = ops.kernel_leases
    assert kl is not None
    with trio.fail_after(30):
        while not kl.asking:
            await trio.sleep(0.05)


def test_the_lookup_that_calls_for_a_listing_does_not_wait_for_it(cluster: Any, testdir: str) -> None:
    """The lookup after which a directory is due for its listing answers at once; the
    listing is fetched in the background (a directory of thousands of files takes tens of
    milliseconds to list), and the lookups after it are answered from it."""
    import pyfuse3
    import trio

    from stripefs.fsclient.fuse._operations import StripeOperations

    client = cluster.client()
    try:
        for i in range(3):
            client.write_bytes(f"{testdir}/f{i}", _body(i))
        parent = client.stat(testdir).ino
        ops = StripeOperations(client)
        ctx = pyfuse3.RequestContext()

        async def main() -> None:
            async with trio.open_nursery() as nursery:
                await _leasing(ops, nursery)
                await ops.lookup(parent, b"f0", ctx)
                await ops.lookup(parent, b"f1", ctx)  # the second in a row: the listing is due
                assert parent not in ops.leased_dirs.dirs  # ... and this lookup did not wait for it
                with trio.fail_after(30):
                    while parent not in ops.leased_dirs.dirs:
                        await trio.sleep(0.01)
                assert ops._from_listing(parent, b"f2", "f2").st_ino == client.stat(f"{testdir}/f2").ino
                nursery.cancel_scope.cancel()

        trio.run(main)
    finally:
        client.close()


@pytest.mark.parametrize("files", [12, PAGE + 12], ids=["one-page", "two-pages"])
def test_lookups_that_come_while_the_listing_is_fetched_wait_for_it(metered_cluster: Any, files: int) -> None:
    """The lookups of a directory's files that come while its listing is in flight wait
    for its first page and are answered from it, without a round trip each (at a
    dataloader's start they raced the listing for the same CPUs and were the slowest files
    of the run); a name the listing lacks, or a subdirectory, is then asked of the service.
    A listing of more pages lets its waiters go at its first page: they are answered all
    the same, from the service or from the listing."""
    import errno

    import pyfuse3
    import trio

    from stripefs.fsclient.fuse._operations import StripeOperations

    client = metered_cluster.client()
    try:
        client.makedirs("/w/sub")
        for i in range(files):
            client.write_bytes(f"/w/f{i}", _body(i))
        parent = client.stat("/w").ino
        inos = {i: client.stat(f"/w/f{i}").ino for i in (*range(2, 10), files - 1)}
        ops = StripeOperations(client)
        ctx = pyfuse3.RequestContext()
        found: dict[int, int] = {}

        async def look(i: int) -> None:
            found[i] = (await ops.lookup(parent, f"f{i}".encode(), ctx)).st_ino

        async def main() -> None:
            async with trio.open_nursery() as nursery:
                await _leasing(ops, nursery)
                await ops.lookup(parent, b"f0", ctx)
                before = _requests(metered_cluster.file, "Lookup")
                await ops.lookup(parent, b"f1", ctx)  # the listing is due, fetched in a task of its own
                assert parent in ops.leased_dirs.pending
                with trio.fail_after(30):
                    async with trio.open_nursery() as waiters:  # these come while it is in flight
                        for i in (*range(2, 10), files - 1):
                            waiters.start_soon(look, i)
                asked = _requests(metered_cluster.file, "Lookup") - before - 1
                assert found == inos
                if files <= PAGE:
                    assert asked == 0, f"{asked:.0f} of 9 lookups went to the service"
                    assert parent in ops.leased_dirs.dirs and not ops.leased_dirs.pending
                with pytest.raises(pyfuse3.FUSEError) as missing:  # not in the listing: the service says
                    await ops.lookup(parent, b"nothing-here", ctx)
                assert missing.value.errno == errno.ENOENT
                assert (await ops.lookup(parent, b"sub", ctx)).st_ino == client.stat("/w/sub").ino
                nursery.cancel_scope.cancel()

        trio.run(main)
    finally:
        client.close()
