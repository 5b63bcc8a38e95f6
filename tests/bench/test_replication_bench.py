"""bench.replication_bench as a program, at 8 MiB: well-formed records, exact bytes, verified data.

No timing thresholds (figures come from the benchmark run, not from tests); only that each
phase happened: the failover saw reads on both sides of the kill and a write after it, and
the restarted server had chunks to copy back and became serving.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

MiB = 1 << 20
SIZE, CHUNK = 8 * MiB, 1 * MiB
FIXED = {"workload", "path", "clients", "servers", "replicas", "bytes", "seconds", "gbps"}


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("replbench") / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "stripefs.bench.replication_bench", "--size", "8M", "--chunk-size", "1M",
         "--settle", "0.3", "--json", str(out), "--root", str(out.parent)],
        cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=150,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "seq_write" in proc.stdout and "resync" in proc.stdout  # the table
    return json.loads(out.read_text())


def one(report: dict[str, Any], workload: str, replicas: int = 2) -> dict[str, Any]:
    [r] = [x for x in report["results"] if x["workload"] == workload and x["replicas"] == replicas]
    return r


def test_records_are_well_formed_and_verified(report: dict[str, Any]) -> None:
    assert report["verified"] is True and report["servers"] == 3
    for r in report["results"]:
        assert FIXED <= r.keys() and r["path"] == "native" and r["clients"] == 1
        assert r["seconds"] > 0 and r["gbps"] == pytest.approx(r["bytes"] / r["seconds"] / 1e9)
        assert r["verified"] is True


def test_cost_of_replication_moves_exactly_the_file(report: dict[str, Any]) -> None:
    for replicas in (1, 2, 3):
        for workload in ("seq_write", "seq_read"):
            r = one(report, workload, replicas)
            assert r["bytes"] == SIZE
            assert r["ratio_to_r1"] == pytest.approx(r["gbps"] / one(report, workload, 1)["gbps"])


def test_failover_saw_reads_around_the_kill_and_a_write_after(report: dict[str, Any]) -> None:
    r = one(report, "failover")
    assert r["read_gap_s"] is not None and r["read_gap_s"] > 0
    assert r["write_resume_s"] is not None and r["write_resume_s"] >= r["offline_after_s"] > 0
    assert r["read_errors"] == 0


def test_resync_copied_what_was_missed(report: dict[str, Any]) -> None:
    r = one(report, "resync")
    assert 0 < r["chunks_missed"] and 0 < r["bytes"] <= (SIZE + 3 * CHUNK)
    assert r["bytes"] % CHUNK == 0  # whole chunks: 8 MiB and the probe are chunk-aligned
    assert r["state_after_restart"] in (["syncing"], ["serving"])
    assert one(report, "write_degraded")["bytes"] == SIZE
    for w in ("read_normal", "read_degraded", "read_during_resync"):
        assert one(report, w)["ratio_to_normal"] is not None
