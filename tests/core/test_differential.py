"""The native client's write path against a local file (fsclient/testing/differential.py).

Seeded random operation sequences (writes from 1 byte to past the write-behind
window, seeks and pwrites back over ranges still in flight, truncates, fsyncs,
reopens in every mode by either of two clients) must leave the stripefs file
byte for byte equal to a local file given the same operations. A divergence
names its seed; ``STRIPEFS_DIFF_SEEDS=N`` replays it, ``STRIPEFS_DIFF_SEEDS=0-999``
soaks.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Iterator

import pytest

from stripefs.fsclient import Client
from stripefs.fsclient.core._ordering import WriteOrder
from tests.conftest import TEST_CHUNK
from stripefs.fsclient.testing.differential import LocalRoute, NativeRoute, parse_seeds, run_seed

SEEDS = parse_seeds(range(24))
OPS = 100
MAX_SIZE = 4 << 20


@pytest.fixture
def route(cluster, client: Client, testdir: str) -> Iterator[NativeRoute]:
    other = cluster.client()
    yield NativeRoute((client, other), testdir)
    other.close()


def _window(client: Client, testdir: str) -> int:
    with client.open(f"{testdir}/probe", "wb") as f:
        return f.window


@pytest.mark.parametrize("seed", SEEDS)
def test_differential_native(route: NativeRoute, client: Client, testdir: str, tmp_path, seed: int) -> None:
    run_seed(route, LocalRoute(str(tmp_path)), f"f{seed}", seed, ops=OPS, chunk=TEST_CHUNK,
             window=_window(client, testdir), max_size=MAX_SIZE)


def test_header_patch_after_large_body(client: Client, testdir: str) -> None:
    """The issue's case: 10 MiB body, seek(0), 100-byte header patch, one write past the end, close.

    4 MiB chunks (the default layout), so the body stays in the write-behind
    buffer and leaves in the background when the patch arrives. Three rounds:
    the lost patch showed in 29 of 30 runs.
    """
    d = f"{testdir}/4m"
    client.makedirs(d)
    client.set_layout(d, chunk_size=4 << 20)
    for round_ in range(3):
        body, patch, tail = os.urandom(10 << 20), os.urandom(100), os.urandom(1000)
        path = f"{d}/ckpt{round_}"
        with client.open(path, "wb") as f:
            f.write(body)
            f.seek(0)
            f.write(patch)
            f.seek(len(body))
            f.write(tail)
        got = client.read_bytes(path)
        assert len(got) == len(body) + len(tail)
        assert got[:100] == patch, f"round {round_}: the header patch was lost"
        assert got == patch + body[100:] + tail


def test_later_overlapping_write_waits_for_the_earlier_one(client: Client, testdir: str, monkeypatch) -> None:
    """Deterministic form of the race: the earlier (multi-chunk, background) write's first
    chunk is held back in the sender; the later one-chunk write to the same range must
    still land after it."""
    core = client._core  # fault injection at the transport: wrap the data connections
    real = core.data_conn
    held = threading.Event()

    class SlowFirstChunk:
        def __init__(self, conn: Any):
            self.conn = conn

        def submit(self, msg: Any, **kw: Any) -> Any:
            payload = kw.get("payload")
            if getattr(msg, "index", None) == 0 and payload is not None and len(payload) > 1000:
                held.set()
                time.sleep(0.5)  # the big write's chunk 0 is late on the wire
            return self.conn.submit(msg, **kw)

    monkeypatch.setattr(core, "data_conn", lambda sid: SlowFirstChunk(real(sid)))
    path = f"{testdir}/race"
    big, small = os.urandom(3 * TEST_CHUNK), os.urandom(100)
    with client.open(path, "wb") as f:
        f.write(big)  # buffered (under the window)
        f.seek(0)
        f.write(small)  # sends the big buffer in the background, buffers this one
        f.seek(len(big))
        f.write(b"tail")  # sends the small buffer: it must wait for chunk 0 of the big one
    assert held.is_set()
    got = client.read_bytes(path)
    assert got[:100] == small, "the later write was overwritten by the earlier one"
    assert got == small + big[100:] + b"tail"


def test_disjoint_writes_are_not_held_back(client: Client, testdir: str, monkeypatch) -> None:
    """Ordering is per overlapping range, not a queue: while an earlier write's first chunk
    is stuck in the sender, a write to other chunks completes, and a write over the stuck
    chunk waits for it (then lands last)."""
    core = client._core  # fault injection at the transport: wrap the data connections
    real = core.data_conn
    stuck, release = threading.Event(), threading.Event()

    class StuckFirstChunk:
        def __init__(self, conn: Any):
            self.conn = conn

        def submit(self, msg: Any, **kw: Any) -> Any:
            payload = kw.get("payload")
            if getattr(msg, "index", None) == 0 and payload is not None and len(payload) == TEST_CHUNK:
                stuck.set()
                assert release.wait(30)
            return self.conn.submit(msg, **kw)

    path = f"{testdir}/disjoint"
    with client.open(path, "wb") as f:
        ino, layout = f.ino, f.layout
    monkeypatch.setattr(core, "data_conn", lambda sid: StuckFirstChunk(real(sid)))
    first = os.urandom(2 * TEST_CHUNK)
    big = core.submit_write(ino, layout, 0, memoryview(first))[0]  # chunks 0-1, in the background
    assert stuck.wait(10)
    far = os.urandom(5000)
    t0 = time.monotonic()
    core.write_from(ino, layout, 5 * TEST_CHUNK, memoryview(far))  # chunk 5: free to go
    assert time.monotonic() - t0 < 5 and not big.done()
    over = os.urandom(300)
    landed = threading.Event()
    later = threading.Thread(target=lambda: (core.write_from(ino, layout, 10, memoryview(over)), landed.set()))
    later.start()
    assert not landed.wait(0.5), "a write over a chunk still in flight went out before it"
    release.set()
    big.result(30)
    later.join(30)
    assert landed.is_set()
    dest = bytearray(5 * TEST_CHUNK + 5000)  # the length is not committed: read the chunks as they are
    core.read_into(ino, layout, len(dest), 0, memoryview(dest))
    got = bytes(dest)
    assert got[:10] == first[:10] and got[10:310] == over and got[310 : 2 * TEST_CHUNK] == first[310:]
    assert got[5 * TEST_CHUNK :] == far
    assert core._order.pending(ino) == 0  # finished pieces leave the registry


def test_write_order_registry() -> None:
    """Which earlier pieces a new write waits for: only those that overlap and are unfinished."""
    order = WriteOrder()
    a = order.register(7, [(0, 100), (100, 200)])
    b = order.register(7, [(200, 300)])
    other = order.register(8, [(0, 1000)])
    assert b.waits == [] and b.ready() and other.waits == []
    c = order.register(7, [(150, 250)])
    assert c.waits == [a.pieces[1], b.pieces[0]] and not c.ready()
    a.finish()
    b.finish(OSError("lost"))  # a failed earlier write releases its waiters too
    assert c.ready()
    c.wait()
    d = order.register(7, [(0, 300)])
    assert d.waits == [c.pieces[0]]
    c.finish()
    d.finish()
    other.finish()
    assert order.pending(7) == order.pending(8) == 0 and not order._inflight


def _exercise_beside(h: Any, tmp_path: Any, loops: list[Any], stop: threading.Event, seeds: range,
                     tag: str) -> None:
    """Run the exerciser's ``seeds`` on ``h`` (two clients, ``/diff``) while each of ``loops``
    runs on a thread of its own; ``stop`` is set and the threads joined afterwards."""
    a, b = h.client(), h.client()
    threads = [threading.Thread(target=f, daemon=True) for f in loops]
    for th in threads:
        th.start()
    try:
        a.makedirs("/diff")
        route = NativeRoute((a, b), "/diff")
        for seed in parse_seeds(seeds):
            run_seed(route, LocalRoute(str(tmp_path)), f"{tag}{seed}", seed, ops=OPS, chunk=TEST_CHUNK,
                     window=_window(a, "/diff"), max_size=MAX_SIZE)
    finally:
        stop.set()
        for th in threads:
            th.join(120)
        a.close()
        b.close()


def test_differential_with_scrub_running_beside(make_cluster, tmp_path) -> None:
    """Scrub reloads chunk headers while writes rename copy-on-write files in (issue #27 item
    2 was such a race): the exerciser runs while every storage server scrubs in a loop, and
    both must agree: the file equals the local one, and no scrub finds a bad chunk."""
    from stripefs.wire import messages as m

    h = make_cluster(servers=2)
    stop, passes, bad = threading.Event(), [0], []

    def scrub_in_a_loop() -> None:
        with h.client() as c:  # the cluster file's credential: a server's (Scrub is theirs)
            while not stop.is_set():
                for sid, info in sorted(c.routing(refresh=True).servers.items()):
                    if info.state == "serving":
                        reply = c.call_storage(sid, m.Scrub(repair=False), timeout=120)
                        bad.extend(reply.bad)
                passes[0] += 1

    _exercise_beside(h, tmp_path, [scrub_in_a_loop], stop, range(100, 106), "s")
    assert passes[0] >= 2, "the scrubber never completed a pass while the writes ran"
    assert bad == [], f"scrub found chunks failing their checksums: {bad}"


def test_differential_with_resync_and_gc_beside(make_cluster, tmp_path) -> None:
    """Resync and the garbage collector move and drop chunks while writes land (issue #27):
    the exerciser runs (R=2) while a storage server is killed and restarted over and over
    (each return resyncs its chains from the surviving replica) and scratch files are
    written, truncated and removed (the collector cuts and drops their chunks, 0.5 s grace).
    The file must equal the local one, every replica of every chunk must agree once the
    cluster healed, and the scratch files' chunks must be gone from every server.
    ``STRIPEFS_DIFF_SEEDS`` runs more seeds (a longer soak)."""
    import os as _os
    import signal

    from stripefs.fsclient.testing._cluster import SERVER_FILE
    from stripefs.fsclient.testing.faults import replica_mismatches, wait_healthy
    from stripefs.wire import ErrorCode, StripefsError
    from stripefs.wire import messages as m

    h = make_cluster(servers=3, replicas=2, gc_grace=0.5)
    stop, errors = threading.Event(), []
    restarts, removed = [0], []

    def restart_in_a_loop() -> None:
        with h.client() as c:
            k = 0
            while not stop.is_set():
                victim = sorted(c.status().servers, key=lambda s: s.server_id)[k % 3]
                k += 1
                _os.kill(victim.pid, signal.SIGKILL)
                time.sleep(0.3)
                h.up()  # back as syncing: its chains resync from the other replica
                restarts[0] += 1
                wait_healthy(c, 3, timeout=60)

    def churn_in_a_loop() -> None:
        with h.client() as c:
            c.makedirs("/gc")
            i = 0
            while not stop.is_set():
                path = f"/gc/x{i}"
                c.write_bytes(path, _os.urandom(3 * TEST_CHUNK + 100))
                c.truncate(path, TEST_CHUNK // 2)
                removed.append(c.stat(path))
                c.remove(path)
                i += 1
                time.sleep(0.05)

    def guarded(fn: Any) -> Any:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 -- reported below
                errors.append(exc)
        return run

    _exercise_beside(h, tmp_path, [guarded(restart_in_a_loop), guarded(churn_in_a_loop)], stop, range(200, 202), "r")
    assert not errors, f"the resync or GC loop failed: {errors[0]!r}"
    assert restarts[0] >= 1 and removed, (restarts, len(removed))
    with h.client() as c:
        wait_healthy(c, 3, timeout=60)
    with Client(_os.path.join(h.root, SERVER_FILE)) as sc:
        assert replica_mismatches(sc) == []

        def gone(attr: Any) -> bool:
            assert attr.layout is not None
            for index in range(4):
                chain = attr.layout.chain_of(index)
                for sid, _state in sc.routing(refresh=True).members[chain]:
                    try:
                        sc.call_storage(sid, m.StatChunk(ino=attr.ino, index=index))
                        return False
                    except StripefsError as exc:
                        if exc.code != ErrorCode.NOT_FOUND:
                            raise
            return True

        deadline = time.monotonic() + 30
        left = list(removed)
        while left and time.monotonic() < deadline:
            left = [x for x in left if not gone(x)]
            time.sleep(0.2)
        assert not left, f"{len(left)} removed files kept chunks past the collector's grace"
