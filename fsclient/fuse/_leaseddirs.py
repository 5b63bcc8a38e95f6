"""Directories whose files' attributes the daemon holds under one listing lease, so that
the kernel's LOOKUP of a file there is answered without a round trip.

A dataloader opens thousands of files of a few directories, each once per epoch, in
random order: every open is a LOOKUP the kernel has not seen (nothing for its own cache
to answer), and each was a leased ``Lookup`` round trip to the metadata service -- half
of the requests a small file's read made, and most of the service's work for it.

Once lookups in one directory found files there in a row (``core._attrcache.DirStreaks``:
two round trips within two seconds), the daemon asks for the whole directory at once, in a
task of its own (the lookup that made it due does not wait; the lookups there that come
while it is in flight wait for its first page, :meth:`LeasedDirs.wait`): one ``Readdir``
with attributes and layouts under a lease (the service leases the directory and every
file's attributes it shows: ``metadata/_lease_grants.py``), page by page (:data:`PAGE`
entries each, each page under a lease of its own, all kept only when no invalidation came
between the first page's request and the last page's answer), so that a directory of up
to :data:`MAX_LISTING` files is leased and no one request holds the service long. A page
is checked as it arrives but its entries are made only as they are looked up
(``wire.ListingPage``): making a thousand held the daemon's loop 2-3 ms, and every
request of the mount with it. While those leases live, and nothing changed since as far
as this client knows (no invalidation heard, no mutation of its own begun: the same test
the OPEN after a leased LOOKUP makes), a lookup of a file named there is answered from it.
The kernel keeps such an answer for what is left of the lease, registered under its
page's lease (``KernelLeases.also``): another client's change to the directory or to one
of its files takes the lease back, which drops the listing here and every entry and
attribute told from it in the kernel, before the change is acknowledged.

Caveats:
    * Files only: a subdirectory's attributes change with every name made in it, the
      service does not lease them with the listing, and its lookups go to the service.
    * Directories of more than :data:`MAX_LISTING` entries are not fetched: their
      lookups go to the service, as before.
    * Any invalidation, or any mutation of this client, ends the use of every listing
      (it is dropped at its next lookup and fetched again when lookups call for it): an
      unrelated change costs one refetch, never a stale answer.
"""

from __future__ import annotations

import time

import trio

from stripefs.fsclient.core._attrcache import LISTING_MAX as MAX_LISTING
from stripefs.fsclient.core._attrcache import LISTING_PAGE as PAGE
from stripefs.fsclient.core._attrcache import DirStreaks
from stripefs.wire import Attr
from stripefs.wire._types import ListingPage

__all__ = ["LeasedDirs", "PAGE", "MAX_LISTING"]

MAX_ENTRIES = 200_000  # entries kept in all (past it, everything is forgotten)
WAIT = 0.25  # seconds a lookup waits at most for a listing in flight before it asks the service


class _Dir:
    __slots__ = ("pages", "expires", "state")

    def __init__(self, pages: list[tuple[dict[str, int], ListingPage, int]], expires: float, state: tuple[int, int]):
        self.pages = pages  # (name -> row, the page, its lease id) each
        self.expires = expires  # monotonic
        self.state = state  # the client's (mutations, invalidations) when it was asked for


class LeasedDirs:
    """Directory ino -> its files' attributes under one lease per page (see the module
    docstring). Used on the trio loop only."""

    def __init__(self) -> None:
        self.dirs: dict[int, _Dir] = {}
        self.entries = 0
        self.streaks = DirStreaks()
        self.pending: dict[int, trio.Event] = {}  # directory ino -> set when its first page is in (see wait)

    def get(self, parent: int, name: str, state: tuple[int, int] | None) -> tuple[Attr, int] | None:
        """``(attributes, lease id)`` of file ``name`` in ``parent`` while its listing is
        leased and nothing changed since (``state``: the client's ``(mutations,
        invalidations)`` now, None while a mutation of its own is unanswered); None for a
        name the listing does not hold, or one that is not a file's. The entry is made
        from its page now (a page's entries are not made as it arrives: ``ListingPage``)."""
        d = self.dirs.get(parent)
        if d is None or state is None:  # (a mutation of this client in flight: asked, not dropped)
            return None
        if state != d.state or d.expires <= time.monotonic():
            self.drop(parent)
            return None
        for rows, page, lease_id in d.pages:
            row = rows.get(name)
            if row is not None:
                attr = page.entry(row).attr
                return (attr, lease_id) if attr is not None and attr.is_file else None
        return None

    def looked_up(self, parent: int, attr: Attr) -> bool:
        """A lookup in ``parent`` went to the service and found ``attr``: should the
        directory's listing be fetched now (then :meth:`put` follows, whatever happens)?"""
        due = attr.is_file and parent not in self.dirs and self.streaks.hit(parent)
        if due:
            self.pending[parent] = trio.Event()
        return due

    async def wait(self, parent: int) -> None:
        """Let a lookup in ``parent`` wait for the listing being fetched, if one is, until
        its first page is in (a listing of one page: the whole) or :data:`WAIT` passed.

        Lookups of a directory's files that come while its listing is in flight used to
        ask the service each, racing the listing for the same CPUs: at a dataloader's
        start every reader's first files did, and were the slowest of the run. Waiting,
        they are answered from the listing, which the service and the daemon then make
        without competing lookups; a lookup waits for at most one page (a larger listing
        lets its waiters go at its first page)."""
        event = self.pending.get(parent)
        if event is not None:
            with trio.move_on_after(WAIT):
                await event.wait()

    def first_page_in(self, parent: int) -> None:
        """The listing of ``parent`` has its first page (or ended): its waiters go on."""
        event = self.pending.pop(parent, None)
        if event is not None:
            event.set()

    def put(self, parent: int, pages: list[tuple[ListingPage, int]] | None, left: float,
            state: tuple[int, int] | None, *, more: bool = False) -> None:
        """The listing of ``parent`` that :meth:`looked_up` called for came back: keep its
        ``pages`` (each with its lease id) for ``left`` seconds (None or ``left`` 0:
        nothing kept -- an error, no lease, a change meanwhile; ``more``: too large to
        fetch). ``state``: the client's as it was when the listing was asked for (None: a
        mutation of its own was in flight, nothing is kept)."""
        self.streaks.done(parent, too_big=more)
        try:
            if pages is None or left <= 0 or state is None:
                return
            size = sum(len(page) for page, _ in pages)
            if self.entries + size > MAX_ENTRIES:
                self.clear()
            self.drop(parent)
            kept = [(dict(zip(page.names, range(len(page)))), page, lease_id) for page, lease_id in pages]
            self.dirs[parent] = _Dir(kept, time.monotonic() + left, state)
            self.entries += size
        finally:
            self.first_page_in(parent)  # the lookups waiting for it go on (see wait)

    def drop(self, ino: int) -> None:
        """Forget the listing of directory ``ino`` (its lease was taken back, or it aged)."""
        d = self.dirs.pop(ino, None)
        if d is not None:
            self.entries -= sum(len(page) for _, page, _ in d.pages)

    def clear(self) -> None:
        self.dirs.clear()
        self.entries = 0
