"""Requests a service answers at once (``Service.answer_now``): no task per request, in
order with the stream, never held up by slow requests of the same connection."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import trio

from stripefs import wire
from stripefs.rpc import Connection, ServerConn, Service, serve_rpc
from stripefs.wire import ErrorCode, FrameHead, Message, StripefsError
from stripefs.wire import messages as m

SECRET = "test-secret"
CLIENT = wire.role_credential(SECRET, "client")


class Quick(Service):
    """Ping answered at once; GetAttr of ino 0 refused at once, of ino 1 a bug at once;
    ReadChunk answered by a task after ``offset`` ms."""

    role = "storage"

    def __init__(self) -> None:
        self.handled: list[str] = []

    def answer_now(self, conn: ServerConn, head: FrameHead, msg: Message) -> dict[str, Any] | None:
        if isinstance(msg, m.Ping):
            return {}
        if isinstance(msg, m.GetAttr) and msg.ino == 0:
            raise StripefsError(ErrorCode.NOT_FOUND, "no inode 0")
        if isinstance(msg, m.GetAttr) and msg.ino == 1:
            raise RuntimeError("a bug")
        return None

    async def handle(self, conn: ServerConn, head: FrameHead, msg: Message, payload: Any) -> None:
        self.handled.append(type(msg).__name__)
        if isinstance(msg, m.ReadChunk):
            await trio.sleep(msg.offset / 1000)
            await conn.send(head, {"length": 0, "chunk_length": 0})
        else:
            await conn.send(head, {})


@pytest.fixture
def served() -> Iterator[tuple[Quick, tuple[str, int]]]:
    holder: dict[str, Any] = {}
    ready = threading.Event()
    service = Quick()

    async def main() -> None:
        holder["token"] = trio.lowlevel.current_trio_token()
        with trio.CancelScope() as holder["scope"]:
            async with trio.open_nursery() as nursery:
                holder["address"] = await nursery.start(lambda task_status: serve_rpc(
                    service, "127.0.0.1", 0, secret=SECRET, task_status=task_status))
                ready.set()

    thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
    thread.start()
    assert ready.wait(10)
    yield service, holder["address"]
    trio.from_thread.run_sync(holder["scope"].cancel, trio_token=holder["token"])
    thread.join(10)


def test_requests_answered_at_once_skip_the_handler_and_overtake_slow_ones(served) -> None:
    service, address = served
    c = Connection(address, CLIENT, os.urandom(16), expect_role="storage")
    try:
        slow = c.submit(m.ReadChunk(ino=1, index=0, offset=2000, length=0))
        start = time.monotonic()
        for _ in range(20):
            c.call(m.Ping(), timeout=5)
        with pytest.raises(FileNotFoundError):
            c.call(m.GetAttr(ino=0), timeout=5)
        with pytest.raises(StripefsError) as bug:  # a bug is answered EIO; the connection goes on
            c.call(m.GetAttr(ino=1), timeout=5)
        assert bug.value.code == ErrorCode.IO
        assert time.monotonic() - start < 1.5  # not queued behind the slow request
        assert not slow.done()
        c.call(m.GetAttr(ino=2), timeout=5)  # answer_now passes it on to a task
        slow.result(timeout=5)
        assert service.handled == ["ReadChunk", "GetAttr"]
    finally:
        c.close()
