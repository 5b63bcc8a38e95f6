"""A lease holder that does not acknowledge (stopped, throttled, cut off) delays another
client's change by its session at most (200 ms by default), not the lease's TTL, and never
answers from what changed meanwhile: it trusts its leases only within the session of
sending a watch that was answered (docs/architecture.md, "Caches").

A private cluster with a long TTL (30 s): a wait for the whole TTL shows as seconds, and
the bound asserted is far below it (no tight timing)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from stripefs.fsclient import Client
from stripefs.fsclient.testing import LocalCluster
from stripefs.fsclient.testing.procs import pause, resume
from tests.conftest import TEST_CHUNK

TTL = 30.0
BOUND = 10.0  # seconds a change may take here: far under the TTL, far over a session on a loaded machine


@pytest.fixture(scope="module")
def lcluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    h = LocalCluster.start(str(tmp_path_factory.mktemp("slow-holders")), servers=1, chunk_size=TEST_CHUNK,
                           lease_ttl=TTL)
    yield h
    h.down()


def holder_script(cluster_file: str, files: list[str], dirs: list[str]) -> str:
    """A holder process: a client holding leases on ``files`` and listing leases on
    ``dirs``; prints ``held``, then on each line read prints the modes of ``files`` and
    the names of ``dirs`` as it sees them (a repr)."""
    return (
        "import sys, time\n"
        "from stripefs.fsclient import Client\n"
        f"c = Client({cluster_file!r})\n"
        f"files, dirs = {files!r}, {dirs!r}\n"
        "c.stat('/')\n"
        "while not c._core.attrs.leasing: time.sleep(0.01)\n"
        "for _ in range(100):\n"
        "    [c.stat(p) for p in files]; [c.listdir(d) for d in dirs]\n"
        "    a = c._core.attrs\n"
        "    if all(a.get(p, leased=True) for p in files) and all(a.get_names(d) is not None for d in dirs): break\n"
        "    time.sleep(0.01)\n"
        "else: raise SystemExit('no lease')\n"
        "print('held', flush=True)\n"
        "for _ in sys.stdin:\n"
        "    print(repr(([oct(c.stat(p).mode & 0o777) for p in files], [c.listdir(d) for d in dirs])), flush=True)\n")


def start_holder(cluster_file: str, files: list[str], dirs: list[str]) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", holder_script(cluster_file, files, dirs)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "held"
    return proc


def ask(proc: subprocess.Popen[str]) -> Any:
    """What the holder process sees now (see :func:`holder_script`)."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("?\n")
    proc.stdin.flush()
    return eval(proc.stdout.readline())  # noqa: S307 -- our own child's repr of lists of str


def test_a_stopped_holder_delays_changes_by_far_less_than_the_ttl(lcluster: LocalCluster) -> None:
    """A holder process SIGSTOPped with a lease on a file and a listing lease on its
    directory: a chmod of the file and a create beside it return long before the TTL, and
    once resumed the holder's very next stat and listing show both."""
    d = f"/stopped-{os.getpid()}"
    with Client(lcluster.file, leases=False) as writer:
        writer.makedirs(d)
        writer.write_bytes(f"{d}/f", b"abc")
        proc = start_holder(lcluster.file, [f"{d}/f"], [d])
        try:
            assert ask(proc) == (["0o644"], [["f"]])
            pause(proc.pid)
            try:
                started = time.monotonic()
                writer.chmod(f"{d}/f", 0o600)
                writer.write_bytes(f"{d}/new", b"n")
                took = time.monotonic() - started
            finally:
                resume(proc.pid)
            assert took < BOUND, f"a chmod and a create waited {took:.1f} s for a stopped holder (TTL {TTL} s)"
            assert ask(proc) == (["0o600"], [["f", "new"]])  # never the entries it held while stopped
        finally:
            proc.kill()
            proc.wait()


def test_a_holder_whose_watch_is_held_up_stops_trusting_its_cache(lcluster: LocalCluster) -> None:
    """The holder's watch thread is held before it sends its next watch (as a throttled
    or cut-off one is): another client's chmod returns after the session, and the holder's
    stat meanwhile goes to the service rather than to the entry it still keeps; once the
    watch caught up, stats are answered from the cache again."""
    d = f"/held-{os.getpid()}"
    with Client(lcluster.file, leases=False) as writer, Client(lcluster.file) as holder:
        writer.makedirs(d)
        writer.write_bytes(f"{d}/f", b"abc")
        cache = holder._core.lease_cache()
        assert cache is not None
        deadline = time.monotonic() + 10
        while cache.get(f"{d}/f", leased=True) is None:
            assert time.monotonic() < deadline, "no lease"
            holder.stat(f"{d}/f")
            time.sleep(0.01)
        watch = holder._core._watch
        assert watch is not None and watch._conn is not None
        conn, gate, entered = watch._conn, threading.Event(), threading.Event()
        call = conn.call

        def held(msg: Any, timeout: float = 60.0) -> Any:
            entered.set()
            gate.wait(30)
            return call(msg, timeout=timeout)

        conn.call = held
        try:
            assert entered.wait(BOUND), "the watch sent nothing (no heartbeat while holding a lease)"
            started = time.monotonic()
            writer.chmod(f"{d}/f", 0o600)
            took = time.monotonic() - started
            assert took < BOUND, f"a chmod waited {took:.1f} s for a holder whose watch was held (TTL {TTL} s)"
            assert holder.stat(f"{d}/f").mode & 0o777 == 0o600
        finally:
            gate.set()
            conn.call = call
        deadline = time.monotonic() + 10
        while cache.get(f"{d}/f", leased=True) is None:  # trusted again once the watch caught up
            assert time.monotonic() < deadline, "the holder never trusted its cache again"
            holder.stat(f"{d}/f")
            time.sleep(0.01)
        assert holder.stat(f"{d}/f").mode & 0o777 == 0o600
