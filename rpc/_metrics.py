"""Prometheus metrics of a server process: the RPC counters every server shares, and the
HTTP endpoint (``--metrics HOST:PORT``) that exposes them with each package's own.

Counting is off until :func:`serve_metrics` runs: a server whose endpoint is off decodes
its requests through the plain :class:`wire.ServerConnection`. With it on, each
connection's state machine is a :class:`MeteredServerConnection`, which sees every request
decoded and every answer encoded on whichever side serves it (the trio reader, a reply
thread that receives for itself, a worker thread): one place, no handler touched.

Per request that costs two clock reads, a dict insert and pop, a counter increment and a
histogram observation, all on children bound once per message type (~2 µs; a small read
costs ~100 µs end to end). Labels are bounded: the role, the message type, a size class
and an error code -- never a path, an inode or a client id.

Metrics (all with ``role``, the server's ``Service.role``):

* ``stripefs_rpc_requests_total{msg,class}``: requests decoded; ``class`` is ``bulk`` for a
  request payload of at least 1 MiB, else ``small``;
* ``stripefs_rpc_request_seconds{msg}``: decoded to answered (a histogram);
* ``stripefs_rpc_received_bytes_total{msg}``, ``stripefs_rpc_sent_bytes_total{msg}``: payload bytes;
* ``stripefs_rpc_errors_total{msg,code}``: requests answered with an error, by wire code;
* ``stripefs_rpc_in_flight``, ``stripefs_rpc_connections``: requests decoded and not yet
  answered, connections open (read at scrape time);
* ``stripefs_rpc_budget_used_bytes``, ``stripefs_rpc_budget_waiting_bytes``,
  ``stripefs_rpc_busy_total``: the payload budget (the queue of writes waiting for room).

``prometheus_client`` (whose import costs ~0.1-0.2 s, most of it its HTTP server) is imported
only once an endpoint starts (``rpc/_prom.py``): clients and CLI commands never pay for it.
Metrics other packages count on rare events (fsyncs, lease grants) are :class:`Lazy`
children, made when the endpoint starts; until then their updates are dropped.

Caveats:
    * One process, one endpoint: a second :func:`serve_metrics` in the same process
      serves the same registry again (tests running several servers in one process see
      their counts summed).
"""

from __future__ import annotations

import contextlib
import json
import os
import weakref
from collections.abc import Callable
from typing import Any

from stripefs.wire import ServerConnection

__all__ = ["LATENCY_BUCKETS", "METRICS_ENV", "METRICS_FILE", "Lazy", "enabled", "family", "on_enable",
           "parse_address", "serve_metrics", "server_machine", "watch_budget", "write_address_file"]

# Seconds: a small read on loopback is ~100 µs, a checkpoint chunk write with its fsync tens of ms.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0)
BULK = 1 << 20  # request payload bytes from which a request is of class "bulk" (storage/_qos.BULK_WRITE)
SCAN_PORTS = 256  # ports tried above PORT for ``HOST:PORT+``
# Where a server process started by ``stripefs up`` takes its ``--metrics`` default, and the
# file (in a storage root; ``metrics-<rpc port>.json`` in the metadata state directory)
# where a process writes the address it bound.
METRICS_ENV = "STRIPEFS_METRICS"
METRICS_FILE = "metrics.json"

_enabled = False
_machine: type[ServerConnection] = ServerConnection
_on_enable: list[Callable[[], None]] = []
_families: dict[str, Any] = {}
BUDGETS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def enabled() -> bool:
    """Whether this process serves metrics (an endpoint was started)."""
    return _enabled


def server_machine() -> type[ServerConnection]:
    """The state machine class a server connection uses now (a counting one once enabled)."""
    return _machine


def watch_budget(role: str, budget: Any) -> None:
    """Expose a server's payload budget (``rpc.ByteBudget``) while it lives."""
    BUDGETS[budget] = role


def on_enable(fn: Callable[[], None]) -> None:
    """Call ``fn`` when the endpoint starts (at once if it runs): register a collector there."""
    if _enabled:
        fn()
    else:
        _on_enable.append(fn)


