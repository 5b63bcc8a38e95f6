"""Directory listings the daemon keeps and serves again (docs/fuse.md, "Listings"): a
listing within the timeouts needs no metadata round trip, yet this mount's own changes
show in the next listing at once, another client's within the timeouts, and a kept
listing never hands the kernel attributes older than it was told since."""

from __future__ import annotations

import os
import random
import stat
import time
from collections.abc import Callable, Iterator

import pytest
import trio
from trio.testing import MockClock

from stripefs.fsclient import Client
from stripefs.fsclient.fuse._listings import Listings, Page
from stripefs.fsclient.testing import LocalCluster
from stripefs.fsclient.testing.procs import while_paused
from stripefs.wire import DirEntry

from .conftest import do_mount, do_umount

pytestmark = pytest.mark.fuse

LONG = 30.0  # the private mount's timeouts: long enough that nothing expires within a test
ATTR_TIMEOUT = 1.0  # the shared mount's (the default)


class Private:
    """A private one-server cluster mounted with long timeouts; one directory per test."""

    def __init__(self, cluster: LocalCluster, mnt: str):
        self.cluster, self.mnt = cluster, mnt
        self.client = cluster.client()
        self.n = 0

    def fresh(self) -> tuple[str, str]:
        """A new directory: (its path for the client, the same seen through the mount)."""
        self.n += 1
        path = f"/d{self.n}"
        self.client.mkdir(path)
        return path, self.mnt + path

    def metadata_pid(self) -> int:
        return int(self.cluster.data["metadata"]["pid"])


@pytest.fixture(scope="module")
def private(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Private]:
    cluster = LocalCluster.start(str(tmp_path_factory.mktemp("listings-cluster")), servers=1, chunk_size=256 * 1024)
    mnt = str(tmp_path_factory.mktemp("listings-mnt"))
    try:
        do_mount(mnt, cluster.file, f"attr_timeout={LONG}", f"entry_timeout={LONG}")
        p = Private(cluster, mnt)
        yield p
        p.client.close()
    finally:
        do_umount(mnt)
        cluster.down()


def _listdir_paused(pid: int, path: str, wait: float) -> list[str] | None:
    """List ``path`` while process ``pid`` is stopped; None if that took over ``wait`` s."""
    return while_paused(pid, lambda: sorted(os.listdir(path)), wait)


def test_a_listing_within_the_timeouts_needs_no_metadata_round_trip(private: Private) -> None:
    path, d = private.fresh()
    names = [f"f{k:03d}" for k in range(40)]
    for n in names:
        private.client.write_bytes(f"{path}/{n}", b"")
    assert sorted(os.listdir(d)) == names  # fetched from the service, and kept
    # The metadata service stops answering: the next listing is served from the kept one.
    assert _listdir_paused(private.metadata_pid(), d, wait=5.0) == names


def test_own_changes_show_in_the_next_listing_at_once(private: Private) -> None:
    path, d = private.fresh()
    os.mkdir(f"{d}/other")
    for n in ("a", "b", "c"):
        private.client.write_bytes(f"{path}/{n}", b"x")

    def listing() -> list[str]:
        return sorted(os.listdir(d))

    def check(want: list[str]) -> None:
        assert listing() == want
        assert sorted(private.client.listdir(path)) == want

    check(["a", "b", "c", "other"])
    assert os.listdir(f"{d}/other") == []  # kept too
    os.close(os.open(f"{d}/new", os.O_CREAT | os.O_WRONLY, 0o644))
    check(["a", "b", "c", "new", "other"])
    os.unlink(f"{d}/a")
    check(["b", "c", "new", "other"])
    os.mkdir(f"{d}/sub")
    check(["b", "c", "new", "other", "sub"])
    os.rmdir(f"{d}/sub")
    check(["b", "c", "new", "other"])
    os.rename(f"{d}/b", f"{d}/b2")
    check(["b2", "c", "new", "other"])
    os.rename(f"{d}/c", f"{d}/other/c")  # both directories' kept listings
    check(["b2", "new", "other"])
    assert os.listdir(f"{d}/other") == ["c"]
    os.symlink("b2", f"{d}/ln")
    os.link(f"{d}/new", f"{d}/hard")
    os.mkfifo(f"{d}/fifo")
    check(["b2", "fifo", "hard", "ln", "new", "other"])
    with open(f"{d}/new", "wb") as f:  # an existing name, opened with O_TRUNC: no new name
        f.write(b"")
    check(["b2", "fifo", "hard", "ln", "new", "other"])


