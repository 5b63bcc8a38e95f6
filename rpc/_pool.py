"""Connections by server: the one cache every client of the protocol uses.

Who keeps connections to many servers -- the client core (metadata service and
every storage server), the metadata service (garbage collection on storage
servers), storage servers (replication to their peers) -- asks a pool for "a
connection to server ``key`` at ``address``". The pool handles what each of
them used to handle on its own:

* a server that moved (restarted on a new port: the caller's routing table gives
  the new address): its connections to the old address are closed and replaced;
* broken connections are dropped and replaced on the next request;
* several connections per server: shared round-robin ones for the pipelined
  blocking :class:`~rpc.Connection` (:class:`ConnectionPool`), leased ones for the
  one-call-at-a-time :class:`~rpc.TrioConnection` (:class:`TrioPool`);
* a server that caps connections per client below what the pool wants (it refuses
  the handshake with BUSY): the pool makes do with those it has, and tries for more
  again only after ``CAPPED_RETRY`` seconds;
* fork safety: a forked child (a DataLoader worker) forgets the parent's
  connections without closing them -- a ``shutdown()`` would cut the parent's too;
* closing everything.

Both flavours are thin layers over :class:`_KeyedCache`, which holds the logic.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import weakref
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Generic, Hashable, Iterator, TypeVar

from stripefs import wire

from ._client import Connection
from ._pid import my_pid
from ._trio_client import CALL_TIMEOUT, TrioConnection

__all__ = ["ConnectionPool", "TrioPool"]

C = TypeVar("C", Connection, TrioConnection)
Address = tuple[str, int]
CAPPED_RETRY = 5.0  # seconds before a pool capped by its server tries to open more connections again

_CACHES: "weakref.WeakSet[_KeyedCache[Any]]" = weakref.WeakSet()


def _forget_all_after_fork() -> None:
    for cache in list(_CACHES):
        cache.forget()


os.register_at_fork(after_in_child=_forget_all_after_fork)


class _KeyedCache(Generic[C]):
    """Connections by key; all of a key's connections go to one address.

    Reads are lock-free (the per-key tuple is replaced, never mutated), so the
    blocking data path pays one dict lookup per request. Closing happens outside
    the lock: a connection's ``close`` may block briefly.
    """

    def __init__(self) -> None:
        self.pid = my_pid()
        self._lock = threading.Lock()
        self._entries: dict[Hashable, tuple[Address, tuple[C, ...]]] = {}
        self._creating: dict[Hashable, threading.Lock] = {}
        self.closed = False
        _CACHES.add(self)

    def forget(self) -> None:
        """In a forked child: drop every connection without touching its socket."""
        self.pid = my_pid()
        self._lock = threading.Lock()  # a parent thread may have held the old ones at fork time
        self._creating = {}
        self._entries = {}

    def _check_fork(self) -> None:
        if my_pid() != self.pid:
            self.forget()

    def live(self, key: Hashable, address: Address) -> tuple[C, ...]:
        """The key's usable connections at ``address``; stale ones are removed and closed."""
        self._check_fork()
        entry = self._entries.get(key)
        if entry is None:
            return ()
        if entry[0] == address and not any(c.broken for c in entry[1]):
            return entry[1]
        with self._lock:
            at, conns = self._entries.get(key, (address, ()))
            keep = tuple(c for c in conns if at == address and not c.broken)
            stale = [c for c in conns if c not in keep]
            self._entries[key] = (address, keep)
        _close(stale)
        return keep

    def creating(self, key: Hashable) -> threading.Lock:
        """The lock a pool holds while opening connections to ``key`` (one opener per key)."""
        return self._creating.setdefault(key, threading.Lock())

    def add(self, key: Hashable, address: Address, conn: C) -> None:
        with self._lock:
            at, conns = self._entries.get(key, (address, ()))
            self._entries[key] = (address, (conns if at == address else ()) + (conn,))

    def take(self, key: Hashable, address: Address) -> C | None:
        """Remove and return one usable connection at ``address`` (a lease), if any."""
        self.live(key, address)
        with self._lock:
            at, conns = self._entries.get(key, (address, ()))
            if at != address or not conns:
                return None
            self._entries[key] = (at, conns[:-1])
            return conns[-1]

    def give_back(self, key: Hashable, address: Address, conn: C, keep: int) -> None:
        """Return a leased connection; kept when it is usable, current and there is room."""
        self._check_fork()
        with self._lock:
            at, conns = self._entries.get(key, (address, ()))
            if not conn.broken and not self.closed and at == address and len(conns) < keep:
                self._entries[key] = (at, conns + (conn,))
                return
        conn.close()

    def drop(self, key: Hashable) -> None:
        with self._lock:
            _, conns = self._entries.pop(key, (None, ()))
        _close(conns)

    def close(self) -> None:
        """Close every connection (in a forked child: forget them, the parent owns the sockets)."""
        if my_pid() != self.pid:
            self.forget()
            return
        with self._lock:
            entries, self._entries = self._entries, {}
            self.closed = True
        _close([c for _, conns in entries.values() for c in conns])


