"""Headline figures and the ratios between records of one run (best peer, local disk).

Shared by the runner (which stores ``vs_best_peer`` / ``vs_local_disk`` on every record) and
``bench.tables`` (which prints them).
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["PEERS", "ORDER", "HEADLINE", "DEFAULT", "SKIP", "headline", "best_peer",
           "add_peer_ratios"]

PEERS = ("glusterfs", "moosefs", "s3fs")
ORDER = ("native", "fsspec", "fuse", "zerocopy", "local_disk", *PEERS)


def _gbps(r: dict[str, Any]) -> float:
    return float(r["gbps"])


def _ops(r: dict[str, Any]) -> float:
    return float(r.get("ops_per_s", 0.0))


def _inv_p99_ratio(r: dict[str, Any]) -> float:
    # lower interference is better: invert so that "higher is better" holds for every figure
    return 1.0 / r["p99_ratio"] if r.get("p99_ratio") else 0.0


# workload -> (column title, figure, how to show it); every figure: higher is better
HEADLINE: dict[str, tuple[str, Callable[[dict[str, Any]], float], Callable[[dict[str, Any]], str]]] = {
    "dataloader": ("files/s (GB/s)", _ops, lambda r: f"{_ops(r):,.0f} ({r['gbps']:.3f})"),
    "dataloader_batched": ("files/s (GB/s)", _ops, lambda r: f"{_ops(r):,.0f} ({r['gbps']:.3f})"),
    "small_writes": ("files/s (GB/s)", _ops, lambda r: f"{_ops(r):,.0f} ({r['gbps']:.3f})"),
    "small_writes_one_dir": ("files/s (GB/s)", _ops, lambda r: f"{_ops(r):,.0f} ({r['gbps']:.3f})"),
    "burst_interference": ("p99 during / alone (burst GB/s, × alone)", _inv_p99_ratio,
                           lambda r: f"{r.get('p99_ratio', float('nan')):.2f} "
                                     f"({r.get('burst_gbps', float('nan')):.3f}, "
                                     f"{r.get('burst_ratio', float('nan')):.2f}×)"),
    "rand_read_4k": ("ops/s", _ops, lambda r: f"{_ops(r):,.0f}"),
    "rand_read_4k_cached": ("ops/s", _ops, lambda r: f"{_ops(r):,.0f}"),
    "meta_create": ("ops/s", _ops, lambda r: f"{_ops(r):,.0f}"),
    "meta_stat": ("ops/s", _ops, lambda r: f"{_ops(r):,.0f}"),
    "meta_readdir": ("ops/s", _ops, lambda r: f"{_ops(r):,.1f}"),
    "meta_unlink": ("ops/s", _ops, lambda r: f"{_ops(r):,.0f}"),
    # Batched calls (200 files per request): files/s, not comparable with the per-call figures.
    "meta_create_batch": ("files/s, 200 per call", _ops, lambda r: f"{_ops(r):,.0f}"),
    "meta_stat_batch": ("files/s, 200 per call", _ops, lambda r: f"{_ops(r):,.0f}"),
    "meta_unlink_batch": ("files/s, 200 per call", _ops, lambda r: f"{_ops(r):,.0f}"),
}
DEFAULT = ("GB/s", _gbps, lambda r: f"{r['gbps']:.3f}")
SKIP = {"transfer", "burst_alone", "burst_write", "burst_write_alone"}  # shown inside other tables or as floors


def headline(r: dict[str, Any]) -> float:
    """The record's headline figure (higher is better)."""
    return HEADLINE.get(r["workload"], DEFAULT)[1](r)


def best_peer(recs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The peer record with the best headline figure (valid records only)."""
    peers = [r for r in recs if r["path"] in PEERS and "invalid" not in r]
    return max(peers, key=headline, default=None)


def add_peer_ratios(results: list[dict[str, Any]]) -> None:
    """``vs_best_peer`` and ``vs_local_disk`` on every record (headline figures, same clients)."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in results:
        if not r["path"].startswith("floor_"):
            groups.setdefault((r["workload"], r.get("pool_clients", r["clients"])), []).append(r)
    for recs in groups.values():
        peers = [headline(r) for r in recs if r["path"] in PEERS and "invalid" not in r]
        disk = [headline(r) for r in recs if r["path"] == "local_disk"]
        for r in recs:
            if peers and max(peers) > 0:
                r["vs_best_peer"] = headline(r) / max(peers)
            if disk and disk[0] > 0:
                r["vs_local_disk"] = headline(r) / disk[0]


