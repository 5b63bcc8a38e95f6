"""The access log of a mount or a client (``--access-log FILE``, off by default): one line
per operation, read back by ``stripefs profile``.

A line is tab-separated: ``time op size seconds status path`` -- the wall-clock time the
operation ended (Unix seconds), its name (``read``, ``write``, ``lookup``, ``open`` ...),
the bytes it moved (0 for a metadata operation), how long it took, ``ok`` or the errno
name it failed with, and the path it concerned as far as the logger knows it (``?``
when it does not: a FUSE daemon learns paths from the lookups it serves).

Recording is cheap and never blocks: a line goes into a bounded ring that a daemon
thread writes out a few times a second.

Caveats:
    * The ring holds :data:`RING` lines; a burst faster than the writer drains it loses
      the oldest unwritten lines (counted in :attr:`AccessLog.dropped`, and said in the log).
    * The file is bounded: past ``max_bytes`` it is renamed to ``FILE.1`` (replacing the
      previous one) and a new one started, so a log never holds more than twice that.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import dataclass

__all__ = ["AccessLog", "Access", "parse_line", "RING", "MAX_BYTES"]

RING = 65536  # lines waiting for the writer thread
MAX_BYTES = 64 << 20  # a log file rolls over past this size
FLUSH_EVERY = 0.2  # seconds between the writer's passes


@dataclass(frozen=True, slots=True)
class Access:
    """One logged operation."""

    time: float
    op: str
    size: int
    seconds: float
    status: str
    path: str


def parse_line(line: str) -> Access | None:
    """The :class:`Access` a log line holds, or None for a line that is not one."""
    parts = line.rstrip("\n").split("\t", 5)
    if len(parts) != 6:
        return None
    try:
        return Access(float(parts[0]), parts[1], int(parts[2]), float(parts[3]), parts[4], parts[5])
    except ValueError:
        return None


class AccessLog:
    """A bounded, asynchronous access log written to ``path``.

    Args:
        path: the log file (appended to).
        max_bytes: size past which the file rolls over to ``path + ".1"``.
        ring: lines held for the writer thread at most.
    """

    def __init__(self, path: str, *, max_bytes: int = MAX_BYTES, ring: int = RING):
        self.path = path
        self.max_bytes = max_bytes
        self._ring: deque[tuple[float, str, int, float, str, str]] = deque(maxlen=ring)
        self.recorded = 0
        self.written = 0
        self._closed = threading.Event()
        self._file = open(path, "a", buffering=1 << 16)
        self._thread = threading.Thread(target=self._run, name="stripefs-access-log", daemon=True)
        self._thread.start()

    @property
    def dropped(self) -> int:
        """Lines lost because the ring was full (approximate while recording goes on)."""
        return max(0, self.recorded - self.written - len(self._ring))

    def record(self, op: str, size: int, seconds: float, status: str = "ok", path: str = "?") -> None:
        """Log one operation that just ended (any thread; never blocks)."""
        self.recorded += 1
        self._ring.append((time.time(), op, size, seconds, status, path))

    def flush(self) -> None:
        """Write out every line recorded so far (the caller's thread)."""
        ring, out = self._ring, []
        while ring:
            try:
                t, op, size, seconds, status, path = ring.popleft()
            except IndexError:
                break
            out.append(f"{t:.6f}\t{op}\t{size}\t{seconds:.6f}\t{status}\t{_clean(path)}\n")
        if not out:
            return
        self._file.write("".join(out))
        self._file.flush()
        self.written += len(out)
        if self._file.tell() >= self.max_bytes:
            self._file.close()
            os.replace(self.path, self.path + ".1")
            self._file = open(self.path, "a", buffering=1 << 16)

    def _run(self) -> None:
        while not self._closed.wait(FLUSH_EVERY):
            try:
                self.flush()
            except (OSError, ValueError):
                pass  # a full disk or a closed file: keep recording, try again

    def close(self) -> None:
        """Stop the writer and write what is left."""
        self._closed.set()
        self._thread.join(timeout=5)
        try:
            self.flush()
        finally:
            self._file.close()


def _clean(path: str) -> str:
    """A path as one field: no tab or newline can split the line."""
    return path.replace("\t", " ").replace("\n", " ")
