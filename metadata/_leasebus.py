"""Attribute leases across metadata services sharing a PostgreSQL store: invalidations by NOTIFY.

Each service keeps its own lease table (``_leasetable.py``) for the clients connected to
it. What a mutation on any service wrote must reach every table, and the mutation must
not be answered before the holders everywhere were told (the promise a lease makes: once
a change is acknowledged, nobody answers from a lease granted before it). Over the store:

* **Published in the commit.** The store records the keys each operation writes and, in
  the same transaction, sends them with ``pg_notify`` on the store's channel
  (``PostgresStore.publish_keys``), numbered per service, with the client whose request
  wrote them (its own leases stay, as on SQLite). PostgreSQL delivers a notification only
  if its transaction commits, after it did, to every session listening, in commit order.
* **Heard on a listening connection.** Every service listens on a connection of its own
  (:meth:`LeaseBus.run`, read on the trio loop) and invalidates what it hears in its own
  table -- its own mutations' keys too, the same way -- telling and waiting for its
  holders as for a mutation of its own, then acknowledges (a ``pg_notify`` back, on a
  second connection: "everything of service A up to number n is done here").
* **The mutation waits** (:meth:`LeaseBus.settle`) until its own service heard its
  publication -- by then every other service's ping committed before it has been heard
  too, so every service that may hold a lease on what it changed is known -- and every
  such service acknowledged it or could hold no lease granted before it any more.
* **Pings bound what a silent service holds.** Every service pings itself on the channel
  every ``PING_EVERY`` s, with its lease TTL. A ping it hears back, sent at ``p``,
  proves it heard everything committed before ``p``; it grants leases only until
  ``p + FRESH`` (``LeaseTable.grant_until``). A service that has not processed a change
  committed at ``c`` heard no ping of its own committed after ``c`` (commit order), so it
  granted nothing after ``c + FRESH`` and what it granted runs out by ``c + FRESH + TTL``.
  A mutation therefore waits for a service that does not acknowledge (stopped, its
  listening connection cut, dead) at most ``FRESH + TTL`` past its commit, and not at all
  for one whose last ping, heard at ``h``, was longer than ``FRESH + TTL`` ago. A
  service that cannot hear its own publication waits that long in any case.
* **A lost listening connection** (an error, or no ping back within ``FRESH``): the
  service stops granting, ends every lease it holds (its holders told on their watch:
  it may have missed invalidations), and reconnects; it grants again once a ping sent
  after its ``LISTEN`` came back.

Why acknowledgements rather than a bound alone: waiting a TTL for every change would
make every mutation take seconds; with acknowledgements a mutation waits one more
notification round trip (about a millisecond on a nearby database) while every service
is healthy, and the bound only for one that is not.

Caveats:
    * Clocks: each service measures on its own monotonic clock; the bounds hold while
      their rates agree over ``FRESH + TTL`` (as the sessions' do, ``_leasetable.py``).
    * Services on one store should share ``--lease-ttl``: a service waits, when it cannot
      hear the others, for the longest TTL it has heard of (its own at least).
    * Every service hears every publication, ping and acknowledgement: fine for the few
      services one database serves (``--metadata-services``), not for hundreds.
    * A write made after a request's first operation (a truncation's cut, a
      ``SetAttr`` run again) is published without its client: its own leases on those
      keys are invalidated and waited for too.
    * A retry answered from another service's record (``_replay.apply_once``): the
      service that applied it may have died before its holders were told. The retry's
      service publishes a *barrier* (``PostgresStore.barrier``), done at each service
      once everything it heard before is, and waits for it as for a change of its own.
    * A service that joins (or listens again) learns who may grant from the sessions on
      the channel (``pg_stat_activity``); one whose two connections were both lost at
      that moment, and that granted on a ping heard just before, is not known to it: a
      change through the new service in its first ``FRESH + TTL`` may then be answered
      before that service's leases run out.
"""

from __future__ import annotations

import json
import logging
import os
from collections import deque
from typing import Any, Callable

import trio

from ._leasetable import LEASE_TTL, LeaseTable

__all__ = ["FRESH", "PING_EVERY", "LeaseBus", "payloads"]

log = logging.getLogger(__name__)

