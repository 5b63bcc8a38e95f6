"""Which segments to evict: the decision alone, on a listing, with no I/O.

The unit of eviction is the segment (the pages of one ``batch_put``): freeing a page
inside a segment would leave a hole that only a compaction could give back. Its recency
is the segment's ``atime`` on the metadata service, which readers move forward when they
hit one of its pages (at most once per ``touch_interval`` per segment and process), so
the order is least recently used at segment granularity:

1. every segment older than the TTL goes;
2. then the least recently used ones (oldest ``atime``; name order, i.e. creation order,
   on a tie), until the pages left plus the pages coming in fit the capacity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

__all__ = ["SegmentInfo", "choose_victims"]


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """A live segment as the listing shows it."""

    name: str
    pages: int
    used_ns: int  # last use: the segment's atime (its creation, until a reader touches it)
    made_ns: int  # creation: the segment's mtime


def choose_victims(segments: Iterable[SegmentInfo], *, page_size: int, capacity: int, incoming: int,
                   now_ns: int, ttl_ns: int | None) -> list[SegmentInfo]:
    """The segments to evict so that ``incoming`` more page bytes fit in ``capacity``.

    Args:
        segments: the live segments.
        page_size: bytes per page.
        capacity: the most page bytes the namespace may hold.
        incoming: page bytes about to be added (0 for a maintenance pass).
        now_ns: the clock the segments' times are compared with.
        ttl_ns: pages live this long after their put; None: forever.

    Returns:
        The victims: expired ones first, then by least recent use.
    """
    live = list(segments)
    expired = [s for s in live if ttl_ns is not None and s.made_ns + ttl_ns <= now_ns]
    gone = {s.name for s in expired}
    rest = sorted((s for s in live if s.name not in gone), key=lambda s: (s.used_ns, s.name))
    held = sum(s.pages for s in rest) * page_size
    victims = list(expired)
    for s in rest:
        if held + incoming <= capacity:
            break
        victims.append(s)
        held -= s.pages * page_size
    return victims
