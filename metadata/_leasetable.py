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
once the mutation returned.

Sessions (Chubby's, on the watch): a client whose watch asks for one (``session=True``: a
native client; a FUSE mount's kernel keeps what it was told whatever its daemon hears, so
a mount asks for none) trusts its leases only within :attr:`LeaseTable.session` (200 ms)
of *sending* a watch that has been answered, and processes each answer's invalidations
before it counts it. Its watch is answered at least every third of that while it holds
leases (a heartbeat, empty when nothing changed). A change then waits for such a holder
at most ``session`` past the invalidation: any answer sent after it carries the
invalidation, so a holder that has not acknowledged by then (stopped, throttled, cut off)
stopped trusting the lease already, and trusts it again only after catching up. A holder
without a session delays a change by at most the lease's TTL.

Acknowledgements: ``after`` acknowledges every invalidation up to it; ``done`` names lease
ids past it whose invalidation the client finished, out of order (a mount's kernel
invalidation may wait for a directory lock; it holds back only the leases it names). An
invalidation is acknowledged once every lease it named is.

A grant is made only when nothing could have changed the answer between the read and the
registration: reads on the service's loop read and register in one step; a read on a
thread is granted only if no invalidation at all happened while it ran
(:meth:`LeaseTable.changes`) -- or, where every service's changes are heard
(:meth:`LeaseTable.track_keys`), none that named one of its keys. The service grants
leases only to a client whose watch is live (a ``WatchLeases`` in flight, or answered
within ``WATCH_GRACE``).

