"""Bounded load: a server out of file descriptors keeps serving once some are free; a
server-wide byte budget bounds the payload bytes held at once."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
import trio

import rpc
from rpc import ByteBudget
from wire import messages as m, role_credential

_SERVER = textwrap.dedent("""
    import resource, sys
    import trio
    import rpc
    from wire import messages as m

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


def _pattern(i: int, n: int) -> bytes:
    return (i.to_bytes(2, "little") + b"stripefs-bounded-load") * (n // 23 + 1)


def _writer(cluster_file: str, i: int, n: int, q: Any) -> None:
    import fsclient

    try:
        with fsclient.Client(cluster_file) as c:
            c.write_bytes(f"/load/w{i}", _pattern(i, n)[:n])
        q.put((i, "ok"))  # acknowledged: the close committed the length
    except Exception as exc:  # reported, so the test shows what a client saw
        q.put((i, repr(exc)))


def _rss_peak_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


@pytest.mark.slow
def test_64_client_processes_writing_to_one_storage_server(tmp_path) -> None:
    from fsclient.testing import LocalCluster

    clients, size, budget = 64, 512 * 1024, 4 << 20
    cluster = LocalCluster.start(str(tmp_path / "c"), servers=1, chunk_size=256 * 1024)
    # The same server again, with a small budget (a restart keeps its identity and chain).
    first = cluster.data["servers"][0]
    os.kill(first["pid"], 9)
    while os.path.exists(f"/proc/{first['pid']}") and open(f"/proc/{first['pid']}/stat").read().split()[2] != "Z":
        time.sleep(0.05)
    sroot = first["root"]
    ready = str(tmp_path / "ready")
    server = subprocess.Popen(
        [sys.executable, "-m", "storage", "--root", sroot, "--metadata",
         f"{cluster.data['metadata']['host']}:{cluster.data['metadata']['port']}",
         "--cluster", os.path.join(cluster.root, "server.json"),  # servers read the cluster secret
         "--ready", ready, "--payload-budget", str(budget)],
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "storage.log", "w"))
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(ready):
            assert server.poll() is None and time.monotonic() < deadline, "storage server did not start"
            time.sleep(0.1)
        with cluster.client() as c:
            c.makedirs("/load")
            c.write_bytes("/load/warm", b"x" * size)  # the server's steady state before the flood
        base = _rss_peak_kib(server.pid)
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["fsclient"])  # 64 children forked ready, not 64 imports
        q = ctx.Queue()
        procs = [ctx.Process(target=_writer, args=(cluster.file, i, size, q)) for i in range(clients)]
        for p in procs:
            p.start()
        results = dict(q.get(timeout=240) for _ in procs)
        for p in procs:
            p.join(30)
        assert server.poll() is None, "the storage server died under load"
        assert results == {i: "ok" for i in range(clients)}
        assert all(p.exitcode == 0 for p in procs)
        growth = (_rss_peak_kib(server.pid) - base) * 1024
        print(f"storage server peak memory growth: {growth >> 20} MiB")
        # The budget bounds payload buffers; the rest is per-connection state (128 connections).
        assert growth < budget + (48 << 20), f"server memory grew by {growth >> 20} MiB"
        with cluster.client() as c:
            for i in range(clients):
                assert c.read_bytes(f"/load/w{i}") == _pattern(i, size)[:size], f"client {i}'s bytes"
    finally:
        server.kill()
        server.wait(10)
        cluster.down()
