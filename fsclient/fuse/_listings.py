"""Directory listings the FUSE daemon serves again, without a round trip, while they
are recent and this mount has not changed the directory (see :class:`Listings`)."""

from __future__ import annotations

import itertools
import stat
from typing import Any

import trio

from stripefs.wire import DirEntry

__all__ = ["Listings", "Page"]

_serials = itertools.count(1)
FILL_WINDOW = 2.0  # seconds: two "no such name" answers from the service within it: a directory being filled
BIG_AGAIN = 30.0  # seconds before the names of a directory found larger than a page are fetched again


class Page:
    """One page of a directory listing as the metadata service gave it: the entries
    after the name ``after``, in the service's name order, with their attributes.

    Attributes:
        entries: the entries, in name order.
        more: another page follows this one.
        index: name -> position in ``entries``.
        fetched: when the service was asked (trio clock): what the timeouts handed to
            the kernel count from, however often the page is served.
        replies: what the daemon tells the kernel of each entry, built at the first
            listing that serves the page (the daemon's business).
        serial: unique in the daemon; readdir offsets name the page by it.
        keep: seconds after ``fetched`` it is kept for (set by :meth:`Listings.put`).
    """

    __slots__ = ("entries", "fetched", "index", "keep", "more", "replies", "serial")

    def __init__(self, entries: list[DirEntry], more: bool, fetched: float):
        self.entries = entries
        self.more = more and bool(entries)
        self.index = {e.name: i for i, e in enumerate(entries)}
        self.fetched = fetched
        self.replies: list[Any] | None = None
        self.serial = next(_serials)  # names the page in the offsets handed to the kernel
        self.keep = 0.0