Bounds: at most ``max_per_client`` live leases per client and ``MAX_LEASES`` in all
(past them, answers carry no lease: nothing is evicted behind a holder's back); no new lease for a client with more
than ``MAX_QUEUED`` unacknowledged invalidations; expired leases and idle clients are
forgotten by :meth:`LeaseTable.run`.

Services sharing a PostgreSQL store each keep a table of their own for the clients
connected to them; every mutation's keys reach every table through the database
(``_leasebus.py``), which calls :meth:`LeaseTable.grant_until` to stop this table
granting while it cannot hear them, and :meth:`LeaseTable.revoke_all` when it may have
missed some.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections import deque
from collections.abc import Hashable

import trio

from . import _stats

__all__ = ["LEASE_TTL", "LeaseTable"]

log = logging.getLogger(__name__)

LEASE_TTL = 5.0  # seconds (``--lease-ttl``): how long a holder that cannot be told delays a mutation
# Seconds a session holder trusts its leases past sending a watch that was answered, and so
# the longest a change waits for one that does not acknowledge (STRIPEFS_LEASE_SESSION overrides).
SESSION = float(os.environ.get("STRIPEFS_LEASE_SESSION", "0.2"))
BEATS = 3  # heartbeats per session: a holder with leases hears from the service this often
# Seconds a key stays "hot" once a change to it had other holders to wait for (and again at
# each change while hot): no lease is granted on it meanwhile. A checkpoint directory that
# 64 readers keep listing then takes creates at the rate it takes them with none (they
# list it from the service meanwhile) instead of each create waiting for 64 acknowledgements
# (docs/benchmarks.md, "Attribute leases"). Off (0) unless STRIPEFS_LEASE_HOT sets it: a
# mount's daemon gives an answer without a lease the mount's own kernel timeouts, so with
# long ones (set because leases keep them coherent) a hot key's answers would go stale for
# that long; it needs short kernel timeouts for unleased answers first.
HOT = float(os.environ.get("STRIPEFS_LEASE_HOT", "0"))
MAX_HOT = 100_000
MAX_PER_CLIENT = 100_000  # live leases per client (~ its cached paths)
MAX_LEASES = 1_000_000  # live leases in all (~300 bytes each with their keys)
MAX_QUEUED = 10_000  # invalidations queued for one client, unacknowledged: past it, no new lease
WATCH_GRACE = 2.0  # a client whose last watch answered this long ago, with none since, gets no lease
MAX_RECENT = 4096  # invalidations whose keys are remembered (``track_keys``)
PURGE_EVERY = 1.0
MAX_WATCH_WAIT = 60.0


class _Lease:
    __slots__ = ("expires", "holder", "id", "keys")

    def __init__(self, lease_id: int, holder: _Holder, keys: tuple[Hashable, ...], expires: float):
        self.id, self.holder, self.keys, self.expires = lease_id, holder, keys, expires


class _Holder:
    """One client's leases and its watch."""

    __slots__ = ("acked", "acks", "client", "finished", "last_seen", "leases", "queue", "sent", "seq", "session",
                 "wake", "watching")

    def __init__(self, client: bytes, now: float):
        self.client = client
        self.seq = 1  # the last invalidation queued (from 1: a watch ``after`` 0 is a new one)
        self.acked = 1  # the last one the client acknowledged
        self.queue: deque[tuple[int, list[int]]] = deque()  # (seq, lease ids) not acknowledged yet
        self.finished: set[int] = set()  # seqs past ``acked`` acknowledged out of order (``done``)
        self.sent = 0  # the last seq a watch answer carried (a watch waits for something newer)
        self.session = False  # its watch asked for a session (bounded waits, heartbeats)
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
        session: seconds a session holder trusts its leases past a watch it sent (see the
            module's docstring), and so the longest a change waits for one; 0: no sessions.
        hot: seconds a key changed while others held it is granted no lease (:data:`HOT`); 0: off.
    """

    def __init__(self, ttl: float = LEASE_TTL, *, max_per_client: int = MAX_PER_CLIENT, session: float = SESSION,
                 hot: float = HOT):
        if ttl < 0 or session < 0 or hot < 0:
            raise ValueError("a lease TTL, session or hot time cannot be negative")
        self.ttl = ttl
        self.hot = hot
        self.session = min(session, ttl)
        self.max_per_client = max_per_client
        self.changes = 0  # invalidations so far (a read on a thread is granted only if none happened)
        # With :meth:`track_keys`: the keys of the last invalidations, (number, keys or None: all).
        self._recent: deque[tuple[int, frozenset[Hashable] | None]] | None = None
        self._ids = itertools.count(1)
        self._by_key: dict[Hashable, dict[int, _Lease]] = {}
        self._leases: dict[int, _Lease] = {}
        self._order: deque[_Lease] = deque()  # by expiry (one TTL for all: grant order)
        self._holders: dict[bytes, _Holder] = {}
        self._hot: dict[Hashable, float] = {}  # key -> until when no lease is granted on it (HOT)
        # Leases are granted only before this (trio time): always, unless the invalidations of
        # other services must reach this table first (``_leasebus.py``: until it hears them).
        self.fresh_until = float("inf")

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
        if self.ttl <= 0 or (since is not None and since != self.changes and not self._unchanged(keys, since)):
            return 0, 0
        holder = self._holders.get(client)
        now = trio.current_time()
        if now >= self.fresh_until:
            return 0, 0  # (a shared store's) invalidations may not reach this table now
        if holder is None or not (holder.watching or now - holder.last_seen < WATCH_GRACE):
            return 0, 0
        if (len(holder.leases) >= self.max_per_client or len(holder.queue) >= MAX_QUEUED
                or len(self._leases) >= MAX_LEASES):
            return 0, 0
        if self._hot and any(self._hot.get(key, 0.0) > now for key in keys):
            return 0, 0  # changed often, with holders to wait for: answered, not leased
        lease = _Lease(next(self._ids), holder, tuple(dict.fromkeys(keys)), now + self.ttl)
        if holder.session and not holder.leases:
            holder.wake.set()  # its watch, held long while it had nothing to trust, turns to heartbeats
        self._leases[lease.id] = lease
        self._order.append(lease)
        holder.leases.add(lease.id)
        for key in lease.keys:
            found = self._by_key.get(key)
            if found is None:
                self._by_key[key] = {lease.id: lease}
            else:
                found[lease.id] = lease
        _stats.LEASE_GRANTS.inc()
        return lease.id, int(self.ttl * 1000)

    def track_keys(self) -> None:
        """Remember the keys of the last ``MAX_RECENT`` invalidations: a read on a thread
        is then granted unless one of them named one of its keys (services sharing a
        store hear every service's changes: ``_leasebus.py``)."""
        self._recent = deque(maxlen=MAX_RECENT)

    def _unchanged(self, keys: list[Hashable], since: int) -> bool:
        """No invalidation after ``since`` named one of ``keys`` (as far as remembered)."""
        recent = self._recent
        if recent is None or not recent or recent[0][0] > since + 1:
            return False  # not remembered that far back
        for number, changed in reversed(recent):
            if number <= since:
                return True
            if changed is None or not changed.isdisjoint(keys):
                return False
        return True

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
        if self._recent is not None:
            self._recent.append((self.changes, frozenset(keys)))
        now = trio.current_time()
        told: dict[bytes, tuple[_Holder, list[int], float]] = {}
        hot = self._hot
        for key in keys:
            if hot and hot.get(key, 0.0) > now:
                hot[key] = now + self.hot  # still changing: still no lease on it
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
                if self.hot > 0 and len(hot) < MAX_HOT:
                    hot[key] = now + self.hot
                entry = told.get(holder.client)
                if entry is None:
                    told[holder.client] = (holder, [lease.id], lease.expires)
                else:
                    entry[1].append(lease.id)
                    told[holder.client] = (holder, entry[1], max(entry[2], lease.expires))
        waits = []
        for holder, ids, expires in told.values():
            _stats.LEASE_INVALIDATIONS.inc(len(ids))
            holder.seq += 1
            holder.queue.append((holder.seq, ids))
            holder.wake.set()
            if holder.session and self.session:
                # Any watch answer sent from now on carries this: by now + session the
                # holder either acknowledged or stopped trusting its leases.
                expires = min(expires, now + self.session)
            waits.append((holder, holder.seq, expires))
        return waits

    def grant_until(self, until: float) -> None:
        """Grant leases only before ``until`` (trio time; ``-inf``: none until told again).
        Starting to grant again counts as a change: a read begun before gets no lease (it
        may have read what an invalidation this table never heard had changed)."""
        now = trio.current_time()
        if self.fresh_until <= now < until:
            self.changes += 1
            if self._recent is not None:
                self._recent.append((self.changes, None))
        self.fresh_until = until

    def revoke_all(self) -> None:
        """Every lease ends now, its holder told as by :meth:`invalidate` (nobody's change
        waits for it): this table may have missed an invalidation (``_leasebus.py``)."""
        self.invalidate(list(self._by_key), b"")
        if self._recent is not None:
            self._recent.append((self.changes, None))  # a read begun before may have missed it too

    @staticmethod
    async def wait(waits: list[tuple[_Holder, int, float]]) -> None:
        """Until every holder in ``waits`` acknowledged its invalidation or its leases expired."""
        for holder, seq, expires in waits:
            started = trio.current_time()
            while holder.acked < seq and seq not in holder.finished and trio.current_time() < expires:
                with trio.move_on_at(expires):
                    await holder.acks.wait()
            _stats.LEASE_WAIT_SECONDS.observe(trio.current_time() - started)
            if holder.acked < seq and seq not in holder.finished:  # stopped, dead or cut off: worth knowing
                log.info("a change waited %.2f s for client %s (no acknowledgement: its %s ran out)",
                         trio.current_time() - started, holder.client.hex()[:8],
                         "session" if holder.session else "leases")

    # -- the watch ----------------------------------------------------------------------------
    async def watch(self, client: bytes, after: int, wait_s: float, *, session: bool = False,
                    done: list[int] | tuple[int, ...] = ()) -> tuple[int, list[int], bool]:
        """A ``WatchLeases`` of ``client``: acknowledge up to ``after`` (and the lease ids
        ``done``, out of order), then ``(seq, lease ids, reset)`` as soon as something new
        is queued, or ``(seq, ids, False)`` after ``wait_s`` (a third of :attr:`session` for
        a ``session`` holder with leases): ``ids``, every lease still unacknowledged.
        ``after`` 0 (a new watch) or one this table never handed out (``reset``: it
        restarted) acknowledges everything and is answered at once; -1 (the client is
        closing: it dropped every entry) also ends its leases and its watch."""
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
        holder.session = session and self.session > 0
        if after == 0 or reset:
            self._ack(holder, holder.seq)
            holder.sent = holder.seq
            return holder.seq, [], reset
        self._ack(holder, after)
        if done:
            self._done(holder, set(done))
        holder.watching += 1
        until = now + min(max(wait_s, 0.0), MAX_WATCH_WAIT)
        try:
            while holder.seq <= max(after, holder.sent):  # nothing it has not been told yet
                end = min(until, now + self.session / BEATS) if holder.session and holder.leases else until
                if trio.current_time() >= end:
                    break
                with trio.move_on_at(end):
                    await holder.wake.wait()
                if holder.wake.is_set():
                    holder.wake = trio.Event()
        finally:
            holder.watching -= 1
            holder.last_seen = trio.current_time()
        holder.sent = holder.seq
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
        holder.seq += 1
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
        if holder.finished:
            holder.finished = {s for s in holder.finished if s > seq}
        holder.acks.set()
        holder.acks = trio.Event()

    @staticmethod
    def _done(holder: _Holder, done: set[int]) -> None:
        """The client finished invalidating the leases ``done``: an invalidation all of
        whose leases are done is acknowledged (out of order)."""
        kept: deque[tuple[int, list[int]]] = deque()
        finished = False
        for seq, ids in holder.queue:
            left = [i for i in ids if i not in done]
            if ids and not left:
                holder.finished.add(seq)
                finished = True
            else:
                kept.append((seq, left))
        if finished:
            holder.queue = kept
            holder.acks.set()
            holder.acks = trio.Event()

    # -- upkeep -----------------------------------------------------------------------------
    def purge(self) -> None:
        """Forget expired leases, and clients with no lease and no watch for a while."""
        now = trio.current_time()
        order = self._order
        while order and order[0].expires <= now:
            self._remove(order.popleft())
        for key in [k for k, until in self._hot.items() if until <= now]:
            del self._hot[key]
        for client, holder in list(self._holders.items()):
            if not holder.leases and not holder.watching and now - holder.last_seen > max(self.ttl, WATCH_GRACE) * 2:
                del self._holders[client]

    async def run(self) -> None:
        """Purge every ``PURGE_EVERY`` seconds, until cancelled."""
        while True:
            await trio.sleep(PURGE_EVERY)
            self.purge()
