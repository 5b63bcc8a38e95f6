"""The metadata service: namespace, storage membership, chain table, garbage collection.

Namespace mutations run in batches on a writer thread (group commit: one durable
commit per batch), reads on a reader thread, so the trio loop never waits on the
disk; what needs no disk wait runs on the loop itself: short reads (``INLINE_COST``)
and single-path mutations, whose commit writes the log to the page cache (under
``--metadata-sync full`` they are answered once a group fsync of the log by a third
thread covers them: ``LogSync``). Storage servers register and heartbeat here; the chain table
(chain id -> ordered target ids) is derived from membership. With replication
factor 1 every server is one chain of one target; chains are lists so chain
replication can extend them.

Background tasks: a liveness check (a server silent for ``OFFLINE_AFTER``
seconds is reported offline), admission (a registering server is ``pending``
until the service has connected back to it: ``_admission.py``), rate-limited
chain moves for servers that joined a frozen table, and the garbage collector
that tells storage servers to drop the chunks of removed files and the tails
of truncated ones.
"""

from __future__ import annotations

import contextvars
import functools
import json
import logging
import math
import os
import pickle
import random
import stat
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import trio

from stripefs.rpc import ServerConn, Service, TrioPool, serve_rpc
from stripefs.wire import Attr, DirEntry, ErrorCode, FrameHead, Message, ReplyMessage, Routing, ServerInfo, StripefsError, role_credential
from stripefs.wire import messages as m

from ._leader import Leadership
from ._admission import MAX_SERVER_ID, NOT_YET, connect_back, same_token, token_hash, validate
from ._leases import Leases
from ._leasetable import LEASE_TTL, LeaseTable
from ._namespace import Namespace
from ._store import GarbageItem, SqliteStore, Store, check_sync
from ._worker import Job, LogSync, StoreThread, run_each

log = logging.getLogger(__name__)

OFFLINE_AFTER = 5.0
# Chains per server when the table is built: more chains than servers lets a new server
# take over whole chains (a fair share) without changing any file's layout.
CHAINS_PER_SERVER = 4
GC_INTERVAL = 0.5
# Chunks of a removed file stay this long, so clients that opened it before the
# unlink (a reader racing a rename-over) finish reading real bytes, not holes.
GC_GRACE = 30.0
# A server that left a chain keeps its copy this long: every server and client sees the
# new routing first (servers within a heartbeat; clients on STALE_ROUTING).
DROP_GRACE = 5.0
# With one replica a chain moved to a server that then fails has no copy left, so a new
# server takes chain slots only after it has heartbeated this long (``--admit-after``).
ADMIT_AFTER = 3.0
# A server counts as heartbeating when its last heartbeat is this recent (they come every second).
HEARTBEAT_FRESH = 2.0
# Chain moves start at most this often, and only while no other server's moves are in flight.
MOVE_INTERVAL = 1.0
# A registration neither repeated nor followed by heartbeats for this long is forgotten.
PENDING_TTL = 10.0
# Registrations waiting for admission at once: beyond, BUSY (a flood cannot grow memory).
MAX_PENDING = 64
# Connect-back checks running at once.
MAX_VERIFYING = 8
# With several services, results of mutations are kept this long for retries that fail
# over to another service (a client retries for at most a minute).
REPLIES_KEPT = 600.0
# The leader refreshes the row followers read (capacities, usage) at most this often.
VIEW_REFRESH = 2.0

# The (client id, request id) of the mutation the current task applies: ``_ns`` records its
# result in the store under that key (see ``MetadataService._once``).
_REQUEST: contextvars.ContextVar[tuple[bytes, int] | None] = contextvars.ContextVar("request", default=None)
# The store keys the current mutation wrote (``SqliteStore.touched``), when leases are granted:
# their leases are invalidated once it committed, before it is answered (``MetadataService.handle``).
_TOUCHED: contextvars.ContextVar[set[Any] | None] = contextvars.ContextVar("touched", default=None)


@dataclass
class Candidate:
    """A registration waiting for its connect-back check; never in the chain table."""

    server_id: int
    host: str
    port: int
    root: str
    capacity: int
    used: int
    pid: int
    token_hash: str
    first_seen: float
    last_seen: float
    reason: str = "waiting for the connect-back check"
    attempts: int = 0
    next_try: float = 0.0
    verifying: bool = False

    def as_status(self, now: float) -> dict[str, Any]:
        return {"server_id": self.server_id, "host": self.host, "port": self.port, "root": self.root,
                "reason": self.reason, "attempts": self.attempts, "waiting": round(now - self.first_seen, 1)}


