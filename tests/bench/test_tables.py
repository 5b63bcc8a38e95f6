"""Markdown tables from a report: one per workload, ratios to the best peer and the floors."""

from __future__ import annotations

from typing import Any

from stripefs.bench._validity import check_validity
from stripefs.bench.tables import add_peer_ratios, markdown_tables, sweep_table


def rec(path: str, workload: str, gbps: float, ops_per_s: float = 0.0, clients: int = 2,
        **extra: Any) -> dict[str, Any]:
    return {"workload": workload, "path": path, "clients": clients, "servers": 4,
            "bytes": int(gbps * 1e9), "seconds": 1.0, "gbps": gbps, "ops_per_s": ops_per_s,
            "pool_clients": clients, **extra}


def report() -> dict[str, Any]:
    results = [rec("floor_socket", "transfer", 2.0),
               rec("native", "dataloader", 0.2, 1200.0, latency_p50_ms=1.0, latency_p99_ms=4.0),
               rec("moosefs", "dataloader", 0.1, 600.0),
               rec("glusterfs", "dataloader", 0.05, 300.0),
               rec("local_disk", "dataloader", 0.4, 2400.0),
               rec("native", "seq_read", 1.0), rec("fuse", "seq_read", 3.0),
               rec("moosefs", "seq_read", 0.5)]
    check_validity(results)
    add_peer_ratios(results)
    return {"header": {"cold_reads": "drop_caches", "command": ["stripefs", "bench"]},
            "results": results, "skipped": [{"path": "s3fs", "reason": "moto missing"}]}


def test_one_table_per_workload_with_ratios() -> None:
    rep = report()
    text = markdown_tables(rep)
    assert text.count("#### ") == 2
    assert "#### dataloader (best peer: moosefs)" in text
    row = next(ln for ln in text.splitlines() if ln.startswith("| native | 1,200"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3] == "2.00"    # 1200 / 600 files/s, the best peer
    assert cells[4] == "0.10"    # 0.2 / 2.0 GB/s, the socket floor
    assert cells[5] == "0.50"    # 1200 / 2400 files/s, the local disk
    assert cells[2] == "1.00 / 4.00"
    assert "floor_socket: 2.00 GB/s" in text and "moto missing" in text
    [native] = [r for r in rep["results"] if r["path"] == "native" and r["workload"] == "dataloader"]
    assert native["vs_best_peer"] == 2.0 and native["vs_local_disk"] == 0.5


def test_invalid_records_are_struck_out() -> None:
    text = markdown_tables(report())
    fuse = next(ln for ln in text.splitlines() if ln.startswith("| fuse |"))
    assert "~~3.000~~" in fuse and "invalid" in fuse


def test_sweep_table_has_a_column_per_client_count() -> None:
    results = [rec("native", "dataloader", 0.1 * c, 500.0 * c, clients=c, cpu_ms_per_op=1.5)
               for c in (1, 2, 4)]
    text = sweep_table({"results": results})
    assert "| route | servers | c=1 | c=2 | c=4 |" in text
    assert "| native | 4 | 500 (0.100) (1.50) | 1,000 (0.200) (1.50) | 2,000 (0.400) (1.50) |" in text
