"""The FUSE daemon's own storage connections (``fsclient/fuse/_loopreads.py``), against real
storage servers: reads in flight at once land in their own buffers, checked; a bad answer
fails its read only; a server that stops answering fails the reads in flight, and nothing
lands in their buffers afterwards; a failed connection is replaced after a while. And
through a real mount: the files come over the loop's connections, and still whole when a
replica is killed under them."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
from typing import Any

import pytest
import trio

from stripefs.fsclient.core._core import PlannedRead
from stripefs.fsclient.fuse import _loopreads
from stripefs.fsclient.fuse._loopreads import LoopReads
from stripefs.wire import ErrorCode, StripefsError

from .conftest import do_umount

pytestmark = pytest.mark.fuse


def _plan(client: Any, path: str, dest: bytearray) -> PlannedRead:
    attr = client.stat(path)
    plan = client._core.plan_read(attr.ino, attr.layout, attr.size, 0, memoryview(dest))
    assert plan is not None, "a file of one chunk is read with one request"
    return plan


def _loop_reads(client: Any) -> LoopReads:
    core = client._core
    return LoopReads(core.config.secret, core.client_id, core.config.role)


async def _connected(reads: LoopReads, plans: list[PlannedRead]) -> None:
    for p in plans:
        reads.connection(p.server_id, p.address)
    with trio.fail_after(10):
        while not all(c.ready for c in reads.conns.values()):
            await trio.sleep(0.01)


async def _read(reads: LoopReads, plan: PlannedRead) -> int:
    """One read of ``plan`` on its loop connection, which must take it: the bytes read."""
    read = reads.start(plan)
    assert read is not None
    await read.wait(10)
    return plan.finish(read.result())


def test_reads_in_flight_at_once_land_in_their_buffers(client, testdir: str) -> None:
    files = {f"{testdir}/f{k}": os.urandom(1000 + 7919 * k) for k in range(24)}
    for path, data in files.items():
        client.write_bytes(path, data)
    client.routing()
    bufs = {path: bytearray(len(data) + 4096) for path, data in files.items()}
    plans = {path: _plan(client, path, bufs[path]) for path in files}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            reads = _loop_reads(client)
            first = next(iter(plans.values()))
            assert reads.start(first) is None  # no nursery yet: the client's way
            reads.attach(nursery)
            assert reads.start(first) is None  # connecting: the client's way meanwhile
            await _connected(reads, list(plans.values()))
            started = {path: reads.start(plan) for path, plan in plans.items()}  # all in flight at once
            assert all(r is not None for r in started.values())
            for path, read in started.items():
                assert read is not None
                await read.wait(10)
                assert plans[path].finish(read.result()) == len(files[path])
                assert bytes(bufs[path][:len(files[path])]) == files[path]
            assert len(reads.conns) == len({p.server_id for p in plans.values()})
            assert all(c.ready and not c.pending for c in reads.conns.values())
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_bad_answer_fails_its_read_only(client, testdir: str) -> None:
    """A payload that fails its check, and a server's refusal (a chain the server does not
    serve): each fails its own read; the connection goes on serving the next."""
    data = os.urandom(50_000)
    client.write_bytes(f"{testdir}/f", data)
    routing = client.routing()
    buf = bytearray(len(data))
    plan = _plan(client, f"{testdir}/f", buf)

    def corrupt(header: dict[str, Any], received: memoryview) -> None:
        raise StripefsError(ErrorCode.CHECKSUM, "injected")

    other_chain = next(c for c, targets in routing.chains.items() if plan.server_id not in targets)
    bad = PlannedRead(plan.server_id, plan.address, plan.msg, corrupt, plan.dest)
    refused = PlannedRead(plan.server_id, plan.address, dataclasses.replace(plan.msg, chain=other_chain),
                          plan.check, plan.dest)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            reads = _loop_reads(client)
            reads.attach(nursery)
            await _connected(reads, [plan])
            for wrong, code in ((bad, ErrorCode.CHECKSUM), (refused, ErrorCode.STALE_ROUTING)):
                read = reads.start(wrong)
                assert read is not None
                await read.wait(10)
                with pytest.raises(StripefsError) as err:
                    read.result()
                assert err.value.code == code
                assert await _read(reads, plan) == len(data) and bytes(buf) == data  # the same connection, still serving
                buf[:] = bytes(len(buf))
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_server_named_by_host_name_is_reached(client, testdir: str) -> None:
    """A routing entry that names its server by host name (another machine's, in a
    deployment) is resolved off the loop, and read from."""
    data = os.urandom(30_000)
    client.write_bytes(f"{testdir}/f", data)
    client.routing()
    buf = bytearray(len(data))
    plan = _plan(client, f"{testdir}/f", buf)
    named = PlannedRead(plan.server_id, ("localhost", plan.address[1]), plan.msg, plan.check, plan.dest)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            reads = _loop_reads(client)
            reads.attach(nursery)
            await _connected(reads, [named])
            assert await _read(reads, named) == len(data) and bytes(buf) == data
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_server_that_cannot_be_reached_is_left_alone(client, testdir: str) -> None:
    """A connection refused: the loop goes on, reads go the client's way, and the server is
    not tried again before ``RETRY_AFTER``."""
    client.write_bytes(f"{testdir}/f", b"x" * 5000)
    client.routing()
    plan = _plan(client, f"{testdir}/f", bytearray(5000))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()  # bound, never listening: refused
        nowhere = PlannedRead(plan.server_id, closed, plan.msg, plan.check, plan.dest)

        async def main() -> None:
            async with trio.open_nursery() as nursery:
                reads = _loop_reads(client)
                reads.attach(nursery)
                assert reads.start(nowhere) is None
                conn = reads.conns[(plan.server_id, closed)]
                with trio.fail_after(5):
                    while conn.failed_at is None:
                        await trio.sleep(0.01)
                assert not conn.ready and reads.start(nowhere) is None
                assert reads.conns[(plan.server_id, closed)] is conn  # not tried again yet
                nursery.cancel_scope.cancel()

        trio.run(main)


def test_the_daemon_connects_to_every_serving_server_before_any_read(cluster) -> None:
    """``StripeOperations.attach`` opens the loop's storage connections at once: the first
    files read through a new mount do not go the client's way while they are made."""
    from stripefs.fsclient.fuse._operations import StripeOperations

    client = cluster.client()
    try:
        serving = {(i.server_id, (i.host, i.port)) for i in client.routing().servers.values() if i.state == "serving"}
        assert len(serving) == 4
        ops = StripeOperations(client)

        async def main() -> None:
            async with trio.open_nursery() as nursery:
                ops.attach(nursery)
                with trio.fail_after(10):  # no read asked for any of them
                    while {k for k, c in ops.loop_reads.conns.items() if c.ready} != serving:
                        await trio.sleep(0.01)
                nursery.cancel_scope.cancel()

        trio.run(main)
    finally:
        client.close()