class Membership:
    """Storage servers, their states and the chain table.

    Persisted as one JSON document (:meth:`to_doc`): by the metadata service in the
    store's ``membership`` row (written by the leading service only, see
    ``MetadataService``), or, given a ``path``, in a file (tests; and the
    ``servers.json`` of older versions, imported into the store once).

    The chain table is built from the registered servers: ``CHAINS_PER_SERVER``
    chains per server, chain ``i`` = servers ``i, i+1, ..., i+R-1`` (mod N) in id
    order, so consecutive chains start on different servers, every server heads
    the same number of chains and recovery load spreads. It is frozen when the
    first file is created: a file's layout names chains; later changes move a
    chain's targets (resync first), never which chains a file uses.

    States: ``serving``; ``offline`` (no heartbeat for ``OFFLINE_AFTER``);
    ``syncing`` (back after being away while another replica of its chains kept
    serving: it receives new writes at the end of its chains and copies what it
    missed, then reports :class:`SyncDone`); ``joining`` (admitted into a frozen
    table, holding no chain slot yet: :meth:`place` moves it in). Every state
    change bumps the routing version; clients and servers refresh on a mismatch.

    Registrations are not trusted: :meth:`register` only records a
    :class:`Candidate` (``pending``, outside :attr:`servers` and the table); the
    service checks it by connecting back and then calls :meth:`admit`. A server id
    is bound to the SHA-256 of its data directory's token (:attr:`tokens`).

    Args:
        admit_after: with one replica, seconds a new server must heartbeat before it
            takes chain slots.
        move_interval: least seconds between two servers' chain moves.
        clock: the monotonic clock (tests drive time).
    """

    def __init__(self, path: str | None = None, replicas: int = 1, *, admit_after: float = ADMIT_AFTER,
                 move_interval: float = MOVE_INTERVAL, clock: Callable[[], float] = time.monotonic,
                 doc: str | None = None, restarted: bool = True):
        self.path = path
        self.clock = clock
        self.admit_after = admit_after
        self.move_interval = move_interval
        self.servers: dict[int, ServerInfo] = {}
        self.tokens: dict[int, str] = {}  # server id -> SHA-256 of its data directory's token
        self.pending: dict[int, Candidate] = {}
        self.since: dict[int, float] = {}  # server id -> when its current run of heartbeats began
        self.last_move = -float("inf")
        self.version = 1
        self.replicas = replicas
        self.table: dict[int, list[int]] = {}
        self.frozen = False
        self.stale: set[int] = set()
        self.leaving: dict[int, int] = {}  # chain -> server that leaves it once the newcomer synced
        self.drops: list[tuple[int, int]] = []  # (server, chain): chunks to delete on a server that left
        # chain -> its last serving target, when that one went offline with no other member
        # serving (the others were syncing or offline): it alone holds everything the chain
        # acknowledged, so once back it serves that chain even while it resyncs its others.
        self.lastsrv: dict[int, int] = {}
        self.draining: set[int] = set()  # servers being removed: their chain slots move away (remove)
        # Without a file the owner persists :meth:`to_doc` (the store's membership row)
        # whenever ``dirty`` is set.
        self.dirty = False
        if doc is None and path is not None:
            try:
                with open(path) as f:
                    doc = f.read()
            except FileNotFoundError:
                pass
        if doc is not None:
            self._load(json.loads(doc), restarted)

    def _load(self, raw: dict[str, Any], restarted: bool) -> None:
        """Adopt a saved document; ``restarted``: this service takes the membership over
        (a new routing version, every server's silence counted from now)."""
        self.version = int(raw.get("version", 1)) + (1 if restarted else 0)
        self.replicas = int(raw.get("replicas", self.replicas))
        self.frozen = bool(raw.get("frozen", False))
        self.table = {int(c): [int(t) for t in ts] for c, ts in raw.get("table", [])}
        self.leaving = {int(c): int(t) for c, t in raw.get("leaving", [])}
        self.drops = [(int(t), int(c)) for t, c in raw.get("drops", [])]
        self.lastsrv = {int(c): int(t) for c, t in raw.get("lastsrv", [])}
        self.tokens = {int(sid): str(h) for sid, h in raw.get("tokens", [])}
        self.draining = {int(sid) for sid in raw.get("draining", [])}
        now = self.clock()
        for s in raw.get("servers", []):
            info = ServerInfo.from_wire(s)
            if not restarted:
                self.servers[info.server_id] = info  # a read-only view of the leader's document
                continue
            if info.state != "serving":
                self.stale.add(info.server_id)  # missed writes before the restart: must resync
            # Keep the last known state: after a restart of this service alone the storage
            # servers are still up and their next heartbeat confirms it; a server that
            # stays silent is declared offline by the usual sweep.
            self.servers[info.server_id] = ServerInfo(**{**info.to_wire(), "last_seen": now})
            self.since[info.server_id] = now  # a joining server's wait starts again after a restart

    def to_doc(self) -> str:
        """The persistent state as a JSON document (``servers.json``, or the store's row)."""
        return json.dumps({"version": self.version, "replicas": self.replicas, "frozen": self.frozen,
                           "table": [[c, ts] for c, ts in sorted(self.table.items())],
                           "leaving": [[c, t] for c, t in sorted(self.leaving.items())],
                           "drops": [list(d) for d in self.drops],
                           "lastsrv": [[c, t] for c, t in sorted(self.lastsrv.items())],
                           "tokens": [[sid, h] for sid, h in sorted(self.tokens.items())],
                           "draining": sorted(self.draining),
                           "servers": [s.to_wire() for s in self.servers.values()]})

    def save(self) -> None:
        if self.path is None:
            self.dirty = True  # the service writes the row before it answers anyone
            return
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.write(self.to_doc())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        # The rename is durable only once the directory entry is: a power loss must not
        # bring back an older chain table than the one servers and clients were told.
        dfd = os.open(os.path.dirname(os.path.abspath(self.path)), os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def _rebuild(self) -> None:
        if self.frozen:
            return
        ids = sorted(s for s, info in self.servers.items() if info.state != "removed")
        r = min(self.replicas, len(ids))
        count = len(ids) * CHAINS_PER_SERVER
        self.table = {i + 1: [ids[(i + k) % len(ids)] for k in range(r)] for i in range(count)}

    def freeze(self) -> None:
        """Fix the chain table (first file creation)."""
        if not self.frozen and self.table:
            self.frozen = True
            self.save()

    def _set(self, sid: int, **changes: Any) -> None:
        old = self.servers[sid]
        self.servers[sid] = ServerInfo(**{**old.to_wire(), **changes})
        if changes.get("state", old.state) != old.state:
            log.info("storage server %d: %s -> %s", sid, old.state, changes["state"])
            self.version += 1
            if changes["state"] == "serving":
                self.stale.discard(sid)
                # It holds every chain of its own now: no chain of it needs a last serving target.
                self.lastsrv = {c: t for c, t in self.lastsrv.items() if t != sid and sid not in self.table.get(c, ())}
            elif changes["state"] == "offline" and old.state == "serving":
                self._note_last_serving(sid)
            elif changes["state"] == "removed":  # gone for good: its chains cannot wait for it
                self.lastsrv = {c: t for c, t in self.lastsrv.items() if t != sid}
            self.save()  # a restarted metadata service must know who missed writes

    def _note_last_serving(self, sid: int) -> None:
        """``sid`` stops serving: it is the last serving target of its chains nobody else serves."""
        for c, ts in self.table.items():
            if sid in ts and not any(self._serves(c, t) for t in ts if t != sid):
                self.lastsrv[c] = sid

    def _serves(self, chain: int, sid: int) -> bool:
        """Does ``sid`` serve ``chain``: serving, or syncing as the chain's last serving target?"""
        info = self.servers.get(sid)
        if info is None:
            return False
        return info.state == "serving" or (info.state == "syncing" and self.lastsrv.get(chain) == sid)

    def _peers_serving(self, sid: int) -> bool:
        """Does some other replica of one of ``sid``'s chains still serve?"""
        return any(
            t != sid and self.servers.get(t) is not None and self.servers[t].state == "serving"
            for ts in self.table.values() if sid in ts for t in ts
        )

    def _behind(self, sid: int) -> bool:
        """May ``sid``, returning, lack acknowledged writes? Then it must resync before serving.

        Yes if it missed writes before a restart of this service, if another replica of
        one of its chains kept serving, or if one of its chains lost its last serving
        target to another server (which alone has that chain's latest writes).
        """
        return (sid in self.stale or self._peers_serving(sid)
                or any(self.lastsrv.get(c, sid) != sid for c, ts in self.table.items() if sid in ts))

    def _in_table(self, sid: int) -> bool:
        return any(sid in ts for ts in self.table.values())

    def _new_id(self) -> int:
        used = set(self.servers) | set(self.pending) | set(self.tokens)
        sid = max(used, default=0) + 1
        if sid > MAX_SERVER_ID:  # someone registered the largest id: take the first free one
            sid = next(i for i in range(1, MAX_SERVER_ID + 1) if i not in used)
        return sid

    def register(self, msg: m.RegisterServer) -> tuple[int, str]:
        """Record a registration as ``pending``; nothing else changes until :meth:`admit`.

        Returns:
            ``(server id, "pending")``.

        Raises:
            StripefsError: INVALID for a bad field; PERMISSION when the server id is bound
            to another data directory's token (or another registration is being checked
            for it); BUSY when too many registrations wait.
        """
        validate(msg)
        th = token_hash(msg.token)
        sid = msg.server_id
        if sid is None:
            # The same data directory registering again without its id (it lost the answer):
            # it keeps the id it was given.
            sid = next((s for s, h in self.tokens.items() if h == th), None)
            sid = sid or next((c.server_id for c in self.pending.values() if c.token_hash == th), None)
            sid = sid or self._new_id()
        recorded = self.tokens.get(sid)
        if recorded is not None and not same_token(recorded, msg.token):
            raise StripefsError(ErrorCode.PERMISSION, f"storage server {sid} belongs to another data directory")
        if sid in self.servers and self.servers[sid].state == "removed":
            raise StripefsError(ErrorCode.PERMISSION, f"storage server {sid} was removed from the cluster for good")
        now = self.clock()
        old = self.pending.get(sid)
        if old is not None and old.token_hash != th:
            if now - old.last_seen <= PENDING_TTL:
                raise StripefsError(ErrorCode.PERMISSION, f"another registration of storage server {sid} is being checked")
            old = None
        if old is not None and (old.host, old.port, old.root) == (msg.host, msg.port, msg.root):
            old.capacity, old.used, old.pid, old.last_seen = msg.capacity, msg.used, msg.pid, now
            return sid, "pending"
        if old is None and len(self.pending) >= MAX_PENDING:
            raise StripefsError(ErrorCode.BUSY, "too many registrations are waiting for admission; retry later")
        self.pending[sid] = Candidate(sid, msg.host, msg.port, msg.root, msg.capacity, msg.used, msg.pid, th, now, now)
        log.info("storage server %d (%s:%d) registered: pending until it answers a connect-back", sid, msg.host, msg.port)
        return sid, "pending"

    def reject(self, sid: int, reason: str) -> None:
        """A connect-back check failed: keep the candidate pending, with the reason, and retry later."""
        cand = self.pending.get(sid)
        if cand is None:
            return
        if reason != cand.reason:
            log.info("storage server %d (%s:%d) not admitted yet: %s", sid, cand.host, cand.port, reason)
        cand.reason = reason
        cand.attempts += 1
        delay = 0.02 if reason == NOT_YET else min(2.0, 0.05 * 2 ** min(cand.attempts, 6))
        cand.next_try = self.clock() + delay

    def admit(self, sid: int) -> str:
        """The candidate passed the connect-back check: it joins the membership. Returns its state."""
        cand = self.pending.pop(sid)
        now = self.clock()
        old = self.servers.get(sid)
        if old is not None and old.state == "serving":
            # Restarted faster than failure detection: it stopped serving all the same.
            self._note_last_serving(sid)
        behind = self._behind(sid)
        state = "syncing" if old is not None and self.frozen and self.replicas > 1 and behind else "serving"
        if any(sid in ts for c, ts in self.table.items() if c in self.leaving and self.leaving[c] != sid):
            state = "syncing"  # a newcomer that restarted before it finished copying
        elif self.frozen and not self._in_table(sid):
            state = "joining"  # chain slots come later, rate-limited (place)
        info = ServerInfo(sid, cand.host, cand.port, state, cand.capacity, cand.used, cand.pid, now)
        self.servers[sid] = info
        self.tokens[sid] = cand.token_hash
        self.since[sid] = now
        self._rebuild()
        if old is None or (old.host, old.port, old.state) != (info.host, info.port, info.state):
            self.version += 1
        self.save()
        log.info("storage server %d (%s:%d) admitted: %s", sid, cand.host, cand.port, state)
        return state

    def _check_token(self, sid: int, token: str) -> None:
        recorded = self.tokens.get(sid)
        # A server recorded before tokens existed has none until it registers again.
        if recorded is not None and not same_token(recorded, token):
            raise StripefsError(ErrorCode.PERMISSION, f"storage server {sid} belongs to another data directory")

    def heartbeat(self, msg: m.Heartbeat) -> str:
        validate(msg)
        sid = msg.server_id
        cand = self.pending.get(sid)
        if cand is not None and (sid not in self.servers or cand.token_hash == token_hash(msg.token)):
            if cand.token_hash != token_hash(msg.token):
                raise StripefsError(ErrorCode.PERMISSION, f"storage server {sid} belongs to another data directory")
            cand.capacity, cand.used, cand.last_seen = msg.capacity, msg.used, self.clock()
            return "pending"
        old = self.servers.get(sid)
        if old is None:
            raise StripefsError(ErrorCode.NOT_FOUND, f"unknown storage server {sid}")
        self._check_token(sid, msg.token)
        if old.state == "removed":
            return "removed"  # it stops (storage._server); it never takes a slot again
        now = self.clock()
        state = old.state
        if state == "offline":  # it was declared dead and may have missed writes
            behind = self._behind(sid)
            state = "syncing" if self.replicas > 1 and behind else "serving"
            if state == "serving" and self.frozen and not self._in_table(sid):
                state = "joining"
            self.since[sid] = now
        self._set(sid, state=state, capacity=msg.capacity, used=msg.used, last_seen=now)
        return state

    def place(self) -> int | None:
        """Move one ``joining`` server into its fair share of chain slots, if moves are due.

        Rate-limited: never while another server's moves are in flight, nor within
        ``move_interval`` of the last; with one replica only a server that has
        heartbeated for ``admit_after`` seconds (and still does). Returns the server moved.
        """
        if not self.frozen or self.leaving:
            return None
        now = self.clock()
        if now - self.last_move < self.move_interval:
            return None
        for sid in sorted(self.servers):
            info = self.servers[sid]
            if info.state != "joining" or now - info.last_seen > HEARTBEAT_FRESH:
                continue
            if self.replicas == 1 and now - self.since.setdefault(sid, now) < self.admit_after:
                continue
            moved = self._plan_migration(sid)
            self.last_move = now
            self._set(sid, state="syncing" if moved else "serving")
            return sid
        return self._drain_step(now)

    def remove(self, sid: int, force: bool = False) -> tuple[str, list[int], list[int]]:
        """Take storage server ``sid`` out of the cluster for good (``stripefs remove-server``).

        When every chain of ``sid`` has another serving replica it is *drained*:
        :meth:`place` moves its chain slots to other serving servers one server at a
        time (the newcomer resyncs, then ``sid`` leaves the chain as a donor does on
        ``add-server``); once it holds no slot it is ``removed``. A chain with no other
        serving replica would be lost: refused unless ``force``, which removes ``sid``
        from every chain at once. A removed server may never register again.

        Returns:
            ``(state, its chains, chains lost)``: state is ``draining`` or ``removed``.

        Raises:
            StripefsError: NOT_FOUND for an unknown server; PERMISSION naming the
            chains that would be lost, without ``force``.
        """
        info = self.servers.get(sid)
        if info is None:
            raise StripefsError(ErrorCode.NOT_FOUND, f"no storage server {sid} in this cluster")
        if info.state == "removed":
            return "removed", [], []
        chains = sorted(c for c, ts in self.table.items() if sid in ts)
        lost = [c for c in chains if not any(t != sid and self._state(t) == "serving" for t in self.table[c])]
        if not self.frozen:
            lost = []  # no file names a chain yet: nothing is stored
        if lost and not force:
            raise StripefsError(ErrorCode.PERMISSION, f"removing storage server {sid} would lose chains "
                                f"{', '.join(map(str, lost))}: no other replica serves them (--force to remove anyway)")
        if force or not self.frozen or not chains:
            for c in chains:
                self.table[c].remove(sid)
                self.leaving.pop(c, None)  # a move it donated to or joined is moot now
            self.draining.discard(sid)
            self._set(sid, state="removed")
            self._rebuild()
            self.save()
            log.warning("storage server %d removed%s", sid, f"; chains lost: {lost}" if lost else "")
            return "removed", chains, lost
        self.draining.add(sid)
        self.save()
        log.info("storage server %d draining: chains %s move to other servers", sid, chains)
        return "draining", chains, []

    def _state(self, sid: int) -> str:
        info = self.servers.get(sid)
        return "offline" if info is None else info.state

    def _drain_step(self, now: float) -> int | None:
        """Move a draining server's chain slots to one other serving server (or finish it).

        One newcomer at a time, like :meth:`place`: the newcomer is ``syncing`` until it
        reports SyncDone, so every chain it already serves must keep another serving target.
        """
        for sid in sorted(self.draining):
            chains = [c for c, ts in sorted(self.table.items()) if sid in ts]
            if not chains:
                self.draining.discard(sid)
                self._set(sid, state="removed")
                log.info("storage server %d drained and removed", sid)
                return sid
            slots: dict[int, int] = {s: 0 for s, i in self.servers.items()
                                     if i.state == "serving" and s not in self.draining}
            for ts in self.table.values():
                for t in ts:
                    if t in slots:
                        slots[t] += 1
            for new in sorted(slots, key=lambda s: (slots[s], s)):
                safe = all(any(t != new and self._state(t) == "serving" for t in ts)
                           for ts in self.table.values() if new in ts)
                moved = [c for c in chains if new not in self.table[c]]
                if not safe or not moved:
                    continue
                for c in moved:
                    self.table[c].append(new)
                    self.leaving[c] = sid
                    log.info("chain %d: server %d joins, draining server %d will leave", c, new, sid)
                self.last_move = now
                self._set(new, state="syncing")
                return new
            # No server can take these slots (every serving one is in the chain already): the
            # chain keeps fewer replicas; its other serving members hold every acknowledged byte.
            shrunk = [c for c in chains if any(t != sid and self._state(t) == "serving" for t in self.table[c])]
            for c in shrunk:
                self.table[c].remove(sid)
                self.drops.append((sid, c))
                log.warning("chain %d: no server can replace draining server %d; it keeps %d replicas",
                            c, sid, len(self.table[c]))
            if shrunk:
                self.version += 1
                self.save()
                return sid
        return None

    def _plan_migration(self, new: int) -> bool:
        """A server joined a frozen cluster: move it into a fair share of chain slots.

        It joins each chosen chain at the end (``syncing``: it gets new writes and
        copies the chain's data); the member it replaces keeps serving until the
        newcomer has caught up, then leaves the chain and deletes its copy. File
        layouts never change: chains keep their ids, only their targets move.
        """
        slots = {s: 0 for s in self.servers if s != new and self.servers[s].state != "removed" and s not in self.draining}
        for ts in self.table.values():
            for t in ts:
                slots[t] = slots.get(t, 0) + 1
        if not slots:
            return False
        want = sum(slots.values()) // (len(slots) + 1)
        for _ in range(want):
            for donor in sorted(slots, key=lambda s: -slots[s]):
                chain = next((c for c, ts in sorted(self.table.items())
                              if donor in ts and new not in ts and c not in self.leaving), None)
                if chain is not None:
                    break
            else:
                break
            self.table[chain].append(new)
            self.leaving[chain] = donor
            slots[donor] -= 1
            log.info("chain %d: server %d joins, server %d will leave", chain, new, donor)
        return bool(want)

    def sync_done(self, msg: m.SyncDone | int) -> None:
        """A syncing server caught up: the members it relieved leave those chains.

        ``msg`` is the server's :class:`SyncDone` (checked: fields, token) or, inside
        the service, a server id.
        """
        if isinstance(msg, m.SyncDone):
            validate(msg)
            if msg.server_id not in self.servers:
                raise StripefsError(ErrorCode.NOT_FOUND, f"unknown storage server {msg.server_id}")
            self._check_token(msg.server_id, msg.token)
            sid = msg.server_id
        else:
            sid = msg
        if sid in self.servers and self.servers[sid].state == "syncing":
            for chain, donor in list(self.leaving.items()):
                ts = self.table.get(chain, [])
                # Only the newcomer's SyncDone relieves the donor. The newcomer joined at the
                # end of the frozen table (_plan_migration) and stays last until then; another
                # member that blipped and resynced (the donor itself, or a third replica) has
                # caught up with its chains, but the newcomer may not have copied anything
                # yet, so dropping the donor then could remove the only complete copy.
                if ts and ts[-1] == sid and sid != donor:
                    # The newcomer serves from now on, so the chain keeps a serving target.
                    self.table[chain].remove(donor)
                    del self.leaving[chain]
                    self.drops.append((donor, chain))
            self._set(sid, state="serving")

    def add_drop_done(self, item: tuple[int, int]) -> None:
        if item in self.drops:
            self.drops.remove(item)
            self.save()

    def sweep(self) -> None:
        """Declare silent servers offline, forget silent registrations, start due chain moves."""
        now = self.clock()
        for sid, s in list(self.servers.items()):
            if s.state not in ("offline", "removed") and now - s.last_seen > OFFLINE_AFTER:
                log.warning("storage server %d (%s:%d) is offline", sid, s.host, s.port)
                self._set(sid, state="offline")
        for sid, cand in list(self.pending.items()):
            if now - cand.last_seen > PENDING_TTL and not cand.verifying:
                log.info("registration of storage server %d (%s:%d) dropped: %s", sid, cand.host, cand.port, cand.reason)
                del self.pending[sid]
        self.place()

    def pending_status(self) -> list[dict[str, Any]]:
        now = self.clock()
        return [c.as_status(now) for _, c in sorted(self.pending.items())]

    def routing(self) -> Routing:
        def state(c: int, t: int) -> str:
            info = self.servers.get(t)
            if info is None:
                return "offline"
            return "serving" if self._serves(c, t) else info.state

        members = {c: tuple((t, state(c, t)) for t in ts) for c, ts in self.table.items()}
        chains = {c: tuple(t for t, st in ms if st == "serving") for c, ms in members.items()}
        return Routing(self.version, chains, dict(self.servers), members, self.replicas)

    def chain_ids(self) -> list[int]:
        return sorted(self.table)


class Replies:
    """Answers to recent mutations by (client id, request id), for retries (as
    ``rpc.ReplayCache``), bounded by their count and by the attributes they hold.

    A batch's answer (``CreateMany``, ``UnlinkMany``) holds up to 200 attributes, ~160 KB
    of Python objects: counted as one entry each, 8192 of them would hold over a GB.
    The newest answer is always kept.
    """

    def __init__(self, entries: int = 8192, attrs: int = 65536):
        self.entries, self.attrs = entries, attrs
        self._d: OrderedDict[tuple[bytes, int], tuple[dict[str, Any] | StripefsError, int]] = OrderedDict()
        self._weight = 0

    def get(self, key: tuple[bytes, int]) -> dict[str, Any] | StripefsError | None:
        found = self._d.get(key)
        return None if found is None else found[0]

    def put(self, key: tuple[bytes, int], value: dict[str, Any] | StripefsError) -> None:
        old = self._d.pop(key, None)
        if old is not None:
            self._weight -= old[1]
        weight = max(1, len(value.get("attrs", ()))) if isinstance(value, dict) else 1
        self._d[key] = (value, weight)
        self._weight += weight
        while len(self._d) > 1 and (len(self._d) > self.entries or self._weight > self.attrs):
            self._weight -= self._d.popitem(last=False)[1][1]


def _many_reply(found: list[Attr | StripefsError]) -> m.StatManyReply:
    """The reply to a batch of paths: the attributes that came back, the indexes and codes of the errors."""
    failed = [i for i, a in enumerate(found) if isinstance(a, StripefsError)]
    return m.StatManyReply([a for a in found if not isinstance(a, StripefsError)], failed,
                           [int(found[i].code) for i in failed])  # type: ignore[union-attr]


MAX_BATCH = 256  # operations per group commit
MAX_BATCH_RETRIES = 8  # reruns of a batch that lost a serialization race (PostgreSQL)

# Reads whose cost is bounded by ``INLINE_COST`` run at once on the trio loop, on a read
# connection of their own, instead of going through the reader thread. Costs are in units of
# ~0.5 us, what one name of a listing costs (measured on a 2-core VM, the pages in memory).
# A stat (4 statements) costs ~25 us in SQLite; the hand-off to a thread and back costs ~40 us
# alone and ~150 us under load (the GIL passes between the threads at every SQLite step). The
# longest read run here (a page of 2,000 names) holds the loop ~1 ms, about as long as the
# same read holds the GIL on the thread; longer ones (big pages with attributes, StatMany of
# many paths) keep the thread.
INLINE_COST = 2500
STATEMENT_COST = 16  # one point query (a dentry, an inode)
NAME_COST = 1  # one name of a ListNames page
ENTRY_COST = 2  # one entry of a Readdir page
ENTRY_PLUS_COST = 14  # one entry of a Readdir page with attributes
# Under ``--metadata-sync normal`` a mutation commits on the loop (no fsync: a write of the
# log to the page cache), saving the hand-off to the writer thread and back; the log is then
# checkpointed on the writer thread after this many commits (SQLite's automatic checkpoint,
# run inside a commit, fsyncs: ~1,000 pages, what this many creates write).
CHECKPOINT_EVERY = 256
# A read on the loop waits this long at most for a lock (only a log recovery holds one
# against WAL readers); past it the read goes to the reader thread, which waits longer.
INLINE_BUSY_TIMEOUT = 0.005


def _page_reply(kind: Callable[[list[Any], bool], ReplyMessage]) -> Callable[[tuple[Any, Any]], ReplyMessage]:
    return lambda page: kind(list(page[0]), bool(page[1]))


ReadPlan = tuple[Callable[..., Any], tuple[Any, ...], int, Callable[[Any], ReplyMessage]]

# The reads that may ask for an attribute lease: the ``Namespace`` method, its arguments
# (``keys``, filled with what the answer depends on, last) and its cost.
_LEASED_ATTR: dict[type, Callable[[Any, list[Any]], tuple[Callable[..., Any], tuple[Any, ...], int]]] = {
    m.Resolve: lambda q, keys: (Namespace.resolve, (q.path, q.follow, keys), _path_cost(q.path)),
    m.Lookup: lambda q, keys: (Namespace.lookup, (q.parent, q.name, keys), 3 * STATEMENT_COST),
    m.GetAttr: lambda q, keys: (Namespace.getattr, (q.ino, keys), STATEMENT_COST),
}

# The read requests: the ``Namespace`` method answering one, its arguments, what it costs at
# most (``INLINE_COST`` units) and the reply made of its result.
_READS: dict[type, Callable[[Any], ReadPlan]] = {
    m.GetAttr: lambda q: (Namespace.getattr, (q.ino,), STATEMENT_COST, m.AttrReply),
    m.Lookup: lambda q: (Namespace.lookup, (q.parent, q.name), 3 * STATEMENT_COST, m.AttrReply),
    m.Resolve: lambda q: (Namespace.resolve, (q.path, q.follow), _path_cost(q.path), m.AttrReply),
    m.StatMany: lambda q: (Namespace.resolve_many, (list(q.paths), q.follow), sum(map(_path_cost, q.paths)),
                           _many_reply),
    m.ListNames: lambda q: (Namespace.list_names, (q.path, q.after, q.limit), _path_cost(q.path) + q.limit * NAME_COST,
                            _page_reply(m.NamesReply)),
    m.Readdir: lambda q: (Namespace.readdir, (q.ino, q.after, q.limit, q.plus, q.layouts),
                          STATEMENT_COST + q.limit * (ENTRY_PLUS_COST if q.plus else ENTRY_COST),
                          _page_reply(m.ReaddirReply)),
    m.GetXattr: lambda q: (Namespace.getxattr, (q.ino, q.name), 2 * STATEMENT_COST, m.XattrReply),
    m.ListXattr: lambda q: (Namespace.listxattr, (q.ino,), 2 * STATEMENT_COST, m.XattrNamesReply),
    m.Readlink: lambda q: (Namespace.readlink, (q.ino,), STATEMENT_COST, m.ReadlinkReply),
    m.GetLayout: lambda q: (Namespace.get_layout, (q.ino,), 2 * STATEMENT_COST, m.LayoutReply),
}


def _nothing() -> None:
    return None


def _path_cost(path: str) -> int:
    """What resolving ``path`` costs: a statement per component and one for the inode
    (symlinks met on the way add theirs: at most 40 of them, see ``Namespace.resolve``)."""
    return (path.count("/") + 2) * STATEMENT_COST if type(path) is str else INLINE_COST + 1


class MetadataService(Service):
    role = "metadata"

    def __init__(self, ns: Namespace, members: Callable[[str | None, bool], Membership], secret: str,
                 gc_grace: float = GC_GRACE, *, legacy_file: str | None = None, sync: str = "full",
                 lease_ttl: float = LEASE_TTL):
        self.ns = ns
        self.store_kind = "postgresql" if type(ns.store).__name__ == "PostgresStore" else "sqlite"
        # Several services share a PostgreSQL store: one leads membership (a lease), and
        # mutations record their results in the store so a retry elsewhere is not reapplied.
        self.shared = self.store_kind == "postgresql"
        self.lead = Leadership(ns.store, self._store_call, members, legacy_file, solo=not self.shared)
        self.lead.on_change = self._wake
        self.leases = Leases(ns.store)
        # Attribute leases (``_leasetable.py``): only a service that alone owns its store (SQLite)
        # sees every mutation, so only it grants them.
        self._watchers: dict[ServerConn, bytes] = {}  # watch connections (connection_ended)
        self.lease_table = LeaseTable(lease_ttl if isinstance(ns.store, SqliteStore) else 0.0)
        self.gc_grace = gc_grace
        self._first_seen: dict[int, float] = {}
        self._drop_seen: dict[tuple[int, int], float] = {}
        self.secret = secret
        # Writes go to one store thread in batches (group commit); reads, when the store
        # has a reader, to another, on their own connection: they never wait behind a
        # batch's durable commit, and see every write acknowledged before they started.
        self._writer = StoreThread(self._run_batch, MAX_BATCH)
        self._writing = 0  # writer-thread jobs queued or running: the loop leaves the connection alone
        # Mutations commit on the loop, a write of the log to the page cache (``CHECKPOINT_EVERY``);
        # under ``full`` they are acknowledged once a group fsync of the log covers them.
        store = ns.store
        self._write_now = isinstance(store, SqliteStore)
        self._log_sync: LogSync | None = None
        if isinstance(store, SqliteStore):
            store.sync_log_by_owner()
            if store.log_by_owner:
                self._log_sync = LogSync(store.sync_log)
        self._checkpoint_due = trio.Event()
        reader = ns.store.reader()
        self._rns = ns.reading(reader) if reader is not None else ns
        self._reader = StoreThread(run_each, MAX_BATCH) if reader is not None else None
        # Short reads run on the loop itself (``INLINE_COST``), on a third connection.
        now_reader = ns.store.reader(busy_timeout_s=INLINE_BUSY_TIMEOUT) if reader is not None else None
        self._lns = ns.reading(now_reader, remember_dirs=True) if now_reader is not None else None
        if isinstance(store, SqliteStore):
            # The one writer's path walks remember directories too (a create in a known
            # directory reads no entry of its path); a batch rolled back forgets them (_run_batch).
            ns.remember_dirs()
        self._gc_due = 0.0  # monotonic time before which a wake-up finds no removal due
        self.replay = Replies()
        self._running: dict[tuple[bytes, int], trio.Event] = {}  # mutations being applied, by replay key
        # Calls to storage servers run one at a time, as a server of the cluster (GC, DropChain).
        self.storage = TrioPool(role_credential(secret, "server"), keep=1, role="server")
        self.gc_wakeup = trio.Event()
        self.admission_wakeup = trio.Event()
        self.verifying = trio.CapacityLimiter(MAX_VERIFYING)
        self.started = time.time()
        self.sync = sync  # the store's durability setting (--sync), shown in the status

    @property
    def members(self) -> Membership:
        """The membership this service runs (leader) or its view of the leader's (follower)."""
        return self.lead.members

    def _wake(self) -> None:
        self.gc_wakeup.set()
        self.admission_wakeup.set()

    async def _ns(self, fn: Callable[..., Any], *args: Any, _now: bool = True, **kwargs: Any) -> Any:
        """Run one namespace operation; operations queued meanwhile commit together.

        Inside a mutation on a shared store the first call is applied at most once per
        request id, across services (:meth:`_once`). ``_now``: it may commit here on the
        loop (False for operations on many paths: too long). Returns once the operation
        is durable, either way: the writer thread's batch fsyncs before it answers, a
        commit on the loop waits in :meth:`_made_durable`.
        """
        if self._log_sync is not None and self._log_sync.failed is not None:
            raise StripefsError(ErrorCode.IO, f"metadata log could not be made durable: {self._log_sync.failed}; "
                                "restart the metadata service")
        key = _REQUEST.get()
        if key is not None and self.shared:
            _REQUEST.set(None)  # later calls of the same request are not the mutation itself
            return await self._store_call(self._once, key, functools.partial(fn, *args, **kwargs))
        touched = _TOUCHED.get()
        if touched is not None:
            fn, args, kwargs = self._recorded, (touched, functools.partial(fn, *args, **kwargs)), {}
        if _now and self._write_now and not self._writing:
            done, result = self._commit_now(functools.partial(fn, *args, **kwargs))
            if done:
                await self._made_durable()
                return result
        return await self._store_call(fn, *args, **kwargs)  # durable when it returns

    async def _made_durable(self) -> None:
        """Return once the commits made on the loop so far are durable (``full``: the group
        fsync of the log that covers them; ``normal``: at once). Nothing a mutation did is
        answered before this (nor recorded for replay: ``handle``).

        Raises:
            StripefsError: IO when the log could not be fsynced (the mutation may be lost).
        """
        if self._log_sync is None:
            return
        try:
            await self._log_sync.durable()
        except OSError as exc:
            log.error("fsync of the metadata log failed: %s; mutations are refused until a restart", exc)
            raise StripefsError(ErrorCode.IO, f"metadata log could not be made durable: {exc}") from exc

    @property
    def log_syncs(self) -> int:
        """Group fsyncs of the log run so far (``full``)."""
        return 0 if self._log_sync is None else self._log_sync.syncs

    def _recorded(self, touched: set[Any], fn: Callable[[], Any]) -> Any:
        """``fn()``, adding the store keys it writes to ``touched`` (on whichever thread runs it)."""
        store = self.ns.store
        assert isinstance(store, SqliteStore)
        store.touched = touched
        try:
            return fn()
        finally:
            store.touched = None

    def _commit_now(self, fn: Callable[[], Any]) -> tuple[bool, Any]:
        """``(True, fn())`` committed here on the loop when that needs no fsync, else
        ``(False, None)``, nothing applied: the writer thread runs it."""
        store = self.ns.store
        assert isinstance(store, SqliteStore)
        try:
            done, result = store.commit_unsynced(fn)
        except StripefsError:
            raise
        except Exception:  # noqa: BLE001 -- the store failed (e.g. disk full): the thread's batch reports it
            return False, None
        if store.unchecked >= CHECKPOINT_EVERY:
            self._checkpoint_due.set()
        return done, result

    def _once(self, key: tuple[bytes, int], fn: Callable[[], Any]) -> Any:
        """Apply ``fn`` unless request ``key`` was applied already (by any service); its
        result is recorded in the same transaction, so both commit or neither does."""
        store = self.ns.store
        with store.transaction() as txn:
            prior = txn.get_reply(key[0], key[1])
        if prior is not None:
            return pickle.loads(prior)  # our own record, written below by a service of this cluster
        result = fn()
        with store.transaction() as txn:
            txn.put_reply(key[0], key[1], time.time_ns(), pickle.dumps(result))
        return result

    def _applied(self, key: tuple[bytes, int]) -> bool:
        """Whether request ``key`` was applied already, by any service sharing the store."""
        with self.ns.store.transaction() as txn:
            return txn.get_reply(key[0], key[1]) is not None

    def _forget_replies(self) -> None:
        with self.ns.store.transaction() as txn:
            txn.delete_replies(time.time_ns() - int(REPLIES_KEPT * 1e9))

    async def _store_call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` in the writer's next batch (group commit)."""
        self._writing += 1  # until the job ran, even if this caller is cancelled meanwhile
        return await self._stored(self._writer, lambda: fn(*args, **kwargs), self._written)

    def _written(self) -> None:
        self._writing -= 1

    async def _read(self, fn: Callable[..., Any], *args: Any, cost: int | None = None) -> Any:
        """Run the read-only ``Namespace`` method ``fn`` (unbound) on a reader, never
        behind a write batch's commit; stores without a reader run it in the write batch.

        Args:
            cost: the most ``fn`` costs, when its arguments bound it (``INLINE_COST``'s
                units): up to ``INLINE_COST`` it runs at once, here on the loop.
        """
        if self._reader is None:
            return await self._store_call(fn, self.ns, *args)
        if cost is not None:
            done, result = self._read_now(fn, args, cost)
            if done:
                return result
        rns = self._rns
        return await self._stored(self._reader, lambda: fn(rns, *args))

    def _read_now(self, fn: Callable[..., Any], args: tuple[Any, ...], cost: int) -> tuple[bool, Any]:
        """``(True, fn(...))`` run here on the loop's read connection when ``cost`` allows,
        else ``(False, None)``: the read goes to the reader thread.

        Raises:
            StripefsError: the read's own error.
        """
        if cost > INLINE_COST or self._lns is None:
            return False, None
        try:
            return True, fn(self._lns, *args)
        except StripefsError:
            raise
        except Exception:  # noqa: BLE001 -- e.g. SQLITE_BUSY during a log recovery: the thread waits it out
            return False, None

    def _forget_dirs(self) -> None:
        """A directory may have been renamed or removed (committed, nobody told yet): the
        loop's reads forget the directory entries they remember."""
        if self._lns is not None:
            self._lns.forget_dirs()

    def answer_now(self, conn: ServerConn, head: FrameHead, msg: Message) -> dict[str, Any] | None:
        """Short reads, answered from the loop (see ``INLINE_COST``); None for the rest.

        No membership is persisted first: a read's answer says nothing of it."""
        plan = _READS.get(type(msg))
        if plan is None or self._lns is None:
            return None
        if isinstance(msg, (m.Resolve, m.Lookup, m.GetAttr)) and msg.lease and self.lease_table.enabled:
            keys: list[Any] = []
            fn, args, cost = _LEASED_ATTR[type(msg)](msg, keys)
            done, attr = self._read_now(fn, args, cost)
            if not done:
                return None
            # Read and registered in one step on the loop: no commit's invalidation between.
            return m.AttrReply(attr, *self._grant_attr(conn, msg, attr, keys, None)).to_header()
        if type(msg) is m.Readdir and msg.lease and self.lease_table.enabled:
            fn, args, cost, _ = plan(msg)
            done, page = self._read_now(fn, args, cost)
            return self._listing_leased(conn, msg, page, None).to_header() if done else None
        if type(msg) is m.ListNames and msg.lease and self.lease_table.enabled:
            walked: list[Any] = []
            done, page = self._read_now(Namespace.list_names, (msg.path, msg.after, msg.limit, walked),
                                        _path_cost(msg.path) + msg.limit * NAME_COST)
            return self._names_leased(conn, page, walked if not msg.after else [], None).to_header() if done else None
        if type(msg) is m.StatMany and msg.lease and self.lease_table.enabled:
            each: list[list[Any]] = []
            done, found = self._read_now(Namespace.resolve_many, (list(msg.paths), msg.follow, each),
                                         sum(map(_path_cost, msg.paths)))
            return self._many_leased(conn, found, each, None).to_header() if done else None
        fn, args, cost, reply = plan(msg)
        done, result = self._read_now(fn, args, cost)
        return reply(result).to_header() if done else None

    @staticmethod
    async def _stored(thread: StoreThread, fn: Callable[[], Any], on_done: Callable[[], None] | None = None) -> Any:
        try:
            return await thread.submit(fn, on_done)
        except StripefsError:
            raise
        except Exception as exc:  # the store itself failed (PostgreSQL went away)
            raise StripefsError(ErrorCode.IO, f"metadata store failed: {exc}") from exc

    async def run_batches(self) -> None:
        """Run the store threads until cancelled. Group commit: every write that arrived
        while the last batch ran goes into the next one -- one durable commit (fsync)
        per batch. With one client nothing changes; with many, the fsync cost is shared."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._writer.run)
            if self._reader is not None:
                nursery.start_soon(self._reader.run)
            if self._log_sync is not None:
                nursery.start_soon(self._log_sync.run)
            if self._write_now:
                nursery.start_soon(self._checkpoints)

    async def _checkpoints(self) -> None:
        """Checkpoint the log on the writer thread when commits on the loop call for it."""
        while True:
            await self._checkpoint_due.wait()
            self._checkpoint_due = trio.Event()
            await self._store_call(_nothing)  # the batch ends with the checkpoint (_run_batch)

    def _run_batch(self, jobs: list[Job]) -> None:
        store = self.ns.store
        for attempt in range(MAX_BATCH_RETRIES + 1):
            for job in jobs:
                job.result, job.exc = None, None
            try:
                with store.batch():
                    for job in jobs:
                        try:
                            job.result = job.fn()
                        except Exception as exc:
                            if store.retryable(exc):  # lost a race with another service: rerun the batch
                                raise
                            job.exc = exc  # this operation fails alone (its savepoint rolled back)
                if self._write_now and getattr(store, "unchecked", 0) >= CHECKPOINT_EVERY:
                    self._checkpoint(store)
                return
            except Exception as exc:  # nothing of the batch is durable
                self.ns.forget_dirs()  # a directory it renamed may be remembered under its new name
                if store.retryable(exc) and attempt < MAX_BATCH_RETRIES:
                    time.sleep(random.uniform(0, 0.002 * 2 ** attempt))  # worker thread: spread the rerun
                    continue
                for job in jobs:
                    if job.exc is None or not isinstance(job.exc, StripefsError):
                        job.result = None
                        job.exc = StripefsError(ErrorCode.IO, f"metadata commit failed: {exc}")
                return

    @staticmethod
    def _checkpoint(store: Any) -> None:
        try:
            store.checkpoint()
        except Exception:  # the next commits call for it again
            log.warning("checkpoint of the metadata log failed", exc_info=True)

    async def _read_reply(self, conn: ServerConn, msg: Message) -> ReplyMessage:
        """The answer to a request that changes nothing (with a lease where it asked for one)."""
        if type(msg) is m.WatchLeases:
            return await self._watch(conn, msg)
        if not getattr(msg, "lease", False) or not self.lease_table.enabled:
            return await self._dispatch(msg)
        if isinstance(msg, (m.Resolve, m.Lookup, m.GetAttr)):
            return await self._attr_leased(conn, msg)
        if type(msg) is m.StatMany:
            return await self._stat_many_leased(conn, msg)
        if type(msg) is m.ListNames:
            since = self.lease_table.changes
            walked: list[Any] = []
            names = await self._read(Namespace.list_names, msg.path, msg.after, msg.limit, walked,
                                     cost=_path_cost(msg.path) + msg.limit * NAME_COST)
            return self._names_leased(conn, names, walked if not msg.after else [], since)
        if type(msg) is m.Readdir:
            since = self.lease_table.changes
            fn, args, cost, _ = _READS[m.Readdir](msg)
            page = await self._read(fn, *args, cost=cost)
            return self._listing_leased(conn, msg, page, since)
        return await self._dispatch(msg)

    async def handle(self, conn: ServerConn, head: FrameHead, msg: Message, payload: Any) -> None:
        if not msg.MUTATES:
            reply = await self._read_reply(conn, msg)
            await self.lead.persist()  # a membership change is durable before anyone hears of it
            await conn.send(head, reply.to_header())
            return
        key = (conn.client_id, head.req_id)
        running = self._running.get(key)
        if running is not None:  # a retry of a mutation still being applied: wait for its answer
            await running.wait()
        prior = self.replay.get(key)
        if prior is None:
            done = self._running[key] = trio.Event()
            request = _REQUEST.set(key)
            touched: set[Any] | None = set() if self.lease_table.enabled else None
            recording = _TOUCHED.set(touched)
            try:
                reply = await self._dispatch(msg)  # returns once what it changed is durable (_ns)
                await self.lead.persist()
                # Durable, not yet answered nor recorded: a step that must come between (telling
                # other clients' caches) goes here.
                prior = reply.to_header()  # the encoded header: resent as is
            except StripefsError as exc:
                prior = exc
            finally:
                _REQUEST.reset(request)
                _TOUCHED.reset(recording)
                try:
                    if touched:
                        # Committed (or rolled back: then nothing changed, and telling costs
                        # only a refetch): every other holder of a lease on what it wrote is
                        # told, and acknowledges (or its lease runs out) before anyone hears
                        # of the change.
                        await self.lease_table.wait(self.lease_table.invalidate(touched, conn.client_id))
                finally:
                    if isinstance(prior, (dict, StripefsError)):
                        self.replay.put(key, prior)
                    del self._running[key]
                    done.set()
        if isinstance(prior, StripefsError):
            raise prior
        await conn.send(head, prior)

    def _many_leased(self, conn: ServerConn, found: list[Attr | StripefsError], keys: list[list[Any]],
                     since: int | None) -> m.StatManyReply:
        """A ``StatMany`` answer with a lease on each attribute (``LeaseTable.grant``)."""
        reply = _many_reply(found)
        ids = [self.lease_table.grant(conn.client_id, k, since)[0] for a, k in zip(found, keys)
               if not isinstance(a, StripefsError)]
        return m.StatManyReply(reply.attrs, reply.failed, reply.codes, ids,
                               int(self.lease_table.ttl * 1000) if any(ids) else 0)

    def _names_leased(self, conn: ServerConn, page: tuple[list[str], bool], keys: list[Any],
                      since: int | None) -> m.NamesReply:
        """A ``ListNames`` page, with a lease when it is a whole listing (a first page with
        no more after it; ``keys`` empty otherwise): a directory's entries change only
        with its inode, one of the walk's keys."""
        names, more = page
        if more or not keys:
            return m.NamesReply(list(names), bool(more))
        return m.NamesReply(list(names), False, *self.lease_table.grant(conn.client_id, keys, since))

    async def _stat_many_leased(self, conn: ServerConn, msg: m.StatMany) -> m.StatManyReply:
        """A ``StatMany`` asking for leases, not answered on the loop (see :meth:`_attr_leased`)."""
        since = self.lease_table.changes
        keys: list[list[Any]] = []
        found = await self._read(Namespace.resolve_many, list(msg.paths), msg.follow, keys,
                                 cost=sum(map(_path_cost, msg.paths)))
        return self._many_leased(conn, found, keys, since)

    async def _attr_leased(self, conn: ServerConn, msg: Any) -> m.AttrReply:
        """A ``Resolve``, ``Lookup`` or ``GetAttr`` asking for a lease, not answered on the
        loop: granted only if no invalidation happened while it was read (it may have read
        before a commit)."""
        since = self.lease_table.changes
        keys: list[Any] = []
        fn, args, cost = _LEASED_ATTR[type(msg)](msg, keys)
        attr = await self._read(fn, *args, cost=cost)
        return m.AttrReply(attr, *self._grant_attr(conn, msg, attr, keys, since))

    def _grant_attr(self, conn: ServerConn, msg: Any, attr: Attr, keys: list[Any],
                    since: int | None) -> tuple[int, int]:
        """The lease on a ``Resolve``, ``Lookup`` or ``GetAttr`` answer. A directory's
        ``Lookup`` or ``GetAttr`` (a FUSE mount walking through it) leaves out its attributes:
        every create or unlink in it changes them, and would wait for every mount that merely
        walked through it. Those who keep what depends on them hold a listing lease
        (:meth:`_listing_leased`); a ``Resolve`` (a native ``stat``) asked for them."""
        if type(msg) is not m.Resolve and stat.S_ISDIR(attr.mode):
            keys = [k for k in keys if k != attr.ino]
        if not keys:
            return 0, 0
        return self.lease_table.grant(conn.client_id, keys, since)

    def _listing_leased(self, conn: ServerConn, msg: m.Readdir, page: tuple[list[DirEntry], bool],
                        since: int | None) -> m.ReaddirReply:
        """A ``Readdir`` page, with a lease on the directory's attributes when it is a whole
        listing (a first page with no more after it): its entries change only with them."""
        entries, more = page
        if more or msg.after:
            return m.ReaddirReply(list(entries), bool(more))
        return m.ReaddirReply(list(entries), False, *self.lease_table.grant(conn.client_id, [msg.ino], since))

    async def _watch(self, conn: ServerConn, msg: m.WatchLeases) -> m.WatchLeasesReply:
        if not self.lease_table.enabled:
            raise StripefsError(ErrorCode.NOT_SUPPORTED, "this metadata service grants no leases"
                                if not self.shared else "metadata services sharing a store grant no leases")
        self._watchers[conn] = conn.client_id
        seq, ids, reset = await self.lease_table.watch(conn.client_id, msg.after, msg.wait_ms / 1000)
        return m.WatchLeasesReply(seq, ids, reset)

    def connection_ended(self, conn: ServerConn, clean: bool) -> None:
        """A client's watch connection closed by the client itself -- its close, or its
        process's exit or death, the kernel closing the socket -- ends its leases at once:
        its watch drops every leased entry before it closes the connection, and a dead
        process caches nothing. A reset or an error (a network fault: the client may live
        on, unaware yet) leaves them to run out."""
        client = self._watchers.pop(conn, None)
        if client is not None and clean:
            self.lease_table.release(client)

    async def _dispatch(self, msg: Message[Any]) -> ReplyMessage:
        ns = self.ns
        plan = _READS.get(type(msg))
        if plan is not None:
            fn, args, cost, reply = plan(msg)
            return reply(await self._read(fn, *args, cost=cost))
        if isinstance(msg, m.Create):
            chains = await self._frozen_chains()
            attr, created = await self._ns(
                ns.create, msg.parent, msg.name, msg.mode, msg.uid, msg.gid,
                chains=chains, exclusive=msg.exclusive, truncate=msg.truncate,
            )
            if msg.truncate and not created:
                await self.truncate_chunks(attr, 0)
            return m.CreateReply(attr, created)
        if isinstance(msg, m.CreatePath):
            self.members.freeze()
            chains = self.members.chain_ids()

            attr, created = await self._ns(ns.create_path, msg.path, msg.mode, msg.uid, msg.gid, chains=chains,
                                           exclusive=msg.exclusive, truncate=msg.truncate)
            if msg.truncate and not created:
                await self.truncate_chunks(attr, 0)
            return m.CreateReply(attr, created)
        if isinstance(msg, m.UnlinkPath):
            attr = await self._ns(ns.unlink_path, msg.path)
            self._garbage_added()
            return m.AttrReply(attr)
        if isinstance(msg, m.Mkdir):
            return m.AttrReply(await self._ns(ns.mkdir, msg.parent, msg.name, msg.mode, msg.uid, msg.gid))
        if isinstance(msg, m.Symlink):
            return m.AttrReply(await self._ns(ns.symlink, msg.parent, msg.name, msg.target, msg.uid, msg.gid))
        if isinstance(msg, m.Mknod):
            chains = await self._frozen_chains() if stat.S_ISREG(msg.mode) else []
            return m.AttrReply(await self._ns(ns.mknod, msg.parent, msg.name, msg.mode, msg.rdev, msg.uid, msg.gid,
                                              chains=chains))
        if isinstance(msg, m.SetXattr):
            return m.AttrReply(await self._ns(ns.setxattr, msg.ino, msg.name, msg.value, msg.flags))
        if isinstance(msg, m.RemoveXattr):
            return m.AttrReply(await self._ns(ns.removexattr, msg.ino, msg.name))
        if isinstance(msg, m.AcquireLock):
            row = await self._ns(self.leases.acquire, msg.key, msg.owner, msg.ttl_ms * 1_000_000)
            return m.LockReply(row.token, row.expires_ns)
        if isinstance(msg, m.ReleaseLock):
            return m.ReleaseLockReply(await self._ns(self.leases.release, msg.key, msg.owner))
        if isinstance(msg, m.Link):
            return m.AttrReply(await self._ns(ns.link, msg.ino, msg.new_parent, msg.new_name))
        if isinstance(msg, m.Unlink):
            attr = await self._ns(ns.unlink, msg.parent, msg.name)
            self._garbage_added()
            return m.AttrReply(attr)
        if isinstance(msg, m.Rmdir):
            try:
                await self._ns(ns.rmdir, msg.parent, msg.name)
            finally:
                self._forget_dirs()
            return m.EmptyReply()
        if isinstance(msg, m.Rename):
            try:
                await self._ns(ns.rename, msg.parent, msg.name, msg.new_parent, msg.new_name, msg.flags)
            finally:
                self._forget_dirs()
            self._garbage_added()
            return m.EmptyReply()
        if isinstance(msg, m.SetAttr):
            attr = await self._ns(
                ns.setattr, msg.ino, mode=msg.mode, uid=msg.uid, gid=msg.gid,
                atime_ns=msg.atime_ns, mtime_ns=msg.mtime_ns, size=msg.size,
            )
            if msg.size is not None:
                await self.truncate_chunks(attr, msg.size)
            return m.AttrReply(attr)
        if isinstance(msg, m.CommitLength):
            return m.AttrReply(await self._ns(ns.commit_length, msg.ino, msg.length, msg.mtime_ns, msg.truncations))
        if isinstance(msg, m.SetLayout):
            await self._ns(ns.set_layout, msg.ino, msg.chunk_size, msg.stripe)
            return m.EmptyReply()
        if isinstance(msg, m.CreateMany):
            Namespace.check_batch(msg.paths)  # refused before the chain table freezes
            chains = await self._frozen_chains()
            found = await self._ns(ns.create_many, list(msg.paths), msg.mode, msg.uid, msg.gid, chains=chains,
                                   exclusive=msg.exclusive, _now=False)
            return _many_reply(found)
        if isinstance(msg, m.UnlinkMany):
            Namespace.check_batch(msg.paths)
            found = await self._ns(ns.unlink_many, list(msg.paths), _now=False)
            self._garbage_added()
            return _many_reply(found)
        if isinstance(msg, m.GetRouting):
            await self.lead.refresh_view()
            return m.RoutingReply(self.members.routing())
        if isinstance(msg, m.Statfs):
            return await self._statfs()
        if isinstance(msg, m.ClusterStatus):
            return await self._status()
        if isinstance(msg, (m.RegisterServer, m.Heartbeat, m.SyncDone, m.RemoveServer)):
            self.lead.require()  # membership changes: callers try the next metadata address
        if isinstance(msg, m.RegisterServer):
            sid, state = self.members.register(msg)
            self.admission_wakeup.set()  # connect back now, not at the next poll
            return m.RegisterServerReply(sid, state, self.members.version)
        if isinstance(msg, m.Heartbeat):
            state = self.members.heartbeat(msg)
            return m.HeartbeatReply(state, self.members.version)
        if isinstance(msg, m.SyncDone):
            self.members.sync_done(msg)
            self.members.place()  # a drain goes on with its next server at once
            return m.SyncDoneReply(self.members.version)
        if isinstance(msg, m.RemoveServer):
            state, chains, lost = self.members.remove(msg.server_id, msg.force)
            if state == "draining":
                self.members.place()
            return m.RemoveServerReply(state, chains, lost, self.members.version)
        if isinstance(msg, m.Ping):
            return m.EmptyReply()
        raise StripefsError(ErrorCode.NOT_SUPPORTED, f"{type(msg).__name__} is not a metadata request")

    async def _frozen_chains(self) -> list[int]:
        """The chain ids a new file may use; the first file freezes the table (leader only)."""
        if not self.members.frozen:
            await self.lead.refresh_view()
        if not self.members.frozen:
            key = _REQUEST.get()
            if key is not None and self.shared and await self._store_call(self._applied, key):
                # A retry of a request some service applied already (its view of the frozen
                # table may lag): _ns answers it from the record, the chains go unused.
                return []
            self.lead.require()  # a follower cannot freeze the leader's table: the client fails over
            self.members.freeze()
            await self.lead.persist()  # durable before any file names the chains
        return self.members.chain_ids()

    async def _statfs(self) -> m.StatfsReply:
        """Usable space: the serving servers' capacity and usage over the replica count.

        Every chunk is stored once per replica of its chain, so raw bytes would
        overstate what files can hold by that factor. Front ends (the FUSE
        ``statfs``, ``Client.statfs``) report these numbers as they are.
        """
        await self.lead.refresh_view()
        servers = [s for s in self.members.servers.values() if s.state == "serving"]
        counts = await self._read(Namespace.counts)
        # Chains hold min(replicas, servers) targets (Membership._rebuild).
        r = max(1, min(self.members.replicas, len(self.members.servers)))
        capacity = sum(s.capacity for s in servers) // r
        used = sum(s.used for s in servers) // r
        return m.StatfsReply(capacity=capacity, used=used, free=max(0, capacity - used), files=counts.get("inodes", 0))

    async def _status(self) -> m.ClusterStatusReply:
        await self.lead.refresh_view()
        routing = self.members.routing()
        counts = await self._read(Namespace.counts)
        # Registrations not admitted yet are shown too (state "pending"), with the reason in
        # metadata["pending"]; they are never part of the routing clients use.
        pending = [ServerInfo(c.server_id, c.host, c.port, "pending", c.capacity, c.used, c.pid, c.last_seen)
                   for sid, c in sorted(self.members.pending.items()) if sid not in routing.servers]
        return m.ClusterStatusReply(
            metadata={"pid": os.getpid(), "uptime": time.time() - self.started, "store": self.store_kind,
                      "sync": self.sync, "lease_ttl": self.lease_table.ttl,
                      "leader": self.lead.leading, **counts,
                      "pending": self.members.pending_status()},
            servers=list(routing.servers.values()) + pending,
            chains=[{"chain_id": c, "targets": [t for t, _ in ms], "states": [st for _, st in ms]}
                    for c, ms in sorted(routing.members.items())],
            replicas=routing.replicas,
            routing_version=routing.version,
        )

    # -- background work -------------------------------------------------------------------
    def _address(self, server_id: int) -> tuple[str, int] | None:
        info = self.members.servers.get(server_id)
        return None if info is None or info.state == "removed" else (info.host, info.port)

    async def _call_storage(self, server_id: int, msg: Message) -> bool:
        """One call to a storage server; False when the server no longer exists."""
        address = self._address(server_id)
        if address is None:
            return False
        header, _payload = await self.storage.call(server_id, address, msg)
        m.decode_reply(msg, header)  # a malformed answer is a broken peer (PROTOCOL)
        return True

    async def truncate_chunks(self, attr: Any, length: int) -> None:
        """Cut a file's chunks to ``length`` before answering the truncating request.

        Synchronous on purpose: applied later (by the background collector) it
        could cut bytes the client wrote after the truncate. Idempotent, and a
        no-op beyond the stored bytes, so it is safe whether the file shrank or not.
        """
        if attr.layout is None:
            return
        try:
            await self._apply(GarbageItem(0, "truncate", attr.ino, length, attr.layout))
        except StripefsError as exc:
            log.error("truncate of inode %d to %d incomplete: %s", attr.ino, length, exc.message)
            raise StripefsError(ErrorCode.IO, f"truncate could not reach every storage server: {exc.message}") from exc

    def _garbage_added(self) -> None:
        """A removal was queued: it is due after the grace period (now, with none)."""
        self._gc_due = min(self._gc_due, time.monotonic() + self.gc_grace)
        self.gc_wakeup.set()

    async def collect(self) -> None:
        """Drop chunks of removed files (after the grace period).

        Truncations were applied when they were asked for (:meth:`truncate_chunks`);
        their queue entries only need clearing.
        """
        self._gc_due = math.inf  # removals queued during this pass lower it again
        limit = 1000
        items = await self._read(Namespace.garbage, limit)
        now = time.monotonic()
        # Items come oldest first: when none on a full page was due, those behind it are
        # younger still, and the next pass is due when the first grace ends (a full page of
        # young removals must not make every unlink's wake-up rescan it).
        due, progressed = math.inf, False
        for item in items:
            if item.kind == "remove":
                seen = self._first_seen.setdefault(item.id, now)
                if now - seen < self.gc_grace:
                    due = min(due, seen + self.gc_grace)
                    continue
                try:
                    await self._apply(item)
                except StripefsError as exc:
                    log.info("removal of inode %d postponed: %s", item.ino, exc.message)
                    due = now
                    continue  # retried on the next pass: removing is idempotent and safe later
            await self._ns(self.ns.garbage_done, item.id)
            self._first_seen.pop(item.id, None)
            progressed = True
        if progressed and len(items) >= limit:
            due = now  # more wait behind these
        self._gc_due = min(self._gc_due, due)

    async def _apply(self, item: Any) -> None:
        layout = item.layout
        cs = layout.chunk_size
        if item.kind == "remove":
            first, cut = 0, None
        else:
            first = -(-item.length // cs)
            cut = (item.length // cs, item.length % cs) if item.length % cs else None
        table = self.members.table
        chains = set(layout.chains)
        for c in chains:
            if table.get(c) and not self._online(table[c]):
                # Nobody could repair a target of this chain later: it must not come back
                # serving with the bytes this removal or cut was meant to drop.
                raise StripefsError(ErrorCode.UNAVAILABLE, f"chain {c} has no target online")
        # Offline targets are skipped: one returns ``syncing`` (it missed writes) and its
        # resync drops the chunks its serving peer no longer holds and copies those whose
        # length (digest) differs, so removals and cuts reach it then. Calling it now would
        # cost a connect timeout per item and fail truncations that already committed a size.
        targets = {t for c in chains for t in self._online(table.get(c, []))}
        # A server that no longer exists has nothing to delete (_call_storage).
        await self._call_all([(sid, m.RemoveChunks(ino=item.ino, from_index=first, forget=item.kind == "remove"))
                              for sid in sorted(targets)])
        if cut is not None:
            await self._call_all([(sid, m.TruncateChunk(ino=item.ino, index=cut[0], length=cut[1]))
                                  for sid in self._online(table.get(layout.chain_of(cut[0]), []))])

    async def _call_all(self, calls: list[tuple[int, Message]]) -> None:
        """Make the calls in parallel (one slow server costs one wait, not one each).

        Raises:
            StripefsError: the first failure, once every call has finished.
        """
        errors: list[StripefsError] = []

        async def one(sid: int, msg: Message) -> None:
            try:
                await self._call_storage(sid, msg)
            except StripefsError as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            for sid, msg in calls:
                nursery.start_soon(one, sid, msg)
        if errors:
            raise errors[0]

    def _online(self, targets: list[int]) -> list[int]:
        """The targets not known to be offline (serving, syncing, or not known at all)."""
        servers = self.members.servers
        return [t for t in targets if t not in servers or servers[t].state != "offline"]

    async def drop_moved_chains(self) -> None:
        """Tell servers that left a chain to delete its chunks, once everyone has the new routing."""
        now = time.monotonic()
        for item in list(self.members.drops):
            if now - self._drop_seen.setdefault(item, now) < DROP_GRACE:
                continue
            try:
                await self._call_storage(item[0], m.DropChain(chain=item[1]))  # gone: nothing to drop
            except StripefsError as exc:
                log.info("dropping chain %d on server %d postponed: %s", item[1], item[0], exc.message)
                continue
            self.members.add_drop_done(item)
            self._drop_seen.pop(item, None)

    async def admission(self) -> None:
        """Connect back to every pending registration that is due; admit those that check out."""
        async with trio.open_nursery() as nursery:
            while True:
                if self.members.pending:  # retries are due on their own schedule
                    with trio.move_on_after(0.05):
                        await self.admission_wakeup.wait()
                else:  # nothing to check until someone registers
                    await self.admission_wakeup.wait()
                self.admission_wakeup = trio.Event()
                now = self.members.clock()
                for cand in list(self.members.pending.values()):
                    if not cand.verifying and cand.next_try <= now:
                        cand.verifying = True
                        nursery.start_soon(self._verify, cand)

    async def _verify(self, cand: Candidate) -> None:
        try:
            async with self.verifying:
                reason = await connect_back(self.secret, cand.host, cand.port, cand.server_id, cand.root)
        except Exception as exc:  # never let one registration take the service down
            log.exception("connect-back to storage server %d failed", cand.server_id)
            reason = f"connect-back failed: {exc}"
        finally:
            cand.verifying = False
        if self.members.pending.get(cand.server_id) is not cand:
            return  # replaced by a newer registration, or forgotten meanwhile
        if reason is None:
            self.members.admit(cand.server_id)
            self.members.place()  # with replicas, its chain moves may start at once
            try:
                await self.lead.persist()
            except StripefsError as exc:
                log.warning("admission of storage server %d not recorded: %s", cand.server_id, exc.message)
        else:
            self.members.reject(cand.server_id, reason)

    async def detect(self) -> None:
        """Failure detection on its own clock: never waits behind garbage collection's I/O."""
        last_flush = trio.current_time()
        while True:
            if self.lead.leading:
                self.members.sweep()
                if self.shared and trio.current_time() - last_flush > VIEW_REFRESH:
                    self.members.dirty = True  # followers' view of capacities and usage
                    last_flush = trio.current_time()
                try:
                    await self.lead.persist()
                except StripefsError as exc:
                    log.warning("membership not recorded: %s", exc.message)
            await trio.sleep(GC_INTERVAL)

    async def background(self) -> None:
        forgot = trio.current_time()
        while True:
            with trio.move_on_after(GC_INTERVAL):
                await self.gc_wakeup.wait()
            woken, self.gc_wakeup = self.gc_wakeup.is_set(), trio.Event()
            if not self.lead.leading:
                continue  # the leader collects
            if woken and time.monotonic() < self._gc_due:
                # An unlink within the grace period: nothing is due yet, and listing the
                # queue at every unlink would cost a scan per operation.
                continue
            try:
                await self.collect()
                await self.drop_moved_chains()
                await self.lead.persist()
                if self.shared and trio.current_time() - forgot > 60:  # old replies, once a minute
                    await self._store_call(self._forget_replies)
                    forgot = trio.current_time()
            except Exception:  # never let GC take the service down
                log.exception("garbage collection pass failed")


def open_store(state_dir: str, store_url: str | None = None, sync: str = "full") -> Store:
    """The namespace store: PostgreSQL for a ``postgresql://`` URL, else SQLite under ``state_dir``.

    Args:
        sync: the SQLite durability setting (``full`` or ``normal``, see :class:`SqliteStore`).

    Raises:
        StripefsError: INVALID for an unknown store or setting, or ``normal`` with
            PostgreSQL (whose durability is the database's ``synchronous_commit``).
    """
    check_sync(sync)
    if store_url and store_url.startswith(("postgresql://", "postgres://")):
        if sync != "full":
            raise StripefsError(ErrorCode.INVALID, "metadata sync normal applies to SQLite; with PostgreSQL "
                                "set the database's synchronous_commit instead")
        from ._pgstore import PostgresStore

        return PostgresStore(store_url)
    if store_url:
        raise StripefsError(ErrorCode.INVALID, f"unknown metadata store {store_url.split(':', 1)[0]!r}")
    return SqliteStore(os.path.join(state_dir, "meta.db"), synchronous=sync)


def _open_namespace(store: Store, chunk_size: int, max_stripe: int) -> Namespace:
    """The namespace on ``store``; services starting together on a new database race to
    create the root directory, and the losers (a serialization failure) try again."""
    for attempt in range(MAX_BATCH_RETRIES + 1):
        try:
            return Namespace(store, default_chunk_size=chunk_size, max_stripe=max_stripe)
        except Exception as exc:
            if not store.retryable(exc) or attempt == MAX_BATCH_RETRIES:
                raise
            time.sleep(random.uniform(0, 0.01 * 2 ** attempt))
    raise AssertionError("unreachable")


async def serve_metadata(
    state_dir: str,
    *,
    secret: str,
    host: str = "127.0.0.1",
    port: int = 0,
    cluster_id: str = "",
    chunk_size: int = 4 << 20,
    max_stripe: int = 16,
    gc_grace: float = GC_GRACE,
    replicas: int = 1,
    store_url: str | None = None,
    admit_after: float = ADMIT_AFTER,
    sync: str = "full",
    lease_ttl: float = LEASE_TTL,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the metadata of the cluster whose state lives in ``state_dir``.

    Args:
        store_url: a ``postgresql://`` URL to keep the namespace in PostgreSQL; by
            default it is SQLite in ``state_dir/meta.db``.
        admit_after: with one replica, seconds a new storage server must heartbeat
            before it takes chain slots in a frozen table.
        sync: ``full`` (each acknowledged operation survives power loss) or
            ``normal`` (it survives a kill -9 of any process, not a power loss):
            the SQLite store's durability, see :class:`SqliteStore`.
        lease_ttl: seconds an attribute lease lives (``_leasetable.py``); 0 grants none.
            Only a SQLite store grants leases (several services share a PostgreSQL one).
    """
    os.makedirs(state_dir, exist_ok=True)
    store = await trio.to_thread.run_sync(open_store, state_dir, store_url, sync)
    ns = await trio.to_thread.run_sync(_open_namespace, store, chunk_size, max_stripe)

    def members(doc: str | None, restarted: bool) -> Membership:
        return Membership(None, replicas, admit_after=admit_after, doc=doc, restarted=restarted)

    service = MetadataService(ns, members, secret, gc_grace, legacy_file=os.path.join(state_dir, "servers.json"),
                              sync=sync, lease_ttl=lease_ttl)
    try:
        async with trio.open_nursery() as nursery:
            address = await nursery.start(functools.partial(serve_rpc, service, host, port, secret=secret, cluster_id=cluster_id))
            nursery.start_soon(service.run_batches)
            service.lead.owner = f"{address[0]}:{address[1]}".encode()  # a restart on the same port resumes its lease
            await nursery.start(service.lead.keep)
            nursery.start_soon(service.detect)
            nursery.start_soon(service.background)
            nursery.start_soon(service.admission)
            nursery.start_soon(service.lease_table.run)
            task_status.started(address)
    finally:
        # Its threads have stopped (run_batches waits for them): the database's writer lock goes with it.
        store.close()
