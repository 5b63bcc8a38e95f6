"""Sending response frames on a server connection from worker threads.

Bulk and latency-critical replies leave the trio loop: ``sendfile`` of a chunk
file, a big buffer, or a whole small read (disk read and send in one thread
hop: ~650 µs per 4 KiB read on this kind of machine, where a second hop back
to the loop costs a visible share of it). The socket is non-blocking (trio
owns it), so these helpers wait with ``poll`` when the kernel buffer is full.

Frames from different senders must not interleave. Every send of a connection
holds its *wire lock*, a ``threading.Lock``: trio tasks take it without blocking
(``acquire(blocking=False)``, retried after short sleeps while a thread holds it),
threads take it blocking. A ``to_thread`` call made by a trio task that holds the
lock sends on the task's behalf (``ServerConn.reply_from_thread``); a
:class:`ConnThread`, the connection's own reply thread, takes the lock per frame.
"""

from __future__ import annotations

import logging
import os
import queue
import select
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import trio

from stripefs import wire
from stripefs.wire import NEED_DATA, ErrorCode, FrameHead, Message, RequestReceived, ServerConnection, StripefsError

__all__ = ["ConnThread", "ThreadReply", "send_all", "sendfile_all"]

log = logging.getLogger(__name__)

WAIT_MS = 60_000  # a peer that reads nothing for a minute is gone
THREAD_READ = 4096  # what a receiving ConnThread asks of the socket at once (a few pipelined requests)

