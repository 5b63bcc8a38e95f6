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
over processes of operations completed in the window. With each window goes the CPU
time spent in it per operation, by who spent it: the metadata services, the PostgreSQL
server's processes (its backends, WAL writer, ...), the client processes
(``/proc/PID/stat``; on a shared machine, what other work costs shows up in the rates,
not in these).

``--per-op`` instead measures one operation at a time in this process, on a store of
each kind: a PostgreSQL store (a private server) as a metadata service's writer runs it
(each operation in a batch of its own, its result recorded for retries, its keys
published) and a SQLite store; per create, stat, rename and unlink: the statements sent,
the waits for the database (round trips), wall time, and the CPU time of this process
and of the PostgreSQL backends.

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


_TICK = os.sysconf("SC_CLK_TCK")


def _cpu(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def _postgres_pids(root: str) -> list[int]:
    """The private PostgreSQL server's processes (its postmaster and every child of it)."""
    import json

    try:
        with open(os.path.join(root, "postgres.json")) as f:
            data = json.load(f)["data"]
        with open(os.path.join(data, "postmaster.pid")) as f:
            master = int(f.readline())
    except (OSError, ValueError, KeyError):
        return []
    pids = [master]
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == master:
                        pids.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return pids


class _CpuClock:
    """CPU seconds used so far by the cluster's groups of processes."""

    def __init__(self, root: str, clients: list[int]) -> None:
        import json

        with open(os.path.join(root, "cluster.json")) as f:
            cluster = json.load(f)
        services = cluster.get("metadata_services") or [cluster.get("metadata", {})]
        self.root = root
        self.groups = {"metadata": [s["pid"] for s in services if "pid" in s], "clients": clients}

    def read(self) -> dict[str, float]:
        # PostgreSQL starts a backend per connection: look them up at every reading (a
        # backend that ended between two readings is missed; the services keep theirs).
        out = {name: sum(_cpu(p) for p in pids) for name, pids in self.groups.items()}
        out["postgres"] = sum(_cpu(p) for p in _postgres_pids(self.root))
        return out


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
        barrier, out = ctx.Barrier(clients + 1), ctx.Queue()  # (this process marks the windows)
        procs = [ctx.Process(target=_client, args=(cluster.file, i, seconds, barrier, out)) for i in range(clients)]
        for p in procs:
            p.start()
        clock = _CpuClock(root, [p.pid for p in procs if p.pid is not None])
        barrier.wait(seconds + 120)
        cpu0 = clock.read()
        barrier.wait(seconds * 2 + 120)
        cpu1 = clock.read()
        results = [out.get(timeout=seconds * 2 + 120) for _ in procs]
        cpu2 = clock.read()
        for p in procs:
            p.join(30)
    finally:
        if os.path.exists(os.path.join(root, "cluster.json")):
            down(root)
        LocalPostgres(root).destroy()  # its data directory may live outside root (as root: /var/tmp)
        shutil.rmtree(root, ignore_errors=True)
    creates, stats = sum(r[0] for r in results), sum(r[1] for r in results)
    return {"store": store, "services": services, "clients": clients, "seconds": seconds,
            "creates": creates, "stats": stats, "creates_per_s": creates / seconds, "stats_per_s": stats / seconds,
            # CPU microseconds per operation, by group, in each window
            "create_cpu_us": {k: (cpu1[k] - cpu0[k]) / max(1, creates) * 1e6 for k in cpu0},
            "stat_cpu_us": {k: (cpu2[k] - cpu1[k]) / max(1, stats) * 1e6 for k in cpu0}}


def _count_round_trips() -> dict[str, int]:
    """From now on, count in this process the statements psycopg sends and the waits for
    their answers (pipelined: a fetch with answers outstanding; else every statement)."""
    import psycopg
    from psycopg import _pipeline_base

    counts = {"statements": 0, "waits": 0}
    execute, fetch = psycopg.Cursor.execute, _pipeline_base.BasePipeline._fetch_gen

    def counting_execute(self: Any, *args: Any, **kwargs: Any) -> Any:
        counts["statements"] += 1
        if self._conn._pipeline is None:  # (not pipelined: every statement waits for its answer)
            counts["waits"] += 1
        return execute(self, *args, **kwargs)

    def counting_fetch(self: Any, *, flush: bool) -> Any:
        if self.result_queue:
            counts["waits"] += 1
        return (yield from fetch(self, flush=flush))

    psycopg.Cursor.execute = counting_execute  # type: ignore[method-assign]
    _pipeline_base.BasePipeline._fetch_gen = counting_fetch  # type: ignore[method-assign]
    return counts


def per_op(n: int) -> list[dict[str, Any]]:
    """Statements, waits, wall and CPU time per create / stat / rename / unlink, ``n`` of
    each, in this process: PostgreSQL as a service's writer runs a request (a batch of its
    own, ``apply_once``, keys published; stats on a reader connection), SQLite as a batch
    of one operation."""
    import functools
    import psycopg

    from stripefs.fsclient.testing import LocalPostgres
    from stripefs.metadata import Namespace
    from stripefs.metadata._pgstore import PostgresStore
    from stripefs.metadata._replay import apply_once
    from stripefs.metadata._sqlite import SqliteStore

    counts = _count_round_trips()
    rows: list[dict[str, Any]] = []
    root = tempfile.mkdtemp(prefix="stripefs-mdperop-")
    pg = LocalPostgres(root)
    try:
        url = pg.start()
        pg.ensure_database()
        for kind in ("postgresql", "sqlite"):
            sqlite_statements: list[str] = []
            if kind == "postgresql":
                store: Any = PostgresStore(url)
                store.publish_keys(lambda number, groups, barrier: ["keys"])  # as services sharing it do
                reader = store.reader()
                backends = [store._conn.info.backend_pid, reader._conn.info.backend_pid]
            else:
                store = SqliteStore(os.path.join(root, "meta.db"))
                store._conn.set_trace_callback(sqlite_statements.append)
                reader, backends = store.reader(), []
                reader._conn.set_trace_callback(sqlite_statements.append)
            ns = Namespace(store)
            rns = ns.reading(reader)
            d = ns.mkdir(1, "d", 0o755, 0, 0).ino
            requests = iter(range(1, 1 << 30))

            def mutate(fn: Any) -> Any:
                with store.batch():
                    if kind == "sqlite":
                        return fn()
                    return apply_once(store, (b"bench-client", next(requests)), fn)

            ops = {
                "create": lambda i: mutate(functools.partial(ns.create, d, f"f{i}", 0o644, 0, 0, chains=[1, 2, 3],
                                                             exclusive=True)),
                "stat": lambda i: rns.resolve(f"/d/f{i}"),
                "rename": lambda i: mutate(functools.partial(ns.rename, d, f"f{i}", d, f"g{i}")),
                "unlink": lambda i: mutate(functools.partial(ns.unlink, d, f"g{i}")),
            }
            for i in range(-64, 0):  # numbers taken in blocks, statements prepared: steady state
                for op in ("create", "rename", "unlink"):
                    ops[op](i)
            for name, op in ops.items():
                counts["statements"] = counts["waits"] = 0
                sqlite_statements.clear()
                cpu0, back0, t0 = time.process_time(), sum(_cpu(p) for p in backends), time.perf_counter()
                for i in range(n):
                    op(i)
                t1, cpu1, back1 = time.perf_counter(), time.process_time(), sum(_cpu(p) for p in backends)
                statements = counts["statements"] if kind == "postgresql" else len(sqlite_statements)
                rows.append({"store": kind, "op": name, "statements": statements / n, "waits": counts["waits"] / n,
                             "wall_us": (t1 - t0) / n * 1e6, "cpu_us": (cpu1 - cpu0) / n * 1e6,
                             "backend_cpu_us": (back1 - back0) / n * 1e6})
            store.close()
    finally:
        pg.destroy()
        shutil.rmtree(root, ignore_errors=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stripefs.bench.metadata_scale", description=(__doc__ or "").split("\n")[0])
    p.add_argument("--seconds", type=float, default=3.0, help="length of each timed window")
    p.add_argument("--clients", default="2,8", help="client process counts, comma-separated")
    p.add_argument("--services", default="1,2,3", help="PostgreSQL metadata service counts, comma-separated")
    p.add_argument("--json", help="write the results here as JSON")
    p.add_argument("--per-op", type=int, metavar="N", nargs="?", const=500,
                   help="instead: statements, waits and CPU per operation, N of each (500)")
    args = p.parse_args(argv)
    if args.per_op:
        rows = per_op(args.per_op)
        print(f"{'store':<11} {'op':<7} {'statements':>10} {'waits':>6} {'wall us':>8} {'CPU us':>7} {'backend CPU us':>14}")
        for r in rows:
            print(f"{r['store']:<11} {r['op']:<7} {r['statements']:>10.1f} {r['waits']:>6.1f} {r['wall_us']:>8.0f} "
                  f"{r['cpu_us']:>7.0f} {r['backend_cpu_us']:>14.0f}")
        if args.json:
            write_json({"machine": machine_facts(), "per_op": rows}, args.json)
        return 0
    clients = [int(c) for c in args.clients.split(",")]
    configs = [("sqlite", 1)] + [("postgresql", int(n)) for n in args.services.split(",")]
    facts = machine_facts()
    print(f"# {facts.get('cpu')}, {os.cpu_count()} cores; {args.seconds:.0f} s windows", file=sys.stderr)
    rows = []
    print(f"{'store':<11} {'services':>8} {'clients':>7} {'creates/s':>10} {'stats/s':>10}   "
          "CPU us per create: metadata postgres clients")
    for store, services in configs:
        for n in clients:
            row = measure(store, services, n, args.seconds)
            rows.append(row)
            cpu = row["create_cpu_us"]
            print(f"{store:<11} {services:>8} {n:>7} {row['creates_per_s']:>10.0f} {row['stats_per_s']:>10.0f}   "
                  f"{cpu['metadata']:>25.0f} {cpu['postgres']:>8.0f} {cpu['clients']:>7.0f}", flush=True)
    if args.json:
        write_json({"machine": facts, "results": rows}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
