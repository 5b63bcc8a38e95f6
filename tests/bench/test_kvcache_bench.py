"""``python -m stripefs.bench.kvcache_bench``: Zipf batches against a namespace smaller than
the key space; every hit is checked against the bytes its key was put with."""

from __future__ import annotations

import json

from stripefs.bench import kvcache_bench


def test_a_small_run_evicts_hits_and_reports(cluster, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "kv.json"
    assert kvcache_bench.main(["--cluster", cluster.file, "--page", "64KiB", "--batch", "16", "--keys", "200",
                               "--capacity", "2MiB", "--rounds", "6", "--warmup", "4", "--no-floor",
                               "--json", str(out)]) == 0
    r = json.loads(out.read_text())["kvcache"]
    assert 0 < r["hit_ratio"] < 1  # Zipf repeats keys; a store of 32 pages cannot hold 200
    assert r["evictions"] > 0 and r["checksum_failures"] == 0
    assert r["occupancy_bytes"] <= (2 << 20) + 16 * (64 << 10)  # at most one batch over
    assert r["get_gbps"] > 0 and r["put_gbps"] > 0 and r["get_p99_ms"] >= r["get_p50_ms"] > 0
    assert "hit ratio" in capsys.readouterr().out
