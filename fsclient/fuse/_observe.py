"""What a FUSE daemon counts and logs: per-operation Prometheus metrics (``--metrics``) and
the access log (``--access-log``), both off by default.

:func:`observe` wraps the handlers of one :class:`StripeOperations` instance (pyfuse3 looks
each handler up on the instance per request), so the operations themselves stay as
they are and a daemon with neither option pays nothing.

Metrics: ``stripefs_fuse_ops_total{op}``, ``stripefs_fuse_op_seconds{op}`` (histogram),
``stripefs_fuse_bytes_total{op}`` (read and write), ``stripefs_fuse_errors_total{op}``.

Caveats:
    * FUSE speaks inodes; the access log names the path this daemon learned for an inode
      from the lookups, creates and opens it served (at most :data:`MAX_PATHS` kept), else
      ``?`` (an inode the kernel looked up before a restart of the daemon).
"""

from __future__ import annotations

import functools
import time
from collections import OrderedDict
from typing import Any

from stripefs.rpc._metrics import LATENCY_BUCKETS, family

from ..core._accesslog import AccessLog

__all__ = ["observe", "OPS"]

OPS = ("lookup", "getattr", "setattr", "readlink", "opendir", "readdir", "releasedir", "mkdir", "rmdir", "symlink",
       "link", "unlink", "rename", "open", "create", "mknod", "read", "write", "flush", "fsync", "release", "statfs",
       "setxattr", "getxattr", "listxattr", "removexattr")
MAX_PATHS = 1 << 17
ROOT_INODE = 1



class _Paths:
    """Inode and handle -> path, as far as this daemon saw them named (bounded)."""

    def __init__(self) -> None:
        self.by_ino: OrderedDict[int, str] = OrderedDict({ROOT_INODE: "/"})
        self.by_fh: dict[int, str] = {}

    def ino(self, ino: int) -> str:
        return self.by_ino.get(ino, "?")

    def child(self, parent: int, name: bytes) -> str:
        base = self.by_ino.get(parent, "?")
        return (base.rstrip("/") + "/" + name.decode(errors="replace")) if base != "?" else "?"

    def learn(self, ino: int, path: str) -> None:
        if path == "?":
            return
        by = self.by_ino
        by[ino] = path
        by.move_to_end(ino)
        if len(by) > MAX_PATHS:
            by.popitem(last=False)


def _errno_name(exc: BaseException) -> str:
    import errno

    code = getattr(exc, "errno", None)
    return errno.errorcode.get(code, str(code)) if isinstance(code, int) else type(exc).__name__


def observe(ops: Any, *, access_log: AccessLog | None = None, metrics: bool = False) -> None:
    """Count (``metrics``) and log (``access_log``) every request ``ops`` serves."""
    if access_log is None and not metrics:
        return
    paths = _Paths()
    for op in OPS:
        handler = getattr(ops, op, None)
        if handler is not None:
            setattr(ops, op, _wrap(op, handler, paths, access_log, metrics))


def _wrap(op: str, handler: Any, paths: _Paths, log: AccessLog | None, metrics: bool) -> Any:
    count = seconds = nbytes = errors = None
    if metrics:  # children bound once per operation
        count = family("Counter", "stripefs_fuse_ops", "FUSE requests served, by operation", ("op",)).labels(op)
        seconds = family("Histogram", "stripefs_fuse_op_seconds", "FUSE request latency in the daemon", ("op",),
                         buckets=LATENCY_BUCKETS).labels(op)
        if op in ("read", "write"):
            nbytes = family("Counter", "stripefs_fuse_bytes", "Bytes read and written through the mount",
                            ("op",)).labels(op)
        errors = family("Counter", "stripefs_fuse_errors", "FUSE requests answered with an error", ("op",)).labels(op)

    @functools.wraps(handler)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        status = "ok"
        result = None
        try:
            result = await handler(*args, **kwargs)
            return result
        except BaseException as exc:
            status = _errno_name(exc)
            raise
        finally:
            took = time.perf_counter() - t0
            size = _size(op, args, result) if status == "ok" else 0
            if count is not None:
                count.inc()
                seconds.observe(took)  # type: ignore[union-attr]
                if nbytes is not None and size:
                    nbytes.inc(size)
                if status != "ok":
                    errors.inc()  # type: ignore[union-attr]
            if log is not None:
                log.record(op, size, took, status, _path(op, args, result, paths, status))
    return wrapper


def _size(op: str, args: tuple[Any, ...], result: Any) -> int:
    if op == "read":
        return len(result) if result is not None else 0
    if op == "write":
        return int(result or 0)
    return 0


def _path(op: str, args: tuple[Any, ...], result: Any, paths: _Paths, status: str) -> str:
    """The path of a request (and what it teaches: a looked-up name's inode, an open handle)."""
    if op in ("lookup", "mkdir", "create", "mknod", "symlink"):
        path = paths.child(args[0], args[1])
        if status == "ok" and result is not None:
            entry = result[1] if op == "create" else result
            paths.learn(getattr(entry, "st_ino", 0), path)
            if op == "create":
                paths.by_fh[result[0].fh] = path
        return path
    if op in ("unlink", "rmdir"):
        return paths.child(args[0], args[1])
    if op == "rename":
        return paths.child(args[0], args[1])
    if op in ("read", "write", "flush", "fsync", "readdir"):
        return paths.by_fh.get(args[0], "?")
    if op in ("release", "releasedir"):
        return paths.by_fh.pop(args[0], "?")
    if op in ("open", "opendir"):
        path = paths.ino(args[0])
        if status == "ok" and result is not None:
            paths.by_fh[result.fh if op == "open" else result] = path
        return path
    if op == "link":
        return paths.child(args[1], args[2])
    if op == "statfs":
        return "/"
    return paths.ino(args[0]) if args and isinstance(args[0], int) else "?"
