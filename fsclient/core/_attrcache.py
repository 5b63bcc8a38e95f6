"""The client's attribute cache: ``stat`` of a path nobody changed answered locally.

Entries live ``timeout`` seconds (the bound on seeing another client's change,
like the FUSE mount's ``attr_timeout``). This client's own changes show at once:
every metadata mutation it makes drops what it may have changed -- by path and
inode for ``CreatePath``/``UnlinkPath`` (plus every cached directory, whose
times and link counts move), everything for any other mutation. ``open``
revalidates (close-to-open). Failed lookups are never cached.

A lookup that raced with one of this client's mutations is not stored: the
cache remembers the mutation count a lookup started under and keeps its answer
only if no mutation began since.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from wire import Attr, Message, messages as m


class AttrCache:
    """Path -> attributes for ``timeout`` seconds (thread-safe)."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._lock = threading.Lock()
        self._by_path: dict[str, tuple[float, Attr]] = {}
        self._by_ino: dict[int, set[str]] = {}
        self.mutations = 0  # mutations begun by this client

    def get(self, path: str) -> Attr | None:
        entry = self._by_path.get(path)
        if entry is None or entry[0] < time.monotonic():
            return None
        return entry[1]

    def put(self, path: str, attr: Attr, started: int) -> None:
        """Remember ``attr`` for ``path`` unless a mutation began since ``started``."""
        with self._lock:
            if self.mutations != started:
                return
            self._drop(path)
            self._by_path[path] = (time.monotonic() + self.timeout, attr)
            self._by_ino.setdefault(attr.ino, set()).add(path)

    def _drop(self, path: str) -> None:
        entry = self._by_path.pop(path, None)
        if entry is not None:
            paths = self._by_ino.get(entry[1].ino)
            if paths is not None:
                paths.discard(path)
                if not paths:
                    del self._by_ino[entry[1].ino]

    def _drop_ino(self, ino: int) -> None:
        for path in list(self._by_ino.get(ino, ())):
            self._drop(path)

    def begin(self, msg: Message[Any]) -> None:
        """A mutation is about to be sent."""
        with self._lock:
            self.mutations += 1

    def done(self, msg: Message[Any], reply: Any) -> None:
        """A mutation was answered (``reply``) or failed (a ``StripefsError``)."""
        with self._lock:
            if isinstance(msg, (m.CreatePath, m.UnlinkPath)) and not isinstance(reply, BaseException):
                self._drop(msg.path)
                self._drop_ino(reply.attr.ino)
                for path in [p for p, (_, a) in self._by_path.items() if a.is_dir]:
                    self._drop(path)
                if isinstance(msg, m.CreatePath):
                    self._by_path[msg.path] = (time.monotonic() + self.timeout, reply.attr)
                    self._by_ino.setdefault(reply.attr.ino, set()).add(msg.path)
            else:
                self._by_path.clear()
                self._by_ino.clear()
