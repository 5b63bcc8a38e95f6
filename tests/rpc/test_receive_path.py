"""The blocking client's receive path: callers that receive their own answers, the reader
thread for the others, timeouts that keep the connection, and connection loss."""

from __future__ import annotations

import os
import socket
import threading
import time
from concurrent.futures import Future
from typing import Any, Iterator

import pytest
import trio

from stripefs.rpc import Connection, ServerConn, Service, abandon, serve_rpc
from stripefs import wire
from stripefs.wire import ErrorCode, FrameHead, Message, StripefsError, messages as m

SECRET = "test-secret"
CLIENT = wire.role_credential(SECRET, "client")
KILL = 999_999  # ReadChunk.index that makes the server drop the connection
CUT = 999_998  # ... that makes it drop the connection halfway through an answer's payload


class SlowEcho(Service):
    """ReadChunk answered after ``offset`` ms with ``length`` bytes of ``index % 251``;
    index KILL tears the connection down instead, index CUT after half the payload."""

    role = "storage"

    async def handle(self, conn: ServerConn, head: FrameHead, msg: Message, payload: Any) -> None:
        if isinstance(msg, m.ReadChunk):
            if msg.index == KILL:
                await trio.sleep(msg.offset / 1000)
                conn.sock.shutdown(socket.SHUT_RDWR)  # the client sees the connection end
                return
            await trio.sleep(msg.offset / 1000)
            if msg.index == CUT:  # a server killed while it sends: the answer stops short
                prefix = conn.machine.send_response(head, {"length": msg.length}, msg.length)
                await conn.sock.send(prefix + bytes(msg.length // 2))
                conn.sock.shutdown(socket.SHUT_RDWR)
                return
            data = bytes([msg.index % 251]) * msg.length
            await conn.send(head, {"length": msg.length, "chunk_length": msg.index}, payload=data)
        else:
            await conn.send(head, {})


@pytest.fixture(scope="module")
def address() -> Iterator[tuple[str, int]]:
    holder: dict[str, Any] = {}
    ready = threading.Event()

    async def main() -> None:
        holder["token"] = trio.lowlevel.current_trio_token()
        with trio.CancelScope() as holder["scope"]:
            async with trio.open_nursery() as nursery:
                holder["address"] = await nursery.start(lambda task_status: serve_rpc(
                    SlowEcho(), "127.0.0.1", 0, secret=SECRET, task_status=task_status))
                ready.set()

    thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
    thread.start()
    assert ready.wait(10)
    yield holder["address"]
    trio.from_thread.run_sync(holder["scope"].cancel, trio_token=holder["token"])
    thread.join(10)


@pytest.fixture
def conn(address: tuple[str, int]) -> Iterator[Connection]:
    c = Connection(address, CLIENT, os.urandom(16), expect_role="storage")
    yield c
    c.close()


def read(index: int, delay_ms: int = 0, length: int = 64) -> m.ReadChunk:
    return m.ReadChunk(ino=1, index=index, offset=delay_ms, length=length)


def test_concurrent_callers_get_their_own_answers(conn: Connection) -> None:
    wrong: list[tuple[int, int]] = []

    def caller(t: int) -> None:
        for i in range(150):
            index = t * 1000 + i
            dest = memoryview(bytearray(64))
            reply = conn.call(read(index, delay_ms=i % 3), dest=dest, timeout=20)
            if reply.header["chunk_length"] != index or bytes(dest) != bytes([index % 251]) * 64:
                wrong.append((t, i))

    # Futures (as trio code and pipelined writers use) mixed with blocking callers.
    futures = [(i, conn.submit(read(50_000 + i, delay_ms=i % 5))) for i in range(100)]
    threads = [threading.Thread(target=caller, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not any(th.is_alive() for th in threads)
    assert wrong == []
    for i, fut in futures:
        reply = fut.result(20)
        assert reply.header["chunk_length"] == 50_000 + i
        assert reply.payload == bytes([(50_000 + i) % 251]) * 64
    assert not conn.broken


def test_a_lone_caller_alternating_with_futures(conn: Connection) -> None:
    """The receive role goes back and forth between a caller and the reader thread."""
    for i in range(200):
        if i % 3 == 0:
            fut = conn.submit(read(i))
            assert conn.call(read(i + 1)).header["chunk_length"] == i + 1
            assert fut.result(10).header["chunk_length"] == i
        elif i % 3 == 1:
            assert conn.submit(read(i)).result(10).header["chunk_length"] == i
        else:
            assert conn.call(read(i)).header["chunk_length"] == i


def test_a_timed_out_request_keeps_the_connection_and_drops_the_late_answer(conn: Connection) -> None:
    dest = memoryview(bytearray(b"\xee" * 64))
    t0 = time.monotonic()
    with pytest.raises(StripefsError) as exc:
        conn.call(read(7, delay_ms=400), dest=dest, timeout=0.1)
    assert exc.value.code == ErrorCode.TIMEOUT
    assert time.monotonic() - t0 < 1.0  # 0.1 s and the scheduling of a loaded machine
    # The next requests are answered on the same connection, after the late answer came.
    time.sleep(0.4)
    for i in range(3):
        assert conn.call(read(100 + i), timeout=10).header["chunk_length"] == 100 + i
    assert not conn.broken
    assert bytes(dest) == b"\xee" * 64  # the late answer never landed in the caller's buffer


def test_a_timeout_while_another_caller_receives(conn: Connection) -> None:
    """A caller waiting for the receiving thread times out on its own; both go on."""
    slow: Future = Future()

    def long_call() -> None:
        try:
            slow.set_result(conn.call(read(1, delay_ms=500), timeout=10))
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            slow.set_exception(e)

    th = threading.Thread(target=long_call)
    th.start()
    time.sleep(0.05)  # the long call holds the receive role by now
    with pytest.raises(StripefsError) as exc:
        conn.call(read(2, delay_ms=300), timeout=0.1)
    assert exc.value.code == ErrorCode.TIMEOUT
    assert slow.result(10).header["chunk_length"] == 1
    th.join(10)
    assert conn.call(read(3), timeout=10).header["chunk_length"] == 3
    assert not conn.broken


def test_abandon_closes_the_connection_and_spares_the_buffer(conn: Connection) -> None:
    """abandon() (futures: the read ring, trio callers) still leaves a hung server behind:
    the connection closes, the others in flight fail over, nothing lands in the buffer."""
    dest = memoryview(bytearray(64))
    fut = conn.submit(read(4, delay_ms=200), dest=dest)
    other = conn.submit(read(5, delay_ms=200))
    time.sleep(0.02)
    abandon(fut)
    for f in (fut, other):
        with pytest.raises(StripefsError) as exc:
            f.result(5)
        assert exc.value.code == ErrorCode.UNAVAILABLE
    time.sleep(0.3)
    assert conn.broken and bytes(dest) == bytes(64)


def test_connection_loss_wakes_every_waiter(conn: Connection) -> None:
    results: list[BaseException | None] = []
    lock = threading.Lock()

    def caller(i: int) -> None:
        try:
            conn.call(read(i, delay_ms=5000), timeout=30)
            err: BaseException | None = None
        except BaseException as e:  # noqa: BLE001
            err = e
        with lock:
            results.append(err)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    futures = [conn.submit(read(10 + i, delay_ms=5000)) for i in range(3)]
    time.sleep(0.1)
    t0 = time.monotonic()
    killer = conn.submit(read(KILL, delay_ms=0))
    for th in threads:
        th.join(5)
    assert time.monotonic() - t0 < 3
    assert len(results) == 4
    for err in results:
        assert isinstance(err, StripefsError) and err.code == ErrorCode.UNAVAILABLE
    for fut in [*futures, killer]:
        with pytest.raises(StripefsError) as exc:
            fut.result(3)
        assert exc.value.code == ErrorCode.UNAVAILABLE
    assert conn.broken
    with pytest.raises(StripefsError) as exc:
        conn.call(read(1), timeout=5)
    assert exc.value.code == ErrorCode.UNAVAILABLE


def test_close_wakes_a_caller_receiving_its_own_answer(conn: Connection) -> None:
    err: list[BaseException] = []

    def caller() -> None:
        try:
            conn.call(read(1, delay_ms=5000), timeout=30)
        except BaseException as e:  # noqa: BLE001
            err.append(e)

    th = threading.Thread(target=caller)
    th.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    conn.close()
    th.join(5)
    assert time.monotonic() - t0 < 2
    assert len(err) == 1 and isinstance(err[0], StripefsError) and err[0].code == ErrorCode.UNAVAILABLE


def _lone_calls_leave_the_reader_idle(conn: Connection) -> None:
    """300 lone blocking calls cost the parked reader thread (almost) no CPU."""
    clock = time.pthread_getcpuclockid(conn._reader.ident)  # type: ignore[arg-type]
    before = time.clock_gettime(clock)
    for i in range(300):
        assert conn.call(read(i), timeout=10).header["chunk_length"] == i
    spent = time.clock_gettime(clock) - before
    assert spent < 0.002, f"the reader thread spent {spent * 1e6:.0f} us on 300 lone calls"

def test_a_lone_caller_receives_its_own_answers(conn: Connection) -> None:
    """No hand-off per request: the reader thread stays parked (spends no CPU) while
    one blocking caller calls in a loop."""
    conn.call(read(0), timeout=10)  # the reader thread is parked by the time this returns
    _lone_calls_leave_the_reader_idle(conn)


def test_the_reader_thread_parks_after_futures_and_a_lone_caller_goes_on_alone(conn: Connection) -> None:
    """Futures keep the reader thread in the socket for a while (no wake-up per request
    for trio users); once idle it parks and a lone caller receives its own answers."""
    for i in range(20):
        assert conn.submit(read(i)).result(10).header["chunk_length"] == i
    time.sleep(1.6)  # a RECV_SLICE with nothing in flight: the reader thread parks
    _lone_calls_leave_the_reader_idle(conn)


def test_a_retry_with_the_id_of_a_timed_out_call_goes_to_a_new_connection(conn: Connection) -> None:
    """A retry reuses its request id; while the first try's answer is still due on this
    connection, the retry fails with UNAVAILABLE and the connection closes (the caller's
    pool opens another), as when a timeout closed the connection."""
    with pytest.raises(StripefsError) as exc:
        conn.call(read(8, delay_ms=300), timeout=0.05, req_id=777_001)
    assert exc.value.code == ErrorCode.TIMEOUT and not conn.broken
    with pytest.raises(StripefsError) as exc:
        conn.call(read(8), timeout=5, req_id=777_001)
    assert exc.value.code == ErrorCode.UNAVAILABLE and conn.broken


def test_an_id_is_free_again_once_the_late_answer_was_dropped(conn: Connection) -> None:
    with pytest.raises(StripefsError):
        conn.call(read(9, delay_ms=100), timeout=0.02, req_id=777_002)
    time.sleep(0.2)
    assert conn.call(read(10), timeout=5).header["chunk_length"] == 10  # reads (and drops) the late answer
    assert conn.call(read(11), timeout=5, req_id=777_002).header["chunk_length"] == 11


def test_small_answers_never_cut_into_big_ones(conn: Connection) -> None:
    """Small answers written at once and big ones sent in pieces (or from a worker
    thread) share a connection: every frame arrives whole."""
    sizes = [64, 20_000, 300_000, 0, 16_384, 1_000_000]
    futures = []
    for i in range(60):
        size = sizes[i % len(sizes)]
        futures.append((i, size, conn.submit(read(i, delay_ms=i % 4, length=size))))
    for i, size, fut in futures:
        reply = fut.result(30)
        assert reply.header == {"length": size, "chunk_length": i}
        assert (reply.payload or b"") == bytes([i % 251]) * size


def test_a_forked_child_never_reads_or_writes_its_parents_connection(conn: Connection) -> None:
    assert conn.call(read(1), timeout=10).header["chunk_length"] == 1
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its parent's connection answers UNAVAILABLE, untouched
        code = 1
        try:
            conn.call(read(2), timeout=2)
        except StripefsError as exc:
            code = 0 if exc.code == ErrorCode.UNAVAILABLE else 2
        except BaseException:  # noqa: BLE001
            code = 3
        os.write(w, bytes([code]))
        os._exit(0)
    os.close(w)
    try:
        assert os.read(r, 1) == b"\x00"
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    for i in range(20):  # the parent's stream is intact
        assert conn.call(read(i), timeout=10).header["chunk_length"] == i
    assert not conn.broken


def test_mixed_callers_timeouts_and_a_kill_never_hang_or_cross_answers(address: tuple[str, int]) -> None:
    """Callers, futures and short timeouts on shared connections, each connection killed
    at some point: every request ends (answer, TIMEOUT or UNAVAILABLE) in bounded time,
    and no caller ever gets another request's answer."""
    problems: list[str] = []
    stop = time.monotonic() + 2.5

    def worker(conn: Connection, t: int) -> None:
        i = 0
        while time.monotonic() < stop:
            i += 1
            index = (t * 100_000 + i) % KILL
            delay = i % 7 * 3  # 0-18 ms
            t0 = time.monotonic()
            try:
                if i % 4 == 0:
                    reply = conn.submit(read(index, delay_ms=delay)).result(10)
                else:
                    reply = conn.call(read(index, delay_ms=delay), timeout=0.01 if i % 5 == 0 else 10)
                if reply.header["chunk_length"] != index:
                    problems.append(f"{t}: asked {index}, got {reply.header['chunk_length']}")
            except StripefsError as exc:
                if exc.code not in (ErrorCode.TIMEOUT, ErrorCode.UNAVAILABLE):
                    problems.append(f"{t}: {exc!r}")
            if time.monotonic() - t0 > 5:
                problems.append(f"{t}: a request took {time.monotonic() - t0:.1f} s")
            if conn.broken:
                return

    rounds = 0
    while time.monotonic() < stop:
        rounds += 1
        conn = Connection(address, CLIENT, os.urandom(16), expect_role="storage")
        threads = [threading.Thread(target=worker, args=(conn, t)) for t in range(4)]
        for th in threads:
            th.start()
        time.sleep(0.2 + rounds % 3 * 0.1)
        if rounds % 2:
            conn.submit(read(KILL))  # the server drops the connection
        else:
            conn.close()
        for th in threads:
            th.join(10)
        assert not any(th.is_alive() for th in threads), "a caller hung after the connection died"
        conn.close()
    assert problems == []


@pytest.mark.parametrize("how", ["call", "future"])
def test_a_connection_lost_in_the_middle_of_a_payload_fails_that_request(address: tuple[str, int], how: str) -> None:
    """A server that dies while it sends an answer (SIGKILL halfway through a chunk): the
    request being received fails with UNAVAILABLE at once, like every other in flight --
    not a hang until its timeout, nor an answer that was never filled in."""
    conn = Connection(address, CLIENT, os.urandom(16), expect_role="storage")
    try:
        dest = memoryview(bytearray(1 << 16))
        t0 = time.monotonic()
        with pytest.raises(StripefsError) as exc:
            if how == "call":
                conn.call(read(CUT, length=len(dest)), dest=dest, timeout=20)
            else:
                conn.submit(read(CUT, length=len(dest)), dest=dest).result(20)
        assert exc.value.code == ErrorCode.UNAVAILABLE
        assert time.monotonic() - t0 < 5 and conn.broken
    finally:
        conn.close()
