"""Local clusters on 127.0.0.1: ``stripefs up``/``down``, tests, benchmarks and the demo.

* :mod:`._cluster` -- the metadata service and storage servers as real processes
  (:func:`up`, :func:`down`, :func:`add_server`, :class:`LocalCluster`);
* :mod:`._postgres` -- a private PostgreSQL server for ``--metadata-store postgresql``
  (:class:`LocalPostgres`);
* :mod:`.differential` -- the write-path exerciser: seeded operation sequences applied
  to a local file and to a stripefs route at once, compared byte for byte;
* :mod:`.faults` and :mod:`.history` -- seeded fault schedules (kill -9, pauses,
  restarts, add-server) against writer and reader processes that record every
  operation, and the checker that judges that history (``bench.fault_soak``);
* :mod:`.netbed` and :mod:`.netfaults` -- many hosts on one machine (a network namespace
  each, on one bridge) with link faults (partitions, one-way drops, a pulled cable, a slow
  link), a cluster's roles started on them with the deploy commands, and seeded link-fault
  schedules judged by the same checker (``bench.net_soak``; docs/deploy.md).
"""

from ._cluster import LocalCluster, add_server, down, mark_removed, read_cluster, up
from ._postgres import LocalPostgres, postgres_bin

__all__ = ["LocalCluster", "up", "down", "add_server", "read_cluster", "mark_removed", "LocalPostgres", "postgres_bin"]
