"""The mount's write-behind budget (:class:`WriteBudget`): bytes sent to the storage
servers and not acknowledged yet, all open files together, bounded by ``write_buffer_mb``;
and the sequential write taken into a file's buffer on the trio loop within that bound
(:meth:`WriteBudget.write_on_loop`).

The write-behind buffers themselves are the native client's (:class:`~fsclient.StripeFile`);
this counts what their sends hold in flight, so that a mount writing many files at once
waits on its loop instead of queueing unbounded bytes behind the network.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Callable

import trio

from ._openfile import OpenFile

__all__ = ["WriteBudget"]


class WriteBudget:
    """Write-behind bytes in flight for the whole mount, and the writes that wait for room.

    Args:
        limit: bytes in flight (``write_buffer_mb``) at which a write that would send one
            more full buffer waits, on the loop, until some are acknowledged.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.sending_bytes = 0  # write-behind bytes in flight, sent from the loop (see write_on_loop)
        self._room = trio.Event()  # set (and replaced) whenever some of them are acknowledged

    async def write_on_loop(self, state: OpenFile, off: int, buf: bytes) -> int | None:
        """Take a sequential write into the file's write-behind buffer on the loop: no
        worker-thread hop, acknowledged once copied (as every write is once buffered).

        A write that fills the buffer sends it in the background; first it waits, on the
        loop, while two buffers of the file are in flight or while the mount's in-flight
        bytes are at ``write_buffer_mb`` (back-pressure). Returns None for any other write
        (not contiguous, a window or larger, the state busy on a thread, an error
        pending): :meth:`OpenFile.write` on a thread takes it and reports what it must.
        """
        f = state.file
        while not state.lock.locked() and state.file is f:
            fits = f.buffered_fits(off, len(buf))
            if fits is None:
                return None
            if not fits:
                blocker = f.send_blocker()
                if blocker is not None:
                    await _future_done(blocker)
                    continue
                if self.sending_bytes and self.sending_bytes + f.window > self.limit:
                    await self._room.wait()
                    continue
            # By identity, not position: sending a full buffer first reaps the sends that
            # finished, so the list can shrink while it gains the new one.
            before = set(f.sending())
            n = state.write_buffered(off, buf)
            for fut in f.sending():
                if fut not in before:
                    self.track(fut, f.window)
            return n
        return None

    def track(self, fut: "Future[None]", nbytes: int) -> None:
        """Count ``nbytes`` in flight against the mount's write budget until ``fut`` is done."""
        self.sending_bytes += nbytes
        token = trio.lowlevel.current_trio_token()

        def sent() -> None:
            self.sending_bytes -= nbytes
            self._room.set()
            self._room = trio.Event()

        fut.add_done_callback(lambda _: _soon(token, sent))


async def _future_done(fut: "Future[None]") -> None:
    """Wait on the trio loop until the concurrent future ``fut`` is done (its result is
    not taken: the file object reaps it and keeps its error)."""
    if fut.done():
        return
    done = trio.Event()
    token = trio.lowlevel.current_trio_token()
    fut.add_done_callback(lambda _: _soon(token, done.set))
    await done.wait()


def _soon(token: trio.lowlevel.TrioToken, fn: Callable[[], None]) -> None:
    """Run ``fn`` on the loop of ``token`` (from any thread); nothing once the loop ended."""
    try:
        token.run_sync_soon(fn)
    except trio.RunFinishedError:
        pass
