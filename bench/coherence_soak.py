"""Soak the coherence checker: seeded histories over two native clients and two mounts, for minutes.

    python -m stripefs.bench.coherence_soak --minutes 10
    python -m stripefs.bench.coherence_soak --minutes 2 --first-seed 5000 --seconds 30 --history-dir /tmp/h
    python -m stripefs.bench.coherence_soak --minutes 10 --metadata-store postgresql --metadata-services 3

Starts two private clusters, one with a short lease TTL (1 s) and one with a long one
(30 s), each mounted twice (``attr_timeout`` = ``entry_timeout`` = 0.5 s), and runs
``fsclient.testing.coherence`` histories on them in turn, a new seed each, until the time
is spent; each history is checked as soon as it ends. Prints the operations by kind and
the violations (with seed, op, timestamps, what was seen and allowed); the exit status
is 1 if any. With ``--metadata-store postgresql --metadata-services N`` each cluster has
N services on one private PostgreSQL, and every client spreads its requests over them.
Replay a seed with ``python -m stripefs.fsclient.testing.coherence --seed N``
(the interleaving differs: threads).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

from stripefs.bench._report import write_json
from stripefs.fsclient.testing.coherence import Rig, check, run_history, summary

TTLS = (1.0, 30.0)


def soak(minutes: float, first_seed: int, seconds: float, mounts: int, history_dir: str | None,
         store: str = "sqlite", services: int = 1) -> dict[str, Any]:
    """Run histories round-robin over the TTLs for ``minutes``; returns the totals and violations."""
    totals: dict[str, Any] = {"histories": 0, "operations": 0, "mutations": 0, "by_op": {}, "violations": [],
                              "crashes": [], "by_ttl": {str(t): 0 for t in TTLS}}
    with tempfile.TemporaryDirectory(prefix="stripefs-coherence-soak-") as work:
        rigs = []
        try:
            for ttl in TTLS:
                rigs.append(Rig(os.path.join(work, f"ttl{ttl:g}"), lease_ttl=ttl, mounts=mounts, store=store,
                                services=services))
            deadline = time.monotonic() + minutes * 60
            seed = first_seed
            while time.monotonic() < deadline:
                rig = rigs[seed % len(rigs)]
                h = run_history(rig, seed, min(seconds, max(1.0, deadline - time.monotonic())))
                violations = check(h)
                s = summary(h, violations)
                totals["histories"] += 1
                totals["operations"] += s["operations"]
                totals["mutations"] += s["mutations"]
                totals["by_ttl"][str(TTLS[seed % len(rigs)])] += s["operations"]
                for k, n in s["by_op"].items():
                    totals["by_op"][k] = totals["by_op"].get(k, 0) + n
                totals["violations"] += [f"seed {seed} ttl {TTLS[seed % len(rigs)]:g}: {v}" for v in violations]
                if violations:
                    print(h.context(violations[0]), flush=True)
                totals["crashes"] += [f"seed {seed}: {c}" for c in h.crashes]
                if history_dir:
                    os.makedirs(history_dir, exist_ok=True)
                    with open(os.path.join(history_dir, f"seed-{seed}.jsonl"), "w") as f:
                        f.writelines(r.to_json() + "\n" for r in h.records)
                print(f"seed {seed} ttl {TTLS[seed % len(rigs)]:g}s: {s['operations']} ops, "
                      f"{s['mutations']} mutations, {len(violations)} violations", flush=True)
                seed += 1
        finally:
            for rig in rigs:
                rig.close()
    totals["by_op"] = dict(sorted(totals["by_op"].items()))
    return totals


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stripefs.bench.coherence_soak", description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--seconds", type=float, default=60.0, help="length of one history")
    p.add_argument("--first-seed", type=int, default=1000, help="seeds below 1000 are what make test runs")
    p.add_argument("--no-mounts", action="store_true", help="native clients only (no FUSE here)")
    p.add_argument("--metadata-store", choices=("sqlite", "postgresql"), default="sqlite")
    p.add_argument("--metadata-services", type=int, default=1, help="more than one needs postgresql")
    p.add_argument("--history-dir", help="keep every history here (JSON lines, one file per seed)")
    p.add_argument("--json", help="write the totals here")
    a = p.parse_args(argv)
    totals = soak(a.minutes, a.first_seed, a.seconds, 0 if a.no_mounts else 2, a.history_dir,
                  a.metadata_store, a.metadata_services)
    print(json.dumps({k: v for k, v in totals.items() if k != "violations"}, indent=1))
    for v in totals["violations"][:50]:
        print("VIOLATION", v)
    if a.json:
        write_json(totals, a.json)
    return 1 if totals["violations"] or totals["crashes"] else 0


if __name__ == "__main__":
    sys.exit(main())
