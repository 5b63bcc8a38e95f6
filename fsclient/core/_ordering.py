"""Ordering of overlapping writes in flight.

Pieces of a write go out in parallel over many connections, and a storage
server runs every request in its own task, so two writes to the same bytes
that are in flight at once may land in either order. A later write to a range
must therefore not be sent before every earlier write that overlaps it has been
acknowledged (a write that started first could otherwise land last and undo the
later one). Writes to disjoint ranges keep going out in parallel.

:class:`WriteOrder` keeps, per inode, the byte ranges of the pieces in flight and
the future each resolves when its piece is acknowledged (or has failed). A new
write registers its pieces in program order (in the caller's thread, before any
byte is sent) and gets the futures of the earlier overlapping pieces: it waits
for those, and only those, before sending.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Iterable

__all__ = ["WriteOrder", "Ticket"]


class Ticket:
    """One registered write: its pieces' futures and the earlier pieces it must wait for.

    Args:
        pieces: one future per registered range, in registration order; the
            writer resolves each when its piece is acknowledged or has failed.
        waits: futures of earlier overlapping pieces still in flight at registration.
    """

    def __init__(self, pieces: list[Future], waits: list[Future]):
        self.pieces = pieces
        self.waits = waits

    def ready(self) -> bool:
        """Have all earlier overlapping writes finished?"""
        return all(f.done() for f in self.waits)

    def wait(self) -> None:
        """Block until every earlier overlapping piece has finished (success or failure).

        An earlier piece that failed does not stop this write: its error reaches
        whoever waits on the earlier write, and this write's bytes are newer.
        """
        for f in self.waits:
            f.exception()  # waits; never raises the piece's error here

    def finish(self, exc: BaseException | None = None) -> None:
        """Resolve every piece not resolved yet (all done, or the write gave up).

        Args:
            exc: the write's error, or None when it succeeded.
        """
        for f in self.pieces:
            if not f.done():
                if exc is None:
                    f.set_result(None)
                else:
                    f.set_exception(exc)


class WriteOrder:
    """Per-inode registry of write pieces in flight (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inflight: dict[int, list[tuple[int, int, Future]]] = {}

    def register(self, ino: int, ranges: Iterable[tuple[int, int]]) -> Ticket:
        """Register a new write's pieces, ``[(start, end), ...]`` in file offsets.

        Args:
            ino: the file's inode.
            ranges: the byte ranges of the write's pieces (half-open).

        Returns:
            A ticket: wait on it before sending, resolve each piece as it is acknowledged,
            and call :meth:`Ticket.finish` at the end whatever happened.
        """
        ranges = list(ranges)
        pieces: list[Future] = [Future() for _ in ranges]
        with self._lock:
            entries = self._inflight.setdefault(ino, [])
            waits = [f for start, end in ranges for s, e, f in entries if s < end and start < e and not f.done()]
            for (start, end), fut in zip(ranges, pieces):
                entries.append((start, end, fut))
        for (start, end), fut in zip(ranges, pieces):
            fut.add_done_callback(lambda f, s=start, e=end: self._forget(ino, s, e, f))
        return Ticket(pieces, list(dict.fromkeys(waits)))

    def _forget(self, ino: int, start: int, end: int, fut: Future) -> None:
        with self._lock:
            entries = self._inflight.get(ino)
            if entries is None:
                return
            try:
                entries.remove((start, end, fut))
            except ValueError:
                pass
            if not entries:
                del self._inflight[ino]

    def pending(self, ino: int) -> int:
        """How many pieces of ``ino`` are registered and not finished (for tests)."""
        with self._lock:
            return sum(1 for *_, f in self._inflight.get(ino, ()) if not f.done())
