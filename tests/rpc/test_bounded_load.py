"""Bounded load: a server out of file descriptors keeps serving once some are free; a
server-wide byte budget bounds the payload bytes held at once."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import trio

import rpc
from rpc._server import ByteBudget
from wire import messages as m

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
                conn = rpc.Connection(("127.0.0.1", port), "s", os.urandom(16))
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
