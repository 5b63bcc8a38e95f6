"""Directory attributes the FUSE daemon answers the kernel's GETATTR with, without a
round trip, while they are recent (see :class:`DirAttrs`)."""

from __future__ import annotations

import dataclasses

import trio

from stripefs.wire import Attr

__all__ = ["DirAttrs"]


class DirAttrs:
    """Directory attributes fetched from the metadata service, with this mount's own
    changes applied, for at most ``ttl`` seconds after the fetch.

    After every create and unlink the kernel drops the parent directory's attributes
    and asks for them again before the next one (its permission check, under
    ``default_permissions``): one metadata round trip per name for nothing new. This
    answers from what the service said recently instead, with the directory's times
    moved to those of this mount's change (the service stamps the parent with the same
    clock reading it gives the new or unlinked inode). An answer carries only the
    seconds left of ``ttl`` as its attribute timeout, so together with the kernel's
    cache nothing is served older than ``ttl`` after it was fetched: the staleness
    towards other clients is the attribute timeout's, as without this cache.

    Caveats:

    * Only creates and unlinks of non-directories are applied; any other change this
      mount makes to a directory drops it (the next GETATTR asks the service).
    * The applied times rely on the service stamping the parent with the child's time
      (``tests/fuse/test_small_ops.py`` checks they match to the nanosecond).
    * An answer that was in flight across any change of this mount is not kept
      (:attr:`version` is one counter for all directories: rare changes cost a refetch).
    """

    MAX = 100_000

    def __init__(self, ttl: float):
        self.ttl = ttl
        self.known: dict[int, tuple[Attr, float]] = {}  # ino -> (attributes, when they expire)
        self.version = 0  # moves at every change this mount makes: see put

    def put(self, attr: Attr, version: int) -> None:
        """Attributes from the service, asked for when :attr:`version` was ``version``
        (directories only; others are ignored). An answer that crossed a change of this
        mount in flight may predate it: it is not kept."""
        if attr.is_dir and self.ttl > 0 and version == self.version:
            if len(self.known) >= self.MAX:  # bounded: forget everything rather than grow
                self.known.clear()
            self.known[attr.ino] = (attr, trio.current_time() + self.ttl)

    def get(self, ino: int) -> tuple[Attr, float] | None:
        """The attributes of ``ino`` and the seconds they stay valid, or None."""
        hit = self.known.get(ino)
        if hit is None:
            return None
        left = hit[1] - trio.current_time()
        if left <= 0:
            del self.known[ino]
            return None
        return hit[0], left

    def touched(self, ino: int, when_ns: int) -> None:
        """This mount added or removed a non-directory name in ``ino``; the service
        stamped the directory ``when_ns``. The expiry stays the fetch's."""
        self.version += 1
        hit = self.known.get(ino)
        if hit is not None:
            self.known[ino] = (dataclasses.replace(hit[0], mtime_ns=when_ns, ctime_ns=when_ns), hit[1])

    def drop(self, ino: int) -> None:
        self.version += 1
        self.known.pop(ino, None)

    def clear(self) -> None:
        self.version += 1
        self.known.clear()
