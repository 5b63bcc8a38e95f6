"""The coherent attribute cache (``Client(leases=True)``, the default): a ``stat`` of a
path nobody changes is answered locally under a lease the metadata service granted, and
any client's change is visible to the holder's very next ``stat`` once it returned.

One private cluster with a short lease TTL (2 s), so a holder that cannot be told delays
a change briefly."""

from __future__ import annotations

import bisect
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from stripefs.fsclient import Client
from stripefs.fsclient.core import pid_alive
from stripefs.fsclient.testing import LocalCluster
from stripefs.fsclient.testing.procs import pause, while_paused
from tests.conftest import TEST_CHUNK

TTL = 2.0


@pytest.fixture(scope="module")
def lcluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    h = LocalCluster.start(str(tmp_path_factory.mktemp("leases")), servers=2, chunk_size=TEST_CHUNK, lease_ttl=TTL)
    yield h
    h.down()


def _watching(c: Client, timeout: float = 10.0) -> Client:
    """``c`` once its lease watch is live (its first stat starts it)."""
    c.stat("/")
    cache = c._core.attrs
    deadline = time.monotonic() + timeout
    while not (cache is not None and cache.leasing):
        assert time.monotonic() < deadline, "the lease watch did not start"
        time.sleep(0.01)
    return c


@pytest.fixture
def pair(lcluster: LocalCluster) -> Iterator[tuple[Client, Client, Client]]:
    """(holder, writer, plain): the holder caches under leases, ``plain`` never caches."""
    holder, writer = _watching(Client(lcluster.file)), Client(lcluster.file)
    plain = Client(lcluster.file, leases=False)
    yield holder, writer, plain
    for c in (holder, writer, plain):
        c.close()


_n = iter(range(1_000_000))


@pytest.fixture
def d(pair: tuple[Client, Client, Client]) -> str:
    path = f"/l{next(_n)}-{os.getpid()}"
    pair[1].makedirs(path)
    return path


def _leased(c: Client, path: str) -> Any:
    """Stat ``path`` until the answer is held under a lease; returns it."""
    for _ in range(50):
        attr = c.stat(path)
        cache = c._core.attrs
        assert cache is not None
        if cache.get(path, leased=True) is not None:
            return attr
        time.sleep(0.01)
    raise AssertionError(f"no lease on {path}")


def test_a_repeated_stat_needs_no_metadata_round_trip(lcluster: LocalCluster, pair, d: str) -> None:
    holder, writer, _ = pair
    writer.write_bytes(f"{d}/f", b"abc")
    first = _leased(holder, f"{d}/f")
    pid = int(lcluster.data["metadata"]["pid"])
    got = while_paused(pid, lambda: [holder.stat(f"{d}/f") for _ in range(100)], 2.0)  # a round trip would wait
    assert got == [first] * 100


def test_writing_new_files_keeps_the_other_leased_entries(lcluster: LocalCluster, pair, d: str) -> None:
    """A new file's commit (``CommitFiles``) and the reservations before it drop what they
    change, not the whole cache: a leased stat of another file stays a cache hit, and the
    new names show in the writer's own listing and stats at once."""
    holder, writer, _ = pair
    writer.write_bytes(f"{d}/f", b"abc")
    first = _leased(holder, f"{d}/f")
    assert holder.listdir(d) == ["f"]
    cache = holder._core.attrs
    expires, _, lease_id, _ = cache._by_path[f"{d}/f"]
    sent: list[str] = []
    core = holder._core
    real = core.call
    core.call = lambda msg, *a, **kw: (sent.append(type(msg).__name__), real(msg, *a, **kw))[1]  # type: ignore[method-assign]
    try:
        for k in range(5):
            with holder.open(f"{d}/new{k}", "wb") as f:
                f.write(b"x" * (k + 1))
            # The entry of f is still the leased one (on a machine slow enough for the 2 s
            # lease, or the 200 ms session, to lapse meanwhile, the stat below asks again:
            # timing, not the property tested here).
            entry = cache._by_path.get(f"{d}/f")
            assert (entry is not None and entry[2] == lease_id) or time.monotonic() >= expires, k
            assert holder.stat(f"{d}/f") == first
        if time.monotonic() < expires - TTL / 2:  # the usual case: none of it lapsed
            assert sent.count("Resolve") == 0, sent  # every stat of f answered from its lease
        assert holder.listdir(d) == ["f"] + [f"new{k}" for k in range(5)]
        assert [holder.stat(f"{d}/new{k}").size for k in range(5)] == [1, 2, 3, 4, 5]
    finally:
        del core.call


def _setup_file(w: Client, d: str) -> None:
    w.write_bytes(f"{d}/f", b"abc")


