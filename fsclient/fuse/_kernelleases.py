"""What the daemon told the kernel under attribute leases, and taking it back.

A ``Lookup`` or ``GetAttr`` the daemon sends while its lease watch is live asks for a lease
(the native client's watch, :class:`~fsclient.core._attrcache.LeaseWatch`: one per client
id). A leased answer goes to the kernel with the lease's remaining lifetime as its entry
and attribute timeouts (a directory's: its entry timeout only, the service leases no
directory's attributes on a lookup); an answer without a lease keeps the mount's own
timeouts. The first ``Readdir`` page of a directory asks for a listing lease (on the
directory's attributes), registered with parent 0: its invalidation drops the daemon's
kept listing and names of that directory.

When the service names a lease (another client changed what the answer depends on), the
lease is taken back before it is acknowledged -- the acknowledgement promises that neither
the daemon nor the kernel answers from it any more: the daemon's own caches of the inodes
concerned go (directory attributes, kept listings and names, "no such xattr"), on the trio
loop; then the kernel is told to forget the entry (``pyfuse3.invalidate_entry``) and the
attributes (``pyfuse3.invalidate_inode``). ``invalidate_entry`` waits for the directory's
lock, held while a request of this mount is in flight there (a create that itself waits
for another holder, say): so this runs on worker threads (:class:`_Workers`), never on the
loop nor on the watch thread, one job per directory, and each job reports its own leases
done (the watch acknowledges them by id): a blocked directory holds back only the leases
in it. When the watch breaks (or the service forgot this client), every entry still
leased is taken back on the watch thread, before a new watch acknowledges everything, and
new answers carry the plain timeouts until it is live again.

The daemon's watch asks for no session (``AttrCache.sessions``): the kernel answers from
what it was told whatever the daemon hears, so a change waits for a mount that does not
acknowledge until its leases run out (the TTL), not for a session's length.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import pyfuse3
import trio

log = logging.getLogger(__name__)

# The kernel's timeout ends this long before the lease could, at least: the lease is
# counted from before the request was sent, the kernel counts from when the process that
# asked runs again after the reply (in whole jiffies) -- on a loaded machine that can be
# tens of milliseconds later, and a change the service makes past the lease's end is told
# to nobody. So a tenth of the lease goes too (0.5 s of the default 5 s).
MARGIN = 0.05
MARGIN_SHARE = 0.1
MAX_TOLD = 200_000  # leased answers remembered (past it, answers are given no timeout)
PURGE_EVERY = 4096  # leased answers between two purges of the expired ones
MAX_WORKERS = 32  # threads taking leases back from the kernel at once (each may wait for a directory)
WORKER_IDLE = 5.0  # seconds an idle worker thread waits for work before it ends


class KernelLeases:
    """Lease id -> what the kernel was told under it (thread-safe).

    Args:
        cache: the native client's attribute cache (its watch tells this object, through
            ``cache.listener``, of every invalidation before acknowledging it).
        forget: called on the trio loop with the inode numbers whose daemon-side caches
            must go (directories and files the invalidated answers named).
    """

    def __init__(self, cache: Any, forget: Callable[[set[int]], None]):
        self.cache = cache
        self.forget = forget
        self._lock = threading.Lock()
        # lease id -> what was told under it: (expiry (monotonic), parent (0: attributes
        # only), name, ino) each -- one answer, or a listing's and the lookups answered from it
        self._told: dict[int, list[tuple[float, int, bytes, int]]] = {}
        self._token: trio.lowlevel.TrioToken | None = None
        self._added = 0
        self._workers = _Workers(MAX_WORKERS)
        cache.sessions = False  # the kernel keeps what it was told: no session can bound it
        cache.listener = self

    # -- on the loop --------------------------------------------------------------------
    @property
    def asking(self) -> bool:
        """The watch is live: requests may ask for leases."""
        return bool(self.cache.leasing)

    def token(self) -> int:
        """Taken before a request is sent, handed to :meth:`timeout` with its answer."""
        return int(self.cache.invalidations)

    def timeout(self, token: int, lease_id: int, lease_ms: int, sent: float, ino: int,
                parent: int = 0, name: bytes = b"") -> float | None:
        """The timeout to give the kernel for a leased answer (None: no lease, the mount's
        own timeouts apply; 0: an invalidation or a watch failure came in meanwhile, so the
        lease may be gone already). ``sent``: ``time.monotonic()`` before the request."""
        if lease_ms <= 0 or not lease_id:
            return None
        if self._token is None:
            self._token = trio.lowlevel.current_trio_token()
        expires = sent + lease_ms / 1000 * (1 - MARGIN_SHARE) - MARGIN
        with self._lock:
            left = expires - time.monotonic()
            if self.token() != token or not self.cache.leasing or left <= 0:
                return 0.0
            self._added += 1
            if len(self._told) >= MAX_TOLD or self._added % PURGE_EVERY == 0:
                now = time.monotonic()
                for old in [k for k, v in self._told.items() if v[0][0] <= now]:
                    del self._told[old]
                if len(self._told) >= MAX_TOLD:
                    return 0.0
            self._told[lease_id] = [(expires, parent, name, ino)]
        return left

    def also(self, lease_id: int, parent: int, name: bytes, ino: int) -> float:
        """The kernel is told of ``name`` in ``parent`` (inode ``ino``) under the lease
        ``lease_id`` the daemon already holds (a listing's, ``_leaseddirs.py``): the seconds
        it may keep it, or 0 when that lease is gone or ending (taken back, lost, expired):
        then the answer gets no timeout."""
        with self._lock:
            told = self._told.get(lease_id)
            if told is None or len(told) >= MAX_TOLD or not self.cache.leasing:
                return 0.0
            expires = told[0][0]
            left = expires - time.monotonic()
            if left <= 0:
                return 0.0
            told.append((expires, parent, name, ino))
        return left

    def renamed(self, parent: int, name: bytes) -> bool:
        """This mount renamed ``name`` of ``parent``: the kernel moved its entry, with the
        leased timeout, to the new name, but the service's lease stays on what the answer
        depended on -- for a directory, the old name alone (its lookup lease covers its
        entry only), and as the mutator this mount is not told of its own change. Another
        client renaming the new name away would then never take it back. So the leases of
        the old name are dropped here; True when there were any: the caller takes the
        entry back from the kernel (it is looked up again, with a lease on the new name)."""
        found = False
        with self._lock:
            for lease_id, told in list(self._told.items()):
                kept = [t for t in told if t[1] != parent or t[2] != name]
                if len(kept) == len(told):
                    continue
                found = True
                if kept:  # a listing's lease: what else was told under it stays registered
                    self._told[lease_id] = kept
                else:
                    del self._told[lease_id]
        return found

    # -- on the watch thread ------------------------------------------------------------
    def invalidated(self, lease_ids: list[int], done: Callable[[list[int]], None]) -> None:
        """The service names ``lease_ids``: take back what was told under them, on worker
        threads, one job per directory; ``done(ids)`` as each job finished (at once for
        the ids under which nothing the kernel may still keep was told)."""
        now = time.monotonic()
        by_parent: dict[int, list[tuple[int, tuple[float, int, bytes, int]]]] = {}
        with self._lock:
            for lease_id in lease_ids:
                for told in self._told.pop(lease_id, ()):
                    if told[0] > now:  # else the kernel forgot it already
                        by_parent.setdefault(told[1], []).append((lease_id, told))
        # A lease is acknowledged once every job holding something told under it is done.
        pending: dict[int, int] = {}
        for group in by_parent.values():
            for lease_id in {lease_id for lease_id, _ in group}:
                pending[lease_id] = pending.get(lease_id, 0) + 1
        idle = [lease_id for lease_id in lease_ids if lease_id not in pending]
        if idle:
            done(idle)
        lock = threading.Lock()

        def finished(ids: list[int]) -> None:
            with lock:
                ready = []
                for lease_id in ids:
                    pending[lease_id] -= 1
                    if not pending[lease_id]:
                        ready.append(lease_id)
            if ready:
                done(ready)

        for group in by_parent.values():  # parent 0 (attributes only) never waits for a lock
            self._workers.submit(self._job, group, finished)

    def _job(self, group: list[tuple[int, tuple[float, int, bytes, int]]],
             done: Callable[[list[int]], None]) -> None:
        try:
            self._take_back([told for _, told in group])
        finally:
            done(list({lease_id: None for lease_id, _ in group}))

    def lost(self) -> None:
        """The watch is down (or the service forgot this client): take back every entry."""
        with self._lock:
            gone = [told for group in self._told.values() for told in group]
            self._told.clear()
        self._take_back(gone)

    def _take_back(self, gone: list[tuple[float, int, bytes, int]]) -> None:
        now = time.monotonic()
        gone = [g for g in gone if g[0] > now]  # the kernel forgot the others already
        if not gone:
            return
        inos = {g[3] for g in gone} | {g[1] for g in gone if g[1]}
        token = self._token
        if token is not None:
            try:
                trio.from_thread.run_sync(self.forget, inos, trio_token=token)
            except trio.RunFinishedError:
                return  # unmounted
        for _, parent, name, ino in gone:
            if parent:
                _quietly(pyfuse3.invalidate_entry, parent, name)
            _quietly(pyfuse3.invalidate_inode, ino, True)


class _Workers:
    """Daemon threads made on demand, up to ``limit``, each ending after :data:`WORKER_IDLE`
    s without work: a job that waits in the kernel holds up no other while threads are
    left (a pool's threads would be joined at exit, and might wait there)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._cv = threading.Condition()
        self._jobs: deque[tuple[Callable[..., None], tuple[Any, ...]]] = deque()
        self._threads = 0
        self._idle = 0

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        with self._cv:
            self._jobs.append((fn, args))
            if self._idle < len(self._jobs) and self._threads < self.limit:
                self._threads += 1
                threading.Thread(target=self._run, name="stripefs-kernel-leases", daemon=True).start()
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._jobs:
                    self._idle += 1
                    woken = self._cv.wait(WORKER_IDLE)
                    self._idle -= 1
                    if not woken and not self._jobs:
                        self._threads -= 1
                        return
                fn, args = self._jobs.popleft()
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 -- the next job goes on
                log.warning("taking a lease back from the kernel failed", exc_info=True)


def _quietly(fn: Callable[..., None], *args: Any) -> None:
    try:
        fn(*args)
    except OSError:  # the kernel forgot it meanwhile: nothing to take back
        pass
    except Exception:  # noqa: BLE001 -- e.g. no FUSE session any more
        log.debug("kernel invalidation failed", exc_info=True)