def test_a_silent_server_fails_the_reads_in_flight_and_nothing_lands_later(make_cluster, monkeypatch) -> None:
    """A storage server stopped (SIGSTOP) under a read: the read fails with TIMEOUT, the
    connection is closed, the buffer stays untouched after the server answers again, and
    the connection is replaced once ``RETRY_AFTER`` has passed."""
    monkeypatch.setattr(_loopreads, "RETRY_AFTER", 0.5)
    c = make_cluster(servers=1)
    client = c.client()
    try:
        data = os.urandom(80_000)
        client.write_bytes("/f", data)
        client.routing()
        [server] = client.status().servers
        buf = bytearray(len(data))
        plan = _plan(client, "/f", buf)

        async def main() -> None:
            async with trio.open_nursery() as nursery:
                reads = _loop_reads(client)
                reads.attach(nursery)
                await _connected(reads, [plan])
                conn = reads.conns[(plan.server_id, plan.address)]
                os.kill(server.pid, signal.SIGSTOP)
                try:
                    read = reads.start(plan)
                    assert read is not None
                    await read.wait(0.3)
                    with pytest.raises(StripefsError) as err:
                        read.result()
                    assert err.value.code == ErrorCode.TIMEOUT
                    assert not conn.ready and conn.sock is None and not conn.pending
                    assert reads.start(plan) is None  # failed just now: the client's way
                finally:
                    os.kill(server.pid, signal.SIGCONT)
                await trio.sleep(0.6)  # the server answers the closed connection; nothing lands
                assert bytes(buf) == bytes(len(buf))
                assert reads.start(plan) is None  # a new connection, connecting
                await _connected(reads, [plan])
                assert await _read(reads, plan) == len(data) and bytes(buf) == data
                nursery.cancel_scope.cancel()

        trio.run(main)
    finally:
        client.close()


def _metric(scraped: Any, path: str) -> float:
    return scraped.total("stripefs_fuse_whole_reads_total", path=path)


def test_a_mount_reads_small_files_over_its_own_connections_and_survives_a_killed_replica(
        make_cluster, tmp_path, monkeypatch) -> None:
    """Through the kernel, two replicas: files rewritten elsewhere are read whole at OPEN on
    the daemon's loop connections; with one storage server killed -9, every file still
    reads back whole (from the other replica, the plain way once the loop's read failed)."""
    from stripefs._cli_top import endpoints, scrape
    from stripefs.fsclient.fuse import main as fuse_main

    monkeypatch.setenv("STRIPEFS_METRICS", "127.0.0.1:0")
    c = make_cluster(servers=2, replicas=2)
    monkeypatch.delenv("STRIPEFS_METRICS")
    client = c.client()
    mp = str(tmp_path / "m")
    os.makedirs(mp)
    try:
        files = {f"f{k}": os.urandom(20_000 + 997 * k) for k in range(40)}
        client.makedirs("/d")
        for name, data in files.items():
            client.write_bytes(f"/d/{name}", data)
        assert fuse_main(["mount", mp, "--cluster", c.file, "--metrics", "127.0.0.1:0"]) == 0
        try:
            [fuse] = [e for e in endpoints(c.file) if e.role == "fuse"]
            for name, data in files.items():  # the first read of each server connects it
                with open(f"{mp}/d/{name}", "rb") as f:
                    assert f.read() == data
            before = scrape(fuse)
            for name, data in files.items():  # new versions: the kernel's pages go, each OPEN reads
                client.write_bytes(f"/d/{name}", data[::-1])
            for name, data in files.items():
                with open(f"{mp}/d/{name}", "rb") as f:
                    assert f.read() == data[::-1]
            after = scrape(fuse)
            assert _metric(after, "loop") - _metric(before, "loop") >= len(files)
            assert _metric(after, "reread") == _metric(before, "reread")
            victim = client.status().servers[0]
            for name, data in files.items():
                client.write_bytes(f"/d/{name}", data)
            os.kill(victim.pid, signal.SIGKILL)
            for name, data in files.items():
                with open(f"{mp}/d/{name}", "rb") as f:
                    assert f.read() == data
            # The survivor's files still come over the loop's connection to it.
            assert _metric(scrape(fuse), "loop") - _metric(after, "loop") >= len(files) // 4
        finally:
            do_umount(mp)
    finally:
        client.close()