def _setup_sub(w: Client, d: str) -> None:
    w.makedirs(f"{d}/sub")
    w.write_bytes(f"{d}/sub/f", b"abc")


def _setup_both(w: Client, d: str) -> None:
    _setup_sub(w, d)
    w.write_bytes(f"{d}/f", b"x")


# (name, setup, the paths the holder stats before, the mutation by another client)
_CASES: list[tuple[str, Callable[[Client, str], None], list[str], Callable[[Client, str], Any]]] = [
    ("create", _setup_file, ["", "/f"], lambda w, d: w.write_bytes(f"{d}/new", b"")),
    ("create_many", _setup_file, ["", "/f"], lambda w, d: w.create_many([f"{d}/n1", f"{d}/n2"])),
    ("unlink", _setup_file, ["", "/f"], lambda w, d: w.remove(f"{d}/f")),
    ("unlink_many", _setup_file, ["", "/f"], lambda w, d: w.unlink_many([f"{d}/f"])),
    ("mkdir", _setup_file, ["", "/f"], lambda w, d: w.mkdir(f"{d}/dir")),
    ("rmdir", _setup_sub, ["", "/sub"], lambda w, d: (w.remove(f"{d}/sub/f"), w.rmdir(f"{d}/sub"))),
    ("rename", _setup_file, ["", "/f"], lambda w, d: w.rename(f"{d}/f", f"{d}/g")),
    ("rename over", _setup_both, ["/f", "/sub/f"], lambda w, d: w.rename(f"{d}/f", f"{d}/sub/f")),
    ("rename exchange", _setup_both, ["/f", "/sub/f"], lambda w, d: w.rename(f"{d}/f", f"{d}/sub/f", exchange=True)),
    ("rename parent", _setup_sub, ["/sub", "/sub/f"], lambda w, d: w.rename(f"{d}/sub", f"{d}/moved")),
    ("link", _setup_file, ["", "/f"], lambda w, d: w.link(f"{d}/f", f"{d}/hard")),
    ("symlink", _setup_file, ["", "/f"], lambda w, d: w.symlink(f"{d}/f", f"{d}/sym")),
    ("mknod", _setup_file, ["", "/f"], lambda w, d: w.mkfifo(f"{d}/fifo")),
    ("chmod", _setup_file, ["/f"], lambda w, d: w.chmod(f"{d}/f", 0o600)),
    ("chown", _setup_file, ["/f"], lambda w, d: w.chown(f"{d}/f", 123, 456)),
    ("utime", _setup_file, ["/f"], lambda w, d: w.utime(f"{d}/f", (1, 2))),
    ("truncate", _setup_file, ["/f"], lambda w, d: w.truncate(f"{d}/f", 1)),
    ("write and close", _setup_file, ["/f"], lambda w, d: w.write_bytes(f"{d}/f", b"abcdefgh")),
    ("append", _setup_file, ["/f"], lambda w, d: w.open(f"{d}/f", "ab").close() or _append(w, f"{d}/f")),
    ("setxattr", _setup_file, ["/f"], lambda w, d: w.setxattr(f"{d}/f", "user.k", b"v")),
    ("removexattr", _setup_file, ["/f"], lambda w, d: (w.setxattr(f"{d}/f", "user.k", b"v"),
                                                        w.removexattr(f"{d}/f", "user.k"))),
]


def _append(w: Client, path: str) -> None:
    with w.open(path, "ab") as f:
        f.write(b"more")


def _fresh(plain: Client, path: str) -> Any:
    try:
        return plain.stat(path)
    except FileNotFoundError:
        return None


def _cached(holder: Client, path: str) -> Any:
    try:
        return holder.stat(path)
    except FileNotFoundError:
        return None


@pytest.mark.parametrize("case", _CASES, ids=[c[0] for c in _CASES])
def test_another_clients_change_is_seen_by_the_next_stat(pair, d: str, case) -> None:
    _name, setup, rels, mutate = case
    holder, writer, plain = pair
    setup(writer, d)
    paths = [d + r for r in rels]
    before = {p: _leased(holder, p) for p in paths}
    mutate(writer, d)  # returned: every holder was told (or its lease ran out)
    after = {p: _cached(holder, p) for p in paths}
    assert after == {p: _fresh(plain, p) for p in paths}
    assert after != before  # the mutation changed what was cached (else the case tests nothing)


def _holding(lcluster: LocalCluster, path: str) -> str:
    """The start of a holder process's script: a client whose watch is live, holding a
    lease on ``path`` (exits with "no lease" when none comes); ``c``, ``p`` for the rest."""
    return ("import sys, time\n"
            "from fsclient import Client\n"
            f"c = Client({lcluster.file!r})\n"
            "c.stat('/')\n"
            "while not c._core.attrs.leasing: time.sleep(0.01)\n"
            f"p = {path!r}\n"
            "for _ in range(50):\n"
            "    c.stat(p)\n"
            "    if c._core.attrs.get(p, leased=True) is not None: break\n"
            "    time.sleep(0.01)\n"
            "else: raise SystemExit('no lease')\n")