PING_EVERY = 0.1  # seconds between a service's pings of itself
FRESH = 1.0  # seconds a service grants past sending a ping it heard back
RETRY = 0.5  # seconds between attempts to connect again
MAX_PAYLOAD = 7000  # bytes per notification (PostgreSQL refuses past 8000)
CONNECT_TIMEOUT = 5
FORGET = 600.0  # seconds after which a service not heard from is forgotten (restarted: a new id)


def _key_json(key: Any) -> Any:
    return list(key) if isinstance(key, tuple) else key


def _key_back(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


def payloads(origin: str, number: int, groups: list[tuple[bytes, set[Any]]], barrier: bool = False) -> list[str]:
    """The notifications publishing ``groups`` (keys by the client that wrote them) as
    service ``origin``'s publication ``number``: JSON, each under ``MAX_PAYLOAD`` bytes,
    the last one marked (its receipt completes the publication). A ``barrier`` is done
    where it is heard only once everything heard there before it is."""
    out: list[str] = []
    part: list[list[Any]] = []
    size = 0
    for client, keys in groups:
        name = client.hex()
        for key in keys:
            item = _key_json(key)
            cost = len(json.dumps(item)) + 2
            new_group = not part or part[-1][0] != name
            if new_group:
                cost += len(name) + 8
            if part and size + cost > MAX_PAYLOAD:
                out.append(json.dumps({"t": "i", "o": origin, "n": number, "last": False, "g": part}))
                if not new_group:  # the group goes on in the next part, named again there
                    cost += len(name) + 8
                part, size, new_group = [], 0, True
            if new_group:
                part.append([name, []])
            part[-1][1].append(item)
            size += cost
    out.append(json.dumps({"t": "i", "o": origin, "n": number, "last": True, "g": part, "b": barrier}))
    return out


class _Peer:
    """What one service (this one too) was last heard saying."""

    __slots__ = ("acked", "heard", "ttl")

    def __init__(self, now: float) -> None:
        self.heard = now  # when its last message arrived (trio time)
        self.ttl = 0.0  # its lease TTL, from its pings (0: grants none)
        self.acked = 0  # its acknowledgement: this service's publications up to this are done there


class LeaseBus:
    """The lease invalidations of one metadata service on a shared PostgreSQL store (see
    the module docstring).

    Args:
        store: the service's ``PostgresStore`` (its URL and channel; it publishes from now on).
        table: the service's lease table (its TTL is announced; 0 grants none, but this
            service still hears, acknowledges and publishes).
    """

    def __init__(self, store: Any, table: LeaseTable) -> None:
        self.url = store.url
        self.channel: str = store.lease_channel
        self.table = table
        self.id = os.urandom(8).hex()
        table.fresh_until = -float("inf")  # no lease until its first ping comes back
        table.track_keys()  # every service's changes are heard here: a read is refused only for its own keys
        store.publish_keys(lambda number, groups, barrier: payloads(self.id, number, groups, barrier))
        self._peers: dict[str, _Peer] = {}
        self._changed = trio.Event()  # set (and replaced) when a publication is seen, done or acknowledged
        self._item_done = trio.Event()  # set (and replaced) when a publication heard here is done
        self._seen = 0  # this service's last publication heard back (every part)
        self._done = 0  # ... and done in its own table
        # Publications being invalidated here, per origin, in order: [number, last part, done].
        self._streams: dict[str, deque[list[Any]]] = {}
        self._generation = 0  # a lost listening connection starts a new one
        self._acks: dict[str, int] = {}  # acknowledgements to send, by origin
        self._outbox = trio.Event()
        self._pings: dict[int, float] = {}  # ping number -> when it was sent
        self._ping_no = 0
        self._ping_now = False  # a new listening connection waits for a ping sent after it
        self._longest = table.ttl  # the longest TTL heard of
        self._nursery: trio.Nursery | None = None

    # -- the mutation's side --------------------------------------------------------------------
    async def settle(self, number: int) -> None:
        """Return once every service is done with this service's publications up to
        ``number`` (their holders told) or can hold no lease granted before them; at
        most ``FRESH`` plus the longest TTL heard of."""
        start = trio.current_time()
        bound = start + FRESH + self._longest
        if number <= 0:
            return
        await self._until(lambda: self._seen >= number, bound)
        if self._seen < number:
            log.info("a change waited %.2f s: this service did not hear its own publication",
                     trio.current_time() - start)
            return
        await self._until(lambda: self._done >= number, bound)
        now = trio.current_time()
        for origin, peer in list(self._peers.items()):
            if origin == self.id or peer.ttl <= 0 or now >= peer.heard + FRESH + peer.ttl:
                continue
            await self._until(lambda: peer.acked >= number or trio.current_time() >= peer.heard + FRESH + peer.ttl,
                              bound)
            if peer.acked < number:
                log.info("a change waited %.2f s for metadata service %s (no acknowledgement)",
                         trio.current_time() - start, origin[:8])

    async def _until(self, done: Any, bound: float) -> None:
        while not done() and trio.current_time() < bound:
            with trio.move_on_at(min(bound, trio.current_time() + PING_EVERY)):
                await self._changed.wait()

    def _change(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # -- running --------------------------------------------------------------------------------
    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen, ping and acknowledge until cancelled; started once the first attempt to
        listen succeeded or failed (a mutation published before it would wait the bound)."""
        started = False

        def ready() -> None:
            nonlocal started
            if not started:
                started = True
                task_status.started()

        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._sender)
            while True:
                try:
                    await self._listen(ready)
                except Exception as exc:  # noqa: BLE001 - any loss: stop granting, connect again
                    log.warning("lease invalidations from other metadata services: %s; no leases granted "
                                "until it is back", exc)
                ready()
                self._lost()
                await trio.sleep(RETRY)

    def _connect(self, purpose: str) -> Any:
        import psycopg

        return psycopg.connect(self.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT,
                               application_name=f"{self.channel} {purpose} {self.id}")

    def _listening(self) -> tuple[Any, set[str]]:
        """A connection listening on the channel, and the services connected to the
        channel when it started (a thread: connecting may block)."""
        from psycopg import sql

        conn = self._connect("listen")
        try:
            conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))
            rows = conn.execute("SELECT application_name FROM pg_stat_activity WHERE starts_with(application_name, %s)",
                                (self.channel + " ",)).fetchall()
        except BaseException:
            conn.close()
            raise
        return conn, {name.rsplit(" ", 1)[-1] for (name,) in rows} - {self.id}

    async def _listen(self, ready: Callable[[], None]) -> None:
        """Hear notifications until the connection is lost or no ping comes back in time."""
        conn, present = await trio.to_thread.run_sync(self._listening, abandon_on_cancel=True)
        ready()
        now = trio.current_time()
        for origin in present:
            # Granting on a ping this connection never heard (committed before its LISTEN):
            # until that service's own ping says its TTL, assume the longest.
            peer = self._peers.get(origin)
            if peer is None:
                peer = self._peers[origin] = _Peer(now)
            peer.heard = max(peer.heard, now)
            peer.ttl = peer.ttl or self._longest or LEASE_TTL
        pgconn = conn.pgconn
        sock = pgconn.socket
        connected = trio.current_time()
        self._pings.clear()  # only a ping sent from now on proves this connection hears
        self._ping_now = True
        self._outbox.set()
        try:
            while True:
                with trio.move_on_after(PING_EVERY):
                    await trio.lowlevel.wait_readable(sock)
                pgconn.consume_input()  # raises when the connection is gone
                while (note := pgconn.notifies()) is not None:
                    try:
                        self._received(note.extra.decode())
                    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
                        log.warning("ignored a malformed lease notification: %.200r", note.extra)
                now = trio.current_time()
                if now >= max(self.table.fresh_until, connected + FRESH):
                    raise OSError(f"no ping came back within {FRESH} s")
        finally:
            trio.lowlevel.notify_closing(sock)
            conn.close()

    def _lost(self) -> None:
        """Stop granting; every lease held ends (invalidations may have been missed)."""
        self.table.grant_until(-float("inf"))
        self.table.revoke_all()
        self._generation += 1
        self._streams.clear()
        self._pings.clear()

    async def _sender(self) -> None:
        """Send pings every ``PING_EVERY`` and acknowledgements as they fall due, on a
        connection of its own (reconnected when it fails)."""
        conn: Any = None
        last_ping = -float("inf")
        while True:
            try:
                if conn is None:
                    conn = await trio.to_thread.run_sync(self._connect, "send", abandon_on_cancel=True)
                with trio.move_on_at(last_ping + PING_EVERY):
                    await self._outbox.wait()
                self._outbox = trio.Event()
                out = [json.dumps({"t": "a", "o": self.id, "to": origin, "n": n}) for origin, n in self._acks.items()]
                self._acks.clear()
                now = trio.current_time()
                if now >= last_ping + PING_EVERY or self._ping_now:
                    self._ping_now = False
                    self._ping_no += 1
                    self._pings[self._ping_no] = last_ping = now  # before it is sent: the bound's start
                    out.append(json.dumps({"t": "p", "o": self.id, "k": self._ping_no, "ttl": self.table.ttl}))
                await trio.to_thread.run_sync(self._send, conn, out, abandon_on_cancel=True)
            except Exception as exc:  # noqa: BLE001 - pings stop: this service stops granting
                log.warning("lease notifications to other metadata services: %s", exc)
                if conn is not None:
                    conn.close()
                conn = None
                await trio.sleep(RETRY)

    def _send(self, conn: Any, out: list[str]) -> None:
        conn.execute("SELECT pg_notify(%s, p) FROM unnest(%s::text[]) AS p", (self.channel, out))

    # -- what is heard ----------------------------------------------------------------------------
    def _received(self, payload: str) -> None:
        msg = json.loads(payload)
        origin = msg["o"]
        now = trio.current_time()
        peer = self._peers.get(origin)
        if peer is None:
            peer = self._peers[origin] = _Peer(now)
        peer.heard = now
        kind = msg["t"]
        if kind == "p":
            peer.ttl = float(msg["ttl"])
            self._longest = max(self._longest, peer.ttl)
            if origin == self.id:
                sent = self._pings.get(msg["k"])
                if sent is not None:  # everything committed before it was heard
                    for k in [k for k in self._pings if k <= msg["k"]]:
                        del self._pings[k]
                    self.table.grant_until(sent + FRESH)
                    for gone in [o for o, p in self._peers.items() if now - p.heard > FORGET]:
                        del self._peers[gone]
        elif kind == "a":
            if msg["to"] == self.id and msg["n"] > peer.acked:
                peer.acked = msg["n"]
                self._change()
        elif kind == "i":
            self._invalidate(origin, msg)

    def _invalidate(self, origin: str, msg: dict[str, Any]) -> None:
        """A publication (part) of ``origin``: its keys' leases here end, their holders told;
        done once they acknowledged (or their leases ran out)."""
        waits = []
        for client, keys in msg["g"]:
            waits += self.table.invalidate([_key_back(k) for k in keys], bytes.fromhex(client))
        # A barrier waits for everything heard before it, whoever published it.
        before = [i for stream in self._streams.values() for i in stream if not i[2]] if msg.get("b") else []
        item = [msg["n"], msg["last"], False]
        self._streams.setdefault(origin, deque()).append(item)
        if origin == self.id and msg["last"]:
            self._seen = msg["n"]
            self._change()
        if (not waits and not before) or self._nursery is None:
            item[2] = True
            self._advance(origin)
        else:
            self._nursery.start_soon(self._wait_done, origin, item, waits, before, self._generation)

    async def _wait_done(self, origin: str, item: list[Any], waits: list[Any], before: list[list[Any]],
                         generation: int) -> None:
        await self.table.wait(waits)
        while not all(i[2] for i in before) and generation == self._generation:
            with trio.move_on_after(PING_EVERY):  # (a lost connection ends them all: look again)
                await self._item_done.wait()
        item[2] = True
        self._item_done.set()
        self._item_done = trio.Event()
        if generation == self._generation:
            self._advance(origin)

    def _advance(self, origin: str) -> None:
        """Publications of ``origin`` done here, in order: acknowledged (our own: counted)."""
        stream = self._streams.get(origin)
        upto = 0
        while stream and stream[0][2]:
            number, last, _ = stream.popleft()
            if last:
                upto = number
        if not upto:
            return
        if origin == self.id:
            self._done = upto
            self._change()
        else:
            self._acks[origin] = upto
            self._outbox.set()
