"""Sending response frames on a server connection from worker threads.

Bulk and latency-critical replies leave the trio loop: ``sendfile`` of a chunk
file, a big buffer, or a whole small read (disk read and send in one thread
hop: ~650 µs per 4 KiB read on this kind of machine, where a second hop back
to the loop costs a visible share of it). The socket is non-blocking (trio
owns it), so these helpers wait with ``poll`` when the kernel buffer is full.

Frames from different tasks must not interleave, and a ``trio.Lock`` cannot be
taken from a thread: the trio task holds the connection's send lock around the
``to_thread`` call and hands the thread a :class:`ThreadReply`, which may send
one frame. ``rpc._server.ServerConn.reply_from_thread`` does exactly that.
"""

from __future__ import annotations

import os
import select
from typing import Any

from wire import ErrorCode, FrameHead, ServerConnection, StripefsError

__all__ = ["ThreadReply", "send_all", "sendfile_all"]

WAIT_MS = 60_000  # a peer that reads nothing for a minute is gone


def _wait_fd(fd: int, events: int) -> None:
    p = select.poll()
    p.register(fd, events)
    if not p.poll(WAIT_MS):
        raise StripefsError(ErrorCode.TIMEOUT, "peer stopped reading")


def sendfile_all(sock_fd: int, file_fd: int, offset: int, count: int) -> None:
    """Send ``count`` bytes of a file with ``sendfile`` on a non-blocking socket (worker thread).

    Raises:
        StripefsError: IO when the file is shorter than ``count``; TIMEOUT when the peer stalls.
        OSError: the socket failed.
    """
    while count > 0:
        try:
            n = os.sendfile(sock_fd, file_fd, offset, count)
        except BlockingIOError:
            _wait_fd(sock_fd, select.POLLOUT)
            continue
        if n == 0:
            raise StripefsError(ErrorCode.IO, "file shorter than announced payload")
        offset += n
        count -= n


def send_all(sock_fd: int, *buffers: Any) -> None:
    """Write every buffer, in order, on a non-blocking socket (worker thread).

    Several buffers go out with one ``writev`` where the kernel takes them all, so a
    header and a small payload leave in one system call.

    Raises:
        StripefsError: TIMEOUT when the peer stalls.
        OSError: the socket failed.
    """
    views = [v for v in (memoryview(b).cast("B") for b in buffers) if len(v)]
    while views:
        try:
            n = os.writev(sock_fd, views)
        except BlockingIOError:
            _wait_fd(sock_fd, select.POLLOUT)
            continue
        while n:
            if n >= len(views[0]):
                n -= len(views.pop(0))
            else:
                views[0] = views[0][n:]
                n = 0


class ThreadReply:
    """Answers one request from a worker thread while the trio side holds the send lock.

    Only valid inside the thread call it was made for. ``send`` or ``send_error``
    exactly once. If sending fails after some bytes of the frame went out, the
    stream is corrupt: :attr:`torn` tells the connection to shut down.
    """

    def __init__(self, sock_fd: int, machine: ServerConnection, head: FrameHead):
        self._fd = sock_fd
        self._machine = machine
        self.head = head
        self.sent = False
        self.torn = False

    def send(self, header: dict[str, Any], *, payload: Any = None, file: tuple[int, int, int] | None = None) -> None:
        """Send the response: ``header`` and a buffer ``payload`` or ``file=(fd, offset, length)``.

        Raises:
            RuntimeError: the request was already answered.
            StripefsError, OSError: the send failed (see :attr:`torn`).
        """
        plen = len(payload) if payload is not None else (file[2] if file else 0)
        self._send(self._machine.send_response(self.head, header, plen), payload, file)

    def send_error(self, error: StripefsError) -> None:
        """Answer with an error frame."""
        self._send(self._machine.send_error(self.head, error), None, None)

    def _send(self, prefix: bytes, payload: Any, file: tuple[int, int, int] | None) -> None:
        if self.sent:
            raise RuntimeError("a request is answered once")
        self.sent = True
        self.torn = True  # until the whole frame is out
        if file is not None:
            send_all(self._fd, prefix)
            sendfile_all(self._fd, *file)
        elif payload is not None:
            send_all(self._fd, prefix, payload)
        else:
            send_all(self._fd, prefix)
        self.torn = False
