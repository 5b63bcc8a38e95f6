"""The RPC counters of a server process and the connection state machine that keeps them
(imported by ``_metrics.serve_metrics`` only: it imports ``prometheus_client``).

See ``_metrics.py`` for the metrics and their cost.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from stripefs.wire import MESSAGES, ConnState, ErrorCode, FrameHead, RequestReceived, ServerConnection, StripefsError

__all__ = ["MeteredServerConnection", "start"]

# Set by start() (``_metrics`` passes its settings: this module does not import it back).
_REQUESTS: Any = None
_SECONDS: Any = None
_RECEIVED: Any = None
_SENT: Any = None
_ERRORS: Any = None
BULK = 1 << 20
BUDGETS: Any = {}

_lock = threading.Lock()


class _MsgStats:
    """The children of one (role, message type), bound once: no label lookup per request."""

    __slots__ = ("name", "small", "bulk", "seconds", "received", "sent", "role", "errors")

    def __init__(self, role: str, msg_type: int):
        cls = MESSAGES.get(msg_type)
        self.name = cls.__name__ if cls is not None else f"type{msg_type}"
        self.role = role
        self.small = _REQUESTS.labels(role, self.name, "small")
        self.bulk = _REQUESTS.labels(role, self.name, "bulk")
        self.seconds = _SECONDS.labels(role, self.name)
        self.received = _RECEIVED.labels(role, self.name)
        self.sent = _SENT.labels(role, self.name)
        self.errors: dict[int, Any] = {}

    def error(self, code: int) -> None:
        child = self.errors.get(code)
        if child is None:
            try:
                name = ErrorCode(code).name
            except ValueError:
                name = str(code)
            child = self.errors[code] = _ERRORS.labels(self.role, self.name, name)
        child.inc()


_STATS: dict[tuple[str, int], _MsgStats] = {}


def _stats(role: str, msg_type: int) -> _MsgStats:
    key = (role, msg_type)
    found = _STATS.get(key)
    if found is None:
        with _lock:  # one set of children per key, whichever thread binds it first
            found = _STATS.setdefault(key, _MsgStats(role, msg_type))
    return found


_LIVE: weakref.WeakSet[MeteredServerConnection] = weakref.WeakSet()
_ENDED = (ConnState.CLOSED, ConnState.ERROR)


class MeteredServerConnection(ServerConnection):
    """A :class:`wire.ServerConnection` that counts what passes through it.

    The decoding side runs on one thread at a time (the reader task or the reply thread
    that took receiving over); answers may be encoded on any thread: the start times live
    in a dict whose single-key operations are atomic.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._started: dict[int, tuple[float, _MsgStats]] = {}
        self._by_type: dict[int, _MsgStats] = {}
        _LIVE.add(self)

    def next_event(self) -> Any:
        event = super().next_event()
        if type(event) is RequestReceived:
            head = event.head
            stats = self._by_type.get(head.msg_type)
            if stats is None:
                stats = self._by_type[head.msg_type] = _stats(self.role, head.msg_type)
            plen = head.payload_len
            if plen:
                stats.received.inc(plen)
                (stats.bulk if plen >= BULK else stats.small).inc()
            else:
                stats.small.inc()
            self._started[head.req_id] = (time.perf_counter(), stats)
        return event

    def send_response(self, head: FrameHead, header: dict[str, Any], payload_len: int = 0) -> bytes:
        out = super().send_response(head, header, payload_len)
        started = self._started.pop(head.req_id, None)
        if started is not None:
            stats = started[1]
            stats.seconds.observe(time.perf_counter() - started[0])
            if payload_len:
                stats.sent.inc(payload_len)
        return out

    def send_error(self, head: FrameHead, error: StripefsError) -> bytes:
        out = super().send_error(head, error)
        started = self._started.pop(head.req_id, None)
        stats = started[1] if started is not None else _stats(self.role, head.msg_type)
        if started is not None:
            stats.seconds.observe(time.perf_counter() - started[0])
        stats.error(int(error.code))
        return out

    @property
    def in_flight(self) -> int:
        return len(self._started)


class _LiveCollector(Collector):
    """What is read at scrape time: connections, requests in flight, payload budgets."""

    def collect(self) -> Iterator[Any]:
        conns = GaugeMetricFamily("stripefs_rpc_connections", "Open connections", labels=["role"])
        flight = GaugeMetricFamily("stripefs_rpc_in_flight", "Requests decoded and not yet answered", labels=["role"])
        per: dict[str, list[int]] = {}
        for machine in list(_LIVE):
            if machine.peer_role and machine.state not in _ENDED:  # admitted, not ended (by the peer or an error)
                entry = per.setdefault(machine.role, [0, 0])
                entry[0] += 1
                entry[1] += machine.in_flight
        for role, (n, inflight) in sorted(per.items()):
            conns.add_metric([role], n)
            flight.add_metric([role], inflight)
        yield conns
        yield flight
        used = GaugeMetricFamily("stripefs_rpc_budget_used_bytes", "Request payload bytes held", labels=["role"])
        waiting = GaugeMetricFamily("stripefs_rpc_budget_waiting_bytes",
                                    "Request payload bytes queued for the budget", labels=["role"])
        busy = CounterMetricFamily("stripefs_rpc_busy", "Requests answered BUSY for want of budget", labels=["role"])
        for budget, role in list(BUDGETS.items()):
            used.add_metric([role], budget.used)
            waiting.add_metric([role], budget.waiting)
            busy.add_metric([role], budget.refused)
        yield used
        yield waiting
        yield busy


def start(*, buckets: tuple[float, ...], bulk: int, budgets: Any) -> None:
    """Make the RPC metrics and register the scrape-time collector (once).

    Args:
        buckets: latency histogram buckets (seconds).
        bulk: payload bytes from which a request is of class ``bulk``.
        budgets: a mapping of live ``ByteBudget`` objects to their server's role.
    """
    global _REQUESTS, _SECONDS, _RECEIVED, _SENT, _ERRORS, BULK, BUDGETS
    if _REQUESTS is not None:
        return
    BULK, BUDGETS = bulk, budgets
    _REQUESTS = Counter("stripefs_rpc_requests", "Requests decoded, by message type and size class",
                        ["role", "msg", "class"])
    _SECONDS = Histogram("stripefs_rpc_request_seconds", "Time from a request decoded to its answer encoded",
                         ["role", "msg"], buckets=buckets)
    _RECEIVED = Counter("stripefs_rpc_received_bytes", "Request payload bytes received", ["role", "msg"])
    _SENT = Counter("stripefs_rpc_sent_bytes", "Response payload bytes sent", ["role", "msg"])
    _ERRORS = Counter("stripefs_rpc_errors", "Requests answered with an error, by wire error code",
                      ["role", "msg", "code"])
    REGISTRY.register(_LiveCollector())
