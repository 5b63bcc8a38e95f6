"""``PageStore``: fixed-size KV-cache pages by key, packed in segments on the cluster.

How a put becomes visible (each step durable before the next starts):

1. make room: the eviction pass (``_evict``) retires segments until the batch fits;
2. the pages and their table are written as one new segment file (``Client.write_bytes``:
   every chunk acknowledged by every replica, then the name and length committed in one
   metadata transaction, so the segment appears whole or not at all);
3. each page is published by one index entry (a symlink whose target is the page's
   location), 200 per ``SymlinkMany`` (one metadata transaction), all in flight together.

A writer killed anywhere leaves at most a segment without index entries (evicted in its
turn, as the least recently used) and never an index entry over bytes that are not all
there. A get reads the index (fresh from the metadata service), resolves the segments
(``seg/NAME``: a retired one is a miss), reads every page straight into its buffer and
its table entries through one read ring, and checks key, slot and CRC32C of each page
before calling it a hit.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Sequence

import crc32c

from stripefs.fsclient import Client
from stripefs.fsclient.batchread import ReadRing, RegisteredFile
from stripefs.wire import Attr, ErrorCode, StripefsError, messages as m

from ._buffers import page_view
from ._evict import Evictor
from ._format import (ENTRY, BadRecord, Entry, Location, decode_entry, encode_entry, encode_target, key_name,
                      new_segment_name, new_writer_id, parse_target, segment_pages, segment_size, table_offset)
from ._meta import call_all
from ._namespace import ROOT, open_namespace
from ._stats import Counters, StoreStats

__all__ = ["PageStore"]

PUBLISH_BATCH = 200  # index entries per SymlinkMany (the service's limit)

GET_GROUP = 256  # pages looked up and read per round (a batch of more goes in rounds)
SEGMENT_MAX = 256 << 20  # page bytes per segment, at most
_TOUCHED_MAX = 4096  # segments whose last touch a store remembers
SEGMENTS_KEPT = 16384  # complete segments a store remembers the attributes of (see _locate)
SEGMENT_TTL = 1.0  # seconds a remembered segment is used at most (less when grace - read_timeout is short)


def _client_of(target: Any) -> tuple[Client, bool]:
    """The client to use, and whether the store made it (and closes it)."""
    if isinstance(target, Client):
        return target, False
    make = getattr(target, "client", None)
    if callable(make):  # a LocalCluster
        return make(), True
    return Client(target), True


class PageStore:
    """Pages of ``page_size`` bytes by ``bytes`` key, in namespace ``namespace`` of a cluster.

    Args:
        client_or_cluster: a :class:`~stripefs.fsclient.Client` (shared, not closed by
            the store), a ``LocalCluster``, or anything ``Client()`` accepts.
        namespace: one file name; every client of a namespace must use the same
            ``page_size`` (EINVAL otherwise).
        page_size: bytes per page.
        capacity_bytes: the most page bytes the namespace holds.
        ttl: seconds a page lives after its put; None: until evicted.
        root: the directory holding the namespaces.
        grace: seconds an evicted segment is kept before its bytes are freed; must
            exceed ``read_timeout`` (and the client's ``attr_timeout`` without leases).
        read_timeout: seconds a get waits for its reads; pages not read by then are misses.
        touch_interval: a hit moves its segment's recency forward at most this often
            (per segment and process): the resolution of the LRU order.
        segment_bytes: page bytes per segment, at most; default ``capacity / 8`` (at
            most 256 MiB), so one eviction frees about an eighth of the store.

    Caveats:
        * Recency and eviction are per segment (the pages of one put), not per page.
        * Pages are copied once into a staging buffer on put (to write the segment in one
          go); gets land in the caller's buffers with no copy.
        * TTL and recency compare the metadata service's clock with this host's.
        * A deleted or overwritten page's bytes stay counted until its segment is evicted.
    """

    def __init__(self, client_or_cluster: Any, namespace: str, page_size: int, capacity_bytes: int,
                 ttl: float | None = None, *, root: str = ROOT, grace: float = 60.0, read_timeout: float = 10.0,
                 touch_interval: float = 1.0, segment_bytes: int | None = None):
        if page_size < 1 or capacity_bytes < page_size:
            raise StripefsError(ErrorCode.INVALID, "page_size must be >= 1 and capacity_bytes >= page_size")
        if ttl is not None and ttl <= 0:
            raise StripefsError(ErrorCode.INVALID, "ttl must be positive (or None)")
        if grace <= read_timeout:
            raise StripefsError(ErrorCode.INVALID, "grace must exceed read_timeout: a reader may still use a segment")
        self.page_size, self.capacity, self.ttl = page_size, capacity_bytes, ttl
        self.read_timeout, self.touch_interval = read_timeout, touch_interval
        self.client, self._own = _client_of(client_or_cluster)
        try:
            self.ns = open_namespace(self.client, root, namespace, page_size)
        except BaseException:
            self._close_client()
            raise
        per_segment = segment_bytes if segment_bytes is not None else min(SEGMENT_MAX, capacity_bytes // 8)
        self._segment_pages = max(1, min(per_segment, capacity_bytes) // page_size)
        self._writer = new_writer_id()
        self._counters = Counters()
        self._evictor = Evictor(self.client, self.ns, page_size=page_size, capacity=capacity_bytes, ttl=ttl,
                                grace=grace, counters=self._counters)
        self._zeros = bytes(page_size)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._rings: list[ReadRing] = []
        self._touched: dict[str, float] = {}  # segment -> when this process last moved its recency
        # Complete segments as stat'ed, until when each may be used: a segment's name is never
        # reused and its file never changes once whole, so a get asks the service only for
        # segments it has not met lately (one StatMany per batch instead of two). Kept for
        # less than grace - read_timeout: a segment retired meanwhile is still readable
        # while it is used (its reads end within read_timeout), as with a stat answered from
        # the client's attribute cache; a read of one that failed forgets it.
        self._segments: dict[str, tuple[RegisteredFile, float]] = {}
        self._segment_ttl = min(SEGMENT_TTL, (grace - read_timeout) / 2)

    # -- put --------------------------------------------------------------------------------
    def batch_put(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> None:
        """Store ``buffers[i]`` (``page_size`` bytes each) under ``keys[i]``; an existing key
        is replaced. Each page becomes visible only once its bytes are all durable.

        Raises:
            StripefsError: EINVAL for bad keys or buffers, or a batch over the capacity
                (nothing stored); otherwise the first error that kept pages from being
                stored, naming how many -- the pages of the batch without it are stored,
                and retrying the whole batch is safe.
        """
        names, views = self._keys(keys, len(buffers)), [page_view(b, self.page_size, writable=False) for b in buffers]
        if len(set(names)) != len(names):
            raise StripefsError(ErrorCode.INVALID, "batch_put: a key is given twice")
        if len(views) * self.page_size > self.capacity:
            raise StripefsError(ErrorCode.INVALID, f"batch_put: {len(views)} pages are more than the capacity holds")
        crcs = [crc32c.crc32c(v) for v in views]
        for start in range(0, len(views), self._segment_pages):
            part = range(start, min(len(views), start + self._segment_pages))
            self._evictor.make_room(len(part) * self.page_size)
            segment = self._write_segment([keys[i] for i in part], [views[i] for i in part], [crcs[i] for i in part])
            self._publish(segment, [names[i] for i in part], [crcs[i] for i in part], len(views))

    def _write_segment(self, keys: list[bytes], views: list[memoryview], crcs: list[int]) -> str:
        """Write one segment whole; returns its name."""
        n, ps = len(views), self.page_size
        size, at = segment_size(n, ps), table_offset(n, ps)
        buf = self.client.buffers.get(size)
        staged = memoryview(buf)[:size]
        for j, view in enumerate(views):
            staged[j * ps:(j + 1) * ps] = view
        for j, (key, crc) in enumerate(zip(keys, crcs)):
            staged[at + j * ENTRY:at + (j + 1) * ENTRY] = encode_entry(Entry(bytes(key), j, ps, crc))
        name = new_segment_name(self._writer, n)
        try:
            self.client.write_bytes(self.ns.seg_path(name), staged, exclusive=True)
        except BaseException:
            staged.release()  # a piece given up on may still be sent from buf: never reuse it
            raise
        staged.release()
        self.client.buffers.put(buf)
        with self._lock:
            self._touched[name] = time.monotonic()  # new: nothing to move forward yet
        return name

    def _publish(self, segment: str, names: list[str], crcs: list[int], batch: int) -> None:
        """One index entry per page of ``segment``, 200 per ``SymlinkMany`` (one metadata
        transaction each, all of them in flight together); an existing key's entry is
        replaced in the same transaction (a reader resolves the old page or the new one)."""
        targets = [encode_target(Location(segment, j, crc)) for j, crc in enumerate(crcs)]
        parts = [(k, min(k + PUBLISH_BATCH, len(names))) for k in range(0, len(names), PUBLISH_BATCH)]
        replies = call_all(self.client, [m.SymlinkMany(parent=self.ns.idx_ino, names=names[a:b], targets=targets[a:b],
                                                       replace=True) for a, b in parts])
        results: list[Any] = []
        for (a, b), reply in zip(parts, replies):
            results.extend([reply] * (b - a) if isinstance(reply, StripefsError)
                           else reply.per_item(names[a:b], "SymlinkMany"))
        failed = [r for r in results if isinstance(r, StripefsError)]
        stored = len(results) - len(failed)
        self._counters.add(puts=stored, bytes_in=stored * self.page_size)
        if failed:
            raise StripefsError(failed[0].code, f"batch_put: {len(failed)} of {batch} pages not stored "
                                                f"({failed[0]})") from failed[0]

    # -- get --------------------------------------------------------------------------------
    def batch_get_into(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> list[bool]:
        """Read the pages of ``keys`` into ``buffers`` (writable, ``page_size`` bytes each).

        Returns:
            The hit mask: ``True`` where ``buffers[i]`` now holds the page of ``keys[i]``,
            checked (key, slot, CRC32C). A missed page's buffer is left as it was, or
            zeroed if bytes were read into it and failed the checks.

        Raises:
            StripefsError: EINVAL for bad keys or buffers; a metadata error (the service
                unreachable past the retry budget). A failed page read is a miss, not an error.
        """
        names = self._keys(keys, len(buffers))
        views = [page_view(b, self.page_size, writable=True) for b in buffers]
        hits = [False] * len(views)
        for start in range(0, len(views), GET_GROUP):
            part = list(range(start, min(len(views), start + GET_GROUP)))
            self._get_group(part, [bytes(keys[i]) for i in part], names, views, hits)
        found = sum(hits)
        self._counters.add(hits=found, misses=len(hits) - found, bytes_out=found * self.page_size)
        return hits

    def _locate(self, names: list[str], *, count: bool = True) -> tuple[list[Location | None], dict[str, RegisteredFile]]:
        """Per name, its page's location (None: a miss; expired and garbled entries
        counted when ``count``), and the live segments those locations are in."""
        attrs = self.client.stat_many([self.ns.idx_path(n) for n in names], follow=False)
        now, ttl_ns = time.time_ns(), None if self.ttl is None else int(self.ttl * 1e9)
        locs: list[Location | None] = []
        for attr in attrs:
            loc = None
            if isinstance(attr, StripefsError):
                pass
            elif ttl_ns is not None and attr.mtime_ns + ttl_ns <= now:
                self._counters.add(expired=int(count))
            else:
                try:
                    loc = parse_target(attr.target)
                except BadRecord:
                    self._counters.add(checksum_failures=int(count))
            locs.append(loc)
        segments = sorted({loc.segment for loc in locs if loc is not None})
        known, now = self._segments, time.monotonic()
        files = {}
        for seg in segments:
            hit = known.get(seg)
            if hit is not None and hit[1] > now:
                files[seg] = hit[0]
        unknown = [seg for seg in segments if seg not in files]
        if unknown:
            if len(known) + len(unknown) > SEGMENTS_KEPT:
                known.clear()
            until = time.monotonic() + self._segment_ttl  # counted from before the question
            for seg, attr in zip(unknown, self.client.stat_many([self.ns.seg_path(s) for s in unknown])):
                if isinstance(attr, Attr) and attr.layout is not None \
                        and attr.size == segment_size(segment_pages(seg), self.page_size):
                    files[seg] = RegisteredFile(attr.ino, attr.layout, attr.size, self.ns.seg_path(seg))
                    known[seg] = (files[seg], until)
        return [loc if loc is not None and loc.segment in files else None for loc in locs], files

    def _get_group(self, part: list[int], keys: list[bytes], names: list[str], views: list[memoryview],
                   hits: list[bool]) -> None:
        locs, files = self._locate([names[i] for i in part])
        wanted = [(i, key, loc) for i, key, loc in zip(part, keys, locs) if loc is not None]
        if not wanted:
            return
        spans: dict[str, tuple[int, int]] = {}  # segment -> (first, last) slot of its table to read
        for _i, _key, loc in wanted:
            lo, hi = spans.get(loc.segment, (loc.slot, loc.slot))
            spans[loc.segment] = (min(lo, loc.slot), max(hi, loc.slot))
        scratch = memoryview(bytearray(sum((hi - lo + 1) * ENTRY for lo, hi in spans.values())))
        tables: dict[str, tuple[int, int]] = {}  # segment -> (offset in scratch, first slot)
        ring, pos, ps = self._ring(), 0, self.page_size
        for seg, (lo, hi) in spans.items():
            f = files[seg]
            tables[seg] = (pos, lo)
            ring.prepare(scratch[pos:pos + (hi - lo + 1) * ENTRY], f,
                         table_offset(segment_pages(seg), ps) + lo * ENTRY, (hi - lo + 1) * ENTRY, ("t", seg))
            pos += (hi - lo + 1) * ENTRY
        for i, _key, loc in wanted:
            ring.prepare(views[i], files[loc.segment], loc.slot * ps, ps, ("p", i))
        outcome = self._read_all(ring, len(spans) + len(wanted))
        hit_segments = set()
        for i, key, loc in wanted:
            fault = outcome.get(("p", i), ErrorCode.TIMEOUT)
            if fault is None:
                fault = outcome.get(("t", loc.segment), ErrorCode.TIMEOUT)
            if fault is None:
                at, lo = tables[loc.segment]
                fault = self._check(key, loc, scratch[at + (loc.slot - lo) * ENTRY:at + (loc.slot - lo + 1) * ENTRY],
                                    views[i])
            if fault is None:
                hits[i] = True
                hit_segments.add(loc.segment)
                continue
            views[i][:] = self._zeros  # whatever landed there is not the page
            self._segments.pop(loc.segment, None)  # removed, or not what it was: stat it again
            self._counters.add(**({"checksum_failures": 1} if fault == ErrorCode.CHECKSUM else {"read_errors": 1}))
        self._touch(hit_segments, files)

    def _read_all(self, ring: ReadRing, count: int) -> dict[tuple[str, Any], ErrorCode | None]:
        """Submit what is prepared and reap it within ``read_timeout``; per userdata, None
        (read whole) or the error. Reads still in flight at the deadline are cancelled."""
        ring.submit()
        outcome: dict[tuple[str, Any], ErrorCode | None] = {}
        deadline = time.monotonic() + self.read_timeout
        while len(outcome) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                ring.cancel()  # nothing lands in the buffers after this returns
                break
            for c in ring.wait(count - len(outcome), timeout=left):
                outcome[c.userdata] = c.error.code if c.error is not None else None
        return outcome

    def _check(self, key: bytes, loc: Location, raw: memoryview, page: memoryview) -> ErrorCode | None:
        """None if ``page`` is the page the index entry promised, else CHECKSUM."""
        try:
            entry = decode_entry(raw)
        except BadRecord:
            return ErrorCode.CHECKSUM
        if (entry.key != key or entry.slot != loc.slot or entry.page_len != self.page_size or entry.crc != loc.crc
                or crc32c.crc32c(page) != entry.crc):
            return ErrorCode.CHECKSUM
        return None

    def _touch(self, segments: set[str], files: dict[str, RegisteredFile]) -> None:
        """Move the recency of the segments hit forward (at most once per touch_interval)."""
        now = time.monotonic()
        with self._lock:
            due = [s for s in segments if now - self._touched.get(s, -1e18) >= self.touch_interval]
            if len(self._touched) > _TOUCHED_MAX:
                self._touched = {s: t for s, t in self._touched.items() if now - t < self.touch_interval}
            for s in due:
                self._touched[s] = now
        stamp = time.time_ns()
        call_all(self.client, [m.SetAttr(ino=files[s].ino, atime_ns=stamp) for s in due])  # a gone one: no matter

    def _ring(self) -> ReadRing:
        ring = getattr(self._local, "ring", None)
        if ring is None or ring.pid != os.getpid():
            ring = self._local.ring = ReadRing(self.client, entries=2 * GET_GROUP)
            with self._lock:
                self._rings.append(ring)
        return ring

    # -- the rest -----------------------------------------------------------------------------
    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether a get would find its page now (index, TTL, live segment; the
        bytes are not read). Not counted as hits or misses."""
        locs, _files = self._locate(self._keys(keys, len(keys)), count=False)
        return [loc is not None for loc in locs]

    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove the keys' index entries; returns how many were there. Their bytes are freed
        with their segments."""
        gone = self.client.unlink_many([self.ns.idx_path(n) for n in self._keys(keys, len(keys))])
        return sum(1 for r in gone if not isinstance(r, StripefsError))

    def evict(self) -> None:
        """A maintenance pass: retire expired and over-capacity segments, reclaim what is due
        (``batch_put`` runs one before each segment it writes)."""
        self._evictor.make_room(0)
        self._evictor.reclaim()

    def stats(self) -> StoreStats:
        """This store's counters, and the namespace's occupancy (one listing round trip)."""
        occupancy, segments = self._evictor.occupancy()
        return self._counters.snapshot(occupancy_bytes=occupancy, segments=segments, capacity_bytes=self.capacity)

    def close(self) -> None:
        with self._lock:
            rings, self._rings = self._rings, []
        for ring in rings:
            if ring.pid == os.getpid():
                ring.close()
        self._close_client()

    def _close_client(self) -> None:
        if self._own:
            self.client.close()

    def __enter__(self) -> "PageStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _keys(self, keys: Sequence[bytes], count: int) -> list[str]:
        """The keys' index names; EINVAL for a bad key or a count that does not match."""
        if len(keys) != count:
            raise StripefsError(ErrorCode.INVALID, f"{len(keys)} keys for {count} buffers")
        try:
            return [key_name(k) for k in keys]
        except ValueError as exc:
            raise StripefsError(ErrorCode.INVALID, str(exc)) from exc
