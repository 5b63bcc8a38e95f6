"""What a storage server counts for its metrics endpoint (``rpc._metrics``).

Counted where it happens (``_chunks.py``): fsyncs and their latency, checksum failures.
Read at scrape time from the live servers (:func:`watch`): disk usage and capacity, chunks
held, resync progress, bulk-write slots taken. Nothing here is labelled by chunk or inode.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

from stripefs.rpc._metrics import Lazy, on_enable

__all__ = ["CHECKSUM_FAILURES", "FSYNC_DATA", "FSYNC_DIR", "watch"]

_FSYNC = ("Histogram", "stripefs_storage_fsync_seconds",
          "fdatasync of a chunk file (kind=data) or fsync of a directory (kind=dir)", ("kind",))
_FSYNC_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
FSYNC_DATA = Lazy(*_FSYNC, values=("data",), buckets=_FSYNC_BUCKETS)
FSYNC_DIR = Lazy(*_FSYNC, values=("dir",), buckets=_FSYNC_BUCKETS)
CHECKSUM_FAILURES = ("Counter", "stripefs_storage_checksum_failures",
                     "Chunk checksum mismatches: read (stored data on a read), scrub (found by a scrub), "
                     "transit (a write's payload corrupted on the way)", ("where",))
CHECKSUM_READ = Lazy(*CHECKSUM_FAILURES, values=("read",))
CHECKSUM_SCRUB = Lazy(*CHECKSUM_FAILURES, values=("scrub",))
CHECKSUM_TRANSIT = Lazy(*CHECKSUM_FAILURES, values=("transit",))

_SERVICES: weakref.WeakSet[Any] = weakref.WeakSet()


def watch(service: Any) -> None:
    """Expose a ``StorageService``'s usage and background work while it lives."""
    _SERVICES.add(service)


class _StorageCollector:
    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        labels = ["server_id"]
        used = GaugeMetricFamily("stripefs_storage_used_bytes", "Chunk bytes stored", labels=labels)
        chunks = GaugeMetricFamily("stripefs_storage_chunks", "Chunks stored", labels=labels)
        capacity = GaugeMetricFamily("stripefs_storage_capacity_bytes", "Size of the file system holding the target",
                                     labels=labels)
        free = GaugeMetricFamily("stripefs_storage_free_bytes", "Free bytes of that file system", labels=labels)
        syncing = GaugeMetricFamily("stripefs_storage_resync_active", "1 while this server resyncs its chains",
                                    labels=labels)
        total = GaugeMetricFamily("stripefs_storage_resync_chunks", "Chunks of the chain being resynced",
                                  labels=labels)
        done = GaugeMetricFamily("stripefs_storage_resync_done_chunks", "Of those, chunks done", labels=labels)
        bulk = GaugeMetricFamily("stripefs_storage_bulk_writes", "Bulk chunk writes holding a slot (storage/_qos)",
                                 labels=labels)
        silences = CounterMetricFamily("stripefs_storage_metadata_silences",
                                       "Times the metadata service went unheard for a lease period", labels=labels)
        for service in list(_SERVICES):
            sid = [str(service.server_id if service.server_id is not None else "")]
            store, repl = service.store, service.repl
            used.add_metric(sid, store.used)
            chunks.add_metric(sid, store.chunks)
            try:
                cap, avail = store.capacity()
            except OSError:
                cap = avail = 0
            capacity.add_metric(sid, cap)
            free.add_metric(sid, avail)
            syncing.add_metric(sid, 1 if repl.syncing else 0)
            progress = dict(repl.sync_progress) if repl.syncing else {}
            total.add_metric(sid, progress.get("total", 0))
            done.add_metric(sid, progress.get("done", 0))
            limiter = getattr(repl, "bulk", None)
            bulk.add_metric(sid, limiter.borrowed_tokens if limiter is not None else 0)
            silences.add_metric(sid, getattr(repl, "silences", 0))
        yield from (used, chunks, capacity, free, syncing, total, done, bulk, silences)


def _register() -> None:
    from prometheus_client import REGISTRY

    REGISTRY.register(_StorageCollector())  # type: ignore[arg-type]


on_enable(_register)
