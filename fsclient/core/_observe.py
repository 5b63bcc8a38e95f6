"""What a native :class:`Client` counts and logs when asked (off by default).

* ``Client(access_log=FILE)`` or ``$STRIPEFS_ACCESS_LOG``: every call of the path API
  (``read_bytes``, ``write_bytes``, ``open``, ``stat``, ``listdir`` ...) as a line of the access log
  (``_accesslog.py``; ``stripefs profile FILE`` sums it up). Clients of one process share
  one log per file.
* ``$STRIPEFS_CLIENT_METRICS=HOST:PORT``: the process serves Prometheus metrics
  (``rpc._metrics``): ``stripefs_client_ops_total{op}``, ``stripefs_client_op_seconds{op}``,
  ``stripefs_client_bytes_total{op}``, ``stripefs_client_errors_total{op}``.

:func:`observe_client` wraps the methods of one instance; a client with neither pays nothing.

Caveats:
    * Reads and writes through an open file object (``Client.open``) are logged as the
      ``open`` only; the batch read path (``fsclient.batchread``) is not logged.
"""

from __future__ import annotations

import atexit
import functools
import os
import threading
import time
from typing import Any

from ._accesslog import AccessLog

__all__ = ["ACCESS_LOG_ENV", "CLIENT_METRICS_ENV", "OPS", "observe_client", "shared_log"]

ACCESS_LOG_ENV = "STRIPEFS_ACCESS_LOG"
CLIENT_METRICS_ENV = "STRIPEFS_CLIENT_METRICS"
# method -> how its size is known: "result" (len of what it returns), "data" (len of its 2nd argument), None
OPS: dict[str, str | None] = {
    "read_bytes": "result", "write_bytes": "data", "open": None, "stat": None, "lstat": None, "exists": None,
    "listdir": None, "scandir": None, "mkdir": None, "makedirs": None, "rmdir": None, "remove": None,
    "rename": None, "truncate": None, "copy": None, "symlink": None, "readlink": None, "link": None,
}

_lock = threading.Lock()
_logs: dict[str, AccessLog] = {}
_metrics: Any = None  # (ops, seconds, bytes, errors) once the endpoint runs
_inside = threading.local()  # a wrapped call runs on this thread: calls it makes are part of it


def shared_log(path: str) -> AccessLog:
    """This process's access log writing to ``path`` (one per file, closed at exit)."""
    path = os.path.abspath(path)
    with _lock:
        log = _logs.get(path)
        if log is None:
            log = _logs[path] = AccessLog(path)
            atexit.register(log.close)
        return log


def _client_metrics(address: str) -> Any:
    global _metrics
    with _lock:
        if _metrics is None:
            from stripefs.rpc._metrics import LATENCY_BUCKETS, family, serve_metrics

            serve_metrics(address, role="client")
            _metrics = (family("Counter", "stripefs_client_ops", "Client calls, by method", ("op",)),
                        family("Histogram", "stripefs_client_op_seconds", "Client call latency", ("op",),
                               buckets=LATENCY_BUCKETS),
                        family("Counter", "stripefs_client_bytes", "Bytes read and written by client calls", ("op",)),
                        family("Counter", "stripefs_client_errors", "Client calls that raised", ("op",)))
        return _metrics


def observe_client(client: Any, access_log: str | None = None) -> None:
    """Log (``access_log``, else ``$STRIPEFS_ACCESS_LOG``) and count (``$STRIPEFS_CLIENT_METRICS``)
    the calls of ``client``."""
    path = access_log or os.environ.get(ACCESS_LOG_ENV)
    log = shared_log(path) if path else None
    address = os.environ.get(CLIENT_METRICS_ENV)
    families = _client_metrics(address) if address else None
    if log is None and families is None:
        return
    for op, sized in OPS.items():
        method = getattr(client, op, None)
        if method is not None:
            setattr(client, op, _wrap(op, sized, method, log, families))


def _wrap(op: str, sized: str | None, method: Any, log: AccessLog | None, families: Any) -> Any:
    children = tuple(f.labels(op) for f in families) if families is not None else None

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if getattr(_inside, "call", False):  # read_bytes opens the file: one operation, logged once
            return method(*args, **kwargs)
        t0 = time.perf_counter()
        status, result = "ok", None
        _inside.call = True
        try:
            result = method(*args, **kwargs)
            return result
        except BaseException as exc:
            import errno

            code = getattr(exc, "errno", None)
            status = errno.errorcode.get(code, type(exc).__name__) if isinstance(code, int) else type(exc).__name__
            raise
        finally:
            _inside.call = False
            took = time.perf_counter() - t0
            size = 0
            if status == "ok":
                if sized == "result" and result is not None:
                    size = len(result)
                elif sized == "data" and len(args) > 1:
                    size = len(args[1])
            if children is not None:
                ops, seconds, nbytes, errors = children
                ops.inc()
                seconds.observe(took)
                if size:
                    nbytes.inc(size)
                if status != "ok":
                    errors.inc()
            if log is not None:
                path = args[0] if args and isinstance(args[0], str) else "?"
                log.record(op, size, took, status, path)
    return wrapper
