"""Attribute leases: which client may answer which ``stat`` from its cache, and telling it when not.

A client that asks (``Resolve(lease=True)``) gets, with the attributes, a lease id and a
lifetime (the TTL). The lease covers the *keys* the answer depends on: the inode numbers
read (the inode the path leads to, symlinks followed, directories left by ``..``) and one
``(parent, name)`` pair per directory entry followed (``Namespace.resolve(keys=...)``). A
mutation records the keys it writes (``SqliteStore.touched``: every inode, directory row,
xattr and directory entry put or deleted), and once it committed, before it is answered,
:meth:`LeaseTable.invalidate` removes every lease on those keys but the mutating client's own (it drops or updates its
own entries on the answer; its leases stay, so another client's later change to the same
keys is told to it), and their holders are told on their watch
(``WatchLeases``, a long poll on a connection of their own) and the mutation waits until
each has acknowledged, or its lease expired, whichever comes first
(:meth:`LeaseTable.wait`). So a change is visible to every client's very next ``stat``
once the mutation returned; a holder that cannot be told (stopped, dead, cut off) delays
it by at most the TTL.

A grant is made only when nothing could have changed the answer between the read and the
registration: reads on the service's loop read and register in one step; a read on a
thread is granted only if no invalidation at all happened while it ran
(:meth:`LeaseTable.changes`). The service grants leases only to a client whose watch is
live (a ``WatchLeases`` in flight, or answered within ``WATCH_GRACE``).

Bounds: at most ``max_per_client`` live leases per client and ``MAX_LEASES`` in all
(past them, answers carry no lease: nothing is evicted behind a holder's back); no new lease for a client with more
than ``MAX_QUEUED`` unacknowledged invalidations; expired leases and idle clients are
forgotten by :meth:`LeaseTable.run`.

Only a service that alone owns its store grants leases (SQLite): with several services on
one PostgreSQL store a mutation through one service could not reach the leases another
granted.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Hashable

import trio

__all__ = ["LEASE_TTL", "LeaseTable"]

log = logging.getLogger(__name__)

LEASE_TTL = 5.0  # seconds (``--lease-ttl``): how long a holder that cannot be told delays a mutation
MAX_PER_CLIENT = 100_000  # live leases per client (~ its cached paths)
MAX_LEASES = 1_000_000  # live leases in all (~300 bytes each with their keys)
MAX_QUEUED = 10_000  # invalidations queued for one client, unacknowledged: past it, no new lease
WATCH_GRACE = 2.0  # a client whose last watch answered this long ago, with none since, gets no lease
PURGE_EVERY = 1.0
MAX_WATCH_WAIT = 60.0


class _Lease:
    __slots__ = ("expires", "holder", "id", "keys")

    def __init__(self, lease_id: int, holder: _Holder, keys: tuple[Hashable, ...], expires: float):
        self.id, self.holder, self.keys, self.expires = lease_id, holder, keys, expires


class _Holder:
    """One client's leases and its watch."""

    __slots__ = ("acked", "acks", "client", "last_seen", "leases", "queue", "seq", "wake", "watching")

    def __init__(self, client: bytes, now: float):
        self.client = client
        self.seq = 1  # the last invalidation queued (from 1: a watch ``after`` 0 is a new one)
        self.acked = 1  # the last one the client acknowledged
        self.queue: deque[tuple[int, list[int]]] = deque()  # (seq, lease ids) not acknowledged yet
        self.wake = trio.Event()  # set when something is queued
        self.acks = trio.Event()  # set (and replaced) at each acknowledgement
        self.watching = 0  # WatchLeases calls in flight
        self.last_seen = now
        self.leases: set[int] = set()  # its live leases


