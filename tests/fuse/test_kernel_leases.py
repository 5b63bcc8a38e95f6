"""The mount holds attribute leases (docs/fuse.md, "Leases"): what it told the kernel under
a lease stays cached for the lease's lifetime with no metadata round trip, yet another
client's change is visible through the mount at the very next ``stat`` -- the service tells
the daemon, which takes it back from the kernel before the change returns.

A private one-server cluster with a short lease TTL, mounted with long timeouts: without
leases every such change would stay invisible for the whole timeout."""

from __future__ import annotations

import os
import queue
import signal
import stat
import threading
import time
from collections.abc import Iterator

import pytest

from stripefs.fsclient import Client
from stripefs.fsclient.core import pid_alive
from stripefs.fsclient.fuse import mount_record
from stripefs.fsclient.testing import LocalCluster
from stripefs.fsclient.testing.procs import pause, while_paused

from .conftest import do_mount, do_umount

pytestmark = pytest.mark.fuse

LONG = 30.0  # the mount's own timeouts: nothing expires by itself within a test
TTL = 2.0  # the service's lease TTL


class Private:
    def __init__(self, cluster: LocalCluster, mnt: str):
        self.cluster, self.mnt = cluster, mnt
        self.client = Client(cluster.file, leases=False)
        self.n = 0

    def fresh(self) -> tuple[str, str]:
        """A new directory with a file ``f`` (4 bytes): (its path for the client, through the mount)."""
        self.n += 1
        path = f"/k{self.n}"
        self.client.mkdir(path)
        self.client.write_bytes(path + "/f", b"1234")
        return path, self.mnt + path

    def metadata_pid(self) -> int:
        return int(self.cluster.data["metadata"]["pid"])


@pytest.fixture(scope="module")
def private(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Private]:
    cluster = LocalCluster.start(str(tmp_path_factory.mktemp("kleases-cluster")), servers=1,
                                 chunk_size=256 * 1024, lease_ttl=TTL)
    mnt = str(tmp_path_factory.mktemp("kleases-mnt"))
    try:
        do_mount(mnt, cluster.file, f"attr_timeout={LONG}", f"entry_timeout={LONG}")
        p = Private(cluster, mnt)
        _leasing(p)
        yield p
        p.client.close()
    finally:
        do_umount(mnt)
        cluster.down()


def _leasing(p: Private, timeout: float = 10.0) -> None:
    """Until the mount's lease watch is live: a stat, then a change by the client, then the
    stat through the mount sees it (before it is live, answers carry plain timeouts)."""
    d, md = p.fresh()
    deadline = time.monotonic() + timeout
    mode, seen = 0o644, 0  # the file's own mode: each round changes it
    while seen < 3:  # three in a row
        os.stat(md + "/f")
        mode ^= 0o044
        p.client.chmod(d + "/f", mode)
        seen = seen + 1 if stat.S_IMODE(os.stat(md + "/f").st_mode) == mode else 0
        assert time.monotonic() < deadline, "the mount's lease watch did not start"


def test_another_clients_chmod_shows_at_the_next_stat(private: Private) -> None:
    d, md = private.fresh()
    assert stat.S_IMODE(os.stat(md + "/f").st_mode) == 0o644
    private.client.chmod(d + "/f", 0o600)
    assert stat.S_IMODE(os.stat(md + "/f").st_mode) == 0o600


def test_another_clients_rename_and_unlink_show_at_the_next_stat(private: Private) -> None:
    d, md = private.fresh()
    private.client.write_bytes(d + "/g", b"gg")
    ino = os.stat(md + "/f").st_ino
    os.stat(md + "/g")
    private.client.rename(d + "/f", d + "/moved")
    assert not os.path.exists(md + "/f")
    assert os.stat(md + "/moved").st_ino == ino
    private.client.remove(d + "/g")
    assert not os.path.exists(md + "/g")


@pytest.mark.parametrize("kind", ["dir", "file"])
def test_a_name_this_mount_renamed_is_taken_back_when_another_client_renames_it(private: Private, kind: str) -> None:
    """The mount stats d1 (leased), renames it to d2; the client renames d2 to d3: the mount
    must see d2 gone at once (the service's lease stayed on the name d1, and the renaming
    mount is not told of its own change), and a file it makes in d2 must not land in d3."""
    d, md = private.fresh()
    if kind == "dir":
        private.client.mkdir(d + "/d1")
    else:
        private.client.write_bytes(d + "/d1", b"x")
    os.stat(md + "/d1")
    os.rename(md + "/d1", md + "/d2")
    time.sleep(0.05)  # the mount takes its moved entry back after its reply (asynchronously)
    private.client.rename(d + "/d2", d + "/d3")
    assert not os.path.exists(md + "/d2")
    assert os.path.exists(md + "/d3")
    if kind == "dir":
        with pytest.raises(FileNotFoundError):
            open(md + "/d2/new", "wb").close()
        assert private.client.listdir(d + "/d3") == []