def _close(conns: Any) -> None:
    for c in conns:
        c.close()


class ConnectionPool:
    """Shared, pipelined blocking connections: ``per_server`` per key, used round-robin.

    Args:
        secret: the credential of ``role`` (``wire.role_credential``).
        client_id: the id every connection presents.
        per_server: connections per key (requests spread over them).
        expect_role: refuse servers of any other role.
        ids: request-id counter shared by every connection (retries keep their id
            across reconnects, for the metadata service's replay cache).
        send_thread: give each connection a sender thread (see :class:`~rpc.Connection`).
        role: what the connections authenticate as ("client", or "server").
    """

    def __init__(self, secret: str, client_id: bytes, *, per_server: int = 1, expect_role: str | None = None,
                 ids: "Iterator[int] | None" = None, send_thread: bool = False, role: str = "client"):
        self.secret = secret
        self.role = role
        self.client_id = client_id
        self.per_server = per_server
        self.expect_role = expect_role
        self.ids = ids
        self.send_thread = send_thread
        self._cache: _KeyedCache[Connection] = _KeyedCache()
        self._rr = itertools.count()
        self._capped: dict[Hashable, float] = {}  # key -> when to try for per_server again

    def live_one(self, key: Hashable, address: Address) -> Connection | None:
        """A live connection to ``key`` if one is open (never connects, never blocks)."""
        conns = self._cache.live(key, address)
        return conns[0] if conns else None

    def get(self, key: Hashable, address: Address) -> Connection:
        """A live connection to ``key`` at ``address``, connecting as needed.

        Raises:
            StripefsError: UNAVAILABLE when the server cannot be reached; AUTH, PROTOCOL
            from the handshake; BUSY when the server refuses even one connection
            (its per-client cap is taken).
        """
        conns = self._cache.live(key, address)
        if len(conns) < self.per_server and (not conns or self._capped.get(key, 0.0) <= time.monotonic()):
            # One opener per key, so concurrent callers do not open more than per_server;
            # a server that is slow to answer does not hold up connections to the others.
            with self._cache.creating(key):
                conns = self._cache.live(key, address)
                while len(conns) < self.per_server:
                    try:
                        conn = Connection(address, self.secret, self.client_id, expect_role=self.expect_role,
                                          ids=self.ids, send_thread=self.send_thread,  # type: ignore[arg-type]
                                          role=self.role)
                    except wire.StripefsError as exc:
                        if exc.code != wire.ErrorCode.BUSY or not conns:
                            raise
                        self._capped[key] = time.monotonic() + CAPPED_RETRY  # make do with fewer
                        break
                    self._cache.add(key, address, conn)
                    conns = self._cache.live(key, address)
        return conns[next(self._rr) % len(conns)]

    def drop(self, key: Hashable) -> None:
        """Close the connections to ``key``."""
        self._cache.drop(key)

    def close(self) -> None:
        """Close every connection (a forked child only forgets them)."""
        self._cache.close()

    def forget(self) -> None:
        """Drop every connection without closing it (the caller knows it was forked)."""
        self._cache.forget()


class TrioPool:
    """Leased trio connections: one caller per connection, up to ``keep`` idle per key.

    Args:
        secret: the credential of ``role`` (``wire.role_credential``).
        client_id: the id every connection presents (random per connection by default).
        keep: idle connections kept per key; more are opened while callers need them.
        role: what the connections authenticate as ("server" between servers).
    """

    def __init__(self, secret: str, *, client_id: bytes | None = None, keep: int = 8, role: str = "client"):
        self.secret = secret
        self.role = role
        self.client_id = client_id
        self.keep = keep
        self._cache: _KeyedCache[TrioConnection] = _KeyedCache()

    @asynccontextmanager
    async def connection(self, key: Hashable, address: Address) -> AsyncIterator[TrioConnection]:
        """Lease a connection to ``key`` at ``address`` for the body of the ``async with``."""
        conn = self._cache.take(key, address) or TrioConnection(address, self.secret, client_id=self.client_id,
                                                                   role=self.role)
        try:
            yield conn
        finally:
            # A failed or cancelled call marks the connection broken: it is closed, not kept.
            self._cache.give_back(key, address, conn, self.keep)

    async def call(self, key: Hashable, address: Address, msg: wire.Message, payload: bytes | memoryview = b"",
                   timeout: float = CALL_TIMEOUT) -> tuple[dict[str, Any], bytes | bytearray]:
        """One request on a leased connection (see :meth:`TrioConnection.call`)."""
        async with self.connection(key, address) as conn:
            return await conn.call(msg, payload, timeout)

    def drop(self, key: Hashable) -> None:
        self._cache.drop(key)

    def close(self) -> None:
        """Close every idle connection (leased ones close when given back after this)."""
        self._cache.close()

