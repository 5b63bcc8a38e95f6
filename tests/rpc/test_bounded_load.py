"""Bounded load: a server out of file descriptors keeps serving once some are free; a
server-wide byte budget bounds the payload bytes held at once, and a request that would
wait too long for it is answered BUSY; one client id holds a bounded number of
connections; clients back off from BUSY and finish."""

from __future__ import annotations

import errno
import os
import random
import socket
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any, Iterator

import pytest
import trio

from stripefs import rpc
from stripefs.bench.load_bench import run as run_load
from stripefs.fsclient.batchread import ReadRing
from stripefs.fsclient.core._core import BUSY_DELAY, BUSY_DELAY_MAX, busy_delay
from stripefs.rpc import ByteBudget, ClientSlots, Connection, ServerConn, Service
from stripefs.storage.__main__ import CLIENT_CONNECTIONS_ENV
from stripefs.wire import ErrorCode, FrameHead, Message, StripefsError, role_credential
from stripefs.wire import messages as m

from .threaded import ThreadedServer

SECRET = "bounded-load"
CLIENT = role_credential(SECRET, "client")

_SERVER = textwrap.dedent("""
    import resource, sys
    import trio
    from stripefs import rpc
    from stripefs.wire import messages as m

    class Echo(rpc.Service):
        role = "storage"

        async def handle(self, conn, head, msg, payload):
            await conn.send(head, m.EmptyReply().to_header())

    resource.setrlimit(resource.RLIMIT_NOFILE, (40, 40))

    async def main():
        async with trio.open_nursery() as nursery:
            host, port = await nursery.start(lambda task_status: rpc.serve_rpc(
                Echo(), "127.0.0.1", 0, secret="s", task_status=task_status))
            print(port, flush=True)

    trio.run(main)
""")


def test_a_server_out_of_file_descriptors_keeps_accepting_later() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    socks: list[socket.socket] = []
    try:
        port = int(proc.stdout.readline())  # type: ignore[union-attr]
        for _ in range(60):  # more than the server's 40 descriptors: accept() hits EMFILE
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(0.5)
        assert proc.poll() is None, "the server exited when it ran out of descriptors"
        for s in socks:
            s.close()
        socks.clear()
        deadline = time.monotonic() + 20
        while True:
            try:
                conn = rpc.Connection(("127.0.0.1", port), role_credential("s", "client"), os.urandom(16))
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        try:
            assert conn.call(m.Ping(), timeout=10).header == {}
        finally:
            conn.close()
        assert proc.poll() is None
    finally:
        for s in socks:
            s.close()
        proc.kill()
        proc.wait(10)


def test_byte_budget_waits_and_admits_in_order() -> None:
    order: list[str] = []

    async def main() -> None:
        budget = ByteBudget(100)
        await budget.acquire(60)

        async def want(name: str, n: int) -> None:
            await budget.acquire(n)
            order.append(name)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(want, "a", 50)
            await trio.sleep(0.05)
            nursery.start_soon(want, "b", 10)  # would fit, but must not overtake "a"
            await trio.sleep(0.05)
            assert order == [] and budget.used == 60
            budget.release(60)
            await trio.sleep(0.05)
            assert sorted(order) == ["a", "b"] and budget.used == 60
            nursery.start_soon(want, "big", 1000)  # bigger than the budget: admitted alone, once empty
            await trio.sleep(0.05)
            assert len(order) == 2
            budget.release(60)
            await trio.sleep(0.05)
            assert order[-1] == "big" and budget.used == 1000
        budget.release(1000)
        assert budget.used == 0

        with trio.move_on_after(0.05):  # a waiter cancelled before its turn takes nothing
            await budget.acquire(60)
            await budget.acquire(60)
        assert budget.used == 60

    trio.run(main)


def test_byte_budget_refuses_nothing_it_cannot_hold() -> None:
    with pytest.raises(ValueError):
        ByteBudget(0)


class HoldService(Service):
    """Writes are received and then held (their budget with them) until ``release``."""

    role = "storage"

    def __init__(self) -> None:
        self.gate = trio.Event()
        self.received: list[int] = []

    async def receive_payload(self, conn: ServerConn, head: FrameHead, msg: Message) -> Any:
        buf = bytearray(head.payload_len)
        await conn.recv_payload_into(memoryview(buf))
        return buf

    async def handle(self, conn: ServerConn, head: FrameHead, msg: Message, payload: Any) -> None:
        if isinstance(msg, m.WriteChunk):
            self.received.append(len(payload))
            await self.gate.wait()
        await conn.send(head, m.EmptyReply().to_header())