def test_another_clients_write_shows_at_the_next_stat_and_read(private: Private) -> None:
    d, md = private.fresh()
    assert os.stat(md + "/f").st_size == 4
    private.client.write_bytes(d + "/f", b"0123456789")
    assert os.stat(md + "/f").st_size == 10
    with open(md + "/f", "rb") as fh:
        assert fh.read() == b"0123456789"


def test_a_repeated_stat_makes_no_round_trip(private: Private) -> None:
    d, md = private.fresh()
    first = os.stat(md + "/f")
    again = while_paused(private.metadata_pid(), lambda: os.stat(md + "/f"), wait=TTL / 4)
    assert again is not None, "a repeated stat waited for the (stopped) metadata service"
    assert again.st_ino == first.st_ino and again.st_mode == first.st_mode


def test_a_stopped_daemon_delays_a_change_by_at_most_the_ttl(private: Private) -> None:
    d, md = private.fresh()
    os.stat(md + "/f")
    pid = mount_record(private.mnt)["pid"]
    started = time.monotonic()
    pause(pid)
    try:
        private.client.chmod(d + "/f", 0o600)  # waits for the stopped daemon's lease to run out
        took = time.monotonic() - started
    finally:
        os.kill(pid, signal.SIGCONT)
    assert took < TTL + 1.5, f"the change waited {took:.1f} s for a {TTL} s lease"
    assert stat.S_IMODE(os.stat(md + "/f").st_mode) == 0o600


def test_a_broken_watch_takes_back_what_was_leased(make_cluster, tmp_path) -> None:
    """A restarted service knows no lease: the daemon's watch breaks, and what the kernel
    was told under a lease is taken back at once (here the lease outlives the test)."""
    h = make_cluster(servers=1, lease_ttl=30.0)
    mnt = str(tmp_path / "mnt")
    do_mount(mnt, h.file, f"attr_timeout={LONG}", f"entry_timeout={LONG}")
    try:
        with Client(h.file, leases=False) as writer:
            writer.write_bytes("/f", b"abc")
            p = Private(h, mnt)
            p.client.close()
            p.client = writer
            _leasing(p)
            os.stat(mnt + "/f")
            port, pid = h.data["metadata"]["port"], int(h.data["metadata"]["pid"])
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.02)
            h.up()  # the service again, on its port, with no memory of the leases
            if h.data["metadata"]["port"] != port:
                pytest.skip("the port was not free again (TIME_WAIT): the mount cannot reach the new service")
            writer.chmod("/f", 0o600)
            assert stat.S_IMODE(os.stat(mnt + "/f").st_mode) == 0o600
    finally:
        do_umount(mnt)


def test_a_name_made_elsewhere_shows_in_a_directory_listed_here(private: Private) -> None:
    """The names the daemon keeps of a listed directory (it answers "no such name" from
    them) go when a lease on the directory is invalidated."""
    d, md = private.fresh()
    assert sorted(os.listdir(md)) == ["f"]
    assert not os.path.exists(md + "/new")
    private.client.write_bytes(d + "/new", b"n")
    assert os.path.exists(md + "/new")
    assert sorted(os.listdir(md)) == ["f", "new"]


def test_a_create_in_a_directory_walked_through_here_does_not_wait_for_this_mount(private: Private) -> None:
    """Looking a directory up leases its entry, not its attributes: another client's create
    or unlink inside it (which changes them) waits for no mount that only walked through
    it, not even a stopped one. Yet the mount sees the names come and go at once."""
    d, md = private.fresh()
    private.client.write_bytes(d + "/g", b"g")
    os.stat(md + "/f")  # walks through d: looks it up, never lists it (nor looks g up)
    pid = mount_record(private.mnt)["pid"]
    pause(pid)
    try:
        started = time.monotonic()
        private.client.write_bytes(d + "/new", b"n")
        private.client.remove(d + "/g")
        took = time.monotonic() - started
    finally:
        os.kill(pid, signal.SIGCONT)
    assert took < TTL / 2, f"a create and an unlink in {d} waited {took:.1f} s for a mount that walked through it"
    assert os.path.exists(md + "/new")
    assert not os.path.exists(md + "/g")
    assert sorted(os.listdir(md)) == ["f", "new"]


