"""The KV-cache page store under an inference-like load: ``python -m stripefs.bench.kvcache_bench``.

One run starts a local cluster (or uses ``--cluster``), then plays rounds against one
:class:`~stripefs.kvcache.PageStore` namespace smaller than the key space, so evictions
happen: each round draws a batch of keys from a Zipf distribution, gets them
(``batch_get_into``, straight into one reused buffer), and puts the ones that missed
(``batch_put``), as a serving engine admits what it had to recompute. It reports the hit
ratio, GB/s of the gets' hits and of the puts, p50/p99 per batch, and the same against
the loopback socket floor measured in the same run (these machines swing 2x between
runs: ratios matter). Every hit is checked against the bytes its key was put with.

    python -m stripefs.bench.kvcache_bench --page 1MiB --batch 64 --keys 2000 --capacity 512MiB --json out.json

Caveats:
    * Pages go into a reused CPU buffer (pinned or CUDA buffers are not used here).
    * The first rounds are cold (few hits); ``--warmup`` rounds are played before the
      measured ones.
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import sys
import tempfile
import time
from typing import Any

import numpy as np

from stripefs.bench._report import write_json
from stripefs.bench.floors import floor_socket, parse_size
from stripefs.fsclient import testing
from stripefs.kvcache import PageStore

__all__ = ["run", "main"]


def _page(key: int, size: int) -> bytes:
    """The bytes key ``key`` is always put with (a hit is checked against them)."""
    seed = hashlib.blake2b(key.to_bytes(8, "little"), digest_size=8).digest()
    return np.random.default_rng(int.from_bytes(seed, "little")).bytes(size)


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3 if values else 0.0


def run(cluster: str, *, page: int, batch: int, keys: int, capacity: int, rounds: int, warmup: int,
        zipf: float, seed: int = 1) -> dict[str, Any]:
    """Play ``warmup + rounds`` rounds; the measured rounds' figures."""
    rng = np.random.default_rng(seed)
    buf = mmap.mmap(-1, page * batch)
    views = [memoryview(buf)[i * page:(i + 1) * page] for i in range(batch)]
    namespace = f"bench-{int(time.time() * 1e3)}"
    gets: list[float] = []
    puts: list[float] = []
    hits = asked = put_pages = 0
    with PageStore(cluster, namespace, page, capacity, grace=5.0, read_timeout=2.0) as store:
        for r in range(warmup + rounds):
            drawn = np.unique((rng.zipf(zipf, batch * 2) - 1) % keys)[:batch]
            names = [int(k).to_bytes(8, "little") for k in drawn]
            t = time.perf_counter()
            hit = store.batch_get_into(names, views[:len(names)])
            t_get = time.perf_counter() - t
            for k, h, v in zip(drawn, hit, views):
                if h and bytes(v) != _page(int(k), page):
                    raise RuntimeError(f"key {int(k)}: a hit returned other bytes than were put")
            missed = [(int(k), n) for k, n, h in zip(drawn, names, hit) if not h]
            t_put = 0.0
            if missed:
                pages = [_page(k, page) for k, _ in missed]
                t = time.perf_counter()
                store.batch_put([n for _, n in missed], pages)
                t_put = time.perf_counter() - t
            if r >= warmup:
                gets.append(t_get)
                asked += len(names)
                hits += sum(hit)
                if missed:
                    puts.append(t_put)
                    put_pages += len(missed)
        stats = store.stats()
    got_s, put_s = sum(gets), sum(puts)
    return {
        "page": page, "batch": batch, "keys": keys, "capacity": capacity, "zipf": zipf, "rounds": rounds,
        "hit_ratio": hits / asked if asked else 0.0,
        "get_gbps": hits * page / got_s / 1e9 if got_s else 0.0,
        "put_gbps": put_pages * page / put_s / 1e9 if put_s else 0.0,
        "get_p50_ms": _pct(gets, 50), "get_p99_ms": _pct(gets, 99),
        "put_p50_ms": _pct(puts, 50), "put_p99_ms": _pct(puts, 99),
        "evictions": stats.evictions, "checksum_failures": stats.checksum_failures,
        "occupancy_bytes": stats.occupancy_bytes,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stripefs.bench.kvcache_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--cluster", help="a running cluster's cluster.json (default: start one)")
    p.add_argument("--servers", type=int, default=4)
    p.add_argument("--page", type=parse_size, default=1 << 20, help="page size (default 1MiB)")
    p.add_argument("--batch", type=int, default=64, help="keys per batch")
    p.add_argument("--keys", type=int, default=2000, help="the key space")
    p.add_argument("--capacity", type=parse_size, default=512 << 20, help="the namespace's capacity (default 512MiB)")
    p.add_argument("--zipf", type=float, default=1.2, help="Zipf exponent of the key draws (> 1)")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--no-floor", action="store_true", help="skip the socket floor")
    p.add_argument("--json", metavar="FILE")
    a = p.parse_args(argv)
    if a.zipf <= 1 or a.batch < 1 or a.keys < a.batch or a.capacity < a.page * a.batch:
        p.error("need --zipf > 1, --keys >= --batch >= 1 and --capacity of at least one batch")
    with tempfile.TemporaryDirectory(prefix="stripefs-kvbench-") as tmp:
        cluster = testing.LocalCluster.start(tmp, servers=a.servers) if a.cluster is None else None
        try:
            result = run(a.cluster or cluster.file, page=a.page, batch=a.batch, keys=a.keys,  # type: ignore[union-attr]
                         capacity=a.capacity, rounds=a.rounds, warmup=a.warmup, zipf=a.zipf)
        finally:
            if cluster is not None:
                cluster.down()
    floor = None if a.no_floor else floor_socket(256 << 20, streams=a.servers)["gbps"]
    result["floor_socket_gbps"] = floor
    print(f"kvcache: pages of {a.page} B, batches of {a.batch}, {a.keys} keys (Zipf {a.zipf}), "
          f"capacity {a.capacity} B; {a.rounds} rounds after {a.warmup}")
    print(f"  hit ratio {result['hit_ratio']:.2f}, evictions {result['evictions']}, checksum failures "
          f"{result['checksum_failures']}")
    for op in ("get", "put"):
        ratio = f" = {result[op + '_gbps'] / floor:.2f}x floor_socket ({floor:.2f} GB/s)" if floor else ""
        print(f"  {op}: {result[op + '_gbps']:.3f} GB/s{ratio}, per batch p50 {result[op + '_p50_ms']:.1f} ms "
              f"p99 {result[op + '_p99_ms']:.1f} ms")
    if a.json:
        write_json({"kvcache": result}, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
