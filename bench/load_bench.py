"""Bounded load: many client processes writing at once to ONE storage server with a small
payload budget.

    python -m stripefs.bench.load_bench [--clients 64] [--size-mb 4] [--budget-mb 8] [--busy-after 0.2] [--json FILE]

Each client process opens its own ``fsclient.Client`` and writes one file of
``--size-mb``; the storage server holds at most ``--budget-mb`` of write payloads
at once and answers BUSY to writes that would wait longer than ``--busy-after``
for it (the clients back off with jitter and send them again). Reports, as JSON:
whether the server survived, how many clients finished and how long they took,
the server's peak memory growth over its steady state (VmHWM), how many writes
were answered BUSY, and whether every acknowledged file reads back exactly.
Exit status 1 when any of those fails.

Caveats:
    * The memory figure is the server's peak RSS growth: payload buffers (bounded by
      the budget) plus per-connection state (two connections per client) and
      the worker threads' stacks.
    * On 2 shared cores 64 clients x 4 MiB take about a minute; most of it is
      starting the client processes and the disk's fsyncs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import shutil
import sys
import tempfile
import time
from typing import Any

# The storage servers a cluster starts read their load bounds from the environment.
from stripefs.storage.__main__ import BUDGET_ENV, BUSY_AFTER_ENV


def pattern(i: int, n: int) -> bytes:
    """Client ``i``'s bytes: distinct per client, so a misplaced piece shows."""
    return ((i.to_bytes(2, "little") + b"stripefs-bounded-load") * (n // 23 + 1))[:n]


def _writer(cluster_file: str, i: int, n: int, q: Any, go: Any) -> None:
    from stripefs import fsclient

    data = pattern(i, n)
    try:
        with fsclient.Client(cluster_file) as c:
            # Connected to the metadata service and the storage server before the start
            # signal (a connection's handshake takes milliseconds of a shared core), so
            # the writes arrive together instead of spread over the clients' starts.
            c.write_bytes(f"/load/ready{i}", b"r")
            q.put((i, "ready", 0.0))
            go.wait(60)
            t0 = time.monotonic()
            c.write_bytes(f"/load/w{i}", data)
        q.put((i, "ok", time.monotonic() - t0))  # acknowledged: the close committed the length
    except Exception as exc:  # noqa: BLE001 - reported, so the caller shows what a client saw
        q.put((i, repr(exc), 0.0))


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has died
    except OSError:
        return False


def run(root: str, *, clients: int = 64, size: int = 4 << 20, budget: int = 8 << 20, busy_after: float = 0.2,
        chunk_size: int = 1 << 20, timeout: float = 120.0) -> dict[str, Any]:
    """Start a one-server cluster under ``root``, flood it, check it; returns the figures.

    The cluster is stopped before returning. ``ok`` is true when the server is alive,
    every client finished in ``timeout`` seconds, and every file reads back exactly.
    """
    from stripefs.fsclient.testing import LocalCluster

    saved = {k: os.environ.get(k) for k in (BUDGET_ENV, BUSY_AFTER_ENV)}
    os.environ[BUDGET_ENV], os.environ[BUSY_AFTER_ENV] = str(budget), str(busy_after)
    try:
        cluster = LocalCluster.start(root, servers=1, chunk_size=chunk_size)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        pid = cluster.data["servers"][0]["pid"]
        with cluster.client() as c:
            c.makedirs("/load")
            c.write_bytes("/load/warm", b"x" * size)  # the server's steady state before the flood
        base_hwm, base_rss = _status_kib(pid, "VmHWM"), _status_kib(pid, "VmRSS")
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["stripefs.fsclient"])  # children forked ready, not one import each
        q, go = ctx.Queue(), ctx.Event()
        procs = [ctx.Process(target=_writer, args=(cluster.file, i, size, q, go)) for i in range(clients)]
        for p in procs:
            p.start()
        results: dict[int, tuple[str, float]] = {}
        ready = 0
        deadline = time.monotonic() + timeout
        t0 = 0.0
        while len(results) < clients and time.monotonic() < deadline:
            try:
                i, outcome, took = q.get(timeout=max(0.1, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - queue.Empty: the deadline passed
                break
            if outcome != "ready":
                results[i] = (outcome, took)
            elif (ready := ready + 1) == clients - sum(1 for o, _ in results.values() if o != "ok"):
                t0 = time.monotonic()
                deadline = t0 + timeout  # the clients' time counts from the start signal
                go.set()
        go.set()
        elapsed = time.monotonic() - t0 if t0 else -1.0
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5)
        alive = _alive(pid)
        growth_kib = _status_kib(pid, "VmHWM") - base_hwm if alive else -1
        rss_kib = _status_kib(pid, "VmRSS") - base_rss if alive else -1
        acked = sorted(i for i, (outcome, _) in results.items() if outcome == "ok")
        corrupt: list[int] = []
        with cluster.client() as c:
            for i in acked:
                if c.read_bytes(f"/load/w{i}") != pattern(i, size):
                    corrupt.append(i)
        log_path = os.path.join(cluster.root, "logs", "storage-0.log")
        with open(log_path, errors="replace") as f:
            counts = [int(n) for n in re.findall(r"(\d+) requests answered BUSY so far", f.read())]
        failures = {i: outcome for i, (outcome, _) in results.items() if outcome != "ok"}
        took = sorted(t for _, t in results.values())
        return {
            "clients": clients, "size": size, "budget": budget, "busy_after": busy_after,
            "server_alive": alive, "finished": len(results), "acknowledged": len(acked),
            "failures": {str(i): f for i, f in sorted(failures.items())[:10]},
            "corrupt": corrupt, "elapsed_s": round(elapsed, 2),
            "client_s_p50": round(took[len(took) // 2], 2) if took else None,
            "client_s_max": round(took[-1], 2) if took else None,
            "server_peak_growth_mib": round(growth_kib / 1024, 1), "server_rss_growth_mib": round(rss_kib / 1024, 1),
            # The server logs a running count at most every 10 s: a lower bound.
            "busy_answers_logged": max(counts, default=0),
            "ok": alive and len(acked) == clients and not corrupt,
        }
    finally:
        cluster.down()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stripefs.bench.load_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=64, help="client processes")
    p.add_argument("--size-mb", type=float, default=4, help="MiB each client writes")
    p.add_argument("--budget-mb", type=float, default=8, help="the storage server's payload budget, MiB")
    p.add_argument("--busy-after", type=float, default=0.2, help="seconds a write waits for the budget before BUSY")
    p.add_argument("--chunk-mb", type=float, default=1, help="chunk size, MiB")
    p.add_argument("--timeout", type=float, default=120, help="seconds the clients have to finish")
    p.add_argument("--json", default=None, help="also write the result here")
    args = p.parse_args(argv)
    root = tempfile.mkdtemp(prefix="stripefs-load-")
    try:
        out = run(root, clients=args.clients, size=int(args.size_mb * (1 << 20)), budget=int(args.budget_mb * (1 << 20)),
                  busy_after=args.busy_after, chunk_size=int(args.chunk_mb * (1 << 20)), timeout=args.timeout)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