# What a receiving thread asks about each request without payload: the job that answers it
# right there, or None to hand the request (and receiving) back to the trio side.
ThreadJob = Callable[[FrameHead, Message], "Callable[..., None] | None"]


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

    ``lock`` is the connection's wire lock, taken around the frame; None when the
    caller already holds it on the thread's behalf.
    """

    def __init__(self, sock_fd: int, machine: ServerConnection, head: FrameHead,
                 lock: threading.Lock | None = None):
        self._fd = sock_fd
        self._machine = machine
        self._lock = lock
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
        if self._lock is None:
            self._send_frame(prefix, payload, file)
        else:
            with self._lock:
                self._send_frame(prefix, payload, file)

    def _send_frame(self, prefix: bytes, payload: Any, file: tuple[int, int, int] | None) -> None:
        self.torn = True  # until the whole frame is out
        if file is not None:
            send_all(self._fd, prefix)
            sendfile_all(self._fd, *file)
        elif payload is not None:
            send_all(self._fd, prefix, payload)
        else:
            send_all(self._fd, prefix)
        self.torn = False


def _as_error(exc: Exception, what: str) -> StripefsError:
    if isinstance(exc, StripefsError):
        return exc
    if isinstance(exc, OSError):
        return wire.error_from_oserror(exc)
    log.error("%s failed", what, exc_info=exc)  # a bug in a reply function: answer EIO, keep serving
    return StripefsError(ErrorCode.IO, f"internal error: {type(exc).__name__}: {exc}")


class _Receive:
    """The job that makes a :class:`ConnThread` take over receiving."""

    __slots__ = ("serve", "back")

    def __init__(self, serve: ThreadJob, back: Callable[[Any], None]):
        self.serve, self.back = serve, back


class ConnThread:
    """A connection's own reply thread: runs ``fn(reply, *args)`` jobs one after another,
    each answering its request itself (a :class:`ThreadReply` that takes the wire lock).

    It may also take over the receiving side (:meth:`receive`): it then reads and decodes
    the frames itself (blocking ``poll`` and ``read``), answers those its ``serve`` function
    has a job for right there, and hands the first other event (a request it does not
    serve, one with a payload, a bad request, the end of the stream) or error back to
    the trio side with ``back``, after which it runs queued jobs again.

    The trio side submits without awaiting anything and is never woken back: a
    request served here costs no worker-thread hand-off and no loop wake-up. A job
    that raises before answering is answered with the error (errno mapping as on the
    trio side). A frame that went out in part calls ``tear`` (the peer sees EOF, the
    trio reader its end). :meth:`close` hands the socket's descriptor over: the thread
    closes it when it ends, so a descriptor number is never reused while the thread
    may still write to it.
    """

    def __init__(self, sock_fd: int, machine: ServerConnection, lock: threading.Lock, tear: Callable[[], None],
                 name: str = "stripefs-conn"):
        self._fd = sock_fd
        self._machine = machine
        self._lock = lock
        self._tear = tear
        self._jobs: queue.SimpleQueue[tuple[FrameHead, Callable[..., None], tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._close_fd = -1
        self.closing = False
        self._token = trio.lowlevel.current_trio_token()  # made on the loop
        self._room_waiters: deque[trio.Event] = deque()
        # True from the trio side's hand-over (:meth:`receive`) until the thread hands
        # receiving back; meanwhile the trio side submits no jobs.
        self.receiving = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def queued(self) -> int:
        """Jobs submitted and not yet started (approximate while the thread runs)."""
        return self._jobs.qsize()

    def submit(self, head: FrameHead, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
        self._jobs.put((head, fn, args))

    def receive(self, serve: ThreadJob, back: Callable[[Any], None]) -> None:
        """Take over receiving once the jobs submitted so far are done (trio side, with no
        read of the socket in progress there). ``serve(head, msg)`` picks the requests
        answered on this thread; ``back(item)`` is called on this thread with the event or
        exception that ends it (the trio side then receives again)."""
        self.receiving = True
        self._jobs.put(_Receive(serve, back))

    async def wait_for_room(self, most: int) -> None:
        """Wait (on the loop) until fewer than ``most`` jobs are queued. The thread wakes
        the loop only when someone waits here."""
        while self._jobs.qsize() >= most:
            event = trio.Event()
            self._room_waiters.append(event)
            if self._jobs.qsize() < most:  # the thread took one before it could see us
                return
            await event.wait()

    def _wake_room_waiters(self) -> None:
        # After a job left the queue: the waiter appended itself before checking the size,
        # and we took the job before looking for waiters, so one of the two sees the other.
        while self._room_waiters:
            try:
                self._token.run_sync_soon(self._room_waiters.popleft().set)
            except (trio.RunFinishedError, IndexError):
                pass

    def close(self, fd: int, *, abandon: bool) -> None:
        """No more jobs; close ``fd`` (the connection's detached socket) when the thread ends.
        ``abandon``: skip the jobs still queued (else they are answered first; a peer that
        stops reading costs each at most the send timeout, ``WAIT_MS``)."""
        self._close_fd = fd
        self.closing = abandon
        self._jobs.put(None)

    def _run(self) -> None:
        try:
            while (job := self._jobs.get()) is not None:
                if self._room_waiters:
                    self._wake_room_waiters()
                if type(job) is _Receive:
                    item = self._receive(job.serve) if not self.closing else EOFError("connection closed")
                    self.receiving = False
                    job.back(item)
                elif not self.closing:
                    try:
                        self._one(*job)
                    except Exception:  # never leave the jobs behind this one unanswered
                        log.exception("reply thread job failed")
                        self._tear()
        finally:
            if self._close_fd >= 0:
                os.close(self._close_fd)

    def _receive(self, serve: ThreadJob) -> Any:
        """Receive and answer requests until one is not for this thread: returns that
        event (or the exception that ended receiving) for the trio side."""
        machine, fd = self._machine, self._fd
        ready = select.poll()
        ready.register(fd, select.POLLIN)
        try:
            while True:
                while n := machine.next_read_size():
                    ready.poll()  # readable, or the stream ended or failed: the read says which
                    try:
                        data = os.read(fd, max(n, THREAD_READ))
                    except BlockingIOError:
                        continue
                    machine.receive_data(data)
                event = machine.next_event()
                if event is NEED_DATA:
                    continue
                if type(event) is not RequestReceived or event.payload_len:
                    return event
                try:
                    fn = serve(event.head, event.message)
                except Exception:  # noqa: BLE001 -- the trio side serves it and answers any failure
                    fn = None
                if fn is None:
                    return event
                self._one(event.head, fn, (event.message,))
                if self.closing:
                    return EOFError("connection closed")
        except Exception as exc:  # noqa: BLE001 -- raised on the trio side, where the connection ends
            return exc

    def _one(self, head: FrameHead, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
        reply = ThreadReply(self._fd, self._machine, head, self._lock)
        try:
            fn(reply, *args)
            if not reply.sent:
                raise RuntimeError(f"{getattr(fn, '__name__', fn)} returned without answering")
        except Exception as exc:  # noqa: BLE001 -- answered with the error, as handlers' failures are
            if not reply.sent:
                try:
                    reply.send_error(_as_error(exc, getattr(fn, "__name__", repr(fn))))
                except Exception:  # noqa: BLE001, S110 -- the socket failed: torn below if part of the frame went out
                    pass
        if reply.torn:
            self._tear()
