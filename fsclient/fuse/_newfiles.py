"""New files of the mount whose name is made at their first ``fsync``/``close``.

Through the mount a small durable file (``open(O_CREAT|O_TRUNC)``, write, ``fsync``,
close) cost two metadata commits in series: the kernel's CREATE (a create, and its log
sync) before the first byte, and the length commit after the last. The native client
already writes a new file under an inode number reserved ahead and makes the name with
its length in one ``CommitFiles`` (``fsclient/core/_pending.py``); here the mount does
the same: CREATE answers the kernel with a reserved inode at once (from a per-directory
pool, one ``ReserveFiles`` per many files), and the file's first FSYNC or FLUSH makes
the name with its length.

When a CREATE is answered this way (:meth:`NewFiles.may_defer`):

* not ``O_EXCL`` (an exclusive create must fail at once when the name exists), and
* this daemon told the kernel "no such name" for it within :data:`FRESH` seconds (the
  kernel looks a name up before it creates it): the name was absent a moment ago, so
  making it later is what a create would have done. A name another client makes in
  between is found at the commit: that file is opened truncated and the bytes move to it
  (``_pending``), and the kernel's entry, which names the reserved inode, is dropped
  (:meth:`NewFiles.made`).

What this mount shows meanwhile is the file, from the moment of CREATE: the kernel has
its entry; a lookup or ``stat`` of it, a listing of its directory, a rename or anything
else that asks the service makes the name first (``PendingCreates.settle_for``), as does
a timer after ``DEFER_AGE`` seconds. Other clients see the file at its ``fsync``/close
(close-to-open). Nothing is acknowledged as durable that is not: FSYNC returns after
the bytes and the name with its length are committed. ``STRIPEFS_DEFER_CREATE=0``
turns this off (every CREATE is a create, as before).
"""

from __future__ import annotations

import errno
import logging
import os
import stat

import pyfuse3
import trio

from stripefs.wire import Attr, StripefsError

from ..core import AsyncClient, Client, StripeFile
from ..core._pending import DEFER
from ..core._wholefiles import Reservation, Reservations, reservations, reserve_request

__all__ = ["FRESH", "NewFiles"]

log = logging.getLogger(__name__)

FRESH = 1.0  # seconds a "no such name" answer vouches for the name's absence at CREATE
_MISSING_MAX = 4096  # answers remembered at most (a bound, not a cache: each is used once)


class NewFiles:
    """The mount's deferred creates: the "no such name" answers just given, the pool of
    reserved inodes per directory, and the files created from it still open."""

    def __init__(self, client: Client, aio: AsyncClient) -> None:
        self.client, self.aio = client, aio
        self.enabled = DEFER
        self.pool = Reservations()
        self._missing: dict[tuple[int, bytes], float] = {}  # (parent, name) -> when told absent
        self.open: dict[int, tuple[int, bytes]] = {}  # reserved ino -> (parent, name), until released

    def said_missing(self, parent: int, name: bytes) -> None:
        """The daemon answered the kernel's lookup of ``name`` in ``parent``: no such name."""
        if len(self._missing) >= _MISSING_MAX:
            self._missing.clear()
        self._missing[(parent, name)] = trio.current_time()

    def may_defer(self, parent: int, name: bytes, flags: int) -> bool:
        """May this CREATE make its name later (module docstring)?"""
        told = self._missing.pop((parent, name), None)
        return (self.enabled and not flags & os.O_EXCL and told is not None
                and trio.current_time() - told <= FRESH)

    async def reservation(self, parent: int) -> Reservation | None:
        """A reserved inode for a new file in directory ``parent``; None when none could be
        had (the caller creates as before, and reports what that says)."""
        got = self.pool.take_now(parent)
        if got is not None:
            return got
        count = self.pool.refill_size(parent)
        try:
            fresh = reservations(await self.aio.call(reserve_request(parent, count)), count)
        except StripefsError:
            return None
        self.pool.add(parent, fresh[1:])
        return fresh[0]

    def new_file(self, parent: int, name: bytes, mode: int, uid: int, gid: int, res: Reservation) -> StripeFile:
        """The file object of a new file under ``res``, its name pending in the client's table."""
        text = os.fsdecode(name)
        pending = self.client._core.pending.new(text, res, stat.S_IMODE(mode), uid, gid, parent_ino=parent)
        attr: Attr = pending.attr()
        self.open[attr.ino] = (parent, name)
        return StripeFile(self.client, f"<inode {attr.ino}>", attr, readable=True, writable=True, pending=pending)

    async def made(self, ino: int | None, file: StripeFile) -> tuple[int, bool] | None:
        """After an fsync or flush of ``ino``: once its name is made, ``(its directory, whether
        the name was ours)`` (the first time only; None before and after). The name is not
        ours when another client made it between our lookup and the commit: the bytes went
        to that file, and the kernel's entry, which names the reserved inode nobody made, is
        dropped before the caller answers (the next open looks the name up again)."""
        where = self.open.get(ino) if ino is not None else None
        if where is None or file.pending:
            return None
        del self.open[ino]
        if file.attr.ino == ino:
            return where[0], True
        log.info("new file %r in directory %d existed at its commit: written to inode %d", where[1], where[0],
                 file.attr.ino)
        await trio.to_thread.run_sync(_forget_entry, where[0], where[1])
        return where[0], False

    def released(self, ino: int) -> None:
        """The last handle of ``ino`` was closed."""
        self.open.pop(ino, None)


def _forget_entry(parent: int, name: bytes) -> None:
    try:
        pyfuse3.invalidate_entry(parent, name)
    except OSError as exc:  # the kernel dropped it already
        if exc.errno != errno.ENOENT:
            raise
