"""Metadata throughput: creates/s and stats/s by store and number of metadata services.

    python -m stripefs.bench.metadata_scale [--seconds 3] [--clients 2,8] [--services 1,2,3] [--json FILE]

One run measures, on local clusters started for it (one storage server: files stay
empty, only metadata moves):

* SQLite, one metadata service (the default store);
* PostgreSQL (a private server, ``--metadata-store postgresql``) with 1, 2, 3 services;

each with 2 and 8 client processes. Every process makes its own directory, then for
``--seconds`` creates empty files (``Create``, one round trip each) and for
``--seconds`` stats them in random order (``Resolve`` by path). Clients spread their
requests over the services (the native client's round robin). The figure is the sum
over processes of operations completed in the window.

Caveats:
    * Everything shares one machine: client processes, metadata services and
      PostgreSQL compete for the same cores, so more services cannot add CPU that is
      not there. The report prints the core count; on 2 cores expect the services
      to win only while a single one is waiting on commits (fsync), not on CPU.
    * A short window on a loaded machine is noisy; read ratios between rows measured
      in the same run rather than absolute numbers.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import shutil
import sys
import tempfile
import time
from typing import Any

from stripefs.bench._report import write_json
from stripefs.bench.floors import machine_facts


def _client(cluster_file: str, index: int, seconds: float, barrier: Any, out: Any) -> None:
    """One client process: creates for ``seconds``, then stats for ``seconds``."""
    from stripefs.fsclient import Client
    from stripefs.wire import messages as m

    with Client(cluster_file) as fs:
        d = f"/bench-{os.getpid()}-{index}"
        parent = fs.mkdir(d).ino
        barrier.wait()
        names: list[str] = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            name = f"f{len(names)}"
            fs.call(m.Create(parent=parent, name=name, mode=0o100644, exclusive=True))
            names.append(name)
        barrier.wait()
        stats, rng, end = 0, random.Random(index), time.monotonic() + seconds
        while time.monotonic() < end:
            fs.stat(f"{d}/{rng.choice(names)}")
            stats += 1
        out.put((len(names), stats))


def measure(store: str, services: int, clients: int, seconds: float) -> dict[str, Any]:
    """Start a cluster, run ``clients`` processes against it, stop it; one result row."""
    from stripefs.fsclient.testing import LocalCluster, LocalPostgres, down

    root = tempfile.mkdtemp(prefix="stripefs-mdscale-")
    try:
        cluster = LocalCluster.start(root, servers=1, metadata_store=store, metadata_services=services)
        ctx = mp.get_context("spawn")  # clean processes: no inherited client threads
        barrier, out = ctx.Barrier(clients), ctx.Queue()
        procs = [ctx.Process(target=_client, args=(cluster.file, i, seconds, barrier, out)) for i in range(clients)]
        for p in procs:
            p.start()
        results = [out.get(timeout=seconds * 2 + 120) for _ in procs]
        for p in procs:
            p.join(30)
    finally:
        if os.path.exists(os.path.join(root, "cluster.json")):
            down(root)
        LocalPostgres(root).destroy()  # its data directory may live outside root (as root: /var/tmp)
        shutil.rmtree(root, ignore_errors=True)
    creates, stats = sum(r[0] for r in results), sum(r[1] for r in results)
    return {"store": store, "services": services, "clients": clients, "seconds": seconds,
            "creates": creates, "stats": stats, "creates_per_s": creates / seconds, "stats_per_s": stats / seconds}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stripefs.bench.metadata_scale", description=(__doc__ or "").split("\n")[0])
    p.add_argument("--seconds", type=float, default=3.0, help="length of each timed window")
    p.add_argument("--clients", default="2,8", help="client process counts, comma-separated")
    p.add_argument("--services", default="1,2,3", help="PostgreSQL metadata service counts, comma-separated")
    p.add_argument("--json", help="write the results here as JSON")
    args = p.parse_args(argv)
    clients = [int(c) for c in args.clients.split(",")]
    configs = [("sqlite", 1)] + [("postgresql", int(n)) for n in args.services.split(",")]
    facts = machine_facts()
    print(f"# {facts.get('cpu')}, {os.cpu_count()} cores; {args.seconds:.0f} s windows", file=sys.stderr)
    rows = []
    print(f"{'store':<11} {'services':>8} {'clients':>7} {'creates/s':>10} {'stats/s':>10}")
    for store, services in configs:
        for n in clients:
            row = measure(store, services, n, args.seconds)
            rows.append(row)
            print(f"{store:<11} {services:>8} {n:>7} {row['creates_per_s']:>10.0f} {row['stats_per_s']:>10.0f}", flush=True)
    if args.json:
        write_json({"machine": facts, "results": rows}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
