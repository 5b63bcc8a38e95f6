"""The client's attribute cache: ``stat`` of a path nobody changed answered locally.

Two kinds of entries:

* **Leased** (the default with a service that grants leases): the service promised to
  tell this client, on its watch (:class:`LeaseWatch`, a ``WatchLeases`` long poll on a
  connection of its own), before any other client's change to what the answer depends
  on returns. Such an entry is current: it serves ``stat`` and ``open`` until the
  service names its lease, or until the lease's own lifetime ends (counted from before
  the request was sent). While the watch is down no lease is asked for and every leased
  entry is dropped at once.

  With a session (the service's watch grants one: ``WatchLeasesReply.session_ms``, 200 ms
  by default), a leased entry is trusted only within the session of sending a watch that
  was answered, and processed (or of sending the request that got the lease): a holder
  that was stopped, throttled or cut off serves nothing from its cache until its watch
  caught up (an answer to a watch sent since, its invalidations dropped first), and a
  change by another client waits at most the session for it. Entries not trusted meanwhile
  are kept, not served: the next watch answer names those that changed.
* **Timed** (``attr_timeout``, for services that grant no lease): entries live
  ``timeout`` seconds (the bound on seeing another client's change, like the FUSE
  mount's ``attr_timeout``); ``open`` revalidates them (close-to-open).

This client's own changes show at once: every metadata mutation it makes drops what it
may have changed -- by path and inode for ``CreatePath``/``UnlinkPath`` of a file (plus
every cached directory, whose times and link counts move), everything for any other
mutation, the removal of a symlink included (a cached path may have resolved through it,
and the service does not tell a client of its own changes). Failed lookups are never
cached.

Memory is bounded in bytes (:data:`MAX_BYTES` for entries and listings together, the
oldest going first past it: an estimate of what each holds, names and paths included),
and expired entries are purged every :data:`PURGE_EVERY` seconds at most (on a store,
and from the watch thread while the client is idle).

A lookup that raced with one of this client's mutations, or with an invalidation that
arrived meanwhile, is not stored: :meth:`AttrCache.token` is taken before the request is
sent, and :meth:`AttrCache.put` keeps the answer only if no mutation began or ended, none
is in flight, and no invalidation was processed since.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any

from stripefs.rpc import Connection
from stripefs.rpc._metrics import Lazy
from stripefs.wire import Attr, ErrorCode, Message, StripefsError
from stripefs.wire import messages as m

log = logging.getLogger(__name__)

MAX_BYTES = 64 << 20  # what the cached entries and listings hold at most (the oldest go first past it)
# The estimated bytes of one path entry besides its path and layout (its Attr and its
# fields, the tuple, its slots in the path, inode, lease and size maps: ~1.1 KB measured with
# tracemalloc for a file with a 16-chain layout), and of one listing besides its names.
ENTRY_BYTES = 800
LISTING_BYTES = 300
PURGE_EVERY = 5.0  # seconds between sweeps of expired entries (at most)
WATCH_WAIT_MS = 10_000  # how long the service holds a watch with nothing to say
RETRY_WATCH = 0.5  # seconds before a failed watch is tried again
RETRY_UNSUPPORTED = 30.0  # ... when the service grants no leases
ACK_WAIT = 0.02  # seconds the watch waits for its listener's invalidations before acknowledging what finished
ACK_POLL_MS = 20  # the watch's wait while some are still in progress (each answer lets it acknowledge more)


# Lookups of the attribute cache (counted only while the process serves metrics:
# ``$STRIPEFS_CLIENT_METRICS``, or a FUSE daemon's ``--metrics``).
_LOOKUPS = ("Counter", "stripefs_client_attr_cache_lookups",
            "Attribute cache lookups that found a valid entry (result=hit) or none", ("result",))
CACHE_HITS = Lazy(*_LOOKUPS, values=("hit",))
CACHE_MISSES = Lazy(*_LOOKUPS, values=("miss",))

STREAK = 2  # lookups of files in one directory within STREAK_WINDOW s that make it due for its listing
STREAK_WINDOW = 2.0
LISTING_PAGE = 1024  # entries per Readdir page of a listing fetched for its files (each page leased)
LISTING_MAX = 16_384  # entries at most in such a listing (a larger directory is not fetched)
TOO_BIG_AGAIN = 60.0  # seconds before a directory found larger than LISTING_MAX is tried again
# Seconds between two fetches of one directory's listing at least (a lease lives 5 s): a
# directory whose files another client keeps changing (each change takes the lease back,
# or the service leases them no more) costs a listing per REFETCH_AFTER, not per 2 opens.
REFETCH_AFTER = 5.0


class DirStreaks:
    """Which directories are being read file by file, so that fetching a whole listing
    (its files' attributes under one lease) pays: :meth:`hit` says a directory is due
    once :data:`STREAK` lookups of its files went to the service within
    :data:`STREAK_WINDOW` seconds, no fetch of it is in flight, none began in the last
    :data:`REFETCH_AFTER` seconds, and none failed for size lately. Thread-safe; used by
    the native client and the FUSE daemon alike."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hits: dict[Any, tuple[int, float]] = {}  # directory -> (lookups, the first's time)
        self._inflight: set[Any] = set()
        self._big: dict[Any, float] = {}  # directory -> monotonic time before which it is not fetched
        self._last: dict[Any, float] = {}  # directory -> when its last fetch began

    def hit(self, key: Any, lookups: int = 1) -> bool:
        """``lookups`` of files in ``key`` went (or are about to go) to the service: True when
        its listing should be fetched now (the caller then calls :meth:`done` once it came
        back)."""
        now = time.monotonic()
        with self._lock:
            if (key in self._inflight or self._big.get(key, 0.0) > now
                    or now - self._last.get(key, -REFETCH_AFTER) < REFETCH_AFTER):
                return False
            count, first = self._hits.get(key, (0, now))
            if now - first > STREAK_WINDOW:
                count, first = 0, now
            if count + lookups < STREAK:
                if len(self._hits) >= 4096:
                    self._hits.clear()
                self._hits[key] = (count + lookups, first)
                return False
            self._hits.pop(key, None)
            self._inflight.add(key)
            if len(self._last) >= 4096:
                self._last = {k: t for k, t in self._last.items() if now - t < REFETCH_AFTER}
            self._last[key] = now
            return True

    def done(self, key: Any, *, too_big: bool = False) -> None:
        """The fetch of ``key``'s listing came back (``too_big``: more than one page)."""
        with self._lock:
            self._inflight.discard(key)
            if too_big:
                if len(self._big) >= 4096:
                    self._big.clear()
                self._big[key] = time.monotonic() + TOO_BIG_AGAIN


class AttrCache:
    """Path -> attributes, leased or for ``timeout`` seconds (thread-safe).

    Args:
        timeout: seconds a timed entry lives (0: none are kept).
        max_bytes: the estimated bytes entries and listings hold at most (:attr:`nbytes`).
    """

    def __init__(self, timeout: float, *, max_bytes: int = MAX_BYTES):
        self.timeout = timeout
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        # ("a", path) for an entry, ("l", path) for a listing -> its estimated bytes, oldest first
        self._sizes: dict[tuple[str, str], int] = {}
        self.nbytes = 0  # the sum of _sizes
        self._next_purge = 0.0  # monotonic time of the next sweep of expired entries
        # path -> (expiry, attr, lease id (0: a timed entry), when its request was sent)
        self._by_path: dict[str, tuple[float, Attr, int, float]] = {}
        self._by_ino: dict[int, set[str]] = {}
        self._by_lease: dict[int, set[str]] = {}  # lease id -> the paths it covers (a listing's: many)
        # A listing's file path -> the lease of its directory's own entry, which also covers it
        # (the listing's lease is on inodes; the directory's entry's on the walk to it).
        self._also: dict[str, int] = {}
        self._dirs: set[str] = set()  # the cached paths that are directories
        # directory path -> (expiry, its names, lease id): whole listings, leased only
        self._lists: dict[str, tuple[float, list[str], int]] = {}
        self._lists_sent: dict[str, float] = {}  # directory path -> when its listing was asked for
        self._list_by_lease: dict[int, str] = {}
        self.mutations = 0  # mutations of this client begun or ended
        self.inflight = 0  # mutations of this client not answered yet
        self.invalidations = 0  # watch answers (and watch failures) processed
        self.leasing = False  # the watch is live: stats may ask for leases
        self.sessions = True  # the watch asks for a session (a FUSE mount's does not: its kernel caches)
        self.session = 0.0  # seconds of the session the service granted (0: none, leases trusted to expiry)
        self.heard = 0.0  # when the last watch whose answer was processed was sent (monotonic)
        # Told on the watch thread of every invalidation (``invalidated(lease ids, done)``:
        # it calls ``done(lease ids)`` once it took them back, from any thread, and the
        # watch acknowledges them then) and watch failure (``lost()``, done when it returns):
        # the FUSE daemon's ``KernelLeases``, which takes back what it told the kernel.
        self.listener: Any = None

    def __len__(self) -> int:
        return len(self._by_path)

    def get(self, path: str, *, leased: bool = False) -> Attr | None:
        """The cached attributes of ``path`` if still valid (``leased``: only a leased entry)."""
        attr = self._get(path, leased)
        (CACHE_HITS if attr is not None else CACHE_MISSES).inc()
        return attr

    def _get(self, path: str, leased: bool) -> Attr | None:
        heard = self.heard  # read before the entry: the watch drops what changed, then moves it
        entry = self._by_path.get(path)
        if entry is None:
            return None
        now = time.monotonic()
        if entry[0] < now:
            with self._lock:
                if self._by_path.get(path) is entry:
                    self._drop(path)
            return None
        if entry[2] and not self._trusted(heard, entry[3], now):
            return None
        return None if leased and not entry[2] else entry[1]

    def _trusted(self, heard: float, sent: float, now: float) -> bool:
        """Within the session: a watch sent since ``now - session`` was answered and
        processed (``heard``), or the lease itself was asked for since (``sent``): any
        change to it since would be waited for until past now."""
        session = self.session
        return not session or now < max(heard, sent) + session

    def get_names(self, path: str) -> list[str] | None:
        """The names of directory ``path``, if a leased listing of it is still valid."""
        heard = self.heard
        entry = self._lists.get(path)
        if entry is None:
            return None
        now = time.monotonic()
        if entry[0] < now:
            with self._lock:
                if self._lists.get(path) is entry:
                    self._drop_names(path)
            return None
        if not self._trusted(heard, self._lists_sent.get(path, 0.0), now):
            return None
        return list(entry[1])

    def put_names(self, path: str, names: list[str], token: tuple[int, int], lease_id: int, lease_ms: int,
                  sent: float) -> None:
        """Remember a whole listing of ``path`` under its lease (as :meth:`put`)."""
        with self._lock:
            if (self.inflight or (self.mutations, self.invalidations) != token
                    or not (lease_ms > 0 and lease_id and self.leasing)):
                return
            self._drop_names(path)
            kept = list(names)
            self._lists[path] = (sent + lease_ms / 1000, kept, lease_id)
            self._lists_sent[path] = sent
            self._list_by_lease[lease_id] = path
            self._account(("l", path), LISTING_BYTES + sys.getsizeof(path) + sys.getsizeof(kept)
                          + sum(map(sys.getsizeof, kept)))

    def _drop_names(self, path: str) -> None:
        entry = self._lists.pop(path, None)
        if entry is not None:
            self._lists_sent.pop(path, None)
            self._list_by_lease.pop(entry[2], None)
            self.nbytes -= self._sizes.pop(("l", path))

    def _clear_names(self) -> None:
        for path in list(self._lists):
            self._drop_names(path)

    # -- bounds --------------------------------------------------------------------------------
    def _account(self, key: tuple[str, str], size: int) -> None:
        """Count a stored entry's bytes, purge what expired (when due), and past
        :attr:`max_bytes` drop the oldest entries until the cache fits again."""
        self._sizes[key] = size
        self.nbytes += size
        self._purge(time.monotonic())
        while self.nbytes > self.max_bytes and self._sizes:
            kind, path = next(iter(self._sizes))
            if kind == "a":
                self._drop(path)
            else:
                self._drop_names(path)

    def _purge(self, now: float) -> None:
        if now < self._next_purge:
            return
        self._next_purge = now + PURGE_EVERY
        for path in [p for p, entry in self._by_path.items() if entry[0] < now]:
            self._drop(path)
        for path in [p for p, entry in self._lists.items() if entry[0] < now]:
            self._drop_names(path)

    def purge(self) -> None:
        """Drop expired entries and listings (a sweep every :data:`PURGE_EVERY` s at most)."""
        now = time.monotonic()
        if now >= self._next_purge:
            with self._lock:
                self._purge(now)

    def token(self) -> tuple[int, int]:
        """Taken before a lookup is sent, handed to :meth:`put` with its answer."""
        return self.mutations, self.invalidations

    def put(self, path: str, attr: Attr, token: tuple[int, int], lease_id: int = 0, lease_ms: int = 0,
            sent: float = 0.0) -> None:
        """Remember ``attr`` for ``path``: leased (``lease_ms`` from ``sent``, the monotonic
        time before the request went out) or timed, unless something that could make it
        stale happened since ``token`` was taken."""
        with self._lock:
            if self.inflight or (self.mutations, self.invalidations) != token:
                return
            # A lease is an id the service will invalidate: a lifetime without one (a batch
            # answer whose other paths were leased, this path past the service's bounds)
            # covers nothing, and is kept as a timed entry at most.
            if lease_ms > 0 and lease_id and self.leasing:
                expires = sent + lease_ms / 1000
            elif self.timeout > 0:
                expires, lease_id = time.monotonic() + self.timeout, 0
            else:
                return
            self._store(path, attr, expires, lease_id, sent)

    def put_files(self, directory: str, entries: list[tuple[str, Attr]], token: tuple[int, int], lease_id: int,
                  lease_ms: int, sent: float) -> None:
        """Remember the files of a whole listing of ``directory`` (``(name, attributes)``
        each), all under the listing's one lease (the service leases a listing with
        attributes and layouts on the directory's inode and each file's), unless something
        that could make them stale happened since ``token`` (as :meth:`put`). Leased only,
        and only while ``directory``'s own entry is leased: a path is stale when any name
        on the way to it changes (a parent renamed), which only the walk's keys -- that
        entry's lease -- cover; its invalidation drops the files too, and they expire with
        it at the latest."""
        with self._lock:
            if (self.inflight or (self.mutations, self.invalidations) != token
                    or not (lease_ms > 0 and lease_id and self.leasing)):
                return
            base = directory.rstrip("/")
            walk = self._by_path.get(base or "/")
            if walk is None or not walk[2] or not walk[1].is_dir:
                return
            expires, dir_lease = min(sent + lease_ms / 1000, walk[0]), walk[2]
            also = self._by_lease.setdefault(dir_lease, set())
            for name, attr in entries:
                if attr.is_file:
                    path = f"{base}/{name}"
                    self._store(path, attr, expires, lease_id, sent)
                    also.add(path)
                    self._also[path] = dir_lease

    def _store(self, path: str, attr: Attr, expires: float, lease_id: int, sent: float = 0.0) -> None:
        self._drop(path)
        self._by_path[path] = (expires, attr, lease_id, sent)
        self._by_ino.setdefault(attr.ino, set()).add(path)
        if lease_id:
            self._by_lease.setdefault(lease_id, set()).add(path)
        if attr.is_dir:
            self._dirs.add(path)
        size = ENTRY_BYTES + sys.getsizeof(path)
        if attr.layout is not None:
            size += sys.getsizeof(attr.layout) + sys.getsizeof(attr.layout.chains)
        if attr.target is not None:
            size += sys.getsizeof(attr.target)
        self._account(("a", path), size)

    def _drop(self, path: str) -> None:
        entry = self._by_path.pop(path, None)
        if entry is not None:
            paths = self._by_ino.get(entry[1].ino)
            if paths is not None:
                paths.discard(path)
                if not paths:
                    del self._by_ino[entry[1].ino]
            if entry[2]:
                self._uncover(entry[2], path)
            also = self._also.pop(path, 0)
            if also:
                self._uncover(also, path)
            self._dirs.discard(path)
            self.nbytes -= self._sizes.pop(("a", path))

    def _uncover(self, lease_id: int, path: str) -> None:
        covered = self._by_lease.get(lease_id)
        if covered is not None:
            covered.discard(path)
            if not covered:
                del self._by_lease[lease_id]

    def _drop_ino(self, ino: int) -> None:
        for path in list(self._by_ino.get(ino, ())):
            self._drop(path)

    def _clear(self) -> None:
        self._by_path.clear()
        self._by_ino.clear()
        self._by_lease.clear()
        self._also.clear()
        self._dirs.clear()
        self._lists.clear()
        self._lists_sent.clear()
        self._list_by_lease.clear()
        self._sizes.clear()
        self.nbytes = 0

    # -- this client's mutations ---------------------------------------------------------------
    def begin(self, msg: Message[Any]) -> None:
        """A mutation is about to be sent."""
        with self._lock:
            self.mutations += 1
            self.inflight += 1

    def done(self, msg: Message[Any], reply: Any) -> None:
        """A mutation was answered (``reply``) or failed (a ``StripefsError``)."""
        with self._lock:
            self.mutations += 1
            self.inflight -= 1
            # A removed symlink may be on the way of any cached path (``/d/link/x``, or
            # ``/e/l/x`` with ``/e/l -> /d/link``), and the service tells other clients only:
            # everything goes. A file has nothing under it; its other names share its inode.
            if (isinstance(msg, (m.CreatePath, m.UnlinkPath)) and not isinstance(reply, BaseException)
                    and not reply.attr.is_symlink):
                self._named([msg.path], [reply.attr])
                if isinstance(msg, m.CreatePath) and self.timeout > 0:
                    self._store(msg.path, reply.attr, time.monotonic() + self.timeout, 0)
            elif isinstance(msg, m.ReserveFiles):
                pass  # inode numbers set aside: no name, no attribute changed
            elif isinstance(msg, m.CommitFiles) and not isinstance(reply, BaseException):
                # New regular files (names that existed failed alone, unchanged): as a create
                # of each, never the whole cache (one per small file written).
                self._named(msg.paths, reply.attrs)
            else:
                self._clear()

    def _named(self, paths: list[str], attrs: list[Attr]) -> None:
        """Names were made or removed (not symlinks): drop them, their inodes, every
        directory's attributes and the kept listings (the directories gained or lost a name)."""
        for path in paths:
            self._drop(path)
        for attr in attrs:
            self._drop_ino(attr.ino)
        for path in list(self._dirs):
            self._drop(path)
        self._clear_names()

    # -- the watch -----------------------------------------------------------------------------
    def invalidate(self, lease_ids: list[int]) -> None:
        """The service names leases whose keys changed: drop their entries."""
        with self._lock:
            self.invalidations += 1
            for lease_id in lease_ids:
                for path in list(self._by_lease.get(lease_id, ())):
                    self._drop(path)
                path = self._list_by_lease.get(lease_id)
                if path is not None:
                    self._drop_names(path)

    def lost(self) -> None:
        """The watch is down (or the service forgot this client): no leased entry can be trusted."""
        with self._lock:
            self.invalidations += 1
            self.leasing = False
            for path in [p for p, (_, _a, lease, _s) in self._by_path.items() if lease]:
                self._drop(path)
            self._clear_names()

    def watching(self, sent: float, session_ms: int) -> None:
        """The watch is live: stats may ask for leases. An answer to the watch sent at
        ``sent`` (monotonic) was processed, its invalidations dropped: leased entries are
        trusted until ``sent`` plus the session (``session_ms``; 0: none)."""
        with self._lock:
            self.session = session_ms / 1000
            self.heard = max(self.heard, sent)
            self.leasing = True


class LeaseWatch:
    """The thread that keeps ``WatchLeases`` in flight for ``core``'s :class:`AttrCache`.

    Its connection is its own (the pooled metadata connections keep their pipelining); the
    next call acknowledges what the last answer named, once the cache dropped it. It keeps
    what it needs of ``core`` (its configuration, client id and request ids), never the
    core itself: a client dropped without ``close()`` is then collected, and closed by its
    finalizer (``fsclient.core._client``).

    The cache's listener (a FUSE mount's ``KernelLeases``) is handed each invalidation
    with a callback, and calls it, from any thread, once it took back what it told under
    those leases (the kernel's entries: that may wait for a directory's lock). What it has
    finished is acknowledged by lease id (``WatchLeases.done``) while the rest is still in
    progress, so one blocked kernel invalidation holds back only its own leases.
    """

    def __init__(self, core: Any, cache: AttrCache):  # core: the ClientCore (which imports this module)
        self.cache = cache
        self._config, self._client_id, self._ids = core.config, core.client_id, core._ids
        self._stop = threading.Event()
        self._conn: Any = None
        self._progress = threading.Condition()
        self._pending: set[int] = set()  # lease ids handed to the listener, not finished yet
        self._finished: list[int] = []  # finished since the last watch was sent (it acknowledges them)
        self._thread = threading.Thread(target=self._run, name="stripefs-lease-watch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop watching: every leased entry is dropped, and the service told to forget this
        client's leases (so nobody's change waits for them to run out). Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self.cache.lost()
        conn = self._conn
        if conn is not None:
            try:
                conn.call(m.WatchLeases(after=-1, wait_ms=0), timeout=2.0)
            except (StripefsError, OSError):
                pass  # the leases run out on their own
            conn.close()  # the call in flight fails at once
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=2.0)  # it ends once its call failed (or its connect returned)

    def _lost(self) -> None:
        """Every leased entry goes (the listener's too) before a new watch, which
        acknowledges everything, is sent: what is still in progress is waited for."""
        self.cache.lost()
        listener = self.cache.listener
        if listener is not None:
            try:
                listener.lost()
            except Exception:  # noqa: BLE001 -- the watch goes on (the listener logs its own trouble)
                log.warning("the lease listener failed", exc_info=True)
        with self._progress:
            while self._pending and not self._stop.is_set():
                self._progress.wait(0.1)
            self._pending.clear()
            self._finished = []

    def _invalidated(self, lease_ids: list[int]) -> None:
        """The service names ``lease_ids``: this client's cache drops them now, the listener
        (if any) takes them back on its own time and says when (:meth:`_finish`)."""
        with self._progress:
            new = [i for i in lease_ids if i not in self._pending]  # an answer repeats what is in progress
        if not new:
            return
        self.cache.invalidate(new)
        listener = self.cache.listener
        if listener is None:
            return
        with self._progress:
            self._pending.update(new)
        try:
            listener.invalidated(new, self._finish)
        except Exception:  # noqa: BLE001 -- the watch goes on (the listener logs its own trouble)
            log.warning("the lease listener failed", exc_info=True)
            self._finish(new)

    def _finish(self, lease_ids: list[int]) -> None:
        """The listener took back what it told under ``lease_ids`` (any thread)."""
        with self._progress:
            for lease_id in lease_ids:
                if lease_id in self._pending:
                    self._pending.discard(lease_id)
                    self._finished.append(lease_id)
            self._progress.notify_all()

    def _acks(self) -> tuple[list[int], bool]:
        """What the next watch acknowledges by lease id, and whether nothing is in
        progress any more (then it acknowledges everything it was told, by ``after``). A
        listener's invalidation usually takes well under :data:`ACK_WAIT`: waited for."""
        with self._progress:
            if self._pending:
                self._progress.wait_for(lambda: not self._pending, timeout=ACK_WAIT)
            done, self._finished = self._finished, []
            return done, not self._pending

    def _connect(self) -> Connection:
        config = self._config
        return Connection(config.addresses[0], config.secret, self._client_id, expect_role="metadata",
                          ids=self._ids, role=config.role)

    def _run(self) -> None:
        after = seen = 0  # acknowledged; the last seq an answer carried
        cache = self.cache
        while not self._stop.is_set():
            done, idle = self._acks()
            if idle:
                after, done = seen, []  # every invalidation told so far is done
            try:
                if self._conn is None:
                    self._conn = self._connect()
                    if self._stop.is_set():
                        self._conn.close()
                        return
                # While some are in progress, a short wait: the next answer carries what finished.
                msg = m.WatchLeases(after=after, wait_ms=WATCH_WAIT_MS if idle else ACK_POLL_MS,
                                    session=cache.sessions, done=done)
                sent = time.monotonic()
                header = self._conn.call(msg, timeout=msg.wait_ms / 1000 + 30).header
                reply = m.decode_reply(msg, header)
            except (StripefsError, OSError) as exc:
                self._lost()
                after = seen = 0
                conn, self._conn = self._conn, None
                if conn is not None:
                    conn.close()
                code = getattr(exc, "code", None)
                unsupported = code in (ErrorCode.NOT_SUPPORTED, ErrorCode.PROTOCOL, ErrorCode.INVALID)
                self._stop.wait(RETRY_UNSUPPORTED if unsupported else RETRY_WATCH)
                continue
            if self._stop.is_set():
                return
            if reply.reset:
                self._lost()
                after = seen = 0
                continue
            seen = reply.seq
            if reply.lease_ids:
                self._invalidated(reply.lease_ids)
            # Counted only once what it named was dropped; a session granted to a watch that
            # no longer asks for one (a mount's, just started) is not counted at all.
            if cache.sessions or not reply.session_ms:
                cache.watching(sent, reply.session_ms)
            cache.purge()  # expired entries go even while the client is idle
