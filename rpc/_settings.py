"""Settings a process reads from its environment, and why a server could not start."""

from __future__ import annotations

import errno
import gc
import logging
import os

from stripefs.wire import StripefsError

__all__ = ["cannot_start", "int_setting", "quiet_collector"]

log = logging.getLogger(__name__)


def int_setting(env: str, default: int) -> int:
    """An integer setting from the environment variable ``env`` (``default`` when unset or
    not a number, said in the log)."""
    raw = os.environ.get(env, "")
    try:
        return int(raw) if raw else default
    except ValueError:
        log.warning("%s=%r is not a number: using %d", env, raw, default)
        return default


def quiet_collector() -> None:
    """Tune the garbage collector of a long-running server or daemon, before it serves.

    Each request leaves a few container objects behind for a while (tasks, events,
    replies): with the default threshold (700) the collector ran every few requests, ~5% of
    the metadata service's CPU, and from time to time (once the objects that survived young
    collections had grown by a quarter) it made a full collection, which stopped the
    process for 10-15 ms once it held a few hundred thousand objects (a FUSE daemon's cached
    attributes and leases: every reader of the mount waited, docs/benchmarks.md). Collect
    young objects 50x less often, and never rescan what exists before serving (modules,
    classes: frozen).
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(35_000, 10, 10)


# bind() errors that mean the listen address itself is wrong (in use, not ours, privileged).
_LISTEN_ERRORS = {errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES}


def cannot_start(exc: BaseException, host: str, port: int) -> str | None:
    """Why a server could not start, when ``exc`` (or an error grouped in it: trio wraps the
    errors of a nursery) says: a StripefsError's message (a store or root it cannot use), or
    a listen address it cannot bind. None for anything else (a bug: the traceback is shown)."""
    if isinstance(exc, StripefsError):
        return exc.message
    if isinstance(exc, OSError) and exc.errno in _LISTEN_ERRORS:
        return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = cannot_start(inner, host, port)
            if found is not None:
                return found
    return None