def test_own_attribute_changes_are_not_taken_back_by_a_kept_listing(private: Private) -> None:
    """Every entry of a listing carries attributes the kernel takes (READDIRPLUS): a kept
    listing served after this mount changed a file must not hand it the old ones."""
    path, d = private.fresh()
    private.client.write_bytes(f"{path}/f", b"12345")
    f = f"{d}/f"

    def after_listing() -> os.stat_result:
        os.listdir(d)
        return os.stat(f)

    assert after_listing().st_size == 5
    os.chmod(f, 0o600)
    assert stat.S_IMODE(after_listing().st_mode) == 0o600
    with open(f, "ab") as fh:
        fh.write(b"678")
    time.sleep(0.2)  # release is asynchronous to close()
    assert after_listing().st_size == 8
    os.truncate(f, 2)
    assert after_listing().st_size == 2
    os.utime(f, ns=(1_000_000_000, 2_000_000_000))
    assert after_listing().st_mtime_ns == 2_000_000_000
    os.setxattr(f, "user.k", b"v")
    assert after_listing().st_ctime_ns == private.client.stat(f"{path}/f").ctime_ns
    os.link(f, f"{d}/g")
    assert after_listing().st_nlink == 2
    os.unlink(f"{d}/g")
    assert after_listing().st_nlink == 1
    with open(f, "wb") as fh:  # O_TRUNC of an existing file, then written
        fh.write(b"abc")
    time.sleep(0.2)
    st = after_listing()
    want = private.client.stat(f"{path}/f")
    assert (st.st_size, st.st_mtime_ns) == (3, want.mtime_ns)


def test_a_kept_listing_does_not_take_back_newer_attributes_seen_since(private: Private) -> None:
    """Another client rewrote a file; this mount saw the new size (an open fetches it); a
    listing served from before the rewrite must not hand the kernel the old size again."""
    path, d = private.fresh()
    private.client.write_bytes(f"{path}/f", b"old")
    assert os.listdir(d) == ["f"] and os.stat(f"{d}/f").st_size == 3
    private.client.write_bytes(f"{path}/f", b"newer bytes")
    with open(f"{d}/f", "rb") as fh:  # close-to-open: fresh attributes, the kernel's dropped
        assert fh.read() == b"newer bytes"
    assert os.stat(f"{d}/f").st_size == 11
    assert os.listdir(d) == ["f"]
    assert os.stat(f"{d}/f").st_size == 11


def test_another_clients_create_and_unlink_show_within_the_timeouts(mdir: str, client: Client, testdir: str) -> None:
    """The shared mount (1 s timeouts): another client's changes show in a listing at most
    the attribute timeout after this mount listed the directory."""
    client.write_bytes(f"{testdir}/old", b"")
    assert os.listdir(mdir) == ["old"]
    client.write_bytes(f"{testdir}/new", b"")
    client.unlink(f"{testdir}/old")
    changed = time.monotonic()
    while os.listdir(mdir) != ["new"]:
        assert time.monotonic() - changed < ATTR_TIMEOUT + 0.5, "another client's change did not show in time"
        time.sleep(0.02)