class HoldServer(ThreadedServer):
    """A trio server on a thread: a 1 MiB budget, BUSY after 0.3 s, 2 connections per client."""

    def __init__(self) -> None:
        super().__init__(HoldService(), SECRET, payload_budget=1 << 20, busy_after=0.3, max_client_connections=2)

    def release(self) -> None:
        self.run_sync(self.service.gate.set)


@pytest.fixture
def hold() -> Iterator[HoldServer]:
    s = HoldServer()
    yield s
    s.stop()


def _write(n: int) -> m.WriteChunk:
    return m.WriteChunk(ino=1, index=0, offset=0, crc=0, chunk_size=n, chain=1)  # chain 0: servers only


def test_a_write_that_would_wait_too_long_for_the_budget_is_answered_busy(hold: HoldServer) -> None:
    a = Connection(hold.address, CLIENT, os.urandom(16))
    b = Connection(hold.address, CLIENT, os.urandom(16))
    try:
        first = a.submit(_write(1 << 20), payload=bytes(1 << 20))  # takes the whole budget and keeps it
        deadline = time.monotonic() + 10
        while not hold.service.received:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        t0 = time.monotonic()
        with pytest.raises(StripefsError) as info:
            b.submit(_write(256 << 10), payload=bytes(256 << 10)).result(10)
        assert info.value.code == ErrorCode.BUSY and info.value.errno == errno.EBUSY
        assert 0.25 <= time.monotonic() - t0 < 5  # it waited its patience, not forever
        # The refused payload was skipped: the stream is intact and b serves on.
        assert b.call(m.Ping(), timeout=10).header == {}
        assert hold.service.received == [1 << 20]  # the refused write never reached the service
        hold.release()
        assert first.result(10).header == {}
        assert b.submit(_write(256 << 10), payload=bytes(256 << 10)).result(10).header == {}
    finally:
        a.close()
        b.close()


def test_a_client_over_its_connection_cap_is_refused_busy(hold: HoldServer) -> None:
    me, other = os.urandom(16), os.urandom(16)
    mine = [Connection(hold.address, CLIENT, me) for _ in range(2)]
    theirs = Connection(hold.address, CLIENT, other)  # the cap is per client, not per server
    try:
        with pytest.raises(StripefsError) as info:
            Connection(hold.address, CLIENT, me)
        assert info.value.code == ErrorCode.BUSY and "connections" in info.value.message
        for c in (*mine, theirs):
            assert c.call(m.Ping(), timeout=10).header == {}
        mine.pop().close()
        deadline = time.monotonic() + 10
        while True:  # the server counts the closed one out once it sees the EOF
            try:
                mine.append(Connection(hold.address, CLIENT, me))
                break
            except StripefsError as exc:
                assert exc.code == ErrorCode.BUSY and time.monotonic() < deadline
                time.sleep(0.05)
        assert mine[-1].call(m.Ping(), timeout=10).header == {}
    finally:
        for c in (*mine, theirs):
            c.close()


def test_client_slots_count_per_client() -> None:
    slots = ClientSlots(1)
    assert slots.admit(b"a", "client") is None
    refusal = slots.admit(b"a", "client")
    assert refusal is not None and refusal.code == ErrorCode.BUSY
    assert slots.admit(b"b", "client") is None
    slots.release(b"a")
    assert slots.admit(b"a", "client") is None
    with pytest.raises(ValueError):
        ClientSlots(0)


def test_byte_budget_refuses_after_its_patience_or_at_once_behind_a_full_queue() -> None:
    async def main() -> None:
        budget = ByteBudget(100)
        await budget.acquire(100)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(budget.acquire_within, 60, 10)  # queued
            await trio.sleep(0.01)
            t0 = trio.current_time()
            assert not await budget.acquire_within(20, 0.05)  # queues, runs out of patience
            assert 0.04 <= trio.current_time() - t0 < 1
            assert budget.waiting == 60 and budget.refused == 1
            nursery.start_soon(budget.acquire_within, 50, 10)  # queued: 110 bytes wait now
            await trio.sleep(0.01)
            t0 = trio.current_time()
            assert not await budget.acquire_within(1, 10)  # a whole budget is queued: no wait
            assert trio.current_time() - t0 < 1 and budget.refused == 2
            budget.release(100)
            await trio.sleep(0.01)
            assert budget.used == 60 and budget.waiting == 50  # in order: the first one got in
            budget.release(60)
        assert budget.used == 50 and budget.waiting == 0  # and then the second

    trio.run(main)


