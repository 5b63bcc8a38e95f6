"""Metadata requests from trio code without a worker thread per request.

The request frame is sent from the loop's thread (a small frame into a socket
with megabytes of send buffer) and the answer, completed by the connection's
reader thread, wakes the waiting task through ``run_sync_soon``: one wake-up
instead of a ``trio.to_thread`` round trip (~100-150 us each on a loaded 2-core
VM). Only opening a connection (connect + handshake) goes to a worker thread.

Caveats:

* ``sendall`` of a request frame could block the loop only if the socket's send
  buffer were full: tens of thousands of small requests unanswered on one
  connection (the service stops reading a connection at 64 in flight).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from stripefs.rpc import Reply, abandon
from stripefs.wire import ErrorCode, Layout, Message, ReplyMessage, StripefsError, messages as m

from ._core import _RETRIED, REQUEST_TIMEOUT
from ._metaretry import MetaRetry
from ._proc import my_pid

if TYPE_CHECKING:
    from ._core import ClientCore

R = TypeVar("R", bound=ReplyMessage)


async def _result(fut: "Future[Reply]", timeout: float) -> Reply:
    token = trio.lowlevel.current_trio_token()
    done = trio.Event()

    def wake(_: Future) -> None:
        try:
            token.run_sync_soon(done.set)
        except trio.RunFinishedError:  # the loop is gone; nobody is waiting
            pass

    fut.add_done_callback(wake)
    with trio.move_on_after(timeout) as scope:
        await done.wait()
    if scope.cancelled_caught:
        abandon(fut)
        raise StripefsError(ErrorCode.TIMEOUT, "metadata request timed out")
    return fut.result()


async def acall(core: "ClientCore", msg: Message[R], timeout: float = 60.0) -> R:
    """:meth:`ClientCore.call` for trio code: same retries (same request id), same errors."""
    return await _acall(core, msg, timeout, raw=False)  # type: ignore[no-any-return]


async def acall_header(core: "ClientCore", msg: Message[Any], timeout: float = 60.0) -> dict[str, Any]:
    """:func:`acall` of a read, its reply's header returned as it came (not checked): the
    caller builds the reply (e.g. ``ReaddirReply.with_page``)."""
    if msg.MUTATES:
        raise TypeError(f"{type(msg).__name__} changes something: its reply is the client's to read")
    return await _acall(core, msg, timeout, raw=True)  # type: ignore[no-any-return]


async def _acall(core: "ClientCore", msg: Message[Any], timeout: float, raw: bool) -> Any:
    if core.pending.due(msg):  # names this process made are there before anything looks (_pending)
        await trio.to_thread.run_sync(core.pending.settle_for, msg)
    watch = core.attrs if msg.MUTATES else None
    if watch is not None:
        watch.begin(msg)
    reply: Any = None
    try:
        req_id = next(core._ids)
        retry = MetaRetry(core, timeout)
        while True:
            try:
                key, address = ("metadata", retry.index), core.config.addresses[retry.index]
                conn = core._meta.live_one(key, address) if core.pid == my_pid() else None
                if conn is None:  # connect (and handshake) off the loop; a forked child starts afresh there
                    conn = await trio.to_thread.run_sync(core._meta_conn, retry.index)
                left = max(retry.deadline - time.monotonic(), 0.001)
                header = (await _result(conn.submit(msg, req_id=req_id), left)).header
                core.meta_health.ok()
                break
            except StripefsError as exc:
                wait = retry.after(exc)
                if wait is None:
                    raise
                await trio.sleep(wait)
        if raw:
            return header
        reply = m.decode_reply(msg, header)
        return reply
    finally:
        if watch is not None:
            watch.done(msg, reply if reply is not None else StripefsError(ErrorCode.IO, "failed"))


async def aread_into(core: "ClientCore", ino: int, layout: Layout, file_size: int, offset: int, dest: memoryview,
                     limiter: trio.CapacityLimiter | None = None) -> int:
    """:meth:`ClientCore.read_into` for trio code: a read that one request answers on an
    open connection is sent from the loop and awaited there (no worker thread); anything
    else -- and an attempt that failed -- runs ``read_into`` on a worker thread, with its
    whole retry loop (next replica, same errors).
    """
    if offset >= file_size or not len(dest):
        return 0
    started = core.start_read(ino, layout, file_size, offset, dest)
    if started is not None:
        fut, finish = started
        try:
            return finish(await _result(fut, REQUEST_TIMEOUT))
        except StripefsError as exc:
            if exc.code not in _RETRIED:
                raise
        except BaseException:  # cancelled: nothing may land in dest once we are gone
            abandon(fut)
            raise
    return await trio.to_thread.run_sync(core.read_into, ino, layout, file_size, offset, dest, limiter=limiter)
