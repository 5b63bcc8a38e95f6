"""Clients ride out faults (issue 14 claim 7): while a chain has no serving target,
chunk reads and writes wait and retry for a bounded time instead of failing.

The overlapping schedule, R = 2 on two servers (every chain holds both): kill
one server, restart it, and kill the other while the first is still syncing
(it cannot serve: it may lack writes). Every chain is then without a serving
target until the second server returns. The application must see no error,
only a pause; and once the budget (``retry_for``) is spent, a clear error.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from stripefs.fsclient import Client
from stripefs.fsclient.batchread import ReadRing
from stripefs.fsclient.testing.procs import pause
from tests.conftest import TEST_CHUNK
from tests.replication.test_replication import server_pid, wait_all_serving


def _wait_state(c: Client, sid: int, state: str, timeout: float = 30.0, poll: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(s.server_id == sid and s.state == state for s in c.status().servers):
            return
        time.sleep(poll)
    raise AssertionError(f"server {sid} never became {state}: {c.status().servers}")


class Traffic:
    """One writer and one reader thread; every error they meet is kept."""

    def __init__(self, h, prefix: str):
        self.h, self.prefix = h, prefix
        self.acked: dict[str, bytes] = {}
        self.errors: list[BaseException] = []
        self.writes = self.reads = 0
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._write), threading.Thread(target=self._read)]

    def _write(self) -> None:
        with self.h.client() as c:
            n = 0
            while not self.stop.is_set():
                path = f"{self.prefix}/w{n}"
                data = os.urandom(TEST_CHUNK * 2 + 7 * n)
                try:
                    c.write_bytes(path, data)
                    self.acked[path] = data
                    self.writes += 1
                except BaseException as exc:  # noqa: BLE001 - the test reports it
                    self.errors.append(exc)
                n += 1

    def _read(self) -> None:
        with self.h.client() as c:
            ring = ReadRing(c)  # the batch read path rides out faults on the same budget
            while not self.stop.is_set():
                for path, data in list(self.acked.items())[-3:]:
                    try:
                        if self.reads % 2:
                            buf = bytearray(len(data))
                            ring.read([(buf, ring.open(path), 0, len(data))])
                            got = bytes(buf)
                        else:
                            got = c.read_bytes(path)
                        if got != data:
                            self.errors.append(AssertionError(f"wrong bytes in {path}"))
                        self.reads += 1
                    except BaseException as exc:  # noqa: BLE001
                        self.errors.append(exc)
                time.sleep(0.02)
            ring.close()

    def __enter__(self) -> Traffic:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(90)


@pytest.mark.slow
def test_overlapping_faults_pause_the_application_without_errors(make_cluster) -> None:
    h = make_cluster(servers=2, replicas=2)
    with h.client() as c:
        c.mkdir("/o")
        first, second = sorted(s.server_id for s in c.status().servers)
    with Traffic(h, "/o") as load:
        time.sleep(0.5)
        os.kill(server_pid(h, first), signal.SIGKILL)
        with h.client() as c:
            _wait_state(c, first, "offline")
        h.up()  # the first server returns and resyncs (for at least a few seconds)
        with h.client() as c:
            _wait_state(c, first, "syncing", poll=0.05)
            os.kill(server_pid(h, second), signal.SIGKILL)  # overlapping fault: no chain is served
            _wait_state(c, second, "offline")
            stalled_at = load.writes
            time.sleep(1.0)
        h.up()  # the second server returns serving; the first finishes its resync from it
        with h.client() as c:
            wait_all_serving(c, 2)
        resumed_at = load.writes
        deadline = time.monotonic() + 20
        while load.writes < resumed_at + 3 and time.monotonic() < deadline:
            time.sleep(0.1)
    assert not load.errors, load.errors[:3]
    assert load.writes >= resumed_at + 3 > stalled_at - 1  # writes went on after the outage
    with h.client() as c:
        for path, data in load.acked.items():
            assert c.read_bytes(path) == data, path


@pytest.mark.slow
def test_a_chain_without_a_serving_target_fails_clearly_after_the_budget(make_cluster) -> None:
    h = make_cluster(servers=2, replicas=1)
    with h.client() as c:
        c.mkdir("/b")
        c.set_layout("/b", stripe=1)
        c.write_bytes("/b/f", b"x" * 1000)
        chain = c.stat("/b/f").layout.chains[0]
        sid = c.routing(refresh=True).chains[chain][0]
    os.kill(server_pid(h, sid), signal.SIGKILL)
    with h.client() as c:
        _wait_state(c, sid, "offline")
    with h.client(retry_for=2.0) as c:
        t0 = time.monotonic()
        with pytest.raises(OSError) as err:
            c.read_bytes("/b/f")
        waited = time.monotonic() - t0
    assert 1.5 <= waited < 15, waited  # it waited for the budget, then gave up
    assert err.value.errno is not None and "no serving target" in str(err.value), err.value
    os.environ["STRIPEFS_RETRY_FOR"] = "0.5"  # the environment sets the default budget
    try:
        with h.client() as c:
            t0 = time.monotonic()
            with pytest.raises(OSError), c.open("/b/f", "r+b") as f:
                f.write(b"y" * 1000)
            assert time.monotonic() - t0 < 10
    finally:
        del os.environ["STRIPEFS_RETRY_FOR"]
    h.up()
    with h.client() as c:
        wait_all_serving(c, 2)
        assert c.read_bytes("/b/f") == b"x" * 1000  # the failed write changed nothing


@pytest.mark.slow
def test_a_syncing_server_with_no_source_does_not_serve_until_one_returns(make_cluster) -> None:
    """A returning server whose only serving peer dies before it copied anything must stay
    ``syncing`` (it lacks the writes it missed), not report its resync done and serve old
    bytes; and the peer, once back, must not take those old bytes for its own."""
    h = make_cluster(servers=2, replicas=2)
    old, new = os.urandom(TEST_CHUNK * 4), os.urandom(TEST_CHUNK * 4)
    with h.client() as c:
        c.write_bytes("/f", old)
        first, second = sorted(s.server_id for s in c.status().servers)
    os.kill(server_pid(h, first), signal.SIGKILL)
    with h.client() as c:
        _wait_state(c, first, "offline")
        with c.open("/f", "r+b") as f:  # lands on the second server only
            f.write(new)
    second_pid = server_pid(h, second)
    pause(second_pid)  # the returning server's first listing hangs on it
    try:
        h.up()
        with h.client() as c:
            _wait_state(c, first, "syncing", poll=0.05)
    finally:
        os.kill(second_pid, signal.SIGKILL)
    with h.client() as c:
        _wait_state(c, second, "offline")
        time.sleep(4.0)  # longer than a resync's shortest run: it must not have finished
        states = {s.server_id: s.state for s in c.status().servers}
        assert states[first] == "syncing", states
    restarter = threading.Timer(1.0, h.up)
    restarter.start()
    try:
        with h.client() as c:
            assert c.read_bytes("/f") == new  # waits for a serving replica, then the acknowledged bytes
            wait_all_serving(c, 2)
            assert c.read_bytes("/f") == new
    finally:
        restarter.join()


@pytest.mark.slow
def test_a_head_paused_past_the_failure_timeout_cannot_ack_a_write_the_chain_lacks(make_cluster) -> None:
    """A head stopped with a client's write queued is replaced; when it resumes, its stale
    forward must not be acknowledged by the new head (which never applied those bytes),
    and reads from it must not return what the chain overwrote meanwhile."""
    h = make_cluster(servers=2, replicas=2)
    base = os.urandom(TEST_CHUNK)
    with h.client() as c:
        c.mkdir("/z")
        c.set_layout("/z", stripe=1)
        c.write_bytes("/z/f", base)
        attr = c.stat("/z/f")
        head = c.routing(refresh=True).chains[attr.layout.chains[0]][0]
    head_pid = server_pid(h, head)
    first, second = os.urandom(4096), os.urandom(4096)
    c1 = h.client()
    c1.routing(refresh=True)
    c1.read_bytes("/z/f", 0, 10)  # connections to both servers exist
    errors: list[BaseException] = []
    pause(head_pid)
    try:
        def zombie_write() -> None:
            try:
                c1.write_from(attr.ino, attr.layout, 0, memoryview(first))
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        t = threading.Thread(target=zombie_write)
        t.start()
        with h.client() as c2:
            _wait_state(c2, head, "offline")
            c2.write_from(attr.ino, attr.layout, 8192, memoryview(second))  # the new head takes it
    finally:
        os.kill(head_pid, signal.SIGCONT)
    t.join(60)
    c1.close()
    assert not errors, errors  # ridden out: retried at the new head
    with h.client() as c:
        wait_all_serving(c, 2)
        for _ in range(4):  # reads spread over both replicas
            assert c.read_bytes("/z/f") == first + base[4096:8192] + second + base[12288:]


@pytest.mark.slow
def test_a_replica_paused_past_the_failure_timeout_does_not_serve_old_bytes(make_cluster) -> None:
    """A reader that still routes by the old table asks the resumed replica first: it must
    not answer with bytes the chain overwrote while it was away."""
    h = make_cluster(servers=2, replicas=2)
    old, new = os.urandom(TEST_CHUNK * 4), os.urandom(TEST_CHUNK * 4)
    with h.client() as c:
        c.mkdir("/p")
        c.set_layout("/p", stripe=1)
        c.write_bytes("/p/f", old)
        attr = c.stat("/p/f")
        paused = c.routing(refresh=True).chains[attr.layout.chains[0]][0]
    reader = h.client()
    try:
        assert reader.read_bytes("/p/f") == old  # its routing (both replicas serving) is cached
        pid = server_pid(h, paused)
        pause(pid)
        try:
            with h.client() as c:
                _wait_state(c, paused, "offline")
                c.write_from(attr.ino, attr.layout, 0, memoryview(new))
        finally:
            os.kill(pid, signal.SIGCONT)
        assert reader.read_into(attr.ino, attr.layout, len(new), 0, memoryview(buf := bytearray(len(new)))) == len(new)
        assert bytes(buf) == new
    finally:
        reader.close()


def test_a_write_forwarded_by_an_older_chain_table_is_refused(make_cluster) -> None:
    """A server forwarding by an old table (a paused middle, a head that missed a join) may
    skip a member that joined since: the receiver refuses, and the write is retried whole."""
    import crc32c

    from stripefs.wire import ErrorCode, StripefsError, messages as m

    h = make_cluster(servers=2, replicas=2)
    with h.client() as c:
        c.set_layout("/", stripe=1)
        c.write_bytes("/f", b"a" * 4096)
        attr = c.stat("/f")
        chain = attr.layout.chains[0]
        routing = c.routing(refresh=True)
        tail = routing.chains[chain][-1]
        assert routing.version > 1
        data = b"b" * 4096
        msg = m.WriteChunk(ino=attr.ino, index=0, offset=0, crc=crc32c.crc32c(data), chunk_size=attr.layout.chunk_size,
                           chain=chain, routing_version=routing.version - 1, version=2, digest=0)
    with Client(os.path.join(h.root, "server.json")) as sc:  # forwarded writes come from servers only
        sc.routing(refresh=True)
        with pytest.raises(StripefsError) as err:
            sc.data_connection(tail).submit(msg, payload=data).result(30)
    assert err.value.code == ErrorCode.STALE_ROUTING
    with h.client() as c:
        assert c.read_bytes("/f") == b"a" * 4096


def test_a_read_the_server_cannot_confirm_fails_fast_while_the_metadata_service_is_silent(make_cluster) -> None:
    """A storage server confirms its chain table before serving a read after a silence of
    the metadata service; a service that does not answer (paused here; cut off by a link
    that drops packets silently in the namespace test bed) makes the read fail with
    UNAVAILABLE within CONFIRM_TIMEOUT -- the client's cue to read another replica -- not
    after the transport's 10-30 s; reads that follow fail at once for a moment, and are
    served again once the service answers."""
    from stripefs.storage import _replication
    from stripefs.wire import ErrorCode, StripefsError, messages as m

    h = make_cluster(servers=1)
    data = os.urandom(4096)
    with h.client() as c:
        c.write_bytes("/f", data)
        ino = c.stat("/f").ino
        place = c.placement("/f")[0]
        server, chain = place["replicas"][0], place["chain"]
        read = m.ReadChunk(ino=ino, index=0, offset=0, length=len(data), chain=chain)
        meta_pid = h.data["metadata_services"][0]["pid"]
        pause(meta_pid)
        try:
            time.sleep(_replication.SILENCE + 1.0)  # the server's last answer is too old now
            t0 = time.monotonic()
            with pytest.raises(StripefsError) as info:
                c.call_storage(server, read, timeout=30)
            first = time.monotonic() - t0
            assert info.value.code == ErrorCode.UNAVAILABLE
            assert first < _replication.CONFIRM_TIMEOUT + 1.5, f"the read waited {first:.1f} s"
            t0 = time.monotonic()
            with pytest.raises(StripefsError):
                c.call_storage(server, read, timeout=30)
            assert time.monotonic() - t0 < 0.4  # within the backoff: at once
        finally:
            os.kill(meta_pid, signal.SIGCONT)
        deadline = time.monotonic() + 20
        while True:
            try:
                reply = c.call_storage(server, read, timeout=30)
                break
            except StripefsError as exc:
                assert exc.code == ErrorCode.UNAVAILABLE and time.monotonic() < deadline
                time.sleep(0.2)
        assert reply.length == len(data)


def test_a_timeout_answered_by_a_server_is_retried_on_another_replica(cluster) -> None:
    """``_run_pieces``: a piece whose request was answered TIMEOUT (a server that could not
    reach a peer or the metadata service in time) goes to the next replica within the
    retry budget; it used to end the call, since a TIMEOUT answer is a ``TimeoutError``
    too and was taken for the client's own wait running out."""
    from concurrent.futures import Future

    from stripefs.wire import ErrorCode, StripefsError

    attempts: list[int] = []
    finished: list[object] = []

    def submit(piece: tuple, attempt: int) -> Future:
        attempts.append(attempt)
        fut: Future = Future()
        if attempt == 0:
            fut.set_exception(StripefsError(ErrorCode.TIMEOUT, "peer did not answer in time"))
        else:
            fut.set_result("answer")
        return fut

    with Client(cluster.file) as c:
        chain = next(iter(c.routing().chains))
        c._core._run_pieces([(0, 0, 0, 0, chain)], submit, lambda piece, reply: finished.append(reply))
    assert attempts == [0, 1] and finished == ["answer"]