@pytest.mark.parametrize("env,args,said", [
    ({}, ["--busy-after", "-1"], "--busy-after: must be a number of seconds >= 0"),
    ({}, ["--max-client-connections", "0"], "--max-client-connections: must be a positive integer"),
    ({"STRIPEFS_STORAGE_PAYLOAD_BUDGET": "lots"}, [], "--payload-budget: must be a positive integer, got 'lots'"),
])
def test_bad_load_bounds_are_usage_errors(tmp_path, env: dict[str, str], args: list[str], said: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "stripefs.storage", "--root", str(tmp_path), "--metadata", "127.0.0.1:1",
                           "--cluster", str(tmp_path / "none.json"), *args], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and said in proc.stderr, proc.stderr


def test_busy_backoff_grows_with_jitter_and_is_capped() -> None:
    rng = random.Random(7)
    for attempt in range(12):
        step = min(BUSY_DELAY * 2 ** attempt, BUSY_DELAY_MAX)
        delays = {busy_delay(attempt, rng) for _ in range(50)}
        assert all(step / 2 <= d <= step for d in delays)
        assert len(delays) > 40  # jittered: clients turned away together do not return together


def test_the_client_backs_off_from_busy_and_reports_ebusy_only_when_its_budget_runs_out(tmp_path, monkeypatch) -> None:
    from stripefs.fsclient.testing import LocalCluster

    monkeypatch.setenv(CLIENT_CONNECTIONS_ENV, "1")  # the storage server admits one connection per client
    cluster = LocalCluster.start(str(tmp_path / "c"), servers=1, chunk_size=256 * 1024)
    data = os.urandom(600 * 1024)
    try:
        server = cluster.data["servers"][0]
        address = (server["host"], server["port"])
        with cluster.client(conns_per_server=2) as c:  # wants two; makes do with the one it gets
            c.write_bytes("/two", data)
            assert c.read_bytes("/two") == data
        with cluster.client(retry_for=1.0) as c:
            # Another connection under this client's id takes its only slot: every chunk
            # request meets BUSY (at the handshake) until the budget runs out.
            squatter = Connection(address, c._core.config.secret, c._core.client_id)
            t0 = time.monotonic()
            with pytest.raises(OSError) as info:
                c.write_bytes("/busy", data)
            assert info.value.errno == errno.EBUSY, info.value
            assert time.monotonic() - t0 >= 1.0  # retried for the whole budget first
            c._core.retry_for = 20.0
            threading.Timer(0.5, squatter.close).start()  # the slot frees up mid-write
            t0 = time.monotonic()
            c.write_bytes("/later", data)
            assert time.monotonic() - t0 >= 0.4
            assert c.read_bytes("/later") == data
        with cluster.client(retry_for=20.0) as c:  # the batch read ring waits it out too
            squatter = Connection(address, c._core.config.secret, c._core.client_id)
            threading.Timer(0.5, squatter.close).start()
            ring = ReadRing(c)
            dest = bytearray(len(data))
            t0 = time.monotonic()
            assert ring.read([(memoryview(dest), ring.open("/two"), 0, len(data))]) == [len(data)]
            assert time.monotonic() - t0 >= 0.4 and dest == data
    finally:
        cluster.down()


@pytest.mark.slow
def test_64_client_processes_writing_to_one_storage_server(tmp_path) -> None:
    # The full-size run (64 x 4 MiB against an 8 MiB budget) is `python -m stripefs.bench.load_bench`.
    budget = 1 << 20  # four 256 KiB pieces: 64 clients sending two each overrun it
    out = run_load(str(tmp_path / "c"), clients=64, size=512 * 1024, budget=budget, busy_after=0.05,
                   chunk_size=256 * 1024, timeout=120)
    print(out)
    assert out["server_alive"], "the storage server died under load"
    assert out["failures"] == {} and out["acknowledged"] == 64, out["failures"]
    assert out["corrupt"] == []
    assert out["busy_answers_logged"] > 0, "the flood never met the budget: the test proves nothing"
    # The budget bounds payload buffers; the rest is per-connection state (128 connections).
    assert out["server_peak_growth_mib"] < (budget >> 20) + 48, out
