"""Local clusters on 127.0.0.1: ``stripefs up``/``down``, tests, benchmarks and the demo.

* :mod:`._cluster` -- the metadata service and storage servers as real processes
  (:func:`up`, :func:`down`, :func:`add_server`, :class:`LocalCluster`);
* :mod:`._postgres` -- a private PostgreSQL server for ``--metadata-store postgresql``
  (:class:`LocalPostgres`);
* :mod:`.differential` -- the write-path exerciser: seeded operation sequences applied
  to a local file and to a stripefs route at once, compared byte for byte.
"""

from ._cluster import LocalCluster, add_server, down, mark_removed, read_cluster, up
from ._postgres import LocalPostgres, postgres_bin

__all__ = ["LocalCluster", "up", "down", "add_server", "read_cluster", "mark_removed", "LocalPostgres", "postgres_bin"]
