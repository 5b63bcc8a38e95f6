"""Eviction on the cluster: list the live segments, retire the victims, reclaim them later.

Eviction is two steps apart in time, so that no reader is ever handed a page whose bytes
are being taken away:

1. **retire**: rename ``seg/NAME`` to ``retired/<retire ns>~NAME`` (one atomic metadata
   operation per segment). From then on no new get finds the segment: a get resolves the
   segment by its ``seg/`` path after reading the index, and a missing one is a miss.
   The inode and its chunks are untouched, so reads already under way complete.
2. **reclaim**: a retired segment is unlinked (its chunks freed) only ``grace`` seconds
   after it was retired. A get looks a segment up at most ``read_timeout`` before its
   reads finish or are cancelled (``ReadRing.cancel``: nothing lands afterwards), so
   with ``grace > read_timeout`` (plus the client's ``attr_timeout`` when it runs
   without leases, plus the clock skew between hosts) no reader can still be using it.
   The index entries that still point into the segment go with it (those a later put
   re-pointed elsewhere stay).

Any process of the namespace may run either step: a retired segment left behind by a
process that died is reclaimed by the next pass of anyone.

Caveats:
    * Removing a key's index entry at reclaim checks, then unlinks: a put of the same
      key that lands between the two loses its new entry (a later miss, never bad
      bytes). Dangling entries (their segment reclaimed) read as misses.
"""

from __future__ import annotations

import time

from stripefs.fsclient import Client
from stripefs.wire import StripefsError, messages as m

from ._format import ENTRY, BadRecord, decode_entry, key_name, parse_target, segment_pages, table_offset
from ._meta import call_all
from ._namespace import Namespace
from ._policy import SegmentInfo, choose_victims
from ._stats import Counters

__all__ = ["Evictor"]

RENAME_NOREPLACE = 1


class Evictor:
    """Capacity, TTL and reclamation for one namespace, as seen from one process.

    Args:
        client: the cluster's client.
        ns: the namespace.
        page_size: bytes per page.
        capacity: the most page bytes the namespace holds.
        ttl: seconds a page lives after its put (None: no limit).
        grace: seconds between retiring a segment and unlinking it.
        counters: where evictions are counted.
    """

    def __init__(self, client: Client, ns: Namespace, *, page_size: int, capacity: int, ttl: float | None,
                 grace: float, counters: Counters):
        self.client, self.ns, self.page_size, self.capacity = client, ns, page_size, capacity
        self.ttl_ns = None if ttl is None else int(ttl * 1e9)
        self.grace_ns = int(grace * 1e9)
        self.counters = counters
        self._next_reclaim = 0.0

    def listing(self) -> list[SegmentInfo]:
        """The live segments (one Readdir round trip per 1,000)."""
        out = []
        for e in self.client.scandir(self.ns.seg, attrs=True):
            try:
                pages = segment_pages(e.name)
            except BadRecord:
                continue  # not ours: left alone, not counted
            if e.attr is not None:
                out.append(SegmentInfo(e.name, pages, e.attr.atime_ns, e.attr.mtime_ns))
        return out

    def occupancy(self) -> tuple[int, int]:
        """``(page bytes, segments)`` of the live segments."""
        segs = self.listing()
        return sum(s.pages for s in segs) * self.page_size, len(segs)

    def make_room(self, incoming: int) -> None:
        """Retire expired segments, then the least recently used, until ``incoming`` page
        bytes fit; reclaim what is due (at most every ``grace / 4`` seconds)."""
        victims = choose_victims(self.listing(), page_size=self.page_size, capacity=self.capacity,
                                 incoming=incoming, now_ns=time.time_ns(), ttl_ns=self.ttl_ns)
        self.retire(victims)
        if time.monotonic() >= self._next_reclaim:
            self.reclaim()

    def retire(self, victims: list[SegmentInfo]) -> int:
        """Rename the victims into ``retired/``; returns the pages this call retired (a
        segment another process retired first is not counted twice)."""
        stamp = time.time_ns()
        msgs = [m.Rename(parent=self.ns.seg_ino, name=v.name, new_parent=self.ns.retired_ino,
                         new_name=f"{stamp}~{v.name}", flags=RENAME_NOREPLACE) for v in victims]
        done = [v for v, r in zip(victims, call_all(self.client, msgs)) if not isinstance(r, StripefsError)]
        pages = sum(v.pages for v in done)
        self.counters.add(evictions=pages, evicted_segments=len(done))
        return pages

    def reclaim(self, *, now_ns: int | None = None) -> int:
        """Unlink the retired segments whose grace has passed, with the index entries that
        still point into them, and stale ``tmp/`` entries. Returns the segments unlinked."""
        self._next_reclaim = time.monotonic() + self.grace_ns / 4e9
        now_ns = time.time_ns() if now_ns is None else now_ns
        due = [n for n in self.client.listdir(self.ns.retired) if _stamp(n) + self.grace_ns <= now_ns]
        for name in due:
            self._drop_index_of(name)
        gone = self.client.unlink_many([f"{self.ns.retired}/{n}" for n in due])
        stale = [n for n in self.client.listdir(self.ns.tmp) if _stamp(n) + self.grace_ns <= now_ns]
        self.client.unlink_many([f"{self.ns.tmp}/{n}" for n in stale])
        count = sum(1 for r in gone if not isinstance(r, StripefsError))
        self.counters.add(reclaimed_segments=count)
        return count

    def _drop_index_of(self, retired_name: str) -> None:
        """Unlink the index entries that still point into a retired segment."""
        segment = retired_name.partition("~")[2]
        try:
            pages = segment_pages(segment)
            table = self.client.read_bytes(f"{self.ns.retired}/{retired_name}",
                                           table_offset(pages, self.page_size), pages * ENTRY)
        except (BadRecord, StripefsError):
            return  # unreadable: its entries dangle, and read as misses
        paths = []
        for i in range(len(table) // ENTRY):
            try:
                paths.append(self.ns.idx_path(key_name(decode_entry(table[i * ENTRY:(i + 1) * ENTRY]).key)))
            except (BadRecord, ValueError):
                continue
        found = self.client.stat_many(paths, follow=False)
        ours = []
        for path, attr in zip(paths, found):
            try:
                if not isinstance(attr, StripefsError) and parse_target(attr.target).segment == segment:
                    ours.append(path)
            except BadRecord:
                ours.append(path)  # not a location at all: no use to anyone
        self.client.unlink_many(ours)


def _stamp(name: str) -> int:
    """The nanosecond stamp a ``retired/`` or ``tmp/`` name starts with (0 if none: due at once)."""
    head = name.partition("~")[0]
    return int(head) if head.isdigit() else 0
