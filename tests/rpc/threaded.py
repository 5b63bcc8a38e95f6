"""A trio ``serve_rpc`` server running on a thread of its own, for tests that talk to it
with the blocking client from the test's thread."""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Iterator
from typing import Any, Callable

import trio

from stripefs.rpc import Service, serve_rpc


class ThreadedServer:
    """``serve_rpc(service, "127.0.0.1", 0, secret=..., **options)`` on a trio run in a
    daemon thread; ``address`` once started, ``stop()`` cancels it.

    Args:
        before: awaited in the trio run before the server starts (e.g. to hold tokens
            of trio's default thread limiter).
    """

    def __init__(self, service: Service, secret: str, *,
                 before: Callable[[], Any] | None = None, **options: Any):
        self.service = service
        self.address: tuple[str, int] = ("", 0)
        ready = threading.Event()

        async def main() -> None:
            self.token = trio.lowlevel.current_trio_token()
            if before is not None:
                await before()
            with trio.CancelScope() as self.scope:
                async with trio.open_nursery() as nursery:
                    self.address = await nursery.start(lambda task_status: serve_rpc(
                        service, "127.0.0.1", 0, secret=secret, task_status=task_status, **options))
                    ready.set()

        self.thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
        self.thread.start()
        assert ready.wait(10), "the server did not start within 10 s"

    def run_sync(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the server's trio thread."""
        return trio.from_thread.run_sync(fn, *args, trio_token=self.token)

    def stop(self) -> None:
        self.run_sync(self.scope.cancel)
        self.thread.join(10)


def temp_file(data: bytes) -> Iterator[str]:
    """A temporary file holding ``data``, removed afterwards (for a yield-fixture)."""
    fd, path = tempfile.mkstemp()
    os.write(fd, data)
    os.close(fd)
    yield path
    os.unlink(path)