def test_a_stopped_holder_delays_a_change_briefly_and_serves_nothing_stale(lcluster: LocalCluster, pair,
                                                                           d: str) -> None:
    """A stopped holder delays a change by its session at most (tests/core/test_slow_holders.py
    bounds it against a long TTL); once resumed, it never answers from its old entry."""
    _, writer, plain = pair
    writer.write_bytes(f"{d}/f", b"abc")
    script = _holding(lcluster, f"{d}/f") + ("print('held', oct(c.stat(p).mode), flush=True)\n"
                                             "sys.stdin.readline()\n"
                                             "print('after', oct(c.stat(p).mode), flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=os.getcwd())
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().split() == ["held", "0o100644"]
        pause(proc.pid)
        try:
            t = time.monotonic()
            writer.chmod(f"{d}/f", 0o600)
            took = time.monotonic() - t
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        assert took < TTL + 3.0  # not for ever (a loaded machine)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().split() == ["after", "0o100600"]  # never the stale entry
        assert plain.stat(f"{d}/f").mode & 0o777 == 0o600
    finally:
        proc.kill()
        proc.wait()


def test_a_stat_never_goes_back_behind_a_completed_change(pair, d: str) -> None:
    """Stats hammered on the holder while another client changes the same file: a stat
    that began after a change returned never shows an older value."""
    holder, writer, _ = pair
    p = f"{d}/f"
    writer.write_bytes(p, b"")
    done: list[tuple[float, int]] = []  # (monotonic time the change returned, the mtime it set)
    seen: list[tuple[float, int]] = []  # (monotonic time a stat began, the mtime it saw)
    stop = threading.Event()

    def hammer() -> None:
        while not stop.is_set():
            t = time.monotonic()
            seen.append((t, holder.stat(p).mtime_ns))

    threads = [threading.Thread(target=hammer, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for k in range(1, 41):
            writer.utime(p, (k, k))
            done.append((time.monotonic(), k))
            time.sleep(0.005)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert len(seen) > 40
    returned = [at for at, _ in done]  # increasing, as the values set
    for began, value in seen:
        floor = bisect.bisect_left(returned, began)  # changes that returned before the stat began
        assert value >= floor, f"a stat begun after mtime {floor} was set saw {value}"
    assert holder.stat(p).mtime_ns == 40


def test_open_uses_a_leased_entry_and_sees_new_bytes(pair, d: str) -> None:
    holder, writer, _ = pair
    p = f"{d}/f"
    writer.write_bytes(p, b"abc")
    _leased(holder, p)
    writer.write_bytes(p, b"abcdef")
    with holder.open(p, "rb") as f:
        assert f.read() == b"abcdef"


def test_no_leases_without_asking(pair, d: str) -> None:
    _, writer, plain = pair
    writer.write_bytes(f"{d}/f", b"abc")
    for _ in range(3):
        plain.stat(f"{d}/f")
    assert plain._core.attrs is None  # leases=False, attr_timeout 0: nothing cached


def test_a_service_with_ttl_0_grants_none(make_cluster) -> None:
    h = make_cluster(servers=1, lease_ttl=0)
    with Client(h.file) as a, Client(h.file) as b:
        a.write_bytes("/f", b"abc")
        for _ in range(20):
            b.stat("/f")
            time.sleep(0.01)
        cache = b._core.attrs
        assert cache is not None and not cache.leasing and cache.get("/f") is None
        a.write_bytes("/f", b"abcdef")
        assert b.stat("/f").size == 6


def test_a_closed_holder_does_not_delay_a_change(lcluster: LocalCluster, pair, d: str) -> None:
    _, writer, plain = pair
    writer.write_bytes(f"{d}/f", b"abc")
    holder = _watching(Client(lcluster.file))
    _leased(holder, f"{d}/f")
    holder.close()  # tells the service its leases are gone
    script = _holding(lcluster, f"{d}/f")  # exits without closing the client
    subprocess.run([sys.executable, "-c", script], check=True, timeout=30, cwd=os.getcwd())
    t = time.monotonic()
    writer.chmod(f"{d}/f", 0o600)
    assert time.monotonic() - t < TTL / 2  # nobody's lease was waited for (that takes TTL)
    assert plain.stat(f"{d}/f").mode & 0o777 == 0o600


def test_a_killed_holder_does_not_delay_a_change(lcluster: LocalCluster, pair, d: str) -> None:
    # kill -9: no atexit, no release message; the kernel closes its sockets, and the
    # watch connection's clean end tells the service the holder is gone.
    _, writer, plain = pair
    writer.write_bytes(f"{d}/f", b"abc")
    script = _holding(lcluster, f"{d}/f") + "print('held', flush=True)\nsys.stdin.readline()\n"
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=os.getcwd())
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().split() == ["held"]
    finally:
        proc.kill()
        proc.wait()
    time.sleep(0.2)  # the end of its connections reaches the service
    t = time.monotonic()
    writer.chmod(f"{d}/f", 0o600)
    assert time.monotonic() - t < TTL / 2  # its lease was not waited for (that takes TTL)
    assert plain.stat(f"{d}/f").mode & 0o777 == 0o600


def test_a_restarted_service_leaves_no_stale_entry(make_cluster) -> None:
    h = make_cluster(servers=1, lease_ttl=TTL)
    with Client(h.file) as writer, _watching(Client(h.file)) as holder:
        writer.write_bytes("/f", b"abc")
        _leased(holder, "/f")
        port, pid = h.data["metadata"]["port"], int(h.data["metadata"]["pid"])
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while pid_alive(pid) and time.monotonic() < deadline:  # dead (a zombie counts) before up() looks
            time.sleep(0.02)
        h.up()  # the service again, on its port, with no memory of the leases
        if h.data["metadata"]["port"] != port:
            pytest.skip("the port was not free again (TIME_WAIT): these clients cannot reach the new service")
        writer.chmod("/f", 0o600)
        assert holder.stat("/f").mode & 0o777 == 0o600
        assert _leased(holder, "/f").mode & 0o777 == 0o600  # leases again once the watch is back


def test_stat_many_answers_from_leases_and_sees_changes(lcluster: LocalCluster, pair, d: str) -> None:
    holder, writer, plain = pair
    paths = [f"{d}/f{k}" for k in range(5)]
    writer.create_many(paths)
    holder.stat_many(paths + [f"{d}/missing"])  # leases on the five (never on an error)
    first = holder.stat_many(paths)
    cache = holder._core.attrs
    assert cache is not None and all(cache.get(p, leased=True) is not None for p in paths)
    pid = int(lcluster.data["metadata"]["pid"])
    assert while_paused(pid, lambda: holder.stat_many(paths), 2.0) == first  # a round trip would wait
    writer.chmod(paths[2], 0o600)
    writer.remove(paths[4])
    again = holder.stat_many(paths)
    assert again[:4] == plain.stat_many(paths[:4]) and again[2].mode & 0o777 == 0o600  # type: ignore[union-attr]
    assert isinstance(again[4], FileNotFoundError)


def test_a_listing_is_kept_under_a_lease_and_sees_changes(lcluster: LocalCluster, pair, d: str) -> None:
    holder, writer, plain = pair
    writer.create_many([f"{d}/a", f"{d}/b"])
    sub = f"{d}/sub"
    writer.makedirs(sub)
    for _ in range(50):  # the first listing may come before the watch is live
        first = holder.listdir(d)
        cache = holder._core.attrs
        assert cache is not None
        if cache.get_names(d) is not None:
            break
        time.sleep(0.01)
    assert first == ["a", "b", "sub"] and cache.get_names(d) == first
    pid = int(lcluster.data["metadata"]["pid"])
    assert while_paused(pid, lambda: holder.listdir(d), 2.0) == first  # a round trip would wait
    for change in (lambda: writer.write_bytes(f"{d}/c", b""), lambda: writer.remove(f"{d}/a"),
                   lambda: writer.rename(f"{d}/b", f"{sub}/b"), lambda: writer.rename(sub, f"{d}/moved"),
                   lambda: writer.mkdir(f"{d}/new")):
        holder.listdir(d)
        change()
        assert holder.listdir(d) == plain.listdir(d)
    assert holder.listdir(d) == ["c", "moved", "new"]


def test_a_broken_watch_drops_every_leased_entry(pair, d: str) -> None:
    holder, writer, plain = pair
    writer.write_bytes(f"{d}/f", b"abc")
    _leased(holder, f"{d}/f")
    cache = holder._core.attrs
    watch = holder._core._watch
    assert cache is not None and watch is not None and watch._conn is not None
    watch._conn.close()  # as a cut connection: the watch fails
    deadline = time.monotonic() + 5
    while cache.get(f"{d}/f", leased=True) is not None:
        assert time.monotonic() < deadline, "a leased entry outlived its watch"
        time.sleep(0.005)
    assert _leased(holder, f"{d}/f").size == 3  # the watch comes back, and leases with it
    writer.write_bytes(f"{d}/f", b"abcdef")
    assert holder.stat(f"{d}/f") == plain.stat(f"{d}/f")
