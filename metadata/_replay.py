"""Replay of retried mutations: a client's retry gets the first answer, not a second application.

A client retries a mutation with the same (client id, request id) after a lost
connection. One service remembers its recent answers in memory (:class:`Replies`,
filled by ``MetadataService.handle`` once an answer is durable). Services sharing a
store (PostgreSQL) cannot see each other's memory: there the first namespace call of a
mutation runs through :func:`apply_once` on the commit path (``_commit.py``), which
records the result in the store's ``replies`` table in the same commit as the change,
so a retry that fails over to another service finds it. The leader deletes records
older than ``REPLIES_KEPT`` (:func:`forget_replies`).

The functions here run on the writer thread, inside its batch (``CommitPath.store_call``).
"""

from __future__ import annotations

import pickle
import time
from collections import OrderedDict
from typing import Any, Callable

from stripefs.wire import StripefsError

from ._store import Store

__all__ = ["Replies", "REPLIES_KEPT", "apply_once", "was_applied", "forget_replies"]

# With several services, results of mutations are kept this long for retries that fail
# over to another service (a client retries for at most a minute).
REPLIES_KEPT = 600.0


class Replies:
    """Answers to recent mutations by (client id, request id), for retries (as
    ``rpc.ReplayCache``), bounded by their count and by the attributes they hold.

    A batch's answer (``CreateMany``, ``UnlinkMany``) holds up to 200 attributes, ~160 KB
    of Python objects: counted as one entry each, 8192 of them would hold over a GB.
    The newest answer is always kept.
    """

    def __init__(self, entries: int = 8192, attrs: int = 65536):
        self.entries, self.attrs = entries, attrs
        self._d: OrderedDict[tuple[bytes, int], tuple[dict[str, Any] | StripefsError, int]] = OrderedDict()
        self._weight = 0

    def get(self, key: tuple[bytes, int]) -> dict[str, Any] | StripefsError | None:
        found = self._d.get(key)
        return None if found is None else found[0]

    def put(self, key: tuple[bytes, int], value: dict[str, Any] | StripefsError) -> None:
        old = self._d.pop(key, None)
        if old is not None:
            self._weight -= old[1]
        weight = max(1, len(value.get("attrs", ()))) if isinstance(value, dict) else 1
        self._d[key] = (value, weight)
        self._weight += weight
        while len(self._d) > 1 and (len(self._d) > self.entries or self._weight > self.attrs):
            self._weight -= self._d.popitem(last=False)[1][1]



def apply_once(store: Store, key: tuple[bytes, int], fn: Callable[[], Any]) -> Any:
    """Apply ``fn`` unless request ``key`` was applied already (by any service); its
    result is recorded in the same transaction, so both commit or neither does."""
    with store.transaction() as txn:
        prior = txn.get_reply(key[0], key[1])
    if prior is not None:
        return pickle.loads(prior)  # our own record, written below by a service of this cluster
    result = fn()
    with store.transaction() as txn:
        txn.put_reply(key[0], key[1], time.time_ns(), pickle.dumps(result))
    return result


def was_applied(store: Store, key: tuple[bytes, int]) -> bool:
    """Whether request ``key`` was applied already, by any service sharing the store."""
    with store.transaction() as txn:
        return txn.get_reply(key[0], key[1]) is not None


def forget_replies(store: Store) -> None:
    """Delete the records older than ``REPLIES_KEPT``."""
    with store.transaction() as txn:
        txn.delete_replies(time.time_ns() - int(REPLIES_KEPT * 1e9))
