"""What the metadata service counts for its metrics endpoint (``rpc._metrics``).

Counted where it happens: commit batch sizes and log fsyncs (``_commit.py``), lease
grants, invalidations and the waits they cause (``_leasetable.py``). Read at scrape time
from the live services (:func:`watch`): leases held, holders, group fsyncs, garbage
collection passes, storage servers by state. No label names a path, an inode or a client.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from stripefs.rpc._metrics import Lazy, on_enable

__all__ = ["COMMIT_BATCH", "LEASE_GRANTS", "LEASE_INVALIDATIONS", "LEASE_WAIT_SECONDS", "LOG_FSYNC_SECONDS",
           "timed_sync", "watch"]

COMMIT_BATCH = Lazy("Histogram", "stripefs_metadata_commit_batch_ops",
                    "Operations per write batch of the writer thread (group commit)",
                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
LOG_FSYNC_SECONDS = Lazy("Histogram", "stripefs_metadata_log_fsync_seconds",
                         "Group fsync of the SQLite log (--metadata-sync full)",
                         buckets=(0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0))
LEASE_GRANTS = Lazy("Counter", "stripefs_metadata_lease_grants", "Attribute/listing leases granted")
LEASE_INVALIDATIONS = Lazy("Counter", "stripefs_metadata_lease_invalidations",
                           "Leases revoked by a mutation, their holders told")
LEASE_WAIT_SECONDS = Lazy("Histogram", "stripefs_metadata_lease_wait_seconds",
                          "How long a mutation waited for the holders it told to acknowledge",
                          buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0))


def timed_sync(sync: Callable[[], None]) -> Callable[[], None]:
    """``sync`` with each call's duration in :data:`LOG_FSYNC_SECONDS`."""
    def timed() -> None:
        t0 = time.perf_counter()
        try:
            sync()
        finally:
            LOG_FSYNC_SECONDS.observe(time.perf_counter() - t0)
    return timed


_SERVICES: weakref.WeakSet[Any] = weakref.WeakSet()


def watch(service: Any) -> None:
    """Expose a ``MetadataService``'s leases, fsyncs and background work while it lives."""
    _SERVICES.add(service)


class _MetadataCollector:
    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        leases = GaugeMetricFamily("stripefs_metadata_leases", "Leases held by clients now")
        holders = GaugeMetricFamily("stripefs_metadata_lease_holders", "Clients holding or watching leases")
        syncs = CounterMetricFamily("stripefs_metadata_log_fsyncs", "Group fsyncs of the log")
        gc = CounterMetricFamily("stripefs_metadata_gc_passes", "Garbage collection passes run")
        servers = GaugeMetricFamily("stripefs_metadata_storage_servers", "Storage servers known, by state",
                                    labels=["state"])
        leader = GaugeMetricFamily("stripefs_metadata_leader", "1 when this service leads (shared store)")
        counts: dict[str, int] = {}
        n_leases = n_holders = n_syncs = n_gc = 0
        leading = 0
        for service in list(_SERVICES):
            table = service.lease_table
            n_leases += len(table)
            n_holders += len(getattr(table, "_holders", ()))
            n_syncs += service.commit.log_syncs
            n_gc += getattr(service.collector, "_passes", 0)
            lead = getattr(service, "lead", None)
            leading += 1 if getattr(lead, "leading", True) else 0
            try:
                for server in list(service.lead.members.servers.values()):
                    state = str(getattr(server, "state", "unknown"))
                    counts[state] = counts.get(state, 0) + 1
            except Exception:  # noqa: BLE001 -- a membership shape this does not know: no per-state counts
                pass
        leases.add_metric([], n_leases)
        holders.add_metric([], n_holders)
        syncs.add_metric([], n_syncs)
        gc.add_metric([], n_gc)
        leader.add_metric([], leading)
        for state, n in sorted(counts.items()):
            servers.add_metric([state], n)
        yield from (leases, holders, syncs, gc, servers, leader)


def _register() -> None:
    from prometheus_client import REGISTRY

    REGISTRY.register(_MetadataCollector())  # type: ignore[arg-type]


on_enable(_register)