def _exists(client: Client, path: str) -> bool:
    try:
        client.lstat(path)
        return True
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("seed", [1, 2])
def test_random_own_changes_always_show_in_the_next_listing_and_stat(private: Private, seed: int) -> None:
    """A seeded run of this mount's own changes over two directories; after each, both
    listings and every entry's attributes (taken by the kernel from the listing) are the
    service's. With 30 s timeouts, any change that failed to drop a kept page shows."""
    rng = random.Random(seed)
    path, d = private.fresh()
    os.mkdir(f"{d}/s")
    dirs = [("", d), ("/s", f"{d}/s")]
    names = ["a", "b", "c", "d"]

    def some() -> tuple[str, str]:
        sub, local = rng.choice(dirs)
        name = rng.choice(names)
        return f"{path}{sub}/{name}", f"{local}/{name}"

    def apply() -> None:
        remote, local = some()
        there = os.path.lexists(local)
        assert there == _exists(private.client, remote), f"seed {seed}: {remote}"  # "no such name" from memory
        isfile = there and stat.S_ISREG(os.lstat(local).st_mode)
        op = rng.choice(["create", "append", "unlink", "mkdir", "rename", "link", "symlink", "chmod", "truncate",
                         "utime", "xattr"])
        if op == "create" and not there:
            os.close(os.open(local, os.O_CREAT | os.O_WRONLY, 0o644))
        elif op == "append" and (isfile or not there):
            with open(local, "ab") as f:
                f.write(os.urandom(rng.randrange(1, 3000)))
        elif op == "unlink" and there:
            if stat.S_ISDIR(os.lstat(local).st_mode):
                if not os.listdir(local):
                    os.rmdir(local)
            else:
                os.unlink(local)
        elif op == "mkdir" and not there:
            os.mkdir(local)
        elif op == "rename" and there and not stat.S_ISDIR(os.lstat(local).st_mode):
            _, target = some()
            if not os.path.isdir(target):
                os.rename(local, target)
        elif op == "link" and isfile:
            _, target = some()
            if not os.path.lexists(target):
                os.link(local, target)
        elif op == "symlink" and not there:
            os.symlink("a", local)
        elif op == "chmod" and isfile:
            os.chmod(local, rng.choice([0o600, 0o640, 0o644, 0o755]))
        elif op == "truncate" and isfile:
            os.truncate(local, rng.randrange(0, 5000))
        elif op == "utime" and isfile:
            os.utime(local, ns=(rng.randrange(1 << 40), rng.randrange(1 << 40)))
        elif op == "xattr" and isfile:
            os.setxattr(local, "user.k", os.urandom(4))

    for _ in range(60):
        apply()
        for sub, local in dirs:
            if not os.path.isdir(local):
                continue
            listed = sorted(os.listdir(local))
            assert listed == sorted(private.client.listdir(path + sub)), f"seed {seed}"
            for name in listed:
                got, want = os.lstat(f"{local}/{name}"), private.client.lstat(f"{path}{sub}/{name}")
                assert (got.st_mode, got.st_nlink, got.st_mtime_ns, got.st_ctime_ns) == (
                    want.mode, want.nlink, want.mtime_ns, want.ctime_ns), f"seed {seed}: {sub}/{name}"
                if stat.S_ISREG(got.st_mode):
                    assert got.st_size == want.size, f"seed {seed}: {sub}/{name}"

# -- "no such name" from the names this mount knows -------------------------------------------
def _exists_paused(pid: int, paths: list[str], wait: float) -> list[bool] | None:
    """``os.path.exists`` of each path while process ``pid`` is stopped; None if that
    took over ``wait`` s."""
    return while_paused(pid, lambda: [os.path.exists(p) for p in paths], wait)


def test_a_name_missing_from_a_directory_made_or_listed_here_needs_no_round_trip(private: Private) -> None:
    """The lookup the kernel sends before every create is answered from the names this
    mount knows: those of a directory it made, or listed in full, with its own changes."""
    os.mkdir(f"{private.mnt}/made")
    path, listed = private.fresh()
    private.client.write_bytes(f"{path}/there", b"")
    assert os.listdir(listed) == ["there"]
    for k in range(3):  # this mount's own creates and removals keep the names right
        os.close(os.open(f"{private.mnt}/made/f{k}", os.O_CREAT | os.O_WRONLY, 0o644))
    os.unlink(f"{private.mnt}/made/f1")
    paths = [f"{private.mnt}/made/new", f"{private.mnt}/made/f1", f"{listed}/new", f"{listed}/there",
             f"{private.mnt}/made/f0"]
    assert _exists_paused(private.metadata_pid(), paths, wait=5.0) == [False, False, False, True, True]


