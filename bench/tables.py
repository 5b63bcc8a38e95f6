"""Markdown tables from a ``stripefs bench --json`` file: one side-by-side table per workload.

    python -m stripefs.bench.tables out.json [--clients N] [--servers M] > tables.md
    python -m stripefs.bench.tables sweep.json --sweep      # seed workloads across client counts

Each table has one row per route (stripefs routes, the local disk, the peers) with the
workload's headline figure, its latency, and the ratios that make runs on noisy machines
comparable: to the best peer of the same run (``× best peer``), to the loopback socket
floor (``× floor_socket``) and to the local disk (``× local_disk``) of the same run.
Records marked invalid (faster than the socket floor: a cache) are shown struck out.

Caveats:
    * Ratios compare records with the same client count; a route run with several server
      counts shows its first.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ._ratios import DEFAULT, HEADLINE, ORDER, PEERS, SKIP, add_peer_ratios, best_peer, headline

SEED_FIRST = ("dataloader", "dataloader_batched", "small_writes", "small_writes_one_dir", "burst_interference")  # the tables open with these

__all__ = ["HEADLINE", "headline", "best_peer", "add_peer_ratios", "markdown_tables", "sweep_table",
           "main"]

def _ratio(a: float, b: float | None) -> str:
    return f"{a / b:.2f}" if b else "-"


def _pick(results: list[dict[str, Any]], clients: int | None,
          servers: int | None) -> dict[str, list[dict[str, Any]]]:
    """Records by workload, one per route (its first server count unless ``servers``)."""
    by: dict[str, dict[str, dict[str, Any]]] = {}
    for r in results:
        if r["workload"] in SKIP or r["path"].startswith("floor_"):
            continue
        if clients is not None and r.get("pool_clients", r["clients"]) != clients:
            continue
        if servers is not None and r["path"] not in PEERS and r["path"] != "local_disk" \
                and r["servers"] != servers:
            continue
        by.setdefault(r["workload"], {}).setdefault(r["path"], r)
    rank = {p: i for i, p in enumerate(ORDER)}
    first = [w for w in SEED_FIRST if w in by] + [w for w in by if w not in SEED_FIRST]
    return {w: sorted(by[w].values(), key=lambda r: rank.get(r["path"], 99)) for w in first}


def _floor(results: list[dict[str, Any]], clients: int) -> float | None:
    fl = [r["gbps"] for r in results if r["path"] == "floor_socket" and r["clients"] == clients]
    return max(fl) if fl else None


def markdown_tables(report: dict[str, Any], clients: int | None = None,
                    servers: int | None = None) -> str:
    """All tables as one markdown string (``clients``: default the run's first count)."""
    results = report["results"]
    if clients is None:
        counts = [r.get("pool_clients", r["clients"]) for r in results
                  if not r["path"].startswith("floor_")]
        clients = counts[0] if counts else 1
    floor = _floor(results, clients)
    h = report.get("header", {})
    out = [f"clients: {clients}; floor_socket: "
           f"{f'{floor:.2f} GB/s' if floor else 'not measured'}; cold reads: "
           f"{h.get('cold_reads', '?')}; command: `{' '.join(h.get('command', []))}`", ""]
    for workload, recs in _pick(results, clients, servers).items():
        title, figure, show = HEADLINE.get(workload, DEFAULT)
        peer = best_peer(recs)
        disk = next((r for r in recs if r["path"] == "local_disk"), None)
        out += [f"#### {workload}" + (f" (best peer: {peer['path']})" if peer else ""), "",
                f"| route | {title} | p50 / p99 ms | × best peer | × floor_socket | × local_disk |",
                "|---|---|---|---|---|---|"]
        for r in recs:
            cell = show(r)
            if "invalid" in r:
                cell = f"~~{cell}~~ (invalid: above floor_socket)"
            lat = (f"{r['latency_p50_ms']:.2f} / {r['latency_p99_ms']:.2f}"
                   if "latency_p50_ms" in r else "-")
            vs_floor = (_ratio(r["gbps"], floor) if r.get("bytes") and workload != "burst_interference"
                        else "-")
            out.append(f"| {r['path']} | {cell} | {lat} | "
                       f"{_ratio(figure(r), figure(peer) if peer else None)} | {vs_floor} | "
                       f"{_ratio(figure(r), figure(disk) if disk else None)} |")
        out.append("")
    skipped = report.get("skipped", [])
    if skipped:
        out.append("Skipped: " + "; ".join(
            f"{s['path']}{' ' + s['workload'] if 'workload' in s else ''} ({s['reason']})"
            for s in skipped))
    return "\n".join(out) + "\n"


def sweep_table(report: dict[str, Any], workloads: tuple[str, ...] = ("dataloader", "small_writes"),
                servers: int | None = None) -> str:
    """Headline figure per route and client count, with the CPU cost per operation."""
    results = report["results"]
    counts = sorted({r.get("pool_clients", r["clients"]) for r in results
                     if r["workload"] in workloads})
    out = []
    for workload in workloads:
        title, figure, show = HEADLINE.get(workload, DEFAULT)
        rows: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}
        for r in results:
            if r["workload"] != workload or (servers is not None and r["servers"] != servers):
                continue
            rows.setdefault((r["path"], r["servers"]), {})[r.get("pool_clients", r["clients"])] = r
        if not rows:
            continue
        out += [f"#### {workload}: {title} by client processes (CPU ms per file)", "",
                "| route | servers | " + " | ".join(f"c={c}" for c in counts) + " |",
                "|---|---|" + "---|" * len(counts)]
        for (path, srv), by_c in sorted(rows.items()):
            cells = []
            for c in counts:
                r = by_c.get(c)
                cells.append("-" if r is None else show(r) + (
                    f" ({r['cpu_ms_per_op']:.2f})" if "cpu_ms_per_op" in r else ""))
            out.append(f"| {path} | {srv} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stripefs.bench.tables", description=__doc__.split("\n")[0])
    ap.add_argument("json", help="a stripefs bench --json file")
    ap.add_argument("--clients", type=int, help="client count to tabulate (default: the first)")
    ap.add_argument("--servers", type=int, help="stripefs server count (default: the first)")
    ap.add_argument("--sweep", action="store_true",
                    help="one table per seed workload across client counts instead")
    a = ap.parse_args(argv)
    with open(a.json) as f:
        report = json.load(f)
    if a.sweep:
        sys.stdout.write(sweep_table(report, servers=a.servers))
    else:
        sys.stdout.write(markdown_tables(report, a.clients, a.servers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