class Listings:
    """Pages of directory listings kept for at most ``ttl`` seconds after the metadata
    service gave them, unless this mount changes the directory meanwhile.

    ``os.listdir`` through the mount is OPENDIR + READDIRPLUS: every listing was a
    round trip that carries every entry's attributes (the service reads and the daemon
    decodes them all), by far the largest cost of listing a directory. A page kept here
    serves the next listings of the same directory for the rest of ``ttl``; the daemon
    hands the kernel only the seconds of its attribute and entry timeouts that are left
    since the page was fetched, so nothing reaches the kernel older than the timeouts
    allow, as if the kernel had cached it itself. Another client's create or unlink shows
    in a listing at most ``ttl`` after this mount last fetched it.

    This mount's own changes show at once: the daemon drops a directory's pages when it
    creates, removes or renames a name in it (and the pages of the directories that list
    it: its times and link count changed), and every page when it changes an inode's
    attributes (setattr, xattrs, links, a file written and closed: the pages of whichever
    directories hold that inode are stale). A listing fetched while such a change was in
    flight may predate it and is not kept (:attr:`version`, one counter for all).

    The names of a directory listed in full (one page), or made by this mount (empty),
    are kept too, for the same ``ttl`` from the fetch (or the mkdir), with this mount's
    own creates and removals applied: a lookup of a name that is not there is answered
    "no such name" from them (:meth:`absent`), without a round trip -- the lookup the
    kernel sends before every create. That is as stale towards other clients as a kept
    listing: another client's new name may be reported missing for the rest of ``ttl``.

    Caveats:

    * ``ttl`` is the smaller of the attribute and entry timeouts; 0 keeps nothing.
    * Bounded by :attr:`MAX_ENTRIES` entries in all: past it, everything is forgotten.
    * Names are kept only for directories of at most one page (1,000 entries).
    * Under a listing lease (the daemon's, see ``_kernelleases.py``) a page is kept no
      longer than the lease lives (``keep``) nor than ``ttl``; names are kept for the
      lease's whole life: the lease is what makes them coherent (another client's create,
      unlink or rename in the directory takes it back first, and that drops them at once;
      this mount's own changes leave it, and are applied here). The "no such name" answers
      made from leased names are then not for the kernel to keep (:meth:`leased`).
    * A directory being filled (two of its lookups in :data:`FILL_WINDOW` seconds were
      round trips that said "no such name", :meth:`filling`) gets its names fetched under
      a lease (:meth:`fetching`, :meth:`put_fetched`): one listing instead of a lookup per
      new name. Not for directories of more than one page (:meth:`too_big`).
    """

    MAX_ENTRIES = 50_000  # ~0.7 KB each, with its attributes and what it tells the kernel

    def __init__(self, ttl: float):
        self.ttl = ttl
        self.pages: dict[int, dict[str, Page]] = {}  # directory ino -> after -> page
        self.entries = 0  # in all the pages kept
        self.holders: dict[int, set[int]] = {}  # directory ino -> directories whose kept pages list it
        # directory ino -> (all its names, when asked, seconds kept from then, under a lease)
        self.names: dict[int, tuple[set[str], float, float, bool]] = {}
        self.named = 0  # names in all the sets kept
        self.version = 0  # moves at every drop: see put
        # directory ino -> this mount's changes to its names while a fetch of them is in
        # flight: (added, removed, outcome unknown) -- applied to the fetched names
        self._inflight: dict[int, tuple[set[str], set[str], list[bool]]] = {}
        self._misses: dict[int, tuple[int, float]] = {}  # directory ino -> (misses, the first's time)
        self._big: dict[int, float] = {}  # directory ino -> until when it is not fetched (see too_big)

    def get(self, ino: int, after: str) -> Page | None:
        """The page of ``ino`` after ``after`` if it is younger than ``ttl``, else None."""
        pages = self.pages.get(ino)
        page = pages.get(after) if pages is not None else None
        if page is None:
            return None
        if trio.current_time() - page.fetched >= page.keep:
            self.drop(ino)  # its other pages are no younger in general: fetch them afresh too
            return None
        return page

    def put(self, ino: int, after: str, page: Page, version: int, keep: float | None = None) -> None:
        """Keep ``page`` of ``ino``, asked for when :attr:`version` was ``version``; an
        answer that crossed a change of this mount in flight may predate it: not kept.
        ``keep``: seconds after its fetch it may be kept at most (a lease's), else ``ttl``."""
        page.keep = self.ttl if keep is None else min(self.ttl, keep)
        if page.keep <= 0 or version != self.version:
            return
        if self.entries + len(page.entries) > self.MAX_ENTRIES:  # bounded: forget rather than grow
            self.clear()
        pages = self.pages.setdefault(ino, {})
        old = pages.get(after)
        self.entries += len(page.entries) - (len(old.entries) if old is not None else 0)
        pages[after] = page
        for e in page.entries:
            if stat.S_ISDIR(e.mode):
                self.holders.setdefault(e.ino, set()).add(ino)

    def drop(self, ino: int) -> None:
        """Forget the pages of directory ``ino`` (this mount changed it), and those of
        the directories that list it (they show its old times and link count); its names
        are kept (see :meth:`added`, :meth:`removed`)."""
        self.version += 1
        self._forget_pages(ino)
        for holder in self.holders.pop(ino, ()):
            self._forget_pages(holder)

    def _forget_pages(self, ino: int) -> None:
        pages = self.pages.pop(ino, None)
        if pages:
            self.entries -= sum(len(p.entries) for p in pages.values())

    def clear(self) -> None:
        """Forget every page (this mount changed attributes some of them may show)."""
        self.version += 1
        self.pages.clear()
        self.holders.clear()
        self.entries = 0

    # -- names --------------------------------------------------------------------------
    def put_names(self, ino: int, names: set[str], asked: float, version: int, keep: float | None = None) -> None:
        """Keep ``names``, every name of directory ``ino`` as of ``asked`` (trio clock),
        asked for when :attr:`version` was ``version`` (else not kept, as :meth:`put`);
        ``keep`` as :meth:`put`'s (given: the names are under a lease)."""
        kept = self.ttl if keep is None else keep  # leased: kept while the lease lives
        if self.ttl <= 0 or kept <= 0 or version != self.version:
            return
        self._store_names(ino, names, asked, kept, keep is not None)

    def _store_names(self, ino: int, names: set[str], asked: float, kept: float, leased: bool) -> None:
        if self.named + len(names) > self.MAX_ENTRIES:
            self.names.clear()
            self.named = 0
        self._drop_names(ino)
        self.names[ino] = (names, asked, kept, leased)
        self.named += len(names)

    # -- a directory being filled: its names fetched under a lease --------------------------
    def missed(self, parent: int) -> None:
        """The metadata service answered a lookup in ``parent``: no such name."""
        now = trio.current_time()
        count, first = self._misses.get(parent, (0, now))
        if now - first > FILL_WINDOW:
            count, first = 0, now
        if len(self._misses) >= 4096:
            self._misses.clear()
        self._misses[parent] = (count + 1, first)

    def filling(self, parent: int) -> bool:
        """Should ``parent``'s names be fetched (under a lease) before its next lookup goes
        to the service? When two lookups there said "no such name" within
        :data:`FILL_WINDOW` s, no fetch is in flight, and it was not found too big lately."""
        hit = self._misses.get(parent)
        if hit is None or hit[0] < 2 or parent in self._inflight or self.ttl <= 0:
            return False
        if trio.current_time() - hit[1] > FILL_WINDOW:
            del self._misses[parent]
            return False
        return self._big.get(parent, 0.0) <= trio.current_time()

    def fetching(self, ino: int) -> None:
        """A fetch of every name of ``ino`` is sent now: this mount's changes to them until
        it is answered are recorded, to be applied to its answer (:meth:`put_fetched`)."""
        self._inflight[ino] = (set(), set(), [False])

    def put_fetched(self, ino: int, names: set[str] | None, asked: float, keep: float) -> None:
        """Keep the fetched ``names`` of ``ino`` for ``keep`` seconds after ``asked`` (a
        lease's), with this mount's changes made meanwhile; None: the fetch failed."""
        added, removed, unknown = self._inflight.pop(ino, (set(), set(), [True]))
        self._misses.pop(ino, None)
        if names is None or unknown[0] or keep <= 0 or self.ttl <= 0:
            return
        self._store_names(ino, (names | added) - removed, asked, keep, True)

    def too_big(self, ino: int) -> None:
        """``ino`` has more names than one page: its lookups go to the service, and its
        names are not fetched again for :data:`BIG_AGAIN` seconds."""
        if len(self._big) >= 4096:
            self._big.clear()
        self._big[ino] = trio.current_time() + BIG_AGAIN

    def absent(self, parent: int, name: str) -> float | None:
        """The seconds for which ``name`` is known not to be in ``parent``, or None."""
        hit = self.names.get(parent)
        if hit is None or name in hit[0]:
            return None
        left = hit[1] + hit[2] - trio.current_time()
        if left <= 0:
            self._drop_names(parent)
            return None
        return left

    def leased(self, parent: int) -> bool:
        """Are the names kept of ``parent`` under a lease (its invalidation forgets them)?"""
        hit = self.names.get(parent)
        return hit is not None and hit[3]

    def added(self, parent: int, name: str) -> None:
        """This mount made ``name`` in ``parent``."""
        flight = self._inflight.get(parent)
        if flight is not None:
            flight[0].add(name)
            flight[1].discard(name)
        hit = self.names.get(parent)
        if hit is not None and name not in hit[0]:
            hit[0].add(name)
            self.named += 1

    def removed(self, parent: int, name: str) -> None:
        """This mount removed ``name`` from ``parent``."""
        flight = self._inflight.get(parent)
        if flight is not None:
            flight[1].add(name)
            flight[0].discard(name)
        hit = self.names.get(parent)
        if hit is not None and name in hit[0]:
            hit[0].discard(name)
            self.named -= 1

    def forget_names(self, ino: int) -> None:
        """Forget the names of ``ino`` (a change of this mount whose outcome is unknown, or
        the lease on them was taken back); a fetch of them in flight is not kept either."""
        flight = self._inflight.get(ino)
        if flight is not None:
            flight[2][0] = True
        self._drop_names(ino)

    def _drop_names(self, ino: int) -> None:
        hit = self.names.pop(ino, None)
        if hit is not None:
            self.named -= len(hit[0])
