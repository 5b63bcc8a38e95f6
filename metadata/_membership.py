"""Storage membership: the servers, their states and the chain table, as a state machine.

Storage servers register and heartbeat with the metadata service; the chain table (chain
id -> ordered target ids) is derived from who is in. With one replica every chain is one
target; chains are lists so chain replication extends them.

Events come in as calls -- a registration (:meth:`Membership.register`), the verdict of
its connect-back check (:meth:`~Membership.admit`, :meth:`~Membership.reject`), a
heartbeat, a server's ``SyncDone``, a removal, and the timer (:meth:`~Membership.sweep`,
on the injected ``clock``) -- and decisions come out as state: each server's state, the
chain table, the moves in flight (``leaving``), the chunks to drop on servers that left
(``drops``) and the routing version clients and servers compare against. Nothing here
does I/O on its own behalf: the owner persists :meth:`~Membership.to_doc` whenever
``dirty`` is set (the metadata service, before it answers anyone: ``_leader.py``), runs
the connect-back checks (``_admission.py``) and tells storage servers to drop chains
(``_collector.py``). The one exception is the ``path`` of tests and of the
``servers.json`` of older versions, read and written by the two functions at the end.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Callable

from stripefs.wire import ErrorCode, Routing, ServerInfo, StripefsError
from stripefs.wire import messages as m

from ._admission import MAX_SERVER_ID, NOT_YET, Candidate, same_token, token_hash, validate

__all__ = ["Membership", "OFFLINE_AFTER", "CHAINS_PER_SERVER", "ADMIT_AFTER", "HEARTBEAT_FRESH", "MOVE_INTERVAL",
           "PENDING_TTL", "MAX_PENDING"]

log = logging.getLogger(__name__)

OFFLINE_AFTER = 5.0
# Chains per server when the table is built: more chains than servers lets a new server
# take over whole chains (a fair share) without changing any file's layout.
CHAINS_PER_SERVER = 4
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

    States: ``serving``; ``offline`` (no heartbeat for ``OFFLINE_AFTER``, or it failed a
    cut: :meth:`take_offline`; a *held* server, :meth:`hold`, stays offline while it
    heartbeats, until the collector has applied to it the cuts it missed);
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
        # Servers that failed a cut no serving replica of theirs received (``hold``): offline,
        # whatever they say, until the collector applied every such cut to them (``release``).
        self.held: set[int] = set()
        # server id -> (its file system: host and id, free bytes there), from heartbeats (not
        # saved: a restarted service has them again within a heartbeat). See statfs.
        self.disks: dict[int, tuple[str, int]] = {}
        # Without a file the owner persists :meth:`to_doc` (the store's membership row)
        # whenever ``dirty`` is set.
        self.dirty = False
        if doc is None and path is not None:
            doc = _read_file(path)
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
        self.held = {int(sid) for sid in raw.get("held", [])}
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
                           "held": sorted(self.held),
                           "servers": [s.to_wire() for s in self.servers.values()]})

    def save(self) -> None:
        if self.path is None:
            self.dirty = True  # the service writes the row before it answers anyone
            return
        _write_file(self.path, self.to_doc())

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
                self.held.discard(sid)
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

    def serves(self, chain: int, sid: int) -> bool:
        """Whether ``sid`` serves ``chain`` now (what clients read from)."""
        return self._serves(chain, sid)

    def take_offline(self, sid: int) -> None:
        """``sid`` failed a call it had to answer (a cut): offline now, as failure detection
        would have it, so nobody reads bytes it should have dropped; it resyncs when back."""
        info = self.servers.get(sid)
        if info is not None and info.state not in ("offline", "removed"):
            log.warning("storage server %d (%s:%d) failed a cut: offline", sid, info.host, info.port)
            self._set(sid, state="offline")

    def hold(self, sid: int) -> None:
        """Keep ``sid`` offline until :meth:`release`: it holds bytes of a cut that no serving
        replica of its chains received, so no resync would ever drop them."""
        info = self.servers.get(sid)
        if info is None or info.state == "removed" or sid in self.held:
            return
        self.take_offline(sid)
        log.warning("storage server %d held offline until it applied the cuts it missed", sid)
        self.held.add(sid)
        self.save()

    def release(self, sid: int) -> None:
        """Every cut ``sid`` missed reached it: its next heartbeat brings it back (resyncing
        first where a replica of its chains served meanwhile)."""
        if sid in self.held:
            self.held.discard(sid)
            log.info("storage server %d released: the cuts it missed were applied", sid)
            self.save()

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
        if sid in self.held:
            state = "offline"  # back, but with bytes of a cut it missed: the collector cuts it first
        elif any(sid in ts for c, ts in self.table.items() if c in self.leaving and self.leaving[c] != sid):
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
        if state == "offline" and sid not in self.held:  # it was declared dead and may have missed writes
            behind = self._behind(sid)
            state = "syncing" if self.replicas > 1 and behind else "serving"
            if state == "serving" and self.frozen and not self._in_table(sid):
                state = "joining"
            self.since[sid] = now
        self._set(sid, state=state, capacity=msg.capacity, used=msg.used, last_seen=now)
        if msg.free >= 0 and msg.fsid:
            self.disks[sid] = (f"{old.host}/{msg.fsid}", msg.free)
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


# -- the file of tests and older versions (``path``) ---------------------------------------
def _read_file(path: str) -> str | None:
    """The document saved at ``path``; None when there is none yet."""
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return None


def _write_file(path: str, doc: str) -> None:
    """Replace the document at ``path`` durably (the file, then its directory entry)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(doc)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    # The rename is durable only once the directory entry is: a power loss must not
    # bring back an older chain table than the one servers and clients were told.
    dfd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
