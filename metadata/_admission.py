"""Who may join the storage membership: field checks, identity tokens, the connect-back check.

Any holder of the cluster secret -- every client -- can send the membership
messages (``RegisterServer``, ``Heartbeat``, ``SyncDone``), so the metadata
service trusts none of their fields:

* :func:`validate` refuses out-of-range fields with ``INVALID`` (EINVAL) before
  anything changes;
* a server id is bound to its data directory's identity token (a random secret
  in ``ROOT/target.json``, created once per storage root); the service keeps only
  its SHA-256 (:func:`token_hash`), so ``servers.json`` does not reveal it;
* :func:`connect_back` proves that the announced address is a storage server of
  this cluster answering as the registered server (same id, same data
  directory) before the registration may take a chain slot.

A registration waits as a :class:`Candidate` (``pending``) in the membership
(``_membership.py``) until :class:`Admission`, a task of the service, has connected
back to it: it admits those that check out and tells the membership why the others
did not, to be retried later. Failure detection (:func:`detect`), the other way out
of the membership, runs beside it on its own clock.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import re
from dataclasses import dataclass
from typing import Any

import trio

from stripefs.wire import (
    NEED_DATA,
    ClientConnection,
    ConnectionClosed,
    ErrorCode,
    ErrorReceived,
    HandshakeComplete,
    Message,
    ResponseReceived,
    StripefsError,
    role_credential,
)
from stripefs.wire import (
    messages as m,
)

from ._leader import Leadership

__all__ = ["MAX_SERVER_ID", "validate", "valid_host", "token_hash", "same_token", "connect_back", "NOT_YET",
           "Candidate", "Admission", "detect"]

log = logging.getLogger(__name__)

MAX_SERVER_ID = 2 ** 31 - 1
_MAX_BYTES = 2 ** 63 - 1  # capacities and counts: anything larger is not a real disk
_MAX_PID = 2 ** 31 - 1
_MAX_ROOT = 4096  # PATH_MAX
_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)\Z")
_TOKEN = re.compile(r"[0-9a-f]{32,128}\Z")
CONNECT_BACK_TIMEOUT = 2.0
# The answer of a server that has not processed its registration reply yet (it learns
# its id from that reply): not a refusal, the check is simply repeated shortly.
NOT_YET = "the server has not taken its server id yet"
# Connect-back checks running at once.
MAX_VERIFYING = 8
# Failure detection sweeps the membership this often (``_membership.OFFLINE_AFTER``).
SWEEP_INTERVAL = 0.5
# With several services, the leader rewrites the membership row followers read (capacities,
# usage) at most this often.
VIEW_REFRESH = 2.0


def _invalid(msg: str) -> StripefsError:
    return StripefsError(ErrorCode.INVALID, msg)


def valid_host(host: str) -> bool:
    """An IP literal a peer can connect to, or an RFC 1123 host name."""
    if not host or len(host) > 253:
        return False
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        pass
    else:  # "0.0.0.0" or a multicast group is not an address anyone can connect back to
        return not (ip.is_unspecified or ip.is_multicast)
    labels = (host[:-1] if host.endswith(".") else host).split(".")
    # A name whose last label is all digits is a mistyped IP ("256.1.1.1"), not a host name.
    return all(_LABEL.match(label) for label in labels) and not labels[-1].isdigit()


def _int(name: str, value: Any, lo: int, hi: int) -> None:
    # The wire decoder already refused non-ints (and bools); ranges are ours to check.
    if not lo <= value <= hi:
        raise _invalid(f"{name} must be between {lo} and {hi}, not {value}")


def _token(value: str) -> None:
    if not _TOKEN.match(value):
        raise _invalid("token must be the storage root's identity: 32-128 lowercase hex digits")


def validate(msg: Message[Any]) -> None:
    """Refuse a membership message with an out-of-range field.

    Raises:
        StripefsError: INVALID naming the first bad field.
    """
    if isinstance(msg, m.RegisterServer):
        if not valid_host(msg.host):
            raise _invalid(f"host must be an IP address or a host name, not {msg.host[:80]!r}")
        _int("port", msg.port, 1, 65535)
        root = msg.root
        if not root or len(root) > _MAX_ROOT or "\0" in root or not os.path.isabs(root):
            raise _invalid(f"root must be an absolute path, not {root[:80]!r}")
        if msg.server_id is not None:
            _int("server_id", msg.server_id, 1, MAX_SERVER_ID)
        _int("capacity", msg.capacity, 0, _MAX_BYTES)
        _int("used", msg.used, 0, _MAX_BYTES)
        _int("pid", msg.pid, 1, _MAX_PID)
        _token(msg.token)
    elif isinstance(msg, m.Heartbeat):
        _int("server_id", msg.server_id, 1, MAX_SERVER_ID)
        _int("capacity", msg.capacity, 0, _MAX_BYTES)
        _int("used", msg.used, 0, _MAX_BYTES)
        _int("chunks", msg.chunks, 0, _MAX_BYTES)
        _token(msg.token)
    elif isinstance(msg, m.SyncDone):
        _int("server_id", msg.server_id, 1, MAX_SERVER_ID)
        _token(msg.token)


def token_hash(token: str) -> str:
    """What the metadata service keeps of a token (never the token itself)."""
    return hashlib.sha256(token.encode()).hexdigest()


def same_token(recorded: str, token: str) -> bool:
    return hmac.compare_digest(recorded, token_hash(token))


async def _exchange(stream: trio.SocketStream, machine: ClientConnection, msg: Message[Any]) -> Any:
    """The handshake, then one request and its typed reply, through the sans-IO machine."""

    async def next_event() -> Any:
        while True:
            event = machine.next_event()  # PROTOCOL for a server of the wrong role
            out = machine.data_to_send()
            if out:
                await stream.send_all(out)
            if event is not NEED_DATA:
                return event
            machine.receive_data(await stream.receive_some(max(machine.next_read_size(), 1 << 16)))

    event = await next_event()
    if not isinstance(event, HandshakeComplete):
        raise StripefsError(ErrorCode.PROTOCOL, "no handshake")
    _, data = machine.send_request(msg)
    await stream.send_all(data)
    event = await next_event()
    if isinstance(event, ErrorReceived):
        raise event.error
    if isinstance(event, ConnectionClosed):
        raise StripefsError(ErrorCode.UNAVAILABLE, "connection closed before the answer")
    if not isinstance(event, ResponseReceived) or event.payload_len:
        raise StripefsError(ErrorCode.PROTOCOL, "unexpected answer")
    return m.decode_reply(msg, event.header)


async def connect_back(secret: str, host: str, port: int, server_id: int, root: str,
                       timeout: float = CONNECT_BACK_TIMEOUT) -> str | None:
    """Check that ``host:port`` is a storage server of this cluster answering as ``server_id`` in ``root``.

    The handshake is the cluster's own with the server credential (both sides
    prove it; the server must announce the ``storage`` role), then ``TargetInfo`` must name the same
    server id and data directory.

    Returns:
        None when it is; otherwise why not (:data:`NOT_YET` when the server does
        not know its id yet, which is worth asking again at once).
    """
    address = f"{host}:{port}"
    try:
        with trio.fail_after(timeout):
            stream = await trio.open_tcp_stream(host, port)
            async with stream:
                # As a server of the cluster: the peer must prove the server credential,
                # which no client holds, so a client cannot stand in for a storage server.
                machine = ClientConnection(role_credential(secret, "server"), os.urandom(16), expect_role="storage",
                                           role="server")
                info = await _exchange(stream, machine, m.TargetInfo())
    except trio.TooSlowError:
        return f"no answer from {address} within {timeout:g}s"
    except StripefsError as exc:
        return f"{address} is not a storage server of this cluster: {exc.message}"
    except OSError as exc:
        return f"cannot connect back to {address}: {exc.strerror or exc}"
    if info.server_id is None:
        return NOT_YET
    if info.server_id != server_id:
        return f"{address} answers as storage server {info.server_id}, not {server_id}"
    if os.path.normpath(info.root) != os.path.normpath(root):
        return f"{address} serves {info.root!r}, not the registered {root!r}"
    return None


@dataclass
class Candidate:
    """A registration waiting for its connect-back check; never in the chain table.

    Kept in ``Membership.pending``; :class:`Admission` checks it and marks its progress.
    """

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


class Admission:
    """The connect-back checks of pending registrations, a few at a time (``MAX_VERIFYING``).

    Args:
        lead: the service's leadership; its membership (``lead.members``, replaced when
            the lead changes hands) holds the candidates, and an admission is persisted
            through it before anyone hears of it.
        secret: the cluster secret, to connect back as a server of the cluster.
    """

    def __init__(self, lead: Leadership, secret: str) -> None:
        self.lead = lead
        self.secret = secret
        self.wakeup = trio.Event()
        self.verifying = trio.CapacityLimiter(MAX_VERIFYING)

    def wake(self) -> None:
        """Check now, not at the next poll (a registration came, or the lead changed hands)."""
        self.wakeup.set()

    async def run(self) -> None:
        """Connect back to every pending registration that is due; admit those that check out."""
        async with trio.open_nursery() as nursery:
            while True:
                if self.lead.members.pending:  # retries are due on their own schedule
                    with trio.move_on_after(0.05):
                        await self.wakeup.wait()
                else:  # nothing to check until someone registers
                    await self.wakeup.wait()
                self.wakeup = trio.Event()
                now = self.lead.members.clock()
                for cand in list(self.lead.members.pending.values()):
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
        members = self.lead.members
        if members.pending.get(cand.server_id) is not cand:
            return  # replaced by a newer registration, or forgotten meanwhile
        if reason is None:
            members.admit(cand.server_id)
            members.place()  # with replicas, its chain moves may start at once
            try:
                await self.lead.persist()
            except StripefsError as exc:
                log.warning("admission of storage server %d not recorded: %s", cand.server_id, exc.message)
        else:
            members.reject(cand.server_id, reason)


async def detect(lead: Leadership, shared: bool) -> None:
    """Failure detection on its own clock: never waits behind garbage collection's I/O.

    While ``lead`` leads, its membership is swept every ``SWEEP_INTERVAL`` seconds
    (``Membership.sweep``: silent servers go offline, silent registrations are
    forgotten, due chain moves start) and persisted. ``shared``: other services read
    the membership row, which then also carries fresh capacities and usage.
    """
    last_flush = trio.current_time()
    while True:
        if lead.leading:
            lead.members.sweep()
            if shared and trio.current_time() - last_flush > VIEW_REFRESH:
                lead.members.dirty = True  # followers' view of capacities and usage
                last_flush = trio.current_time()
            try:
                await lead.persist()
            except StripefsError as exc:
                log.warning("membership not recorded: %s", exc.message)
        await trio.sleep(SWEEP_INTERVAL)
