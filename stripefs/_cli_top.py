"""``stripefs top``: a live view of a cluster from its processes' metrics endpoints.

Where the endpoints are (:func:`endpoints`): each metadata service writes
``ROOT/meta/metrics-<rpc port>.json``, each storage server ``<its root>/metrics.json``,
each FUSE daemon the ``metrics`` field of its mount record; ``stripefs up --metrics-base``
also records them in cluster.json. ``top`` scrapes them all every ``--interval`` seconds
and shows rates from the difference of two scrapes: requests/s, MB/s in and out, p99
latency (from the histogram buckets' difference), requests in flight and write payload
queued; the servers' disk usage; the background work (resync progress, scrub, garbage
collection). ``--once`` prints one frame (two scrapes ``--interval`` apart) and exits.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from ._units import human as _human

__all__ = ["add_parsers", "endpoints", "scrape", "Sample"]

SCRAPE_TIMEOUT = 2.0
BACKGROUND_MSGS = {"Scrub": "scrub", "RemoveChunks": "gc", "ListChain": "resync", "CopyChunk": "resync"}


@dataclass
class Endpoint:
    name: str  # "metadata 127.0.0.1:4000", "storage 2", "fuse /mnt/x"
    role: str
    address: str


Sample = dict[tuple[str, frozenset[tuple[str, str]]], float]


@dataclass
class Scrape:
    endpoint: Endpoint
    at: float
    samples: Sample = field(default_factory=dict)
    error: str = ""

    def total(self, name: str, **match: str) -> float:
        want = set(match.items())
        return sum(v for (n, labels), v in self.samples.items() if n == name and want <= labels)

    def by(self, name: str, label: str, **match: str) -> dict[str, float]:
        want, out = set(match.items()), {}
        for (n, labels), v in self.samples.items():
            if n == name and want <= labels:
                key = dict(labels).get(label, "")
                out[key] = out.get(key, 0.0) + v
        return out


def _read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def endpoints(cluster_file: str) -> list[Endpoint]:
    """The metrics endpoints of the cluster whose cluster.json is ``cluster_file``: its
    metadata services and storage servers (local state), and the FUSE mounts of it."""
    from stripefs.fsclient.core import pid_alive

    data = _read_json(cluster_file) or {}
    root = data.get("root") or os.path.dirname(os.path.abspath(cluster_file))
    found: list[Endpoint] = []
    services = data.get("metadata_services") or ([data["metadata"]] if data.get("metadata") else [])
    for s in services:
        rec = _read_json(os.path.join(root, "meta", f"metrics-{s.get('port')}.json"))
        address = (rec or {}).get("address") or s.get("metrics")
        if address and (rec is None or pid_alive(rec.get("pid", -1))):
            found.append(Endpoint(f"metadata {s.get('host')}:{s.get('port')}", "metadata", address))
    for i, s in enumerate(data.get("servers", [])):
        if not isinstance(s, dict) or s.get("removed"):
            continue
        rec = _read_json(os.path.join(s.get("root", ""), "metrics.json"))
        address = (rec or {}).get("address") or s.get("metrics")
        if address and (rec is None or pid_alive(rec.get("pid", -1))):
            found.append(Endpoint(f"storage {i} {s.get('host')}:{s.get('port')}", "storage", address))
    from stripefs.fsclient.fuse._mounts import record_path

    mine = os.path.realpath(cluster_file)
    for path in sorted(glob.glob(os.path.join(os.path.dirname(record_path("/")), "*.json"))):
        rec = _read_json(path)
        if (rec and rec.get("metrics") and rec.get("cluster_file")
                and os.path.realpath(rec["cluster_file"]) == mine and pid_alive(rec.get("pid", -1))):
            found.append(Endpoint(f"fuse {rec.get('mountpoint')}", "fuse", rec["metrics"]))
    return found


def scrape(endpoint: Endpoint) -> Scrape:
    """One scrape of ``endpoint`` (an unreachable one comes back with ``error`` set)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = Scrape(endpoint, time.monotonic())
    try:
        with urllib.request.urlopen(f"http://{endpoint.address}/metrics", timeout=SCRAPE_TIMEOUT) as r:
            text = r.read().decode()
    except OSError as exc:
        out.error = str(getattr(exc, "reason", exc))
        return out
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.samples[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def _quantile(before: Scrape, after: Scrape, name: str, q: float) -> float | None:
    """The ``q`` quantile of what histogram ``name`` observed between two scrapes (all its
    series summed), as the upper bound of the bucket it falls in; None when nothing was."""
    def buckets(s: Scrape) -> dict[float, float]:
        return {float(le): v for le, v in s.by(f"{name}_bucket", "le").items()}

    b, a = buckets(before), buckets(after)
    edges = sorted(a)
    if not edges:
        return None
    total = a.get(math.inf, 0.0) - b.get(math.inf, 0.0)
    if total <= 0:
        return None
    for le in edges:
        if a[le] - b.get(le, 0.0) >= q * total:
            return le
    return math.inf


def _rate(before: Scrape, after: Scrape, name: str, **match: str) -> float:
    dt = max(after.at - before.at, 1e-6)
    return max(0.0, after.total(name, **match) - before.total(name, **match)) / dt


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if math.isinf(seconds):
        return ">10s"
    return f"{seconds * 1000:.2f}ms" if seconds < 0.01 else f"{seconds * 1000:.0f}ms"


def frame(before: list[Scrape], after: list[Scrape]) -> str:
    """The text of one view from two rounds of scrapes."""
    lines = [f"stripefs top  {time.strftime('%H:%M:%S')}  {len(after)} endpoints"]
    head = f"{'process':<34} {'ops/s':>9} {'MB/s in':>9} {'MB/s out':>9} {'p99':>9} {'inflight':>8} {'queued':>9}"
    lines.append(head)
    background: list[str] = []
    for b, a in zip(before, after):
        name = a.endpoint.name
        if a.error or b.error:
            lines.append(f"{name:<34} unreachable ({a.error or b.error})")
            continue
        if a.endpoint.role == "fuse":
            ops = _rate(b, a, "stripefs_fuse_ops_total")
            rd = _rate(b, a, "stripefs_fuse_bytes_total", op="read") / 1e6
            wr = _rate(b, a, "stripefs_fuse_bytes_total", op="write") / 1e6
            p99 = _quantile(b, a, "stripefs_fuse_op_seconds", 0.99)
            lines.append(f"{name:<34} {ops:>9.0f} {wr:>9.1f} {rd:>9.1f} {_ms(p99):>9} {'-':>8} {'-':>9}")
            continue
        ops = _rate(b, a, "stripefs_rpc_requests_total")
        rin = _rate(b, a, "stripefs_rpc_received_bytes_total") / 1e6
        rout = _rate(b, a, "stripefs_rpc_sent_bytes_total") / 1e6
        p99 = _quantile(b, a, "stripefs_rpc_request_seconds", 0.99)
        inflight = a.total("stripefs_rpc_in_flight")
        queued = a.total("stripefs_rpc_budget_waiting_bytes")
        lines.append(f"{name:<34} {ops:>9.0f} {rin:>9.1f} {rout:>9.1f} {_ms(p99):>9} {inflight:>8.0f} "
                     f"{_human(int(queued)):>9}")
        errors = _rate(b, a, "stripefs_rpc_errors_total")
        extra = []
        if errors:
            extra.append(f"errors {errors:.1f}/s")
        if a.endpoint.role == "storage":
            used, cap = a.total("stripefs_storage_used_bytes"), a.total("stripefs_storage_capacity_bytes")
            fsync = _quantile(b, a, "stripefs_storage_fsync_seconds", 0.99)
            extra.append(f"used {_human(int(used))} of {_human(int(cap))}, {a.total('stripefs_storage_chunks'):.0f} chunks")
            if fsync is not None:
                extra.append(f"fsync p99 {_ms(fsync)} ({_rate(b, a, 'stripefs_storage_fsync_seconds_count'):.0f}/s)")
            bad = a.total("stripefs_storage_checksum_failures_total")
            if bad:
                extra.append(f"checksum failures {bad:.0f}")
            if a.total("stripefs_storage_resync_active"):
                background.append(f"resync   {name}: {a.total('stripefs_storage_resync_done_chunks'):.0f}"
                                  f"/{a.total('stripefs_storage_resync_chunks'):.0f} chunks of the current chain")
        elif a.endpoint.role == "metadata":
            extra.append(f"leases {a.total('stripefs_metadata_leases'):.0f} "
                         f"(+{_rate(b, a, 'stripefs_metadata_lease_grants_total'):.0f}/s, "
                         f"-{_rate(b, a, 'stripefs_metadata_lease_invalidations_total'):.0f}/s)")
            fsync = _quantile(b, a, "stripefs_metadata_log_fsync_seconds", 0.99)
            if fsync is not None:
                extra.append(f"log fsync p99 {_ms(fsync)}")
            extra.append(f"gc passes {a.total('stripefs_metadata_gc_passes_total'):.0f}")
        for msg, kind in BACKGROUND_MSGS.items():
            r = _rate(b, a, "stripefs_rpc_requests_total", msg=msg)
            if r:
                background.append(f"{kind:<8} {name}: {r:.1f} {msg}/s")
        if extra:
            lines.append(f"{'':<4}{'; '.join(extra)}")
    lines.append("background: " + ("none" if not background else ""))
    lines.extend("  " + line for line in background)
    return "\n".join(lines)


def cmd_top(a: argparse.Namespace) -> int:
    from stripefs.fsclient.core import find_cluster

    path = find_cluster(a.cluster).path
    if not path or not os.path.exists(path):
        print("stripefs top: needs a local cluster.json (--cluster)", file=sys.stderr)
        return 1
    found = endpoints(path)
    if not found:
        print(f"stripefs top: no metrics endpoint found for {path}: start the cluster with "
              "`stripefs up --metrics-base PORT` (or servers with --metrics)", file=sys.stderr)
        return 1
    before = [scrape(e) for e in found]
    try:
        while True:
            time.sleep(a.interval)
            after = [scrape(e) for e in found]
            text = frame(before, after)
            if a.once:
                print(text)
                return 0
            sys.stdout.write("\x1b[H\x1b[2J" + text + "\n")
            sys.stdout.flush()
            before = after
    except KeyboardInterrupt:
        return 0


def add_parsers(sub: Any, cluster_help: str) -> None:
    sp = sub.add_parser("top", help="Live view of the cluster from its metrics endpoints",
                        description=__doc__.split("\n\n")[1] if __doc__ else None)
    sp.set_defaults(fn=cmd_top)
    sp.add_argument("--cluster", "-c", help=cluster_help)
    sp.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    sp.add_argument("--once", action="store_true", help="print one frame and exit")
