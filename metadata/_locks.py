"""Advisory lease locks kept by the metadata service: one operation per method.

A lease is held by an owner (a client session) for a time the owner renews; a
holder that dies stops renewing and its lease expires, so the lock is released
when the holder's session ends, cleanly (``release``) or not (expiry). Leases
live in the store, so they survive a restart of the metadata service and are
shared by every metadata service on the same store.

Each new holder gets a larger ``token`` (a fencing token): work done under a
lease can carry it, and a receiver can refuse tokens older than one it has seen.

Not the attribute leases of the clients' caches (``_leasetable.py``, ``_lease_grants.py``):
these lock a key, those vouch for a cached answer.

Caveats:
    * Expiry uses the metadata service's clock; a holder must renew well within
      its TTL (the client renews at a third of it).
    * Advisory: nothing stops a client from writing without the lease.
"""

from __future__ import annotations

import time

from stripefs.wire._errors import ErrorCode, StripefsError
from stripefs.wire._types import MAX_PATH

from ._store import LockRow, Store

__all__ = ["Leases", "MIN_TTL_NS", "MAX_TTL_NS"]

MIN_TTL_NS = 100_000_000  # 0.1 s
MAX_TTL_NS = 3600 * 1_000_000_000  # 1 h


def _check(key: str, owner: bytes) -> None:
    if not key or len(key.encode("utf-8", "surrogateescape")) > MAX_PATH or "\x00" in key:
        raise StripefsError(ErrorCode.INVALID, f"lock keys are 1-{MAX_PATH} bytes without NUL")
    if not 8 <= len(owner) <= 64:
        raise StripefsError(ErrorCode.INVALID, "lock owner must be 8-64 bytes")


class Leases:
    """Lease locks over a :class:`~metadata._store.Store`."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def acquire(self, key: str, owner: bytes, ttl_ns: int, now_ns: int | None = None) -> LockRow:
        """Take ``key`` for ``owner`` for ``ttl_ns``, or renew it if ``owner`` holds it.

        Returns:
            The lock row: a new holder gets the next token, a renewal keeps it.

        Raises:
            StripefsError: WOULD_BLOCK (EAGAIN) when another owner holds an
                unexpired lease; INVALID for a bad key, owner or TTL.
        """
        _check(key, owner)
        if not MIN_TTL_NS <= ttl_ns <= MAX_TTL_NS:
            raise StripefsError(ErrorCode.INVALID, f"lease TTL must be {MIN_TTL_NS / 1e9}-{MAX_TTL_NS / 1e9:.0f} s")
        now = time.time_ns() if now_ns is None else now_ns
        with self._store.transaction() as txn:
            held = txn.get_lock(key)
            if held is not None and held.owner != owner and held.expires_ns > now:
                raise StripefsError(ErrorCode.WOULD_BLOCK, f"lock {key!r} is held (for {(held.expires_ns - now) / 1e9:.1f} s more)")
            if held is not None and held.owner == owner and held.expires_ns > now:
                token = held.token  # a renewal
            else:
                token = (held.token if held is not None else 0) + 1
            row = LockRow(key, owner, token, now + ttl_ns)
            txn.put_lock(row)
            return row

    def release(self, key: str, owner: bytes) -> bool:
        """Drop ``owner``'s lease on ``key``. Returns False when ``owner`` did not hold it.

        The row keeps its token (as expired), so the next holder's token is larger.
        """
        _check(key, owner)
        with self._store.transaction() as txn:
            held = txn.get_lock(key)
            if held is None or held.owner != owner:
                return False
            txn.put_lock(LockRow(key, b"\x00" * 8, held.token, 0))
            return True
