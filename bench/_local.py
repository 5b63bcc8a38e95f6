"""The cluster a hand tool measures: one it is given, or a local one it starts for the run."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator

from stripefs.fsclient import Client
from stripefs.fsclient.testing import LocalCluster


@contextlib.contextmanager
def cluster_and_pids(cluster: str | None, servers: int, prefix: str) -> Iterator[tuple[str, dict[str, int]]]:
    """``(cluster.json path, pids)``: ``cluster`` when given, else a local cluster of ``servers``
    storage servers started now and taken down at the end; ``pids`` names its processes
    (``metadata``, ``storage <id>``), whose CPU a tool reads from ``/proc``."""
    with tempfile.TemporaryDirectory(prefix=prefix) as root:
        started = LocalCluster.start(root, servers=servers) if cluster is None else None
        try:
            path = cluster or os.path.join(root, "cluster.json")
            with Client(path) as c:
                status = c.status()
            pids = {"metadata": int(status.metadata["pid"])}
            pids.update({f"storage {s.server_id}": s.pid for s in status.servers})
            yield path, pids
        finally:
            if started is not None:
                started.down()