class LeaseTable:
    """The leases a metadata service granted (trio: every method runs on the service's loop).

    Args:
        ttl: seconds a lease lives; 0 grants none.
        max_per_client: live leases one client may hold.
        clock: the trio clock (tests may pass another).
    """

    def __init__(self, ttl: float = LEASE_TTL, *, max_per_client: int = MAX_PER_CLIENT):
        if ttl < 0:
            raise ValueError("a lease TTL cannot be negative")
        self.ttl = ttl
        self.max_per_client = max_per_client
        self.changes = 0  # invalidations so far (a read on a thread is granted only if none happened)
        self._ids = itertools.count(1)
        self._by_key: dict[Hashable, dict[int, _Lease]] = {}
        self._leases: dict[int, _Lease] = {}
        self._order: deque[_Lease] = deque()  # by expiry (one TTL for all: grant order)
        self._holders: dict[bytes, _Holder] = {}

    @property
    def enabled(self) -> bool:
        return self.ttl > 0

    def __len__(self) -> int:
        return len(self._leases)

    # -- granting ---------------------------------------------------------------------------
    def grant(self, client: bytes, keys: list[Hashable], since: int | None = None) -> tuple[int, int]:
        """Register a lease of ``client`` on ``keys``: ``(lease id, lifetime in ms)``, or
        ``(0, 0)`` when none is granted (leases off, no live watch, over a bound, or, with
        ``since`` (:attr:`changes` before the read), an invalidation since)."""
        if self.ttl <= 0 or (since is not None and since != self.changes):
            return 0, 0
        holder = self._holders.get(client)
        now = trio.current_time()
        if holder is None or not (holder.watching or now - holder.last_seen < WATCH_GRACE):
            return 0, 0
        if (len(holder.leases) >= self.max_per_client or len(holder.queue) >= MAX_QUEUED
                or len(self._leases) >= MAX_LEASES):
            return 0, 0
        lease = _Lease(next(self._ids), holder, tuple(dict.fromkeys(keys)), now + self.ttl)
        self._leases[lease.id] = lease
        self._order.append(lease)
        holder.leases.add(lease.id)
        for key in lease.keys:
            found = self._by_key.get(key)
            if found is None:
                self._by_key[key] = {lease.id: lease}
            else:
                found[lease.id] = lease
        return lease.id, int(self.ttl * 1000)

    def _remove(self, lease: _Lease) -> None:
        if self._leases.pop(lease.id, None) is None:
            return
        lease.holder.leases.discard(lease.id)
        for key in lease.keys:
            found = self._by_key.get(key)
            if found is not None:
                found.pop(lease.id, None)
                if not found:
                    del self._by_key[key]

    # -- invalidating -----------------------------------------------------------------------
    def invalidate(self, keys: set[Hashable] | list[Hashable], mutator: bytes) -> list[tuple[_Holder, int, float]]:
        """Remove the leases on ``keys`` (written by a committed mutation of ``mutator``) and
        queue their ids for their holders, ``mutator`` excepted. Returns what
        :meth:`wait` waits for: per holder told, the sequence number to be acknowledged
        and when its last lease would have expired."""
        self.changes += 1
        now = trio.current_time()
        told: dict[bytes, tuple[_Holder, list[int], float]] = {}
        for key in keys:
            found = self._by_key.get(key)
            if not found:
                continue
            for lease in list(found.values()):
                holder = lease.holder
                if holder.client == mutator and lease.expires > now:
                    # The mutator knows what it changed (it drops or updates its own entries);
                    # its lease lives on, so another client's later change is still told to it
                    # (a FUSE daemon's kernel keeps what it was told under the lease).
                    continue
                self._remove(lease)
                if lease.expires <= now:
                    continue  # an expired lease is trusted by nobody
                entry = told.get(holder.client)
                if entry is None:
                    told[holder.client] = (holder, [lease.id], lease.expires)
                else:
                    entry[1].append(lease.id)
                    told[holder.client] = (holder, entry[1], max(entry[2], lease.expires))
        waits = []
        for holder, ids, expires in told.values():
            holder.seq += 1
            holder.queue.append((holder.seq, ids))
            holder.wake.set()
            waits.append((holder, holder.seq, expires))
        return waits

    @staticmethod
    async def wait(waits: list[tuple[_Holder, int, float]]) -> None:
        """Until every holder in ``waits`` acknowledged its invalidation or its leases expired."""
        for holder, seq, expires in waits:
            started = trio.current_time()
            while holder.acked < seq and trio.current_time() < expires:
                with trio.move_on_at(expires):
                    await holder.acks.wait()
            if holder.acked < seq:  # stopped, dead or cut off: worth knowing why a change was slow
                log.info("a change waited %.1f s for the leases of client %s to run out (no acknowledgement)",
                         trio.current_time() - started, holder.client.hex()[:8])

    # -- the watch ----------------------------------------------------------------------------
    async def watch(self, client: bytes, after: int, wait_s: float) -> tuple[int, list[int], bool]:
        """A ``WatchLeases`` of ``client``: acknowledge up to ``after``, then ``(seq, lease
        ids, reset)`` as soon as something is queued past it, or ``(seq, [], False)`` after
        ``wait_s``. ``after`` 0 (a new watch) or one this table never handed out
        (``reset``: it restarted) acknowledges everything and is answered at once; -1 (the
        client is closing: it dropped every entry) also ends its leases and its watch."""
        now = trio.current_time()
        holder = self._holders.get(client)
        if after < 0:
            if holder is not None:
                self._release(holder)
            return 0, [], False
        reset = False
        if holder is None:
            holder = self._holders[client] = _Holder(client, now)
            reset = after != 0
        elif after > holder.seq:
            reset = True
        holder.last_seen = now
        if after == 0 or reset:
            self._ack(holder, holder.seq)
            return holder.seq, [], reset
        self._ack(holder, after)
        holder.watching += 1
        try:
            with trio.move_on_after(min(max(wait_s, 0.0), MAX_WATCH_WAIT)):
                while not holder.queue:
                    await holder.wake.wait()
                    holder.wake = trio.Event()
        finally:
            holder.watching -= 1
            holder.last_seen = trio.current_time()
        return holder.seq, [i for _, ids in holder.queue for i in ids], False

    def release(self, client: bytes) -> None:
        """``client`` is gone: its leases end at once (its watch connection ended cleanly)."""
        holder = self._holders.get(client)
        if holder is not None:
            self._release(holder)

    def _release(self, holder: _Holder) -> None:
        for lease_id in list(holder.leases):
            lease = self._leases.get(lease_id)
            if lease is not None:
                self._remove(lease)
        self._ack(holder, holder.seq)
        holder.queue.append((holder.seq, []))  # the watch in flight answers now
        holder.wake.set()
        holder.last_seen = -float("inf")  # no lease until it watches again
        self._holders.pop(holder.client, None)

    @staticmethod
    def _ack(holder: _Holder, seq: int) -> None:
        if seq <= holder.acked:
            return
        holder.acked = seq
        while holder.queue and holder.queue[0][0] <= seq:
            holder.queue.popleft()
        holder.acks.set()
        holder.acks = trio.Event()

    # -- upkeep -----------------------------------------------------------------------------
    def purge(self) -> None:
        """Forget expired leases, and clients with no lease and no watch for a while."""
        now = trio.current_time()
        order = self._order
        while order and order[0].expires <= now:
            self._remove(order.popleft())
        for client, holder in list(self._holders.items()):
            if not holder.leases and not holder.watching and now - holder.last_seen > max(self.ttl, WATCH_GRACE) * 2:
                del self._holders[client]

    async def run(self) -> None:
        """Purge every ``PURGE_EVERY`` seconds, until cancelled."""
        while True:
            await trio.sleep(PURGE_EVERY)
            self.purge()
