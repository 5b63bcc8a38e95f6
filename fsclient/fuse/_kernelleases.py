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
watch thread, before it acknowledges: drops the daemon's own caches of the inodes
concerned (directory attributes, kept listings and names, "no such xattr"), on the trio
loop; then tells the kernel to forget the entry (``pyfuse3.invalidate_entry``) and the
attributes (``pyfuse3.invalidate_inode``). Those calls release the GIL, but
``invalidate_entry`` waits for any request the kernel has in flight on the same directory
(a lookup the loop is serving, say): so they run on the watch thread, which holds nothing
the loop needs while it waits. When the watch breaks (or the service forgot this client),
every entry still leased is taken back the same way and new answers carry the plain
timeouts until it is live again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pyfuse3
import trio

log = logging.getLogger(__name__)

# The kernel's timeout ends this long before the lease could (the lease is counted from
# before the request was sent; the kernel counts from the reply, in whole jiffies).
MARGIN = 0.05
MAX_TOLD = 200_000  # leased answers remembered (past it, answers are given no timeout)
PURGE_EVERY = 4096  # leased answers between two purges of the expired ones


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
        # lease id -> (expiry (monotonic), parent (0: attributes only), name, ino)
        self._told: dict[int, tuple[float, int, bytes, int]] = {}
        self._token: trio.lowlevel.TrioToken | None = None
        self._added = 0
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
        expires = sent + lease_ms / 1000 - MARGIN
        with self._lock:
            left = expires - time.monotonic()
            if self.token() != token or not self.cache.leasing or left <= 0:
                return 0.0
            self._added += 1
            if len(self._told) >= MAX_TOLD or self._added % PURGE_EVERY == 0:
                now = time.monotonic()
                for old in [k for k, v in self._told.items() if v[0] <= now]:
                    del self._told[old]
                if len(self._told) >= MAX_TOLD:
                    return 0.0
            self._told[lease_id] = (expires, parent, name, ino)
        return left

    def renamed(self, parent: int, name: bytes) -> bool:
        """This mount renamed ``name`` of ``parent``: the kernel moved its entry, with the
        leased timeout, to the new name, but the service's lease stays on what the answer
        depended on -- for a directory, the old name alone (its lookup lease covers its
        entry only), and as the mutator this mount is not told of its own change. Another
        client renaming the new name away would then never take it back. So the leases of
        the old name are dropped here; True when there were any: the caller takes the
        entry back from the kernel (it is looked up again, with a lease on the new name)."""
        with self._lock:
            gone = [lease_id for lease_id, (_, p, n, _) in self._told.items() if p == parent and n == name]
            for lease_id in gone:
                del self._told[lease_id]
        return bool(gone)

    # -- on the watch thread ------------------------------------------------------------
    def invalidated(self, lease_ids: list[int]) -> None:
        """The service names ``lease_ids``: take back what was told under them."""
        with self._lock:
            gone = [told for told in map(self._told.pop, lease_ids, [None] * len(lease_ids)) if told]
        self._take_back(gone)

    def lost(self) -> None:
        """The watch is down (or the service forgot this client): take back every entry."""
        with self._lock:
            gone = list(self._told.values())
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


def _quietly(fn: Callable[..., None], *args: Any) -> None:
    try:
        fn(*args)
    except OSError:  # the kernel forgot it meanwhile: nothing to take back
        pass
    except Exception:  # noqa: BLE001 -- e.g. no FUSE session any more
        log.debug("kernel invalidation failed", exc_info=True)
