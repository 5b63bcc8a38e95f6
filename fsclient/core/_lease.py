"""Advisory lease locks for clients: leader election, one writer per checkpoint directory.

    >>> with client.lease("/ckpt/run1", ttl=10.0) as lease:   # waits until free
    ...     write_checkpoint(fencing_token=lease.token)

The metadata service keeps the lease (``stripefs.metadata._locks``); a thread renews it
at a third of its TTL while it is held. Closing the client releases its leases
(so does the process's exit, and a client collected without ``close()``; a held
lease keeps its client from being collected); a holder that dies stops renewing,
and the lease expires after its TTL.

Caveats:
    * Advisory: it excludes other lease holders, not other writers.
    * If renewals fail for a whole TTL (the holder was cut off), another client
      may take the lease; :attr:`Lease.lost` then becomes true. Check it, or pass
      :attr:`Lease.token` to whatever you write so stale holders can be fenced.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING

from stripefs.wire import messages as m

if TYPE_CHECKING:
    from ._core import ClientCore

__all__ = ["Lease", "acquire"]

log = logging.getLogger(__name__)


class Lease:
    """One held lease. Made by :meth:`fsclient.Client.lease`; release it or use ``with``."""

    def __init__(self, core: "ClientCore", key: str, owner: bytes, ttl: float, token: int):
        self.key = key
        self.token = token
        self.ttl = ttl
        self._core = core
        self._owner = owner
        # The client the lease was taken through stays open while the lease is held
        # (``Client(...).lease(key)``), not collected and closed under it (fsclient.core._client).
        self._client = core.owner()
        self._pid = os.getpid()
        self._deadline = time.monotonic() + ttl  # our conservative view of the expiry
        self._stop = threading.Event()
        self.lost = False
        self._thread = threading.Thread(target=self._renew_loop, name=f"stripefs-lease-{key}", daemon=True)
        self._thread.start()

    @property
    def held(self) -> bool:
        """True while the lease is ours (renewed in time, not released)."""
        return not (self.lost or self._stop.is_set()) and time.monotonic() < self._deadline

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            sent = time.monotonic()
            try:
                reply = self._core.call(m.AcquireLock(key=self.key, owner=self._owner, ttl_ms=int(self.ttl * 1000)))
            except BlockingIOError:
                self.lost = True  # expired and taken by another owner
                log.warning("lease %r lost to another holder", self.key)
                return
            except OSError as exc:
                log.info("lease %r renewal failed, retrying: %s", self.key, exc)
                continue
            if reply.token != self.token:  # expired and re-taken by us: work since may be fenced
                self.lost = True
                return
            self._deadline = sent + self.ttl

    def release(self) -> None:
        """Give the lease back (idempotent; a no-op in a forked child)."""
        if self._stop.is_set() or os.getpid() != self._pid:
            return
        self._stop.set()
        self._thread.join()
        try:
            self._core.call(m.ReleaseLock(key=self.key, owner=self._owner))
        except OSError as exc:  # it expires by itself
            log.info("releasing lease %r failed (it will expire): %s", self.key, exc)
        self._client = None

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def acquire(core: "ClientCore", key: str, owner: bytes, ttl: float, wait: bool, timeout: float | None) -> Lease:
    """Take ``key`` (see :meth:`fsclient.Client.lease`)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = 0.05
    while True:
        try:
            reply = core.call(m.AcquireLock(key=key, owner=owner, ttl_ms=int(ttl * 1000)))
            return Lease(core, key, owner, ttl, reply.token)
        except BlockingIOError:
            if not wait or (deadline is not None and time.monotonic() + delay > deadline):
                raise
        time.sleep(delay)
        delay = min(delay * 2, 1.0, ttl / 4)