def test_a_name_made_elsewhere_goes_from_the_kept_names_of_a_listed_directory(private: Private) -> None:
    """The listing lease: a directory listed here keeps its names (and answers "no such
    name" from them) only until another client changes it, however long the timeouts."""
    d, md = private.fresh()
    assert sorted(os.listdir(md)) == ["f"]
    for round_ in range(2):  # again once the first invalidation came and went
        name = f"new{round_}"
        assert not os.path.exists(md + "/" + name)
        private.client.write_bytes(f"{d}/{name}", b"n")
        assert os.path.exists(md + "/" + name)
        assert name in os.listdir(md)
    private.client.remove(d + "/new0")
    assert sorted(os.listdir(md)) == ["f", "new1"]
    assert not os.path.exists(md + "/new0")


def test_a_create_held_by_a_stopped_holder_delays_no_acknowledgement(make_cluster, tmp_path) -> None:
    """Issue 28, item 4: a native holder process is SIGSTOPped with a listing lease on d;
    the mount creates in d (the create waits for that holder) while it holds leases on d/f
    and e/g. Another client's chmods of those return long before the TTL -- the create
    waits for the holder's session, not its lease, and the mount's acknowledgements do not
    wait behind its kernel invalidations -- and the mount sees them at its next stat."""
    from tests.core.test_slow_holders import BOUND, TTL as SLOW_TTL, start_holder

    h = make_cluster(servers=1, lease_ttl=SLOW_TTL)
    mnt = str(tmp_path / "mnt")
    do_mount(mnt, h.file, f"attr_timeout={LONG}", f"entry_timeout={LONG}")
    try:
        with Client(h.file, leases=False) as writer:
            for path in ("/d/f", "/e/g"):
                writer.makedirs(os.path.dirname(path))
                writer.write_bytes(path, b"x")
            p = Private(h, mnt)
            p.client.close()
            p.client = writer
            _leasing(p)
            os.stat(mnt + "/d/f")
            os.stat(mnt + "/e/g")
            proc = start_holder(h.file, [], ["/d"])
            try:
                pause(proc.pid)
                try:
                    created: list[float] = []
                    creator = threading.Thread(target=lambda: (open(mnt + "/d/new", "wb").close(),
                                                               created.append(time.monotonic())), daemon=True)
                    started = time.monotonic()
                    creator.start()
                    writer.chmod("/d/f", 0o600)
                    writer.chmod("/e/g", 0o600)
                    took = time.monotonic() - started
                    creator.join(SLOW_TTL + 5)
                finally:
                    os.kill(proc.pid, signal.SIGCONT)
            finally:
                proc.kill()
                proc.wait()
            assert took < BOUND, f"two chmods took {took:.1f} s beside a create held by a stopped holder"
            assert created and created[0] - started < BOUND, "the mount's create waited for the holder's lease"
            assert stat.S_IMODE(os.stat(mnt + "/d/f").st_mode) == 0o600
            assert stat.S_IMODE(os.stat(mnt + "/e/g").st_mode) == 0o600
    finally:
        do_umount(mnt)


def test_a_blocked_kernel_invalidation_holds_back_only_its_own_leases(monkeypatch: pytest.MonkeyPatch) -> None:
    """``invalidate_entry`` waits for its directory's lock (held while one of the mount's
    own requests there is in flight): the leases of other directories, and those of
    attributes alone, are reported done meanwhile; the blocked one once it returns."""
    from stripefs.fsclient.fuse import _kernelleases

    gate = threading.Event()

    def entry(parent: int, name: bytes) -> None:
        if parent == 10:
            gate.wait(10)

    monkeypatch.setattr(_kernelleases.pyfuse3, "invalidate_entry", entry)
    monkeypatch.setattr(_kernelleases.pyfuse3, "invalidate_inode", lambda ino, attr_only=False: None)

    class Cache:
        leasing, invalidations, listener, sessions = True, 0, None, True

    cache = Cache()
    kl = _kernelleases.KernelLeases(cache, lambda inos: None)
    assert cache.listener is kl and cache.sessions is False  # a kernel's cache has no session
    later = time.monotonic() + 30
    kl._told.update({1: [(later, 10, b"f", 100)], 2: [(later, 20, b"g", 200)], 3: [(later, 0, b"", 300)],
                     # a listing's lease (directory 10's files): its own entry, and a lookup told from it
                     5: [(later, 0, b"", 10), (later, 10, b"h", 101)]})
    done: queue.Queue[list[int]] = queue.Queue()
    kl.invalidated([1, 2, 3, 4, 5], done.put)  # 4: nothing told under it
    got: set[int] = set()
    while got != {2, 3, 4}:
        got.update(done.get(timeout=5))
    time.sleep(0.2)
    assert done.empty()  # 1 still waits for its directory, and so does 5 (half of it is done)
    gate.set()
    got = set()
    while got != {1, 5}:
        got.update(done.get(timeout=5))
