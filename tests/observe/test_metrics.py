"""Metrics endpoints, ``stripefs top`` and ``stripefs profile`` on a live cluster (real processes).

Each test runs a real workload and checks that the counts moved as the workload says;
no timing is asserted.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from stripefs import cli
from stripefs._cli_profile import summarize
from stripefs._cli_top import Scrape, endpoints, scrape
from stripefs.fsclient.core._observe import shared_log

from ..conftest import flip_chunk_byte

N = 24  # files written, then read
SIZE = 3000  # bytes each: one chunk per file


def _scrape_all(found: list[Any]) -> dict[str, Scrape]:
    out = {e.name: scrape(e) for e in found}
    for s in out.values():
        assert not s.error, f"{s.endpoint.name}: {s.error}"
    return out


def _delta(before: dict[str, Scrape], after: dict[str, Scrape], role: str, name: str, **match: str) -> float:
    return sum(after[k].total(name, **match) - before[k].total(name, **match)
               for k in after if after[k].endpoint.role == role)


def test_counts_follow_the_workload_and_top_and_profile_show_it(metered: Any, tmp_path: Any,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    found = endpoints(metered.file)
    assert sorted(e.role for e in found) == ["metadata", "storage", "storage"]
    before = _scrape_all(found)
    log_path = str(tmp_path / "access.log")
    payload = os.urandom(SIZE)
    with metered.client(access_log=log_path) as c:
        c.makedirs("/w/hot")
        for i in range(N):
            c.write_bytes(f"/w/hot/f{i}", payload)
        for i in range(N):
            assert c.read_bytes(f"/w/hot/f{i}") == payload
    after = _scrape_all(found)

    # N files of one chunk: N chunk writes and N chunk reads, over the two servers together.
    assert _delta(before, after, "storage", "stripefs_rpc_requests_total", msg="WriteChunk") >= N
    assert _delta(before, after, "storage", "stripefs_rpc_requests_total", msg="ReadChunk") >= N
    assert _delta(before, after, "storage", "stripefs_rpc_received_bytes_total", msg="WriteChunk") >= N * SIZE
    assert _delta(before, after, "storage", "stripefs_rpc_sent_bytes_total", msg="ReadChunk") >= N * SIZE
    assert _delta(before, after, "storage", "stripefs_rpc_request_seconds_count", msg="ReadChunk") >= N
    assert _delta(before, after, "storage", "stripefs_storage_fsync_seconds_count", kind="data") >= 1  # --data-sync full
    assert sum(s.total("stripefs_storage_chunks") for s in after.values() if s.endpoint.role == "storage") >= N
    # Every file was created on the metadata service: at least N requests there.
    assert _delta(before, after, "metadata", "stripefs_rpc_requests_total") >= N
    assert _delta(before, after, "storage", "stripefs_rpc_errors_total") == 0

    assert cli.main(["top", "--once", "--interval", "0.1", "--cluster", metered.file]) == 0
    frame = capsys.readouterr().out
    for e in found:
        assert e.name in frame
    assert "unreachable" not in frame

    shared_log(log_path).flush()
    summary = summarize(open(log_path))
    by_op = {r["op"]: r for r in summary["by_op"]}
    assert by_op["write_bytes"]["count"] == N and by_op["write_bytes"]["bytes"] == N * SIZE
    assert by_op["read_bytes"]["count"] == N and by_op["read_bytes"]["bytes"] == N * SIZE
    assert summary["hot_dirs"][0] == {"dir": "/w/hot", "ops": 2 * N, "bytes": 2 * N * SIZE}
    assert summary["sizes"]["read"]["<=4K"] == N
    assert cli.main(["profile", log_path]) == 0
    out = capsys.readouterr().out
    assert "read_bytes" in out and "/w/hot" in out


def test_a_checksum_failure_is_counted(metered: Any) -> None:
    """A chunk corrupted on disk: the read fails with EIO, and the server counts it."""
    found = [e for e in endpoints(metered.file) if e.role == "storage"]
    with metered.client() as c:
        c.write_bytes("/bad", b"x" * SIZE)
        ino = c.stat("/bad").ino
        before = _scrape_all(found)
        # A data byte (a chunk file's new mtime makes its server look again; a container
        # log's records are checked at every read).
        assert flip_chunk_byte([s["root"] for s in metered.data["servers"]], ino, 7) == 1
        with pytest.raises(OSError):
            c.read_bytes("/bad")
    after = _scrape_all(found)
    assert _delta(before, after, "storage", "stripefs_storage_checksum_failures_total", where="read") >= 1
    assert _delta(before, after, "storage", "stripefs_rpc_errors_total", code="CHECKSUM") >= 1


_CLIENT = """
import json, sys, time, urllib.request
from stripefs.rpc._metrics import serve_metrics
from stripefs.fsclient import Client
from prometheus_client.parser import text_string_to_metric_families
host, port = serve_metrics("127.0.0.1:0", role="client")
with Client(sys.argv[1]) as c:
    c.write_bytes("/cached", b"x")
    for _ in range(300):  # leased, and so cached, once the client's lease watch is live
        c.stat("/cached")
        time.sleep(0.01)
text = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10).read().decode()
got = {s.labels.get("result", s.labels.get("op", "")) + ":" + s.name: s.value
       for f in text_string_to_metric_families(text) for s in f.samples}
print(json.dumps(got))
"""


def test_a_client_counts_its_attribute_cache_lookups(metered: Any) -> None:
    """A process serving metrics (one of its own: counting is per process) counts its
    clients' attribute cache lookups: a file stat'ed 300 times is found cached (leased)
    most of the time, and its first stat missed."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _CLIENT, metered.file], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    hits, misses = got["hit:stripefs_client_attr_cache_lookups_total"], got["miss:stripefs_client_attr_cache_lookups_total"]
    assert misses >= 1 and hits >= 150 and hits + misses >= 300
