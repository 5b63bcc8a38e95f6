"""The page store through a storage server's ``kill -9`` and return, with two copies of
every chunk: batches of puts and gets go on throughout, every hit is checked byte for
byte against the page its key was put with (0 garbled), and every batch a put
acknowledged is all there once the server is back (nothing acknowledged lost). Puts that
raised while the chain was being repaired are allowed, and counted: their pages are then
whole or absent, never half.

Longer, with more kills: ``python -m stripefs.bench.kvcache_soak --minutes 10``."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from stripefs.fsclient.testing import LocalCluster
from stripefs.bench.kvcache_soak import soak

PS = 64 * 1024


def test_a_storage_server_killed_during_puts_and_gets_garbles_and_loses_nothing(
        make_cluster: Callable[..., LocalCluster], ns: str, tmp_path: Path) -> None:
    cluster = make_cluster(servers=3, replicas=2)
    report = soak(cluster, ns, seconds=14.0, page=PS, batch=16, kills=[(3.0, 0, 4.0)], seed=1)
    assert report.garbled == 0, report
    assert report.lost == [], report
    assert report.half == [], report
    assert report.puts_acked >= 10 and report.gets >= 10, report  # the run did its work
    assert report.killed == 1 and report.restarted == 1, report
