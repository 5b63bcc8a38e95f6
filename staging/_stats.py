"""What checkpoint staging counts for a metrics endpoint (``rpc._metrics``).

Counted where it happens: bytes the mover uploaded (acknowledged pieces), and every
checkpoint that reached an end state (``Journal.set_state``: committed, failed, abandoned),
with the replicas its commit reached. Read at scrape time from the journals this process
opened (:func:`watch`): the backlog (checkpoints not yet in the store, their bytes still to
upload) and its lag (the age of the oldest). The trainer's in-process mover and
``stripefs mover --metrics HOST:PORT`` count alike; a trainer serves them when it serves its
client's (``$STRIPEFS_CLIENT_METRICS``). Nothing is labelled by checkpoint or path.

Metrics:

* ``stripefs_mover_uploaded_bytes_total``;
* ``stripefs_mover_checkpoints_total{outcome}``: committed, failed, abandoned;
* ``stripefs_mover_degraded_commits_total``: commits made while some chain had fewer
  serving replicas than the cluster's count;
* ``stripefs_mover_last_commit_replicas``: the fewest serving replicas of any chain at the
  last commit (what every chunk of it was acknowledged by);
* ``stripefs_mover_backlog_checkpoints``, ``stripefs_mover_backlog_bytes``,
  ``stripefs_mover_lag_seconds`` (0 with no backlog): summed over this process's journals
  (a staging directory's path would be an unbounded label).
"""

from __future__ import annotations

import json
import logging
import time
import weakref
from collections.abc import Iterator
from typing import Any

from stripefs.rpc._metrics import Lazy, on_enable

__all__ = ["UPLOADED", "count_end", "watch"]

log = logging.getLogger(__name__)

UPLOADED = Lazy("Counter", "stripefs_mover_uploaded_bytes", "Checkpoint bytes uploaded to the store")
_ENDS = ("Counter", "stripefs_mover_checkpoints", "Checkpoints that reached an end state, by outcome", ("outcome",))
_END = {state: Lazy(*_ENDS, values=(state,)) for state in ("committed", "failed", "abandoned")}
_DEGRADED = Lazy("Counter", "stripefs_mover_degraded_commits",
                 "Commits made while some chain had fewer serving replicas than the cluster's count")
_REPLICAS = Lazy("Gauge", "stripefs_mover_last_commit_replicas",
                 "Fewest serving replicas of any chain at the last commit")
PENDING = ("writing", "streaming", "staged")

_JOURNALS: weakref.WeakSet[Any] = weakref.WeakSet()


def watch(journal: Any) -> None:
    """Expose a ``Journal``'s backlog while it lives."""
    _JOURNALS.add(journal)


def count_end(state: str, durability: str | None) -> None:
    """A checkpoint reached ``state``; ``durability``: its commit's (``_replicas.Durability`` JSON)."""
    end = _END.get(state)
    if end is not None:
        end.inc()
    if durability:
        try:
            d = json.loads(durability)
            _REPLICAS.set(d["serving"])
            if d["degraded"]:
                _DEGRADED.inc()
        except (ValueError, KeyError, TypeError):
            log.debug("unreadable durability record %r", durability)


class _BacklogCollector:
    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        rows = left = 0
        oldest: float | None = None
        marks = ",".join("?" * len(PENDING))
        for journal in list(_JOURNALS):
            db = journal._db()  # this (scraping) thread's own connection
            n, first = db.execute(f"SELECT COUNT(*), MIN(created) FROM ckpt WHERE state IN ({marks})",
                                  PENDING).fetchone()
            (b,) = db.execute(f"SELECT COALESCE(SUM(f.size - f.done), 0) FROM file f JOIN ckpt c ON f.ckpt = c.id "
                              f"WHERE c.state IN ({marks})", PENDING).fetchone()
            rows, left = rows + n, left + b
            if first is not None:
                oldest = first if oldest is None else min(oldest, first)
        yield GaugeMetricFamily("stripefs_mover_backlog_checkpoints", "Checkpoints staged and not yet in the store",
                                value=rows)
        yield GaugeMetricFamily("stripefs_mover_backlog_bytes", "Bytes of those still to upload", value=left)
        yield GaugeMetricFamily("stripefs_mover_lag_seconds", "Age of the oldest checkpoint not yet in the store",
                                value=max(0.0, time.time() - oldest) if oldest is not None else 0.0)


def _register() -> None:
    from prometheus_client import REGISTRY

    REGISTRY.register(_BacklogCollector())


on_enable(_register)
