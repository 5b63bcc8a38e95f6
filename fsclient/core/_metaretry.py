"""How long a metadata request keeps trying, and what the caller is told meanwhile.

One policy for the blocking (``ClientCore.call``) and the trio (``acall``) callers:

* each request starts at the next metadata service in turn; UNAVAILABLE or TIMEOUT
  (the service died, or it does not lead and the request needs the leader) moves it
  on to the next one, and after a full round without an answer it backs off
  (0.2 s, doubling up to 2 s);
* **nobody there**: when every address refused the connection (or has no route, or
  its host name does not resolve) and this client was never answered by the cluster,
  the request fails after :data:`REFUSED_GRACE` with an error that names the
  addresses and the cluster file. A cluster that is down, or a wrong port, is
  reported in about a second, not after the whole retry budget;
* **waiting**: a client that was answered before rides out a restart (refusals while
  the service comes back, connections or requests that time out). It keeps trying
  for its retry budget (``retry_for``, ``$STRIPEFS_RETRY_FOR``, 30 s: the same
  budget as chunk requests), counted from the request's first failure and within the
  call's ``timeout``, and logs a warning once per outage that it is waiting (the CLI
  shows it on stderr), and another when the service answers again.

Caveats:
    * A service that accepts a request and never answers (stopped, not dead) is
      noticed only when the request's ``timeout`` (60 s by default) runs out; a new
      connection to it is given up after ``rpc``'s connect timeout (10 s).
"""

from __future__ import annotations

import errno
import logging
import socket
import time
from typing import Iterator, Protocol

from stripefs.wire import ErrorCode, StripefsError

from ._config import ClusterConfig

__all__ = ["MetaHealth", "MetaRetry", "REFUSED_GRACE", "RETRY_DELAY", "RETRY_ENV", "RETRY_FOR"]

log = logging.getLogger("stripefs.fsclient")

# Seconds a failing request keeps retrying (metadata and chunk requests alike): a dead replica
# leaves its chain in ~5 s, a metadata service restarts in a second or two, but with overlapping
# faults a chain may have no serving target until a server returns. docs/operations.md
# ("When the cluster cannot be reached") documents this default; a test reads it from there.
RETRY_FOR = 30.0
RETRY_ENV = "STRIPEFS_RETRY_FOR"  # overrides RETRY_FOR for clients that do not pass retry_for
RETRY_DELAY = 0.2
# Seconds a client that never reached the cluster keeps trying while every address refuses:
# long enough for a service that `stripefs up` is starting at that moment, short enough that
# a cluster that is down is said at once.
REFUSED_GRACE = 1.0
# What a failed connect says when nobody is there at all (as opposed to a timeout).
_NOBODY_ERRNOS = frozenset({errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EADDRNOTAVAIL})


def nobody_there(exc: StripefsError) -> bool:
    """Whether ``exc`` is a connection that nothing at the address accepted (refused,
    no route, no such host), as opposed to a timeout or a connection lost."""
    cause = exc.__cause__
    if isinstance(cause, socket.gaierror):
        return True
    return isinstance(cause, OSError) and not isinstance(cause, StripefsError) and cause.errno in _NOBODY_ERRNOS


class MetaHealth:
    """What a client knows of its metadata services: whether any ever answered, and
    whether it is waiting for one now (so it says so once per outage, not per request)."""

    def __init__(self) -> None:
        self.answered = False
        self._waiting_since: float | None = None

    def ok(self) -> None:
        """A metadata request was answered."""
        self.answered = True
        since, self._waiting_since = self._waiting_since, None
        if since is not None:
            log.warning("stripefs: the metadata service answers again (after %.1f s)", time.monotonic() - since)

    def waiting(self, address: tuple[str, int], exc: StripefsError, left: float) -> None:
        if self._waiting_since is None:
            self._waiting_since = time.monotonic()
            log.warning("stripefs: waiting for the metadata service at %s:%d (%s); retrying for up to %.0f s more "
                        "(retry_for, %s)", address[0], address[1], _reason(exc), left, RETRY_ENV)


def _reason(exc: StripefsError) -> str:
    cause = exc.__cause__
    if isinstance(cause, OSError) and not isinstance(cause, StripefsError):
        return cause.strerror or str(cause) or type(cause).__name__
    return exc.message


class _Core(Protocol):
    """What the policy reads of ``ClientCore`` (which imports this module)."""

    config: ClusterConfig
    retry_for: float
    meta_health: MetaHealth
    _spread: Iterator[int]


class MetaRetry:
    """Where one metadata request goes next, and how long it waits first (module docstring)."""

    def __init__(self, core: _Core, timeout: float):
        self._core = core
        self.addresses = core.config.addresses
        self.services = len(self.addresses)
        self.index = next(core._spread) % self.services
        self.deadline = time.monotonic() + timeout
        self._delay = RETRY_DELAY
        self._failed = 0
        self._first: float | None = None  # when this request first failed
        self._refused: set[int] = set()   # services whose last try found nobody there

    def after(self, exc: StripefsError) -> float | None:
        """The seconds to wait before the next try after ``exc``; None: give up (re-raise ``exc``).

        Raises:
            StripefsError: instead of ``exc``, when giving up is better said otherwise:
                nobody at any address (UNAVAILABLE, naming the addresses and the cluster
                file), or the retry budget spent (the cause and the budget).
        """
        if exc.code not in (ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT):
            self._core.meta_health.ok()  # an error answered is an answer
            return None
        now = time.monotonic()
        if self._first is None:
            self._first = now
        if nobody_there(exc):
            self._refused.add(self.index)
        else:
            self._refused.discard(self.index)
        nobody = len(self._refused) == self.services
        health = self._core.meta_health
        if nobody and not health.answered and now - self._first >= REFUSED_GRACE:
            raise StripefsError(exc.code, self._nobody_message(exc)) from exc
        end = min(self.deadline, self._first + self._core.retry_for)
        if now + self._delay > end:
            if now - self._first < RETRY_DELAY:
                return None  # no retry was possible (a budget or timeout of ~0): the error as it is
            raise StripefsError(exc.code, f"{exc.message} (still failing after {now - self._first:.0f} s of retries; "
                                          f"{self._cluster()}; the budget is the client's retry_for or "
                                          f"{RETRY_ENV})") from exc
        self.index = (self.index + 1) % self.services
        self._failed += 1
        if self._failed % self.services:
            return 0.0
        if not (nobody and not health.answered):  # a client that never got in fails soon: no notice
            health.waiting(self.addresses[self.index], exc, end - now)
        wait, self._delay = self._delay, min(self._delay * 2, 2.0)
        return wait

    def _cluster(self) -> str:
        path = self._core.config.path
        return f"cluster file {path}" if path else "cluster given as host:port"

    def _nobody_message(self, exc: StripefsError) -> str:
        where = ", ".join(f"{h}:{p}" for h, p in self.addresses)
        service = "service" if self.services == 1 else "services"
        return (f"no metadata {service} at {where} ({_reason(exc)}); {self._cluster()}: is the cluster up? "
                "(`stripefs up --root DIR` starts it)")