def test_another_clients_new_name_in_a_directory_made_here(mdir: str, client: Client, testdir: str) -> None:
    """The shared mount (1 s timeouts): a name another client makes in a directory this
    mount made shows within the timeout; an exclusive create of it here fails at once,
    and a plain one opens the other client's file (the create goes to the service)."""
    os.mkdir(f"{mdir}/made")
    assert not os.path.exists(f"{mdir}/made/x")
    client.write_bytes(f"{testdir}/made/x", b"theirs")
    client.write_bytes(f"{testdir}/made/y", b"theirs too")
    with pytest.raises(FileExistsError):
        os.open(f"{mdir}/made/x", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    fd = os.open(f"{mdir}/made/x", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        assert os.read(fd, 100) == b"theirs"
    finally:
        os.close(fd)
    changed = time.monotonic()
    while not os.path.exists(f"{mdir}/made/y"):
        assert time.monotonic() - changed < ATTR_TIMEOUT + 0.5, "another client's new name did not show in time"
        time.sleep(0.02)


# -- the bookkeeping itself (no mount) --------------------------------------------------------
def _in_trio(fn: Callable[[MockClock], None]) -> None:
    clock = MockClock()

    async def main() -> None:
        fn(clock)

    trio.run(main, clock=clock)


def _page(names: list[str], more: bool = False) -> Page:
    return Page([DirEntry(n, k + 10, stat.S_IFREG | 0o644) for k, n in enumerate(names)], more, trio.current_time())


def test_kept_pages_expire_and_are_not_kept_across_a_change_in_flight() -> None:
    def check(clock: MockClock) -> None:
        kept = Listings(ttl=1.0)
        asked = kept.version
        kept.drop(99)  # a change of this mount while the listing was in flight
        kept.put(1, "", _page(["a"]), asked)
        assert kept.get(1, "") is None
        kept.put(1, "", _page(["a"]), kept.version)
        assert [e.name for e in kept.get(1, "").entries] == ["a"]  # type: ignore[union-attr]
        clock.jump(0.99)
        assert kept.get(1, "") is not None
        clock.jump(0.02)
        assert kept.get(1, "") is None and kept.entries == 0

    _in_trio(check)


def test_kept_pages_are_bounded() -> None:
    def check(clock: MockClock) -> None:
        kept = Listings(ttl=1.0)
        kept.MAX_ENTRIES = 10
        kept.put(1, "", _page([f"n{k}" for k in range(6)]), kept.version)
        kept.put(2, "", _page([f"n{k}" for k in range(6)]), kept.version)  # over the bound: the rest goes
        assert kept.get(1, "") is None and kept.get(2, "") is not None and kept.entries == 6
        kept.clear()
        assert kept.entries == 0 and not kept.pages

    _in_trio(check)


def test_known_names_answer_absent_names_for_the_rest_of_the_time() -> None:
    def check(clock: MockClock) -> None:
        kept = Listings(ttl=1.0)
        kept.put_names(1, {"a", "b"}, trio.current_time(), kept.version)
        assert kept.absent(1, "a") is None and kept.absent(2, "x") is None
        clock.jump(0.25)
        assert kept.absent(1, "x") == pytest.approx(0.75)
        kept.added(1, "x")
        kept.removed(1, "a")
        kept.drop(1)  # the pages go; the names stay, with this mount's changes
        assert kept.absent(1, "x") is None and kept.absent(1, "a") == pytest.approx(0.75)
        assert kept.named == 2
        clock.jump(0.75)
        assert kept.absent(1, "a") is None and kept.named == 0
        kept.put_names(3, set(), trio.current_time(), kept.version - 1)  # answered across a change: not kept
        assert kept.absent(3, "x") is None
        kept.put_names(3, set(), trio.current_time(), kept.version)
        kept.forget_names(3)
        assert kept.absent(3, "x") is None and kept.named == 0

    _in_trio(check)


def test_with_zero_timeouts_nothing_is_kept(cluster: LocalCluster, client: Client, testdir: str, tmp_path) -> None:
    """``-o attr_timeout=0``: every listing and every lookup asks the service."""
    mp = str(tmp_path / "m")
    do_mount(mp, cluster.file, "attr_timeout=0")
    try:
        d = mp + testdir
        os.mkdir(f"{d}/made")
        assert os.listdir(d) == ["made"]
        client.write_bytes(f"{testdir}/new", b"")
        client.write_bytes(f"{testdir}/made/x", b"")
        assert sorted(os.listdir(d)) == ["made", "new"]
        assert os.path.exists(f"{d}/made/x")
    finally:
        do_umount(mp)