def family(kind: str, name: str, doc: str, labels: tuple[str, ...] = (), **kw: Any) -> Any:
    """The ``prometheus_client`` metric ``name`` (``kind``: Counter, Gauge, Histogram), made once."""
    found = _families.get(name)
    if found is None:
        import prometheus_client

        found = _families[name] = getattr(prometheus_client, kind)(name, doc, list(labels), **kw)
    return found


class Lazy:
    """A metric (child) made when the endpoint starts; its updates are dropped until then.

    Args:
        kind, name, doc, labels, kw: as :func:`family`.
        values: the label values of the child (none: the metric itself).
    """

    __slots__ = ("_spec", "_child")

    def __init__(self, kind: str, name: str, doc: str, labels: tuple[str, ...] = (), values: tuple[str, ...] = (),
                 **kw: Any):
        self._spec = (kind, name, doc, labels, values, kw)
        self._child: Any = None
        on_enable(self._make)

    def _make(self) -> None:
        kind, name, doc, labels, values, kw = self._spec
        metric = family(kind, name, doc, labels, **kw)
        self._child = metric.labels(*values) if values else metric

    def inc(self, amount: float = 1) -> None:
        if self._child is not None:
            self._child.inc(amount)

    def observe(self, value: float) -> None:
        if self._child is not None:
            self._child.observe(value)

    def set(self, value: float) -> None:
        if self._child is not None:
            self._child.set(value)

    def time(self) -> Any:
        """A context timing its block into this histogram (nothing while disabled)."""
        return self._child.time() if self._child is not None else contextlib.nullcontext()


def parse_address(text: str) -> tuple[str, int, bool]:
    """``HOST:PORT`` (PORT 0: any free port) or ``HOST:PORT+`` (PORT, else the first free one
    above it): ``(host, port, scan)``.

    Raises:
        ValueError: not of that form.
    """
    host, sep, port = text.strip().rpartition(":")
    scan = port.endswith("+")
    port = port.rstrip("+")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"--metrics wants HOST:PORT (PORT 0: any free port; PORT+: the first free from PORT), got {text!r}")
    return host.strip("[]"), int(port), scan


def serve_metrics(address: str, *, role: str, address_file: str | None = None) -> tuple[str, int]:
    """Start this process's metrics endpoint (a daemon thread serving ``/metrics``) and
    turn counting on; returns the bound ``(host, port)``.

    Args:
        address: ``HOST:PORT``, ``HOST:0``, or ``HOST:PORT+`` (:func:`parse_address`).
        role: what this process is (``metadata``, ``storage``, ``fuse``, ``client``), shown as
            ``stripefs_process_info{role}``.
        address_file: where to write ``{"address", "role", "pid"}`` (JSON) once bound, so
            ``stripefs top`` finds an endpoint that took a free port.

    Raises:
        ValueError: a malformed address.
        OSError: the port is taken (no free one in the scanned range).
    """
    global _enabled, _machine
    host, port, scan = parse_address(address)
    from prometheus_client import start_http_server

    from . import _prom

    last: OSError | None = None
    for candidate in range(port, min(port + SCAN_PORTS, 65536)) if scan else (port,):
        try:
            httpd, _thread = start_http_server(candidate, addr=host)
            break
        except OSError as exc:
            last = exc
    else:
        assert last is not None
        raise last
    if not _enabled:
        _enabled = True
        _machine = _prom.MeteredServerConnection
        _prom.start(buckets=LATENCY_BUCKETS, bulk=BULK, budgets=BUDGETS)
        for fn in _on_enable:
            fn()
        _on_enable.clear()
    family("Gauge", "stripefs_process_info", "This process's role (value 1)", ("role",)).labels(role).set(1)
    bound = int(httpd.server_address[1])
    if address_file:
        write_address_file(address_file, host, bound, role)
    return host, bound


def write_address_file(path: str, host: str, port: int, role: str, **extra: Any) -> None:
    """Record a metrics endpoint for ``stripefs top``: ``{"address", "role", "pid", ...}`` (JSON)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"address": f"{host}:{port}", "role": role, "pid": os.getpid(), **extra}, f)
    os.replace(tmp, path)
